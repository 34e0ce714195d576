"""The probes' shared host-time report: one call of a function under cProfile, its top
functions by own and by cumulative time."""

from __future__ import annotations

import cProfile
import io
import pstats
from collections.abc import Callable


def profiled(run: Callable[[], float], top: int = 45) -> str:
    """Runs `run` (which returns its wall ms) once under cProfile; the report's text."""
    prof = cProfile.Profile()
    prof.enable()
    wall = run()
    prof.disable()
    out = io.StringIO()
    out.write(f"under cProfile: {wall:.2f} ms\n")
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(top)
        out.write(f"\n==== by {key}\n{s.getvalue()}")
    return out.getvalue()
