"""Kernel launches with programmatic dependent launch (PDL) on cards that have it (compute capability 9.0
and later), through the CUDA driver's cuLaunchKernelEx, which CuPy's RawKernel does not expose.

A PDL launch lets the kernel start while the kernel before it in the stream is still finishing: its
blocks take free slots and wait in `pdl_entry` (common.cuh, the first statement of every kernel; the
single-token GEMVs first issue their weight loads, which no kernel writes) until that kernel has ended
and its writes are visible. What it saves is the gap between two dependent kernels (the launch, the
block scheduling, a GEMV's first trip to memory), which inside a decode step's CUDA graph is paid at
every one of its few hundred kernels. Stream capture records it as a programmatic edge of the graph.

Only launches into a graph being captured use it (build.Kernel): launched eagerly, a kernel did not
start early on the H100 (tests/gpu/test_pdl.py measured it), and CuPy's own launch costs the host less.

MINECART_PDL: "auto" (default: on where the card has it), "off". Older cards launch through CuPy as
before; their kernels are compiled without the wait (nothing to wait for).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

PDL_VARIANT = os.environ.get("MINECART_PDL", "auto")
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


_driver: Any = None
_PDL_ATTR = _Attribute(_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, b"", (1).to_bytes(4, "little") + bytes(60))


def _cuda() -> Any:
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuStreamIsCapturing.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        lib.cuStreamIsCapturing.restype = ctypes.c_int
        _driver = lib
    return _driver


def capturing(stream_ptr: int) -> bool:
    """Whether the stream is being captured into a CUDA graph (cuStreamIsCapturing; a stream whose status
    cannot be read counts as not captured: its launches take CuPy's plain launch)."""
    status = ctypes.c_int(0)
    err = _cuda().cuStreamIsCapturing(ctypes.c_void_p(stream_ptr), ctypes.byref(status))
    return err == 0 and status.value != 0


def pdl_wanted(compute_capability: int) -> bool:
    """Whether kernels on a card of this compute capability (e.g. 90) are launched with PDL (captured
    into graphs): MINECART_PDL allows it, the card has it and the driver has cuLaunchKernelEx."""
    if PDL_VARIANT not in ("auto", "off"):
        raise ValueError(f"MINECART_PDL={PDL_VARIANT!r}: use auto or off")
    if PDL_VARIANT == "off" or compute_capability < 90:
        return False
    try:
        _cuda()
    except (OSError, AttributeError):  # no driver library, or one older than CUDA 12
        return False
    return True


def _dim3(d: Any) -> tuple[int, int, int]:
    """A grid or block size as CuPy takes it (an int, or 1-3 ints) as three dimensions."""
    x, y, z = (*(d if isinstance(d, tuple | list) else (d,)), 1, 1)[:3]
    return int(x), int(y), int(z)


def _arg_bytes(a: Any) -> bytes:
    """One kernel argument as the bytes CuPy would pass: an array as its device pointer, a NumPy scalar
    as itself, a Python int / float / bool as int64 / float64 / bool (CuPy's conversions)."""
    import cupy as cp

    if isinstance(a, cp.ndarray):
        return np.uint64(a.data.ptr).tobytes()
    if isinstance(a, np.generic):
        return a.tobytes()
    if isinstance(a, bool):
        return np.bool_(a).tobytes()
    if isinstance(a, int):
        return np.int64(a).tobytes()
    if isinstance(a, float):
        return np.float64(a).tobytes()
    raise TypeError(f"kernel argument of type {type(a).__name__}: pass a CuPy array or a NumPy scalar")


def launch_pdl(function_ptr: int, grid: Any, block: Any, args: tuple, shared_mem: int = 0) -> None:
    """Launch the CUfunction `function_ptr` on the current CuPy stream with programmatic stream
    serialization allowed."""
    import cupy as cp

    bufs = [ctypes.create_string_buffer(_arg_bytes(a)) for a in args]
    params = (ctypes.c_void_p * max(1, len(bufs)))(*[ctypes.addressof(b) for b in bufs])
    gx, gy, gz = _dim3(grid)
    bx, by, bz = _dim3(block)
    cfg = _Config(gx, gy, gz, bx, by, bz, int(shared_mem), cp.cuda.get_current_stream().ptr,
                  ctypes.pointer(_PDL_ATTR), 1)
    err = _cuda().cuLaunchKernelEx(ctypes.byref(cfg), function_ptr, params, None)
    if err:
        name = ctypes.c_char_p()
        _cuda().cuGetErrorName(err, ctypes.byref(name))
        raise RuntimeError(f"cuLaunchKernelEx failed: {(name.value or b'?').decode()} ({err})")
