"""CPU emulation of the Q32-format weight loads (kernels/common.cuh `q32_block`: Q4_1, Q5_0, Q5_1, IQ4_NL,
IQ4_XS): the device layout kernels/ops.py uploads, the bit tricks (byte permutes of the IQ4 level table,
the 5th-bit spread, Q5_0's signed bytes) and the value each block decodes to, checked bit-exactly
against engine/quants.py, which is itself bit-exact with gguf.quants. NumPy mirrors of the CUDA
functions, operation for operation, so a wrong shift or selector fails here before any GPU runs.
"""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import quants as Q

U32 = np.uint32
# common.cuh IQ4_W0..IQ4_W3: the 16 levels as signed bytes, four per little-endian word
IQ4_W = (U32(0xBFAD9881), U32(0xF6EADDCF), U32(0x26190D01), U32(0x71594535))


def byte_perm(x, y, s):
    """PTX prmt (default mode), the instruction __byte_perm compiles to: byte n of the result is byte
    (s >> 4n) & 7 of the 8-byte value {y, x}; when bit 3 of that selector nibble is set, the byte's sign
    bit is replicated instead."""
    x, y, s = (np.asarray(a, dtype=U32) for a in (x, y, s))
    src = (y.astype(np.uint64) << np.uint64(32)) | x.astype(np.uint64)
    out = np.zeros(np.broadcast(x, y, s).shape, dtype=U32)
    for n in range(4):
        sel = (s >> U32(4 * n)) & U32(15)
        byte = ((src >> (8 * (sel & U32(7))).astype(np.uint64)) & np.uint64(0xFF)).astype(U32)
        byte = np.where(sel & U32(8), np.where(byte & U32(0x80), U32(0xFF), U32(0)), byte)
        out |= byte << U32(8 * n)
    return out


def iq4_lookup4(s):
    s = np.asarray(s, dtype=U32)
    sel = s & U32(0x7777)
    lo = byte_perm(IQ4_W[0], IQ4_W[1], sel)
    hi = byte_perm(IQ4_W[2], IQ4_W[3], sel)
    return byte_perm(lo, hi, U32(0x3210) | ((s & U32(0x8888)) >> U32(1)))


def iq4_levels(v):
    v = np.asarray(v, dtype=U32)
    a = iq4_lookup4(v)
    b = iq4_lookup4(v >> U32(16))
    return byte_perm(a, b, U32(0x6420)), byte_perm(a, b, U32(0x7531))


def spread4(x):
    return ((np.asarray(x, dtype=U32) & U32(15)) * U32(0x00204081)) & U32(0x01010101)


def h2f(h):
    return np.asarray(h, dtype=np.uint16).view(np.float16).astype(np.float32)


def device_layout(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray | None]:
    """ops.upload_weight's re-layout of one row's GGUF bytes -> (wq bytes, wd uint16 or None)."""
    if type_name in ("Q5_0", "IQ4_NL"):  # the fp16 scale of each block moves to wd
        bb = Q.BLOCK_SIZES[Q.TYPE_IDS[type_name]][1]
        blk = raw.reshape(-1, bb)
        return np.ascontiguousarray(blk[:, 2:]).reshape(-1), np.ascontiguousarray(blk[:, :2]).view(np.uint16)[:, 0]
    return raw.reshape(-1), None


def q32_block(wq: np.ndarray, wd, b: np.ndarray, type_name: str):
    """common.cuh q32_block for the blocks b of one row -> (q (n, 8) uint32 words, d (n,), m (n,))."""
    def u32_at(off):  # little-endian u32 at byte offsets off (n,)
        return wq[off[:, None] + np.arange(4)].copy().view("<u4")[:, 0].astype(U32)

    def u16_at(off):
        return wq[off[:, None] + np.arange(2)].copy().view("<u2")[:, 0]

    n = b.size
    qh = np.zeros(n, U32)
    m = np.zeros(n, np.float32)
    if type_name in ("Q4_1", "Q5_0"):
        base = b * 20
        head = u32_at(base)
        qs = np.stack([u32_at(base + 4 + 4 * i) for i in range(4)], axis=1)
        if type_name == "Q4_1":
            d, m = h2f(head & U32(0xFFFF)), h2f(head >> U32(16))
        else:
            qh, d = head, h2f(wd[b])
    elif type_name == "Q5_1":
        base = b * 24
        head = u32_at(base)
        d, m = h2f(head & U32(0xFFFF)), h2f(head >> U32(16))
        qh = u32_at(base + 4)
        qs = np.stack([u32_at(base + 8 + 4 * i) for i in range(4)], axis=1)
    elif type_name == "IQ4_NL":
        qs = np.stack([u32_at(b * 16 + 4 * i) for i in range(4)], axis=1)
        d = h2f(wd[b])
    else:  # IQ4_XS
        p = (b >> 3) * 136
        ib = (b & 7).astype(U32)
        sh = u16_at(p + 2).astype(U32)
        sl = wq[p + 4 + (ib >> U32(1))].astype(U32)
        ls = ((sl >> (U32(4) * (ib & U32(1)))) & U32(15)) | (((sh >> (U32(2) * ib)) & U32(3)) << U32(4))
        d = h2f(u16_at(p)) * (ls.astype(np.int32) - 32).astype(np.float32)
        qs = np.stack([u32_at(p + 8 + 16 * ib.astype(np.int64) + 4 * i) for i in range(4)], axis=1)
    q = np.zeros((n, 8), U32)
    for i in range(4):
        if type_name.startswith("IQ4"):
            q[:, i], q[:, 4 + i] = iq4_levels(qs[:, i])
            continue
        lo, hi = qs[:, i] & U32(0x0F0F0F0F), (qs[:, i] >> U32(4)) & U32(0x0F0F0F0F)
        if type_name == "Q5_0":
            lo |= spread4(~qh >> U32(4 * i)) * U32(0xF0)
            hi |= spread4(~qh >> U32(16 + 4 * i)) * U32(0xF0)
        elif type_name == "Q5_1":
            lo |= spread4(qh >> U32(4 * i)) << U32(4)
            hi |= spread4(qh >> U32(16 + 4 * i)) << U32(4)
        q[:, i], q[:, 4 + i] = lo, hi
    return q, d, m


