"""Launching expert_call.cu: a GPU's MoE layer asks the CPU's expert pool (engine/expert_pool.py) for its
routed experts without leaving the stream.

`call(...)` queues one single-block kernel on the current stream: the rows (T, W) float32 go to the
page-locked hx, the request into the channel's words of the pool's control block, and once the pool has
answered, hy's (T, H) rows come back into `out`. What this is not: the pool, or a copy engine (the rows
are a decode step's few kilobytes; the block's stores and loads cross the bus themselves).
"""

from __future__ import annotations

import numpy as np

from .build import get_kernel

THREADS = 512


def call(rows, out, ctrl_word: int, hx: int, hy: int, seq, entry: int, timeout_s: float) -> None:
    """rows (T, W), out (T, H): C-contiguous float32 CuPy arrays; ctrl_word, hx, hy: host addresses
    (page-locked: the GPU reaches them by the same address); seq: a (1,) uint64 CuPy array, the
    channel's request counter."""
    T, W = (int(d) for d in rows.shape)
    H = int(out.shape[1])
    ns = max(1, int(float(timeout_s) * 1e9))
    get_kernel("expert_call", "expert_call")(
        (1,), (THREADS,),
        (rows, out, np.uint64(ctrl_word), np.uint64(hx), np.uint64(hy), seq, np.int64(entry), np.int32(T),
         np.int32(W), np.int32(H), np.uint64(ns)))
