"""The q3 KV cache (engine/kvquant.py: K 3-bit and V 2-bit codes, an fp16 scale per 64 rotated values):
codebooks, packing, rotation, error bounds, the NumPy cache and the model end to end on the shared tiny
fixture (q3 against the f32 cache).

The end-to-end bounds are about 2x the numbers measured in docs/kv-cache.md, so a real regression
(a wrong rotation, swapped codes, a lost scale) fails them, while the exact q3-vs-f32 difference is
also required to be clearly nonzero (so a silent fallback to f32 fails too).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from minecart.engine import kvquant as kq
from minecart.engine.backends.numpy_backend import NumpyBackend, NumpyKVCache
from minecart.engine.errors import RequestError

DIMS = (64, 128, 256)


# ---- codebook -------------------------------------------------------------------------------------
def test_stored_codebook_is_the_lloyd_max_fixed_point():
    levels, thresholds, mse = kq.derive_lloyd_max()
    np.testing.assert_allclose(kq.LEVELS, levels, rtol=0, atol=1e-12)
    np.testing.assert_allclose(kq.THRESHOLDS, thresholds, rtol=0, atol=1e-12)
    assert np.all(np.diff(kq.LEVELS) > 0)
    np.testing.assert_array_equal(kq.LEVELS, -kq.LEVELS[::-1])  # symmetric
    # Max (1960), table for N = 8: outputs 0.2451, 0.7560, 1.344, 2.152; MSE 0.03454
    np.testing.assert_allclose(kq.LEVELS[4:], [0.2451, 0.7560, 1.344, 2.152], atol=6e-4)
    assert abs(mse - 0.03454) < 2e-5
    # the 4-level codebook of the 2-bit V codes; Max (1960), N = 4: outputs 0.4528, 1.510; MSE 0.1175
    levels2, _, mse2 = kq.derive_lloyd_max(4)
    np.testing.assert_allclose(kq.LEVELS2, levels2, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(kq.LEVELS2, -kq.LEVELS2[::-1])
    np.testing.assert_allclose(kq.LEVELS2[2:], [0.4528, 1.510], atol=6e-4)
    assert abs(mse2 - 0.1175) < 2e-4
    assert kq.CODEBOOKS == {3: kq.LEVELS, 2: kq.LEVELS2}


def test_codebook_is_optimal_on_gaussian_samples():
    x = np.random.default_rng(1).standard_normal(2_000_000)
    cell = np.searchsorted(kq.THRESHOLDS, x)
    # centroid condition: each level is the mean of the samples it represents
    for i in range(kq.N_LEVELS):
        assert abs(x[cell == i].mean() - kq.LEVELS[i]) < 0.01
    mse = np.mean((x - kq.LEVELS[cell]) ** 2)
    assert abs(mse - 0.034548) < 5e-4
    # moving the levels in or out makes it worse
    for f in (0.95, 1.05):
        assert np.mean((x - f * kq.LEVELS[np.searchsorted(f * kq.THRESHOLDS, x)]) ** 2) > mse


# ---- packing --------------------------------------------------------------------------------------
def test_pack3_layout_by_hand():
    # word = sum(i << 3i) for codes 0..7 = 0xFAC688, little-endian bytes 88 C6 FA
    np.testing.assert_array_equal(kq.pack3(np.arange(8, dtype=np.uint8)), [0x88, 0xC6, 0xFA])
    np.testing.assert_array_equal(kq.pack3(np.full(8, 7, np.uint8)), [0xFF, 0xFF, 0xFF])
    np.testing.assert_array_equal(kq.unpack3(np.array([0x88, 0xC6, 0xFA], np.uint8)), np.arange(8))


@pytest.mark.parametrize("shape", [(8,), (3, 64), (5, 2, 256), (7, 4, 24)])
def test_pack_unpack_round_trip_is_bit_exact(shape):
    rng = np.random.default_rng(sum(shape))
    codes = rng.integers(0, 8, shape).astype(np.uint8)
    packed = kq.pack3(codes)
    assert packed.dtype == np.uint8 and packed.shape == shape[:-1] + (shape[-1] * 3 // 8,)
    np.testing.assert_array_equal(kq.unpack3(packed), codes)
    # every byte string is a valid packing: unpack then pack gives the same bytes back
    raw = rng.integers(0, 256, packed.shape).astype(np.uint8)
    np.testing.assert_array_equal(kq.pack3(kq.unpack3(raw)), raw)


def test_pack3_refuses_a_partial_group():
    with pytest.raises(ValueError, match="multiple of 8"):
        kq.pack3(np.zeros(12, np.uint8))
    with pytest.raises(ValueError, match="multiple of 4"):
        kq.pack2(np.zeros(6, np.uint8))


def test_pack2_layout_and_round_trip():
    # code i of a byte at bits 2i: codes 0, 1, 2, 3 -> 0b11100100 = 0xE4
    np.testing.assert_array_equal(kq.pack2(np.array([0, 1, 2, 3, 3, 3, 3, 3], np.uint8)), [0xE4, 0xFF])
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 4, (5, 2, 64)).astype(np.uint8)
    packed = kq.pack(codes, 2)
    assert packed.shape == (5, 2, 16)
    np.testing.assert_array_equal(kq.unpack(packed, 2), codes)
    raw = rng.integers(0, 256, (3, 16)).astype(np.uint8)
    np.testing.assert_array_equal(kq.pack2(kq.unpack2(raw)), raw)  # every byte is a valid packing


# ---- rotation -------------------------------------------------------------------------------------
def _fwht(x: np.ndarray) -> np.ndarray:
    """Independent butterfly Walsh-Hadamard transform of the last axis, normalized."""
    y = np.array(x, np.float64)
    d = y.shape[-1]
    h = 1
    while h < d:
        y = y.reshape(y.shape[:-1] + (d // (2 * h), 2, h))
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :], y[..., 1, :] = a + b, a - b
        y = y.reshape(y.shape[:-3] + (d,))
        h *= 2
    return y / np.sqrt(d)


@pytest.mark.parametrize("d", DIMS)
def test_rotation_is_orthonormal_and_a_signed_hadamard(d):
    eye = np.eye(d)
    r = kq.rotate(eye)  # rows: R e_i, i.e. R^T
    np.testing.assert_allclose(r @ r.T, eye, atol=1e-12)
    np.testing.assert_allclose(np.abs(r), 1 / np.sqrt(d), atol=1e-15)
    x = np.random.default_rng(d).standard_normal((9, 3, d))
    np.testing.assert_allclose(kq.rotate(x), _fwht(x * kq.rotation_signs(d)), atol=1e-12)
    np.testing.assert_allclose(kq.unrotate(kq.rotate(x)), x, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(kq.rotate(x), axis=-1), np.linalg.norm(x, axis=-1))
    s = kq.rotation_signs(d)
    assert set(np.unique(s)) == {-1.0, 1.0} and abs(s.sum()) < d / 4  # a real mix of flips


def test_bad_head_dims_are_refused_with_a_fix():
    for d in (48, 96, 16):
        with pytest.raises(RequestError, match="power of two"):
            kq.quantize(np.ones((1, d)))
    with pytest.raises(RequestError, match="kv_type 'f32'"):
        NumpyBackend().new_kv_cache(2, 80, 80, 4, kv_type="q3")


# ---- error on Gaussian and outlier data --------------------------------------------------------
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("sigma", [1e-3, 1.0, 300.0])
@pytest.mark.parametrize("bits,lo,hi", [(3, 0.02, 0.036), (2, 0.09, 0.1175)])
def test_relative_error_on_gaussian_rows(d, sigma, bits, lo, hi):
    x = sigma * np.random.default_rng(d).standard_normal((2000, d))
    packed, scales = kq.quantize(x, bits)
    assert packed.shape == (2000, bits * d // 8) and scales.shape == (2000, d // 64)
    assert scales.dtype == np.float16
    rel_mse = np.sum((kq.dequantize(packed, scales, bits) - x) ** 2) / np.sum(x**2)
    # Lloyd-Max bounds for a known variance: 0.0345 (8 levels), 0.1175 (4 levels); the per-block
    # least-squares scale does a bit better (measured 0.0325 and 0.113)
    assert lo < rel_mse < hi, rel_mse


def test_rotation_tames_outlier_channels():
    """K rows with a few huge channels (as real K caches have): the rotation spreads them, so the
    error stays near the Gaussian bound; without it the error is many times larger."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1000, 128))
    x[:, [3, 77]] *= 40.0
    for bits, bound in ((3, 0.04), (2, 0.1)):  # measured 0.023 and 0.063
        rel = np.sum((kq.dequantize(*kq.quantize(x, bits), bits) - x) ** 2) / np.sum(x**2)
        codes, scales = kq.quantize_rotated(x, bits)  # the same codebook without the rotation
        rel_no_rotation = np.sum((kq.dequantize_rotated(codes, scales, bits) - x) ** 2) / np.sum(x**2)
        assert rel < bound
        assert rel_no_rotation > 5 * rel


