"""PNG plots of a result document (matplotlib, Agg backend, small files).

* ``<prefix>cdf_<config>.png``: latency CDFs (TTFT, TPOT, ITL, E2E), one line per load point;
* ``<prefix>throughput.png``: output throughput and goodput against the swept load.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

CDF_METRICS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E"))
DPI = 72  # keeps each PNG well under 100 KB for the repository


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower()


def _values(point: dict[str, Any], key: str) -> list[float]:
    vals: list[float] = []
    for r in point.get("requests", []):
        if not r["success"]:
            continue
        v = r.get(key)
        if isinstance(v, list):
            vals += [x for x in v if x is not None]
        elif v is not None:
            vals.append(v)
    return sorted(vals)


def _x(point: dict[str, Any]) -> float:
    """The swept quantity: the rate when finite, else the concurrency."""
    rate = point["rate"]
    if rate != "inf":
        return float(rate)
    return float(point["concurrency"] or math.nan)


def write_plots(doc: dict[str, Any], out_dir: str, prefix: str = "") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    os.makedirs(out_dir, exist_ok=True)
    written = []
    for cfg in doc["configs"]:
        fig, axes = plt.subplots(1, 4, figsize=(13, 3.2))
        for ax, (key, title) in zip(axes, CDF_METRICS, strict=True):
            for pt in cfg["points"]:
                vals = _values(pt, key)
                if vals:
                    ys = [(i + 1) / len(vals) for i in range(len(vals))]
                    ax.step(vals, ys, where="post", label=pt["label"])
            ax.set_title(f"{title} (ms)", fontsize=9)
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels overlap
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("CDF")
        axes[-1].legend(fontsize=7)
        fig.suptitle(f"{cfg['label']}: latency CDFs", fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{prefix}cdf_{_slug(cfg['label'])}.png")
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        written.append(path)
    written.append(_throughput_plot(doc, out_dir, prefix, plt))
    return written


def _throughput_plot(doc: dict[str, Any], out_dir: str, prefix: str, plt: Any) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    xlabel = "request rate (req/s)"
    for cfg in doc["configs"]:
        pts = sorted(cfg["points"], key=_x)
        if all(p["rate"] == "inf" for p in pts):
            xlabel = "concurrency"
        xs = [_x(p) for p in pts]
        axes[0].plot(xs, [p["metrics"]["output_throughput"] for p in pts], "o-",
                     label=cfg["label"])
        good = [p["metrics"].get("request_goodput") for p in pts]
        req = [p["metrics"]["request_throughput"] for p in pts]
        axes[1].plot(xs, req, "o--", label=f"{cfg['label']} throughput")
        if any(g is not None for g in good):
            axes[1].plot(xs, good, "s-", label=f"{cfg['label']} goodput")
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("requests/s")
    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{prefix}throughput.png")
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
