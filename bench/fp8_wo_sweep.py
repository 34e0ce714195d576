"""Weight-only FP8 decode projections on one GPU (issue 27): the kernels of
kernels/triton_fp8_weight_only.py against the HBM read rate and cuBLAS bf16.

    PYTHONPATH=.:proto python3 bench/fp8_wo_sweep.py --out $OUT/fp8_wo_sweep.json

For Llama-3-8B's four projections (K-major weights [N, K], per-channel scales) at M=1 and
M=8 it times the pre-GEMV configuration (OLD_CONFIG with the old split rule), the current
default (config_for + choose_splits) and a pruned sweep of tiles x splits, then checks
the best of each against the torch reference, prints a table (us, % of the measured HBM
read rate) and the 32-layer total at M=1, and writes everything as JSON.

Timing (/work/.library/device/METHOD.md): each measurement is one CUDA graph of many
launches, rotating over enough weight copies (>= 3x the 60 MB L2) that every launch
streams its weight from HBM, as a decode step does; triton.testing.do_bench's median of
the graph's replays, over the launches in it. Split-K partials are what the fused readers
take (engine/models/split_k.py) for qkv, o and down at <= 4 rows; elsewhere the engine
sums them (engine/quant/fp8_linear.py), so that sum is timed with the kernel there.
The sweep keeps to --budget-s (default 170 s; the whole run ~3.5 min).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import torch
import triton
import triton.testing

from kernels import ref_fp8
from kernels import triton_fp8_weight_only as wo

SHAPES = {  # name: (N, K), Llama-3-8B
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
LAYERS = 32
ROTATE_BYTES = 200 * 2 ** 20  # weight copies per measurement: >= 3x L2
FUSED_READER_MAX_M = 4  # engine/models/split_k.MAX_ROWS: partials go to a fused reader


def hbm_read_rate() -> dict[str, float]:
    """Bytes/s of a large sum (reads only) and of a device copy (reads + writes)."""
    src = torch.randn(2 ** 30 // 4, device="cuda")  # 1 GiB float32
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(src.sum, warmup=20, rep=200, return_mode="median")
    ms_c = triton.testing.do_bench(lambda: dst.copy_(src), warmup=20, rep=200,
                                   return_mode="median")
    read = src.numel() * 4 / (ms * 1e-3)
    copy = 2 * src.numel() * 4 / (ms_c * 1e-3)
    return {"sum_read_Bps": read, "copy_rw_Bps": copy}


def old_splits(m: int, n: int, k: int, sms: int) -> int:
    """The split rule before the GEMV (per channel): programs of the 64-column dot tile
    doubled while under 2 per SM and each range keeps >= 4 tiles of 128."""
    progs = triton.cdiv(n, 64) * triton.cdiv(m, min(64, max(16, triton.next_power_of_2(m))))
    s = 1
    while progs * s < 2 * sms and k % (2 * s) == 0 and k // (2 * s) >= 4 * 128:
        s *= 2
    return s


class Case:
    """One (shape, M): the rotated weights, x, and a timer for (config, splits)."""

    def __init__(self, name: str, n: int, k: int, m: int, gen: torch.Generator):
        self.name, self.n, self.k, self.m = name, n, k, m
        w = (torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5)
        q, s = ref_fp8.quantize_weight(w, "channel")
        del w
        self.copies = max(2, math.ceil(ROTATE_BYTES / q.numel()))
        self.ws = [q] + [q.clone() for _ in range(self.copies - 1)]
        self.s = s.contiguous()
        self.x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        self.ref = ref_fp8.fp8_weight_only_ref(self.x.float(), q, self.s)  # float32 [M, N]

    def call(self, w: torch.Tensor, cfg: wo.Config, splits: int) -> torch.Tensor:
        out = wo.fp8_weight_only(self.x, w, self.s, splits=splits, config=cfg)
        if splits > 1 and (self.name == "gate_up" or self.m > FUSED_READER_MAX_M):
            return out.sum(0).to(self.x.dtype)  # no fused reader here: the engine sums
        return out

    def time_us(self, cfg: wo.Config, splits: int) -> float:
        for w in self.ws[:1]:  # compile + warm outside the graph
            self.call(w, cfg, splits)
        torch.cuda.synchronize()
        reps = max(1, 24 // self.copies)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                for w in self.ws:
                    self.call(w, cfg, splits)
        ms = triton.testing.do_bench(g.replay, warmup=10, rep=60, return_mode="median")
        return ms * 1e3 / (reps * self.copies)

    def error(self, cfg: wo.Config, splits: int) -> float:
        out = wo.fp8_weight_only(self.x, self.ws[0], self.s, splits=splits, config=cfg)
        got = out.float() if splits == 1 else out.sum(0)
        return float((got - self.ref).norm() / self.ref.norm())

    def bf16_us(self) -> float:
        """cuBLAS x @ W^T with a bf16 copy of the weight, rotated the same way."""
        wb = ref_fp8.dequant(self.ws[0], self.s).to(torch.bfloat16)
        copies = max(2, math.ceil(ROTATE_BYTES / (2 * wb.numel())))
        wbs = [wb] + [wb.clone() for _ in range(copies - 1)]
        torch.nn.functional.linear(self.x, wb)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for b in wbs:
                torch.nn.functional.linear(self.x, b)
        ms = triton.testing.do_bench(g.replay, warmup=10, rep=60, return_mode="median")
        del wbs, wb
        return ms * 1e3 / copies


def candidates(m: int, n: int, k: int, sms: int) -> list[tuple[wo.Config, int]]:
    """Pruned tiles x splits, the likeliest first (the sweep stops at its time budget)."""
    out: list[tuple[int, wo.Config, int]] = []
    if m <= 4:
        kinds = [("gemv", bn, bk, nw, st) for bn, bk, nw, st in itertools.product(
            (16, 32, 64, 128), (128, 256, 512), (2, 4, 8), (1, 3))]
    else:  # 8 rows: a few GEMV tiles against the tensor-core kernel's
        kinds = [("gemv", bn, bk, 4, st) for bn, bk, st in itertools.product(
            (16, 32, 64), (128, 256), (1, 3))]
        kinds += [("dot", bn, bk, nw, st) for bn, bk, nw, st in itertools.product(
            (32, 64, 128), (64, 128, 256), (4, 8), (3, 4))]
    for kind, bn, bk, nw, st in kinds:
        tile = bn * bk
        per_thread = tile // (32 * nw)  # weight bytes each thread loads per tile
        if kind == "gemv" and not (16 <= per_thread <= 128 and 2048 <= tile <= 32768):
            continue
        if kind == "dot" and not (4096 <= tile <= 32768):
            continue
        progs = triton.cdiv(n, bn) * (triton.cdiv(m, 4) if kind == "gemv" else 1)
        for s in (1, 2, 4, 8, 16):
            if k % s or (k // s) % bk or k // s < 2 * bk:
                continue
            grid = progs * s
            if not sms <= grid <= 64 * sms:
                continue
            # likeliest first: ~2-8 programs per SM, 32-64 bytes per thread, stages 1
            score = abs(math.log2(grid / (4 * sms))) + 0.5 * abs(math.log2(max(per_thread, 1)
                                                                            / 64))
            score += 0.3 * (st != 1 if kind == "gemv" else 0)
            out.append((round(score * 1000), wo.Config(kind, bn, bk, nw, st), s))
    out.sort(key=lambda t: t[0])
    return [(c, s) for _, c, s in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--budget-s", type=float, default=170.0,
                    help="sweep time budget; M=1 cases get twice an M=8 case's share")
    ap.add_argument("--ms", default="1,8", help="row counts, comma separated")
    args = ap.parse_args()
    t_start = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ms_list = [int(v) for v in args.ms.split(",")]
    rates = hbm_read_rate()
    bw = rates["sum_read_Bps"]
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs, triton {triton.__version__}, "
          f"torch {torch.__version__}")
    print(f"HBM: sum reads {bw / 1e12:.2f} TB/s; copy {rates['copy_rw_Bps'] / 1e12:.2f} TB/s "
          "(read + write)")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name(0), "sms": sms,
                     "triton": triton.__version__, "torch": torch.__version__,
                     "hbm": rates, "cases": {}}
    # M=1 decides the issue: its cases get twice the share of the others
    weights = [2.0 if m == 1 else 1.0 for m in ms_list]
    unit = args.budget_s / (len(SHAPES) * sum(weights))
    rows = []
    for m in ms_list:
        for name, (n, k) in SHAPES.items():
            case = Case(name, n, k, m, gen)
            floor_us = (n * k + 4 * n + 2 * m * k) / bw * 1e6
            entry: dict = {"n": n, "k": k, "m": m, "floor_us": floor_us, "sweep": []}
            t_case = time.time()
            per_case = unit * (2.0 if m == 1 else 1.0)
            entry["bf16_us"] = case.bf16_us()
            old_s = old_splits(m, n, k, sms)
            entry["old"] = {"config": wo.OLD_CONFIG.__dict__, "splits": old_s,
                            "us": case.time_us(wo.OLD_CONFIG, old_s),
                            "err": case.error(wo.OLD_CONFIG, old_s)}
            dcfg = wo.config_for(m, n, k, 1)
            d_s = wo.choose_splits(m, n, k, 1, sms)
            entry["default"] = {"config": dcfg.__dict__, "splits": d_s,
                                "us": case.time_us(dcfg, d_s), "err": case.error(dcfg, d_s)}
            best = (entry["default"]["us"], dcfg, d_s)
            tried = 0
            for cfg, s in candidates(m, n, k, sms):
                if time.time() - t_case > per_case:
                    break
                try:
                    us = case.time_us(cfg, s)
                except Exception as exc:  # a tile the compiler refuses: record, go on
                    entry["sweep"].append({"config": cfg.__dict__, "splits": s,
                                           "error": repr(exc)[:200]})
                    continue
                tried += 1
                entry["sweep"].append({"config": cfg.__dict__, "splits": s, "us": us})
                if us < best[0]:
                    best = (us, cfg, s)
            us, cfg, s = best
            err = case.error(cfg, s)
            entry["best"] = {"config": cfg.__dict__, "splits": s, "us": us, "err": err,
                             "ok": err < 1e-2}
            entry["tried"] = tried
            results["cases"][f"{name}/m{m}"] = entry
            for label, e in (("bf16 cuBLAS", {"us": entry["bf16_us"]}), ("old", entry["old"]),
                             ("default", entry["default"]), ("best", entry["best"])):
                cdesc = ("" if "config" not in e else
                         f"{e['config']['kind']} {e['config']['block_n']}x"
                         f"{e['config']['block_k']} w{e['config']['num_warps']} "
                         f"st{e['config']['num_stages']} s{e['splits']}")
                hbm = floor_us / e["us"] * 100 * (2 if label.startswith("bf16") else 1)
                rows.append((f"{name}/m{m}", label, e["us"], hbm, e.get("err"), cdesc))
            print(f"  {name} m={m}: {tried} configs in {time.time() - t_case:.0f}s; best "
                  f"{us:.2f} us vs old {entry['old']['us']:.2f} us", flush=True)
            del case
            torch.cuda.empty_cache()
    print()
    print(f"{'case':<12} {'kernel':<12} {'us':>8} {'%HBM':>6} {'rel err':>9}  config")
    for case_name, label, t_us, hbm, rel, cdesc in rows:
        e_txt = "" if rel is None else f"{rel:.1e}"
        print(f"{case_name:<12} {label:<12} {t_us:8.2f} {hbm:6.1f} {e_txt:>9}  {cdesc}")
    for m in ms_list:
        tot = {lab: LAYERS * sum(results["cases"][f"{nm}/m{m}"][key]["us"]
                                 for nm in SHAPES)
               for lab, key in (("old", "old"), ("default", "default"), ("best", "best"))}
        tot["bf16"] = LAYERS * sum(results["cases"][f"{nm}/m{m}"]["bf16_us"] for nm in SHAPES)
        tot["floor"] = LAYERS * sum(results["cases"][f"{nm}/m{m}"]["floor_us"]
                                    for nm in SHAPES)
        results[f"total_32_layers_m{m}_us"] = tot
        print(f"M={m}, 4 projections x {LAYERS} layers: old {tot['old'] / 1e3:.3f} ms, "
              f"default {tot['default'] / 1e3:.3f} ms, best {tot['best'] / 1e3:.3f} ms, "
              f"bf16 cuBLAS {tot['bf16'] / 1e3:.3f} ms, byte floor {tot['floor'] / 1e3:.3f} ms"
              f" (best/old {tot['best'] / tot['old']:.2f}, best/bf16 "
              f"{tot['best'] / tot['bf16']:.2f})")
    bad = [c for c, e in results["cases"].items() if not e["best"]["ok"]]
    print("verify best configs vs torch reference:", "FAILED " + ", ".join(bad) if bad
          else "all rel err < 1e-2")
    results["wall_s"] = time.time() - t_start
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
