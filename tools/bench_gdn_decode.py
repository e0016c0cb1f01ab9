"""GPU time of the Gated DeltaNet decode kernels (kernels/fused.py gdn_decode, gdn_decode_batch) at a
model's shape, as a decode step runs them: inside a CUDA graph, one sequence and batches of B.

    python3 tools/bench_gdn_decode.py [--shape 16,32,128,128,4] [--batches 1,8,32] [--reps 50]

--shape is n_k, n_v, dk, dv, conv kernel (default: Qwen3.5 9B's). Each case is timed by
kernels/probe.py time_gpu (`--reps` launches captured as one CUDA graph), best of three graphs:
"warm" launches back to back, so the recurrent states stay in L2; "cold" puts a 256 MiB copy before
each launch (its own time, measured alone, subtracted), which evicts them as a step's weight stream
does. The state bytes read and written per launch are set against the copy's own bandwidth. What this
is not: the kernel's share of a decode step (tools/profile_decode.py --ablate is).
"""

from __future__ import annotations

import argparse
import sys

import cupy as cp
import numpy as np
from minecart.kernels import fused
from minecart.kernels.probe import time_gpu

FLUSH_BYTES = 256 << 20


def _best(fn, reps: int) -> float:
    return min(time_gpu(fn, reps) for _ in range(3))


def _after(first, then):
    def both():
        first()
        then()
    return both


def _case(B: int, n_k: int, n_v: int, dk: int, dv: int, kw: int, C: int, f32, weights):
    """A launch of B sequences' decode token (gdn_decode for one, else gdn_decode_batch), its states."""
    mixed, z, b, alpha = f32(B, C), f32(B, n_v * dv), f32(B, n_v), f32(B, n_v)
    convs = [f32(kw - 1, C) for _ in range(B)]
    ssms = [f32(n_v, dk, dv, scale=0.1) for _ in range(B)]
    dims = dict(n_k=n_k, n_v=n_v, dk=dk, dv=dv, eps=1e-6, want_q8=True)
    if B == 1:
        return (lambda: fused.gdn_decode(mixed, z, b, alpha, convs[0], ssms[0], *weights, **dims)), ssms
    ctab = fused.pointer_table(tuple(int(c.data.ptr) for c in convs))
    stab = fused.pointer_table(tuple(int(s.data.ptr) for s in ssms))
    return (lambda: fused.gdn_decode_batch(mixed, z, b, alpha, convs, ssms, ctab, stab, *weights, **dims)), ssms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="16,32,128,128,4")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    n_k, n_v, dk, dv, kw = (int(x) for x in args.shape.split(","))
    C = 2 * n_k * dk + n_v * dv
    rs = cp.random.RandomState(0)

    def f32(*shape, scale=1.0):
        return (rs.standard_normal(shape) * scale).astype(cp.float32)

    conv_w, ssm_a = f32(C, kw, scale=0.5), -cp.exp(f32(n_v))
    dt_bias, norm_w = f32(n_v), 1 + f32(dv, scale=0.2)
    src, dst = cp.empty(FLUSH_BYTES // 4, cp.float32), cp.empty(FLUSH_BYTES // 4, cp.float32)
    src.fill(1.0)

    def flush():
        dst[...] = src

    t_flush = _best(flush, args.reps)
    print(f"gdn_decode n_k={n_k} n_v={n_v} dk={dk} dv={dv} kernel={kw}; us a launch inside a CUDA graph "
          f"(best of 3 graphs of {args.reps}); the {FLUSH_BYTES >> 20} MiB copy: {t_flush * 1e6:.1f} us, "
          f"{2 * FLUSH_BYTES / t_flush / 1e9:.0f} GB/s")
    print("batch   warm   cold   state MB  cold GB/s  share of copy")
    fused.make_gdn_counters(max(int(b) for b in args.batches.split(",")) * n_k)
    cp.cuda.Device().synchronize()
    for B in (int(b) for b in args.batches.split(",")):
        launch, ssms = _case(B, n_k, n_v, dk, dv, kw, C, f32, (conv_w, ssm_a, dt_bias, norm_w))
        warm = _best(launch, args.reps)
        cold = _best(_after(flush, launch), args.reps) - t_flush
        nbytes = 2 * B * (n_v * dk * dv + (kw - 1) * C) * 4  # states read and written
        gbs = nbytes / cold / 1e9
        print(f"{B:5d} {warm * 1e6:6.1f} {cold * 1e6:6.1f} {nbytes / 1e6:9.1f} {gbs:10.0f} "
              f"{gbs / (2 * FLUSH_BYTES / t_flush / 1e9):14.2f}")
        assert np.isfinite(float(cp.asnumpy(ssms[0][0, 0, 0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
