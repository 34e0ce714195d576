"""Benchmark the Triton paged-attention kernels on one GPU against ceilings measured in the
same run.

* ceilings: device-to-device copy bandwidth (bytes read + written) of a 4 GiB buffer, and
  the bf16 matrix rate of an 8192^3 product on random data;
* decode attention at the Llama-3-8B head shape (32 q heads, 8 KV heads, dim 128, bf16,
  block size 16, scattered blocks) for batch x context, as achieved KV bandwidth over the
  copy bandwidth, and its time against torch SDPA on the same data unpaged (the better of
  GQA-native SDPA and SDPA with each KV head's query group folded into the query length);
* prefill attention TFLOP/s (causal FLOPs: 4 * D * Hq * visible keys) over the matrix rate,
  against SDPA's causal flash attention on the same data unpaged.

Before the grids it sweeps a few tile configurations at representative points and uses the
fastest. Every time is the median of triton.testing.do_bench, which flushes L2 between
calls, so small problems are timed cold (a conservative choice for decode).

Run from the repo root on a CUDA machine:
    PYTHONPATH=. python3 bench/kernels_bench.py --out DIR

``--cached-prefix`` runs only the prefix-cache point instead (``cached_prefix.json``): one
request's 128-token chunk after 2,048 cached tokens at the Llama-3-8B head shape, with the
launcher's own choices (split-K, short-chunk tiles), with each split count forced, without
the split, and with the tiles used before the split existed (256-query tiles, 8 warps,
unsplit); against the same kernel's full 2,176-token prefill. Times are per attention
layer (x 32 for the model's step) and the host time of one eager launch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import time
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.testing

from kernels.triton_decode_attention import decode_attention
from kernels.triton_prefill_attention import prefill_attention

HQ, HKV, D, BS = 32, 8, 128, 16
DT = torch.bfloat16
SCALE = D ** -0.5


def bench(fn) -> float:
    """Median milliseconds, L2 flushed before each call, host launch cost included."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def bench_graph(fn) -> float:
    """Median milliseconds of CUDA-graph replays: GPU time alone, as an engine that captures
    its decode step sees it (L2 is not flushed: small working sets read from cache)."""
    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def copy_bw() -> float:
    """GB/s of a 4 GiB device-to-device copy, counting bytes read and written."""
    a = torch.randn(1 << 31, device="cuda", dtype=DT)
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    return 2 * a.numel() * a.element_size() / ms / 1e6


def matmul_rate() -> float:
    """TFLOP/s of an 8192^3 bf16 product on random data."""
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=DT)
    y = torch.randn(m, m, device="cuda", dtype=DT)
    ms = bench(lambda: x @ y)
    return 2 * m**3 / ms / 1e9


def ceilings() -> dict[str, float]:
    res = {"copy_GBps": copy_bw()}
    torch.cuda.empty_cache()
    res["matmul_TFLOPs"] = matmul_rate()
    return res


def paged(batch: int, ctx: int, gen: torch.Generator):
    """Random KV [NB, 2, BS, Hkv, D] for `batch` requests of `ctx` tokens, scattered blocks."""
    per = triton.cdiv(ctx, BS)
    nb = batch * per
    kv = torch.randn(nb, 2, BS, HKV, D, device="cuda", dtype=DT)
    perm = torch.randperm(nb, device="cuda", generator=gen)
    table = perm.view(batch, per).to(torch.int32)
    return kv, table


def decode_point(batch: int, ctx: int, cfg: dict, gen: torch.Generator,
                 with_sdpa: bool = True) -> dict:
    kv, table = paged(batch, ctx, gen)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=DT)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    ms = bench(lambda: decode_attention(q, kv, table, lens, SCALE, out, max_seq_len=ctx, **cfg))
    kv_bytes = 2 * batch * ctx * HKV * D * kv.element_size()
    res = {"batch": batch, "ctx": ctx, "ms": ms, "GBps": kv_bytes / ms / 1e6}
    if not with_sdpa:
        return res
    res["graph_ms"] = bench_graph(
        lambda: decode_attention(q, kv, table, lens, SCALE, out, max_seq_len=ctx, **cfg))
    # Same data unpaged, [B, Hkv, S, D], for SDPA; check agreement on the way.
    k = kv[table.long(), 0].reshape(batch, -1, HKV, D)[:, :ctx].transpose(1, 2).contiguous()
    v = kv[table.long(), 1].reshape(batch, -1, HKV, D)[:, :ctx].transpose(1, 2).contiguous()
    g = HQ // HKV
    qg = q.view(batch, HKV, g, D)  # a KV head's query group as g query rows: no mask needed
    ref = F.scaled_dot_product_attention(qg, k, v, scale=SCALE).reshape(batch, HQ, D)
    res["rel_err_vs_sdpa"] = float((out.float() - ref.float()).norm() / ref.float().norm())
    res["sdpa_grouped_ms"] = bench(lambda: F.scaled_dot_product_attention(qg, k, v,
                                                                          scale=SCALE))
    q4 = q.unsqueeze(2)  # [B, Hq, 1, D]
    try:
        res["sdpa_gqa_ms"] = bench(lambda: F.scaled_dot_product_attention(
            q4, k, v, scale=SCALE, enable_gqa=True))
    except (RuntimeError, torch.OutOfMemoryError) as e:  # backend without GQA support
        res["sdpa_gqa_ms"] = math.inf
        res["sdpa_gqa_error"] = str(e)[:200]
    res["sdpa_ms"] = min(res["sdpa_grouped_ms"], res["sdpa_gqa_ms"])
    fast = (lambda: F.scaled_dot_product_attention(qg, k, v, scale=SCALE)) \
        if res["sdpa_grouped_ms"] <= res["sdpa_gqa_ms"] else \
        (lambda: F.scaled_dot_product_attention(q4, k, v, scale=SCALE, enable_gqa=True))
    res["sdpa_graph_ms"] = bench_graph(fast)
    return res


