"""fp64 references and random inputs shared by the CPU emulation tests (tests/kernels) and the GPU tests (tests/gpu)."""

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


def gdn_inputs(rng, T, n_k, n_v, dk, dv):
    """Random delta-rule inputs in the model's ranges: unit q (scaled by dk^-1/2) and k (T, n_k, dk),
    v (T, n_v, dv), decays g < 0 and beta in (0, 1) (T, n_v), and a start state (n_v, dk, dv); fp32."""

    def unit(a):
        return a / np.linalg.norm(a, axis=-1, keepdims=True)

    q = (unit(rng.standard_normal((T, n_k, dk))) / np.sqrt(dk)).astype(np.float32)
    k = unit(rng.standard_normal((T, n_k, dk))).astype(np.float32)
    v = rng.standard_normal((T, n_v, dv)).astype(np.float32)
    g = -np.exp(rng.uniform(-4, 1, (T, n_v))).astype(np.float32)
    beta = rng.uniform(0, 1, (T, n_v)).astype(np.float32)
    s0 = (rng.standard_normal((n_v, dk, dv)) * 0.1).astype(np.float32)
    return q, k, v, g, beta, s0
