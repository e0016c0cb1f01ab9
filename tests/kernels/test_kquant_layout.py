"""The K-quant device layout (kernels/kquant_layout.py) on the CPU: the byte-wise repack (what the GPU
runs) equals the value-by-value model, the repack is lossless (unpacking it gives engine/quants.py's
dequantization bit for bit, and the file's integers back), it keeps the
file's bytes, and a NumPy emulation of the CUDA loads (common.cuh kq_dd / kq_load: the bit tricks on
32-bit words) reads the same integers. The GPU test (tests/gpu/test_kquant_gemv.py) checks the CUDA
repack byte for byte against `repack` and every kernel against dequantize-then-matmul."""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import quants as Q
from minecart.engine.gguf_file import TensorInfo
from minecart.kernels import kquant_layout as L

TYPE_IDS = {"Q4_K": Q.Q4_K, "Q5_K": Q.Q5_K, "Q6_K": Q.Q6_K}


def random_blocks(type_name: str, rows: int, K: int, rng, extreme: bool = False) -> np.ndarray:
    """Random raw super-blocks (every bit pattern of quants and scales) with finite fp16 scales; with
    `extreme` the fp16 fields span subnormals to 65504, negative ones and zeros included."""
    n = rows * K // 256
    blocks = rng.integers(0, 256, (n, L.SUPER_BYTES[type_name]), dtype=np.uint8)
    offs = (208,) if type_name == "Q6_K" else (0, 2)
    for off in offs:
        if extreme:
            pool = np.array([0.0, -0.0, 6e-8, -6e-8, 6.1e-5, 1e-3, -1.0, 1.0, 100.0, -65504.0, 65504.0],
                            np.float32)
            s = rng.choice(pool, n)
        else:
            s = rng.standard_normal(n) * rng.choice([1e-3, 1.0, 100.0], n)
        blocks[:, off:off + 2] = s.astype("<f2").view(np.uint8).reshape(n, 2)
    if extreme and type_name == "Q6_K":  # the int8 scale extremes
        blocks[::3, 192:208] = np.uint8(0x80)
        blocks[1::3, 192:208] = np.uint8(0x7F)
    return blocks.reshape(rows, -1)


def reference(type_name: str, raw: np.ndarray, rows: int, K: int) -> np.ndarray:
    tid = TYPE_IDS[type_name]
    info = TensorInfo("blk.0.w.weight", tid, type_name, (rows, K), raw, raw.nbytes)
    return Q.dequantize(info)


