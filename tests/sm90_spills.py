"""Register spills of Triton kernels compiled for an H200 (sm_90), without a GPU: ptxas
from Triton's wheel, in a child process (the kernel tests' conftest runs Triton in its
interpreter, which compiles nothing). A test gives the script body that compiles its
kernels with ``spills(fn, signature, constexprs, **options)`` and fills ``out`` (name ->
spilled bytes)."""

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


def spills(fn, sig, const, **opts):
    sig = dict(sig, **{k: "constexpr" for k in const})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=TARGET,
                       options=opts)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                       capture_output=True, text=True, check=True)
    os.unlink(f.name)
    line = [l for l in r.stderr.splitlines() if "spill stores" in l][0]
    return int(line.split("bytes spill stores")[0].split(",")[-1])


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
    r = subprocess.run([sys.executable, "-c", PRELUDE + body + "\nprint(json.dumps(out))\n"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    found: dict[str, int] = json.loads(r.stdout.strip().splitlines()[-1])
    return found
