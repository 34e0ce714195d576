"""CPU: the engine's own Python per layer of an MoE prefill, with every Triton launch a no-op.

Session 40's 4,096-token V2-Lite prefill on an H200 launched its last kernel 0.6 ms before
the GPU ended (bench/RESULTS.md): the host paced it, at ~2 ms a layer. This separates the
part of that host time that is the engine's own code (the layer's wrappers, shape checks,
tile choices, allocations, the torch calls' dispatch) from the launches themselves: it runs
a small DeepSeek-V2-layout (or Qwen3-MoE) model's prefill forward on CPU with the CUDA kernel
set, every Triton launch replaced by a no-op, and times the forward. The torch ops still run
on CPU at the small model's sizes, so the number is an upper bound on the wrappers' cost
(and `--tokens` small keeps the torch ops' own work small). What one launch costs on a GPU
host is bench/probes/triton_launch_probe.py's.

    python bench/probes/prefill_python_cost.py [--version v2|v3|qwen3] [--tokens 160]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

# read when @triton.jit functions are defined: set before any kernels.triton_* import
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

import decode_op_count  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", choices=sorted(decode_op_count.VERSIONS), default="v2")
    ap.add_argument("--tokens", type=int, default=160,
                    help="prompt tokens (the default is past the align step's 128 "
                         "(token, expert) pairs for every --version, so it takes the three "
                         "launches a long prefill's does)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    from triton.runtime.interpreter import InterpretedFunction

    with tempfile.TemporaryDirectory() as d:
        path = decode_op_count.write_config(os.path.join(d, "config.json"), args.version,
                                            num_hidden_layers=args.layers)
        model, ids, pos, kv, meta = decode_op_count.prefill_inputs(path, args.tokens)

    def forward() -> None:
        model(ids, pos, kv, meta())

    launches = [0]

    def no_launch(self: Any, *a: Any, **k: Any) -> None:
        launches[0] += 1

    saved = InterpretedFunction.run
    InterpretedFunction.run = no_launch  # type: ignore[method-assign]
    try:
        with torch.inference_mode():
            for _ in range(3):
                forward()
            launches[0] = 0
            times = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                forward()
                times.append((time.perf_counter() - t0) * 1e3)
    finally:
        InterpretedFunction.run = saved  # type: ignore[method-assign]
    ms = statistics.median(times)
    print(f"{args.version}, {args.tokens} tokens, {args.layers} layers: forward {ms:.3f} ms "
          f"of host Python (median of {args.rounds}), {ms / args.layers:.3f} ms a layer; "
          f"{launches[0] / args.rounds:.0f} Triton launches a forward, skipped")


if __name__ == "__main__":
    main()
