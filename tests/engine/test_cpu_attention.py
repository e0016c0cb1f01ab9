"""engine/cpu_attention.py: the compiled attention of a decode token (or a short chunk) against its NumPy
twin and against a float64 loop written from the formula, on fresh random inputs (GQA groups, several
query rows, sliding windows, float32 and float16 caches, a single key); bad shapes; the backend's routing
(kernel, twin for long chunks and quantized caches, twin when switched off)."""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import cpu_attention
from minecart.engine.backends.numpy_backend import NumpyBackend

needs_numba = pytest.mark.skipif(not cpu_attention.available(), reason="numba is not installed")


def _formula(q, keys, values, scale, window):
    """Softmax attention element by element in float64: query t sits at position L - T + t."""
    T, nh, _ = q.shape
    L, n_kv, _ = keys.shape
    group = nh // n_kv
    out = np.zeros((T, nh, values.shape[2]))
    for t in range(T):
        p = L - T + t
        seen = [l for l in range(L) if l <= p and (window <= 0 or l > p - window)]
        for h in range(nh):
            kh = h // group
            s = np.array([scale * (q[t, h].astype(np.float64) @ keys[l, kh].astype(np.float64)) for l in seen])
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ values[seen, kh].astype(np.float64)
    return out


def _inputs(rng, T, nh, n_kv, d, dv, L, dtype):
    q = rng.standard_normal((T, nh, d)).astype(np.float32)
    keys = (rng.standard_normal((L, n_kv, d)) * 2).astype(dtype)
    values = rng.standard_normal((L, n_kv, dv)).astype(dtype)
    return q, keys, values


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("T,nh,n_kv,d,dv,L,window", [
    (1, 4, 1, 256, 256, 97, 0),  # the demo Gemma's heads
    (1, 16, 4, 64, 48, 40, 0),  # groups of 4, dv != d
    (1, 8, 8, 32, 32, 1, 0),  # one key: no grouping
    (1, 6, 2, 16, 16, 60, 9),  # a sliding window shorter than the cache
    (5, 8, 2, 16, 24, 30, 7),  # a short chunk: each row its own causal end and window
    (16, 4, 2, 8, 8, 16, 0),  # the whole cache is the chunk (the first query sees one key)
])
def test_kernel_matches_its_twin_and_the_formula(dtype, T, nh, n_kv, d, dv, L, window):
    for seed in range(2):
        rng = np.random.default_rng(seed)
        q, keys, values = _inputs(rng, T, nh, n_kv, d, dv, L, dtype)
        scale = 1.0 / np.sqrt(d)
        got = cpu_attention.attend(q, keys, values, scale=scale, window=window)
        twin = cpu_attention.attend_twin(q, keys, values, scale=scale, window=window)
        ref = _formula(q, keys, values, scale, window)
        assert got.dtype == np.float32 and got.shape == (T, nh, dv)
        bound = 2e-6 * float(np.abs(ref).max())
        np.testing.assert_allclose(got, twin, rtol=0, atol=bound)
        np.testing.assert_allclose(got, ref, rtol=0, atol=bound)
        np.testing.assert_allclose(twin, ref, rtol=0, atol=bound)


@needs_numba
def test_a_float16_cache_is_read_exactly():
    """Every float16 bit pattern a cache can hold (subnormals, infinities, NaN aside) widens to its exact
    value: one key and one value row per pattern group, attended with a one-hot query."""
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = patterns[np.isfinite(patterns)]
    d = 64
    rows = finite[: (finite.size // d) * d].reshape(-1, 1, d)
    keys = np.zeros_like(rows)
    for r in range(0, rows.shape[0], 97):  # a query over a single key returns that value row exactly
        got = cpu_attention.attend(np.ones((1, 1, d), np.float32), keys[r : r + 1], rows[r : r + 1], scale=1.0)
        np.testing.assert_array_equal(got[0, 0], rows[r, 0].astype(np.float32))


@needs_numba
def test_bad_shapes_are_refused():
    rng = np.random.default_rng(3)
    q, keys, values = _inputs(rng, 1, 6, 4, 8, 8, 5, np.float32)  # 6 heads do not share 4 key heads
    with pytest.raises(ValueError, match="multiple of n_kv"):
        cpu_attention.attend(q, keys, values, scale=1.0)
    q, keys, values = _inputs(rng, 6, 4, 2, 8, 8, 5, np.float32)  # more queries than keys
    with pytest.raises(ValueError, match="T <= L"):
        cpu_attention.attend(q, keys, values, scale=1.0)
    q, keys, values = _inputs(rng, 1, 4, 2, 8, 8, 5, np.float32)
    with pytest.raises(ValueError, match="one type"):
        cpu_attention.attend(q, keys, values.astype(np.float16), scale=1.0)
    with pytest.raises(ValueError, match="float32 or float16"):
        cpu_attention.attend(q, keys.astype(np.float64), values.astype(np.float64), scale=1.0)


@needs_numba
@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
def test_the_backend_routes_decode_rows_to_the_kernel(kv_type, monkeypatch):
    """A decode token over a float32 / float16 cache runs the kernel; a chunk past KERNEL_ROWS_MAX and a
    q8_0 cache run the twin; the kernel switched off runs the twin. All give the twin's values."""
    rng = np.random.default_rng(7)
    be, off = NumpyBackend(), NumpyBackend(attention_kernel=False)
    caches = [b.new_kv_cache(2, 32, 32, 8, kv_type=kv_type) for b in (be, off)]
    prompt = cpu_attention.KERNEL_ROWS_MAX + 3
    ran: list[str] = []
    real_attend, real_twin = cpu_attention.attend, cpu_attention.attend_twin
    monkeypatch.setattr(cpu_attention, "attend", lambda *a, **kw: ran.append("kernel") or real_attend(*a, **kw))
    monkeypatch.setattr(cpu_attention, "attend_twin", lambda *a, **kw: ran.append("twin") or real_twin(*a, **kw))
    for T in (prompt, 1, 1):
        q, k, v = _inputs(rng, T, 8, 2, 32, 32, T, np.float32)
        runs = []
        for b, c in zip((be, off), caches, strict=True):
            ran.clear()
            runs.append((b.attention(q, k, v, c, scale=0.2, window=0), list(ran)))
        (got, how), (want, how_off) = runs
        assert how_off == ["twin"]
        assert how == (["kernel"] if T == 1 and kv_type != "q8_0" else ["twin"])
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * float(np.abs(want).max()))
    assert caches[0].length == prompt + 2
