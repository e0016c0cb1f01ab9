"""kernels/kvq3.cu against engine/kvquant.py (the NumPy specification of the q3 KV cache).

Written without GPU access: these tests have never run. Tolerances: the kernels work in fp32 and the
reference in fp64, so a value sitting on a decision threshold may get the neighbouring code and a
least-squares scale may round to the neighbouring fp16; both are rare and bounded below.
"""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import kvquant as kq

cp = pytest.importorskip("cupy")
kvq3 = pytest.importorskip("minecart.kernels.kvq3")

DIMS = (64, 128, 256)


@pytest.mark.parametrize("d", DIMS)
def test_rotation_kernels_match_numpy(d, poison):
    x = np.random.default_rng(d).standard_normal((7, 3, d)).astype(np.float32)
    y = cp.asnumpy(kvq3.rotate(cp.asarray(x)))
    np.testing.assert_allclose(y, kq.rotate(x), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(cp.asnumpy(kvq3.unrotate(cp.asarray(y))), x, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("sigma", [0.01, 1.0, 50.0])
def test_quantize_append_matches_numpy(d, sigma, poison):
    rng = np.random.default_rng(d + int(sigma * 100))
    T, n_kv, start = 37, 2, 5
    x = (sigma * rng.standard_normal((T, n_kv, d))).astype(np.float32)
    x[3, 1, :] = 0.0  # a zero row stays zero
    codes, scales = kvq3.alloc(T + start + 3, n_kv, d)
    codes[:] = 0xAB  # poison: rows outside start..start+T-1 must stay untouched
    scales[:] = cp.float16(7.0)
    kvq3.quantize_append(cp.asarray(x), codes, scales, start)
    got_c, got_s = cp.asnumpy(codes), cp.asnumpy(scales)
    assert np.all(got_c[:start] == 0xAB) and np.all(got_c[start + T:] == 0xAB)
    assert np.all(got_s[:start] == 7.0) and np.all(got_s[start + T:] == 7.0)
    ref_c, ref_s = kq.quantize(x)
    same_codes = np.mean(kq.unpack3(got_c[start:start + T]) == kq.unpack3(ref_c))
    assert same_codes > 0.999, same_codes
    np.testing.assert_allclose(got_s[start:start + T].astype(np.float32), ref_s.astype(np.float32), rtol=2e-3)
    deq = kq.dequantize(got_c[start:start + T], got_s[start:start + T])
    rel = np.sum((deq - x) ** 2) / np.sum(x**2)
    assert rel < 0.036, rel
    assert np.all(deq[3, 1] == 0.0)


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("L", [1, 33, 300])
def test_decode_attention_matches_numpy(d, window, L, poison):
    rng = np.random.default_rng(d + L + window)
    nh, n_kv = 8, 2
    k = rng.standard_normal((L, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((L, n_kv, d)).astype(np.float32)
    q = rng.standard_normal((1, nh, d)).astype(np.float32)
    # the cache content comes from the NumPy quantizer, so only the attention kernel is under test here
    kc, ks = kq.quantize(k)
    vc, vs = kq.quantize(v)
    scale = 1.0 / np.sqrt(d)
    ref = kq.attention_rotated(q, kc, ks, vc, vs, scale=scale, q_positions=np.array([L - 1]), window=window)
    got = kvq3.decode_attention(cp.asarray(q), cp.asarray(kc), cp.asarray(ks), cp.asarray(vc), cp.asarray(vs),
                                L, scale, window)
    np.testing.assert_allclose(cp.asnumpy(got), ref, atol=1e-4, rtol=1e-4)
