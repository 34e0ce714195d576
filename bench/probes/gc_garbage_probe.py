"""Runs a module as ``python -m`` would, with its garbage collections timed and, with
``--save-all``, the cyclic garbage they find counted by type: which of a serving process's
objects only the cyclic collector frees, and how long the collections that free them stop
the process. Lines go to stdout: ``GCPAUSE gen G <ms> ms collected N pid P at T`` for each
collection of at least --min-ms (and every full one), T its start in Unix seconds, to set
beside a bench record's stamps, P the process (the router's mirror frontends, started
without this probe, write to the same log but print no such lines);
``GARBAGE <count> [(type, n), ...]`` whenever --save-all has kept more than --report-over
objects (then cleared). ``--walked`` adds to each GCPAUSE line how many objects that
collection walked (its generation and the younger ones, counted before it starts and off
its clock), ``--walked-types N`` their N most common types: what the requests in flight
keep alive, per request.

    python bench/probes/gc_garbage_probe.py [--save-all] -m deploy.cli router ...

Under bench/serving_path_gpu.sh, SERVE_PY="python3 bench/probes/gc_garbage_probe.py
--save-all" runs the router and the workers' gRPC processes so (their logs get the lines;
the engine processes are spawned and run without it). ``--save-all`` keeps what it counts
until the report, so its pauses are not the plain process's.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import runpy
import sys
import time
from typing import Any


def _walked(gen: int, types: int) -> tuple[int, str]:
    """How many tracked objects a collection of ``gen`` walks (its generation and the younger
    ones), and with ``types`` the most common of their types."""
    objs = [o for g in range(gen + 1) for o in gc.get_objects(g)]
    kinds = ""
    if types:
        count = collections.Counter(type(o).__qualname__ for o in objs)
        kinds = " types " + ", ".join(f"{k} {n}" for k, n in count.most_common(types))
    n = len(objs)
    del objs
    return n, kinds


def install(save_all: bool, min_ms: float, report_over: int, walked: bool = False,
            walked_types: int = 0) -> None:
    if save_all:
        gc.set_debug(gc.DEBUG_SAVEALL)
    started = [0.0, 0.0]  # perf_counter, wall clock
    seen: list[Any] = [0, ""]  # walked objects, their types (at the start, before counting)

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        gen = info.get("generation")
        if phase == "start":
            if walked or walked_types:  # counted off the clock: the pause starts after it
                seen[:] = _walked(gen or 0, walked_types if (gen or 0) >= 1 else 0)
            started[:] = [time.perf_counter(), time.time()]
            return
        ms = (time.perf_counter() - started[0]) * 1e3
        if (ms >= min_ms or gen == 2) and not sys.stdout.closed:  # closed: at exit
            extra = f" walked {seen[0]}{seen[1]}" if (walked or walked_types) else ""
            print(f"GCPAUSE gen {gen} {ms:.2f} ms collected {info.get('collected')} "
                  f"pid {os.getpid()} at {started[1]:.3f}{extra}", flush=True)
        if save_all and len(gc.garbage) > report_over:
            kinds = collections.Counter(
                f"{getattr(type(o), '__module__', '?')}.{type(o).__qualname__}"
                for o in gc.garbage)
            print(f"GARBAGE {len(gc.garbage)} {kinds.most_common(12)}", flush=True)
            gc.garbage.clear()

    gc.callbacks.append(on_gc)


def main() -> None:
    if "-m" not in sys.argv:
        sys.exit("usage: gc_garbage_probe.py [--save-all] [--min-ms MS] -m MODULE [ARGS...]")
    at = sys.argv.index("-m")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save-all", action="store_true", help="count the cyclic garbage")
    ap.add_argument("--min-ms", type=float, default=1.0, help="report pauses this long")
    ap.add_argument("--report-over", type=int, default=2000,
                    help="report the kept garbage past this many objects")
    ap.add_argument("--walked", action="store_true",
                    help="add how many objects each reported collection walked")
    ap.add_argument("--walked-types", type=int, default=0, metavar="N",
                    help="and the N most common of their types (generations 1 and 2)")
    args = ap.parse_args(sys.argv[1:at])
    module, rest = sys.argv[at + 1], sys.argv[at + 2:]
    install(args.save_all, args.min_ms, args.report_over, args.walked, args.walked_types)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
