"""CPU emulation of kernels/kv_q8_0.cu and kv_f16.cu's loads (kv_load4 / kv_load1): element i of the
(capacity, n_kv, D) value layout read from the GPU cache bytes must be the NumPy twin's dequantized
value, for every i the attention kernels ask for (multiples of 4 for kv_load4, any for kv_load1).
Also q8_0's rounding at the fp32 trap 0.49999997 (roundf gives 0, a + 0.5 would give 1)."""

from __future__ import annotations

import numpy as np
from minecart.engine import kvquant as kq


def _gpu_bytes_q8(x: np.ndarray) -> np.ndarray:
    T, n_kv, d = x.shape
    q, s = kq.quantize_q8_0(x)
    blocks = np.concatenate([s.reshape(T, n_kv, d // 32, 1).view(np.uint8),
                             q.reshape(T, n_kv, d // 32, 32).view(np.uint8)], axis=-1)
    return blocks.reshape(-1)


def _load1_q8(p: np.ndarray, i: int) -> np.float32:
    b = (i >> 5) * 34  # kv_q8_0.cu: block i / 32, 34 bytes each
    d = p[b:b + 2].view(np.float16)[0].astype(np.float32)
    return d * np.float32(p[b + 2 + (i & 31)].astype(np.int8))


def _load4_q8(p: np.ndarray, i: int) -> np.ndarray:
    assert i % 4 == 0
    b = (i >> 5) * 34
    d = p[b:b + 2].view(np.float16)[0].astype(np.float32)
    off = b + 2 + (i & 31)
    assert off % 2 == 0  # two aligned 16-bit loads (ld_u16x2)
    return d * p[off:off + 4].view(np.int8).astype(np.float32)


def test_q8_0_loads_read_the_twin_values():
    rng = np.random.default_rng(0)
    for d in (64, 128, 256):
        x = rng.standard_normal((5, 3, d)).astype(np.float32)
        p = _gpu_bytes_q8(x)
        want = kq.dequantize_q8_0(*kq.quantize_q8_0(x)).reshape(-1)
        n = want.size
        assert p.size == n // 32 * 34
        for i in range(0, n, 4):
            np.testing.assert_array_equal(_load4_q8(p, i), want[i:i + 4])
        for i in rng.integers(0, n, 200):
            assert _load1_q8(p, int(i)) == want[i]


def test_f16_loads_read_the_twin_values():
    x = np.random.default_rng(1).standard_normal((4, 2, 64)).astype(np.float32)
    p = x.astype(np.float16).reshape(-1)  # kv_f16.cu: u16 values, element i at p[i]
    want = x.astype(np.float16).astype(np.float32).reshape(-1)
    for i in range(0, p.size, 4):
        w = p[i:i + 4].view(np.uint16).view(np.uint32)  # the uint2 load: two words, low half first
        lo, hi = (w & 0xFFFF).astype(np.uint16), (w >> 16).astype(np.uint16)
        got = np.stack([lo, hi], axis=-1).reshape(-1).view(np.float16).astype(np.float32)
        np.testing.assert_array_equal(got, want[i:i + 4])


def test_q8_0_rounds_like_roundf():
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 127.0
    x[0, 1] = np.float32(0.49999997)  # d = 1: x / d = 0.49999997 -> 0 (roundf), not 1
    x[0, 2] = 2.5  # a tie -> 3 (away from zero)
    x[0, 3] = -2.5
    q, s = kq.quantize_q8_0(x)
    assert s[0, 0] == 1.0 and list(q[0, :4]) == [127, 0, 3, -3]
