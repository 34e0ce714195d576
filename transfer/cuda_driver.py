"""The few CUDA driver calls the IPC data plane needs, through ctypes on libcuda.

Why the driver and not torch's tensor sharing: torch opens a shared allocation in a
context on the exporting GPU, so every consumer process would also create a context
(hundreds of MiB) on every producer's GPU. ``cuIpcOpenMemHandle`` maps the producer's
pool into the consumer's own context (peer access over NVLink), and one
``cuMemcpyDtoDAsync`` per run pulls it on the consumer's stream. libcuda ships with the
driver, so nothing extra is installed.
"""

from __future__ import annotations

import ctypes
from functools import cache

from transfer.types import TransferError

IPC_LAZY_ENABLE_PEER_ACCESS = 1
HANDLE_BYTES = 64


MEMORYTYPE_DEVICE = 2


class Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D: a pitched copy (rows of ``WidthInBytes``, each side its own pitch)."""

    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t),
                ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
                ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
                ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p),
                ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


class IpcMemHandle(ctypes.Structure):
    # bytes, not c_char: a c_char array field reads back cut at its first NUL
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


@cache
def _lib() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise TransferError(f"backend ipc: CUDA driver library not loadable: {e}") from None
    u64, p64 = ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)
    sigs = {
        "cuInit": [ctypes.c_uint],
        "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
        "cuCtxSetCurrent": [ctypes.c_void_p],
        "cuMemGetAddressRange_v2": [p64, ctypes.POINTER(ctypes.c_size_t), u64],
        "cuIpcGetMemHandle": [ctypes.POINTER(IpcMemHandle), u64],
        "cuIpcOpenMemHandle_v2": [p64, IpcMemHandle, ctypes.c_uint],
        "cuIpcCloseMemHandle": [u64],
        "cuMemcpyDtoDAsync_v2": [u64, u64, ctypes.c_size_t, ctypes.c_void_p],
        "cuMemcpy2DAsync_v2": [ctypes.POINTER(Memcpy2D), ctypes.c_void_p],
        "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        _lib().cuGetErrorString(rc, ctypes.byref(msg))
        text = msg.value.decode() if msg.value else "unknown error"
        raise TransferError(f"backend ipc: {what} failed: CUDA error {rc} ({text})")


def use_device(ordinal: int) -> None:
    """Makes the device's primary context (the one torch uses) current on this thread.

    Why not torch.cuda.set_device: it skips the runtime call when the thread's default
    device already matches (device 0), leaving a new thread with no current context."""
    lib = _lib()
    _check(lib.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    _check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), f"cuDeviceGet({ordinal})")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def allocation_of(ptr: int) -> tuple[int, int]:
    """(base, size) of the allocation holding ``ptr`` (IPC handles name whole allocations)."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(_lib().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
           "cuMemGetAddressRange")
    return base.value, size.value


def export(base: int) -> bytes:
    h = IpcMemHandle()
    _check(_lib().cuIpcGetMemHandle(ctypes.byref(h), base),
           "cuIpcGetMemHandle (pool from the expandable-segments allocator?)")
    return bytes(h)


def open_handle(handle: bytes) -> int:
    """Maps a peer's allocation into the current context; returns its base there."""
    if len(handle) != HANDLE_BYTES:
        raise TransferError(f"backend ipc: IPC handle of {len(handle)} bytes, "
                            f"expected {HANDLE_BYTES}")
    h = IpcMemHandle.from_buffer_copy(handle)
    ptr = ctypes.c_uint64()
    _check(_lib().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, IPC_LAZY_ENABLE_PEER_ACCESS),
           "cuIpcOpenMemHandle (both GPUs visible to both processes? same host?)")
    return ptr.value


def close_handle(ptr: int) -> None:
    _check(_lib().cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")


def copy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    _check(_lib().cuMemcpyDtoDAsync_v2(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")


def copy_2d_async(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                  height: int, stream: int) -> None:
    """``height`` rows of ``width`` bytes, device to device, one DMA on ``stream``."""
    p = Memcpy2D(srcMemoryType=MEMORYTYPE_DEVICE, srcDevice=src, srcPitch=src_pitch,
                 dstMemoryType=MEMORYTYPE_DEVICE, dstDevice=dst, dstPitch=dst_pitch,
                 WidthInBytes=width, Height=height)
    _check(_lib().cuMemcpy2DAsync_v2(ctypes.byref(p), stream), "cuMemcpy2DAsync")
