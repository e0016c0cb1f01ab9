"""NumPy emulation of kernels/attention.cu `flash_prefill_g` (same blocking, same masks, same online
softmax in fp32 / log2 domain) against an fp64 softmax reference, on CPU.

The emulation mirrors the kernel's index arithmetic: a 1-D grid of (row blocks x KV heads) with the
last row block first, 64 rows R = t * G + g per block, key tiles of 64 from the first key the window
lets any row see to the last key the causal mask lets any row see, V streamed in chunks of 4096 / D
keys. It pins the algorithm; tests/gpu/test_attention_prefill.py pins the kernel.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests._reference import attention_reference as reference

BQ, BK, VBUF = 64, 64, 4096
LOG2E = 1.4426950408889634


def emulate(q, kc, vc, start, kv_len, scale, window, vbuf=VBUF):
    T, nh, D = q.shape
    n_kv = kc.shape[1]
    G = nh // n_kv
    n_rows = T * G
    nbx = -(-n_rows // BQ)
    KC = vbuf // D
    out = np.full((T, nh, D), np.nan, np.float32)
    sc = np.float32(scale * LOG2E)
    for bid in range(nbx * n_kv):
        kvh = bid % n_kv
        R0 = (nbx - 1 - bid // n_kv) * BQ
        R = R0 + np.arange(BQ)
        live = R < n_rows
        t_row, g_row = R // G, R % G
        Q = np.zeros((BQ, D), np.float32)
        Q[live] = q[t_row[live], kvh * G + g_row[live]]
        pos = start + t_row
        t_first, t_last = R0 // G, (min(R0 + BQ, n_rows) - 1) // G
        kv_hi = min(kv_len, start + t_last + 1)
        kv_lo = max(0, start + t_first - window + 1) if window > 0 else 0
        o = np.zeros((BQ, D), np.float32)
        m = np.full(BQ, -1e30, np.float32)
        l_run = np.zeros(BQ, np.float32)
        for kt in range(kv_lo, kv_hi, BK):
            j = kt + np.arange(BK)
            K = np.zeros((BK, D), np.float32)
            K[j < kv_len] = kc[j[j < kv_len], kvh]
            s = (Q @ K.T) * sc
            valid = (j[None, :] < kv_len) & (j[None, :] <= pos[:, None])
            if window > 0:
                valid &= j[None, :] > pos[:, None] - window
            mx = np.where(valid, s, np.float32(-1e30)).max(axis=1)
            m_new = np.maximum(m, mx)
            alpha = np.exp2(m - m_new)
            with np.errstate(over="ignore"):  # masked entries only
                p = np.where(valid, np.exp2(s - m_new[:, None]), np.float32(0)).astype(np.float32)
            l_run = l_run * alpha + p.sum(axis=1)
            m = m_new
            o *= alpha[:, None]
            n_keys = min(BK, kv_hi - kt)
            for k0 in range(0, n_keys, KC):
                jj = kt + k0 + np.arange(KC)
                V = np.zeros((KC, D), np.float32)
                V[jj < kv_len] = vc[jj[jj < kv_len], kvh]
                o += p[:, k0:k0 + KC] @ V
        inv = np.where(l_run > 0, 1 / np.where(l_run > 0, l_run, 1), 0).astype(np.float32)
        res = o * inv[:, None]
        out[t_row[live], kvh * G + g_row[live]] = res[live]
    return out


CASES = [(T, start, D, G, window) for T in (1, 5, 33, 64, 100, 257) for start in (0, 37) for D in (64, 256)
         for G in (1, 4) for window in (0, 16)]
CASES += [(70, 0, 128, 2, 0), (70, 37, 128, 8, 16), (130, 37, 128, 3, 0), (65, 1, 64, 5, 16)]
CASES = [c + (VBUF,) for c in CASES] + [(T, 37, D, 4, w, 2048) for T in (5, 100) for D in (64, 128, 256)
                                         for w in (0, 16)]  # sm_75 variant: V chunks of 8 KB


@pytest.mark.parametrize("T,start,D,G,window,vbuf", CASES)
def test_emulation_matches_reference(T, start, D, G, window, vbuf):
    rng = np.random.default_rng(T * 7 + start + D + G + window)
    n_kv = 2
    nh = n_kv * G
    kv_len = start + T
    q = rng.standard_normal((T, nh, D)).astype(np.float32)
    kc = rng.standard_normal((kv_len + 3, n_kv, D)).astype(np.float32)
    vc = rng.standard_normal((kv_len + 3, n_kv, D)).astype(np.float32)
    kc[kv_len:] = np.nan  # rows past the context must never reach the output
    vc[kv_len:] = np.nan
    scale = D ** -0.5
    ref = reference(q, kc, vc, start, kv_len, scale, window)
    y = emulate(q, kc, vc, start, kv_len, scale, window, vbuf)
    assert np.all(np.isfinite(y))
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert err < 1e-5, err
