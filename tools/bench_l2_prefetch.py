"""Would a decode GEMV gain if the small kernel before it fetched its weights into L2? A measurement
before any engine change (issue 16: decode at the bandwidth roofline).

In a decode step every GEMV follows a short, latency-bound kernel (the RMSNorm before the input
projections and gate/up, the Gated DeltaNet or attention before the output projection, SwiGLU before
down) that leaves the memory bus idle. Here a stand-in for that kernel (`spacer`: 32 blocks spinning
for S microseconds) runs before each GEMV of the 9B decode shapes, over enough copies of each matrix
that every GEMV reads HBM, and optionally issues `prefetch.global.L2` for the GEMV's weight bytes first
(fire and forget: the spacer does not wait for them). Printed per type, shape, S and form: us per
(spacer + GEMV) pair, the spacer alone, their difference (the GEMV's time after that spacer) and the
GEMV with its weights already in L2 (one copy, replayed) as the floor.

`python3 tools/bench_l2_prefetch.py [--types Q4_K,Q8_0] [--spacers 1.5,4,9]` on a GPU (about a minute).
"""

from __future__ import annotations

import argparse
import math
import sys

import cupy as cp
import numpy as np
from minecart.kernels import ops
from minecart.kernels.probe import measure_copy, random_weight, time_gpu

_SRC = r"""
extern "C" __global__ void spacer(long long cycles, const char* a, long long na, const char* b, long long nb,
                                  int stride, int evict_last) {
    long long t0 = clock64();
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * stride;
    long long step = (long long)gridDim.x * blockDim.x * stride;
    for (long long o = i; o < na + nb; o += step) {
        const char* p = o < na ? a + o : b + (o - na);
        if (evict_last) asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(p));
        else asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
    }
    while (clock64() - t0 < cycles) { }
}
"""

SHAPES = ((4096, 4096, True), (12352, 4096, False), (24576, 4096, False), (4096, 12288, True))
# (label, prefetch stride in bytes or 0 for none, evict_last, byte budget or 0 for all)
FORMS = (("none", 0, 0, 0), ("pf128", 128, 0, 0), ("pf128-4MB", 128, 0, 4 << 20), ("pf32", 32, 0, 0),
         ("pf128-el", 128, 1, 0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="Q4_K,Q8_0")
    ap.add_argument("--spacers", default="1.5,4,9", help="spacer lengths in microseconds")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    kernel = cp.RawKernel(_SRC, "spacer")
    khz = cp.cuda.Device().attributes["ClockRate"]
    copy = measure_copy()
    print(f"copy bandwidth {copy:.0f} GB/s; SM clock {khz / 1e3:.0f} MHz", flush=True)
    rng = np.random.default_rng(0)
    spacers = [float(v) for v in args.spacers.split(",")]
    for type_name in args.types.split(","):
        for R, K, with_res in SHAPES:
            _shape(kernel, khz, copy, type_name, R, K, with_res, spacers, args.reps, rng)
            cp.get_default_memory_pool().free_all_blocks()
    return 0


def _shape(kernel, khz: int, copy: float, type_name: str, R: int, K: int, with_res: bool, spacers: list[float],
           reps: int, rng: np.random.Generator) -> None:
    first = random_weight(type_name, R, K, 0)
    per = first.nbytes
    ws = [first] + [random_weight(type_name, R, K, i) for i in range(1, max(2, math.ceil((256 << 20) / per)))]
    x = cp.asarray(rng.standard_normal((1, K)).astype(np.float32))
    res = cp.asarray(rng.standard_normal((1, R)).astype(np.float32)) if with_res else None
    ops.register_quantized(x, ops.quantize_q8_1(x))
    hot = time_gpu(lambda: [ops.matmul(x, first, "dp4a", residual=res) for _ in ws], reps) / len(ws)
    cold = time_gpu(lambda: [ops.matmul(x, w, "dp4a", residual=res) for w in ws], reps) / len(ws)
    print(f"{type_name} {R}x{K}: {per / 1e6:.1f} MB; GEMV alone from HBM {cold * 1e6:.2f} us "
          f"({per / cold / 1e9 / copy:.0%} of copy), from L2 {hot * 1e6:.2f} us", flush=True)
    for s_us in spacers:
        cycles = np.int64(s_us * khz / 1e3)

        def spacer(w, stride, el, budget, cycles=cycles):
            na = w.wq.nbytes if budget == 0 else min(w.wq.nbytes, budget)
            nb = 0 if w.wd is None else w.wd.nbytes
            b = w.wd if w.wd is not None else w.wq
            kernel((32,), (256,), (cycles, w.wq, np.int64(na if stride else 0), b,
                                   np.int64(nb if stride else 0), np.int32(max(stride, 1)), np.int32(el)))

        alone = time_gpu(lambda spacer=spacer: [spacer(w, 0, 0, 0) for w in ws], reps) / len(ws)
        line = [f"  spacer {s_us:4.1f} us (measured {alone * 1e6:5.2f})"]
        for label, stride, el, budget in FORMS:
            def pair(stride=stride, el=el, budget=budget, spacer=spacer):
                for w in ws:
                    spacer(w, stride, el, budget)
                    ops.matmul(x, w, "dp4a", residual=res)

            t = time_gpu(pair, reps) / len(ws)
            line.append(f"{label} {t * 1e6:6.2f} (GEMV {(t - alone) * 1e6:5.2f})")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    sys.exit(main())
