"""FusedOpsMixin (engine/backends/base.py): the NumPy compositions against the basic ops they stand for,
the qwen35 layer on them against the fixtures' path, and a NumPy emulation of kernels/fused.cu
gdn_decode's block structure (one block per value head, conv state of shared key heads written by the
last reader) run in random block orders, so the algorithm is checked without a GPU.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from minecart.engine.backends.numpy_backend import NumpyBackend

from tests._fused_emulation import conv_silu_block, gdn_acts, gdn_case, head_norm, qk_gates

F32 = np.float32


@pytest.fixture(scope="module")
def nb():
    return NumpyBackend()


def test_gdn_decode_equals_the_basic_ops(nb):
    """The mixin composition is the old qwen35 mixer body (T == 1 recurrence, T > 1 chunked)."""
    rng = np.random.default_rng(0)
    n_k, n_v, dk, dv, kw = 2, 4, 16, 8, 4
    for T in (1, 5):
        case = gdn_case(rng, n_k, n_v, dk, dv, kw)
        mixed, z, b, alpha = gdn_acts(rng, T, n_k, n_v, dk, dv)
        conv2, ssm2 = case["conv"].copy(), case["ssm"].copy()
        y = nb.gdn_decode(mixed, z, b, alpha, case["conv"], case["ssm"], case["conv_w"], case["ssm_a"],
                          case["dt_bias"], case["norm_w"], n_k=n_k, n_v=n_v, dk=dk, dv=dv, eps=1e-6)
        (u,) = nb.conv1d_silu(mixed, conv2, case["conv_w"])
        kd = n_k * dk
        q = nb.scale(nb.l2_norm(u[:, :kd].reshape(T, n_k, dk), 1e-6), 1.0 / math.sqrt(dk))
        k = nb.l2_norm(u[:, kd : 2 * kd].reshape(T, n_k, dk), 1e-6)
        v = u[:, 2 * kd :].reshape(T, n_v, dv)
        g, beta = nb.gdn_gates(alpha, b, case["ssm_a"], case["dt_bias"])
        step = nb.gdn_step if T == 1 else nb.gdn_chunk
        o = step(q, k, v, g, beta, ssm2)
        ref = nb.gated_rms_norm(o, z.reshape(T, n_v, dv), case["norm_w"], 1e-6).reshape(T, n_v * dv)
        np.testing.assert_array_equal(y, ref)
        np.testing.assert_array_equal(case["conv"], conv2)
        np.testing.assert_array_equal(case["ssm"], ssm2)


def test_gated_attention_and_matmul_ops_equal_the_basic_ops(nb):
    rng = np.random.default_rng(1)
    T, nh, n_kv, d = 3, 4, 2, 16
    qg = rng.standard_normal((T, nh, 2, d)).astype(F32)
    k = rng.standard_normal((T, n_kv, d)).astype(F32)
    v = rng.standard_normal((T, n_kv, d)).astype(F32)
    qn, kn = (1 + 0.1 * rng.standard_normal((2, d))).astype(F32)
    c1, c2 = nb.new_kv_cache(n_kv, d, d, 8), nb.new_kv_cache(n_kv, d, d, 8)
    pos = np.arange(T)
    y = nb.gated_attention(qg, k, v, c1, qn, kn, pos, n_rot=8, base=1e4, scale=0.25, eps=1e-6)
    q = nb.rope(nb.rms_norm(qg[:, :, 0, :], qn, 1e-6), pos, 8, 1e4)
    kr = nb.rope(nb.rms_norm(k, kn, 1e-6), pos, 8, 1e4)
    o = nb.attention(q, kr, v, c2, scale=0.25)
    ref = nb.mul(o, nb.sigmoid(qg[:, :, 1, :])).reshape(T, nh * d)
    np.testing.assert_array_equal(y, ref)


class _Delegating:
    """A wrapper backend that forwards everything (as engine/rig.py's RigBackend does)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_fixture_logits_through_a_delegating_backend(fixtures_dir):
    """The qwen35 layers on the fused ops give the fixture logits through a forwarding wrapper too."""
    from minecart.engine.model import load_model

    path = fixtures_dir / "dense/qwen35-tiny-dense-q8_0.gguf"
    ids = [1, 5, 9, 2, 7]
    with load_model(path, backend=NumpyBackend()) as m:
        ref = m.logits(ids)
    with load_model(path, backend=_Delegating(NumpyBackend())) as m:
        got = m.logits(ids)
    np.testing.assert_array_equal(got, ref)


# ---- emulation of fused.cu gdn_decode -----------------------------------------------------------------


def _q8_1_block(v):
    """common.cuh q8_1_block on one block of 32 fp32 values."""
    amax = np.abs(v).max()
    d = F32(amax / F32(127.0))
    q = np.rint(v / d).astype(np.int8) if amax > 0 else np.zeros(32, np.int8)
    return q, d, F32(d * F32(q.astype(F32).sum()))


def emulate_gdn_decode(mixed, z, bet, alpha, conv_state, conv_w, ssm_a, dt_bias, norm_w, state, n_k, n_v, dk, dv,
                       eps, order, counters):
    """fused.cu gdn_decode for one token, blocks run one after another in `order` (each to completion, as
    the worst interleaving for the conv-state hand-over allows). fp32 throughout. Returns y, q8 blocks."""
    key_dim = n_k * dk
    y = np.zeros(n_v * dv, F32)
    q8 = {}
    for j in order:
        kh = j % n_k
        chans = ([kh * dk + i for i in range(dk)] + [key_dim + kh * dk + i for i in range(dk)]
                 + [2 * key_dim + j * dv + i for i in range(dv)])
        readers = (n_v - 1 - kh) // n_k + 1
        u = conv_silu_block(mixed, conv_state, conv_w, chans, dk, kh, counters, readers)  # 1. conv + SiLU
        qs, ks, vs, g, beta = qk_gates(u, dk, eps, j, ssm_a, alpha, dt_bias, bet)
        S = state[j]  # (dk, dv), updated in place, one column per thread
        a = F32(np.exp(g))
        e = ks @ S
        r = qs @ S
        dlt = (beta * (vs - a * e)).astype(F32)
        S[...] = (a * S + np.outer(ks, dlt)).astype(F32)
        o = (a * r + F32(ks @ qs) * dlt).astype(F32)
        out = head_norm(o, z[j * dv : (j + 1) * dv], norm_w, eps)
        y[j * dv : (j + 1) * dv] = out
        if dv % 32 == 0:
            for w in range(dv // 32):
                q8[j * dv // 32 + w] = _q8_1_block(out[32 * w : 32 * w + 32])
    return y, q8


@pytest.mark.parametrize("shape", [(1, 3, 16, 16, 4), (2, 4, 16, 32, 4), (3, 3, 8, 32, 3), (2, 6, 16, 8, 2)])
def test_gdn_decode_emulation(nb, shape):
    n_k, n_v, dk, dv, kw = shape
    rng = np.random.default_rng(sum(shape))
    case = gdn_case(rng, n_k, n_v, dk, dv, kw)
    conv_e, ssm_e = case["conv"].copy(), case["ssm"].copy()
    counters = np.zeros(n_k, np.int64)
    for step in range(3):
        mixed, z, b, alpha = gdn_acts(rng, 1, n_k, n_v, dk, dv)
        ref = nb.gdn_decode(mixed, z, b, alpha, case["conv"], case["ssm"], case["conv_w"], case["ssm_a"],
                            case["dt_bias"], case["norm_w"], n_k=n_k, n_v=n_v, dk=dk, dv=dv, eps=1e-6)
        order = rng.permutation(n_v)
        y, q8 = emulate_gdn_decode(mixed[0], z[0], b[0], alpha[0], conv_e, case["conv_w"], case["ssm_a"],
                                   case["dt_bias"], case["norm_w"], ssm_e, n_k, n_v, dk, dv, 1e-6, order, counters)
        assert np.all(counters == 0), "a counter was not reset by the last reader"
        np.testing.assert_array_equal(conv_e, case["conv"])  # every channel shifted exactly once
        np.testing.assert_allclose(y, ref[0], rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(ssm_e, case["ssm"], rtol=2e-4, atol=2e-5)
        for blk, (q, d, s) in q8.items():
            rq, rd, rs = _q8_1_block(y[32 * blk : 32 * blk + 32])
            assert np.array_equal(q, rq) and d == rd and s == rs, f"step {step}"
