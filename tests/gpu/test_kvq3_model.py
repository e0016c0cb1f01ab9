"""The q3 KV cache end to end on the GPU (CupyQ3KVCache: K 3-bit / V 2-bit codes read directly by the
kvq3 attention kernels) against the NumPy q3 cache (engine/kvquant.py), and its greedy agreement with f32.

Both quantize the same K/V rows with the same format, so they should agree about as closely as the f32
caches do (the GPU quantizes in fp32: a value within ~1e-6 of a decision threshold may take the
neighbouring code, a rare and tiny difference). Prints, per fixture sequence: max relative logit error
GPU q3 vs NumPy q3, top-1 agreement, and for scale GPU q3 vs GPU f32.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.gpu._compare import graph_vs_eager, greedy

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

FIXTURE = "dense/qwen35-tiny-dense-f16.gguf"


def _seqs(fixtures_dir) -> dict:
    return {s["name"]: s["ids"] for s in json.loads((fixtures_dir / "sequences.json").read_text())["sequences"]}


def _models(fixtures_dir, gpu_path="fma", *, graphs=True):
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.backends.numpy_backend import NumpyBackend
    from minecart.engine.model import load_model

    be = CupyBackend("cuda:0", path=gpu_path)
    be.use_graphs = graphs
    path = fixtures_dir / FIXTURE
    return load_model(path, backend=NumpyBackend(), kv_type="q3"), load_model(path, backend=be, kv_type="q3"), be


def test_q3_caches_are_the_gpu_class(fixtures_dir):
    from minecart.engine.backends.cupy_backend import CupyQ3KVCache
    from minecart.engine.kvquant import kv_bytes_per_token

    _, m_gp, _ = _models(fixtures_dir)
    states = m_gp.new_state(64)
    caches = [st.kv for st in states if st.kv is not None]
    assert caches and all(isinstance(c, CupyQ3KVCache) for c in caches)
    per_token = kv_bytes_per_token(m_gp.config, "q3")
    assert all(c.nbytes == 64 * per_token for c in caches), (caches[0].nbytes, per_token)
    m_gp._free_states(states)


def test_q3_fixture_logits_match_numpy_q3(fixtures_dir):
    from minecart.engine.kvquant import compare_logits, sequence_logits

    m_np, m_gp, _ = _models(fixtures_dir)
    worst = 0.0
    for name, ids in _seqs(fixtures_dir).items():
        ref = sequence_logits(m_np, ids, "q3")
        got = sequence_logits(m_gp, ids, "q3")
        f32 = sequence_logits(m_gp, ids, "f32")
        r, q = compare_logits(ref, got), compare_logits(f32, got)
        print(f"\n{name:10s} GPU q3 vs NumPy q3: rel err max {r['rel_err_max']:.2e} mean {r['rel_err_mean']:.2e}, "
              f"top-1 {r['top1_agree']:.3f}, KL max {r['kl_max']:.2e} | GPU q3 vs GPU f32: rel err mean "
              f"{q['rel_err_mean']:.3f}, top-1 {q['top1_agree']:.3f}")
        worst = max(worst, r["rel_err_max"])
        pos_rel = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
        if np.any(pos_rel > 2e-2):  # which positions: all past the first points at the prefill (T > 1) path
            print(f"  positions over 2e-2: {np.flatnonzero(pos_rel > 2e-2).tolist()[:20]} of {len(ids)}")
        assert np.all(np.isfinite(got))
        assert r["rel_err_mean"] < 2e-3 and r["rel_err_max"] < 2e-2, name
        assert r["top1_agree"] >= 0.98, name
        assert q["rel_err_mean"] > 1e-4, "q3 should not equal the f32 cache"
    print(f"worst max rel err GPU q3 vs NumPy q3: {worst:.2e}")


def test_q3_greedy_32_matches_numpy_q3(fixtures_dir):
    m_np, m_gp, be = _models(fixtures_dir)
    same = {}
    for name, ids in _seqs(fixtures_dir).items():
        a, b = greedy(m_np, ids, 32), greedy(m_gp, ids, 32)
        same[name] = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), 32)
        if len(ids) > 48:  # chunked prefill: later chunks attend from a nonzero start over the codes
            # (both chunked alike: the keys' reference row is the first chunk's mean)
            assert greedy(m_gp, ids, 8, chunk=48) == greedy(m_np, ids, 8, chunk=48), name
    print(f"\ngreedy 32 identical prefix per sequence (GPU q3 vs NumPy q3): {same}; graph used: {bool(be._graphs)}")
    assert all(v == 32 for v in same.values()), same


def test_q3_greedy_32_matches_f32_on_gpu(fixtures_dir):
    """The issue's bar: greedy agreement with the exact cache on the fixtures (NumPy backend, measured
    in docs/kv-cache.md: 32 of 32 tokens on every sequence); here GPU q3 vs GPU f32."""
    from minecart.engine.kvquant import greedy_tokens

    _, m_gp, _ = _models(fixtures_dir)
    same = {}
    for name, ids in _seqs(fixtures_dir).items():
        a, b = greedy_tokens(m_gp, ids, 32, "f32"), greedy_tokens(m_gp, ids, 32, "q3")
        same[name] = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), 32)
    print(f"\ngreedy 32 identical prefix per sequence (GPU q3 vs GPU f32): {same}")
    assert all(v == 32 for v in same.values()), same


def test_q3_graph_decode_matches_eager(fixtures_dir):
    """Replayed CUDA-graph decode over a q3 cache == the eager step, across cache growth (the cache
    moves: the graph is re-captured) and a truncate."""
    _, mg, graph_be = _models(fixtures_dir, graphs=True)
    _, me, _ = _models(fixtures_dir, graphs=False)
    prompt = _seqs(fixtures_dir)["len70"]
    sg, se = mg.new_session(len(prompt) + 4), me.new_session(len(prompt) + 4)  # caches must grow
    worst = graph_vs_eager(sg, se, prompt, 40, truncate_at=20)
    print(f"\nq3 graph vs eager decode: max rel err {worst:.2e}")
    assert graph_be._graphs, "decode never used a CUDA graph"


def test_q3_fork_and_long_growth(fixtures_dir):
    """Session.fork clones a q3 cache on the device; a small initial capacity grows several times."""
    m_np, m_gp, _ = _models(fixtures_dir)
    ids = _seqs(fixtures_dir)["len300"]
    a = greedy(m_np, ids, 8, capacity=8)
    b = greedy(m_gp, ids, 8, capacity=8)
    print(f"\nlen300 from capacity 8: NumPy {a} GPU {b}")
    assert a == b
    s = m_gp.new_session(len(ids) + 16)
    s.prefill([int(t) for t in ids[:100]])
    twin = s.fork()
    la, lb = s.step(int(ids[100])), twin.step(int(ids[100]))
    np.testing.assert_allclose(la, lb, rtol=0, atol=1e-6 * float(np.abs(la).max()))
    s.close()
    twin.close()


def test_q3_decode_logits_match_numpy_q3(fixtures_dir):
    """Decode-step logits (not only the argmax: this fixture's greedy tokens repeat and hide attention
    errors) of GPU q3 vs NumPy q3 after a multi-token prefill, eager and through the decode graph."""
    from minecart.engine.kvquant import compare_logits

    m_np, m_gp, be = _models(fixtures_dir)
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
    print(f"\nq3 prefill + 12 decode steps GPU vs NumPy q3: rel err max {r['rel_err_max']:.2e} mean "
          f"{r['rel_err_mean']:.2e}, top-1 {r['top1_agree']:.3f}; graph used: {bool(be._graphs)}")
    assert r["rel_err_mean"] < 2e-3 and r["rel_err_max"] < 2e-2


def test_q3_unknown_type_refused_on_gpu():
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.errors import RequestError

    be = CupyBackend("cuda:0", path="fma")
    with pytest.raises(RequestError, match="not known"):
        be.new_kv_cache(2, 64, 64, 8, kv_type="q4")
    with pytest.raises(RequestError, match="q3"):
        be.new_kv_cache(2, 64, 128, 8, kv_type="q3")