def test_least_squares_scale_beats_the_rms_scale():
    y = kq.rotate(np.random.default_rng(7).standard_normal((500, 128)))
    for bits in (3, 2):
        lv = kq.CODEBOOKS[bits]
        packed, scales = kq.quantize_rotated(y, bits)
        blocks = y.reshape(500, 2, 64)
        rms = np.sqrt(np.mean(blocks**2, axis=-1, keepdims=True))
        rms_err = np.sum((lv[np.searchsorted((lv[1:] + lv[:-1]) / 2, blocks / rms)] * rms - blocks) ** 2)
        assert np.sum((kq.dequantize_rotated(packed, scales, bits) - y) ** 2) < rms_err


def test_zero_rows_stay_zero():
    x = np.zeros((3, 64))
    x[1] = np.random.default_rng(0).standard_normal(64)
    for bits in (3, 2):
        out = kq.dequantize(*kq.quantize(x, bits), bits)
        assert np.all(out[0] == 0) and np.all(out[2] == 0) and np.all(np.isfinite(out))


# ---- the NumPy cache ----------------------------------------------------------------------------
def test_q3_cache_append_grow_truncate_clone():
    rng = np.random.default_rng(3)
    cache = NumpyBackend().new_kv_cache(2, 64, 128, 3, kv_type="q3")
    assert isinstance(cache, kq.Q3KVCache)
    assert (cache.k_bits, cache.v_bits, cache.block) == (3, 2, 64)
    k = rng.standard_normal((10, 2, 64)).astype(np.float32)
    v = rng.standard_normal((10, 2, 128)).astype(np.float32)
    cache.append(k[:4], v[:4])
    cache.append(k[4:], v[4:])  # grows past the capacity of 3
    assert cache.length == 10 and cache.capacity >= 10
    got_k, got_v = cache.read(10)
    # keys are centred on the first append's mean (float64, rounded to float32) and read back with it
    ref = np.mean(k[:4], axis=0, dtype=np.float64).astype(np.float32)
    np.testing.assert_array_equal(cache.k_ref, ref)
    np.testing.assert_array_equal(got_k, kq.dequantize(*kq.quantize(k - ref, 3), 3) + ref)
    np.testing.assert_array_equal(got_v, kq.dequantize(*kq.quantize(v, 2), 2))
    assert 0.01 < np.sum((got_k - k) ** 2) / np.sum(k**2) < 0.05
    assert 0.07 < np.sum((got_v - v) ** 2) / np.sum(v**2) < 0.14
    twin = cache.clone()
    cache.truncate(5)
    cache.append(-k[5:], -v[5:])
    np.testing.assert_array_equal(twin.read(10)[0], got_k)  # the clone is independent
    np.testing.assert_array_equal(twin.k_ref, ref)
    np.testing.assert_array_equal(cache.k_ref, ref)  # fixed for the cache's life
    np.testing.assert_array_equal(cache.read(10)[0][5:], kq.dequantize(*kq.quantize(-k[5:] - ref, 3), 3) + ref)
    np.testing.assert_array_equal(cache.read(10)[1][5:], kq.dequantize(*kq.quantize(-v[5:], 2), 2))
    with pytest.raises(ValueError):
        cache.truncate(11)
    # K: 3 bits per value + a 2-byte scale per 64 = 26 bytes per 64 values; V: 2 bits + the scale = 18
    assert cache.bytes_per_token == 2 * (26 + 2 * 18) == 124
    assert cache.nbytes == cache.capacity * cache.bytes_per_token
    assert cache.k_codes.shape[1:] == (2, 24) and cache.v_codes.shape[1:] == (2, 32)
    assert cache.k_scales.shape[1:] == (2, 1) and cache.v_scales.shape[1:] == (2, 2)
    # equal K and V dims: exactly the placement price, 11/32 bytes per value (2.75 bits)
    eq = NumpyBackend().new_kv_cache(4, 256, 256, 8, kv_type="q3")
    assert kq.KV_BYTES_PER_VALUE["q3"] == 11 / 32
    assert eq.bytes_per_token == 4 * 2 * 256 * 11 // 32 == 4 * (104 + 72)
    f32 = NumpyKVCache(4, 256, 256, 8)
    assert (f32.k.nbytes + f32.v.nbytes) * 11 == eq.nbytes * 4 * 32  # 11.6x smaller than f32


