"""What one GPU -> host -> GPU round trip costs inside a CUDA graph, piece by piece.

    python3 tools/diag_round_trip.py [--layers 30] [--replays 20] [--threads 16]

A host-RAM expert layer of a decode step is: GPU work, a copy of the routed rows to pinned memory, a
host function (the CPU experts), a copy back. This captures graphs of --layers such steps with the
CPU work left out or replaced by stand-ins, replays each --replays times (waited for through a
blocking-sync event, as the engine does), and prints microseconds per layer:
  kernels                 a small kernel per layer only (the floor of a graph node)
  + copies                the two 8 KiB copies (to pinned host memory and back)
  + native host function  the C library's free(NULL) as the host function: the driver's own cost
  + host function (no-op) a Python host function that returns at once (kernels/host_func.py)
  + empty numba region    the host function starts an empty parallel loop on --threads threads
So (+ host function) - (+ copies) is what queueing a host function costs the stream, and the last
row adds what waking the expert threads from the driver's thread costs.
What this is not: a benchmark of the experts (tools/bench_moe_cpu.py) or of a model (diag_host_decode.py).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time

import cupy as cp
import numba
import numpy as np
from minecart.kernels import host_func
from minecart.kernels.probe import begin_capture


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048, help="float32 values per copied row")
    ap.add_argument("--no-main-region", action="store_true",
                    help="never start the parallel loop on the main thread (one OpenMP pool, the driver thread's)")
    args = ap.parse_args()

    @numba.njit(parallel=True, cache=False)
    def region(a):  # pragma: no cover - compiled
        for i in numba.prange(a.size):
            a[i] += 1.0

    scratch = np.zeros(4 * args.threads)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    if not args.no_main_region:
        region(scratch)

    def noop(arg: int) -> None:
        return None

    def empty_region(arg: int) -> None:
        region(scratch)

    libc = ctypes.CDLL(None)
    native = host_func._HOSTFN(ctypes.cast(libc.free, ctypes.c_void_p).value)  # free(NULL): a no-op

    n = args.width
    pin_x = np.frombuffer(cp.cuda.alloc_pinned_memory(4 * n), np.float32, n)
    pin_y = np.frombuffer(cp.cuda.alloc_pinned_memory(4 * n), np.float32, n)
    stream = cp.cuda.Stream(non_blocking=True)
    sleeper = cp.cuda.Event(block=True, disable_timing=True)
    rt = cp.cuda.runtime
    print(f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"{args.threads} numba threads")
    for label, copies, fn in [("kernels", False, None), ("+ copies", True, None),
                              ("+ native host function", True, native),
                              ("+ host function (no-op)", True, noop),
                              ("+ empty numba region", True, empty_region)]:
        with stream:
            x = cp.zeros(n, cp.float32)
            x += 1  # compile the kernel outside the capture
            stream.synchronize()
            begin_capture(stream)
            for _ in range(args.layers):
                x += 1
                if copies:
                    rt.memcpyAsync(pin_x.ctypes.data, x.data.ptr, 4 * n, rt.memcpyDeviceToHost, stream.ptr)
                if fn is native:
                    status = host_func._driver_launch()(ctypes.c_void_p(stream.ptr), native, None)
                    assert status == 0, status
                elif fn is not None:
                    host_func.launch(stream.ptr, fn, 0)
                if copies:
                    rt.memcpyAsync(x.data.ptr, pin_y.ctypes.data, 4 * n, rt.memcpyHostToDevice, stream.ptr)
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
            times = []
            for _ in range(args.replays):
                t = time.perf_counter()
                graph.launch(stream)
                sleeper.record(stream)
                sleeper.synchronize()
                times.append(time.perf_counter() - t)
        per = 1e6 * float(np.median(times)) / args.layers
        print(f"{label:<26} {per:8.1f} us a layer (median of {args.replays} replays of {args.layers} layers)",
              flush=True)


if __name__ == "__main__":
    main()
