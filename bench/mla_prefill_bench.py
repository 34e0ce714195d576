"""MLA prefill attention on one GPU: the kernel on the decompressed context
(kernels/triton_mla_prefill.py) against the way MLA ran before it, in the same run.

Before: the context decompressed into a zero-filled paged K/V of one power-of-two head dim
(Dn + R and Dv padded to 256 at DeepSeek's dims) and the GQA paged prefill kernel on it,
the query padded the same way. Now: kv_b_proj's output and the latent's k_pe read in
place. Each is timed as MLA's prefill runs it (decompression and copies included, "whole")
and as the attention kernel alone, at DeepSeek-V2-Lite's heads (16) and V3's on one rank
(128), for a whole prompt and for a chunk after a cached context; the new kernel also under
a few tile variants. FLOPs: causal q.k and p.v, H x (Dn + R + Dv) x 2 per visible
query-key pair; the run's bf16 matmul rate is the reference.

    python bench/mla_prefill_bench.py --out $OUT/mla_prefill_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

DN, R, DV, C, BS = 128, 64, 128, 512, 64
# (BLOCK_M, BLOCK_N, stages, warps): the default first; each is a compile (~10-20 s)
TILES = [(128, 64, 2, 8), (128, 32, 2, 8), (128, 64, 3, 8)]


def timed_ms(fn: Any, reps: int = 10) -> float:
    """Median of `reps` CUDA-event timings after two warm-ups (prefill is not graphed)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def case(heads: int, chunk: int, ctx: int, mm_tflops: float) -> dict[str, Any]:
    from kernels.tile_fit import Tiles
    from kernels.triton_mla_prefill import mla_prefill
    from kernels.triton_prefill_attention import prefill_attention

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    seq = ctx + chunk
    nb = -(-seq // BS)
    lat = torch.randn(nb * BS, C + R, device=dev, generator=g, dtype=torch.bfloat16)
    w = torch.randn(heads * (DN + DV), C, device=dev, generator=g, dtype=torch.bfloat16) / C**0.5
    q = torch.randn(chunk, heads, DN + R, device=dev, generator=g, dtype=torch.bfloat16)
    qn, qp = q[..., :DN], q[..., DN:]
    cu = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
    lens = torch.tensor([seq], dtype=torch.int32, device=dev)
    starts = torch.zeros(1, dtype=torch.int64, device=dev)
    tables = torch.arange(nb, dtype=torch.int32, device=dev).view(1, nb)
    scale = (DN + R) ** -0.5
    pad = 256

    def old_inputs() -> tuple[torch.Tensor, torch.Tensor]:
        kv = torch.nn.functional.linear(lat[:, :C], w).view(nb, BS, heads, DN + DV)
        paged = kv.new_zeros(nb, 2, BS, heads, pad)
        paged[:, 0, :, :, :DN] = kv[..., :DN]
        paged[:, 0, :, :, DN:DN + R] = lat.view(nb, BS, C + R)[:, :, None, C:]
        paged[:, 1, :, :, :DV] = kv[..., DN:]
        qq = q.new_zeros(chunk, heads, pad)
        qq[..., :DN + R] = q
        return qq, paged

    def old_whole() -> torch.Tensor:
        qq, paged = old_inputs()
        return prefill_attention(qq, paged, tables, cu, lens, scale)[..., :DV]

    kv_new = torch.nn.functional.linear(lat[:, :C], w).view(nb * BS, heads, DN + DV)

    def new_whole(tiles: Tiles | None = None) -> torch.Tensor:
        kv = torch.nn.functional.linear(lat[:, :C], w).view(nb * BS, heads, DN + DV)
        return mla_prefill(qn, qp, kv, lat[:, C:], starts, cu, lens, scale, tiles=tiles)

    qq, paged = old_inputs()
    pairs = chunk * ctx + chunk * (chunk + 1) / 2  # visible query-key pairs
    flops = 2 * pairs * heads * (DN + R + DV)
    print(f"heads {heads} chunk {chunk} cached {ctx}: compiling", flush=True)
    ref, got = old_whole().float(), new_whole().float()
    err = float((got - ref).norm() / ref.norm())
    row: dict[str, Any] = {"heads": heads, "chunk": chunk, "cached": ctx,
                           "gflop": round(flops / 1e9, 1), "new_vs_old_rel_err": err}

    def rate(ms: float) -> dict[str, float]:
        tf = flops / (ms * 1e-3) / 1e12
        return {"ms": round(ms, 3), "tflops": round(tf, 1),
                "of_matmul": round(tf / mm_tflops, 3)}

    row["old_kernel"] = rate(timed_ms(lambda: prefill_attention(qq, paged, tables, cu, lens,
                                                                 scale)))
    row["old_whole"] = rate(timed_ms(old_whole))
    row["new_whole"] = rate(timed_ms(new_whole))
    for t in TILES:
        tiles = Tiles(*t)
        try:
            ms = timed_ms(lambda tiles=tiles: mla_prefill(qn, qp, kv_new, lat[:, C:], starts,
                                                           cu, lens, scale, tiles=tiles))
            row[f"new_kernel {t}"] = rate(ms)
        except Exception as e:  # a tile the device cannot hold: recorded, the others run
            row[f"new_kernel {t}"] = {"error": repr(e)[:200]}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/mla_prefill_h200.json")
    args = ap.parse_args()
    sys.path.insert(0, "bench")
    from moe_bench import matmul_tflops

    mm = matmul_tflops()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "command": " ".join(sys.argv), "bf16_matmul_tflops": round(mm, 1),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "cases": []}
    print("bf16 matmul TFLOP/s", round(mm, 1), flush=True)
    for heads, chunk, ctx in ((16, 4096, 0), (16, 2048, 2048), (128, 4096, 0)):
        try:
            result["cases"].append(case(heads, chunk, ctx, mm))
        except Exception as e:
            result["cases"].append({"heads": heads, "chunk": chunk, "cached": ctx,
                                    "error": repr(e)[:300]})
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
