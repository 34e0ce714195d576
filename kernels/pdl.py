"""Programmatic dependent launch (PDL, Hopper and later) for the small-batch decode chain.

A decode step at one to a few rows is ~300 short kernels: each FP8 GEMV streams its
weights, and between two of them an RMSNorm, RoPE, attention or SiLU kernel runs on a few
SMs while HBM sits idle, plus a launch gap each (~0.5 µs in a CUDA graph). With PDL a kernel
launched after another in the stream may start as soon as every program of the one before
has called ``launch_dependents``; it must then ``wait`` (griddepcontrol.wait: the kernel
before it has finished and its writes are visible) before it reads anything that kernel
wrote or writes anything it reads. What that buys is the launch: the next kernel's
programs are resident and waiting when the one before ends, instead of a graph node's gap
and ramp later. (Asking L2 for a GEMV's first weight tiles before its wait, which no kernel
writes, was tried too: every size from 256 bytes a row up made the step slower on the H200,
bench/RESULTS.md.)

The rules every kernel launched with ``launch_pdl`` here keeps (its first statement is
``follow()``, which does both):
* ``wait`` first, before any load or store (a kernel that never waits could finish before
  the one it follows, breaking the stream order the next kernel relies on, and its output
  may be memory the one before still reads, as a graph's pool reuses blocks);
* ``launch_dependents`` right after its own ``wait``, so at most two kernels overlap and
  the one started early only waits (or, later, after its last store: the K-split FP8 GEMM
  does, since its one-wave grid lost SM room to the next kernel's waiting programs;
  kernels/triton_fp8_split_gemm.PDL_DEPENDENTS).

Kernels not launched with PDL (cuBLAS, torch's own) keep plain stream order either way.
Off CUDA (the Triton interpreter has no griddepcontrol) and before sm_90 it is off, and
``ENABLED`` turns it off everywhere (``bench/fp8_bench.py --sections pdl`` times both).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

ENABLED = True


@functools.cache
def _capability(index: int) -> int:
    return int(torch.cuda.get_device_capability(index)[0])


def pdl_for(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL (and wait / launch dependents)."""
    return ENABLED and t.is_cuda and _capability(t.device.index or 0) >= 9


@triton.jit
def follow() -> None:
    """A PDL-launched kernel's first statement: ``wait``, then ``launch_dependents`` (the
    rules above, in the one order they allow)."""
    wait()
    launch_dependents()


@triton.jit
def wait() -> None:
    """griddepcontrol.wait: the kernel before this one has completed and its writes are
    visible (a no-op for a kernel launched without PDL)."""
    tl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def launch_dependents() -> None:
    """griddepcontrol.launch_dependents: the next kernel in the stream may start once every
    program of this one has got here (or exited)."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                              dtype=tl.int32, is_pure=False, pack=1)
