"""Human-readable views of a result document: a markdown table and P/D-vs-colocated ratios."""

from __future__ import annotations

from typing import Any

# (column, metric key, statistic); statistic None: a scalar metric.
COLUMNS: list[tuple[str, str, str | None]] = [
    ("req/s", "request_throughput", None),
    ("out tok/s", "output_throughput", None),
    ("out tok/s/worker", "output_throughput_per_worker", None),
    ("goodput req/s", "request_goodput", None),
    ("TTFT p50", "ttft_ms", "p50"), ("TTFT p99", "ttft_ms", "p99"),
    ("TTST p50", "ttst_ms", "p50"),
    ("TPOT p50", "tpot_ms", "p50"), ("TPOT p99", "tpot_ms", "p99"),
    ("ITL p50", "itl_ms", "p50"), ("ITL p99", "itl_ms", "p99"),
    ("E2E p50", "e2el_ms", "p50"),
    ("hold p50", "hold_ms", "p50"), ("hold p99", "hold_ms", "p99"),
    ("KV ms p50", "kv_transfer_ms", "p50"),
    # prompt tokens the workers' prefix caches held, and that share of the workload's ideal
    ("hit rate", "prefix_cache", "hit_rate"), ("of ideal", "prefix_cache", "of_ideal"),
]
RATIO_KEYS = ["output_throughput", "output_throughput_per_worker", "request_goodput",
              ("ttft_ms", "p50"), ("ttft_ms", "p99"), ("tpot_ms", "p50"), ("itl_ms", "p50"),
              ("e2el_ms", "p50")]


def metric(m: dict[str, Any], key: str, stat: str | None) -> float | None:
    v = m.get(key)
    if stat is not None:
        v = v.get(stat) if isinstance(v, dict) else None
    return v if isinstance(v, int | float) else None


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}"


def markdown_table(configs: list[dict[str, Any]]) -> str:
    """One row per (configuration, load point); latencies in ms."""
    head = ["config", "load", "ok", "failed", *(c for c, _, _ in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cfg in configs:
        for pt in cfg["points"]:
            m = pt["metrics"]
            cells = [cfg["label"], pt["label"], str(m["completed"]), str(m["failed"]),
                     *(_fmt(metric(m, k, s)) for _, k, s in COLUMNS)]
            lines.append("| " + " | ".join(cells) + " |")
    errors = [(cfg["label"], pt["label"], e, n) for cfg in configs for pt in cfg["points"]
              for e, n in pt["metrics"]["errors"].items()]
    for label, load, err, n in errors:
        lines.append(f"\nFAILED {n}x in {label} {load}: {err}")
    return "\n".join(lines)


def ratios(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """a / b for every load point both configurations ran (matched by label)."""
    b_points = {p["label"]: p for p in b["points"]}
    out = []
    for pa in a["points"]:
        pb = b_points.get(pa["label"])
        if pb is None:
            continue
        row: dict[str, Any] = {"load": pa["label"]}
        for k in RATIO_KEYS:
            key, stat = (k, None) if isinstance(k, str) else k
            va, vb = metric(pa["metrics"], key, stat), metric(pb["metrics"], key, stat)
            name = key if stat is None else f"{key}_{stat}"
            row[name] = va / vb if va is not None and vb else None
        out.append(row)
    return out


def ratio_table(a_label: str, b_label: str, rows: list[dict[str, Any]]) -> str:
    if not rows:
        return f"(no common load points between {a_label} and {b_label})"
    keys = [k for k in rows[0] if k != "load"]
    lines = [f"ratios {a_label} / {b_label} (throughput > 1 and latency < 1 favour "
             f"{a_label})", "| load | " + " | ".join(keys) + " |",
             "|" + "---|" * (len(keys) + 1)]
    for r in rows:
        lines.append(f"| {r['load']} | " + " | ".join(_fmt(r[k]) for k in keys) + " |")
    return "\n".join(lines)
