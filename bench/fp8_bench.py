"""GPU benchmark of FP8 weights: decode steps and a 4k-token prefill, bf16 against FP8, in
one run on one GPU, for a Llama-3-8B-shaped model (dummy weights; FP8 by
``--quantization fp8``: per-channel weight scales, activations quantized per token).

Sections (``--sections``, in order; each writes one key of the JSON):
  * ``decode``: per (batch, context) point the engine's decode step (CUDA graphs, as
    bench/decode_bench.py times it) in bf16 and FP8, and FP8's floor: the bytes of the
    weights a step reads in full (FP8 projections with their scales, the bf16 lm_head and
    norms) over the HBM read rate measured in this run. FP8 is also timed with every
    projection weight-only and with every projection FP8 x FP8 (the two forms
    engine/quant/fp8_linear.py picks between by rows): the crossover sets
    WEIGHT_ONLY_MAX_ROWS.
  * ``prefill``: one 4096-token prefill through the model (eager, as the engine runs
    prefill), tokens/s in bf16 and FP8 (and FP8 with each ``--variants`` setting).
  * ``pdl``: the decode step (CUDA graphs) with programmatic dependent launch off and on
    (kernels/pdl.py), bf16 and FP8, alternated off/on/off/on so drift shows; with PDL on,
    FP8 also with each ``--variants`` setting (a module constant set for that capture).
  * ``profile``: the graphed decode step's kernels under torch.profiler (bench/moe_profile.py)
    at each --batches x --contexts point, bf16 and FP8, and per kernel name the FP8 step's
    time against bf16's: where FP8's step is above its byte floor.
  * ``prefill_ab``: bf16, FP8 and FP8 with each ``--variants`` setting, interleaved over
    --repeats rounds (the prefill comparison to trust), and each variant's hidden states
    against FP8's defaults.
  * ``gemm``: the four projections of the 8B shape alone at decode-batch rows, cuBLAS's
    row-wise scaled mm (also with the operands swapped: out^T = w x^T, and that transposed
    back) against the K-split Triton kernel, with the weight bytes' floor.
  * ``prefill_profile``: one --prefill-tokens prefill's kernels under torch.profiler, bf16
    and FP8: what bounds FP8's prefill speed-up.
Further sections register in SECTIONS (name -> fn(args, ctx) -> JSON value); ctx carries
the model config directory, the HBM rate and each dtype's engine builder.

    python bench/fp8_bench.py --out bench/results/fp8_h200.json
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import gc
import importlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_bench import LLAMA3_8B, engine_point, hbm_read_tbps, recapture  # noqa: E402
from fp8_gemm_section import gemm_section  # noqa: E402

Section = Callable[[argparse.Namespace, dict[str, Any]], Any]


def build(ctx: dict[str, Any], quantization: str | None, args: argparse.Namespace,
          memory: float = 0.85):
    """memory: the engine's gpu_memory_utilization (a second engine beside a first needs
    the first's share plus its own: the budget counts memory already in use)."""
    from engine.config import EngineConfig
    from engine.llm import build_engine

    return build_engine(EngineConfig(
        model=ctx["cfg_dir"], dtype="bfloat16", device="cuda", load_format="dummy",
        max_num_seqs=max(args.batch_list), quantization=quantization,
        max_model_len=max(max(args.context_list), args.prefill_tokens) + args.steps
        * args.repeats + 64, max_num_batched_tokens=2048,
        gpu_memory_utilization=memory))


def free() -> None:
    """Returns what dropped engines held to the device. The caller drops its own name first
    (`del eng`): a name deleted in here would leave the caller's, and the next build would
    then run beside the old engine (on an 80 GB card the 8B bf16 and FP8 engines together
    do not fit)."""
    gc.collect()
    torch.cuda.empty_cache()


