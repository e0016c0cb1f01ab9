"""NumPy emulation of the split single-token Gated DeltaNet decode (kernels/fused.cu gdn_prep, gdn_state,
gdn_norm; fused.GDN_DECODE_VARIANT "split"), run on the CPU against the NumPy backend: the scratch layout
(fused.gdn_scratch_len), the channel and gate ownership of gdn_prep's blocks (each conv channel shifted by
the one thread that owns it), gdn_state's (value head, 32 columns) blocks with 8 warps of DK/8 rows, both
head-norm forms (gdn_norm per head of (B n_v, DV), or gdn_state's TAIL through the head counters), for one
sequence and for B sequences with their per-sequence offsets; the blocks of each launch in a random order.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from minecart.engine.backends.numpy_backend import NumpyBackend

from tests._fused_emulation import gdn_acts, gdn_case, head_norm, silu32

F32 = np.float32
PREP_CHANNELS = 128  # fused.GDN_PREP_CHANNELS
WARPS = 8  # fused.cu GDN_STATE_WARPS


def scratch_len(n_k, n_v, dk, dv):
    """fused.gdn_scratch_len (the kernel's and the wrapper's must agree with it)."""
    return 2 * n_k * dk + n_v * dv + 2 * n_v + n_k


def conv_channel(mixed, conv_state, conv_w, ch):
    """fused.cu gdn_conv_channel: conv + SiLU of channel ch, and its state shift."""
    kw = conv_w.shape[1]
    acc = F32(0)
    hist = [conv_state[r, ch] for r in range(kw - 1)]
    for r in range(kw - 1):
        acc = F32(acc + hist[r] * conv_w[ch, r])
    xin = mixed[ch]
    acc = F32(acc + xin * conv_w[ch, kw - 1])
    conv_state[:, ch] = hist[1:] + [xin]
    return silu32(acc)


def prep_block(blk, mixed, bet, alpha, conv_state, conv_w, ssm_a, dt_bias, scr, n_k, n_v, dk, dv, eps):
    key_dim = n_k * dk
    C = 2 * key_dim + n_v * dv
    if blk < n_k:
        kh = blk
        uq = np.array([conv_channel(mixed, conv_state, conv_w, kh * dk + t) for t in range(dk)], F32)
        uk = np.array([conv_channel(mixed, conv_state, conv_w, key_dim + kh * dk + t) for t in range(dk)], F32)
        rq = F32(1 / np.sqrt(F32((uq * uq).sum()) + F32(eps)))
        rk = F32(1 / np.sqrt(F32((uk * uk).sum()) + F32(eps)))
        q_scale = F32(1 / math.sqrt(dk))
        scr[kh * dk : (kh + 1) * dk] = uq * rq * q_scale
        scr[key_dim + kh * dk : key_dim + (kh + 1) * dk] = uk * rk
        scr[C + 2 * n_v + kh] = F32((uq * uk).sum()) * rq * q_scale * rk
        return
    for t in range(PREP_CHANNELS):
        i = (blk - n_k) * PREP_CHANNELS + t
        if i < n_v * dv:
            scr[2 * key_dim + i] = conv_channel(mixed, conv_state, conv_w, 2 * key_dim + i)
        if i < n_v:
            g = F32(ssm_a[i] * np.log1p(np.exp(F32(alpha[i] + dt_bias[i]))))
            scr[C + i] = np.exp(g)
            scr[C + n_v + i] = F32(1 / (1 + np.exp(-bet[i])))


def state_block(j, cb, scr, state, y, n_k, n_v, dk, dv):
    """One gdn_state block without its norm: o of columns 32 cb.. of head j to y, the state updated."""
    key_dim = n_k * dk
    C = 2 * key_dim + n_v * dv
    kh = j % n_k
    c0 = cb * 32
    nc = min(32, dv - c0)
    rw = dk // WARPS
    S = state[j][:, c0 : c0 + nc].copy()
    qn = scr[kh * dk : (kh + 1) * dk]
    kn = scr[key_dim + kh * dk : key_dim + (kh + 1) * dk]
    v = scr[2 * key_dim + j * dv + c0 : 2 * key_dim + j * dv + c0 + nc]
    a, beta, kq = scr[C + j], scr[C + n_v + j], scr[C + 2 * n_v + kh]
    pe = [kn[w * rw : (w + 1) * rw] @ S[w * rw : (w + 1) * rw] for w in range(WARPS)]
    pr = [qn[w * rw : (w + 1) * rw] @ S[w * rw : (w + 1) * rw] for w in range(WARPS)]
    e = (((pe[0] + pe[1]) + (pe[2] + pe[3])) + ((pe[4] + pe[5]) + (pe[6] + pe[7]))).astype(F32)
    r = (((pr[0] + pr[1]) + (pr[2] + pr[3])) + ((pr[4] + pr[5]) + (pr[6] + pr[7]))).astype(F32)
    d = (beta * (v - a * e)).astype(F32)
    state[j][:, c0 : c0 + nc] = (a * S + np.outer(kn, d)).astype(F32)
    y[j * dv + c0 : j * dv + c0 + nc] = (a * r + kq * d).astype(F32)


def emulate_gdn_split(mixed, z, bet, alpha, conv_tab, ssm_tab, conv_w, ssm_a, dt_bias, norm_w, y, B, n_k, n_v,
                      dk, dv, eps, rng, tail=False, counters=None):
    """The three (or, tail, two) launches of one token of B sequences over flat (B, ...) rows; conv_tab /
    ssm_tab: each sequence's states (its pointer tables). counters: B (n_k + n_v), for tail."""
    C, HV, NC = 2 * n_k * dk + n_v * dv, n_v * dv, n_k + n_v
    P = scratch_len(n_k, n_v, dk, dv)
    scr = np.full(B * P, np.nan, F32)  # cp.empty: whatever is unwritten stays NaN
    n_prep = n_k + math.ceil(n_v * dv / PREP_CHANNELS)
    blocks = [(s, blk) for s in range(B) for blk in range(n_prep)]
    for s, blk in (blocks[i] for i in rng.permutation(len(blocks))):
        prep_block(blk, mixed[s * C : (s + 1) * C], bet[s * n_v : (s + 1) * n_v], alpha[s * n_v : (s + 1) * n_v],
                   conv_tab[s], conv_w, ssm_a, dt_bias, scr[s * P : (s + 1) * P], n_k, n_v, dk, dv, eps)
    assert not np.isnan(scr).any(), "gdn_prep left part of the scratch unwritten"
    n_cb = (dv + 31) // 32
    blocks = [(s, j, cb) for s in range(B) for j in range(n_v) for cb in range(n_cb)]
    for s, j, cb in (blocks[i] for i in rng.permutation(len(blocks))):
        ys = y[s * HV : (s + 1) * HV]
        state_block(j, cb, scr[s * P : (s + 1) * P], ssm_tab[s], ys, n_k, n_v, dk, dv)
        if tail:  # the last column block of the head normalizes it
            cnt = counters[s * NC : (s + 1) * NC]
            prev = cnt[n_k + j]
            cnt[n_k + j] += 1
            if n_cb > 1 and prev != n_cb - 1:
                continue
            cnt[n_k + j] = 0
            ys[j * dv : (j + 1) * dv] = head_norm(ys[j * dv : (j + 1) * dv].copy(), z[s * HV + j * dv :][:dv],
                                                  norm_w, eps)
    if not tail:  # gdn_norm: head h of the (B n_v, DV) rows
        for h in rng.permutation(B * n_v):
            y[h * dv : (h + 1) * dv] = head_norm(y[h * dv : (h + 1) * dv].copy(), z[h * dv : (h + 1) * dv], norm_w,
                                                 eps)


