"""Register spills of Triton kernels compiled for an H200 (sm_90), without a GPU: ptxas
from Triton's wheel, in a child process (the kernel tests' conftest runs Triton in its
interpreter, which compiles nothing). A test gives the script body that compiles its
kernels with ``spills(fn, signature, constexprs, **options)`` and fills ``out`` (name ->
what ``spills`` returned: spilled bytes, read once every kernel has compiled)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = r'''
import json, os, subprocess, tempfile
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
TARGET = GPUTarget("cuda", 90, 32)
# ptxas is most of the time (~80% with Triton's cache warm): it runs in the background, one
# per core, while the next kernel compiles; each result is read at the end
PARALLEL = max(1, len(os.sched_getaffinity(0)))
running = []


class Ptxas:
    def __init__(self, ptx):
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        self.path = f.name
        self.proc = subprocess.Popen([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.spilled = None

    def result(self):
        if self.spilled is None:
            stdout, stderr = self.proc.communicate()
            os.unlink(self.path)
            if self.proc.returncode:
                raise subprocess.CalledProcessError(self.proc.returncode, self.proc.args,
                                                    stdout, stderr)
            line = [l for l in stderr.splitlines() if "spill stores" in l][0]
            self.spilled = int(line.split("bytes spill stores")[0].split(",")[-1])
        return self.spilled


def spills(fn, sig, const, divisible=None, **opts):
    """divisible: argument names a real launch sees as multiples of 16 (16-byte aligned
    pointers, sizes and strides). The JIT specializes on that, and without it the compiler
    can neither vectorize nor pipeline those loads: a different kernel from the one that
    runs, which spilled where the launched one does not. None: every pointer and every
    integer stride named s_* but the block tables' row stride s_btb (a table is as wide as
    the longest request's blocks, any number)."""
    if divisible is None:
        divisible = [k for k, v in sig.items()
                     if v.startswith("*") or (k.startswith("s_") and k != "s_btb")]
    sig = dict(sig, **{k: "constexpr" for k in const})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                       target=TARGET, options=opts)
    while len(running) >= PARALLEL:
        running.pop(0).result()
    running.append(Ptxas(k.asm["ptx"]))
    return running[-1]


def compiled(fn, sig, const, divisible=(), **opts):
    """The kernel compiled as spills() compiles it, for a look at its PTX."""
    sig = dict(sig, **{k: "constexpr" for k in const})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                          target=TARGET, options=opts)


class Found:
    """1 if every needle is in the PTX, else 0 (read with the spill counts)."""

    def __init__(self, ptx, *needles):
        self.value = int(all(n in ptx for n in needles))

    def result(self):
        return self.value


out = {}
'''


def spill_bytes(body: str) -> dict[str, int]:
    """Runs PRELUDE + body in a fresh interpreter; skips where the wheel has no ptxas."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("Triton's wheel carries no ptxas here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    end = "\nprint(json.dumps({k: v.result() for k, v in out.items()}))\n"
    r = subprocess.run([sys.executable, "-c", PRELUDE + body + end],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    found: dict[str, int] = json.loads(r.stdout.strip().splitlines()[-1])
    return found