def full_read_bytes(model) -> dict[str, int]:
    """Bytes of the parameters a decode step reads whole: every parameter but the input
    embedding (a step gathers only its rows), split into FP8 weights, scales and float."""
    out = {"fp8_weights": 0, "scales": 0, "float": 0}
    tied = model.cfg.tie_word_embeddings
    for name, p in model.named_parameters():
        if name.startswith("embed_tokens.") and not tied:
            continue
        key = ("fp8_weights" if p.dtype == torch.float8_e4m3fn else
               "scales" if name.endswith(("weight_scale", "input_scale")) else "float")
        out[key] += p.numel() * p.element_size()
    return out


def _points(engine, args: argparse.Namespace) -> dict[tuple[int, int], float]:
    out = {}
    for ctx in args.context_list:
        for b in args.batch_list:
            p = engine_point(engine, b, ctx, args.steps, args.repeats)
            out[(b, ctx)] = p.get("engine_step_ms", float("nan"))
            print(json.dumps(p), flush=True)
    return out


def decode_section(args: argparse.Namespace, ctx: dict[str, Any]) -> list[dict[str, Any]]:
    import engine.quant.fp8_linear as fl

    eng = build(ctx, None, args)
    bf16 = _points(eng, args)
    del eng
    free()
    eng = build(ctx, args.quantization, args)
    nbytes = full_read_bytes(eng.runner.model)
    ctx["fp8_read_bytes"] = nbytes
    default = fl.WEIGHT_ONLY_MAX_ROWS
    fp8 = _points(eng, args)
    variants = {}
    for name, rows in (("weight_only", 1 << 30), ("fp8xfp8", 0)):
        fl.WEIGHT_ONLY_MAX_ROWS = rows
        recapture(eng)
        variants[name] = _points(eng, args)
    fl.WEIGHT_ONLY_MAX_ROWS = default
    # KV bytes a token holds over all layers (the pool's own block layout)
    kv_token_bytes = eng.layout.block_nbytes / eng.layout.block_size
    del eng
    free()
    hbm = ctx["hbm_tb_s"] * 1e12
    # issue 27's floor is the weights alone; at batch >= 8 the step also reads KV as large as
    # them (batch 128 x 512 tokens: ~8.6 GB on the 8B shape), so the with-KV floor says how
    # far a batched step is from its bytes (the timed steps' context is a little past c)
    floor_ms = sum(nbytes.values()) / hbm * 1e3
    points = []
    for (b, c), ms in fp8.items():
        kv_floor_ms = floor_ms + b * c * kv_token_bytes / hbm * 1e3
        p = {"batch": b, "context": c, "bf16_step_ms": round(bf16[(b, c)], 3),
             "fp8_step_ms": round(ms, 3), "fp8_floor_ms": round(floor_ms, 3),
             "fp8_over_bf16": round(ms / bf16[(b, c)], 3),
             "fp8_over_floor": round(ms / floor_ms, 3),
             "fp8_floor_with_kv_ms": round(kv_floor_ms, 3),
             "fp8_over_floor_with_kv": round(ms / kv_floor_ms, 3),
             "fp8_tok_s": round(b / ms * 1e3, 1),
             "fp8_weight_only_step_ms": round(variants["weight_only"][(b, c)], 3),
             "fp8_fp8xfp8_step_ms": round(variants["fp8xfp8"][(b, c)], 3),
             "weight_only_max_rows": default}
        points.append(p)
        print(json.dumps(p), flush=True)
    return points


@contextlib.contextmanager
def setting(spec: str) -> Iterator[None]:
    """'package.module.NAME=value' (value a Python literal) set for the block."""
    target, _, value = spec.partition("=")
    mod_name, _, attr = target.rpartition(".")
    mod = importlib.import_module(mod_name)
    old = getattr(mod, attr)
    setattr(mod, attr, ast.literal_eval(value))
    try:
        yield
    finally:
        setattr(mod, attr, old)


