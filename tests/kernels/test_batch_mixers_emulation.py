"""NumPy emulations of the batched decode mixer launches, run on the CPU against the NumPy backend:

- kernels/fused.cu gdn_decode_batch: grid (n_v, B), sequence s's rows at offsets s C, s n_v DV and
  s n_v of flat (B, ...) buffers, its states through a table (a list here), its counters at s n_k; the blocks of all sequences interleaved in a random order (disjoint counters: no
  sequence's hand-over may see another's blocks);
- attention.cu flash_decode_batch + attn_merge_gate_batch: one split count for the batch (sized for the
  longest capacity over B x n_kv heads, fused.decode_batch_splits), slices sized per sequence for its own
  device-side length; partial slabs per sequence.
The head block's body itself is tests/kernels/test_fused_emulation.py's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from minecart.engine.backends.numpy_backend import NumpyBackend

from tests._fused_emulation import gdn_acts, gdn_case
from tests.kernels.test_fused_emulation import (
    _fd_split_len,
    emulate_decode_attention,
    emulate_gdn_decode,
)

F32 = np.float32


@pytest.mark.parametrize("B", [2, 5])
@pytest.mark.parametrize("shape", [(1, 3, 16, 16, 4), (2, 4, 16, 64, 4), (3, 3, 8, 32, 3)])
def test_gdn_decode_batch_layout(shape, B):
    n_k, n_v, dk, dv, kw = shape
    nb = NumpyBackend()
    rng = np.random.default_rng(sum(shape) * 3 + B)
    C, HV, NC = 2 * n_k * dk + n_v * dv, n_v * dv, n_k
    w = gdn_case(rng, n_k, n_v, dk, dv, kw)
    weights = [w[k] for k in ("conv_w", "ssm_a", "dt_bias", "norm_w")]
    cases = [gdn_case(rng, n_k, n_v, dk, dv, kw) for _ in range(B)]
    conv = [c["conv"] for c in cases]
    ssm = [c["ssm"] for c in cases]
    conv_tab = [c.copy() for c in conv]  # the states the kernel finds through its pointer tables
    ssm_tab = [s.copy() for s in ssm]
    counters = np.zeros(B * NC, np.int64)
    blocks = [(s, j) for s in range(B) for j in range(n_v)]
    for step in range(3):
        acts = [np.concatenate(a) for a in zip(*(gdn_acts(rng, 1, n_k, n_v, dk, dv) for _ in range(B)),
                                                strict=True)]
        mixed, z, b, alpha = acts  # (B, C), (B, HV), (B, n_v), (B, n_v)
        ref = nb.gdn_decode_batch(mixed, z, b, alpha, conv, ssm, *weights, n_k=n_k, n_v=n_v, dk=dk, dv=dv,
                                  eps=1e-6)
        flat = [a.reshape(-1) for a in acts]
        y = np.full(B * HV, np.nan, F32)
        for s, j in (blocks[i] for i in rng.permutation(len(blocks))):
            # what gdn_decode_batch hands its block body: row s of each input, its own states and counters
            emulate_gdn_decode(flat[0][s * C : (s + 1) * C], flat[1][s * HV : (s + 1) * HV],
                               flat[2][s * n_v : (s + 1) * n_v], flat[3][s * n_v : (s + 1) * n_v], conv_tab[s],
                               weights[0], weights[1], weights[2], weights[3], ssm_tab[s],
                               y[s * HV : (s + 1) * HV], n_k, n_v, dk, dv, 1e-6, [j],
                               counters[s * NC : (s + 1) * NC])
        assert np.all(counters == 0), "a sequence's counter was not reset by its last block"
        for s in range(B):
            np.testing.assert_array_equal(conv_tab[s], conv[s])
            np.testing.assert_allclose(y[s * HV : (s + 1) * HV], ref[s], rtol=2e-4, atol=2e-5,
                                       err_msg=f"step {step} sequence {s}")
            np.testing.assert_allclose(ssm_tab[s], ssm[s], rtol=2e-4, atol=2e-5)


def _batch_splits(capacities, n_kv, sms=132, blocks_per_sm=3):
    """fused.decode_batch_splits (ops.DECODE_BLOCKS_PER_SM blocks per multiprocessor)."""
    want = max(1, (blocks_per_sm * sms) // (n_kv * max(1, len(capacities))))
    span = max(max(capacities), 1)
    split_len = max(32, math.ceil(span / want / 32) * 32)
    return max(1, math.ceil(span / split_len))


@pytest.mark.parametrize("sms", [10, 132])
def test_decode_batch_slices_per_sequence(sms):
    rng = np.random.default_rng(sms)
    nh, n_kv, D = 4, 2, 16
    lengths = [1, 33, 700, 64, 2]  # after this token's append
    capacities = [64, 64, 1400, 128, 8]
    n_splits = _batch_splits(capacities, n_kv, sms)
    B = len(lengths)
    caches = [(rng.standard_normal((cap, n_kv, D)), rng.standard_normal((cap, n_kv, D))) for cap in capacities]
    q = rng.standard_normal((B, nh, D))
    for s, (L, (kc, vc)) in enumerate(zip(lengths, caches, strict=True)):
        ref = np.zeros((nh, D))
        for h in range(nh):
            sc = kc[:L, h // (nh // n_kv)] @ q[s, h] / 4
            e = np.exp(sc - sc.max())
            ref[h] = e @ vc[:L, h // (nh // n_kv)] / e.sum()
        got = emulate_decode_attention(q[s], kc, vc, L, 0.25, 0, n_splits, 0)
        assert np.all(np.isfinite(got)), f"sequence {s}: the merge read a split that holds no keys"
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12)
        assert _fd_split_len(0, L, n_splits) * n_splits >= L  # the slices cover the whole context
    assert n_splits > 1
