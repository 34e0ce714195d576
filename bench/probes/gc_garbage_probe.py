"""Runs a module as ``python -m`` would, with its garbage collections timed and, with
``--save-all``, the cyclic garbage they find counted by type: which of a serving process's
objects only the cyclic collector frees, and how long the collections that free them stop
the process. Lines go to stdout: ``GCPAUSE gen G <ms> ms collected N pid P at T`` for each
collection of at least --min-ms (and every full one), T its start in Unix seconds, to set
beside a bench record's stamps, P the process (the router's mirror frontends, started
without this probe, write to the same log but print no such lines);
``GARBAGE <count> [(type, n), ...]`` whenever --save-all has kept more than --report-over
objects (then cleared).

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


def install(save_all: bool, min_ms: float, report_over: int) -> None:
    if save_all:
        gc.set_debug(gc.DEBUG_SAVEALL)
    started = [0.0, 0.0]  # perf_counter, wall clock

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[:] = [time.perf_counter(), time.time()]
            return
        ms = (time.perf_counter() - started[0]) * 1e3
        gen = info.get("generation")
        if (ms >= min_ms or gen == 2) and not sys.stdout.closed:  # closed: at exit
            print(f"GCPAUSE gen {gen} {ms:.2f} ms collected {info.get('collected')} "
                  f"pid {os.getpid()} at {started[1]:.3f}", flush=True)
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
    args = ap.parse_args(sys.argv[1:at])
    module, rest = sys.argv[at + 1], sys.argv[at + 2:]
    install(args.save_all, args.min_ms, args.report_over)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