def prefill_point(reqs: list[tuple[int, int]], cfg: dict, gen: torch.Generator,
                  with_sdpa: bool = True, host: bool = False) -> dict:
    """reqs: (cached tokens, chunk length) per request; host: also the host time of one
    launch."""
    lens = [c + n for c, n in reqs]
    per = [triton.cdiv(s, BS) for s in lens]
    kv = torch.randn(sum(per), 2, BS, HKV, D, device="cuda", dtype=DT)
    perm = torch.randperm(sum(per), device="cuda", generator=gen)
    table = torch.zeros(len(reqs), max(per), dtype=torch.int32, device="cuda")
    start = 0
    for i, p in enumerate(per):
        table[i, :p] = perm[start:start + p].int()
        start += p
    chunks = [n for _, n in reqs]
    cu = torch.tensor([0] + chunks, device="cuda").cumsum(0).int()
    seq = torch.tensor(lens, device="cuda", dtype=torch.int32)
    q = torch.randn(sum(chunks), HQ, D, device="cuda", dtype=DT)
    out = torch.empty_like(q)
    ms = bench(lambda: prefill_attention(q, kv, table, cu, seq, SCALE, out, **cfg))
    visible = sum(sum(range(c + 1, c + n + 1)) for c, n in reqs)  # keys seen by each query
    flops = 4 * D * HQ * visible
    res: dict[str, Any] = {"reqs": reqs, "ms": ms, "TFLOPs": flops / ms / 1e9}
    if host:
        res["host_us"] = host_us(
            lambda: prefill_attention(q, kv, table, cu, seq, SCALE, out, **cfg))
        # the same data through the unsplit kernel at the tuned tiles: the split must agree
        plain = prefill_attention(q, kv, table, cu, seq, SCALE, num_splits=1, block_m=256,
                                  num_warps=8)
        res["rel_err_vs_unsplit"] = float((out.float() - plain.float()).norm()
                                          / plain.float().norm())
    if with_sdpa and len(reqs) == 1 and reqs[0][0] == 0:  # fresh prompt: SDPA, same data
        n = reqs[0][1]
        k = kv[table[0].long(), 0].reshape(-1, HKV, D)[:n].transpose(0, 1).unsqueeze(0)
        v = kv[table[0].long(), 1].reshape(-1, HKV, D)[:n].transpose(0, 1).unsqueeze(0)
        k, v = k.contiguous(), v.contiguous()
        qs = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        ref = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=SCALE,
                                             enable_gqa=True)[0].transpose(0, 1)
        res["rel_err_vs_sdpa"] = float((out.float() - ref.float()).norm() / ref.float().norm())
        res["sdpa_ms"] = bench(lambda: F.scaled_dot_product_attention(
            qs, k, v, is_causal=True, scale=SCALE, enable_gqa=True))
        res["sdpa_TFLOPs"] = flops / res["sdpa_ms"] / 1e9
    return res


