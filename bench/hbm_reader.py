"""The HBM read rate the byte floors divide by: the fastest of the readers here.

A floor is only as honest as its reader. Until session 49 the benches read with torch's
`x.sum` over 4 GiB, which on an H100 reads ~3.3% slower than a plain Triton streaming sum
(3.11-3.12 against 3.21-3.23 TB/s in that session's runs, each printed by hbm_read_tbps;
bench/RESULTS.md): every floor was that much too high and every step/floor ratio that much
too low. Here torch's sum and a small sweep of one
grid-stride Triton kernel (each program streams BLOCK-element tiles, a grid of a few waves)
read the same tensor in CUDA graphs, and the rate is the fastest of them.

Imported only by the GPU benches, inside their functions: its @triton.jit kernel is defined
at import, and a CPU test run must have set TRITON_INTERPRET first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

# (programs per SM, BLOCK, num_warps): the audit's best on an H100 was 32 x 132 programs,
# BLOCK 8192, 8 warps; the rest bracket it
SWEEP = ((8, 8192, 8), (16, 8192, 8), (32, 8192, 8), (32, 4096, 4), (64, 4096, 8),
         (32, 16384, 16))


@triton.jit
def _sum_kernel(x_ptr, part_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        if EVEN:  # every tile whole: no mask on the loads
            acc += tl.load(x_ptr + offs).to(tl.float32)
        else:
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(part_ptr + pid, tl.sum(acc, axis=0))


def triton_sum(x: torch.Tensor, programs: int, block: int, num_warps: int,
               parts: torch.Tensor | None = None) -> torch.Tensor:
    """Per-program partial sums (float32, [programs]) of a contiguous 1-D tensor: every
    element read once, in `programs` programs striding over BLOCK-element tiles."""
    if x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"x: need a contiguous 1-D tensor, got shape {tuple(x.shape)}")
    if parts is None:
        parts = torch.empty(programs, dtype=torch.float32, device=x.device)
    n = x.numel()
    _sum_kernel[(programs,)](x, parts, n, BLOCK=block, EVEN=n % block == 0,
                             num_warps=num_warps)
    return parts


def read_rates(time_ms: Callable[[Callable[[], Any]], float], x: torch.Tensor
               ) -> dict[str, float]:
    """TB/s of each reader over `x`, each timed by `time_ms` (decode_bench.graph_time_ms)."""
    nbytes = x.numel() * x.element_size()
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    readers: dict[str, Callable[[], Any]] = {"torch_sum": lambda: x.sum(dtype=torch.float32)}
    for per_sm, block, warps in SWEEP:
        parts = torch.empty(per_sm * sms, dtype=torch.float32, device=x.device)
        readers[f"triton_{per_sm}x{sms}_b{block}_w{warps}"] = (
            lambda p=per_sm * sms, b=block, w=warps, o=parts: triton_sum(x, p, b, w, o))
    return {name: nbytes / (time_ms(fn) * 1e-3) / 1e12 for name, fn in readers.items()}
