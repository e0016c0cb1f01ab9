"""NumPy emulations of the blocking of two fused decode kernels, run on the CPU against the NumPy
backend: kernels/fused.cu gdn_decode (a block per value head, the q/k conv-state hand-over to the key
head's last reader, blocks in random orders) and the
graph-style split of attention.cu flash_decode + flash_merge_len / attn_merge_gate (slices sized for the
device-side length, splits past it skipped), and the blocking of the split merge itself (common.cuh
merge_head_splits).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from minecart.engine.backends.numpy_backend import NumpyBackend

from tests._fused_emulation import conv_silu_block, gdn_acts, gdn_case, head_norm, qk_gates

F32 = np.float32


def emulate_gdn_decode(mixed, z, bet, alpha, conv_state, conv_w, ssm_a, dt_bias, norm_w, state, y, n_k, n_v,
                       dk, dv, eps, order, counters):
    """One token; blocks j (a value head each) run one after another in `order`, each to its end.
    counters: [0, n_k), the readers of each key head's q/k conv state."""
    key_dim = n_k * dk
    rw = dk // 4
    for j in order:
        kh = j % n_k
        S = state[j].copy()  # 0. the head's state, loaded first
        chans = ([kh * dk + i for i in range(dk)] + [key_dim + kh * dk + i for i in range(dk)]
                 + [2 * key_dim + j * dv + i for i in range(dv)])
        readers = (n_v - 1 - kh) // n_k + 1
        u = conv_silu_block(mixed, conv_state, conv_w, chans, dk, kh, counters, readers)  # 1. conv + SiLU
        qs, ks, vs, g, beta = qk_gates(u, dk, eps, j, ssm_a, alpha, dt_bias, bet)
        a = F32(np.exp(g))
        # 4. four row-quarter warps per column; partial sums added as ((p0 + p1) + (p2 + p3))
        pe = [ks[w * rw : (w + 1) * rw] @ S[w * rw : (w + 1) * rw] for w in range(4)]
        pr = [qs[w * rw : (w + 1) * rw] @ S[w * rw : (w + 1) * rw] for w in range(4)]
        e = ((pe[0] + pe[1]) + (pe[2] + pe[3])).astype(F32)
        r = ((pr[0] + pr[1]) + (pr[2] + pr[3])).astype(F32)
        dlt = (beta * (vs - a * e)).astype(F32)
        state[j] = (a * S + np.outer(ks, dlt)).astype(F32)
        qr, kr = u[:dk], u[dk : 2 * dk]  # 2. k . q from the raw vectors' sums (one block reduction)
        kq = F32(F32(qr @ kr) / np.sqrt(F32(kr @ kr) + F32(eps)) / np.sqrt(F32(qr @ qr) + F32(eps))
                 * F32(1 / math.sqrt(dk)))
        o = (a * r + kq * dlt).astype(F32)  # 5. o, normalized over the head in the block
        y[j * dv : (j + 1) * dv] = head_norm(o, z[j * dv : (j + 1) * dv], norm_w, eps)


@pytest.mark.parametrize("shape", [(1, 3, 16, 16, 4), (2, 4, 16, 64, 4), (3, 3, 8, 32, 3), (2, 6, 16, 48, 2),
                                   (1, 2, 32, 128, 4)])
def test_gdn_decode_head_blocks(shape):
    n_k, n_v, dk, dv, kw = shape
    nb = NumpyBackend()
    rng = np.random.default_rng(sum(shape) + 1)
    case = gdn_case(rng, n_k, n_v, dk, dv, kw)
    conv, ssm, conv_w, ssm_a, dt_bias, norm_w = (case[k] for k in ("conv", "ssm", "conv_w", "ssm_a", "dt_bias",
                                                                   "norm_w"))
    conv_e, ssm_e = conv.copy(), ssm.copy()
    counters = np.zeros(n_k, np.int64)
    for step in range(3):
        mixed, z, b, alpha = gdn_acts(rng, 1, n_k, n_v, dk, dv)
        ref = nb.gdn_decode(mixed, z, b, alpha, conv, ssm, conv_w, ssm_a, dt_bias, norm_w, n_k=n_k, n_v=n_v,
                            dk=dk, dv=dv, eps=1e-6)
        order = [int(j) for j in rng.permutation(n_v)]
        y = np.full(n_v * dv, np.nan, F32)
        emulate_gdn_decode(mixed[0], z[0], b[0], alpha[0], conv_e, conv_w, ssm_a, dt_bias, norm_w, ssm_e, y,
                           n_k, n_v, dk, dv, 1e-6, order, counters)
        assert np.all(counters == 0), "a counter was not reset by its last block"
        np.testing.assert_array_equal(conv_e, conv)  # every channel shifted exactly once
        np.testing.assert_allclose(y, ref[0], rtol=2e-4, atol=2e-5, err_msg=f"step {step}")
        np.testing.assert_allclose(ssm_e, ssm, rtol=2e-4, atol=2e-5)


