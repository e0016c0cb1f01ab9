"""A NumPy emulation of kernels/kvq3.cu (same fp32 arithmetic, butterfly order, warp reductions, bit
packing and tile loop) checked against engine/kvquant.py, the specification of the q3 KV format.

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
BLOCK = 32
LEVELS = kq.LEVELS.astype(F32)
THRESH = kq.THRESHOLDS.astype(F32)


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


def emu_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """kvq3_quantize over rows x (..., D): (packed codes uint8 (..., 3D/8), fp16 scales (..., D/32))."""
    x = np.asarray(x, F32)
    D = x.shape[-1]
    y = fwht(x * sign_u32(D))
    blocks = y.reshape(y.shape[:-1] + (D // BLOCK, BLOCK))  # warp w = scale block w
    rms = np.sqrt(warp_sum(blocks * blocks) * F32(1.0 / BLOCK))
    t = blocks / np.where(rms > 0, rms, F32(1.0))
    code = np.zeros(blocks.shape, np.int32)
    for thr in THRESH:
        code += (t > thr).astype(np.int32)
    c = LEVELS[code]
    num, den = warp_sum(blocks * c)[..., 0], warp_sum(c * c)[..., 0]
    scales = np.minimum(num / den, F32(65504.0)).astype(np.float16)  # cvt.rn.f16.f32
    cs = code.reshape(y.shape).astype(np.uint32)
    groups = cs.reshape(cs.shape[:-1] + (D // 8, 8))  # thread tid < D/8 packs codes 8tid..8tid+7
    w = np.zeros(groups.shape[:-1], np.uint32)
    for j in range(8):
        w |= groups[..., j] << np.uint32(3 * j)
    packed = np.stack([w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF], axis=-1).astype(np.uint8)
    return packed.reshape(cs.shape[:-1] + (3 * D // 8,)), scales


def emu_code(packed_row: np.ndarray, c: int) -> int:
    """kvq3_code: code c of a packed row."""
    g = packed_row[3 * (c >> 3): 3 * (c >> 3) + 3].astype(np.uint32)
    w = g[0] | (g[1] << 8) | (g[2] << 16)
    return int((w >> (3 * (c & 7))) & 7)


def emu_dequant_rotated(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """LEVELS[kvq3_code(row, c)] * h2f(scale[c / 32]) for every row (..., D), float32."""
    rows = packed.reshape(-1, packed.shape[-1])
    s = np.asarray(scales, np.float16).astype(F32).reshape(-1, scales.shape[-1])
    D = 8 * packed.shape[-1] // 3
    out = np.empty((rows.shape[0], D), F32)
    for r in range(rows.shape[0]):
        for c in range(D):
            out[r, c] = LEVELS[emu_code(rows[r], c)] * s[r, c // BLOCK]
    return out.reshape(packed.shape[:-1] + (D,))


def emu_dequant(packed, scales, kv_len: int, rows: int, n_kv: int) -> np.ndarray:
    """kvq3_dequant over a cache (rows_cache, n_kv, 3D/8): grid rows * n_kv blocks, those at or past
    kv_len * n_kv leave; out (rows, n_kv, D) poisoned with NaN where no block writes."""
    D = 8 * packed.shape[-1] // 3
    out = np.full((rows * n_kv, D), np.nan, F32)
    flat_p = packed.reshape(-1, packed.shape[-1])
    flat_s = scales.reshape(-1, scales.shape[-1])
    for row in range(rows * n_kv):
        if row >= kv_len * n_kv:
            continue
        s = emu_dequant_rotated(flat_p[row], flat_s[row])
        out[row] = fwht(s) * sign_u32(D)
    return out.reshape(rows, n_kv, D)


def emu_decode(q_rot, k_packed, k_scales, v_packed, v_scales, kv_len: int, scale: float, window: int):
    """kvq3_decode: per query head, 32-row tiles from lo, running max / sum in fp32 on 'warp 0'."""
    nh, D = q_rot.shape
    n_kv = k_packed.shape[1]
    kd = emu_dequant_rotated(k_packed, k_scales)  # (L, n_kv, D)
    vd = emu_dequant_rotated(v_packed, v_scales)
    out = np.empty((nh, D), F32)
    p = kv_len - 1
    lo = max(0, p - window + 1) if window > 0 else 0
    for h in range(nh):
        kvh = h // (nh // n_kv)
        o = np.zeros(D, F32)
        m_run, l_run = F32(-1.0e30), F32(0.0)
        for kt in range(lo, kv_len, 32):
            rows = np.arange(kt, min(kt + 32, kv_len))
            s = np.array([np.sum(q_rot[h] * kd[r, kvh], dtype=F32) for r in rows], F32) * F32(scale)
            m_new = max(m_run, F32(s.max()))
            alpha = np.exp(F32(m_run - m_new), dtype=F32)
            pv = np.exp(s - m_new, dtype=F32)
            l_run = F32(l_run * alpha + pv.sum(dtype=F32))
            m_run = m_new
            o = o * alpha + pv @ vd[rows, kvh]
        out[h] = o * (F32(1.0) / l_run)
    return out


# ------------------------------------------------------------------------------------------------


def test_sign_hash_matches_spec():
    for d in (64, 128, 256):
        np.testing.assert_array_equal(sign_u32(d), kq.rotation_signs(d).astype(F32))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fwht_butterflies_are_the_sylvester_rotation(d):
    x = np.random.default_rng(d).standard_normal((5, d)).astype(F32)
    np.testing.assert_allclose(fwht(x * sign_u32(d)), kq.rotate(x), atol=2e-6, rtol=0)
    np.testing.assert_allclose(fwht(kq.rotate(x).astype(F32)) * sign_u32(d), x, atol=2e-6, rtol=0)


def _near_tie(x: np.ndarray) -> np.ndarray:
    """Where the float64 spec's y/scale sits within 1e-5 of a threshold (both codes are right)."""
    y = kq.rotate(x)
    d = x.shape[-1]
    b = y.reshape(y.shape[:-1] + (d // BLOCK, BLOCK))
    rms = np.sqrt(np.mean(b * b, axis=-1, keepdims=True))
    t = b / np.where(rms > 0, rms, 1.0)
    gap = np.min(np.abs(t[..., None] - kq.THRESHOLDS), axis=-1)
    return (gap < 1e-5).reshape(y.shape)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sigma", [0.01, 1.0, 50.0])
def test_emulated_quantize_equals_spec(d, sigma):
    rng = np.random.default_rng(d * 7 + int(sigma * 10))
    x = (sigma * rng.standard_normal((40, 2, d))).astype(F32)
    x[3, 1] = 0.0
    x[5, 0, 7] = 300.0 * sigma  # an outlier channel
    got_c, got_s = emu_quantize(x)
    ref_c, ref_s = kq.quantize(x)
    gc, rc = kq.unpack3(got_c), kq.unpack3(ref_c)
    tie = _near_tie(x)
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
    assert np.all(got_s[3, 1] == 0) and np.all(gc[3, 1] == 3)


def test_packing_layout_by_hand():
    # codes 0..7 in one group pack to 88 C6 FA (docs/kv-cache.md)
    codes = np.arange(8, dtype=np.uint32)
    w = np.uint32(0)
    for j in range(8):
        w |= codes[j] << np.uint32(3 * j)
    assert [int(w) & 0xFF, (int(w) >> 8) & 0xFF, (int(w) >> 16) & 0xFF] == [0x88, 0xC6, 0xFA]
    packed = kq.pack3(np.arange(64, dtype=np.uint8) % 8)
    assert [emu_code(packed, c) for c in range(64)] == [c % 8 for c in range(64)]


@pytest.mark.parametrize("d", [64, 128])
def test_emulated_dequant_equals_spec(d):
    rng = np.random.default_rng(d)
    n_kv, cap, kv_len = 2, 9, 6
    packed, scales = kq.quantize(rng.standard_normal((cap, n_kv, d)).astype(F32) * 3)
    out = emu_dequant(packed, scales, kv_len, cap, n_kv)
    ref = kq.dequantize(packed[:kv_len], scales[:kv_len])
    np.testing.assert_allclose(out[:kv_len], ref, atol=1e-6 * np.abs(ref).max(), rtol=0)
    assert np.all(np.isnan(out[kv_len:]))  # blocks past the length write nothing


@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("L", [1, 33, 70])
def test_emulated_decode_equals_spec(window, L):
    d, nh, n_kv = 64, 4, 2
    rng = np.random.default_rng(L + window)
    kc, ks = kq.quantize(rng.standard_normal((L, n_kv, d)).astype(F32))
    vc, vs = kq.quantize(rng.standard_normal((L, n_kv, d)).astype(F32))
    q = rng.standard_normal((1, nh, d)).astype(F32)
    scale = 1.0 / np.sqrt(d)
    ref = kq.attention_rotated(q, kc, ks, vc, vs, scale=scale, q_positions=np.array([L - 1]), window=window)
    q_rot = fwht(q[0] * sign_u32(d))
    out = fwht(emu_decode(q_rot, kc, ks, vc, vs, L, scale, window)) * sign_u32(d)
    np.testing.assert_allclose(out, ref[0], atol=1e-5, rtol=1e-5)


def emu_load_tile(packed, scales, kt: int, hi: int, kvh: int, D: int) -> np.ndarray:
    """kvq3_load_tile: a 32 x D tile, one 3-byte group (8 codes, one scale) per step, zero past hi."""
    tile = np.zeros((32, D), F32)
    for i in range(32 * (D // 8)):
        r, g = divmod(i, D // 8)
        if kt + r < hi:
            b = packed[kt + r, kvh, 3 * g: 3 * g + 3].astype(np.uint32)
            w = b[0] | (b[1] << 8) | (b[2] << 16)
            s = F32(np.float16(scales[kt + r, kvh, (8 * g) // BLOCK]))
            for j in range(8):
                tile[r, 8 * g + j] = LEVELS[(w >> (3 * j)) & 7] * s
    return tile


def emu_flash_decode(q_rot, kc, ks, vc, vs, kv_len: int, scale: float, window: int, split_len: int,
                     n_splits: int):
    """kvq3_flash_decode over (KV head, split) + flash_merge: the merged rotated output (nh, D)."""
    nh, D = q_rot.shape
    n_kv = kc.shape[1]
    G = nh // n_kv
    po = np.zeros((n_splits, nh, D), F32)
    pm = np.full((n_splits, nh), F32(-1.0e30), F32)
    pl = np.zeros((n_splits, nh), F32)
    p = kv_len - 1
    for kvh in range(n_kv):
        for split in range(n_splits):
            lo, hi = split * split_len, min(kv_len, split * split_len + split_len)
            if window > 0:
                lo = max(lo, p - window + 1)
            for kt in range(lo, hi, 32):
                kt_tile = emu_load_tile(kc, ks, kt, hi, kvh, D)
                vt_tile = emu_load_tile(vc, vs, kt, hi, kvh, D)
                valid = kt + np.arange(32) < hi
                for g in range(G):
                    h = kvh * G + g
                    s = (kt_tile @ q_rot[h]).astype(F32) * F32(scale)
                    m_new = max(pm[split, h], F32(np.where(valid, s, F32(-1.0e30)).max()))
                    alpha = np.exp(F32(pm[split, h] - m_new))
                    pv = np.where(valid, np.exp(s - m_new), F32(0.0)).astype(F32)
                    pl[split, h] = pl[split, h] * alpha + pv.sum(dtype=F32)
                    pm[split, h] = m_new
                    po[split, h] = po[split, h] * alpha + pv @ vt_tile
    m = pm.max(axis=0)
    wgt = np.exp(pm - m)  # (n_splits, nh)
    l_tot = np.sum(wgt * pl, axis=0)
    return np.einsum("sh,shd->hd", wgt, po) / np.where(l_tot > 0, l_tot, np.inf)[:, None]


@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("L,split_len", [(1, 32), (33, 32), (70, 64), (100, 32)])
def test_emulated_flash_decode_equals_spec(window, L, split_len):
    d, nh, n_kv = 64, 6, 2
    rng = np.random.default_rng(L + window + split_len)
    kc, ks = kq.quantize(rng.standard_normal((L, n_kv, d)).astype(F32))
    vc, vs = kq.quantize(rng.standard_normal((L, n_kv, d)).astype(F32))
    q = rng.standard_normal((1, nh, d)).astype(F32)
    scale = 1.0 / np.sqrt(d)
    ref = kq.attention_rotated(q, kc, ks, vc, vs, scale=scale, q_positions=np.array([L - 1]), window=window)
    # a graph-sized split (span = a capacity above L) leaves empty splits: they must merge to nothing
    n_splits = -(-(L + 40) // split_len)
    q_rot = fwht(q[0] * sign_u32(d))
    out = fwht(emu_flash_decode(q_rot, kc, ks, vc, vs, L, scale, window, split_len, n_splits)) * sign_u32(d)
    np.testing.assert_allclose(out, ref[0], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# multi-row appends at a nonzero start (the prefill path of CupyQ3KVCache / CupyBackend.attention)


def emu_quantize_append(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, start: int) -> None:
    """kvq3_quantize's grid over x (T, n_kv, D): block `row` = t * n_kv + head quantizes x's row `row`
    and writes cache row dst = start * n_kv + row of the flat (capacity * n_kv, ...) arrays."""
    T, n_kv, D = x.shape
    flat_x = np.asarray(x, F32).reshape(T * n_kv, D)
    flat_c = codes.reshape(-1, 3 * D // 8)
    flat_s = scales.reshape(-1, D // BLOCK)
    for row in range(T * n_kv):
        dst = start * n_kv + row
        flat_c[dst], flat_s[dst] = emu_quantize(flat_x[row])


def _attention64(q, keys, values, start: int, scale: float, window: int) -> np.ndarray:
    """Causal GQA attention in float64 of q (T, nh, D) at positions start.. over (L, n_kv, D)."""
    T, nh, _ = q.shape
    L, n_kv, _ = keys.shape
    k_pos, q_pos = np.arange(L), np.arange(start, start + T)
    visible = k_pos[None, :] <= q_pos[:, None]
    if window > 0:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    out = np.empty((T, nh, values.shape[2]))
    for h in range(nh):
        kv = h // (nh // n_kv)
        s = np.where(visible, (q[:, h].astype(np.float64) @ keys[:, kv].astype(np.float64).T) * scale, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ values[:, kv].astype(np.float64)
    return out


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [0, 4])
def test_emulated_multi_row_appends_equal_numpy_cache(d, window):
    """Appends of 5, 7, 1 and 4 rows (starts 0, 5, 12, 13) into poisoned cache arrays, each followed by
    the attention flow of CupyBackend._attention_q3: dequantize rows [0, length) of K and of V into two
    separate fp32 scratch arrays (kvq3_dequant) and attend from `start`. Checked against the NumPy
    Q3KVCache (the reference the GPU model test compares with) fed the same rows, row by row."""
    from minecart.engine.backends.numpy_backend import NumpyBackend

    rng = np.random.default_rng(d + window)
    n_kv, nh, cap = 2, 4, 20
    scale = 1.0 / np.sqrt(d)
    kc = np.full((cap, n_kv, 3 * d // 8), 0xAB, np.uint8)
    ks = np.full((cap, n_kv, d // BLOCK), 7.0, np.float16)
    vc, vs = kc.copy(), ks.copy()
    k_scratch = np.full((cap, n_kv, d), np.nan, F32)
    v_scratch = np.full((cap, n_kv, d), np.nan, F32)
    nb = NumpyBackend()
    ref_cache = nb.new_kv_cache(n_kv, d, d, cap, kv_type="q3")
    length = 0
    for T in (5, 7, 1, 4):
        start = length
        q = rng.standard_normal((T, nh, d)).astype(F32)
        k = (2.0 * rng.standard_normal((T, n_kv, d))).astype(F32)
        v = rng.standard_normal((T, n_kv, d)).astype(F32)
        emu_quantize_append(k, kc, ks, start)
        emu_quantize_append(v, vc, vs, start)
        length = start + T
        assert np.all(kc[length:] == 0xAB) and np.all(ks[length:] == 7.0)  # rows past the append untouched
        k_scratch[:] = emu_dequant(kc, ks, length, cap, n_kv)
        v_scratch[:] = emu_dequant(vc, vs, length, cap, n_kv)
        got = _attention64(q, k_scratch[:length], v_scratch[:length], start, scale, window)
        ref = nb.attention(q, k, v, ref_cache, scale=scale, window=window)
        # the new rows' codes: the spec's, except a value within 1e-5 of a decision threshold
        for arr, ref_arr, x in ((kc, ref_cache.k_codes, k), (vc, ref_cache.v_codes, v)):
            differ = kq.unpack3(arr[start:length]) != kq.unpack3(ref_arr[start:length])
            assert not np.any(differ & ~_near_tie(x))
        ref_k, ref_v = ref_cache.read(length)
        tol_k, tol_v = 1e-5 * np.abs(ref_k).max(), 1e-5 * np.abs(ref_v).max()
        np.testing.assert_allclose(k_scratch[:length], ref_k, atol=tol_k, rtol=0)
        np.testing.assert_allclose(v_scratch[:length], ref_v, atol=tol_v, rtol=0)
        assert np.all(np.isnan(k_scratch[length:]))
        np.testing.assert_allclose(got, ref, atol=2e-5 * np.abs(ref).max(), rtol=0)
