"""A CPU-time sampler for any pdserve process, switched on by the environment.

Put this folder first on PYTHONPATH and set PDSERVE_CPU_SAMPLE_DIR; every Python process
whose command line contains PDSERVE_CPU_SAMPLE_MATCH (default: all) samples its main
thread's Python stack every millisecond of the process's CPU time (ITIMER_PROF, so idle
time costs no samples) and writes the folded stacks to DIR/<pid>.folded at exit. A fork
child (the engine process) inherits no timer: only the process that started is sampled.

Python frames only: CPU burnt in a C thread (grpc's event engine) is charged to whatever
the main thread was doing at that moment, typically the event loop's selector. Read the
result with bench/probes/cpu_sample_report.py.
"""

from __future__ import annotations

import os
import sys

_DIR = os.environ.get("PDSERVE_CPU_SAMPLE_DIR", "")
if _DIR and os.environ.get("PDSERVE_CPU_SAMPLE_MATCH", "") in " ".join(sys.argv):
    import atexit
    import collections
    import signal

    _counts: collections.Counter[str] = collections.Counter()
    _pid = os.getpid()

    def _sample(_sig: int, frame: object) -> None:
        parts = []
        f = frame
        while f is not None:
            co = f.f_code  # type: ignore[attr-defined]
            parts.append(f"{co.co_name} ({os.path.basename(co.co_filename)})")
            f = f.f_back  # type: ignore[attr-defined]
        _counts[";".join(reversed(parts))] += 1

    def _dump() -> None:
        if os.getpid() != _pid or not _counts:
            return
        os.makedirs(_DIR, exist_ok=True)
        with open(os.path.join(_DIR, f"{_pid}.folded"), "w") as out:
            out.write(f"# {' '.join(sys.argv)}\n")
            for stack, n in _counts.most_common():
                out.write(f"{stack} {n}\n")

    signal.signal(signal.SIGPROF, _sample)
    signal.setitimer(signal.ITIMER_PROF, 0.001, 0.001)
    atexit.register(_dump)
