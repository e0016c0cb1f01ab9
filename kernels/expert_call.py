"""Launching expert_call.cu: a GPU's MoE layer asks the CPU's expert pool (engine/expert_pool.py) for its
routed experts without leaving the stream.

`call(...)` queues one single-block kernel on the current stream: the tokens' rows and their routing
(T, H + 2k float32) go to the page-locked hx, the request into the channel's words of the pool's
control block, and once the pool has answered, hy's (T, H) rows come back into `out`. What this is not: the pool, or a copy engine (the rows
are a decode step's few kilobytes; the block's stores and loads cross the bus themselves).
"""

from __future__ import annotations

import numpy as np

from .build import get_kernel

THREADS = 512


def call(x, ids, wts, out, ctrl_word: int, hx: int, hy: int, seq, entry: int, timeout_s: float) -> None:
    """x (T, H) float32, ids (T*k,) int32, wts (T*k,) float32, out (T, H) float32: C-contiguous CuPy
    arrays; ctrl_word, hx, hy: host addresses (page-locked: the GPU reaches them by the same address;
    hx holds T rows of H + 2k floats); seq: a (1,) uint64 CuPy array, the channel's request counter."""
    T, H = (int(d) for d in x.shape)
    k = int(ids.size) // max(T, 1)
    ns = max(1, int(float(timeout_s) * 1e9))
    get_kernel("expert_call", "expert_call")(
        (1,), (THREADS,),
        (x, ids, wts, out, np.uint64(ctrl_word), np.uint64(hx), np.uint64(hy), seq, np.int64(entry), np.int32(T),
         np.int32(k), np.int32(H), np.uint64(ns)))
