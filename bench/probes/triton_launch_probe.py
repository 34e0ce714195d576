"""GPU: what one kernel launch costs the host, by kind, on this machine.

A long MoE prefill is not graphed, and on some hosts its launches pace the GPU: session 40's
4,096-token V2-Lite prefill on an H200 launched its last kernel 0.6 ms before the GPU ended
(bench/RESULTS.md), at ~23 launches a layer. Whether a cheaper launch path would pay
depends on what a launch costs without a profiler, which this measures: the host's time per
call, enqueued back to back with no sync between, for
- a Triton kernel with a fused-MoE-like argument list (12 tensors, 8 ints, 3 constexprs),
  through `kernel[grid](...)`;
- `torch.empty` (the caching allocator, no kernel);
- a small `torch.add` and a small `F.linear` (cuBLAS).
Each kernel does almost nothing, so the GPU never holds the host back (the queue stays
short); the median of several rounds of N calls is reported, in microseconds.

    python3 bench/probes/triton_launch_probe.py [--calls 2000] [--out OUT/launch.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _many_args_kernel(a, b, c, d, e, f, g, h, i, j, k, out,
                      n0, n1, n2, n3, s0, s1, s2, s3,
                      BLOCK: tl.constexpr, FLAG: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(a + offs, mask=offs < n0, other=0.0)
    tl.store(out + offs, x + n1 + s0, mask=offs < n0)


def _per_call_us(fn: Callable[[], None], calls: int, rounds: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(times), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    ts = [torch.zeros(4096, device=dev) for _ in range(12)]
    x = torch.randn(16, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(256, 2048, device=dev, dtype=torch.bfloat16)
    n = 1024

    def triton_launch() -> None:
        _many_args_kernel[(4,)](*ts, n, 3, 5, 7, 2048, 1, 64, 16, BLOCK=256, FLAG=True, MODE=1)

    results = {
        "triton_launch_us": _per_call_us(triton_launch, args.calls),
        "torch_empty_us": _per_call_us(lambda: torch.empty(4096, device=dev), args.calls),
        "torch_add_us": _per_call_us(lambda: torch.add(ts[0], ts[1], out=ts[2]), args.calls),
        "linear_16x2048x256_us": _per_call_us(lambda: F.linear(x, w), args.calls),
        "device": torch.cuda.get_device_name(0),
        "triton": triton.__version__,
        "torch": torch.__version__,
    }
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