def test_centred_keys_cut_the_error_of_a_shared_component():
    """Keys with a large common component (real models' keys: 50-80% of the energy, docs/kv-cache.md):
    centring on the first append's mean makes the cached keys' error scale with what varies, and the
    attention is unchanged by the reference row (softmax ignores a per-query shift)."""
    rng = np.random.default_rng(12)
    n_kv, d, T = 2, 128, 40
    k = (rng.standard_normal((T, n_kv, d)) + 4.0 * rng.standard_normal((1, n_kv, d))).astype(np.float32)
    v = rng.standard_normal((T, n_kv, d)).astype(np.float32)
    cache = kq.Q3KVCache(n_kv, d, d, T)
    cache.append(k, v)
    centred = np.sum((cache.read(T)[0] - k) ** 2)
    plain = np.sum((kq.dequantize(*kq.quantize(k, 3), 3) - k) ** 2)
    assert centred < plain / 5, (centred, plain)
    # attention over the centred codes alone (no reference row) == attention over the read-back keys
    be = NumpyBackend()
    q = rng.standard_normal((T, 4, d)).astype(np.float32)
    ref = be.attention(q, k, v, be.new_kv_cache(n_kv, d, d, T, kv_type="q3"), scale=0.1)
    got = kq.attention_rotated(q, cache.k_codes, cache.k_scales, cache.v_codes, cache.v_scales, scale=0.1,
                               q_positions=np.arange(T))
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5)


