"""GPU time of the device's top-k (kernels/ops.py top_k) by k rounds and in four passes (a threshold, then
a sort of the few logits above it), as a decode step runs it: inside a CUDA graph, rows of a
248,320-token vocabulary (Qwen3.5's), for the k a sampler asks for.

    python3 tools/bench_topk.py [--vocab 248320] [--rows 1,8] [--ks 1,2,4,8,20,40,64] [--reps 50]

Each (rows, k, variant) is timed by kernels/probe.py time_gpu (`--reps` top-k calls on the same logits
captured as one CUDA graph) three times; the best time per call is printed, in microseconds, with the
ratio select / rounds. What this is not: the end-to-end decode (tools/bench_generate.py is).
"""

from __future__ import annotations

import argparse
import sys

import cupy as cp
from minecart.kernels import ops
from minecart.kernels.probe import time_gpu


def _graph_us(logits: cp.ndarray, k: int, reps: int) -> float:
    return 1e6 * min(time_gpu(lambda: ops.top_k(logits, k), reps) for _ in range(3))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--ks", default="1,2,4,8,20,40,64")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    rs = cp.random.RandomState(0)
    print(f"top-k of {args.vocab} logits, us a call inside a CUDA graph (best of 3 graphs of {args.reps} calls)")
    print("rows     k   rounds   select  select/rounds")
    for rows in (int(r) for r in args.rows.split(",")):
        logits = (rs.standard_normal((rows, args.vocab)) * 3).astype(cp.float32)
        for k in (int(x) for x in args.ks.split(",")):
            us = {}
            for variant in ("rounds", "select"):
                ops.TOPK_VARIANT = variant
                us[variant] = _graph_us(logits, k, args.reps)
            ops.TOPK_VARIANT = "auto"
            print(f"{rows:4d} {k:5d} {us['rounds']:8.1f} {us['select']:8.1f} {us['select'] / us['rounds']:11.2f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
