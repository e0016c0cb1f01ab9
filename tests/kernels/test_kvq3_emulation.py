"""A NumPy emulation of kernels/kvq3.cu (same fp32 arithmetic, butterfly order, warp reductions, bit
packing and tile loops of the decode and prefill attention) checked against engine/kvquant.py, the
specification of the q3 KV format (K: 3-bit codes, V: 2-bit codes, an fp16 scale per 64 values).

The kernels cannot run on this machine; this catches indexing, packing and algorithm mistakes on the
CPU. The emulation works in float32 where the kernels do and the specification in float64, so a value
within ~1e-6 of a decision threshold may legitimately take the neighbouring code: the tests require
identical codes everywhere else (and report how many near-ties there were).
"""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import kvquant as kq

F32 = np.float32
BLOCK = 64
NEG_BIG = F32(-1.0e30)


def levels(bits: int) -> np.ndarray:
    return kq.CODEBOOKS[bits].astype(F32)


def thresholds(bits: int) -> np.ndarray:
    lv = kq.CODEBOOKS[bits]
    return ((lv[1:] + lv[:-1]) / 2.0).astype(F32)


def sign_u32(d: int) -> np.ndarray:
    """kvq3_sign: u32 wrap-around arithmetic, bit 31."""
    i = np.arange(d, dtype=np.uint32)
    with np.errstate(over="ignore"):
        h = (i + np.uint32(1)) * np.uint32(0x9E3779B1)
        h ^= h >> np.uint32(16)
        h = h * np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
    return np.where(h >> np.uint32(31), F32(-1.0), F32(1.0))


