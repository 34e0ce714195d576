"""Every host<->device sync torch's CUDA sync debug mode sees while a callable runs, each
with the engine and kernel frames that asked for it (the probes' shared watcher)."""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch


def syncs_in(fn: Callable[[], Any], frames: int = 4) -> list[str]:
    """Runs fn under torch.cuda.set_sync_debug_mode("warn"); one line per sync: the
    warning's start, then the last ``frames`` frames in engine/ or kernels/."""
    found: list[str] = []

    def show(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        where = [f"{fr.filename.split('/work/')[-1]}:{fr.lineno} {fr.name}"
                 for fr in traceback.extract_stack()[:-1]
                 if "/engine/" in fr.filename or "/kernels/" in fr.filename]
        found.append(f"{str(message)[:80]} <- " + " | ".join(where[-frames:]))

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown
    return found