def host_us(fn, n: int = 200) -> float:
    """Microseconds of host time per call, launches queued without waiting for the GPU."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def cached_prefix(cached: int, chunk: int, gen: torch.Generator) -> dict:
    """The prefix-cache chunk under each launch choice, and the full prefill it replaces."""
    from kernels.triton_prefill_attention import SHORT_BLOCK_M
    from kernels.triton_prefill_split import choose_prefill_splits, max_query_tiles

    rows: dict[str, Any] = {}
    total = cached + chunk
    tiles = max_query_tiles(chunk, 1, SHORT_BLOCK_M if chunk <= SHORT_BLOCK_M else 256)
    auto_splits = choose_prefill_splits(tiles, HQ, total, torch.device("cuda"))
    auto2 = choose_prefill_splits(tiles, HQ, total, torch.device("cuda"), programs_per_sm=2)
    variants: list[tuple[str, dict]] = [
        ("auto", {}),
        ("unsplit", {"num_splits": 1}),
        ("before (256 x 64 tiles, 8 warps, unsplit)",
         {"num_splits": 1, "block_m": 256, "num_warps": 8}),
        ("auto splits, 4 warps", {"num_warps": 4}),
        ("splits for 2 programs per SM", {"num_splits": auto2}),
    ] + [(f"splits={s}", {"num_splits": s}) for s in (2, 3, 4, 6, 8, 12, 16)]
    for name, kw in variants:
        r = prefill_point([(cached, chunk)], dict(kw, max_seq_len=total), gen, False,
                          host=True)
        r["step_ms_32_layers"] = 32 * r["ms"]
        rows[name] = r
        print(f"cached {cached} + chunk {chunk} [{name}]: {r['ms'] * 1e3:.1f} us/layer, "
              f"host {r['host_us']:.1f} us/launch, err {r['rel_err_vs_unsplit']:.1e}",
              flush=True)
    full = prefill_point([(0, total)], {}, gen, True)
    full["step_ms_32_layers"] = 32 * full["ms"]
    print(f"full prefill of {total}: {full['ms'] * 1e3:.1f} us/layer "
          f"(SDPA {full.get('sdpa_ms', float('nan')) * 1e3:.1f} us)", flush=True)
    best = min((k for k in rows if k.startswith("splits=")), key=lambda k: rows[k]["ms"])
    return {"cached": cached, "chunk": chunk, "auto_num_splits": auto_splits,
            "variants": rows, "full_prefill": full, "best_forced": best,
            "speedup_auto_vs_unsplit": rows["unsplit"]["ms"] / rows["auto"]["ms"],
            "speedup_auto_vs_before": rows["before (256 x 64 tiles, 8 warps, unsplit)"]["ms"]
            / rows["auto"]["ms"],
            "chunk_over_full": rows["auto"]["ms"] / full["ms"]}


DECODE_CFGS = [
    {"block_n": 64, "num_warps": 4, "num_stages": 3, "programs_per_sm": 16},
    {"block_n": 64, "num_warps": 4, "num_stages": 4, "programs_per_sm": 16},
    {"block_n": 64, "num_warps": 4, "num_stages": 4, "programs_per_sm": 8},
    {"block_n": 64, "num_warps": 4, "num_stages": 4, "programs_per_sm": 32},
    {"block_n": 128, "num_warps": 8, "num_stages": 3, "programs_per_sm": 16},
    {"block_n": 32, "num_warps": 4, "num_stages": 4, "programs_per_sm": 16},
]
PREFILL_CFGS = [
    {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
    {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 4},
    {"block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 4},
    {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3},
    {"block_m": 256, "block_n": 64, "num_warps": 8, "num_stages": 3},
    {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 4},
]


def sweep(kind: str, cfgs: list[dict], run, log: list) -> dict:
    best, best_score = cfgs[0], math.inf
    for cfg in cfgs:
        try:
            score = run(cfg)
        except Exception as e:  # e.g. out of shared memory for this tile shape
            log.append({"kind": kind, "cfg": cfg, "error": str(e)[:200]})
            continue
        log.append({"kind": kind, "cfg": cfg, "score_ms_geomean": score})
        print(f"sweep {kind} {cfg}: {score:.4f} ms (geomean)", flush=True)
        if score < best_score:
            best, best_score = cfg, score
    return best


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true", help="fewer points (smoke test)")
    ap.add_argument("--cached-prefix", action="store_true",
                    help="only the prefix-cache chunk (128 after 2,048 cached) and its "
                         "comparisons, into cached_prefix.json")
    args = ap.parse_args()
    outdir = pathlib.Path(args.out)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    dev = torch.cuda.get_device_properties(0)
    meta = {"device": dev.name, "sms": dev.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "date": datetime.date.today().isoformat()}
    print(meta, flush=True)
    if args.cached_prefix:
        points = [cached_prefix(2048, 128, gen), cached_prefix(2048, 512, gen),
                  cached_prefix(8192, 128, gen)]
        (outdir / "cached_prefix.json").write_text(
            json.dumps({"meta": meta, "points": points}, indent=1))
        return
    ceil = ceilings()
    print(ceil, flush=True)

    log: list = []
    dpts = [(32, 4096), (16, 16384), (128, 8192), (1, 32768), (256, 1024)]
    dbest = sweep("decode", DECODE_CFGS, lambda c: geomean(
        [decode_point(b, s, c, gen, False)["ms"] for b, s in dpts]), log)
    ppts = [[(0, 4096)], [(4096, 2048), (0, 2048)]]
    pbest = sweep("prefill", PREFILL_CFGS, lambda c: geomean(
        [prefill_point(r, c, gen, False)["ms"] for r in ppts]), log)

    batches = [1, 4, 16, 32, 64, 128, 256]
    ctxs = [512, 1024, 2048, 4096, 8192, 16384, 32768]
    if args.quick:
        batches, ctxs = [1, 32, 256], [512, 4096, 32768]
    decode = []
    for b in batches:
        for s in ctxs:
            r = decode_point(b, s, dbest, gen)
            r["frac_copy_bw"] = r["GBps"] / ceil["copy_GBps"]
            r["speedup_vs_sdpa"] = r["sdpa_ms"] / r["ms"]
            r["graph_speedup_vs_sdpa"] = r["sdpa_graph_ms"] / r["graph_ms"]
            decode.append(r)
            print(f"decode B={b:4d} ctx={s:6d} {r['ms']:.4f} ms {r['GBps']:7.0f} GB/s "
                  f"({r['frac_copy_bw']:.0%}) sdpa {r['sdpa_ms']:.4f} ms "
                  f"x{r['speedup_vs_sdpa']:.2f} | graph {r['graph_ms']:.4f} vs "
                  f"{r['sdpa_graph_ms']:.4f} x{r['graph_speedup_vs_sdpa']:.2f} "
                  f"err {r['rel_err_vs_sdpa']:.1e}", flush=True)
            torch.cuda.empty_cache()
    prefill = []
    for reqs in [[(0, 4096)], [(4096, 4096)], [(0, 1024)] * 4, [(0, 8192)]]:
        r = prefill_point(reqs, pbest, gen)
        r["frac_matmul"] = r["TFLOPs"] / ceil["matmul_TFLOPs"]
        prefill.append(r)
        print(f"prefill {reqs[:2]}{'...' if len(reqs) > 2 else ''} {r['ms']:.3f} ms "
              f"{r['TFLOPs']:.0f} TFLOP/s ({r['frac_matmul']:.0%}) "
              f"sdpa {r.get('sdpa_TFLOPs', float('nan')):.0f} TFLOP/s", flush=True)

    result = {"meta": meta, "ceilings": ceil, "decode_cfg": dbest, "prefill_cfg": pbest,
              "sweep": log, "decode": decode, "prefill": prefill}
    (outdir / "kernels_bench.json").write_text(json.dumps(result, indent=1))
    (outdir / "kernels_bench.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    c = r["ceilings"]
    lines = [f"{r['meta']['device']}, torch {r['meta']['torch']}, triton {r['meta']['triton']}, "
             f"{r['meta']['date']}. Ceilings measured in this run: copy "
             f"{c['copy_GBps']:.0f} GB/s (read+write), bf16 matmul {c['matmul_TFLOPs']:.0f} "
             f"TFLOP/s.", "",
             f"Decode config {r['decode_cfg']}; prefill config {r['prefill_cfg']}.", "",
             "Decode (Llama-3-8B heads, bf16, block 16): KV bandwidth as a fraction of copy "
             "bandwidth / speedup over the best torch SDPA on the same data unpaged", "",
             "| batch \\ ctx | " + " | ".join(str(s) for s in
                                             sorted({d["ctx"] for d in r["decode"]})) + " |",
             "|---" * (1 + len({d["ctx"] for d in r["decode"]})) + "|"]
    for b in sorted({d["batch"] for d in r["decode"]}):
        row = [d for d in r["decode"] if d["batch"] == b]
        lines.append(f"| {b} | " + " | ".join(
            f"{d['frac_copy_bw']:.0%} / x{d['speedup_vs_sdpa']:.2f}" for d in row) + " |")
    lines += ["", "Decode under CUDA-graph replay (GPU time, no launch cost, L2 warm): "
              "microseconds, Triton / SDPA", "",
              lines[6], lines[7]]
    for b in sorted({d["batch"] for d in r["decode"]}):
        row = [d for d in r["decode"] if d["batch"] == b]
        lines.append(f"| {b} | " + " | ".join(
            f"{d['graph_ms'] * 1e3:.1f} / {d['sdpa_graph_ms'] * 1e3:.1f}" for d in row) + " |")
    lines += ["", "Prefill (causal FLOPs):", "",
              "| requests (cached, chunk) | ms | TFLOP/s | of matmul | SDPA TFLOP/s |",
              "|---|---|---|---|---|"]
    for p in r["prefill"]:
        reqs = p["reqs"]
        name = f"{len(reqs)} x {tuple(reqs[0])}"
        sd = f"{p['sdpa_TFLOPs']:.0f}" if "sdpa_TFLOPs" in p else "-"
        lines.append(f"| {name} | {p['ms']:.3f} | {p['TFLOPs']:.0f} | "
                     f"{p['frac_matmul']:.0%} | {sd} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
