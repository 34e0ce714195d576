"""engine.gguf_dequant against gguf.quants (the reference dequantizer), and the header
cache of engine.gguf_reader.open_gguf."""

from __future__ import annotations

import os

import numpy as np
import pytest

from engine.gguf_dequant import Q4_1, Q8_0, dequantize
from engine.gguf_reader import open_gguf, read_gguf_config
from engine.model_source import resolve_model

# the reference reader; the GPU machine lacks it (the tests here need no GPU: CI runs them)
gguf = pytest.importorskip("gguf")


def _blocks(rng: np.random.Generator, rows: int, blocks_per_row: int, size: int) -> np.ndarray:
    raw = rng.integers(0, 256, (rows, blocks_per_row * size), dtype=np.uint8)
    # finite scales of both signs and many magnitudes (random f16 bits include NaN/inf)
    scales = rng.normal(0, 0.05, (rows, blocks_per_row, 2)).astype(np.float16)
    per_block = raw.reshape(rows, blocks_per_row, size)
    n = 4 if size == 20 else 2
    per_block[:, :, :n] = scales[:, :, : n // 2].view(np.uint8).reshape(rows, blocks_per_row, n)
    return raw


@pytest.mark.parametrize("qtype,size", [(Q4_1, 20), (Q8_0, 34)])
def test_block_types_equal_gguf_bit_for_bit(qtype: int, size: int) -> None:
    rng = np.random.default_rng(qtype)
    for shape in ((1, 1), (7, 3), (64, 18)):
        raw = _blocks(rng, shape[0], shape[1], size)
        ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype))
        ours = dequantize(raw, qtype)
        assert ours.dtype == np.float32 and ours.shape == ref.shape == (shape[0], shape[1] * 32)
        np.testing.assert_array_equal(ours, ref)
        assert not np.shares_memory(ours, raw)
    three_d = _blocks(rng, 6, 2, size).reshape(2, 3, 2 * size)  # outer dims kept
    np.testing.assert_array_equal(dequantize(three_d, qtype), gguf.quants.dequantize(
        three_d, gguf.GGMLQuantizationType(qtype)))


def test_the_embedded_models_tensors_equal_gguf_bit_for_bit() -> None:
    reader = open_gguf(resolve_model(None))
    seen = set()
    for t in reader.tensors:
        raw = reader.raw_tensor(t)
        np.testing.assert_array_equal(
            dequantize(raw, t.qtype),
            gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t.qtype)), err_msg=t.name)
        seen.add(t.qtype)
    assert {Q4_1, Q8_0} <= seen  # the fast paths ran, not only the fallback


def test_other_types_fall_back_to_gguf() -> None:
    raw = np.arange(8, dtype=np.float16).view(np.uint8).reshape(2, 8)
    out = dequantize(raw, int(gguf.GGMLQuantizationType.F16))
    np.testing.assert_array_equal(out, np.arange(8, dtype=np.float32).reshape(2, 4))


def test_a_row_of_partial_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="not whole blocks of 20"):
        dequantize(np.zeros((2, 30), np.uint8), Q4_1)


def test_the_header_is_parsed_once_until_the_file_changes(tmp_path) -> None:
    embedded = resolve_model(None)
    assert open_gguf(embedded) is open_gguf(embedded)
    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    first = open_gguf(path)
    assert first.get("llama.block_count") == 1
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # coarse clocks
    assert open_gguf(path).get("llama.block_count") == 2
    os.remove(path)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        read_gguf_config(path)
