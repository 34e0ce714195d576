"""Kernels per layer of a DeepSeek decode step (bench/decode_op_count.py: the CUDA kernel
set run by Triton's interpreter, aten operators counted beside the Triton launches). At
batch 1 in a CUDA graph each kernel costs a few microseconds whatever its size, so these
bounds fail a change that adds launches to a layer."""

from __future__ import annotations

import pytest
import torch

# kernels per layer at most: (dense first layer, MoE layer). V2 (V2-Lite's layout: q_proj,
# ungrouped softmax routing, 2 shared experts): norms 2, one GEMM for q and kv_a, the latent
# kernel (its rotated q_pe written into the absorbed query), the W_UK bmm (into the same
# query), MLA decode, the W_UV bmm (in o_proj's row order), o_proj; then the dense MLP 3,
# or the router GEMM, routing 1 and the fused experts' align, gate/up, down and sum, the
# shared experts stacked among them. V3 adds the q LoRA's norm and second GEMM, and routes
# by expert groups in the same routing kernel.
BOUNDS = {("v2", 1): (11, 14), ("v2", 3): (11, 14), ("v3", 1): (13, 16)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts the interpreter's launches")
@pytest.mark.parametrize("version,batch", sorted(BOUNDS))
def test_decode_step_kernels_per_layer(version, batch, tmp_path):
    from bench.decode_op_count import count_decode_step, write_config

    counts = count_decode_step(write_config(str(tmp_path / "config.json"), version),
                               batch=batch)
    dense, moe = BOUNDS[(version, batch)]
    assert counts["layer.0"].total <= dense, counts["layer.0"]
    for layer in ("layer.1", "layer.2"):
        c = counts[layer]
        assert c.total <= moe, (layer, c)
        # the shared experts run inside the fused kernel: no separate MLP, no add
        assert c.triton["_gate_up_kernel"] == 1 and "_silu_and_mul_kernel" not in c.triton
        assert "add" not in c.aten
        assert c.triton["_mla_latent_kernel"] == 1 and "_rope_kernel" not in c.triton
        assert c.triton["_route_kernel"] == 1 and "topk" not in c.aten
        assert "cat" not in c.aten and c.aten["bmm"] == 2
    # the step's ends: the embedding, then the final norm and the head
    assert counts["embed"].total == 1 and counts["head"].total == 2