def pdl_section(args: argparse.Namespace, ctx: dict[str, Any]) -> list[dict[str, Any]]:
    import kernels.pdl as pdl

    default_on = pdl.ENABLED
    rows: dict[tuple[int, int], dict[str, Any]] = {}

    def run(eng, key: str) -> None:
        for (b, c), ms in _points(eng, args).items():
            rows.setdefault((b, c), {"batch": b, "context": c}).setdefault(key, []).append(
                round(ms, 3))

    try:
        for name, quant in (("bf16", None), ("fp8", args.quantization)):
            eng = build(ctx, quant, args)
            for on in (False, True, False, True):
                pdl.ENABLED = on
                recapture(eng)
                run(eng, f"{name}_pdl_{'on' if on else 'off'}_ms")
            if quant is not None:
                pdl.ENABLED = True
                for spec in args.variant_list:
                    with setting(spec):
                        recapture(eng)
                        run(eng, f"fp8_pdl_{spec}_ms")
            del eng
            free()
    finally:
        pdl.ENABLED = default_on
    out = list(rows.values())
    for r in out:
        for name in ("bf16", "fp8"):
            off, on = r.get(f"{name}_pdl_off_ms"), r.get(f"{name}_pdl_on_ms")
            if off and on:
                r[f"{name}_on_over_off"] = round(min(on) / min(off), 3)
        print(json.dumps(r), flush=True)
    return out


def _prefill_inputs(engine, n: int, seed: int | None = None) -> tuple[Any, ...]:
    """One n-token prompt's (ids, positions, metadata) over the first blocks of the cache."""
    from engine.attention import AttentionMetadata

    bs = engine.config.block_size
    nb = -(-n // bs)
    dev = torch.device("cuda")
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=dev),
        block_tables=torch.arange(nb, dtype=torch.int32, device=dev)[None],
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev), decode_only=False,
        max_seq_len=n, cu_seqlens_q_host=[0, n], seq_lens_host=[n])
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed if seed is not None else torch.seed() % 2**31)
    ids = torch.randint(0, 1000, (n,), device=dev, generator=gen)
    return ids, torch.arange(n, device=dev), meta


