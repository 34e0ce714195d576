"""bench/moe_bench.py's shapes (bench/moe_shapes.py) are configs the engine loads (a field
it refused would end a GPU run at its start, after the device's minute of start-up), with
the sizes moe_bench's docstring gives; --layers replaces the layer count, says so in the
label, and is refused where it leaves no MoE layer."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from moe_shapes import SHAPES, shape_config  # noqa: E402

from engine.config import ModelConfig  # noqa: E402

# shape: (layers, hidden, experts, top-k, expert intermediate, kv heads, arch)
EXPECTED = {
    "qwen3": (48, 2048, 128, 8, 768, 4, "qwen3_moe"),
    "v2lite": (27, 2048, 64, 6, 1408, 16, "deepseek_v2"),
    "mixtral": (32, 4096, 8, 2, 14336, 8, "mixtral"),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shape_loads_as_documented(shape):
    label, hf = shape_config(shape)
    m = ModelConfig.from_hf(hf)
    assert m.moe is not None
    got = (m.num_layers, m.hidden_size, m.moe.num_experts, m.moe.top_k,
           m.moe.intermediate_size, m.num_kv_heads, m.arch)
    assert got == EXPECTED[shape]
    assert label == SHAPES[shape][0]


def test_layers_override_and_fp8_block():
    label, hf = shape_config("mixtral", layers=8, quantization="fp8-block")
    m = ModelConfig.from_hf(hf)
    assert m.num_layers == 8 and m.moe is not None and m.moe.layers == tuple(range(8))
    assert label.endswith(", 8 layers")
    assert hf["quantization_config"]["weight_block_size"] == [128, 128]
    assert SHAPES["mixtral"][1]["num_hidden_layers"] == 32  # the shape itself untouched


@pytest.mark.parametrize("shape,layers", [("v2lite", 1), ("mixtral", 0)])
def test_layers_that_leave_no_moe_layer_are_refused(shape, layers):
    # V2-Lite's first layer is dense: one layer would leave the bench nothing to measure
    with pytest.raises(ValueError, match="--layers"):
        shape_config(shape, layers)
    assert shape_config("v2lite", 2)[0].endswith(", 2 layers")
