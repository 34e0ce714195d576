"""The planner's simulator against reality, in one command.

    python bench/plan_validate.py [--profile p.json] [--num-prompts 24] [--out-dir DIR]

1. Profiles one worker (``pdserve plan profile``: SmolLM2, CPU, ``--threads 1``) unless
   ``--profile`` is given.
2. For two workloads (long prompts with short outputs; short prompts with long outputs)
   at two Poisson rates each (a quarter and half of two workers' estimated capacity, or
   ``--rates``), runs ``pdserve bench --compare`` (1P1D and 2 colocated, each worker on one
   thread, started by the bench) and simulates the same workloads on the profile.
3. Writes ``validate.json`` and ``validate.md``: TTFT and TPOT p50, measured and simulated,
   their ratio (within 25% is the bar), and whether the simulator ranks 1P1D against 2
   colocated as the measurement does (by TTFT p50 and by TPOT p50).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from deploy.plan.planner import Workload  # noqa: E402
from deploy.plan.profile import Profile  # noqa: E402
from deploy.plan.sim_worker import EngineLimits  # noqa: E402
from deploy.plan.simulator import Split, simulate  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PDSERVE = [sys.executable, "-m", "deploy.cli"]
WORKLOADS = {"long-prompt": (384, 4), "short-prompt": (16, 48)}
CONFIGS = {"1P1D": Split(1, 1, 0), "2C": Split(0, 0, 2)}
TOLERANCE = 0.25
ROUTER_POLICY = "least_loaded"  # `pdserve router`'s default, which the bench's clusters run


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=os.path.join(HERE, ".."))


def capacity_rps(p: Profile, prompt: int, output: int) -> float:
    """One worker serving one request at a time, a lower bound of its capacity."""
    return 1e3 / (p.prefill_ms(prompt) + (output - 1) * p.decode_ms(1, prompt + output / 2))


def measured(doc: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, cfg in zip(CONFIGS, doc["configs"], strict=True):  # --compare: P/D first
        for pt in cfg["points"]:
            m = pt["metrics"]
            out.setdefault(name, {})[str(pt["rate"])] = {
                "ttft_p50_ms": m["ttft_ms"]["p50"], "tpot_p50_ms": m["tpot_ms"]["p50"],
                "completed": m["completed"], "failed": m["failed"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--rates", default="", help="RATE,RATE per workload for both (default: "
                    "0.25 and 0.5 of two workers' estimated capacity)")
    ap.add_argument("--out-dir", default="bench/results/plan_validate")
    ap.add_argument("--reps", type=int, default=7,
                    help="timed repetitions per profile point (the median is kept)")
    ap.add_argument("--reuse-bench", action="store_true",
                    help="simulate against the bench_<workload>.json already in --out-dir "
                         "(their rates) instead of measuring again")
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    prof_path = a.profile or os.path.join(a.out_dir, "profile.json")
    if not a.profile:
        _run([*PDSERVE, "plan", "profile", "--threads", "1", "--out", prof_path,
              "--prefill-tokens", "16,64,128,256,384,512", "--decode-batch", "1,2,4",
              "--decode-context", "32,128,512", "--reps", str(a.reps)])
    profile = Profile.load(prof_path)
    rows: list[dict[str, Any]] = []
    for wname, (prompt, output) in WORKLOADS.items():
        cap = 2 * capacity_rps(profile, prompt, output)
        rates = ([float(r) for r in a.rates.split(",")] if a.rates
                 else [round(0.25 * cap, 3), round(0.5 * cap, 3)])
        res = os.path.join(a.out_dir, f"bench_{wname}.json")
        if a.reuse_bench:
            with open(res, encoding="utf-8") as f:
                rates = [pt["rate"] for pt in json.load(f)["configs"][0]["points"]]
        else:
            _run([*PDSERVE, "bench", "--compare", "--producers", "1", "--consumers", "1",
                  "--input-len", str(prompt), "--output-len", str(output), "--ignore-eos",
                  "--num-prompts", str(a.num_prompts), "--rate", ",".join(map(str, rates)),
                  "--result-json", res, "--log-dir", os.path.join(a.out_dir, f"logs_{wname}")])
        with open(res, encoding="utf-8") as f:
            doc_b = json.load(f)
        meas = measured(doc_b)
        for rate in rates:
            # the bench's own arrivals (its seeded Poisson draw: same generator, same seed),
            # so both sides see the same bursts; the router's default policy
            n, seed = doc_b["args"]["num_prompts"], doc_b["args"]["seed"]
            work = Workload(rate, ((prompt, output),) * n, seed=seed)
            for cname, split in CONFIGS.items():
                m = simulate(profile, split, work.arrivals(), EngineLimits(64, 512),
                             policy=ROUTER_POLICY)
                real = meas[cname][str(rate)]
                rows.append({"workload": wname, "prompt": prompt, "output": output,
                             "rate": rate, "config": cname,
                             "measured_ttft_p50_ms": real["ttft_p50_ms"],
                             "sim_ttft_p50_ms": m["ttft_ms"]["p50"],
                             "measured_tpot_p50_ms": real["tpot_p50_ms"],
                             "sim_tpot_p50_ms": m["tpot_ms"]["p50"],
                             "measured_failed": real["failed"]})
    for r in rows:
        for k in ("ttft", "tpot"):
            meas_v, sim_v = r[f"measured_{k}_p50_ms"], r[f"sim_{k}_p50_ms"]
            r[f"{k}_ratio"] = sim_v / meas_v if meas_v else None
            r[f"{k}_within"] = meas_v is not None and abs(sim_v / meas_v - 1) <= TOLERANCE
    rankings = []
    for wname in WORKLOADS:
        for rate in sorted({r["rate"] for r in rows if r["workload"] == wname}):
            pd, co = (next(r for r in rows if r["workload"] == wname and r["rate"] == rate
                           and r["config"] == c) for c in CONFIGS)
            for k in ("ttft", "tpot"):
                real = pd[f"measured_{k}_p50_ms"] < co[f"measured_{k}_p50_ms"]
                sim = pd[f"sim_{k}_p50_ms"] < co[f"sim_{k}_p50_ms"]
                rankings.append({"workload": wname, "rate": rate, "metric": k,
                                 "measured_better": "1P1D" if real else "2C",
                                 "sim_better": "1P1D" if sim else "2C", "match": real == sim})
    doc = {"profile": profile.to_json(), "rows": rows, "rankings": rankings,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_average": os.getloadavg()}
    with open(os.path.join(a.out_dir, "validate.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    lines = ["| workload | rate | config | TTFT p50 meas | sim | ratio | TPOT p50 meas | sim | "
             "ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['rate']} | {r['config']} | "
                     f"{r['measured_ttft_p50_ms']:.1f} | {r['sim_ttft_p50_ms']:.1f} | "
                     f"{r['ttft_ratio']:.2f} | {r['measured_tpot_p50_ms']:.1f} | "
                     f"{r['sim_tpot_p50_ms']:.1f} | {r['tpot_ratio']:.2f} |")
    lines.append("")
    lines += [f"ranking {g['workload']} @ {g['rate']} by {g['metric']}: measured "
              f"{g['measured_better']}, simulated {g['sim_better']} "
              f"({'match' if g['match'] else 'MISMATCH'})" for g in rankings]
    text = "\n".join(lines)
    with open(os.path.join(a.out_dir, "validate.md"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
