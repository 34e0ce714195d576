"""The per-kernel table of a MoE model's graphed decode step (``moe_bench.py --profile``):
torch.profiler's CUDA time and launches per step of each kernel, at each (batch, context),
and when the GPU was busy (``gpu_timeline``). Where the decode benchmark says how far a step
is from its byte floor, this says which kernels the step's time goes to. With PDL on, a
kernel's recorded time includes its wait for the one before: for each kernel's own time,
profile with ``kernels.pdl.ENABLED = False`` (bench/RESULTS.md, session 46).
``prefill_kernels`` does the same for one prefill (``--profile`` with
``--prefill-tokens``): what keeps it under the matmul rate."""

from __future__ import annotations

import json
import time
from typing import Any

import torch


def kernel_totals(prof: Any, per: int) -> list[tuple[str, float, float]]:
    """A torch.profiler run's CUDA kernels by name (cut to 120 characters): (name, ms,
    launches), each divided by `per` (the steps or runs profiled), largest time first."""
    kern: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kern.setdefault(e.name[:120], [0.0, 0])
            k[0] += e.device_time_total
            k[1] += 1
    return [(name, us / per / 1e3, n / per)
            for name, (us, n) in sorted(kern.items(), key=lambda kv: -kv[1][0])]


def gpu_timeline(prof: Any, per: int) -> dict[str, Any]:
    """When the GPU ran: the union of the CUDA events' intervals (busy) and their extent
    (span), each per step, and the last step's events in order (name, start after the
    first, duration; µs). With PDL a kernel's recorded time includes its wait on the one
    before, so durations overlap and their sum overstates the work; busy does not, and
    the gaps in the timeline are where no kernel ran."""
    iv = sorted((e.time_range.start, e.time_range.end, e.name[:80]) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)
    if not iv:
        return {}
    busy, cur_s, cur_e = 0.0, iv[0][0], iv[0][1]
    for s, e, _ in iv[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    last = iv[-max(1, len(iv) // per):]
    t0 = last[0][0]
    return {"gpu_busy_ms_per_step": round(busy / per / 1e3, 4),
            "gpu_span_ms_per_step": round((iv[-1][1] - iv[0][0]) / per / 1e3, 4),
            "last_step": [[n, round(s - t0, 2), round(e - s, 2)] for s, e, n in last]}


def profile_point(engine: Any, batch: int, context: int, steps: int) -> dict[str, Any]:
    """Per-kernel GPU time of the graphed decode step at (batch, context): torch.profiler
    over `steps` steps after a warm-up, each kernel name's CUDA time and launches per step,
    largest first. Kernels in a replayed CUDA graph are recorded one by one (CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps * 2 + 16, ignore_eos=True)
    ids = []
    for i in range(batch):
        blocks = engine.reserve(context)
        if blocks is None:
            break
        rid = f"prof-{batch}-{context}-{i}"
        engine.add_prefilled(rid, [1 + (5 * i + j) % 1000 for j in range(context)], params,
                             blocks, first_token=2)
        ids.append(rid)
    if len(ids) < batch:
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        return {"batch": batch, "context": context, "skipped": "KV does not fit"}
    for _ in range(4):  # prefilled requests join; graphs replay from here on
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / steps * 1e3
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    rows = [{"kernel": name, "ms_per_step": round(ms, 4), "count_per_step": round(n, 2)}
            for name, ms, n in kernel_totals(prof, steps)]
    return {"batch": batch, "context": context, "steps": steps,
            "step_wall_ms_under_profiler": round(wall_ms, 3),
            "kernel_ms_per_step": round(sum(r["ms_per_step"] for r in rows), 3),
            "kernels_per_step": round(sum(r["count_per_step"] for r in rows), 1),
            **gpu_timeline(prof, steps), "kernels": rows}


def profile_table(engine: Any, batches: list[int], contexts: list[int],
                  steps: int) -> list[dict[str, Any]]:
    """profile_point at every (batch, context), each printed with its 30 largest kernels as
    it ends; a point that raises is recorded with its error and the others still run."""
    prof = []
    for ctx in contexts:
        for b in batches:
            try:
                p = profile_point(engine, b, ctx, steps)
            except Exception as e:
                p = {"batch": b, "context": ctx, "error": repr(e)[:300]}
            print(json.dumps({k: v for k, v in p.items() if k not in ("kernels", "last_step")}),
                  flush=True)
            for row in p.get("kernels", [])[:30]:
                print(f"  {row['ms_per_step']:8.4f} ms  {row['count_per_step']:6.1f}/step"
                      f"  {row['kernel']}", flush=True)
            prof.append(p)
    return prof


def prefill_kernels(engine: Any, tokens: int, runs: int = 2) -> dict[str, Any]:
    """One `tokens`-token prompt prefilled `runs` times under torch.profiler (after one
    unprofiled run that compiles its shapes): each kernel name's CUDA ms and launches per
    prefill, largest first, and the wall time per prefill under the profiler."""
    from fresh_prefill import fresh_prompt, prefill_uncached
    from torch.profiler import ProfilerActivity, profile

    def one(r: int) -> None:
        prefill_uncached(engine, f"prefill-prof-{r}", fresh_prompt(tokens))

    one(0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for r in range(runs):
            one(1 + r)
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / runs * 1e3
    rows = [{"kernel": name, "ms": round(ms, 3), "count": round(n, 1)}
            for name, ms, n in kernel_totals(prof, runs)]
    out = {"tokens": tokens, "wall_ms_under_profiler": round(wall_ms, 2),
           "kernel_ms": round(sum(r["ms"] for r in rows), 2), "kernels": rows}
    print(json.dumps({k: v for k, v in out.items() if k != "kernels"}), flush=True)
    for row in rows[:30]:
        print(f"  {row['ms']:8.3f} ms  {row['count']:6.1f}x  {row['kernel']}", flush=True)
    return out
