"""fp32 NumPy pieces of the emulations of kernels/fused.cu gdn_decode, shared by the whole-head form
(tests/engine/test_fused_ops.py) and the head-block form (tests/kernels/test_fused_emulation.py):
random layer weights and activations, the conv + SiLU of one block's channels with the q/k conv-state
hand-over to the key head's last reader, the q/k normalization and gates, and the head's gated RMSNorm.
"""

from __future__ import annotations

import math

import numpy as np

F32 = np.float32


def gdn_case(rng, n_k, n_v, dk, dv, kw):
    """Random GDN layer state and weights: conv state, ssm state, conv weights, A, dt bias, norm weight."""
    C = 2 * n_k * dk + n_v * dv
    return dict(
        conv=rng.standard_normal((kw - 1, C)).astype(F32),
        ssm=(rng.standard_normal((n_v, dk, dv)) * 0.1).astype(F32),
        conv_w=(rng.standard_normal((C, kw)) * 0.5).astype(F32),
        ssm_a=-np.exp(rng.standard_normal(n_v)).astype(F32),
        dt_bias=rng.standard_normal(n_v).astype(F32),
        norm_w=(1 + 0.2 * rng.standard_normal(dv)).astype(F32),
    )


def gdn_acts(rng, T, n_k, n_v, dk, dv):
    """Random (mixed qkv, z, beta logits, alpha) for T tokens."""
    C = 2 * n_k * dk + n_v * dv
    return (rng.standard_normal((T, C)).astype(F32), rng.standard_normal((T, n_v * dv)).astype(F32),
            rng.standard_normal((T, n_v)).astype(F32), rng.standard_normal((T, n_v)).astype(F32))


def silu32(x):
    x = F32(x)
    return F32(x / (F32(1) + np.exp(-x, dtype=F32)))


def conv_silu_block(mixed, conv_state, conv_w, chans, dk, kh, counters, readers):
    """Step 1 of a gdn_decode block over channels `chans` (dk q, dk k, then its value channels): conv +
    SiLU -> u. The value channels' conv state is shifted at once; the q/k shift is staged and written
    by the last of the `readers` blocks of key head kh (counters[kh] counts them and is reset)."""
    kw = conv_w.shape[1]
    u = np.zeros(len(chans), F32)
    newst = np.zeros((kw - 1, 2 * dk), F32)
    for idx, ch in enumerate(chans):
        hist = [conv_state[r, ch] for r in range(kw - 1)]
        acc = F32(0)
        for r in range(kw - 1):
            acc = F32(acc + hist[r] * conv_w[ch, r])
        xin = mixed[ch]
        acc = F32(acc + xin * conv_w[ch, kw - 1])
        u[idx] = silu32(acc)
        shifted = hist[1:] + [xin]
        for r in range(kw - 1):
            if idx >= 2 * dk:
                conv_state[r, ch] = shifted[r]
            else:
                newst[r, idx] = shifted[r]
    prev = counters[kh]
    counters[kh] += 1
    if prev == readers - 1:  # the last reader of key head kh writes its conv state
        counters[kh] = 0
        for idx in range(2 * dk):
            conv_state[:, chans[idx]] = newst[:, idx]
    return u


def qk_gates(u, dk, eps, j, ssm_a, alpha, dt_bias, bet):
    """Steps 2-3 for value head j: L2-normed q (scaled by dk^-1/2) and k, the block's v, the decay g and beta."""
    qs, ks, vs = u[:dk], u[dk : 2 * dk], u[2 * dk :]
    qs = (qs / np.sqrt(F32((qs * qs).sum()) + F32(eps))).astype(F32) * F32(1 / math.sqrt(dk))
    ks = (ks / np.sqrt(F32((ks * ks).sum()) + F32(eps))).astype(F32)
    g = F32(ssm_a[j] * np.log1p(np.exp(F32(alpha[j] + dt_bias[j]))))
    beta = F32(1 / (1 + np.exp(-bet[j])))
    return qs, ks, vs, g, beta


def head_norm(o, z_head, norm_w, eps):
    """The head's gated RMSNorm: o / rms(o) * norm_w * silu(z)."""
    inv = F32(1 / np.sqrt(F32((o * o).sum() / o.size) + F32(eps)))
    zs = np.array([silu32(t) for t in z_head], F32)
    return (o * inv * norm_w * zs).astype(F32)