def fwht(x: np.ndarray) -> np.ndarray:
    """kvq3_fwht on rows (..., D): butterflies h = 1, 2, 4.. over thread tid < D/2 (pair i, i+h with
    i = (tid / h) * 2h + tid % h), in float32, then * (1 / sqrt(D)) in float32."""
    x = np.array(x, F32)
    D = x.shape[-1]
    tid = np.arange(D // 2)
    h = 1
    while h < D:
        i = (tid // h) * 2 * h + tid % h
        a, b = x[..., i].copy(), x[..., i + h].copy()
        x[..., i] = a + b
        x[..., i + h] = a - b
        h <<= 1
    return x * (F32(1.0) / np.sqrt(F32(D)))


def warp_sum(v: np.ndarray) -> np.ndarray:
    """__shfl_xor_sync butterfly over the last axis (32 lanes): every lane ends with the same sum."""
    v = np.array(v, F32)
    lanes = np.arange(32)
    for o in (16, 8, 4, 2, 1):
        v = v + v[..., lanes ^ o]
    return v


def emu_quantize(x: np.ndarray, bits: int, ref: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """kvq3_quantize<D, bits> over rows x (..., D): (packed codes uint8 (..., bits*D/8), fp16 scales
    (..., D/64)). ref (keys): a row subtracted in fp32 first. Scale block b = warps 2b and 2b+1: each
    warp's butterfly sum, then the two added in shared memory (red[2b] + red[2b+1])."""
    x = np.asarray(x, F32)
    if ref is not None:
        x = x - np.asarray(ref, F32)
    D = x.shape[-1]
    y = fwht(x * sign_u32(D))
    warps = y.reshape(y.shape[:-1] + (D // 32, 32))
    per_warp = warp_sum(warps * warps)[..., 0]  # (..., D/32)
    pair = (per_warp[..., 0::2] + per_warp[..., 1::2])  # (..., D/64)
    rms = np.sqrt(pair * F32(1.0 / BLOCK))
    blocks = y.reshape(y.shape[:-1] + (D // BLOCK, BLOCK))
    t = blocks / np.where(rms > 0, rms, F32(1.0))[..., None]
    code = np.zeros(blocks.shape, np.int32)
    for thr in thresholds(bits):
        code += (t > thr).astype(np.int32)
    c = levels(bits)[code]
    wv = (blocks * c).reshape(warps.shape)
    wc = (c * c).reshape(warps.shape)
    num_w, den_w = warp_sum(wv)[..., 0], warp_sum(wc)[..., 0]
    num, den = num_w[..., 0::2] + num_w[..., 1::2], den_w[..., 0::2] + den_w[..., 1::2]
    scales = np.minimum(num / den, F32(65504.0)).astype(np.float16)  # cvt.rn.f16.f32
    cs = code.reshape(y.shape).astype(np.uint32)
    groups = cs.reshape(cs.shape[:-1] + (D // 8, 8))  # thread tid < D/8 packs codes 8tid..8tid+7
    w = np.zeros(groups.shape[:-1], np.uint32)
    for j in range(8):
        w |= groups[..., j] << np.uint32(bits * j)
    packed = np.stack([(w >> np.uint32(8 * b)) & 0xFF for b in range(bits)], axis=-1).astype(np.uint8)
    return packed.reshape(cs.shape[:-1] + (bits * D // 8,)), scales


def emu_group8(codes, scales, row: int, g: int, bits: int, D: int) -> np.ndarray:
    """kvq3_group8: 8 rotated values of group g of flat row `row` (codes (rows, bits*D/8))."""
    b = codes[row, bits * g: bits * g + bits].astype(np.uint32)
    w = b[0] | (b[1] << np.uint32(8))
    if bits == 3:
        w |= b[2] << np.uint32(16)
    s = F32(np.float16(scales[row, g // (BLOCK // 8)]))
    mask = np.uint32((1 << bits) - 1)
    return np.array([levels(bits)[(w >> np.uint32(bits * j)) & mask] * s for j in range(8)], F32)


def emu_load_tile(codes, scales, kt: int, hi: int, kvh: int, D: int, bits: int) -> np.ndarray:
    """kvq3_load_tile<D, bits>: a 32 x D tile of rows kt.. of KV head kvh, one group per step, zero past hi."""
    n_kv = codes.shape[1]
    fc, fs = codes.reshape(-1, codes.shape[-1]), scales.reshape(-1, scales.shape[-1])
    tile = np.zeros((32, D), F32)
    for i in range(32 * (D // 8)):
        r, g = divmod(i, D // 8)
        if kt + r < hi:
            tile[r, 8 * g: 8 * g + 8] = emu_group8(fc, fs, (kt + r) * n_kv + kvh, g, bits, D)
    return tile


def emu_flash_decode(q_rot, kc, ks, vc, vs, kv_len: int, scale: float, window: int, split_len: int,
                     n_splits: int):
    """kvq3_flash_decode over (KV head, split) + flash_merge: the merged rotated output (nh, D)."""
    nh, D = q_rot.shape
    n_kv = kc.shape[1]
    G = nh // n_kv
    po = np.zeros((n_splits, nh, D), F32)
    pm = np.full((n_splits, nh), NEG_BIG, F32)
    pl = np.zeros((n_splits, nh), F32)
    p = kv_len - 1
    for kvh in range(n_kv):
        for split in range(n_splits):
            lo, hi = split * split_len, min(kv_len, split * split_len + split_len)
            if window > 0:
                lo = max(lo, p - window + 1)
            for kt in range(lo, hi, 32):
                kt_tile = emu_load_tile(kc, ks, kt, hi, kvh, D, 3)
                vt_tile = emu_load_tile(vc, vs, kt, hi, kvh, D, 2)
                valid = kt + np.arange(32) < hi
                for g in range(G):
                    h = kvh * G + g
                    s = (kt_tile @ q_rot[h]).astype(F32) * F32(scale)
                    m_new = max(pm[split, h], F32(np.where(valid, s, NEG_BIG).max()))
                    alpha = np.exp(F32(pm[split, h] - m_new))
                    pv = np.where(valid, np.exp(s - m_new), F32(0.0)).astype(F32)
                    pl[split, h] = pl[split, h] * alpha + pv.sum(dtype=F32)
                    pm[split, h] = m_new
                    po[split, h] = po[split, h] * alpha + pv @ vt_tile
    m = pm.max(axis=0)
    wgt = np.exp(pm - m)  # (n_splits, nh)
    l_tot = np.sum(wgt * pl, axis=0)
    return np.einsum("sh,shd->hd", wgt, po) / np.where(l_tot > 0, l_tot, np.inf)[:, None]


def emu_prefill(q_rot, kc, ks, vc, vs, start: int, kv_len: int, scale: float, window: int) -> np.ndarray:
    """kvq3_prefill<D>: blocks of 32 queries x one head; key tiles of 32 from kv_lo (rounded down to a
    tile) to kv_hi; scores accumulated over head-dim chunks of 32 (K dequantized a group at a time);
    the V tile dequantized; masked running max / sum in fp32; output rows normalized (0 if l == 0)."""
    T, nh, D = q_rot.shape
    n_kv = kc.shape[1]
    out = np.full((T, nh, D), np.nan, F32)
    fkc, fks = kc.reshape(-1, kc.shape[-1]), ks.reshape(-1, ks.shape[-1])
    for h in range(nh):
        kvh = h // (nh // n_kv)
        for t0 in range(0, T, 32):
            t_last = min(t0 + 32, T) - 1
            kv_hi = min(kv_len, start + t_last + 1)
            kv_lo = (max(0, start + t0 - window + 1) & ~31) if window > 0 else 0
            qb = np.zeros((32, D), F32)
            n = min(32, T - t0)
            qb[:n] = q_rot[t0:t0 + n, h]
            o = np.zeros((32, D), F32)
            m_run = np.full(32, NEG_BIG, F32)
            l_run = np.zeros(32, F32)
            for kt in range(kv_lo, kv_hi, 32):
                s = np.zeros((32, 32), F32)
                for dc in range(0, D, 32):
                    kchunk = np.zeros((32, 32), F32)
                    for r in range(32):
                        for seg in range(4):
                            if kt + r < kv_len:
                                kchunk[r, 8 * seg: 8 * seg + 8] = emu_group8(
                                    fkc, fks, (kt + r) * n_kv + kvh, dc // 8 + seg, 3, D)
                    s += qb[:, dc:dc + 32] @ kchunk.T
                vt = emu_load_tile(vc, vs, kt, kv_len, kvh, D, 2)
                j = kt + np.arange(32)
                p = start + t0 + np.arange(32)
                valid = (j[None, :] < kv_len) & (j[None, :] <= p[:, None])
                if window > 0:
                    valid &= j[None, :] > p[:, None] - window
                s = s * F32(scale)
                mx = np.where(valid, s, NEG_BIG).max(axis=1)
                m_new = np.maximum(m_run, mx)
                alpha = np.exp(m_run - m_new).astype(F32)
                with np.errstate(over="ignore"):  # a fully masked row: exp(s - NEG_BIG), discarded
                    pv = np.where(valid, np.exp(s - m_new[:, None]), F32(0.0)).astype(F32)
                l_run = l_run * alpha + pv.sum(axis=1, dtype=F32)
                m_run = m_new
                o = o * alpha[:, None] + pv @ vt
            inv = np.where(l_run > 0, F32(1.0) / np.where(l_run > 0, l_run, F32(1.0)), F32(0.0))
            out[t0:t0 + n, h] = (o * inv[:, None])[:n]
    return out


def unrot(y: np.ndarray) -> np.ndarray:
    """kvq3_unrotate: fwht, then the signs."""
    return fwht(y) * sign_u32(y.shape[-1])


def rot(x: np.ndarray) -> np.ndarray:
    return fwht(np.asarray(x, F32) * sign_u32(x.shape[-1]))


# ------------------------------------------------------------------------------------------------


def test_sign_hash_matches_spec():
    for d in (64, 128, 256):
        np.testing.assert_array_equal(sign_u32(d), kq.rotation_signs(d).astype(F32))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fwht_butterflies_are_the_sylvester_rotation(d):
    x = np.random.default_rng(d).standard_normal((5, d)).astype(F32)
    np.testing.assert_allclose(rot(x), kq.rotate(x), atol=2e-6, rtol=0)
    np.testing.assert_allclose(unrot(kq.rotate(x).astype(F32)), x, atol=2e-6, rtol=0)


def _near_tie(x: np.ndarray, bits: int) -> np.ndarray:
    """Where the float64 spec's y/rms sits within 1e-5 of a threshold (both codes are right)."""
    y = kq.rotate(x)
    d = x.shape[-1]
    b = y.reshape(y.shape[:-1] + (d // BLOCK, BLOCK))
    rms = np.sqrt(np.mean(b * b, axis=-1, keepdims=True))
    t = b / np.where(rms > 0, rms, 1.0)
    lv = kq.CODEBOOKS[bits]
    gap = np.min(np.abs(t[..., None] - (lv[1:] + lv[:-1]) / 2.0), axis=-1)
    return (gap < 1e-5).reshape(y.shape)


def _codes_match(got_c, got_s, x, bits):
    ref_c, ref_s = kq.quantize(x, bits)
    gc, rc = kq.unpack(got_c, bits), kq.unpack(ref_c, bits)
    tie = _near_tie(x, bits)
    assert np.array_equal(gc[~tie], rc[~tie])
    if np.array_equal(gc, rc):
        np.testing.assert_array_equal(got_c, ref_c)  # the packed bytes too
    # fp16 scales: equal, or one fp16 step apart where the fp32 and fp64 quotients straddle a rounding
    # midpoint (or a block holds a near-tie code)
    a, b = got_s.astype(np.float64), ref_s.astype(np.float64)
    ulp = np.abs(np.spacing(ref_s.astype(np.float16)).astype(np.float64))
    tie_block = (gc != rc).reshape(gc.shape[:-1] + (-1, BLOCK)).any(axis=-1)  # its LS scale moves too
    assert np.all((np.abs(a - b) <= ulp) | tie_block)
    assert np.mean(a == b) > 0.99
    return gc


@pytest.mark.parametrize("bits", [3, 2])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sigma", [0.01, 1.0, 50.0])
def test_emulated_quantize_equals_spec(d, sigma, bits):
    rng = np.random.default_rng(d * 7 + int(sigma * 10) + bits)
    x = (sigma * rng.standard_normal((40, 2, d))).astype(F32)
    x[3, 1] = 0.0
    x[5, 0, 7] = 300.0 * sigma  # an outlier channel
    got_c, got_s = emu_quantize(x, bits)
    assert got_c.shape == (40, 2, bits * d // 8) and got_s.shape == (40, 2, d // BLOCK)
    gc = _codes_match(got_c, got_s, x, bits)
    # a zero row: zero scales, and every code the level just above 0 (t = 0 is no threshold's right side)
    assert np.all(got_s[3, 1] == 0) and np.all(gc[3, 1] == (1 << bits) // 2 - 1)


def test_emulated_quantize_subtracts_the_reference_row():
    """Keys: kvq3_quantize with ref == the spec's quantize of (x - ref) in float32 (Q3KVCache's keys)."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((30, 2, 128)) + 5.0 * rng.standard_normal((1, 2, 128))).astype(F32)
    ref = np.mean(x, axis=0, dtype=np.float64).astype(F32)
    got_c, got_s = emu_quantize(x, 3, ref)
    _codes_match(got_c, got_s, x - ref, 3)


def test_packing_layout_by_hand():
    # 3-bit: codes 0..7 in one group pack to 88 C6 FA; 2-bit: codes 0,1,2,3 to 0xE4 (docs/kv-cache.md)
    np.testing.assert_array_equal(kq.pack3(np.arange(8, dtype=np.uint8)), [0x88, 0xC6, 0xFA])
    np.testing.assert_array_equal(kq.pack2(np.array([0, 1, 2, 3, 3, 2, 1, 0], np.uint8)), [0xE4, 0x1B])
    for bits in (3, 2):
        codes = (np.arange(128) % (1 << bits)).astype(np.uint8).reshape(1, 128)
        packed = kq.pack(codes, bits)
        scales = np.ones((1, 2), np.float16)
        got = np.concatenate([emu_group8(packed, scales, 0, g, bits, 128) for g in range(16)])
        np.testing.assert_array_equal(got, levels(bits)[codes[0]])


@pytest.mark.parametrize("d", [64, 256])
def test_emulated_tile_loads_equal_spec_dequantization(d):
    rng = np.random.default_rng(d)
    n_kv, L = 3, 45
    x = (3 * rng.standard_normal((L, n_kv, d))).astype(F32)
    for bits in (3, 2):
        c, s = kq.quantize(x, bits)
        ref = kq.dequantize_rotated(c, s, bits)
        for kt, hi in ((0, 45), (32, 45), (32, 40)):
            tile = emu_load_tile(c, s, kt, hi, 1, d, bits)
            n = min(32, hi - kt)
            np.testing.assert_array_equal(tile[:n], ref[kt:kt + n, 1])
            assert np.all(tile[n:] == 0)


def _cache(rng, L, n_kv, d, k_sigma=1.0):
    k = (k_sigma * rng.standard_normal((L, n_kv, d))).astype(F32)
    v = rng.standard_normal((L, n_kv, d)).astype(F32)
    kc, ks = kq.quantize(k, kq.K_BITS)
    vc, vs = kq.quantize(v, kq.V_BITS)
    return kc, ks, vc, vs


@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("L,split_len", [(1, 32), (33, 32), (70, 64), (100, 32)])
def test_emulated_flash_decode_equals_spec(window, L, split_len):
    d, nh, n_kv = 64, 6, 2
    rng = np.random.default_rng(L + window + split_len)
    kc, ks, vc, vs = _cache(rng, L, n_kv, d, 2.0)
    q = rng.standard_normal((1, nh, d)).astype(F32)
    scale = 1.0 / np.sqrt(d)
    ref = kq.attention_rotated(q, kc, ks, vc, vs, scale=scale, q_positions=np.array([L - 1]), window=window)
    # a graph-sized split (span = a capacity above L) leaves empty splits: they must merge to nothing
    n_splits = -(-(L + 40) // split_len)
    out = unrot(emu_flash_decode(rot(q[0]), kc, ks, vc, vs, L, scale, window, split_len, n_splits))
    np.testing.assert_allclose(out, ref[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 7, 40])
@pytest.mark.parametrize("T,start,nh,n_kv", [(1, 0, 2, 1), (5, 30, 4, 2), (37, 0, 2, 2), (40, 33, 6, 2)])
def test_emulated_prefill_equals_spec(T, start, nh, n_kv, window):
    d = 64
    rng = np.random.default_rng(T * 100 + start + window + nh)
    L = start + T
    kc, ks, vc, vs = _cache(rng, L, n_kv, d, 2.0)
    q = rng.standard_normal((T, nh, d)).astype(F32)
    scale = 1.0 / np.sqrt(d)
    ref = kq.attention_rotated(q, kc, ks, vc, vs, scale=scale, q_positions=np.arange(start, L), window=window)
    out = unrot(emu_prefill(rot(q), kc, ks, vc, vs, start, L, scale, window))
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# multi-row appends at a nonzero start (the prefill path of CupyQ3KVCache / CupyBackend.attention)


def emu_quantize_append(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, start: int, bits: int,
                        ref: np.ndarray | None = None) -> None:
    """kvq3_quantize's grid over x (T, n_kv, D): block `row` = t * n_kv + head quantizes x's row `row`
    (minus ref[row % n_kv] when given) and writes cache row dst = start * n_kv + row of the flat
    (capacity * n_kv, ...) arrays."""
    T, n_kv, D = x.shape
    flat_x = np.asarray(x, F32).reshape(T * n_kv, D)
    flat_c = codes.reshape(-1, bits * D // 8)
    flat_s = scales.reshape(-1, D // BLOCK)
    for row in range(T * n_kv):
        dst = start * n_kv + row
        flat_c[dst], flat_s[dst] = emu_quantize(flat_x[row], bits, None if ref is None else ref[row % n_kv])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [0, 4])
def test_emulated_multi_row_appends_equal_numpy_cache(d, window):
    """Appends of 5, 7, 1 and 4 rows (starts 0, 5, 12, 13) into poisoned cache arrays, each followed by
    the attention flow of CupyBackend._attention_q3 (kvq3.attention: prefill for several rows, the
    split decode for one), keys centred on the first append's mean as CupyQ3KVCache does. Checked
    against the NumPy q3 cache and backend (the reference the GPU model test compares with) fed the
    same rows; the attention reads the centred codes without adding the reference back."""
    from minecart.engine.backends.numpy_backend import NumpyBackend

    rng = np.random.default_rng(d + window)
    n_kv, nh, cap = 2, 4, 20
    scale = 1.0 / np.sqrt(d)
    kc = np.full((cap, n_kv, 3 * d // 8), 0xAB, np.uint8)
    vc = np.full((cap, n_kv, 2 * d // 8), 0xAB, np.uint8)
    ks = np.full((cap, n_kv, d // BLOCK), 7.0, np.float16)
    vs = ks.copy()
    nb = NumpyBackend()
    ref_cache = nb.new_kv_cache(n_kv, d, d, cap, kv_type="q3")
    length = 0
    offset = (4.0 * rng.standard_normal((1, n_kv, d))).astype(F32)  # keys share a common component
    k_ref = None
    for T in (5, 7, 1, 4):
        start = length
        q = rng.standard_normal((T, nh, d)).astype(F32)
        k = (2.0 * rng.standard_normal((T, n_kv, d)) + offset).astype(F32)
        v = rng.standard_normal((T, n_kv, d)).astype(F32)
        if k_ref is None:
            k_ref = np.mean(k, axis=0, dtype=np.float64).astype(F32)
        emu_quantize_append(k, kc, ks, start, 3, k_ref)
        emu_quantize_append(v, vc, vs, start, 2)
        length = start + T
        assert np.all(kc[length:] == 0xAB) and np.all(ks[length:] == 7.0)  # rows past the append untouched
        assert np.all(vc[length:] == 0xAB) and np.all(vs[length:] == 7.0)
        if T == 1:
            got = unrot(emu_flash_decode(rot(q[0]), kc, ks, vc, vs, length, scale, window, 32, 1))[None]
        else:
            got = unrot(emu_prefill(rot(q), kc, ks, vc, vs, start, length, scale, window))
        ref = nb.attention(q, k, v, ref_cache, scale=scale, window=window)
        # the new rows' codes: the spec's, except a value within 1e-5 of a decision threshold
        np.testing.assert_array_equal(ref_cache.k_ref, k_ref)
        for arr, ref_arr, x, bits in ((kc, ref_cache.k_codes, k - k_ref, 3), (vc, ref_cache.v_codes, v, 2)):
            differ = kq.unpack(arr[start:length], bits) != kq.unpack(ref_arr[start:length], bits)
            assert not np.any(differ & ~_near_tie(x, bits))
        np.testing.assert_allclose(got, ref, atol=3e-5 * np.abs(ref).max(), rtol=0)
