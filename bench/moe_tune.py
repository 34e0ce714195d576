"""Tile tuning for the MoE benchmark's kernels (``bench/moe_bench.py --tune`` and
``--tune-mla``): each candidate timed on the device, the fastest printed for
kernels/moe_configs.json and the MLA decode kernel's constants."""

from __future__ import annotations

from typing import Any

import torch
from moe_bench import kernel_point, mla_kernel_point

# fused-kernel tile candidates for --tune (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): each
# compiles for sm_90 without register spills (ptxas -v, as tests/kernels/test_moe_sm90.py)
CANDIDATES = [(16, 64, 128, 8, 3), (16, 32, 128, 4, 3), (16, 64, 64, 4, 4),
              (16, 128, 64, 4, 3), (16, 64, 128, 8, 4), (32, 64, 64, 8, 3),
              (32, 64, 128, 8, 3), (64, 64, 64, 8, 3), (64, 128, 64, 8, 3),
              # wider K or N for batch-1 streaming (not spill-checked: timing decides)
              (16, 32, 256, 4, 3), (16, 64, 256, 8, 2), (16, 128, 128, 8, 3)]
# ... and for prefill-sized calls (more than PREFILL_TOKENS tokens), where the kernel is
# compute-bound: wide row tiles feed the tensor cores; each expert's rows pad to BLOCK_M, so
# 128-row tiles waste more on experts with few rows (timing decides). (BLOCK_M, BLOCK_N,
# BLOCK_K, BLOCK_N_DOWN, BLOCK_K_DOWN, warps, stages): the down GEMM holds one accumulator
# where gate/up holds two, so its tile may be wider. Register spills on sm_90 (ptxas,
# gate/up + down bytes) noted where not zero: 128-row tiles at 128 columns spill.
PREFILL_TOKENS = 1024
PREFILL_CANDIDATES = [(64, 128, 64, 128, 64, 8, 3),  # the default table's 8192 bucket
                      (128, 64, 64, 64, 64, 8, 3),  # 44 + 0
                      (128, 64, 32, 64, 64, 8, 4),
                      (128, 32, 64, 64, 64, 8, 3),
                      (128, 64, 64, 128, 64, 8, 3),  # 44 + 376
                      (64, 128, 64, 256, 64, 8, 3),  # 0 + 180
                      (128, 128, 64, 128, 64, 8, 3)]  # 452 + 376: session 24's fastest