def deq_block32(wq, wd, b, type_name):
    """common.cuh deq_block32 for a Q32 format: fmaf(d, (float)(i8)byte, m) per value -> (n, 32)."""
    q, d, m = q32_block(wq, wd, b, type_name)
    vals = q.view(np.int8).reshape(-1, 32).astype(np.float64)  # byte k of word i = value 4i + k
    # one rounding of the exact d * q + m, as fmaf does (d * q is exact in float64: 11 x 8 bits)
    return (d[:, None].astype(np.float64) * vals + m[:, None].astype(np.float64)).astype(np.float32)


def random_blocks(type_name: str, n: int, rng) -> np.ndarray:
    tid = Q.TYPE_IDS[type_name]
    bb = Q.BLOCK_SIZES[tid][1]
    blocks = rng.integers(0, 256, (n, bb), dtype=np.uint8)
    fields = (0, 2) if type_name in ("Q4_1", "Q5_1") else (0,)
    for off in fields:  # finite fp16 scales of several magnitudes
        s = rng.standard_normal(n) * rng.choice([1e-3, 1.0, 50.0], n)
        blocks[:, off : off + 2] = s.astype("<f2").view(np.uint8).reshape(-1, 2)
    return blocks


def test_iq4_lookup_every_code_quad():
    s = np.arange(1 << 16, dtype=U32)
    got = iq4_lookup4(s).view(np.int8).reshape(-1, 4)
    codes = (s[:, None] >> (4 * np.arange(4, dtype=U32))) & U32(15)
    np.testing.assert_array_equal(got, Q.KVALUES[codes])


def test_iq4_table_words_match_kvalues():
    assert np.array(IQ4_W, dtype="<u4").view(np.int8).tolist() == Q.KVALUES.tolist()


def test_iq4_levels_split_low_and_high_nibbles():
    v = np.random.default_rng(0).integers(0, 2**32, 5000, dtype=np.uint64).astype(U32)
    lo, hi = iq4_levels(v)
    byts = v.view(np.uint8).reshape(-1, 4)
    np.testing.assert_array_equal(lo.view(np.int8).reshape(-1, 4), Q.KVALUES[byts & 15])
    np.testing.assert_array_equal(hi.view(np.int8).reshape(-1, 4), Q.KVALUES[byts >> 4])


def test_spread4():
    x = np.arange(16, dtype=U32)
    want = sum(((x >> U32(k)) & U32(1)) << U32(8 * k) for k in range(4))
    np.testing.assert_array_equal(spread4(x | U32(0xFFF0)), want)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS"])
@pytest.mark.parametrize("K", [32, 96, 256, 768])
def test_device_blocks_decode_bit_exact(type_name, K):
    tid = Q.TYPE_IDS[type_name]
    bv, bb = Q.BLOCK_SIZES[tid]
    if K % bv:
        pytest.skip(f"{type_name} rows hold multiples of {bv}")
    rng = np.random.default_rng(K + tid)
    rows = 5
    raw = random_blocks(type_name, rows * K // bv, rng).reshape(rows, -1)
    ref = Q.dequantize_blocks(raw, tid).reshape(rows, K)
    for r in range(rows):
        wq, wd = device_layout(raw[r], type_name)
        got = deq_block32(wq, wd, np.arange(K // 32), type_name).reshape(K)
        np.testing.assert_array_equal(got, ref[r])  # equal as numbers (+0 / -0 aside)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS"])
def test_dp4a_block_dot_matches_dequantized(type_name):
    """The DP4A arithmetic of gemv.cu wblock_dot_acc on these blocks: d * (int8 weights . int8 activations)
    + m * xs equals the dequantized block times the dequantized q8_1 activations."""
    tid = Q.TYPE_IDS[type_name]
    bv = Q.BLOCK_SIZES[tid][0]
    rng = np.random.default_rng(tid)
    K = max(bv, 64)
    raw = random_blocks(type_name, K // bv, rng).reshape(-1)
    wq, wd = device_layout(raw, type_name)
    nb = K // 32
    q, d, m = q32_block(wq, wd, np.arange(nb), type_name)
    wint = q.view(np.int8).reshape(nb, 32).astype(np.int64)
    xq = rng.integers(-127, 128, (nb, 32))
    xd = rng.uniform(0.01, 0.1, nb)
    xs = xd * xq.sum(axis=1)
    got = (xd * d * (wint * xq).sum(axis=1) + m * xs).sum()
    w = Q.dequantize_blocks(raw, tid).astype(np.float64).reshape(nb, 32)
    ref = float((w * (xq * xd[:, None])).sum())
    assert got == pytest.approx(ref, rel=1e-5, abs=1e-5 * np.abs(w).sum())
