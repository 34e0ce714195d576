"""GGUF tensor bytes -> float32, with whole-tensor numpy paths for the block formats the
embedded models use (Q4_1, Q8_0) and ``gguf.quants`` for every other type.

Why: ``gguf.quants`` dequantizes in groups of 16 rows with several temporaries per group;
SmolLM2-135M (Q4_1 with a Q8_0 embedding) took 1.36 s of every engine start there, 0.62 s
here, and every worker start loads it. The values are the same floats: each element is
computed with the same float32 operations in the same order (``d * q + m``, ``q * d``);
tests/engine/test_gguf_dequant.py checks bit-equality against ``gguf.quants``.

Block layouts (ggml's ``block_q4_1`` and ``block_q8_0``, 32 weights per block):
  Q4_1: f16 d, f16 m, 16 bytes of nibbles: byte j holds weight j (low) and j + 16 (high)
  Q8_0: f16 d, 32 int8
"""

from __future__ import annotations

import numpy as np

Q4_1, Q8_0 = 3, 8  # ggml type ids (gguf.GGMLQuantizationType)
_BLOCK = 32
_BYTES = {Q4_1: 20, Q8_0: 34}


def dequantize(raw: np.ndarray, qtype: int) -> np.ndarray:
    """``raw``: uint8 ``[*outer, row_bytes]`` -> float32 ``[*outer, row_elements]``, a new
    array (never a view of ``raw``) for the block types handled here."""
    if qtype not in _BYTES:
        import gguf

        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype))
    size = _BYTES[qtype]
    if raw.shape[-1] % size:
        raise ValueError(f"GGUF tensor rows of {raw.shape[-1]} bytes are not whole "
                         f"blocks of {size}")
    shape = (*raw.shape[:-1], raw.shape[-1] // size * _BLOCK)
    blocks = raw.reshape(-1, size)
    # scales as float32 columns [n, 1], broadcast over each block's 32 weights
    scales = np.ascontiguousarray(blocks[:, :4 if qtype == Q4_1 else 2])
    scales = scales.view(np.float16).astype(np.float32)
    if qtype == Q8_0:
        out = blocks[:, 2:].view(np.int8).astype(np.float32)
        out *= scales
        return out.reshape(shape)
    nibbles = blocks[:, 4:]
    out = np.empty((blocks.shape[0], _BLOCK), np.float32)
    np.bitwise_and(nibbles, 0x0F, out=out[:, :16], casting="unsafe")
    np.right_shift(nibbles, 4, out=out[:, 16:], casting="unsafe")
    out *= scales[:, 0:1]
    out += scales[:, 1:2]
    return out.reshape(shape)
