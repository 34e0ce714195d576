"""Triton compiles while serving, named: the warm-up's blind spots show up in the log.

A kernel specialization Triton has not compiled in this process costs ~0.5-2.5 s the first
time a step needs it (engine/warmup.py), and every request in that step, and every decode
waiting behind it, sees the stall as TTFT or an inter-token gap. The warm-up runs the shapes
a server meets; when traffic finds one it missed, this says which kernel and which
specialization, so the next warm-up covers it, instead of leaving an unexplained p99.

Triton calls ``knobs.runtime.jit_cache_hook`` before each compile (an in-memory cache miss;
an on-disk hit still passes through it, quickly) and ``jit_post_compile_hook`` after. The
watch counts them and times each; once the engine is serving it logs every compile as a
warning. Hooks already installed by someone else (a profiler) still run, after ours.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("pdserve.engine")

Hook = Callable[..., Any]


class CompileWatch:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.serving = False  # set once the warm-up is over: compiles from then on are warned
        self.compiles = 0  # every compile the hooks saw
        self.compile_s = 0.0
        self.while_serving = 0  # of those, the ones after serving began
        self._started: dict[str, float] = {}  # specialization key -> its compile's start
        self._lock = threading.Lock()  # TP followers' threads compile too
        self._before: Hook | None = None
        self._after: Hook | None = None
        self._knobs: Any = None

    def before(self, **kw: Any) -> Any:
        with self._lock:
            self._started[str(kw.get("key"))] = self.clock()
        return self._before(**kw) if self._before is not None else None

    def after(self, **kw: Any) -> Any:
        now = self.clock()
        with self._lock:
            started = self._started.pop(str(kw.get("key")), now)
            self.compiles += 1
            self.compile_s += now - started
            if self.serving:
                self.while_serving += 1
        if self.serving:
            log.warning("Triton compiled %s while serving (%.0f ms): a shape not compiled "
                        "before serving (engine/warmup.py misses it, or --no-warmup)",
                        describe(kw), (now - started) * 1e3)
        return self._after(**kw) if self._after is not None else None

    def install(self) -> bool:
        """Hooks into this process's Triton; False where Triton (or its hooks) is absent."""
        try:
            from triton import knobs
        except ImportError:
            return False
        rt = getattr(knobs, "runtime", None)
        if rt is None or not hasattr(rt, "jit_cache_hook"):
            return False
        self._knobs = rt
        self._before, self._after = rt.jit_cache_hook, rt.jit_post_compile_hook
        rt.jit_cache_hook, rt.jit_post_compile_hook = self.before, self.after
        return True

    def uninstall(self) -> None:
        if self._knobs is not None:
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = (
                self._before, self._after)
            self._knobs = None


def describe(kw: dict[str, Any]) -> str:
    """The kernel and what its specialization fixed: constexpr values (integer arguments
    equal to 1 among them) and the arguments specialized as divisible by 16. Triton's own
    ``repr`` argument pairs parameters with the characters of a string in Triton 3.6-3.7."""
    fn = kw.get("fn")
    name = getattr(fn, "name", None) or "?"
    info = kw.get("compile") or {}
    names = list((info.get("signature") or {}).keys())

    def arg(path: Any) -> str:
        i = path[0] if isinstance(path, tuple) and path else path
        return names[i] if isinstance(i, int) and 0 <= i < len(names) else str(path)

    consts = ", ".join(f"{arg(p)}={v}" for p, v in (info.get("constants") or {}).items())
    configs = info.get("configs") or [{}]
    div16 = ", ".join(arg(p) for p, attrs in (configs[0] or {}).items()
                      if any("divisibility" in str(a) for a in attrs))
    return f"{name}({consts}; divisible by 16: {div16 or 'none'})"


_PROCESS: CompileWatch | None = None


def process_watch() -> CompileWatch:
    """This process's watch, installed on first use (Triton's hooks are process-wide)."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = CompileWatch()
        _PROCESS.install()
    return _PROCESS
