"""bench/moe_profile.py's GPU timeline: overlapping kernel intervals (PDL's early launches)
count once in the busy time, gaps count in the span only, and the last step's events are
listed from its first start. The events stand in for torch.profiler's (a seam: the real
profiler needs a GPU, where `moe_bench.py --profile` runs it)."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from moe_profile import gpu_timeline  # noqa: E402

CUDA = torch.autograd.DeviceType.CUDA


def _event(name: str, start: float, end: float, device=CUDA) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=device,
                           time_range=SimpleNamespace(start=start, end=end))


def test_busy_counts_overlap_once_and_span_counts_gaps():
    step = [("norm", 0, 10), ("gemm", 5, 12), ("attn", 20, 25)]  # 5 µs overlap, 8 µs gap
    events = [_event(n, s + off, e + off) for off in (0, 100) for n, s, e in step]
    events.append(_event("host-side", 0, 500, device=torch.autograd.DeviceType.CPU))
    t = gpu_timeline(SimpleNamespace(events=lambda: events), per=2)
    assert t["gpu_busy_ms_per_step"] == 0.017  # (12 + 5) µs a step
    assert t["gpu_span_ms_per_step"] == 0.0625  # 125 µs over two steps
    assert t["last_step"] == [["norm", 0, 10], ["gemm", 5, 7], ["attn", 20, 5]]


def test_no_cuda_events_gives_nothing():
    events = [_event("host-side", 0, 5, device=torch.autograd.DeviceType.CPU)]
    assert gpu_timeline(SimpleNamespace(events=lambda: events), per=1) == {}