# ---- graph-style decode attention split ---------------------------------------------------------------

def _fd_split_len(split_len, kv_len, n_splits):
    """common.cuh fd_split_len."""
    return split_len if split_len > 0 else max(32, (kv_len + 32 * n_splits - 1) // (32 * n_splits) * 32)


def emulate_decode_attention(q, kc, vc, kv_len, scale, window, n_splits, split_len):
    """flash_decode over (KV head, split) blocks + the merge of the splits below the length."""
    nh, D = q.shape
    n_kv = kc.shape[1]
    G = nh // n_kv
    sl = _fd_split_len(split_len, kv_len, n_splits)
    po = np.full((n_splits, nh, D), np.nan)  # splits that exit at once leave their partials unwritten
    pm = np.full((n_splits, nh), np.nan)
    pl = np.full((n_splits, nh), np.nan)
    p = kv_len - 1
    for s in range(n_splits):
        if s * sl >= kv_len:
            continue
        lo, hi = s * sl, min(kv_len, s * sl + sl)
        if window > 0:
            lo = max(lo, p - window + 1)
        for h in range(nh):
            if lo >= hi:
                po[s, h], pm[s, h], pl[s, h] = 0.0, -1e30, 0.0
                continue
            sc = kc[lo:hi, h // G] @ q[h] * scale
            m = sc.max()
            e = np.exp(sc - m)
            po[s, h], pm[s, h], pl[s, h] = e @ vc[lo:hi, h // G], m, e.sum()
    ns = min(n_splits, (kv_len + sl - 1) // sl)
    m = pm[:ns].max(axis=0)
    w = np.exp(pm[:ns] - m)
    return (w[:, :, None] * po[:ns]).sum(axis=0) / (w * pl[:ns]).sum(axis=0)[:, None]


@pytest.mark.parametrize("window", [0, 50])
def test_decode_split_for_the_device_length(window):
    rng = np.random.default_rng(3 + window)
    nh, n_kv, D, cap = 4, 2, 16, 2048
    kc = rng.standard_normal((cap, n_kv, D))
    vc = rng.standard_normal((cap, n_kv, D))
    want = 40
    split_len = max(32, math.ceil(cap / want / 32) * 32)
    n_splits = max(1, math.ceil(cap / split_len))
    for L in (1, 31, 32, 33, 70, 500, 1999, cap):
        q = rng.standard_normal((nh, D))
        lo = max(0, L - window) if window > 0 else 0
        ref = np.zeros((nh, D))
        for h in range(nh):
            sc = kc[lo:L, h // (nh // n_kv)] @ q[h] / 4
            e = np.exp(sc - sc.max())
            ref[h] = e @ vc[lo:L, h // (nh // n_kv)] / e.sum()
        got = emulate_decode_attention(q, kc, vc, L, 0.25, window, n_splits, 0)
        assert np.all(np.isfinite(got)), f"L={L}: the merge read a split that holds no keys"
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12)
        assert _fd_split_len(0, L, n_splits) * n_splits >= L


# ---- inside one flash_decode block: 4 warps, groups of U keys, merged in warp order ---------------------

NEG_BIG = -1.0e30


def emulate_flash_decode_block(q, k, v, lo, hi, scale, U, warps=4):
    """attention.cu flash_decode<D, GM> for one (KV head, slice) block, in float32: warp w takes the
    key groups starting at lo + w*U, lo + (w + warps)*U, ...; each group's scores update the warp's
    running max, sum and unnormalized output (alpha rescale); then the warps are merged in order.
    q (G, D), k/v (L, D). Returns the slice's partials (o (G, D), m (G,), l (G,))."""
    f32 = np.float32
    G, D = q.shape
    ms = np.full((warps, G), NEG_BIG, f32)
    ls = np.zeros((warps, G), f32)
    os_ = np.zeros((warps, G, D), f32)
    for w in range(warps):
        for t0 in range(lo + w * U, hi, warps * U):
            ts = [t for t in range(t0, t0 + U)]
            s = np.array([[(q[g] @ k[t]) * f32(scale) if t < hi else NEG_BIG for t in ts] for g in range(G)], f32)
            m_new = np.maximum(ms[w], s.max(axis=1))
            alpha = np.exp(ms[w] - m_new).astype(f32)
            p = np.where(np.array(ts)[None, :] < hi, np.exp(s - m_new[:, None]), 0).astype(f32)
            vv = np.stack([v[t] if t < hi else np.zeros(D, f32) for t in ts])
            os_[w] = os_[w] * alpha[:, None] + p @ vv
            ls[w] = ls[w] * alpha + p.sum(axis=1)
            ms[w] = m_new
    M = ms.max(axis=0)
    f = np.exp(ms - M).astype(f32)
    o = np.zeros((G, D), f32)
    for w in range(warps):  # warp order, as the kernel adds them in shared memory
        o += os_[w] * f[w][:, None]
    return o, M, (ls * f).sum(axis=0)


@pytest.mark.parametrize("U", [2, 4])
@pytest.mark.parametrize("lo,hi", [(0, 1), (0, 7), (5, 37), (64, 160), (3, 3 + 4 * 4 * 3 + 1), (10, 10)])
def test_flash_decode_block_equals_softmax(U, lo, hi):
    rng = np.random.default_rng(lo * 7 + hi + U)
    G, D, L = 4, 64, 200
    q = rng.standard_normal((G, D)).astype(np.float32)
    k = (3 * rng.standard_normal((L, D))).astype(np.float32)  # large scores: the rescales matter
    v = rng.standard_normal((L, D)).astype(np.float32)
    o, m, l = emulate_flash_decode_block(q, k, v, lo, hi, 0.125, U)
    if lo >= hi:  # a slice cut away by the window: neutral partials for the merge
        assert np.all(m == NEG_BIG) and np.all(l == 0) and np.all(o == 0)
        return
    s = (q.astype(np.float64) @ k[lo:hi].T.astype(np.float64)) * 0.125
    np.testing.assert_allclose(m, s.max(axis=1), rtol=1e-5)
    e = np.exp(s - s.max(axis=1, keepdims=True))
    np.testing.assert_allclose(l, e.sum(axis=1), rtol=1e-5)
    np.testing.assert_allclose(o / l[:, None], (e @ v[lo:hi]) / e.sum(axis=1, keepdims=True), rtol=2e-5, atol=2e-6)


# ---- the split merge (common.cuh merge_head_splits) ---------------------------------------------------

def _defines(src: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"^#define (MERGE_\w+) (\d+)$", src, re.M)}


def test_the_merge_launch_matches_the_kernels_geometry():
    kernels = Path(__file__).resolve().parents[2] / "kernels"
    d = _defines((kernels / "common.cuh").read_text())
    ops_src = (kernels / "ops.py").read_text()
    for name in ("MERGE_COLS", "MERGE_THREADS"):
        assert re.search(rf"^{name} = {d[name]}$", ops_src, re.M), name
    assert d["MERGE_COLS"] % 4 == 0 and d["MERGE_THREADS"] % (d["MERGE_COLS"] // 4) == 0
    assert all(D % d["MERGE_COLS"] == 0 for D in (64, 128, 256))  # build.HEAD_DIMS


def emulate_merge(po, pm, pl, ns, h, c0, cols, threads, loads):
    """merge_head_splits for columns c0 .. c0 + cols of head h: the chunks of `threads` splits, part p's
    rounds of `loads` splits p, p + P, ... (P = threads / (cols / 4)), the parts added in order; float32.
    Returns (the merged columns, how often each split's partials were read)."""
    tpr = cols // 4
    P = threads // tpr
    m = pm[:ns, h].max()
    w = np.exp(pm[:ns, h] - m).astype(F32)
    L = F32((w * pl[:ns, h]).sum())
    acc = np.zeros((P, cols), F32)
    reads = np.zeros(po.shape[0], np.int64)
    for s0 in range(0, ns, threads):
        n = min(threads, ns - s0)
        for part in range(P):
            for s1 in range(part, n, loads * P):
                for k in range(loads):
                    s = s1 + k * P
                    if s < n:
                        reads[s0 + s] += 1
                        acc[part] += w[s0 + s] * po[s0 + s, h, c0 : c0 + cols]
    r = acc[0].copy()
    for k in range(1, P):
        r += acc[k]
    return r / L, reads


@pytest.mark.parametrize("ns", [1, 3, 61, 64, 65, 257, 600])
def test_the_merge_reads_every_split_below_the_length_once(ns):
    rng = np.random.default_rng(ns)
    nh, D, cap = 3, 128, 640
    po = rng.standard_normal((cap, nh, D)).astype(F32)
    pm = rng.standard_normal((cap, nh)).astype(F32)
    pl = rng.uniform(0.5, 2.0, (cap, nh)).astype(F32)
    po[ns:], pm[ns:], pl[ns:] = np.nan, np.nan, np.nan  # past the length: never read
    for h in range(nh):
        for c0 in range(0, D, 64):
            got, reads = emulate_merge(po, pm, pl, ns, h, c0, 64, 256, 4)
            assert (reads[:ns] == 1).all() and (reads[ns:] == 0).all()
            w = np.exp(pm[:ns, h].astype(np.float64) - pm[:ns, h].max())
            ref = (w[:, None] * po[:ns, h, c0 : c0 + 64]).sum(0) / (w * pl[:ns, h]).sum()
            np.testing.assert_allclose(got, ref, rtol=2e-5, atol=1e-6)
