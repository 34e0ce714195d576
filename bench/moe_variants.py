"""``moe_bench.py --variants``: the MoE model's decode step under module settings, interleaved
(``--prefill-variants``: its prefill; ``--kernel-variants``: the fused MoE kernel and the MLA
decode kernel alone).

Each variant is a ';'-free list of ``package.module.NAME=value`` settings joined by ','
(the empty variant is the tree's defaults); a round times every (batch, context) point under
each variant in turn, the decode graphs captured again for each, and --repeats rounds
alternate so that drift over the run shows as spread, not as a difference. The result per
point: each variant's step times, and its best against the defaults' best.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

from decode_bench import engine_point, recapture
from fp8_bench import setting


@contextlib.contextmanager
def settings(variant: str) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for spec in (s for s in variant.split(",") if s):
            stack.enter_context(setting(spec))
        yield


def variants_section(engine: Any, variants: list[str], batches: list[int],
                     contexts: list[int], steps: int, rounds: int) -> list[dict[str, Any]]:
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for _ in range(rounds):
        for v in ["", *variants]:
            with settings(v):
                recapture(engine)
                for c in contexts:
                    for b in batches:
                        p = engine_point(engine, b, c, steps, repeats=1)
                        row = rows.setdefault((b, c), {"batch": b, "context": c})
                        row.setdefault(v or "defaults", []).append(
                            p.get("engine_step_ms", p.get("skipped")))
    recapture(engine)  # the defaults' graphs again for whatever runs next
    out = list(rows.values())
    for r in out:
        base = min(x for x in r["defaults"] if isinstance(x, float))
        r["best_over_defaults"] = {
            v: round(min(x for x in r[v] if isinstance(x, float)) / base, 3)
            for v in variants if any(isinstance(x, float) for x in r[v])}
    return out


def prefill_variants_section(engine: Any, variants: list[str], tokens: int, mm_tflops: float,
                             rounds: int) -> dict[str, Any]:
    """The --prefill-tokens prefill (moe_bench.prefill_point: best of its 2 timed runs after
    a compiling one) under the defaults and each variant, rounds alternating; per variant
    its ms per round and its best against the defaults' best."""
    from moe_bench import prefill_point

    runs: dict[str, list[float]] = {}
    best: dict[str, dict[str, Any]] = {}  # each variant's fastest point
    for _ in range(rounds):
        for v in ["", *variants]:
            with settings(v):
                p = prefill_point(engine, tokens, mm_tflops)
            key = v or "defaults"
            runs.setdefault(key, []).append(p["prefill_ms"])
            if key not in best or p["prefill_ms"] < best[key]["prefill_ms"]:
                best[key] = p
            print("prefill", key, p, flush=True)
    base = best["defaults"]["prefill_ms"]
    return {"tokens": tokens, "ms": runs,
            "best_over_defaults": {v: round(best[v]["prefill_ms"] / base, 3) for v in variants},
            "best_fraction_of_matmul_rate": {v: p["fraction_of_matmul_rate"]
                                             for v, p in best.items()}}


def kernel_variants_section(model: Any, hbm: float, variants: list[str], batches: list[int],
                            contexts: list[int], rounds: int) -> list[dict[str, Any]]:
    """The fused MoE kernel alone (moe_bench.kernel_point, per batch) and, for an MLA model,
    the MLA decode kernel alone (mla_kernel_point, per batch x context) under the defaults
    and each variant, rounds alternating; each captures its own graph, so a variant's
    module settings reach it. Per point: ms per round, and each variant's best against the
    defaults' best with its fraction of the HBM read rate."""
    from moe_bench import kernel_point, mla_kernel_point

    rows: dict[tuple[str, int, int], dict[str, Any]] = {}

    def add(kernel: str, b: int, c: int, v: str, p: dict[str, Any]) -> None:
        row = rows.setdefault((kernel, b, c), {"kernel": kernel, "batch": b, "context": c,
                                               "ms": {}, "fraction_of_hbm_read": {}})
        key = v or "defaults"
        row["ms"].setdefault(key, []).append(p.get("kernel_ms_all_layers"))
        frac = p.get("fraction_of_hbm_read")
        if frac is not None:
            best = row["fraction_of_hbm_read"].get(key, 0.0)
            row["fraction_of_hbm_read"][key] = max(best, frac)

    for _ in range(rounds):
        for v in ["", *variants]:
            with settings(v):
                for b in batches:
                    add("fused_moe", b, 0, v, kernel_point(model, b, hbm))
                    if model.cfg.is_mla:
                        for c in contexts:
                            add("mla_decode", b, c, v, mla_kernel_point(model, b, c, hbm))
    out = list(rows.values())
    for r in out:
        timed = {k: [x for x in ms if isinstance(x, float)] for k, ms in r["ms"].items()}
        if timed.get("defaults"):
            base = min(timed["defaults"])
            r["best_over_defaults"] = {k: round(min(x) / base, 3) for k, x in timed.items()
                                       if x and k != "defaults"}
        print(json.dumps(r), flush=True)
    return out


def variant_sections(args: Any, engine: Any, model: Any, hbm: float, mm_tflops: float,
                     batches: list[int], contexts: list[int]) -> dict[str, Any]:
    """moe_bench.py's --variants, --kernel-variants or --prefill-variants section, the one
    asked for ({} when none is)."""
    def listed(spec: str) -> list[str]:
        return [v for v in spec.split(";") if v]

    if args.variants:
        rows = variants_section(engine, listed(args.variants), batches, contexts, args.steps,
                                args.repeats)
        print(json.dumps(rows, indent=1))
        return {"variants": rows}
    if args.kernel_variants:
        return {"kernel_variants": kernel_variants_section(
            model, hbm, listed(args.kernel_variants), batches, contexts, args.repeats)}
    if args.prefill_variants:
        pv = prefill_variants_section(engine, listed(args.prefill_variants),
                                      args.prefill_tokens, mm_tflops, args.repeats)
        print(json.dumps(pv, indent=1))
        return {"prefill_variants": pv}
    return {}
