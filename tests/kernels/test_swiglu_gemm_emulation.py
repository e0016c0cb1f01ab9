"""A NumPy emulation of the SwiGLU GEMM (kernels/gemm.cu gemm_dp4a<Q8_0, 2, true>, launched by
kernels/ops.py matmul_swiglu): its windows of gate rows and the same up rows (the requantized scratch's
two halves, `uoff`), each block's loader rows (64 gate rows, then the same 64 up rows, clamped at the
window's end), each thread's 8 x 8 tile (columns j < 4 gate, j >= 4 up of the same 4 f), and the
epilogue's 32-value q8_1 blocks over 8 lanes, against the plain product of [gate; up] followed by SwiGLU
and q8_1 (the composition it replaces). Products are exact (float64 over integer-valued inputs), so only
the index formulas are under test here; tests/gpu/test_swiglu_gemm.py holds the kernel to the composition
bit for bit on a GPU. Runs without one.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

GB_M = 128


def q8_1(v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, d, s) of the rows of v (whole 32-value blocks): d = max|v| / 127, q = round(v / d), s = d sum(q)."""
    T, F = v.shape
    b = v.reshape(T, F // 32, 32)
    d = np.abs(b).max(axis=2) / 127.0
    q = np.where(d[..., None] > 0, np.rint(b / np.where(d > 0, d, 1)[..., None]), 0)
    return q.reshape(T, F), d, d * q.sum(axis=2)


def silu(v):
    return v / (1.0 + np.exp(-v))


def emulate(x: np.ndarray, w: np.ndarray, scratch_rows: int):
    """matmul_swiglu on x (T, K) and w = [gate; up] (2F, K): the window loop of ops.matmul_swiglu (a
    scratch of `scratch_rows` rows: gate rows flo.. in its first half, the same up rows after them), each
    window's launch block by block, its 256 threads' tiles and epilogue (gemm_swiglu_epilogue) at once."""
    T, K = x.shape
    F = w.shape[0] // 2
    h = np.full(T * F, np.nan)
    hq = np.full(T * F, np.nan)
    hd = np.full(T * F // 32, np.nan)
    hs = np.full(T * F // 32, np.nan)
    step = min(max(64, scratch_rows // 2 // 64 * 64), F)
    tid = np.arange(256)
    ty, tx = tid >> 4, tid & 15
    ti = np.array([[t * 4 + i if i < 4 else 64 + t * 4 + i - 4 for i in range(8)] for t in range(16)])[ty]
    tj = np.array([[c * 4 + j if j < 4 else 64 + c * 4 + j - 4 for j in range(8)] for c in range(16)])[tx]
    group = (ty & 1) * 2 + (tx >> 3) + 4 * (ty >> 1)  # the 8 lanes (xor 1, 2, 4) a thread's shuffles span
    for flo in range(0, F, step):
        n = min(step, F - flo)
        wq = np.concatenate([w[flo:flo + n], w[F + flo:F + flo + n]])  # the two requantized halves
        rlo, rhi, uoff = flo, flo + n, n
        for bx in range(math.ceil((rhi - rlo) / 64)):
            r0 = rlo + bx * 64
            lrow = np.arange(128)
            wr = np.minimum(r0 + (lrow & 63), rhi - 1) - rlo + np.where(lrow < 64, 0, uoff)
            for by in range(math.ceil(T / GB_M)):
                t0 = by * GB_M
                xt = np.minimum(t0 + np.arange(GB_M), T - 1)
                tile = x[xt] @ wq[wr].T  # (128 tokens, 128 tile rows)
                acc = tile[ti[:, :, None], tj[:, None, :]]  # (256 threads, 8 tokens, 8 columns)
                v = silu(acc[:, :, :4]) * acc[:, :, 4:]  # (256, 8, 4)
                amax = np.abs(v).max(axis=2)  # then the max over each group of 8 lanes
                gmax = np.zeros_like(amax)
                for g_ in np.unique(group):
                    gmax[group == g_] = amax[group == g_].max(axis=0)
                d = gmax / 127.0
                q = np.where(gmax[..., None] > 0, np.rint(v / np.where(d > 0, d, 1)[..., None]), 0)
                qs = np.zeros_like(amax)
                for g_ in np.unique(group):
                    qs[group == g_] = q[group == g_].sum(axis=(0, 2))
                f = r0 + tx * 4
                for i in range(8):
                    t = t0 + ti[:, i]
                    ok = (t < T) & (f < rhi)
                    o = t * F + f
                    for c in range(4):
                        h[o[ok] + c] = v[ok, i, c]
                        hq[o[ok] + c] = q[ok, i, c]
                    lead = ok & ((tx & 7) == 0)
                    hd[o[lead] >> 5] = d[lead, i]
                    hs[o[lead] >> 5] = d[lead, i] * qs[lead, i]
    return h.reshape(T, F), hq.reshape(T, F), hd.reshape(T, -1), hs.reshape(T, -1)


@pytest.mark.parametrize("T,F,scratch_rows", [(130, 96, 10**6), (200, 320, 10**6), (129, 320, 128),
                                              (300, 192, 256)])
def test_emulation_is_the_composition(T, F, scratch_rows):
    rng = np.random.default_rng(T + F)
    K = 64
    x = rng.integers(-127, 128, (T, K)).astype(np.float64) / 64
    w = rng.integers(-127, 128, (2 * F, K)).astype(np.float64) / 64
    h, hq, hd, hs = emulate(x, w, scratch_rows)
    y = x @ w.T
    ref = silu(y[:, :F]) * y[:, F:]
    np.testing.assert_allclose(h, ref, rtol=1e-12, atol=1e-12)
    q, d, s = q8_1(ref)
    np.testing.assert_array_equal(hq, q)
    np.testing.assert_allclose(hd, d, rtol=1e-12)
    np.testing.assert_allclose(hs, s, rtol=1e-12)
