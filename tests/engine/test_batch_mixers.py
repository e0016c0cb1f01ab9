"""The batched mixer ops of a decode step (Backend.gdn_decode_batch, gated_attention_batch) on the
NumPy backend, and the model's dispatch to them.

- The default implementation (base.FusedOpsMixin, what the NumPy backend runs and the CUDA kernels are
  checked against) is the single-sequence op row by row: bit-for-bit the same outputs and states, for
  caches of different lengths and every KV type, text and M-RoPE positions.
- qwen35's mixers call the batched ops exactly when every sequence of a SequenceRows has one row (a
  decode step), and per_sequence otherwise (a prefill chunk sharing the pass).
- forward_batch's logits over a decode step equal the former per-sequence path bit-for-bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine.backends.base import LayerState
from minecart.engine.backends.numpy_backend import NumpyBackend
from minecart.engine.model import load_model
from minecart.engine.models.batch import SequenceRows
from minecart.engine.models.spec import ATTN, GDN

N_K, N_V, DK, DV, KW = 2, 4, 16, 16, 4
NH, N_KV, D = 4, 2, 64


def _gdn_inputs(rng, B: int):
    C = 2 * N_K * DK + N_V * DV
    f = lambda *s, sc=1.0: (rng.standard_normal(s) * sc).astype(np.float32)  # noqa: E731
    rows = (f(B, C), f(B, N_V * DV), f(B, N_V), f(B, N_V))
    states = [(f(KW - 1, C), f(N_V, DK, DV, sc=0.3)) for _ in range(B)]
    weights = (f(C, KW, sc=0.5), -np.exp(f(N_V)), f(N_V), 1.0 + f(DV, sc=0.1))
    return rows, states, weights


@pytest.mark.parametrize("B", [1, 2, 5])
def test_default_gdn_decode_batch_is_gdn_decode_per_row(B):
    be = NumpyBackend()
    (mixed, z, b, alpha), states, weights = _gdn_inputs(np.random.default_rng(B), B)
    dims = dict(n_k=N_K, n_v=N_V, dk=DK, dv=DV, eps=1e-6)
    alone_states = [(c.copy(), s.copy()) for c, s in states]
    expect = np.concatenate([
        be.gdn_decode(mixed[i:i + 1], z[i:i + 1], b[i:i + 1], alpha[i:i + 1], *alone_states[i], *weights, **dims)
        for i in range(B)])
    got = be.gdn_decode_batch(mixed, z, b, alpha, [c for c, _ in states], [s for _, s in states], *weights,
                              **dims)
    assert got.shape == (B, N_V * DV) and got.dtype == np.float32
    np.testing.assert_array_equal(got, expect)
    for (c, s), (ca, sa) in zip(states, alone_states, strict=True):
        np.testing.assert_array_equal(c, ca)
        np.testing.assert_array_equal(s, sa)
    assert not np.array_equal(states[0][0], _gdn_inputs(np.random.default_rng(B), B)[1][0][0])  # updated


def _filled_cache(be, rng, length: int, kv_type: str):
    cache = be.new_kv_cache(N_KV, D, D, 4, kv_type=kv_type)
    if length:
        cache.append(rng.standard_normal((length, N_KV, D)).astype(np.float32),
                     rng.standard_normal((length, N_KV, D)).astype(np.float32))
    return cache


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0", "q3"])
@pytest.mark.parametrize("mrope", [False, True])
def test_default_gated_attention_batch_is_gated_attention_per_row(kv_type, mrope):
    be = NumpyBackend()
    rng = np.random.default_rng(7)
    lengths = [0, 5, 37]  # a first token, a short and a longer context (past the caches' capacity 4)
    B = len(lengths)
    caches = [_filled_cache(be, rng, n, kv_type) for n in lengths]
    twins = [c.clone() for c in caches]
    qg = rng.standard_normal((B, NH, 2, D)).astype(np.float32)
    k = rng.standard_normal((B, N_KV, D)).astype(np.float32)
    v = rng.standard_normal((B, N_KV, D)).astype(np.float32)
    q_norm, k_norm = (1.0 + 0.1 * rng.standard_normal(D)).astype(np.float32), np.ones(D, np.float32)
    if mrope:
        positions = [np.array([[n], [n + 1], [2 * n]]) for n in lengths]
        rope = dict(n_rot=16, base=1e4, sections=(3, 3, 2, 0), scale=D ** -0.5, eps=1e-6)
    else:
        positions = [np.array([n]) for n in lengths]
        rope = dict(n_rot=16, base=1e4, scale=D ** -0.5, eps=1e-6)
    expect = np.concatenate([be.gated_attention(qg[i:i + 1], k[i:i + 1], v[i:i + 1], twins[i], q_norm, k_norm,
                                                positions[i], **rope) for i in range(B)])
    got = be.gated_attention_batch(qg, k, v, caches, q_norm, k_norm, positions, **rope)
    assert got.shape == (B, NH * D)
    np.testing.assert_array_equal(got, expect)
    for c, t, n in zip(caches, twins, lengths, strict=True):
        assert c.length == t.length == n + 1
        for a, b in zip(c.read(c.length), t.read(t.length), strict=True):  # (K, V) as stored, widened
            np.testing.assert_array_equal(a, b)


def test_batched_mixers_reject_a_state_count_that_does_not_match_the_rows():
    be = NumpyBackend()
    (mixed, z, b, alpha), states, weights = _gdn_inputs(np.random.default_rng(0), 3)
    with pytest.raises(ValueError, match="3 rows need 3 conv and ssm states"):
        be.gdn_decode_batch(mixed, z, b, alpha, [c for c, _ in states[:2]], [s for _, s in states[:2]],
                            *weights, n_k=N_K, n_v=N_V, dk=DK, dv=DV, eps=1e-6)
    qg = np.ones((2, NH, 2, D), np.float32)
    k = v = np.ones((2, N_KV, D), np.float32)
    with pytest.raises(ValueError, match="2 rows need 2 caches and positions"):
        be.gated_attention_batch(qg, k, v, [be.new_kv_cache(N_KV, D, D, 4)], np.ones(D, np.float32),
                                 np.ones(D, np.float32), [np.array([0])] * 2, n_rot=16, base=1e4,
                                 scale=0.125, eps=1e-6)


def test_sequence_rows_decoding():
    st = (LayerState(), LayerState(), LayerState())
    pos = (np.array([3]), np.array([9]), np.array([0]))
    assert SequenceRows(st, (0, 1, 2, 3), pos).decoding
    assert not SequenceRows(st, (0, 1, 5, 6), (pos[0], np.arange(4), pos[2])).decoding


class _Counting(NumpyBackend):
    """The NumPy backend, counting the batched mixer calls and the rows they get."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def gdn_decode_batch(self, mixed, *args, **kw):
        self.calls.append(("gdn", mixed.shape[0]))
        return super().gdn_decode_batch(mixed, *args, **kw)

    def gated_attention_batch(self, qg, *args, **kw):
        self.calls.append(("attn", qg.shape[0]))
        return super().gated_attention_batch(qg, *args, **kw)


