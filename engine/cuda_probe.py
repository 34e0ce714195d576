"""Is there a CUDA device for `--device auto`, answered without importing torch.

A worker's gRPC process builds its EngineConfig (flags are checked before anything starts)
but never runs the model; importing torch there only to resolve "auto" cost every worker
start and respawn 2-6 s. The answer is torch.cuda.is_available()'s, reached from what it
rests on: a torch built with CUDA, the driver library, and the driver's device count (which
honours CUDA_VISIBLE_DEVICES as the runtime's does). Where a step cannot tell (a ROCm build,
a driver call failing for a reason other than "no device"), torch is asked after all.

One knowing difference: where the driver is present but too old for torch's CUDA runtime,
torch says False (and the engine would quietly run on the CPU); this says True, and the
engine then fails at start naming the driver, which is what a GPU node should do.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os

CUDA_SUCCESS = 0
CUDA_ERROR_NO_DEVICE = 100


def _torch_lib_dir() -> str | None:
    spec = importlib.util.find_spec("torch")  # finds the package without running it
    if spec is None or spec.origin is None:
        return None
    return os.path.join(os.path.dirname(spec.origin), "lib")


def _ask_torch() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def has_cuda() -> bool:
    lib_dir = _torch_lib_dir()
    if lib_dir is None:
        return _ask_torch()  # an unusual install: let torch say (and fail) as before
    if os.path.exists(os.path.join(lib_dir, "libtorch_hip.so")):
        return _ask_torch()  # ROCm builds answer through torch.cuda too
    if not os.path.exists(os.path.join(lib_dir, "libtorch_cuda.so")):
        return False  # a CPU-only build: torch.cuda.is_available() is False
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False  # no driver: the CUDA runtime finds no device either
    try:
        rc = driver.cuInit(ctypes.c_uint(0))
        if rc == CUDA_ERROR_NO_DEVICE:
            return False
        count = ctypes.c_int(0)
        if rc != CUDA_SUCCESS or driver.cuDeviceGetCount(ctypes.byref(count)) != CUDA_SUCCESS:
            return _ask_torch()
    except AttributeError:  # not the driver API we know
        return _ask_torch()
    return count.value > 0
