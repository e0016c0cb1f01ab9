"""Host work queued on a CUDA stream (the driver's cuLaunchHostFunc), so that a captured graph holds it.

A decode step of a MoE model whose routed experts live in host RAM goes GPU -> CPU -> GPU once per
such layer. Queued as copies plus a host function on the stream, that round trip becomes nodes of the
step's CUDA graph (a host node runs the function when the stream reaches it, and the stream waits for
it to return), so the whole step replays as one graph instead of ~1,000 eager launches from Python.

`launch(stream_ptr, fn, arg)` queues the Python call `fn(arg)` on the stream (arg: an integer below
2^63 that the driver hands back; a graph replays the captured value). The driver calls it from its
own thread; ctypes takes the GIL for it, so whoever waits for the stream must wait without the GIL
(CuPy's stream and event waits do). `fn` must not call CUDA (the driver forbids it in host functions)
and must not raise (the caller's wrapper records errors; an exception escaping here is only printed).
One C callback is made per live `fn` (keyed by its identity) and kept: a graph replays the same
function pointer long after the capture. It holds `fn` weakly, so the caller keeps fn alive as long as
its graphs; one `fn` per caller, with what differs between calls in `arg`, keeps the set small.

What this is not: a thread pool, or a way to run CUDA work from the host function.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_lock = threading.Lock()
# id(fn) -> (a weak reference to fn, its C callback); callbacks of functions that died stay in _retired
# (a few hundred bytes each): a graph captured with one may outlive the entry
_callbacks: dict[int, tuple[Callable[[], object], object]] = {}
_retired: list[object] = []
_launch: Callable[..., int] | None = None


def _driver_launch() -> Callable[..., int]:
    global _launch
    if _launch is None:
        names = ["nvcuda.dll"] if sys.platform == "win32" else ["libcuda.so.1", "libcuda.so"]
        found = ctypes.util.find_library("cuda")
        lib = None
        for name in names + ([found] if found else []):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if lib is None:
            raise RuntimeError("the CUDA driver library (libcuda) was not found: host functions cannot be queued")
        fn = lib.cuLaunchHostFunc
        fn.argtypes = [ctypes.c_void_p, _HOSTFN, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _launch = fn
    return _launch


@contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection (on any thread) inside the block: where a collection could free a
    CUDA object at a moment CUDA forbids it (a host function; a stream capture, which a free that
    synchronizes invalidates)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _callback(fn: Callable[[int], None]) -> object:
    """The C callback for fn, made once per live fn. It holds fn weakly (a bound method: its object),
    so a model whose graphs are gone can be freed; a call after fn died does nothing."""
    with _lock:
        entry = _callbacks.get(id(fn))
        if entry is not None and entry[0]() == fn:  # (a WeakMethod gives a new, equal bound method)
            return entry[1]
        if entry is not None:
            _retired.append(entry[1])
        ref: Callable[[], object] = weakref.WeakMethod(fn) if isinstance(fn, types.MethodType) else weakref.ref(fn)

        def call(a: int | None) -> None:
            f = ref()
            if f is None:
                return
            # a collection here could free a CUDA graph, event or pinned buffer of something else, and
            # CUDA calls are not permitted in a host function (seen on the H200: cudaGraphDestroy ->
            # cudaErrorNotPermitted, the graph leaked)
            with paused_gc():
                f(int(a or 0))  # type: ignore[operator]  # ctypes hands a null pointer over as None

        cb = _HOSTFN(call)
        _callbacks[id(fn)] = (ref, cb)
        return cb


def launch(stream_ptr: int, fn: Callable[[int], None], arg: int = 0) -> None:
    """Queue fn(arg) on the stream `stream_ptr` (a CuPy Stream's .ptr; 0 is the legacy default stream).
    Keep fn alive while a graph holding this call may replay (the callback holds it weakly)."""
    if not 0 <= int(arg) < 1 << 63:
        raise ValueError(f"a host function's argument must be in [0, 2^63), got {arg}")
    status = _driver_launch()(ctypes.c_void_p(stream_ptr), _callback(fn), ctypes.c_void_p(int(arg)))
    if status != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed with CUDA driver error {status}")