def test_unknown_kv_type_is_refused():
    with pytest.raises(RequestError, match="q3"):
        NumpyBackend().new_kv_cache(2, 64, 64, 4, kv_type="q4")


@pytest.mark.parametrize("window", [0, 5])
def test_rotated_space_attention_matches_the_dequantizing_backend(window):
    rng = np.random.default_rng(11 + window)
    be = NumpyBackend()
    T, nh, n_kv, d = 12, 4, 2, 64
    q = rng.standard_normal((T, nh, d)).astype(np.float32)
    k = rng.standard_normal((T, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((T, n_kv, d)).astype(np.float32)
    cache = be.new_kv_cache(n_kv, d, d, T, kv_type="q3")
    ref = be.attention(q, k, v, cache, scale=0.125, window=window)
    got = kq.attention_rotated(q, cache.k_codes[:T], cache.k_scales[:T], cache.v_codes[:T],
                               cache.v_scales[:T], scale=0.125, q_positions=np.arange(T), window=window)
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5)
    exact = be.attention(q, k, v, be.new_kv_cache(n_kv, d, d, T), scale=0.125, window=window)
    assert np.abs(exact - ref).max() > 1e-3  # the q3 path really is quantized


# ---- end to end on the shared fixture ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(fixtures_dir):
    from minecart.engine.model import load_model

    path = fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf"
    seqs = {s["name"]: s["ids"] for s in json.loads((fixtures_dir / "sequences.json").read_text())["sequences"]}
    return load_model(path, backend=NumpyBackend(), mmproj=False, kv_type="q3"), seqs


def test_fixture_logits_with_q3_stay_close_to_f32(tiny):
    model, seqs = tiny
    assert model.kv_type == "q3"
    ids = seqs["len128"]
    ref = kq.sequence_logits(model, ids, "f32")
    got = kq.sequence_logits(model, ids, "q3")
    row = kq.compare_logits(ref, got)
    # measured (docs/kv-cache.md): rel mean 0.034, max 0.107, top-1 0.984, KL mean 0.0057, max 0.052
    assert 0.006 < row["rel_err_mean"] < 0.07
    assert row["rel_err_max"] < 0.25
    assert row["top1_agree"] >= 0.95
    assert row["kl_mean"] < 0.012 and row["kl_max"] < 0.12
    # Model.logits uses the model's kv_type (q3 here): the same numbers (one append of the same rows, so
    # the same key reference row), up to float32 rounding
    np.testing.assert_allclose(model.logits(ids[:20]), kq.sequence_logits(model, ids[:20], "q3"),
                               rtol=1e-4, atol=1e-4)
    # the keys' reference row is the first append's mean: a prefix run alone differs a little from the
    # same rows inside the longer run (a lossy cache's numbers depend on the first chunk), boundedly
    assert kq.compare_logits(got[:20], model.logits(ids[:20]))["rel_err_max"] < 0.2


def test_fixture_sessions_take_the_kv_type(tiny):
    model, seqs = tiny
    s = model.new_session()
    f = model.new_session(kv_type="f32")
    try:
        kinds = {type(st.kv) for st in s.states if st.kv is not None}
        assert kinds == {kq.Q3KVCache}
        assert {type(st.kv) for st in f.states if st.kv is not None} == {NumpyKVCache}
        prompt = seqs["short"]
        s.prefill(prompt)
        twin = s.fork()
        assert {type(st.kv) for st in twin.states if st.kv is not None} == {kq.Q3KVCache}
        a = s.step(5)
        b = twin.step(5)
        np.testing.assert_array_equal(a, b)
        twin.close()
    finally:
        s.close()
        f.close()
    # greedy continuation: q3 and f32 agree on the fixture (measured: all 32 tokens)
    assert kq.greedy_tokens(model, seqs["chat"], 8, "q3") == kq.greedy_tokens(model, seqs["chat"], 8, "f32")


def test_load_model_refuses_an_unknown_kv_type(fixtures_dir):
    from minecart.engine.model import load_model

    with pytest.raises(RequestError, match="not known"):
        load_model(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", backend=NumpyBackend(),
                   mmproj=False, kv_type="q5")


def test_cli_has_the_kv_type_flag():
    import argparse

    from minecart.engine.cli import run_cmd

    parser = argparse.ArgumentParser()
    run_cmd.register(parser.add_subparsers())
    assert parser.parse_args(["run", "m.gguf", "--kv-type", "q3"]).kv_type == "q3"
    assert parser.parse_args(["run", "m.gguf"]).kv_type == "f16"  # the engine's default


def test_cuda_source_carries_the_same_codebook_and_signs():
    """kernels/kvq3.cu hard-codes the levels, thresholds, the block and the sign hash, kernels/kvq3.py the
    bits and the block; they must be the NumPy ones (checked on the text, no GPU needed)."""
    import re
    from pathlib import Path

    import minecart.kernels as kernels_pkg

    src = (Path(kernels_pkg.__file__).parent / "kvq3.cu").read_text()

    def table(name):
        body = re.search(name + r"\[\d\] = \{([^}]*)\}", src).group(1)
        return np.array([float(v.strip().rstrip("f")) for v in body.split(",")])

    np.testing.assert_allclose(table("KVQ3_LEVELS3"), kq.LEVELS, rtol=2e-9, atol=1e-12)
    np.testing.assert_allclose(table("KVQ3_THRESHOLDS3"), kq.THRESHOLDS, rtol=2e-9, atol=1e-12)
    np.testing.assert_allclose(table("KVQ3_LEVELS2"), kq.LEVELS2, rtol=2e-9, atol=1e-12)
    np.testing.assert_allclose(table("KVQ3_THRESHOLDS2"), (kq.LEVELS2[1:] + kq.LEVELS2[:-1]) / 2,
                               rtol=2e-9, atol=1e-12)
    for const in ("0x9E3779B1", "0x85EBCA6B", ">> 16", ">> 13", ">> 31", f"#define KVQ3_BLOCK {kq.BLOCK}"):
        assert const in src
    py = (Path(kernels_pkg.__file__).parent / "kvq3.py").read_text()
    assert f"K_BITS, V_BITS, BLOCK = {kq.K_BITS}, {kq.V_BITS}, {kq.BLOCK}" in py


def test_runtime_load_passes_the_kv_type(fixtures_dir):
    from minecart.engine.runtime import Runtime

    rt = Runtime(sample_memory_s=0)
    try:
        rt.load(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", devices=["cpu:0"], kv_type="q3").result()
        model = rt._model
        assert model.kv_type == "q3"
        session = model.new_session()
        assert any(isinstance(st.kv, kq.Q3KVCache) for st in session.states)
        session.close()
    finally:
        rt.close()


# ---- f16 and q8_0 caches ----------------------------------------------------------------------------


def test_q8_0_rows_are_ggml_q8_0_blocks_bit_for_bit():
    """quantize_q8_0 against gguf-py's Q8_0 (the converter's own quantizer), byte for byte: Gaussian
    rows at three magnitudes, an all-zero block, a block of exact halves (x / d = k + 0.5: ties go away
    from zero in ggml's roundf) and one with a lone outlier."""
    import gguf

    rng = np.random.default_rng(5)
    rows = [rng.standard_normal((7, 128)).astype(np.float32) * s for s in (1e-3, 1.0, 300.0)]
    special = np.zeros((1, 128), np.float32)
    # d = 127/8 / 127 = 1/8 exactly, so x / d lands exactly on k + 0.5 for the other 31 values
    special[0, 32:64] = np.concatenate([[127.0], np.arange(-15, 16) + 0.5]) / 8
    assert np.any(np.abs(special[0, 33:64] * 8 % 1) == 0.5)
    special[0, 64:96] = rng.standard_normal(32) * 0.01
    special[0, 70] = 50.0
    special[0, 96:] = np.float32(127.0) * np.linspace(-1, 1, 32, dtype=np.float32)
    x = np.concatenate(rows + [special])
    q, scales = kq.quantize_q8_0(x)
    ours = np.concatenate([np.concatenate([scales[r, b:b + 1].view(np.uint8), q[r, 32 * b:32 * b + 32].view(np.uint8)])
                           for r in range(x.shape[0]) for b in range(4)])
    ref = np.asarray(gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)).reshape(-1)
    np.testing.assert_array_equal(ours, ref)
    np.testing.assert_array_equal(kq.dequantize_q8_0(q, scales),
                                  gguf.quants.dequantize(ref.reshape(x.shape[0], -1), gguf.GGMLQuantizationType.Q8_0))


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_f16_and_q8_0_caches_append_grow_truncate_clone(kv_type):
    rng = np.random.default_rng(3)
    be = NumpyBackend()
    cache = be.new_kv_cache(2, 64, 128, 3, kv_type=kv_type)
    assert cache.kv_type == kv_type
    k = rng.standard_normal((5, 2, 64)).astype(np.float32)
    v = rng.standard_normal((5, 2, 128)).astype(np.float32)
    cache.append(k[:2], v[:2])
    cache.append(k[2:], v[2:])  # grows past 3
    assert cache.length == 5 and cache.capacity >= 5
    rk, rv = cache.read(5)
    if kv_type == "f16":  # IEEE half, round to nearest even: what a GPU's __float2half_rn stores
        np.testing.assert_array_equal(rk, k.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(rv, v.astype(np.float16).astype(np.float32))
    else:
        np.testing.assert_array_equal(rk, kq.dequantize_q8_0(*kq.quantize_q8_0(k)))
        assert 0 < np.abs(rk - k).max() <= np.abs(k).max() / 127 / 2 * 1.001
    twin = cache.clone()
    cache.truncate(2)
    cache.append(k[4:], v[4:])
    np.testing.assert_array_equal(twin.read(5)[0], rk)  # the clone kept its rows
    np.testing.assert_array_equal(cache.read(3)[0][2], rk[4])
    per_value = {"f16": 2, "q8_0": 34 / 32}[kv_type]
    assert cache.nbytes == cache.capacity * 2 * (64 + 128) * per_value


def test_q8_0_needs_whole_blocks():
    with pytest.raises(RequestError, match="multiple of 32"):
        NumpyBackend().new_kv_cache(2, 48, 48, 4, kv_type="q8_0")


@pytest.mark.parametrize("kv_type", kq.KV_TYPES)
def test_plan_prices_the_kv_cache_the_engine_allocates(fixtures_dir, capsys, kv_type):
    """`minecart plan`'s KV bytes per token == the bytes of the caches a loaded model allocates."""
    from minecart.engine.cli import main
    from minecart.engine.model import load_model

    path = fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf"
    assert main(["plan", str(path), "--rig", "cpu:0=4GiB", "--kv-type", kv_type, "--json",
                 "--context", "1000"]) == 0
    report = json.loads(capsys.readouterr().out)
    model = load_model(path, backend=NumpyBackend(), mmproj=False, kv_type=kv_type)
    try:
        session = model.new_session(capacity=1000)
        caches = [st.kv for st in session.states if st.kv is not None]
        assert {c.kv_type if hasattr(c, "kv_type") else "f32" for c in caches} == {kv_type}
        allocated = sum(c.nbytes for c in caches)
        assert allocated == report["kv_bytes_per_token"] * 1000 == report["devices"][0]["kv_cache_bytes"]
        assert report["kv_bytes_per_token"] == 2 * kq.kv_bytes_per_token(model.config, kv_type)
        session.close()
    finally:
        model.close()


@pytest.mark.parametrize("kv_type,rel_mean", [("f16", 1e-3), ("q8_0", 1e-2)])
def test_fixture_with_f16_and_q8_0_agrees_with_f32(tiny, kv_type, rel_mean):
    model, seqs = tiny
    ids = seqs["len128"]
    row = kq.compare_logits(kq.sequence_logits(model, ids, "f32"), kq.sequence_logits(model, ids, kv_type))
    assert 0 < row["rel_err_mean"] < rel_mean  # nonzero: the cache really rounds
    assert row["top1_agree"] >= 0.99
    assert kq.greedy_tokens(model, seqs["chat"], 8, kv_type) == kq.greedy_tokens(model, seqs["chat"], 8, "f32")


def test_kv_report_compares_a_type_with_f32(fixtures_dir, tmp_path, capsys):
    """`python -m minecart.engine.kv_report MODEL --sequences S --kv-type T` prints measure's JSON."""
    from minecart.engine import kv_report

    seqs = tmp_path / "s.json"
    seqs.write_text(json.dumps({"sequences": [{"name": "a", "ids": [5, 9, 200, 31, 7, 8, 1000, 3]}]}))
    model = fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf"
    for kv in ("q3", "q8_0"):
        assert kv_report.main([str(model), "--sequences", str(seqs), "--greedy", "2", "--kv-type", kv]) == 0
        r = json.loads(capsys.readouterr().out)
        assert r["kv_type"] == kv
        # fixture: 2 KV heads x (64 + 64) values per token per layer
        assert r["bytes_per_token_layer"] == {"f32": 1024, "f16": 512, "q8_0": 272, "q3": 88}
        row = r["sequences"]["a"]
        assert row["positions"] == 8 and 0 < row["rel_err_mean"] < 0.2 and row["greedy_same"] == 2
