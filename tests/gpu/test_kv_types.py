"""The f16 and q8_0 KV caches on the GPU (kernels/kv_f16.cu, kernels/kv_q8_0.cu, attention.cu reading
them) against their NumPy twins: engine/kvquant.py quantize_q8_0 (itself bit-identical to gguf-py's Q8_0)
and NumpyF16KVCache / NumpyQ8KVCache.

- append: bytes identical to the twin (f16: IEEE round to nearest even; q8_0: the ggml Q8_0 blocks
  gguf-py writes), at a host row and at a row held on the device, rows outside untouched;
- attention (prefill tile kernel and split decode, device-side length, sliding window, GQA) over the
  stored values vs fp64 attention over the twin's dequantized rows;
- the model end to end: fixture logits and 32 greedy tokens GPU vs NumPy with the same cache type,
  graph decode == eager across growth and truncate, fork, bytes per token as the plan prices them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from minecart.engine import kvquant as kq

from tests._reference import attention_reference
from tests.gpu._compare import graph_vs_eager, greedy

cp = pytest.importorskip("cupy")
kvcache = pytest.importorskip("minecart.kernels.kvcache")
ops = pytest.importorskip("minecart.kernels.ops")

pytestmark = pytest.mark.gpu

DIMS = (64, 128, 256)
TYPES = ("f16", "q8_0")
FIXTURE = "dense/qwen35-tiny-dense-f16.gguf"


def _rows(rng, T, n_kv, d, sigma=1.0):
    x = (sigma * rng.standard_normal((T, n_kv, d))).astype(np.float32)
    x[min(2, T - 1), 0, :32] = 0.0  # an all-zero block
    x[min(1, T - 1), -1, 5] = 300.0 * sigma  # an outlier
    if d >= 64 and T > 3:
        # a block whose x / d lands exactly on k + 0.5 (d = 1/8): ties round away from zero in ggml
        x[3, 0, 32:64] = np.concatenate([[127.0], np.arange(-15, 16) + 0.5]) / 8
    return x


def _twin_bytes(x: np.ndarray, kv: str) -> np.ndarray:
    """The bytes the NumPy twin stores for rows x (T, n_kv, d), in the GPU layout."""
    T, n_kv, d = x.shape
    if kv == "f16":
        return x.astype(np.float16).view(np.uint8).reshape(T, n_kv, 2 * d)
    q, s = kq.quantize_q8_0(x)
    blocks = np.concatenate([s.reshape(T, n_kv, d // 32, 1).view(np.uint8),
                             q.reshape(T, n_kv, d // 32, 32).view(np.uint8)], axis=-1)
    return blocks.reshape(T, n_kv, d // 32 * 34)


def _twin_values(x: np.ndarray, kv: str) -> np.ndarray:
    if kv == "f16":
        return x.astype(np.float16).astype(np.float32)
    return kq.dequantize_q8_0(*kq.quantize_q8_0(x))


def test_q8_0_twin_is_ggml_q8_0():
    import gguf

    x = _rows(np.random.default_rng(1), 6, 2, 128)
    ref = np.asarray(gguf.quants.quantize(x.reshape(6, -1), gguf.GGMLQuantizationType.Q8_0))
    np.testing.assert_array_equal(_twin_bytes(x, "q8_0").reshape(6, -1), ref)


@pytest.mark.parametrize("kv", TYPES)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("sigma", [1e-3, 1.0, 40.0])
def test_append_matches_the_twin(kv, d, sigma, poison):
    rng = np.random.default_rng(d + int(sigma * 10))
    T, n_kv, start, cap = 19, 2, 5, 30
    k, v = _rows(rng, T, n_kv, d, sigma), _rows(rng, T, n_kv, d, sigma * 0.5)
    kc, vc = kvcache.alloc(cap, n_kv, d, kv), kvcache.alloc(cap, n_kv, d, kv)
    kc.view(cp.uint8)[:] = 0xA5  # poison: rows outside start..start+T-1 must stay untouched
    vc.view(cp.uint8)[:] = 0xA5
    kvcache.append(cp.asarray(k), cp.asarray(v), kc, vc, kv, start)
    got_k = cp.asnumpy(kc.view(cp.uint8)).reshape(cap, n_kv, -1)
    got_v = cp.asnumpy(vc.view(cp.uint8)).reshape(cap, n_kv, -1)
    np.testing.assert_array_equal(got_k[start:start + T], _twin_bytes(k, kv))
    np.testing.assert_array_equal(got_v[start:start + T], _twin_bytes(v, kv))
    assert np.all(got_k[:start] == 0xA5) and np.all(got_k[start + T:] == 0xA5)
    assert np.all(got_v[:start] == 0xA5) and np.all(got_v[start + T:] == 0xA5)


@pytest.mark.parametrize("kv", TYPES)
def test_append_at_a_row_on_the_device(kv, poison):
    rng = np.random.default_rng(7)
    n_kv, d, cap = 4, 128, 12
    kc, vc = kvcache.alloc(cap, n_kv, d, kv), kvcache.alloc(cap, n_kv, d, kv)
    kc.view(cp.uint8)[:] = 0
    vc.view(cp.uint8)[:] = 0
    row = cp.asarray(np.array([9], np.int32))
    k, v = _rows(rng, 1, n_kv, d), _rows(rng, 1, n_kv, d)
    kvcache.append(cp.asarray(k), cp.asarray(v), kc, vc, kv, 0, start_ptr=row)  # host start ignored
    got = cp.asnumpy(kc.view(cp.uint8)).reshape(cap, n_kv, -1)
    np.testing.assert_array_equal(got[9], _twin_bytes(k, kv)[0])
    assert not got[:9].any() and not got[10:].any()
    np.testing.assert_array_equal(cp.asnumpy(vc.view(cp.uint8)).reshape(cap, n_kv, -1)[9], _twin_bytes(v, kv)[0])


@pytest.mark.parametrize("kv", TYPES)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("T,start,window", [(1, 200, 0), (1, 700, 64), (37, 0, 0), (29, 51, 0), (64, 40, 23)])
def test_attention_reads_the_stored_values(kv, d, T, start, window, poison):
    """ops.attention over an f16 / q8_0 cache == fp64 attention over the twin's dequantized rows (decode
    for T = 1: the split flash_decode; prefill otherwise: flash_prefill_g)."""
    rng = np.random.default_rng(d * 7 + T + start)
    n_kv, nh = 2, 8
    kv_len = start + T
    k, v = _rows(rng, kv_len, n_kv, d), _rows(rng, kv_len, n_kv, d)
    q = rng.standard_normal((T, nh, d)).astype(np.float32)
    kc, vc = kvcache.alloc(kv_len + 5, n_kv, d, kv), kvcache.alloc(kv_len + 5, n_kv, d, kv)
    kvcache.append(cp.asarray(k), cp.asarray(v), kc, vc, kv, 0)
    scale = 1.0 / np.sqrt(d)
    got = cp.asnumpy(ops.attention(cp.asarray(q), kc, vc, start, kv_len, scale, window, kv_type=kv))
    ref = attention_reference(q, _twin_values(k, kv), _twin_values(v, kv), start, kv_len, scale, window)
    exact = attention_reference(q, k, v, start, kv_len, scale, window)
    nerr, maxrel = _errors(got, ref)
    print(f"\n{kv} d={d} T={T} start={start} window={window}: vs twin norm rel err {nerr:.2e} (max rel "
          f"{maxrel:.2e}); twin vs the fp32 rows {_errors(ref, exact)[0]:.2e}")
    assert np.all(np.isfinite(got))
    assert nerr < 2e-5 and maxrel < 1e-4  # tests/gpu/test_attention_prefill.py's bounds for the f32 cache
    assert np.abs(ref - exact).max() > 0  # the cache type really rounds


@pytest.mark.parametrize("kv", TYPES)
def test_decode_with_the_length_on_the_device(kv, poison):
    rng = np.random.default_rng(3)
    n_kv, nh, d, kv_len, cap = 2, 8, 128, 300, 512
    k, v = _rows(rng, kv_len, n_kv, d), _rows(rng, kv_len, n_kv, d)
    q = rng.standard_normal((1, nh, d)).astype(np.float32)
    kc, vc = kvcache.alloc(cap, n_kv, d, kv), kvcache.alloc(cap, n_kv, d, kv)
    kvcache.append(cp.asarray(k), cp.asarray(v), kc, vc, kv, 0)
    length = cp.asarray(np.array([kv_len - 1], np.int32))  # the length before this token's append
    got = cp.asnumpy(ops.attention(cp.asarray(q), kc, vc, kv_len - 1, kv_len, 0.088, 0, kv_len_ptr=length,
                                   kv_type=kv))
    ref = attention_reference(q, _twin_values(k, kv), _twin_values(v, kv), kv_len - 1, kv_len, 0.088, 0)
    nerr, maxrel = _errors(got, ref)
    assert nerr < 2e-5 and maxrel < 1e-4


@pytest.mark.parametrize("kv", TYPES)
@pytest.mark.parametrize("window", [0, 19])
def test_backend_attention_through_appends_and_growth(kv, window, poison):
    """CupyBackend.attention over an f16 / q8_0 cache vs NumpyBackend.attention over its twin cache:
    a prefill of 37, a second chunk of 33, decode steps and a 5-token chunk, from capacity 16 (grows)."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.backends.numpy_backend import NumpyBackend

    nb, gb = NumpyBackend(), CupyBackend("cuda:0", path="fma")
    rng = np.random.default_rng(11 + window)
    nh, n_kv, d = 8, 2, 128
    c_np = nb.new_kv_cache(n_kv, d, d, 16, kv_type=kv)
    c_gp = gb.new_kv_cache(n_kv, d, d, 16, kv_type=kv)
    for T in (37, 33, 1, 1, 5, 1):
        poison()
        q = rng.standard_normal((T, nh, d)).astype(np.float32)
        k = rng.standard_normal((T, n_kv, d)).astype(np.float32)
        v = rng.standard_normal((T, n_kv, d)).astype(np.float32)
        ref = nb.attention(q, k, v, c_np, scale=d ** -0.5, window=window)
        y = gb.to_numpy(gb.attention(gb.asarray(q), gb.asarray(k), gb.asarray(v), c_gp, scale=d ** -0.5,
                                     window=window))
        assert c_gp.length == c_np.length
        nerr, maxrel = _errors(y, ref)
        assert nerr < 2e-5 and maxrel < 1e-4, (T, c_np.length, nerr, maxrel)
    np.testing.assert_array_equal(cp.asnumpy(c_gp.k.view(cp.uint8)).reshape(c_gp.capacity, n_kv, -1)[:c_gp.length],
                                  _twin_bytes_of_cache(c_np))


