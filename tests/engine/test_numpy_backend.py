"""NumpyBackend ops against plain loop-by-loop references written here from the architecture doc.

Random inputs (several seeds, odd sizes, n_v != n_k so the tiled head rule matters), never zeros.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from minecart.engine.backends.base import Backend, KVCache
from minecart.engine.backends.numpy_backend import NumpyBackend
from minecart.engine.gguf_file import GGUFFile

be = NumpyBackend()


def test_protocols():
    assert isinstance(be, Backend)
    assert isinstance(be.new_kv_cache(2, 8, 8, 4), KVCache)
    with pytest.raises(ValueError):
        NumpyBackend("cuda:0")


# ---- Gated DeltaNet -----------------------------------------------------------------------------


def _gdn_inputs(rng, T, n_k=2, n_v=6, dk=8, dv=5):
    q = rng.standard_normal((T, n_k, dk))
    k = rng.standard_normal((T, n_k, dk))
    q = (q / np.linalg.norm(q, axis=-1, keepdims=True) / math.sqrt(dk)).astype(np.float32)
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32)
    v = rng.standard_normal((T, n_v, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 3.0, (T, n_v)).astype(np.float32)  # strong and weak decays
    g[::7] = -12.0  # some near-total forgetting: the masked exp must not overflow
    beta = rng.uniform(0.05, 0.95, (T, n_v)).astype(np.float32)
    state = rng.standard_normal((n_v, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, state


def _gdn_loop_reference(q, k, v, g, beta, state):
    """Doc 3.4 step 6, one head and one token at a time, float64."""
    T, n_k, _ = q.shape
    n_v = v.shape[1]
    S = state.astype(np.float64).copy()
    out = np.zeros(v.shape)
    for t in range(T):
        for j in range(n_v):
            kh = j % n_k  # GGUF tiled order
            S[j] *= math.exp(g[t, j])
            e = S[j].T @ k[t, kh]
            d = beta[t, j] * (v[t, j] - e)
            S[j] += np.outer(k[t, kh], d)
            out[t, j] = S[j].T @ q[t, kh]
    return out, S


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("T", [1, 5, 64, 65, 130])
def test_gdn_step_and_chunk_match_loop_reference(seed, T):
    rng = np.random.default_rng(seed)
    q, k, v, g, beta, state = _gdn_inputs(rng, T)
    ref_out, ref_state = _gdn_loop_reference(q, k, v, g, beta, state)
    for fn in ("gdn_step", "gdn_chunk"):
        st = state.copy()
        out = getattr(be, fn)(q, k, v, g, beta, st)
        assert out.dtype == np.float32 and st.dtype == np.float32
        np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5, err_msg=fn)
        np.testing.assert_allclose(st, ref_state, rtol=1e-5, atol=1e-5, err_msg=fn)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_gdn_chunk_size_and_split_calls_do_not_change_result(chunk):
    rng = np.random.default_rng(3)
    q, k, v, g, beta, state = _gdn_inputs(rng, 100, n_k=3, n_v=6, dk=4, dv=7)
    ref_out, ref_state = _gdn_loop_reference(q, k, v, g, beta, state)
    st = state.copy()
    parts = [be.gdn_chunk(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], st, chunk=chunk)
             for a, b in ((0, 37), (37, 38), (38, 100))]
    np.testing.assert_allclose(np.concatenate(parts), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(st, ref_state, rtol=1e-5, atol=1e-5)


def test_gdn_value_heads_use_tiled_key_heads():
    """Changing key head 1 must change exactly the value heads j with j % n_k == 1."""
    rng = np.random.default_rng(4)
    q, k, v, g, beta, state = _gdn_inputs(rng, 9, n_k=2, n_v=6)
    base = be.gdn_chunk(q, k, v, g, beta, state.copy())
    k2 = k.copy()
    k2[:, 1] = k[:, 0]
    changed = np.abs(be.gdn_chunk(q, k2, v, g, beta, state.copy()) - base).max(axis=(0, 2)) > 1e-6
    assert list(changed) == [j % 2 == 1 for j in range(6)]


def test_conv1d_silu_matches_loop_and_carries_state():
    rng = np.random.default_rng(5)
    C, K, T = 11, 4, 9
    w = rng.standard_normal((C, K)).astype(np.float32)
    hist = rng.standard_normal((K - 1, C)).astype(np.float32)
    x = rng.standard_normal((T, C)).astype(np.float32)
    X = np.concatenate([hist, x]).astype(np.float64)
    ref = np.zeros((T, C))
    for t in range(T):
        for ch in range(C):
            ref[t, ch] = sum(X[t + tap, ch] * w[ch, tap] for tap in range(K))
    ref = ref / (1 + np.exp(-ref))
    state = hist.copy()
    (whole,) = be.conv1d_silu(x, state, w)
    np.testing.assert_allclose(whole, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(state, x[-(K - 1):])
    # two calls == one call
    state2 = hist.copy()
    out2 = np.concatenate([be.conv1d_silu(x[:4], state2, w)[0], be.conv1d_silu(x[4:], state2, w)[0]])
    np.testing.assert_allclose(out2, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(state2, state)
    # cut into column pieces: the same values
    pieces = be.conv1d_silu(x, hist.copy(), w, cuts=(3, 7))
    assert [p.shape for p in pieces] == [(T, 3), (T, 4), (T, 4)]
    np.testing.assert_array_equal(np.concatenate(pieces, axis=1), whole)


def test_gdn_gates_softplus_threshold():
    alpha = np.array([[-30.0, -1.0, 0.0, 3.0, 19.0, 25.0]], np.float32)
    dt = np.array([0.5, -0.5, 0.1, 0.0, 2.0, 0.0], np.float32)
    a = -np.array([0.1, 1.0, 2.0, 0.5, 0.3, 0.02], np.float32)
    beta_in = np.array([[-3.0, -1.0, 0.0, 1.0, 3.0, 40.0]], np.float32)
    g, beta = be.gdn_gates(alpha, beta_in, a, dt)
    x = alpha.astype(np.float64) + dt
    sp = np.where(x > 20, x, np.log1p(np.exp(x)))
    np.testing.assert_allclose(g, a * sp, rtol=1e-6)
    np.testing.assert_allclose(beta, 1 / (1 + np.exp(-beta_in.astype(np.float64))), rtol=1e-6)
    assert (g <= 0).all()


# ---- norms and elementwise --------------------------------------------------------------------------


def test_norms():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 4, 10)).astype(np.float32) * 3
    z = rng.standard_normal((3, 4, 10)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 10).astype(np.float32)
    eps = 1e-6
    x64 = x.astype(np.float64)
    rms = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps)
    np.testing.assert_allclose(be.rms_norm(x, w, eps), rms * w, rtol=1e-6)
    np.testing.assert_allclose(be.rms_norm(x, None, eps), rms, rtol=1e-6)
    np.testing.assert_allclose(be.l2_norm(x, eps), x64 / np.sqrt((x64**2).sum(-1, keepdims=True) + eps), rtol=1e-6)
    silu_z = z / (1 + np.exp(-z.astype(np.float64)))
    np.testing.assert_allclose(be.gated_rms_norm(x, z, w, eps), rms * w * silu_z, rtol=1e-5, atol=1e-7)
    s, n = be.add_rms_norm(x, z, w, eps)
    np.testing.assert_allclose(s, x + z, rtol=1e-6)
    np.testing.assert_allclose(n, be.rms_norm(x + z, w, eps), rtol=1e-6)
    np.testing.assert_allclose(be.swiglu(z, x), silu_z * x, rtol=1e-5, atol=1e-7)
    z64 = z.astype(np.float64)
    gelu_tanh = 0.5 * z64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (z64 + 0.044715 * z64**3)))
    np.testing.assert_allclose(be.geglu(z, x), gelu_tanh * x, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(be.silu(z), silu_z, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(be.scale(x, 0.25), x * 0.25, rtol=1e-7)
    np.testing.assert_allclose(be.mul(z, x[..., :1]), z * x[..., :1], rtol=1e-7)  # broadcasting
    assert np.isfinite(be.sigmoid(np.array([-1000.0, 1000.0], np.float32))).all()


# ---- RoPE -------------------------------------------------------------------------------------------


def _rope_reference(x, pos3, n_rot, base, sections):
    """Doc 3.3.1 written pair by pair: pos3 (3, T) components (t, h, w)."""
    y = x.astype(np.float64).copy()
    half = n_rot // 2
    s_t, s_h, s_w = (list(sections) + [0, 0, 0])[:3]
    for t in range(x.shape[0]):
        for i in range(half):
            if i % 3 == 1 and i < 3 * s_h:
                p = pos3[1, t]
            elif i % 3 == 2 and i < 3 * s_w:
                p = pos3[2, t]
            else:
                p = pos3[0, t]
            theta = p * base ** (-2 * i / n_rot)
            a, b = x[t, :, i].astype(np.float64), x[t, :, i + half].astype(np.float64)
            y[t, :, i] = a * math.cos(theta) - b * math.sin(theta)
            y[t, :, i + half] = a * math.sin(theta) + b * math.cos(theta)
    return y


def test_rope_text_and_mrope():
    rng = np.random.default_rng(7)
    T, nh, d, n_rot = 6, 3, 24, 16
    x = rng.standard_normal((T, nh, d)).astype(np.float32)
    pos = np.array([0, 1, 2, 7, 100, 5000])
    text = be.rope(x, pos, n_rot, 1e7, sections=(3, 3, 2))
    np.testing.assert_allclose(text, _rope_reference(x, np.stack([pos] * 3), n_rot, 1e7, (3, 3, 2)), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(text[..., n_rot:], x[..., n_rot:])  # pass-through dims
    np.testing.assert_array_equal(be.rope(x, np.stack([pos] * 3), n_rot, 1e7, sections=(3, 3, 2)), text)
    pos3 = np.stack([pos, pos // 2 + 3, pos % 5])
    got = be.rope(x, pos3, n_rot, 1e7, sections=(3, 3, 2))
    np.testing.assert_allclose(got, _rope_reference(x, pos3, n_rot, 1e7, (3, 3, 2)), rtol=1e-5, atol=1e-6)
    # linear scaling divides the position
    np.testing.assert_allclose(be.rope(x, pos * 4, n_rot, 1e4, scale=4.0), be.rope(x, pos, n_rot, 1e4), rtol=1e-5, atol=1e-6)


# ---- attention ----------------------------------------------------------------------------------------


def _attention_reference(q, k_all, v_all, scale, window=0):
    T, nh, _ = q.shape
    L, n_kv, _ = k_all.shape
    out = np.zeros((T, nh, v_all.shape[2]))
    for t in range(T):
        p = L - T + t
        for h in range(nh):
            kv = h // (nh // n_kv)
            idx = [j for j in range(L) if j <= p and (window == 0 or j > p - window)]
            s = np.array([q[t, h] @ k_all[j, kv] for j in idx], np.float64) * scale
            a = np.exp(s - s.max())
            a /= a.sum()
            out[t, h] = sum(a[n] * v_all[j, kv] for n, j in enumerate(idx))
    return out


@pytest.mark.parametrize("window", [0, 3])
def test_attention_gqa_causal_window_and_cache(window):
    rng = np.random.default_rng(8)
    nh, n_kv, d, dv, T = 6, 2, 8, 5, 9
    q = rng.standard_normal((T, nh, d)).astype(np.float32)
    k = rng.standard_normal((T, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((T, n_kv, dv)).astype(np.float32)
    ref = _attention_reference(q, k, v, 0.3, window)
    cache = be.new_kv_cache(n_kv, d, dv, capacity=2)  # forces growth
    np.testing.assert_allclose(be.attention(q, k, v, cache, scale=0.3, window=window), ref, rtol=1e-5, atol=1e-6)
    assert cache.length == T and cache.capacity >= T
    # prefill 4, then one by one
    cache2 = be.new_kv_cache(n_kv, d, dv, capacity=16)
    outs = [be.attention(q[:4], k[:4], v[:4], cache2, scale=0.3, window=window)]
    outs += [be.attention(q[t:t + 1], k[t:t + 1], v[t:t + 1], cache2, scale=0.3, window=window) for t in range(4, T)]
    np.testing.assert_allclose(np.concatenate(outs), ref, rtol=1e-5, atol=1e-6)
    # truncate + re-append the same tokens gives the same rows; a clone is independent
    twin = cache2.clone()
    cache2.truncate(5)
    again = be.attention(q[5:], k[5:], v[5:], cache2, scale=0.3, window=window)
    np.testing.assert_allclose(again, ref[5:], rtol=1e-5, atol=1e-6)
    cache2.truncate(2)
    assert twin.length == T and np.array_equal(twin.k[:T], cache.k[:T])
    with pytest.raises(ValueError):
        cache2.truncate(3)


# ---- weights, embedding, matmul, moe helpers ------------------------------------------------------------


@pytest.mark.parametrize("gguf_name", ["qwen35-tiny-dense-q8_0.gguf", "qwen35-tiny-dense-f16.gguf"])
def test_weights_embedding_rows_and_matmul(fixtures_dir, gguf_name):
    gf = GGUFFile(fixtures_dir / "dense" / gguf_name)
    info = gf.tensor("token_embd.weight")
    table = be.load_weight(info, role="embedding")
    ids = [0, 5, 248319, 5, 123456]
    full = gf.dequantize("token_embd.weight")
    np.testing.assert_array_equal(be.embed(table, ids), full[ids])
    with pytest.raises(ValueError):
        be.embed(table, [248320])
    # the same table used as the tied LM head
    h = np.random.default_rng(9).standard_normal((2, 32)).astype(np.float32)
    np.testing.assert_allclose(be.matmul(h, table), h @ full.T, rtol=1e-5, atol=1e-5)
    w = be.load_weight(gf.tensor("blk.0.attn_qkv.weight"), role="matmul")
    assert w.shape == (128, 32) and w.type_name == info.type_name
    np.testing.assert_allclose(be.matmul(h, w), h.astype(np.float64) @ gf.dequantize("blk.0.attn_qkv.weight").T.astype(np.float64), rtol=1e-5, atol=1e-5)
    vec = be.load_weight(gf.tensor("blk.0.ssm_a"), role="vector")
    assert vec.dtype == np.float32 and vec.shape == (4,) and (vec < 0).all()
    one_d = be.load_weight(gf.tensor("blk.0.attn_norm.weight"), role="matmul")  # 1-D as (1, n)
    assert one_d.shape == (1, 32)
    np.testing.assert_allclose(be.matmul(h, one_d)[:, 0], h @ gf.dequantize("blk.0.attn_norm.weight"), rtol=1e-5)


def test_top_k():
    rng = np.random.default_rng(10)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    top = be.top_k(logits, 5)
    order = np.argsort(-logits, axis=1)[:, :5]
    np.testing.assert_array_equal(top.ids, order)
    np.testing.assert_array_equal(top.values, np.take_along_axis(logits, order, 1))
    # ties: equal values in ascending id order, and the lowest ids of the values tied at the k-th place
    tied = np.round(rng.standard_normal((4, 300))).astype(np.float32)
    top = be.top_k(tied, 40)
    order = np.lexsort((np.broadcast_to(np.arange(300), tied.shape), -tied), axis=1)[:, :40]
    np.testing.assert_array_equal(top.ids, order)
    np.testing.assert_array_equal(top.values, np.take_along_axis(tied, order, 1))


def test_real_head_sizes_prefill_modes_agree(tmp_path):
    """A synthetic model with the released head sizes (attention 256 / 64 rotated dims with sections
    [11, 11, 10], GDN 128, n_v = 2 n_k): whole, 64-chunk and token-by-token prefill agree."""
    from dataclasses import replace

    from minecart.engine.model import load_model
    from minecart.engine.synth import SHAPES, write_synthetic

    path = tmp_path / "small.gguf"
    write_synthetic(path, replace(SHAPES["small-dense"], vocab_size=1000), "q8_0", seed=5, mtp=False)
    model = load_model(path, backend=be)
    cfg = model.config
    assert (cfg.head_dim, cfg.rope_dims, cfg.gdn_key_dim, cfg.gdn_v_heads) == (256, 64, 128, 4)
    ids = [int(t) for t in np.random.default_rng(6).integers(0, 1000, 80)]
    full = model.logits(ids)
    assert np.isfinite(full).all() and full.std() > 0.1
    for chunk in (64, 1):
        s = model.new_session()
        s.prefill(ids[:-1], chunk=chunk)
        last = s.step(ids[-1])
        err = np.linalg.norm(last - full[-1]) / np.linalg.norm(full[-1])
        assert err < 1e-4, (chunk, err)
    model.close()
