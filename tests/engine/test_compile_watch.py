"""engine/compile_watch.py: Triton's compile hooks counted and timed, compiles while serving
warned by kernel. The seam with made-up hook calls on CPU (Triton's interpreter compiles
nothing), and a real compile on the GPU."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.compile_watch import CompileWatch, describe


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_compiles_are_counted_timed_and_warned_only_while_serving(caplog):
    clock = Clock()
    watch = CompileWatch(clock)
    with caplog.at_level(logging.WARNING, logger="pdserve.engine"):
        watch.before(key="k1", repr="prefill[num_warps=4](T: i32)")
        clock.t = 1.5
        watch.after(key="k1", repr="prefill[num_warps=4](T: i32)")
        assert (watch.compiles, watch.compile_s, watch.while_serving) == (1, 1.5, 0)
        assert not caplog.records  # the warm-up's compiles are expected
        watch.serving = True
        watch.before(key="k2", repr="prefill[num_warps=4](T: i32:16)")
        clock.t = 3.5
        watch.after(key="k2", repr="prefill[num_warps=4](T: i32:16)")
    assert (watch.compiles, watch.compile_s, watch.while_serving) == (2, 3.5, 1)
    [rec] = caplog.records
    assert "?(" in rec.getMessage()  # no fn or compile info in these made-up calls
    assert "2000 ms" in rec.getMessage()


def test_the_warning_names_the_kernel_its_constexprs_and_its_divisible_arguments():
    class Fn:
        name = "_prefill_kernel"

    kw = dict(key="k", fn=Fn(), compile=dict(
        signature={"q_ptr": "*bf16", "T": "i32", "S": "constexpr", "BLOCK_M": "constexpr"},
        constants={(2,): 1, (3,): 128}, configs=[{(0,): [["tt.divisibility", 16]],
                                                  (1,): [["tt.divisibility", 16]]}]))
    assert describe(kw) == "_prefill_kernel(S=1, BLOCK_M=128; divisible by 16: q_ptr, T)"
    assert describe({}) == "?(; divisible by 16: none)"


def test_install_chains_the_hooks_already_there_and_uninstall_restores_them():
    triton = pytest.importorskip("triton")
    rt = triton.knobs.runtime
    seen: list[tuple[str, str]] = []

    def prior_before(**kw):
        seen.append(("before", kw["key"]))
        return None

    def prior_after(**kw):
        seen.append(("after", kw["key"]))

    saved = rt.jit_cache_hook, rt.jit_post_compile_hook
    rt.jit_cache_hook, rt.jit_post_compile_hook = prior_before, prior_after
    try:
        watch = CompileWatch()
        assert watch.install()
        assert rt.jit_cache_hook == watch.before and rt.jit_post_compile_hook == watch.after
        # Triton skips the compile when the before-hook returns true: ours never asks it to
        assert not rt.jit_cache_hook(key="k", repr="r")
        rt.jit_post_compile_hook(key="k", repr="r")
        assert seen == [("before", "k"), ("after", "k")] and watch.compiles == 1
        watch.uninstall()
        assert (rt.jit_cache_hook, rt.jit_post_compile_hook) == (prior_before, prior_after)
    finally:
        rt.jit_cache_hook, rt.jit_post_compile_hook = saved


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_compile_while_serving_is_warned(caplog):
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)

    rt = triton.knobs.runtime
    # this process's own watch (an engine built earlier in it) would log the same compiles
    saved = rt.jit_cache_hook, rt.jit_post_compile_hook
    rt.jit_cache_hook = rt.jit_post_compile_hook = None
    watch = CompileWatch()
    assert watch.install()
    try:
        x = torch.zeros(20, device="cuda")
        add_one[(1,)](x, 20, BLOCK=32)
        assert watch.compiles == 1 and watch.compile_s > 0 and watch.while_serving == 0
        add_one[(1,)](x, 20, BLOCK=32)  # compiled already: no hook
        assert watch.compiles == 1
        watch.serving = True
        with caplog.at_level(logging.WARNING, logger="pdserve.engine"):
            add_one[(1,)](x, 16, BLOCK=32)  # n divisible by 16: a new specialization
        assert watch.compiles == 2 and watch.while_serving == 1
        [msg] = [r.getMessage() for r in caplog.records if "add_one" in r.getMessage()]
        assert "add_one(BLOCK=32; divisible by 16: x_ptr, n) while serving" in msg
        torch.cuda.synchronize()
        assert x[:16].tolist() == [3.0] * 16 and x[16:].tolist() == [2.0] * 4
    finally:
        watch.uninstall()
        rt.jit_cache_hook, rt.jit_post_compile_hook = saved
