"""kernels/kvq3.cu against engine/kvquant.py (the NumPy specification of the q3 KV cache: K 3-bit and
V 2-bit codes, an fp16 scale per 64 rotated values), every kernel on fresh random inputs: quantize for
both code widths, the split decode and the tiled prefill (lengths across split-K slices and key tiles,
GQA groups, a sliding window), the backend's q3 attention through appends, decode steps and growth.

Tolerances: the kernels work in fp32 and the reference in fp64, so a value within ~1e-5 of a decision
threshold may get the neighbouring code (the tests require identical codes everywhere else and print
how many near-ties there were) and a least-squares scale may round to the neighbouring fp16 (at most
one fp16 step). tests/kernels/test_kvq3_emulation.py checks the same loop structure on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import kvquant as kq

from tests._reference import attention_reference

cp = pytest.importorskip("cupy")
kvq3 = pytest.importorskip("minecart.kernels.kvq3")

DIMS = (64, 128, 256)


@pytest.mark.parametrize("d", DIMS)
def test_rotation_kernels_match_numpy(d, poison):
    x = np.random.default_rng(d).standard_normal((7, 3, d)).astype(np.float32)
    y = cp.asnumpy(kvq3.rotate(cp.asarray(x)))
    np.testing.assert_allclose(y, kq.rotate(x), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(cp.asnumpy(kvq3.unrotate(cp.asarray(y))), x, atol=2e-5, rtol=1e-5)


def _near_tie(x: np.ndarray, bits: int) -> np.ndarray:
    """Where the float64 spec's y / rms sits within 1e-5 of a decision threshold (either code is right)."""
    y = kq.rotate(x)
    d = x.shape[-1]
    b = y.reshape(y.shape[:-1] + (d // kq.BLOCK, kq.BLOCK))
    rms = np.sqrt(np.mean(b * b, axis=-1, keepdims=True))
    t = b / np.where(rms > 0, rms, 1.0)
    lv = kq.CODEBOOKS[bits]
    return (np.min(np.abs(t[..., None] - (lv[1:] + lv[:-1]) / 2), axis=-1) < 1e-5).reshape(y.shape)


def _check_rows(got_c, got_s, x, label, bits):
    ref_c, ref_s = kq.quantize(x, bits)
    gc, rc = kq.unpack(got_c, bits), kq.unpack(ref_c, bits)
    tie = _near_tie(x, bits)
    differ = gc != rc
    print(f"\n{label}: {int(differ.sum())} codes differ of {gc.size} ({int(tie.sum())} near-ties), "
          f"scales equal {np.mean(got_s == ref_s):.5f}")
    assert not np.any(differ & ~tie), "codes differ away from a decision threshold"
    if not differ.any():
        np.testing.assert_array_equal(got_c, ref_c)  # packed bytes bit-identical
    a, b = got_s.astype(np.float64), ref_s.astype(np.float64)
    ulp = np.abs(np.spacing(ref_s.astype(np.float16)).astype(np.float64))
    tie_block = differ.reshape(differ.shape[:-1] + (-1, kq.BLOCK)).any(axis=-1)  # its LS scale moves too
    assert np.all((np.abs(a - b) <= ulp) | tie_block), "a scale more than one fp16 step from the spec"
    assert np.mean(a == b) > 0.99
    # Reconstruction error: a property of the format, not of the kernel (a 300-sigma outlier row rotates
    # into a flat block whose values sit near a decision threshold). So the bound is the spec's own
    # error on the same rows: equal codes give the same error, and a near-tie code may move it only a little.
    deq = kq.dequantize(got_c, got_s, bits)
    ref = kq.dequantize(ref_c, ref_s, bits)
    energy = np.sum(x.astype(np.float64) ** 2)
    rel = np.sum((deq - x.astype(np.float64)) ** 2) / energy if energy else 0.0
    rel_ref = np.sum((ref - x.astype(np.float64)) ** 2) / energy if energy else 0.0
    print(f"{label}: relative squared error kernel {rel:.6f}, spec {rel_ref:.6f}")
    assert rel <= rel_ref * (1.0 + 1e-3) + 1e-12, (rel, rel_ref)
    return deq


@pytest.mark.parametrize("bits", [3, 2])
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("sigma", [0.01, 1.0, 50.0])
def test_quantize_append_matches_numpy(d, sigma, bits, poison):
    rng = np.random.default_rng(d + int(sigma * 100) + bits)
    T, n_kv, start = 37, 2, 5
    x = (sigma * rng.standard_normal((T, n_kv, d))).astype(np.float32)
    x[3, 1, :] = 0.0  # a zero row stays zero
    x[4, 0, 9] = 300.0 * sigma  # an outlier channel
    codes, scales = kvq3.alloc(T + start + 3, n_kv, d, bits)
    assert codes.shape[2] == bits * d // 8 and scales.shape[2] == d // 64
    codes[:] = 0xAB  # poison: rows outside start..start+T-1 must stay untouched
    scales[:] = cp.float16(7.0)
    kvq3.quantize_append(cp.asarray(x), codes, scales, start)
    got_c, got_s = cp.asnumpy(codes), cp.asnumpy(scales)
    assert np.all(got_c[:start] == 0xAB) and np.all(got_c[start + T:] == 0xAB)
    assert np.all(got_s[:start] == 7.0) and np.all(got_s[start + T:] == 7.0)
    deq = _check_rows(got_c[start:start + T], got_s[start:start + T], x, f"quantize{bits} d={d} sigma={sigma}", bits)
    assert np.all(deq[3, 1] == 0.0)


@pytest.mark.parametrize("bits", [3, 2])
@pytest.mark.parametrize("d", DIMS)
def test_quantize_append_device_start(d, bits, poison):
    """start_ptr (CUDA-graph decode) writes the row the device int32 names, nothing else."""
    rng = np.random.default_rng(d + bits)
    n_kv, cap = 3, 11
    x = rng.standard_normal((1, n_kv, d)).astype(np.float32)
    codes, scales = kvq3.alloc(cap, n_kv, d, bits)
    codes[:] = 0xAB
    scales[:] = cp.float16(7.0)
    row = cp.asarray(np.array([6], np.int32))
    kvq3.quantize_append(cp.asarray(x), codes, scales, 0, start_ptr=row)
    got_c, got_s = cp.asnumpy(codes), cp.asnumpy(scales)
    others = np.arange(cap) != 6
    assert np.all(got_c[others] == 0xAB) and np.all(got_s[others] == 7.0)
    _check_rows(got_c[6:7], got_s[6:7], x, f"quantize{bits} start_ptr d={d}", bits)


@pytest.mark.parametrize("d", DIMS)
def test_quantize_append_subtracts_the_reference_row(d, poison):
    """Keys: quantize_append(ref=) == the spec's quantize of (x - ref[head]) (Q3KVCache's centred keys)."""
    rng = np.random.default_rng(d + 5)
    T, n_kv = 9, 2
    x = (rng.standard_normal((T, n_kv, d)) + 5.0 * rng.standard_normal((1, n_kv, d))).astype(np.float32)
    ref = np.mean(x, axis=0, dtype=np.float64).astype(np.float32)
    codes, scales = kvq3.alloc(T, n_kv, d, 3)
    codes[:] = 0xAB
    kvq3.quantize_append(cp.asarray(x), codes, scales, 0, ref=cp.asarray(ref))
    _check_rows(cp.asnumpy(codes), cp.asnumpy(scales), x - ref, f"quantize3 ref d={d}", 3)
    with pytest.raises(ValueError, match="reference row"):
        kvq3.quantize_append(cp.asarray(x), codes, scales, 0, ref=cp.asarray(ref[:1]))


def _cache_case(rng, rows, n_kv, d):
    """A q3 cache of `rows` random K/V rows (n_kv, d), quantized by the NumPy spec so that only the
    attention kernel is under test (K with a larger spread, so that the softmax is not flat)."""
    k = (2.0 * rng.standard_normal((rows, n_kv, d))).astype(np.float32)
    v = rng.standard_normal((rows, n_kv, d)).astype(np.float32)
    kc, ks = kq.quantize(k, kq.K_BITS)
    vc, vs = kq.quantize(v, kq.V_BITS)
    return kc, ks, vc, vs


def _rel_err(got, ref) -> float:
    return float(np.max(np.abs(got - ref))) / max(float(np.abs(ref).max()), 1e-30)


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("L", [1, 33, 300, 2000])
@pytest.mark.parametrize("nh,n_kv", [(8, 2), (6, 1), (4, 4)])
def test_flash_decode_matches_numpy(d, window, L, nh, n_kv, poison):
    """kvq3_flash_decode (split context, flash_merge) vs attention_rotated; also with the length read
    from the device over a cache larger than L (the CUDA-graph form: empty splits past the length)."""
    rng = np.random.default_rng(d + L + window + nh)
    kc, ks, vc, vs = _cache_case(rng, L + 77, n_kv, d)
    q = rng.standard_normal((1, nh, d)).astype(np.float32)
    scale = 1.0 / np.sqrt(d)
    ref = kq.attention_rotated(q, kc[:L], ks[:L], vc[:L], vs[:L], scale=scale, q_positions=np.array([L - 1]),
                               window=window)
    dev = [cp.asarray(a) for a in (kc, ks, vc, vs)]
    got = cp.asnumpy(kvq3.flash_decode(cp.asarray(q), *dev, L, scale, window))
    got2 = cp.asnumpy(kvq3.flash_decode(cp.asarray(q), *dev, 0, scale, window,
                                        kv_len_ptr=cp.asarray(np.array([L - 1], np.int32))))
    err, err2 = _rel_err(got, ref), _rel_err(got2, ref)
    print(f"\nflash_decode d={d} L={L} window={window} nh/n_kv={nh}/{n_kv}: max rel err {err:.2e}, "
          f"device length {err2:.2e}")
    assert err < 1e-4 and err2 < 1e-4


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("T,start", [(1, 0), (1, 70), (5, 0), (37, 30), (100, 0), (64, 200)])
@pytest.mark.parametrize("nh,n_kv", [(8, 2), (6, 1), (12, 1)])
def test_prefill_matches_numpy(d, window, T, start, nh, n_kv, poison):
    """kvq3_prefill: T queries at positions start.. over cache rows [0, start + T) of a larger cache,
    vs attention_rotated (causal, GQA, window); the output poisoned first. Also kvq3.attention's
    dispatch (a single token with more than 8 query heads per KV head takes the prefill kernel)."""
    rng = np.random.default_rng(d + T + start + window + nh)
    L = start + T
    kc, ks, vc, vs = _cache_case(rng, L + 40, n_kv, d)
    q = rng.standard_normal((T, nh, d)).astype(np.float32)
    scale = 1.0 / np.sqrt(d)
    ref = kq.attention_rotated(q, kc[:L], ks[:L], vc[:L], vs[:L], scale=scale, q_positions=np.arange(start, L),
                               window=window)
    dev = [cp.asarray(a) for a in (kc, ks, vc, vs)]
    got = cp.asnumpy(kvq3.prefill(cp.asarray(q), *dev, start, L, scale, window))
    err = _rel_err(got, ref)
    via = cp.asnumpy(kvq3.attention(cp.asarray(q), *dev, start, L, scale, window))
    err_via = _rel_err(via, ref)
    print(f"\nprefill d={d} T={T} start={start} window={window} nh/n_kv={nh}/{n_kv}: max rel err {err:.2e}, "
          f"via attention {err_via:.2e}")
    assert np.all(np.isfinite(got))
    assert err < 1e-4 and err_via < 1e-4


def test_attention_refuses_mismatched_arrays():
    d = 64
    kc, ks = kvq3.alloc(8, 2, d, 3)
    vc, vs = kvq3.alloc(8, 2, d, 2)
    q = cp.zeros((1, 4, d), cp.float32)
    with pytest.raises(ValueError, match="3 bits"):
        kvq3.attention(q, vc, vs, kc, ks, 0, 1, 0.125)  # K and V swapped
    with pytest.raises(ValueError, match="multiple"):
        kvq3.attention(cp.zeros((1, 3, d), cp.float32), kc, ks, vc, vs, 0, 1, 0.125)
    with pytest.raises(ValueError, match="cache rows"):
        kvq3.prefill(cp.zeros((4, 4, d), cp.float32), kc, ks, vc, vs, 6, 10, 0.125)


def _ref_attention(q, keys, values, start: int, scale: float, window: int) -> np.ndarray:
    """fp64 causal GQA attention of q (T, nh, D) at positions start.. over keys/values (L, n_kv, D)."""
    return attention_reference(q, keys, values, start, keys.shape[0], scale, window)


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("window", [0, 20])
def test_backend_q3_attention_multi_row_appends(d, window, poison):
    """CupyBackend.attention over a q3 cache, step by step: multi-row appends at start 0 and at a
    nonzero start (quantize several rows, kvq3_prefill from `start`), single-token steps (the split
    decode), a growth past the capacity. Each step is checked (a) tightly against fp64 attention over
    the GPU cache's own codes dequantized by the spec and (b) against the NumPy backend's q3 cache
    (its own codes: equal up to rare near-ties). Keys share a common component, so the centring on
    the first append's mean (k_ref) matters. The backend holds no fp32 copy of the cache."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.backends.numpy_backend import NumpyBackend

    be = CupyBackend("cuda:0", path="fma")
    nb = NumpyBackend()
    nh, n_kv = 8, 2
    scale = 1.0 / np.sqrt(d)
    gc = be.new_kv_cache(n_kv, d, d, 16, kv_type="q3")
    nc = nb.new_kv_cache(n_kv, d, d, 16, kv_type="q3")
    assert gc.k_codes.shape[1:] == (n_kv, 3 * d // 8) and gc.v_codes.shape[1:] == (n_kv, 2 * d // 8)
    assert "_q3_scratch_arrays" not in be.__dict__
    rng = np.random.default_rng(d + window)
    offset = (3.0 * rng.standard_normal((1, n_kv, d))).astype(np.float32)  # keys share a component
    for step, T in enumerate([5, 7, 1, 1, 37, 1, 3]):  # 37 at start 14 grows the cache past 16
        start = gc.length
        q = rng.standard_normal((T, nh, d)).astype(np.float32)
        k = (2.0 * rng.standard_normal((T, n_kv, d)) + offset).astype(np.float32)
        v = rng.standard_normal((T, n_kv, d)).astype(np.float32)
        got = cp.asnumpy(be.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), gc, scale=scale, window=window))
        ref_np = nb.attention(q, k, v, nc, scale=scale, window=window)
        L = gc.length
        assert L == start + T == nc.length
        k_ref = cp.asnumpy(gc.k_ref)
        np.testing.assert_allclose(k_ref, nc.k_ref, rtol=0, atol=1e-6 * float(np.abs(nc.k_ref).max()))
        kd = kq.dequantize(cp.asnumpy(gc.k_codes[:L]), cp.asnumpy(gc.k_scales[:L]), kq.K_BITS) + k_ref
        vd = kq.dequantize(cp.asnumpy(gc.v_codes[:L]), cp.asnumpy(gc.v_scales[:L]), kq.V_BITS)
        ref = _ref_attention(q, kd, vd, start, scale, window)
        err, err_np = _rel_err(got, ref), _rel_err(got, ref_np)
        print(f"\nq3 backend d={d} window={window} step {step}: T={T} start={start}: max rel err vs own codes "
              f"{err:.2e}, vs NumPy q3 cache {err_np:.2e}")
        assert err < 1e-4, (step, err)
        assert err_np < 2e-2, (step, err_np)
