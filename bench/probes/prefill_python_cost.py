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
                    help="prompt tokens (past 64 at top-2 the align step takes its "
                         "three-launch form, as a long prefill's does)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    from triton.runtime.interpreter import InterpretedFunction

    from engine.attention import AttentionMetadata, kernels_for
    from engine.weights import build_model, read_model_config

    with tempfile.TemporaryDirectory() as d:
        path = decode_op_count.write_config(os.path.join(d, "config.json"), args.version,
                                            num_hidden_layers=args.layers)
        cfg = read_model_config(path)
        model = build_model(path, cfg, kernels_for(torch.device("cuda")), torch.device("cpu"),
                            "float32", "dummy", 64)
    bs, t = 16, args.tokens
    nb = -(-t // bs)
    kv = torch.zeros(nb + 1, *decode_op_count._block_shape(cfg, bs))
    table = torch.arange(1, nb + 1, dtype=torch.int32).view(1, nb)
    pos = torch.arange(t)
    ids = torch.randint(3, cfg.vocab_size, (t,))

    def forward() -> None:
        # a fresh metadata each time: the MLA split it caches is the step's, built once
        meta = AttentionMetadata(
            slot_mapping=pos + bs, block_tables=table,
            cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32),
            seq_lens=torch.tensor([t], dtype=torch.int32), decode_only=False,
            max_seq_len=t, cu_seqlens_q_host=[0, t], seq_lens_host=[t])
        model(ids, pos, kv, meta)

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
    print(f"{args.version}, {t} tokens, {args.layers} layers: forward {ms:.3f} ms of host "
          f"Python (median of {args.rounds}), {ms / args.layers:.3f} ms a layer; "
          f"{launches[0] / args.rounds:.0f} Triton launches a forward, skipped")


if __name__ == "__main__":
    main()
