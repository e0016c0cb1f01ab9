"""NumPy emulation of the fp16 HFMA2 matmul arithmetic (kernels/hfma2.cu), run on the CPU: the byte ->
fp16 conversion trick, quantize_h16's per-block scaling, f16x2 partials summed in the kernels' order
(fused multiply-add, one fp16 rounding each) and scaled into fp32, and the overflow bound the comments
claim. The GPU tests (tests/gpu/test_hfma2.py) check the kernels themselves."""

from __future__ import annotations

import numpy as np
import pytest


def byte_to_half(q: np.ndarray) -> np.ndarray:
    """hraw_to_h2's conversion: (q ^ 0x80) under the exponent of 1024, minus 1152 (0x6480)."""
    u = (q.astype(np.int16) & 0xFF) ^ 0x80
    bits = (0x6400 | u).astype(np.uint16)
    return bits.view(np.float16) - np.array([0x6480], np.uint16).view(np.float16)[0]


def test_byte_to_half_is_exact():
    q = np.arange(-128, 128).astype(np.int8)
    assert np.array_equal(byte_to_half(q).astype(np.int32), q.astype(np.int32))
    assert np.array([0x6480], np.uint16).view(np.float16)[0] == 1152
    assert np.array([0x6400], np.uint16).view(np.float16)[0] == 1024