def tune_mla(model: Any, hbm: float, points: list[tuple[int, int]]) -> dict[str, Any]:
    """Times MLA decode tile candidates (rows per tile, warps, stages, and the split count
    against the heuristic's) per (batch, context); returns every timing and the best."""
    from kernels.triton_mla_decode import choose_num_splits

    out: dict[str, Any] = {}
    for b, ctx in points:
        base = choose_num_splits(b, 1, ctx, torch.device("cuda"))
        rows = []
        for block_n in (16, 32, 64):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    for splits in sorted({max(1, base // 2), base, min(64, base * 2)}):
                        tiles = {"block_n": block_n, "num_warps": warps,
                                 "num_stages": stages, "num_splits": splits}
                        try:
                            p = mla_kernel_point(model, b, ctx, hbm, tiles)
                        except Exception as e:  # a tile that does not fit: skip it
                            print("tune-mla", b, ctx, tiles, repr(e)[:100], flush=True)
                            continue
                        rows.append({**tiles, "ms": p["kernel_ms_all_layers"],
                                     "fraction_of_hbm_read": p["fraction_of_hbm_read"]})
                        print("tune-mla", b, ctx, rows[-1], flush=True)
        rows.sort(key=lambda r: r["ms"])
        out[f"{b}x{ctx}"] = {"heuristic_splits": base, "best": rows[:5]}
    return out


def tune(model: Any, hbm: float, batches: list[int]) -> dict[str, Any]:
    """Times each tile candidate per batch; returns the moe_configs.json entry."""
    best: dict[str, Any] = {}
    for b in batches:
        rows = []
        cands = (PREFILL_CANDIDATES if b > PREFILL_TOKENS
                 else [(bm, bn, bk, bn, bk, w, st) for bm, bn, bk, w, st in CANDIDATES])
        for bm, bn, bk, bn2, bk2, warps, stages in cands:
            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_N_DOWN": bn2,
                   "BLOCK_K_DOWN": bk2, "num_warps": warps, "num_stages": stages}
            try:
                p = kernel_point(model, b, hbm, cfg)
            except Exception as e:  # a config that does not fit: skip it
                print("tune", b, cfg, repr(e)[:120], flush=True)
                continue
            rows.append((p["kernel_ms_all_layers"], cfg))
            print("tune", b, cfg, p["kernel_ms_all_layers"], p.get("tflops", ""), flush=True)
        rows.sort(key=lambda r: r[0])
        best[str(b)] = rows[0][1]
    return {torch.cuda.get_device_name(): best}


# --tune-tma candidates (kernels/triton_moe_tma.py): gate/up (BLOCK_M, BLOCK_N, BLOCK_K,
# warps, stages), down (BLOCK_N_DOWN, BLOCK_K_DOWN, warps, stages). None spills compiled for
# sm_90 (ptxas -v; 128-row tiles at 256 columns do, at 8 warps, and 16 warps cap a thread
# at 128 registers); the third is the module's default (the fastest on an H100).
TMA_CANDIDATES = [((128, 128, 64, 8, 3), (128, 64, 8, 3)),
                  ((128, 128, 64, 8, 4), (128, 64, 8, 4)),
                  ((128, 128, 64, 16, 3), (256, 64, 16, 3)),
                  ((128, 128, 128, 8, 2), (128, 128, 8, 2)),
                  ((64, 128, 64, 4, 3), (256, 64, 8, 3)),
                  ((128, 64, 64, 4, 4), (128, 64, 8, 4)),
                  ((128, 64, 64, 4, 3), (128, 64, 8, 3)),  # ~100 KB shared: 2 programs/SM
                  ((64, 128, 64, 4, 4), (128, 64, 4, 4))]


def tune_tma(model: Any, hbm: float, batches: list[int]) -> dict[str, Any]:
    """Times the tensor-memory form under each candidate per token count, and the decode
    form's table tile (kernels/moe_configs.json) in the same run; returns every timing."""
    import kernels.moe_grouped_gemm as grouped
    import kernels.triton_moe_tma as tma
    from kernels.triton_moe import tile_config

    names = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "NUM_WARPS", "NUM_STAGES",
             "BLOCK_N_DOWN", "BLOCK_K_DOWN", "NUM_WARPS_DOWN", "NUM_STAGES_DOWN")
    saved = {n: getattr(tma, n) for n in ("MIN_TOKENS", *names)}
    out: dict[str, Any] = {}
    try:
        for b in batches:
            table = tile_config(b, torch.device("cuda"))
            ref = kernel_point(model, b, hbm, dict(table))  # a config: the decode form
            rows = [{"form": "decode", **table, "ms": ref["kernel_ms_all_layers"],
                     "tflops": ref["tflops"]}]
            print("tune-tma", b, rows[-1], flush=True)
            tma.MIN_TOKENS = 1
            grouped_min, grouped.MIN_TOKENS = grouped.MIN_TOKENS, None  # fused_moe's first pick
            for gu, dn in TMA_CANDIDATES:
                for n, v in zip(names, (*gu, *dn), strict=True):
                    setattr(tma, n, v)
                try:
                    p = kernel_point(model, b, hbm)
                except Exception as e:  # a tile that does not fit: skip it
                    print("tune-tma", b, gu, dn, repr(e)[:120], flush=True)
                    continue
                rows.append({"form": "tma", "gate_up": gu, "down": dn,
                             "ms": p["kernel_ms_all_layers"], "tflops": p["tflops"]})
                print("tune-tma", b, rows[-1], flush=True)
            tma.MIN_TOKENS = saved["MIN_TOKENS"]
            grouped.MIN_TOKENS = grouped_min
            rows.sort(key=lambda r: r["ms"])
            out[str(b)] = rows
    finally:
        for n, v in saved.items():
            setattr(tma, n, v)
    return out
