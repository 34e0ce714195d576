"""Is one commit's `pdserve bench --compare` within noise of another's? A verdict per point
and for the whole run, from the JSONs of alternating runs of both commits
(bench/protocol_compare.sh writes before_N.json and after_N.json).

Why a test and not "inside the other side's range": with two runs a side, a third run of
the *same* code lands outside the range of two others with probability 2/3, and a
comparison reads 6 points x 4 metrics. Some point then always looks off, and a different
one each time, which is what the idle runs showed. So each metric gets Welch's t-test and
the family of tests gets Holm's correction (the chance that any of them flags by luck stays
at alpha).

The sample is the run: one value per run and point (the p50 of TTFT, TPOT and end-to-end
latency, and the output throughput). Requests are not independent samples: the requests
of one run share its machine state, and treating them as such flagged points whose sign
flipped between two idle invocations of the same two commits. Two runs a side detect only
large differences; the power grows with --rounds of bench/protocol_compare.sh.

    python bench/compare_noise.py DIR [--alpha 0.05] [--out DIR/noise.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
from typing import Any

METRICS = ("ttft_ms_p50", "tpot_ms_p50", "e2el_ms_p50", "output_throughput")
LOWER_IS_BETTER = {"ttft_ms_p50": True, "tpot_ms_p50": True, "e2el_ms_p50": True,
                   "output_throughput": False}


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-12:
            break
    return h


def _inc_beta(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lead = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                    + a * math.log(x) + b * math.log(1.0 - x))
    if x < (a + 1.0) / (a + b + 2.0):
        return lead * _betacf(a, b, x) / a
    return 1.0 - lead * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with df degrees of freedom."""
    return _inc_beta(df / 2.0, 0.5, df / (df + t * t))


def welch(m1: float, v1: float, n1: int, m2: float, v2: float, n2: int) -> tuple[float, float]:
    """(t, two-sided p) of Welch's test for means m with variances v over n samples."""
    se2 = v1 / n1 + v2 / n2
    if se2 <= 0.0:
        return (0.0, 1.0) if m1 == m2 else (math.inf, 0.0)
    t = (m2 - m1) / math.sqrt(se2)
    df = se2 ** 2 / ((v1 / n1) ** 2 / max(n1 - 1, 1) + (v2 / n2) ** 2 / max(n2 - 1, 1))
    return t, t_two_sided_p(t, df)


def _points(path: str) -> dict[tuple[str, str], dict[str, Any]]:
    with open(path) as f:
        doc = json.load(f)
    return {(c["label"], p["label"]): p["metrics"]
            for c in doc["configs"] for p in c["points"]}


def holm(pvalues: list[float], alpha: float) -> list[bool]:
    """Which hypotheses Holm's step-down procedure rejects at family-wise level alpha."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    reject = [False] * len(pvalues)
    for rank, i in enumerate(order):
        if pvalues[i] > alpha / (len(pvalues) - rank):
            break
        reject[i] = True
    return reject


def compare(before: list[str], after: list[str], alpha: float) -> dict[str, Any]:
    b_runs, a_runs = [_points(p) for p in before], [_points(p) for p in after]
    keys = [k for k in b_runs[0] if all(k in r for r in b_runs + a_runs)]
    rows: list[dict[str, Any]] = []
    for key in keys:
        for metric in METRICS:
            bv = [_value(r[key], metric) for r in b_runs]
            av = [_value(r[key], metric) for r in a_runs]
            b = (sum(bv) / len(bv), _var(bv), len(bv))
            a = (sum(av) / len(av), _var(av), len(av))
            t, p = welch(*b, *a)
            change = (a[0] - b[0]) / b[0] if b[0] else 0.0
            rows.append({"config": key[0], "load": key[1], "metric": metric,
                         "before": bv, "after": av, "before_mean": b[0], "after_mean": a[0],
                         "change": change, "t": t, "p": p})
    flags = holm([r["p"] for r in rows], alpha)
    for r, flag in zip(rows, flags, strict=True):
        worse = (r["change"] > 0) == LOWER_IS_BETTER[r["metric"]]
        r["verdict"] = ("worse" if worse else "better") if flag else "within noise"
    return {"alpha": alpha, "correction": "Holm over all rows", "before": before,
            "after": after, "rows": rows,
            "worse": [f"{r['config']} {r['load']} {r['metric']}" for r in rows
                      if r["verdict"] == "worse"]}


def _value(metrics: dict[str, Any], name: str) -> float:
    if name.endswith("_p50"):
        return float(metrics[name[:-4]]["p50"])
    return float(metrics[name])


def _var(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1)


def markdown(result: dict[str, Any]) -> str:
    lines = ["| config | load | metric | before | after | change | p | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['config']} | {r['load']} | {r['metric']} | {r['before_mean']:.1f} "
                     f"| {r['after_mean']:.1f} | {r['change']:+.1%} | {r['p']:.3f} "
                     f"| {r['verdict']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="holds before_N.json and after_N.json")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--out", default=None, help="JSON (default: DIR/noise.json)")
    args = ap.parse_args()
    before = sorted(glob.glob(os.path.join(args.dir, "before_*.json")))
    after = sorted(glob.glob(os.path.join(args.dir, "after_*.json")))
    if not before or not after:
        raise SystemExit(f"{args.dir}: needs before_N.json and after_N.json")
    result = compare(before, after, args.alpha)
    with open(args.out or os.path.join(args.dir, "noise.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(markdown(result))
    print(f"\nworse beyond noise (Holm, alpha {args.alpha}): {result['worse'] or 'none'}")


if __name__ == "__main__":
    main()