def _twin_bytes_of_cache(c) -> np.ndarray:
    """The stored K rows of a NumPy f16 / q8_0 cache in the GPU layout."""
    L = c.length
    if c.kv_type == "f16":
        return c.k[:L].view(np.uint8).reshape(L, c.n_kv_heads, -1)
    d = c.head_dim
    blocks = np.concatenate([c.k_scales[:L].reshape(L, c.n_kv_heads, d // 32, 1).view(np.uint8),
                             c.k_q[:L].reshape(L, c.n_kv_heads, d // 32, 32).view(np.uint8)], axis=-1)
    return blocks.reshape(L, c.n_kv_heads, -1)


def _errors(got, ref) -> tuple[float, float]:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return (float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
            float(np.abs(got - ref).max() / np.abs(ref).max()))


# ---- the model end to end --------------------------------------------------------------------------


def _seqs(fixtures_dir) -> dict:
    return {s["name"]: s["ids"] for s in json.loads((fixtures_dir / "sequences.json").read_text())["sequences"]}


def _models(fixtures_dir, kv, *, graphs=True):
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.backends.numpy_backend import NumpyBackend
    from minecart.engine.model import load_model

    be = CupyBackend("cuda:0", path="fma")
    be.use_graphs = graphs
    path = fixtures_dir / FIXTURE
    return load_model(path, backend=NumpyBackend(), kv_type=kv), load_model(path, backend=be, kv_type=kv), be


@pytest.mark.parametrize("kv", TYPES)
def test_caches_are_the_typed_class_and_priced_exactly(fixtures_dir, kv):
    from minecart.engine.backends.cupy_backend import CupyTypedKVCache

    _, m_gp, _ = _models(fixtures_dir, kv)
    states = m_gp.new_state(64)
    caches = [st.kv for st in states if st.kv is not None]
    assert caches and all(isinstance(c, CupyTypedKVCache) and c.kv_type == kv for c in caches)
    per_token = kq.kv_bytes_per_token(m_gp.config, kv)
    assert all(c.nbytes == 64 * per_token for c in caches), (caches[0].nbytes, per_token)
    m_gp._free_states(states)


@pytest.mark.parametrize("kv", TYPES)
def test_fixture_logits_match_numpy_with_the_same_cache(fixtures_dir, kv):
    from minecart.engine.kvquant import compare_logits, sequence_logits

    m_np, m_gp, _ = _models(fixtures_dir, kv)
    for name, ids in _seqs(fixtures_dir).items():
        ref = sequence_logits(m_np, ids, kv)
        got = sequence_logits(m_gp, ids, kv)
        r = compare_logits(ref, got)
        print(f"\n{name:10s} GPU {kv} vs NumPy {kv}: rel err max {r['rel_err_max']:.2e} mean "
              f"{r['rel_err_mean']:.2e}, top-1 {r['top1_agree']:.3f}")
        assert np.all(np.isfinite(got))
        assert r["rel_err_mean"] < 2e-3 and r["rel_err_max"] < 2e-2, name
        assert r["top1_agree"] >= 0.98, name


@pytest.mark.parametrize("kv", TYPES)
def test_greedy_32_matches_numpy(fixtures_dir, kv):
    m_np, m_gp, be = _models(fixtures_dir, kv)
    same = {}
    for name, ids in _seqs(fixtures_dir).items():
        a, b = greedy(m_np, ids, 32), greedy(m_gp, ids, 32)
        same[name] = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), 32)
    print(f"\ngreedy 32 identical prefix per sequence (GPU {kv} vs NumPy {kv}): {same}; graph used: {bool(be._graphs)}")
    assert all(n == 32 for n in same.values()), same


@pytest.mark.parametrize("kv", TYPES)
def test_decode_logits_match_numpy(fixtures_dir, kv):
    """Decode-step logits after a multi-token prefill, GPU vs NumPy with the same cache type (the greedy
    tokens of this fixture repeat, so the logits themselves are compared)."""
    from minecart.engine.kvquant import compare_logits

    m_np, m_gp, be = _models(fixtures_dir, kv)
    prompt = [int(t) for t in _seqs(fixtures_dir)["len70"]]
    sn, sg = m_np.new_session(len(prompt) + 16), m_gp.new_session(len(prompt) + 16)
    ln, lg = sn.prefill(prompt), sg.prefill(prompt)
    rows_n, rows_g = [np.array(ln)], [np.array(lg)]
    for _ in range(12):
        tok = int(np.argmax(ln))
        ln, lg = sn.step(tok), sg.step(tok)
        rows_n.append(np.array(ln))
        rows_g.append(np.array(lg))
    sn.close()
    sg.close()
    r = compare_logits(np.stack(rows_n), np.stack(rows_g))
    print(f"\n{kv} prefill + 12 decode steps GPU vs NumPy: rel err max {r['rel_err_max']:.2e} mean "
          f"{r['rel_err_mean']:.2e}; graph used: {bool(be._graphs)}")
    assert r["rel_err_mean"] < 2e-3 and r["rel_err_max"] < 2e-2


@pytest.mark.parametrize("kv", TYPES)
def test_graph_decode_matches_eager(fixtures_dir, kv):
    _, mg, graph_be = _models(fixtures_dir, kv, graphs=True)
    _, me, _ = _models(fixtures_dir, kv, graphs=False)
    prompt = _seqs(fixtures_dir)["len70"]
    sg, se = mg.new_session(len(prompt) + 4), me.new_session(len(prompt) + 4)  # caches must grow
    worst = graph_vs_eager(sg, se, prompt, 40, truncate_at=20)
    print(f"\n{kv} graph vs eager decode: max rel err {worst:.2e}")
    assert graph_be._graphs, "decode never used a CUDA graph"


@pytest.mark.parametrize("kv", TYPES)
def test_fork_and_growth(fixtures_dir, kv):
    m_np, m_gp, _ = _models(fixtures_dir, kv)
    ids = _seqs(fixtures_dir)["len300"]
    a = greedy(m_np, ids, 8, capacity=8)
    b = greedy(m_gp, ids, 8, capacity=8)
    assert a == b
    s = m_gp.new_session(len(ids) + 16)
    s.prefill([int(t) for t in ids[:100]])
    twin = s.fork()
    la, lb = s.step(int(ids[100])), twin.step(int(ids[100]))
    np.testing.assert_allclose(la, lb, rtol=0, atol=1e-6 * float(np.abs(la).max()))
    s.close()
    twin.close()


def test_unequal_head_dims_refused_in_words():
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.errors import RequestError

    be = CupyBackend("cuda:0", path="fma")
    for kv in TYPES:
        with pytest.raises(RequestError, match="equal K and V head dims"):
            be.new_kv_cache(2, 64, 128, 8, kv_type=kv)
