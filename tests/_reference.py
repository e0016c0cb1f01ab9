"""fp64 references shared by the CPU emulation tests (tests/kernels) and the GPU tests (tests/gpu)."""

from __future__ import annotations

import numpy as np


def attention_reference(q, kc, vc, start, kv_len, scale, window):
    """fp64 causal GQA attention: query t at position start + t over cache rows [0, kv_len)."""
    T, nh, D = q.shape
    G = nh // kc.shape[1]
    pos = start + np.arange(T)
    j = np.arange(kv_len)
    vis = j[None, :] <= pos[:, None]
    if window > 0:
        vis &= j[None, :] > pos[:, None] - window
    out = np.zeros((T, nh, D))
    for h in range(nh):
        s = q[:, h].astype(np.float64) @ kc[:kv_len, h // G].astype(np.float64).T * scale
        s = np.where(vis, s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ vc[:kv_len, h // G].astype(np.float64)
    return out