@pytest.mark.parametrize("tail", [False, True], ids=["gdn_norm", "tail"])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("shape", [(1, 3, 16, 16, 4), (2, 4, 16, 64, 4), (3, 3, 32, 32, 3), (2, 6, 16, 48, 2),
                                   (1, 2, 128, 128, 4), (2, 2, 64, 80, 4), (1, 1, 16, 1, 2)])
def test_gdn_split(shape, B, tail):
    n_k, n_v, dk, dv, kw = shape
    nb = NumpyBackend()
    rng = np.random.default_rng(sum(shape) * 7 + B + tail)
    C, HV = 2 * n_k * dk + n_v * dv, n_v * dv
    w = gdn_case(rng, n_k, n_v, dk, dv, kw)
    weights = [w[k] for k in ("conv_w", "ssm_a", "dt_bias", "norm_w")]
    cases = [gdn_case(rng, n_k, n_v, dk, dv, kw) for _ in range(B)]
    conv = [c["conv"] for c in cases]
    ssm = [c["ssm"] for c in cases]
    conv_tab = [c.copy() for c in conv]
    ssm_tab = [s.copy() for s in ssm]
    counters = np.zeros(B * (n_k + n_v), np.int64)
    for step in range(3):
        acts = [np.concatenate(a) for a in zip(*(gdn_acts(rng, 1, n_k, n_v, dk, dv) for _ in range(B)),
                                                strict=True)]
        mixed, z, b, alpha = acts
        ref = nb.gdn_decode_batch(mixed, z, b, alpha, conv, ssm, *weights, n_k=n_k, n_v=n_v, dk=dk, dv=dv,
                                  eps=1e-6)
        flat = [a.reshape(-1) for a in acts]
        y = np.full(B * HV, np.nan, F32)
        emulate_gdn_split(*flat, conv_tab, ssm_tab, *weights, y, B, n_k, n_v, dk, dv, 1e-6, rng, tail=tail,
                          counters=counters)
        assert np.all(counters == 0), "a head counter was not reset by its last block"
        assert mixed.shape == (B, C)
        for s in range(B):
            np.testing.assert_array_equal(conv_tab[s], conv[s])  # every channel shifted exactly once
            np.testing.assert_allclose(y[s * HV : (s + 1) * HV], ref[s], rtol=2e-4, atol=2e-5,
                                       err_msg=f"step {step} sequence {s}")
            np.testing.assert_allclose(ssm_tab[s], ssm[s], rtol=2e-4, atol=2e-5)