def _prefill_ms(engine, n: int, runs: int = 7, warm: int = 2) -> float:
    model, kv = engine.runner.model, engine.kv_cache
    ids, pos, meta = _prefill_inputs(engine, n)
    times = []
    with torch.inference_mode():
        for i in range(runs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            h = model(ids, pos, kv, meta)
            model.compute_logits(h[-1:])
            b.record()
            b.synchronize()
            if i >= warm:  # the first runs compile and allocate
                times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _prefill_hidden(engine, n: int) -> torch.Tensor:
    """The final hidden states of a fixed n-token prompt, float32."""
    ids, pos, meta = _prefill_inputs(engine, n, seed=0)
    with torch.inference_mode():
        return engine.runner.model(ids, pos, engine.kv_cache, meta).float()


def prefill_ab_section(args: argparse.Namespace, ctx: dict[str, Any]) -> dict[str, Any]:
    """bf16, FP8 and FP8 under each --variants setting, interleaved: --repeats rounds, each
    timing every configuration once (7 prefills, the median) in an order rotated by one per
    round, so the GPU's drift over the run (it warms: a late FP8 prefill was measured 3%
    slower than an early one of the same code) falls on all of them alike. Also how far each
    variant's final hidden states move from FP8's own defaults (relative norm)."""
    n = args.prefill_tokens
    engines = {"bf16": build(ctx, None, args, memory=0.4)}
    engines["fp8"] = build(ctx, args.quantization, args, memory=0.85)
    configs: list[tuple[str, str, str | None]] = [("bf16", "bf16", None), ("fp8", "fp8", None)]
    configs += [(spec, "fp8", spec) for spec in args.variant_list]
    times: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    for r in range(args.repeats):
        k = r % len(configs)
        for name, eng, spec in configs[k:] + configs[:k]:
            with setting(spec) if spec else contextlib.nullcontext():
                times[name].append(round(_prefill_ms(engines[eng], n), 2))
    med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    out: dict[str, Any] = {"tokens": n, "rounds": args.repeats, "ms": times, "median_ms": med,
                           "speedup_over_bf16": {name: round(med["bf16"] / m, 3)
                                                 for name, m in med.items()}}
    ref = _prefill_hidden(engines["fp8"], n)
    drift: dict[str, float] = {}
    for name, eng, spec in configs:
        if name == "fp8":
            continue
        with setting(spec) if spec else contextlib.nullcontext():
            h = _prefill_hidden(engines[eng], n)
        drift[name] = float((h - ref).norm() / ref.norm())
    out["hidden_rel_diff_from_fp8"] = drift
    print(json.dumps(out), flush=True)
    engines.clear()
    free()
    return out


def prefill_section(args: argparse.Namespace, ctx: dict[str, Any]) -> dict[str, Any]:
    """FP8 both ways: one activation scale per row (cuBLAS) and per row and 128 columns
    (the Triton block-scaled kernel; engine/quant/fp8_linear.ACT_GROUP)."""
    import engine.quant.fp8_linear as fl

    n = args.prefill_tokens
    out: dict[str, Any] = {"tokens": n, "act_group": fl.ACT_GROUP}
    for name, quant in (("bf16", None), ("fp8", args.quantization)):
        eng = build(ctx, quant, args)
        ms = _prefill_ms(eng, n)
        out[f"{name}_ms"] = round(ms, 2)
        out[f"{name}_tok_s"] = round(n / ms * 1e3, 1)
        if quant is not None:
            default = fl.ACT_GROUP
            for group in (0, 128):
                fl.ACT_GROUP = group
                gms = _prefill_ms(eng, n)
                out[f"fp8_act_group{group}_tok_s"] = round(n / gms * 1e3, 1)
            fl.ACT_GROUP = default
            for spec in args.variant_list:  # e.g. engine.quant.fp8_input.FUSED=False
                with setting(spec):
                    vms = _prefill_ms(eng, n)
                out[f"fp8_{spec}_ms"] = round(vms, 2)
                out[f"fp8_{spec}_tok_s"] = round(n / vms * 1e3, 1)
            out["fp8_again_ms"] = round(_prefill_ms(eng, n), 2)  # drift across the variants
        del eng
        free()
    out["fp8_speedup"] = round(out["fp8_tok_s"] / out["bf16_tok_s"], 3)
    print(json.dumps(out), flush=True)
    return out


def _prefill_kernels(engine: Any, n: int) -> dict[str, Any]:
    """One n-token prefill (after _prefill_ms has warmed it) under torch.profiler: each
    kernel name's CUDA ms and launches, largest first."""
    from moe_profile import kernel_totals
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _prefill_ms(engine, n, runs=3, warm=1)
    rows = [{"kernel": name, "ms": round(ms, 3), "count": round(c, 1)}
            for name, ms, c in kernel_totals(prof, 3)]  # three runs: per-prefill figures
    return {"kernel_ms": round(sum(r["ms"] for r in rows), 2), "kernels": rows}


def prefill_profile_section(args: argparse.Namespace, ctx: dict[str, Any]) -> dict[str, Any]:
    """Where a prefill's time goes, bf16 against FP8: the kernel table of one
    --prefill-tokens prefill each (what bounds FP8's prefill speed-up)."""
    n = args.prefill_tokens
    out: dict[str, Any] = {"tokens": n}
    for name, quant in (("bf16", None), ("fp8", args.quantization)):
        eng = build(ctx, quant, args)
        out[f"{name}_ms"] = round(_prefill_ms(eng, n), 2)
        out[name] = _prefill_kernels(eng, n)
        print(f"prefill profile {name}: {out[f'{name}_ms']} ms, kernels "
              f"{out[name]['kernel_ms']} ms", flush=True)
        for row in out[name]["kernels"][:25]:
            print(f"  {row['ms']:8.3f} ms  {row['count']:6.1f}x  {row['kernel']}", flush=True)
        del eng
        free()
    return out


def profile_section(args: argparse.Namespace, ctx: dict[str, Any]) -> dict[str, Any]:
    from moe_profile import profile_table

    out: dict[str, Any] = {}
    for name, quant in (("bf16", None), ("fp8", args.quantization)):
        eng = build(ctx, quant, args)
        print(f"profile: {name}", flush=True)
        out[name] = profile_table(eng, args.batch_list, args.context_list, args.steps)
        del eng
        free()
    out["fp8_vs_bf16"] = [kernel_diff(b, f) for b, f in zip(out["bf16"], out["fp8"],
                                                              strict=True)]
    for d in out["fp8_vs_bf16"]:
        print(json.dumps({k: v for k, v in d.items() if k != "kernels"}), flush=True)
        for row in d["kernels"][:20]:
            print(f"  bf16 {row['bf16_ms']:8.4f}  fp8 {row['fp8_ms']:8.4f} ms/step  "
                  f"{row['kernel']}", flush=True)
    return out


def kernel_diff(bf16: dict[str, Any], fp8: dict[str, Any]) -> dict[str, Any]:
    """One point's kernels by name, bf16's and FP8's ms per step side by side, the names
    where the two differ most first."""
    a = {r["kernel"]: r["ms_per_step"] for r in bf16.get("kernels", [])}
    b = {r["kernel"]: r["ms_per_step"] for r in fp8.get("kernels", [])}
    rows = [{"kernel": k, "bf16_ms": a.get(k, 0.0), "fp8_ms": b.get(k, 0.0)}
            for k in set(a) | set(b)]
    rows.sort(key=lambda r: -max(r["bf16_ms"], r["fp8_ms"]))
    return {"batch": fp8.get("batch"), "context": fp8.get("context"),
            "bf16_kernel_ms": bf16.get("kernel_ms_per_step"),
            "fp8_kernel_ms": fp8.get("kernel_ms_per_step"),
            "bf16_kernels": bf16.get("kernels_per_step"),
            "fp8_kernels": fp8.get("kernels_per_step"), "kernels": rows}


SECTIONS: dict[str, Section] = {"decode": decode_section, "prefill": prefill_section,
                                "pdl": pdl_section, "profile": profile_section,
                                "gemm": gemm_section, "prefill_ab": prefill_ab_section,
                                "prefill_profile": prefill_profile_section}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="decode,prefill",
                    help=f"comma-separated, of {sorted(SECTIONS)}")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="512")
    ap.add_argument("--gemm-rows", default="32,64,128,256", help="the gemm section's rows")
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", default="fp8", choices=("fp8", "fp8-all"),
                    help="FP8's --quantization: fp8 leaves the first and last decoder layers "
                         "in bf16 (engine/quant/scheme.py); fp8-all quantizes all of them, "
                         "as an FP8 per-channel checkpoint that ignores only lm_head runs")
    ap.add_argument("--variants", default="",
                    help="pdl section: FP8 (PDL on) also with each of these settings, "
                         "'module.NAME=value' each, ';' between them")
    ap.add_argument("--out", default="bench/results/fp8_h200.json")
    args = ap.parse_args()
    args.variant_list = [v for v in args.variants.split(";") if v]
    args.gemm_row_list = [int(r) for r in args.gemm_rows.split(",") if r]
    args.batch_list = [int(b) for b in args.batches.split(",") if b]
    args.context_list = [int(c) for c in args.contexts.split(",") if c]
    unknown = [s for s in args.sections.split(",") if s not in SECTIONS]
    if unknown:
        ap.error(f"--sections: unknown {unknown} (known: {sorted(SECTIONS)})")
    cfg_dir = tempfile.mkdtemp()
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump(LLAMA3_8B, f)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "model": "Llama-3-8B shape, dummy",
        "fp8": f"--quantization {args.quantization} (per-channel weights, per-token "
               "activations)",
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    ctx: dict[str, Any] = {"cfg_dir": cfg_dir, "hbm_tb_s": hbm_read_tbps()}
    result["hbm_read_tb_s"] = round(ctx["hbm_tb_s"], 3)
    print("HBM read TB/s", result["hbm_read_tb_s"], flush=True)
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            result[name] = SECTIONS[name](args, ctx)
        except Exception as e:  # keep the other sections; the error is the result
            result[name] = {"error": repr(e)[:500]}
            print(name, "error", repr(e)[:500], flush=True)
        result[f"{name}_s"] = round(time.perf_counter() - t0, 1)
    if "fp8_read_bytes" in ctx:
        result["fp8_step_read_bytes"] = ctx["fp8_read_bytes"]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