def quantize_h16(x: np.ndarray):
    T, K = x.shape
    xb = x.reshape(T, K // 32, 32).astype(np.float32)
    amax = np.abs(xb).max(axis=2)
    ok = amax > 1e-30
    inv = np.where(ok, np.float32(1) / np.where(ok, amax, 1), 0).astype(np.float32)
    xh = np.clip(xb * inv[:, :, None], -1, 1).astype(np.float16)
    return xh, np.where(ok, amax, 0).astype(np.float32), xb.sum(axis=2, dtype=np.float32)


def f16x2_partials(wh: np.ndarray, xh: np.ndarray, pairs: tuple[int, int]) -> np.ndarray:
    """Per (token, row, block): the two fp16 lanes summed over k-pairs pairs[0]..pairs[1]-1 in order,
    each step one fused multiply-add rounded once to fp16. wh (R, nb, 32), xh (T, nb, 32)."""
    T, R, nb = xh.shape[0], wh.shape[0], wh.shape[1]
    acc = np.zeros((T, R, nb, 2), np.float16)
    with np.errstate(over="ignore", invalid="ignore"):
        for k in range(*pairs):
            prod = xh[:, None, :, 2 * k:2 * k + 2].astype(np.float64) * wh[None, :, :, 2 * k:2 * k + 2]
            acc = (acc.astype(np.float64) + prod).astype(np.float16)
    return acc


def hfma2_matmul(x, q, dlo, dhi, m=None, split=False, f16_rows=False):
    """The kernels' arithmetic. q (R, K): fp16-exact weight integers (or F16 values with f16_rows);
    dlo/dhi (R, nb): scales of values 0..15 / 16..31; m (R, nb): offset per unit of the block sum.
    GEMM order (split=False): one partial over 16 pairs; GEMV / Q6_K order (split=True): two of 8."""
    T, K = x.shape
    R, nb = q.shape[0], K // 32
    xh, xd, xs = quantize_h16(x)
    wh = q.reshape(R, nb, 32).astype(np.float16)
    parts = [((0, 8), dlo), ((8, 16), dhi)] if split else [((0, 16), dhi)]
    y = np.zeros((T, R), np.float64)
    for pairs, d in parts:
        p = f16x2_partials(wh, xh, pairs).astype(np.float32).sum(-1)
        if f16_rows:  # a non-finite partial is recomputed with fp32 products
            vals = slice(2 * pairs[0], 2 * pairs[1])
            exact = np.einsum("tbk,rbk->trb", xh[:, :, vals].astype(np.float64), wh[:, :, vals].astype(np.float64))
            p = np.where(np.isfinite(p), p, exact)
        assert np.all(np.isfinite(p))
        y += (p * xd[:, None, :] * d[None]).sum(-1)
    if m is not None:
        y += (m[None] * xs[:, None, :]).sum(-1)
    return y


def rel(y, ref):
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("xscale", [1.0, 1e30, 1e-25])
def test_q8_0_like_accuracy_any_activation_range(split, xscale):
    rng = np.random.default_rng(1)
    T, R, K = 3, 17, 512
    q = rng.integers(-127, 128, (R, K)).astype(np.int8)
    d = (rng.random((R, K // 32)) * 0.01 + 0.001).astype(np.float32)
    x = (rng.standard_normal((T, K)) * xscale).astype(np.float32)
    x[:, 32:64] *= 1000  # blocks of very different ranges
    ref = x.astype(np.float64) @ (q.astype(np.float64) * np.repeat(d, 32, axis=1)).T
    y = hfma2_matmul(x, byte_to_half(q), d, d, split=split)
    assert rel(y, ref) < 3e-3, rel(y, ref)


def test_partials_stay_below_the_bound():
    """Worst case: every q = -128 or 127 and every |x'| = 1 with matching signs: 16 * 128 = 2048."""
    q = np.full((1, 32), -128, np.int8)
    x = -np.ones((1, 32), np.float32) * 3e38
    with np.errstate(over="ignore"):  # the fp32 block sum overflows; only xd and xh matter here
        xh, xd, _ = quantize_h16(x)
    p = f16x2_partials(byte_to_half(q).reshape(1, 1, 32), xh, (0, 16))
    assert np.all(np.isfinite(p)) and float(np.abs(p).max()) == 2048.0
    assert xd[0, 0] == np.float32(3e38)


def test_offset_formats_q4():
    """Q4_0 / Q4_K form: unsigned 0..15 quants, value = d * q + m, the m term through the block sum."""
    rng = np.random.default_rng(2)
    T, R, K = 2, 9, 256
    q = rng.integers(0, 16, (R, K)).astype(np.int8)
    d = (rng.random((R, K // 32)) * 0.01).astype(np.float32)
    m = (-rng.random((R, K // 32)) * 0.05).astype(np.float32)
    x = rng.standard_normal((T, K)).astype(np.float32)
    dense = q.astype(np.float64) * np.repeat(d, 32, axis=1) + np.repeat(m, 32, axis=1)
    y = hfma2_matmul(x, byte_to_half(q), d, d, m=m)
    assert rel(y, x.astype(np.float64) @ dense.T) < 3e-3


def test_q6_k_two_scales():
    rng = np.random.default_rng(3)
    T, R, K = 2, 5, 256
    q = rng.integers(-32, 32, (R, K)).astype(np.int8)
    dlo = rng.standard_normal((R, K // 32)).astype(np.float32) * 0.01
    dhi = rng.standard_normal((R, K // 32)).astype(np.float32) * 0.01
    x = rng.standard_normal((T, K)).astype(np.float32)
    scale = np.stack([dlo, dhi], axis=2).repeat(16, axis=2).reshape(R, K)
    y = hfma2_matmul(x, byte_to_half(q), dlo, dhi, split=True)
    assert rel(y, x.astype(np.float64) @ (q * scale.astype(np.float64)).T) < 3e-3


def test_f16_rows_overflow_fallback():
    rng = np.random.default_rng(4)
    T, R, K = 2, 4, 64
    w = (rng.standard_normal((R, K)) * 0.05).astype(np.float16)
    w[0, :32] = 30000
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[:, :32] = np.abs(x[:, :32]) + 0.5
    xh, _, _ = quantize_h16(x)
    assert not np.all(np.isfinite(f16x2_partials(w.reshape(R, 2, 32), xh, (0, 16))))
    ones = np.ones((R, K // 32), np.float32)
    y = hfma2_matmul(x, w, ones, ones, f16_rows=True)
    assert rel(y, x.astype(np.float64) @ w.astype(np.float64).T) < 3e-3
