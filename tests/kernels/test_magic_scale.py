"""common.cuh `magic_scale` / `magic_off`, the DP4A tiles' block scaling, emulated on the CPU.

A tile's int32 block sum s sits in an accumulator that started at the bits of the float 1.5 * 2^23, so
read as a float it is 1.5 * 2^23 + s. The kernels scale it with one FMA, (1.5 * 2^23 + s) * dw + off
with off = -1.5 * 2^23 * dw rounded to fp32. That equals s * dw rounded once only if off is exact, which
holds when dw has at most 21 significant bits. These tests check that claim for every block scale a
DP4A format can produce (an fp16 value times an integer in [-128, 127], as load_wblock / kq_load
compute it), and the FMA itself in float64, where (1.5 * 2^23 + s) * dw needs at most 45 bits and so
is exact before the one rounding to fp32."""

from __future__ import annotations

import numpy as np

MAGIC = np.float32(12582912.0)  # 1.5 * 2^23, the float whose bits are MAGIC_I = 0x4B400000
BLOCK_MAX = 32 * 127 * 127  # the largest |s| of a 32-value block of int8 products


def _fp16_values() -> np.ndarray:
    """Every finite fp16 value, as fp32."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    return h[np.isfinite(h)].astype(np.float32)


def _scales(k: int) -> np.ndarray:
    """dw = fp16 d times the integer k, rounded to fp32 as the kernels multiply them."""
    return (_fp16_values() * np.float32(k)).astype(np.float32)


def test_the_magic_constant_is_the_accumulators_start():
    assert np.array([0x4B400000], dtype=np.uint32).view(np.float32)[0] == MAGIC
    # every block sum keeps 1.5 * 2^23 + s inside [2^23, 2^24), where fp32 holds each integer
    assert 2.0**23 <= float(MAGIC) - BLOCK_MAX and float(MAGIC) + BLOCK_MAX < 2.0**24


def test_magic_off_is_exact_for_every_block_scale():
    for k in range(-128, 128):  # Q4_K / Q5_K 0..63, Q6_K -128..127, IQ4_XS -32..31, the others 1
        dw = _scales(k)
        off32 = (-MAGIC * dw).astype(np.float32)  # magic_off in fp32
        exact = -float(MAGIC) * dw.astype(np.float64)  # 24 + 24 bits: exact in float64
        bad = off32.astype(np.float64) != exact
        assert not bad.any(), f"k={k}: {dw[bad][:4]} lose bits in -1.5 * 2^23 * dw"


def _magic_scale(s: np.ndarray, dw: np.ndarray) -> np.ndarray:
    """fmaf(float(MAGIC_I + s), dw, magic_off(dw)) in float64 (exact), then the FMA's one rounding."""
    a = (MAGIC.astype(np.float64) + s).astype(np.float32)  # the accumulator's bits read as a float
    assert (a.astype(np.float64) == float(MAGIC) + s).all()
    off = (-MAGIC * dw).astype(np.float32)
    return (a.astype(np.float64) * dw.astype(np.float64) + off.astype(np.float64)).astype(np.float32)


def test_magic_scale_is_the_block_sum_times_its_scale_rounded_once():
    rng = np.random.default_rng()  # fresh sums and scales each run
    for k in (1, 63, -32, 127, -128, 17):
        dw = rng.choice(_scales(k), 200_000)
        s = rng.integers(-BLOCK_MAX, BLOCK_MAX + 1, dw.size).astype(np.float64)
        s[:4] = (-BLOCK_MAX, BLOCK_MAX, 0, 1)
        want = (s * dw.astype(np.float64)).astype(np.float32)  # s * dw, exact in float64, rounded once
        np.testing.assert_array_equal(_magic_scale(s, dw), want)


def test_a_scale_with_more_bits_would_not_be_exact():
    """The check above can fail: a full 24-bit scale loses bits in magic_off, and the FMA is then off by
    up to 0.75 units of the scale."""
    dw = np.array([1.0 + 2.0**-23], dtype=np.float32)  # 24 significant bits
    off32 = (-MAGIC * dw).astype(np.float32)
    assert off32.astype(np.float64)[0] != -float(MAGIC) * float(dw[0])
    s = np.array([5.0])
    assert _magic_scale(s, dw)[0] != np.float32(5.0 * float(dw[0]))