@pytest.mark.parametrize("type_name", L.KQUANT_TYPES)
@pytest.mark.parametrize("K", [256, 768, 2048, 2304, 4352])  # 1, 3, 8, 9, 17 super-blocks (Q6_K tails)
@pytest.mark.parametrize("extreme", [False, True])
def test_repack_is_lossless(type_name, K, extreme):
    rng = np.random.default_rng(K + 7 * extreme + len(type_name))
    rows = 5
    raw = random_blocks(type_name, rows, K, rng, extreme)
    wq, wd = L.repack(raw, type_name, K)
    assert wq.dtype == np.uint8 and wd.dtype == np.uint16
    ref_q, ref_d = L.repack_reference(raw, type_name, K)  # the value-by-value statement of the layout
    np.testing.assert_array_equal(wq, ref_q)
    np.testing.assert_array_equal(wd, ref_d)
    assert wq.shape == (rows, L.wq_row_bytes(type_name, K)) and wd.shape == (rows, K // 32)
    assert wq.shape[1] % 16 == 0  # every row starts 16-byte aligned
    # the file's integers come back exactly
    for a, b in zip(L.decode_ints(raw, type_name, K), L.unpack_ints(wq, wd, type_name, K), strict=True):
        if a is None:
            assert b is None
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got = L.unpack(wq, wd, type_name, K)
    ref = reference(type_name, raw, rows, K)
    assert got.shape == ref.shape == (rows, K)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("type_name", L.KQUANT_TYPES)
def test_bytes_are_the_files(type_name):
    for K in (4096, 12288, 256, 2304):
        n = K // 256
        dev = L.wq_row_bytes(type_name, K) + 2 * (K // 32)
        file = n * L.SUPER_BYTES[type_name]
        if type_name == "Q6_K":
            assert file <= dev <= file + 14 and (dev == file) == (n % 8 == 0)
        else:
            assert dev == file


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="multiple of 256"):
        L.repack(np.zeros(144, np.uint8), "Q4_K", 128)
    with pytest.raises(ValueError, match="not a K-quant"):
        L.wq_row_bytes("Q8_0", 256)
    with pytest.raises(ValueError, match="whole rows"):
        L.repack(np.zeros(145, np.uint8), "Q4_K", 256)
    with pytest.raises(ValueError, match="whole rows"):
        L.repack_reference(np.zeros(145, np.uint8), "Q4_K", 256)
    with pytest.raises(ValueError, match="do not hold"):
        L.unpack(np.zeros((1, 128), np.uint8), np.zeros((1, 4), np.uint16), "Q4_K", 256)


# ---- NumPy emulation of the device loads (common.cuh) ---------------------------------------------

def _u32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u4").astype(np.uint64)


def byte_perm(x, y, sel: int):
    """PTX prmt / __byte_perm (default mode): result byte i = byte (sel >> 4 i) & 7 of [x, y]."""
    pool = [(x >> (8 * k)) & 0xFF for k in range(4)] + [(y >> (8 * k)) & 0xFF for k in range(4)]
    out = 0
    for i in range(4):
        out |= pool[(sel >> (4 * i)) & 7] << (8 * i)
    return out


def kq_dd(w0, w1, w2, w3):
    """common.cuh kq_dd: d | dmin << 16 from the super-block's four wd words."""
    m, lo = 0xF0F0F0F0, 0x0F0F0F0F
    xd = (w0 & m) | ((w1 >> 4) & lo)
    xm = (w2 & m) | ((w3 >> 4) & lo)
    return byte_perm(xd, xm, 0x7531)


def sign6(q):
    """Q6_K q - 32 as four signed bytes without borrows (load path of common.cuh)."""
    return ((q ^ 0x20202020) | (((~q) & 0x20202020) * 6)) & 0xFFFFFFFF


def emulate_block_ints(wq, wd, type_name: str, K: int, row: int, b: int):
    """What kq_load computes for block b of a row: 8 ints (4 signed bytes each) and the scale fields."""
    j, s = b & 7, b >> 3
    if type_name == "Q6_K":
        g = s // L.Q6K_GROUP
        base = g * (16 + 192 * L.Q6K_GROUP) + 16 + (s % L.Q6K_GROUP) * 192
        d16 = int(wq[row, g * (16 + 192 * L.Q6K_GROUP) + 2 * (s % L.Q6K_GROUP):][:2].view("<u2")[0])
    else:
        base = s * (128 if type_name == "Q4_K" else 160)
        w = _u32(wd[row, 8 * s:8 * s + 8].view(np.uint8))
        dd = kq_dd(*[int(w[i]) for i in range(4)])
        d16 = dd & 0xFFFF
    v = _u32(wq[row, base + 16 * j:base + 16 * j + 16])
    out = []
    for half in range(2):
        for k in range(4):
            nib = (int(v[k]) >> (4 * half)) & 0x0F0F0F0F
            if type_name == "Q5_K":
                h = int(_u32(wq[row, base + 128 + 4 * j:base + 132 + 4 * j])[0])
                hb = ((h << (4 - k)) if half == 0 else (h >> k)) & 0x10101010
                nib |= hb
            if type_name == "Q6_K":
                h = int(_u32(wq[row, base + 128 + 8 * j + 4 * half:base + 132 + 8 * j + 4 * half])[0])
                hb = ((h << (4 - 2 * k)) if k < 3 else (h >> 2)) & 0x30303030
                nib = sign6(nib | hb)
            out.append(int(nib) & 0xFFFFFFFF)
    return out, d16


@pytest.mark.parametrize("type_name", L.KQUANT_TYPES)
def test_device_load_emulation(type_name):
    """The 32-bit-word tricks of the CUDA loads read the file's integers for every block."""
    rng = np.random.default_rng(3)
    K, rows = 2304, 2
    raw = random_blocks(type_name, rows, K, rng, extreme=True)
    wq, wd = L.repack(raw, type_name, K)
    q, sc, m, d16, dmin16 = L.decode_ints(raw, type_name, K)
    for row in range(rows):
        for b in range(K // 32):
            ints, d_bits = emulate_block_ints(wq, wd, type_name, K, row, b)
            vals = np.array(ints, dtype="<u4").view(np.int8 if type_name == "Q6_K" else np.uint8)
            want = q[row, b >> 3, b & 7].astype(np.int16) - (32 if type_name == "Q6_K" else 0)
            np.testing.assert_array_equal(vals.astype(np.int16), want)
            assert d_bits == d16[row, b >> 3]
            if type_name != "Q6_K":
                w = _u32(wd[row, 8 * (b >> 3):8 * (b >> 3) + 8].view(np.uint8))
                dd = kq_dd(*[int(w[i]) for i in range(4)])
                assert dd >> 16 == dmin16[row, b >> 3]
                e = int(wd[row, b])
                assert (e & 63, (e >> 6) & 63) == (sc[row, b >> 3, b & 7], m[row, b >> 3, b & 7])


def kq_dd_shift(j: int) -> int:
    """common.cuh kq_dd_shift: where block j's nibble goes in d | dmin << 16."""
    return ((0x80C4 >> (4 * (j & 3))) & 15) + 4 * (j & 4)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K"])
def test_dd_gather_by_shuffles(type_name):
    """gemv_kq's gather of d | dmin << 16 (each of a super-block's 8 lanes shifts its entry's nibble
    into place, three xor-shuffles OR them) equals kq_dd on the super-block's wd words and the file's
    d / dmin, for every super-block."""
    rng = np.random.default_rng(4)
    K = 4352
    raw = random_blocks(type_name, 3, K, rng, extreme=True)
    wq, wd = L.repack(raw, type_name, K)
    _, _, _, d16, dmin16 = L.decode_ints(raw, type_name, K)
    for row in range(3):
        for s in range(K // 256):
            lanes = [(int(wd[row, 8 * s + j]) >> 12 & 15) << kq_dd_shift(j) for j in range(8)]
            for step in (1, 2, 4):  # __shfl_xor_sync(v, step) then OR, as the kernel does
                lanes = [lanes[j] | lanes[j ^ step] for j in range(8)]
            want = int(d16[row, s]) | int(dmin16[row, s]) << 16
            assert all(v == want for v in lanes)
            w = _u32(wd[row, 8 * s:8 * s + 8].view(np.uint8))
            assert kq_dd(*[int(w[i]) for i in range(4)]) == want


@pytest.mark.parametrize("type_name", L.KQUANT_TYPES)
def test_repack_in_host_chunks(monkeypatch, type_name):
    """The host repack walks the super-blocks in chunks; chunk edges inside rows change nothing."""
    rng = np.random.default_rng(6)
    K, rows = 2304, 4
    raw = random_blocks(type_name, rows, K, rng)
    monkeypatch.setattr(L, "_HOST_CHUNK", 5)
    wq, wd = L.repack(raw, type_name, K)
    ref_q, ref_d = L.repack_reference(raw, type_name, K)
    np.testing.assert_array_equal(wq, ref_q)
    np.testing.assert_array_equal(wd, ref_d)


@pytest.mark.parametrize("wpr,nu", [(1, 4), (2, 4), (4, 4), (1, 8), (2, 8)])
def test_gemv_kq_blocking(wpr, nu):
    """gemv_kq's loop (gemv.cu) visits every 32-value block of a row exactly once over its WPR warps,
    the loop is uniform over a warp (so the shuffles see all 32 lanes), each lane's block has
    b & 7 == lane & 7, and the 8 lanes of a group hold the 8 blocks of one super-block, all valid or all
    past the row end (rows are whole super-blocks)."""
    for K in (256, 2304, 4096, 4352, 12288, 12544):
        nb = K // 32
        seen = np.zeros(nb, np.int64)
        for sub in range(wpr):
            base = sub * 32
            while base < nb:  # the same trip count for every lane
                for u in range(nu):
                    bs = [base + 32 * wpr * u + lane for lane in range(32)]
                    for g in range(4):
                        grp = bs[8 * g:8 * g + 8]
                        assert len({b >> 3 for b in grp}) == 1
                        assert len({b < nb for b in grp}) == 1
                    for lane, b in enumerate(bs):
                        assert b & 7 == lane & 7
                        if b < nb:
                            seen[b] += 1
                base += 32 * wpr * nu
        assert (seen == 1).all(), f"K={K}: blocks visited {np.unique(seen)} times"
