"""FP8 weights for the weight-only kernel tests (tests/kernels/test_fp8.py and
test_fp8_wo_gemv.py): a random [n, k] weight quantized by kernels/ref_fp8 per channel or in
square blocks (scales spread to one per row, [N, G]: Fp8Linear's form), and the relative
error the tests bound."""

from __future__ import annotations

import torch

from kernels import ref_fp8


def fp8_weight(n: int, k: int, groups: int, gen: torch.Generator, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=gen) * k ** -0.5
    if groups == 1:
        q, s = ref_fp8.quantize_weight(w, "channel")
        return q.to(device), s.to(device)
    q, s = ref_fp8.quantize_weight(w, "block", (k // groups, k // groups))
    return q.to(device), s.repeat_interleave(k // groups, 0)[:n].contiguous().to(device)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())