@pytest.fixture(scope="module")
def counted(fixtures_dir):
    be = _Counting()
    model = load_model(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", backend=be)
    yield model, be
    model.close()


def _sessions(model, prompts):
    sessions = [model.new_session() for _ in prompts]
    for s, p in zip(sessions, prompts, strict=True):
        s.prefill(p)
    return sessions


def test_qwen35_decode_step_calls_the_batched_mixers_once_per_layer(counted):
    model, be = counted
    kinds = model.config.layer_types
    sessions = _sessions(model, [[5, 6, 7], [8], [9, 10, 11, 12, 13]])
    be.calls.clear()
    model.executor.forward_batch([[1], [2], [3]], [s.states for s in sessions],
                                 [np.array([s.position]) for s in sessions])
    assert sorted(be.calls) == sorted([("gdn", 3)] * kinds.count(GDN) + [("attn", 3)] * kinds.count(ATTN))
    assert kinds.count(GDN) and kinds.count(ATTN)
    be.calls.clear()  # a prompt chunk sharing the pass: every mixer per sequence, none batched
    model.executor.forward_batch([[1], [4, 5, 6]], [sessions[0].states, sessions[1].states],
                                 [np.array([sessions[0].position + 1]),
                                  np.arange(sessions[1].position + 1, sessions[1].position + 4)])
    assert be.calls == []
    for s in sessions:
        s.close()


def test_forward_batch_decode_equals_the_per_sequence_path_bit_for_bit(fixtures_dir, monkeypatch):
    """A decode step through the batched mixers gives the logits and states the per-sequence path gave
    (the default ops are that path, op for op)."""
    model = load_model(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", devices=["cpu:0"])
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    tokens = [[11, 12, 13], [21, 22, 23], [31, 32, 33], [41, 42, 43]]

    def run() -> tuple[np.ndarray, list]:
        sessions = _sessions(model, prompts)
        pos = [s.position for s in sessions]
        out = [model.executor.forward_batch([[t] for t in step], [s.states for s in sessions],
                                            [np.array([p + k]) for p in pos])
               for k, step in enumerate(tokens)]
        last = [s.step(7) for s in sessions]  # the state the batch left continues alone
        for s in sessions:
            s.close()
        return np.stack(out), last

    got, got_last = run()
    monkeypatch.setattr(SequenceRows, "decoding", property(lambda self: False))
    old, old_last = run()
    np.testing.assert_array_equal(got, old)
    for a, b in zip(got_last, old_last, strict=True):
        np.testing.assert_array_equal(a, b)
    model.close()
