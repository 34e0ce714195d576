"""Kernel tests: on a machine without CUDA, the Triton kernels run in Triton's interpreter.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it is set here,
at conftest import, before any test module imports ``kernels.triton_*`` (the ``kernels``
package imports none of them).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # A test module collected before this folder (tests/bench ... tests/engine, in a
    # whole-suite run) that imports a kernels.triton_* module at its top has already defined
    # those @triton.jit functions for the compiler: every interpreted kernel that calls one
    # then fails with "Cannot call @triton.jit'd outside of the scope of a kernel". Name it.
    early = sorted(m for m in sys.modules if m.startswith("kernels.triton_"))
    if early and not os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError(
            f"{', '.join(early)} imported before TRITON_INTERPRET was set: a test module "
            "collected earlier imports it at module level; import it inside the test")
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

# ||out - ref|| / ||ref|| bounds. The references compute in float32 from the same stored
# values, so the gap is the kernels' own rounding: bf16/fp16 probabilities fed to the PV
# product on the GPU, and the interpreter's float32 -> bf16 cast, which truncates.
REL_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.double() - ref.double()).norm()
    return float(diff / ref.double().norm().clamp_min(1e-30))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite output: an element was not written"
    err = rel_err(out, ref)
    assert err < REL_TOL[dtype], f"relative error {err:.3g} >= {REL_TOL[dtype]:.3g}"


@pytest.fixture
def close() -> Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]:
    return assert_close


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded generator per test: reproducible, and fresh data for every test."""
    g = torch.Generator()
    g.manual_seed(int.from_bytes(os.urandom(4)) if os.environ.get("KERNEL_TEST_RANDOM") else 0)
    return g


@pytest.fixture
def count_launches(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any], list[int]]:
    """count_launches(module): the list each call of module.launch appends to, for the
    tests of a kernel form that a dispatcher may pass over for another (whose values would
    pass the same checks)."""
    def count(mod: Any) -> list[int]:
        calls: list[int] = []
        real = mod.launch

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(mod, "launch", counted)
        return calls

    return count


@pytest.fixture(autouse=True)
def _return_cached_gpu_memory() -> Any:
    """After each test, the CUDA caching allocator's free blocks go back to the driver. The
    GPU suite runs six workers on one card, and a worker otherwise keeps what its largest test
    reserved: in session 44's run five workers held 75 of the card's 80 GiB when a sixth
    asked for 726 MiB and failed (bench/results/gpu_suite.txt, sessions 41 and 44)."""
    yield
    if HAS_CUDA and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
