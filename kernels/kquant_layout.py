"""The device layout of the K-quant weight formats (Q4_K, Q5_K, Q6_K), in NumPy (and CuPy).

`repack` makes it from the file's raw blocks with byte-wide array operations only, so the same function
runs on the device (ops.upload_weight copies the raw rows to the GPU and runs it there with CuPy, a
chunk of rows at a time) and on the host (NumPy); `repack_reference` states the same bytes value by
value (the tests hold `repack` to it); `unpack` reads the layout back to float32 with the file format's
arithmetic, so a test can compare it bit for bit with engine/quants.py; `wq_row_bytes` is the row
stride the kernels use (common.cuh `row_bytes`).

The layout (per row of K values, n = K / 256 super-blocks, nb = K / 32 blocks of 32 values; the bytes
are the file's: Q4_K 144 n, Q5_K 176 n, Q6_K 210 n when n % 8 == 0, else up to 14 bytes of padding):

  wq, quants only, every 32-value block's nibbles as 16 aligned bytes: byte i holds value i in its low
      nibble and value 16 + i in its high nibble, so masking an int gives 4 consecutive values for DP4A.
      Q4_K: block b at 16 b.                                                      (128 n bytes)
      Q5_K: per super-block 160 bytes: 8 x 16 nibble bytes, then 8 x 4 bytes of high bits: a u32 H per
            block with bit 8 i + k = bit 4 of value 4 k + i and bit 8 i + 4 + k = bit 4 of value
            16 + 4 k + i (k, i < 4), so `(H << (4 - k)) & 0x10101010` lands them under int k's bytes.
      Q6_K: groups of 8 super-blocks: a 16-byte header holding the 8 fp16 d, then per super-block 192
            bytes: 8 x 16 nibble bytes, then 8 x 8 bytes of high 2-bit pairs: u32 H0 (values 0..15) and
            H1 (values 16..31) with bits 8 i + 2 k, +1 = bits 4, 5 of value 4 k + i (+ 16 for H1).
  wd, one u16 per 32-value block (the `wd` every kernel already indexes as row * nb + b):
      Q4_K, Q5_K: bits 0-5 the sub-block scale sc, 6-11 its min m (both 6-bit in the file), 12-15 one
            nibble of the super-block's fp16 d (blocks 0-3) or dmin (blocks 4-7): blocks 2, 0, 3, 1
            hold bits 0-3, 4-7, 8-11, 12-15, so that two shifts, two bit-selects and one byte permute
            of the super-block's 16 wd bytes give d | dmin << 16 (common.cuh `kq_dd`).
      Q6_K: the two int8 scales of values 0..15 and 16..31 (the file's scale bytes, in order).

Values: Q4_K/Q5_K x = (d * sc) * q - (dmin * m), q in 0..15 / 0..31; Q6_K x = (d * sc) * (q - 32),
q in 0..63 (fp32 products rounded as engine/quants.py rounds them).

Not here: the CUDA loads (common.cuh, the K-quant section) and launches (ops.py). Imports numpy only
(CuPy arrives as the `xp` argument).
"""

from __future__ import annotations

from typing import Any

import numpy as np

KQUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")
SUPER_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # file bytes per 256 values
Q6K_GROUP = 8  # Q6_K super-blocks per group (one 16-byte header of their d)
_DD_SHIFT = (4, 12, 0, 8)  # bit offset of the nibble that block j (mod 4) holds in its fp16


def wq_row_bytes(type_name: str, K: int) -> int:
    """Bytes per row of the quants array `wq` (a multiple of 16)."""
    n = K // 256
    if type_name == "Q4_K":
        return 128 * n
    if type_name == "Q5_K":
        return 160 * n
    if type_name == "Q6_K":
        return 192 * n + 16 * -(-n // Q6K_GROUP)
    raise ValueError(f"{type_name} is not a K-quant format ({', '.join(KQUANT_TYPES)})")


def _check(raw: np.ndarray, type_name: str, K: int) -> np.ndarray:
    if type_name not in KQUANT_TYPES:
        raise ValueError(f"{type_name} is not a K-quant format ({', '.join(KQUANT_TYPES)})")
    if K <= 0 or K % 256:
        raise ValueError(f"{type_name} rows must be a multiple of 256 values, got {K}")
    raw = np.ascontiguousarray(raw).view(np.uint8)
    per = K // 256 * SUPER_BYTES[type_name]
    if raw.size % per:
        raise ValueError(f"{raw.size} bytes are not whole rows of {K} {type_name} values ({per} bytes each)")
    return raw.reshape(-1, K // 256, SUPER_BYTES[type_name])


def decode_ints(raw: np.ndarray, type_name: str, K: int):
    """The file's integers: (q (rows, n, 8, 32) uint8, sc, m, d16, dmin16). Q4_K/Q5_K: sc, m (rows, n, 8)
    6-bit, d16/dmin16 (rows, n) the fp16 bit patterns; Q6_K: sc (rows, n, 16) int8, m None, dmin16 None."""
    blk = _check(raw, type_name, K)
    rows, n = blk.shape[:2]
    if type_name in ("Q4_K", "Q5_K"):
        d16 = blk[..., 0:2].copy().view("<u2")[..., 0]
        dmin16 = blk[..., 2:4].copy().view("<u2")[..., 0]
        a, b, c = blk[..., 4:8], blk[..., 8:12], blk[..., 12:16]
        sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
        m = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
        qs = blk[..., -128:].reshape(rows, n, 4, 1, 32)
        q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, n, 8, 32)
        if type_name == "Q5_K":
            qh = blk[..., 16:48].reshape(rows, n, 1, 32)
            q = q | (((qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1) << 4)
        return q, sc, m, d16, dmin16
    ql = blk[..., 0:128].reshape(rows, n, 2, 1, 64)
    qh = blk[..., 128:192].reshape(rows, n, 2, 1, 32)
    low = np.concatenate([ql & 15, ql >> 4], axis=3).reshape(rows, n, 2, 128)
    top = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3).reshape(rows, n, 2, 128)
    q = (low | (top << 4)).reshape(rows, n, 8, 32)
    sc = blk[..., 192:208].view(np.int8)
    d16 = blk[..., 208:210].copy().view("<u2")[..., 0]
    return q, sc, None, d16, None


def _nibble_bytes(q: np.ndarray) -> np.ndarray:
    """(..., 32) values -> (..., 16) bytes: value i low nibble, value 16 + i high nibble."""
    return (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)


def _bit_words(q: np.ndarray, shift: int, width: int) -> np.ndarray:
    """(..., 16) values -> (...,) u32: `width` bits of value 4 k + i (from bit `shift`) at bit 8 i + width k."""
    field = (q.astype(np.uint32) >> shift) & ((1 << width) - 1)
    k = np.arange(16) // 4
    i = np.arange(16) % 4
    return (field << (8 * i + width * k).astype(np.uint32)).sum(axis=-1, dtype=np.uint32)


def repack_reference(raw: np.ndarray, type_name: str, K: int) -> tuple[np.ndarray, np.ndarray]:
    """`repack` written value by value (every quant decoded to an integer, then packed): the slow,
    plain statement of the layout that the tests hold `repack` to."""
    q, sc, m, d16, dmin16 = decode_ints(raw, type_name, K)
    rows, n = q.shape[:2]
    nib = _nibble_bytes(q).reshape(rows, n, 128)
    if type_name == "Q4_K":
        wq = nib.reshape(rows, 128 * n)
    elif type_name == "Q5_K":
        hi = _bit_words(q.reshape(rows, n, 8, 2, 16)[..., 0, :], 4, 1) | (
            _bit_words(q.reshape(rows, n, 8, 2, 16)[..., 1, :], 4, 1) << np.uint32(4))
        wq = np.concatenate([nib, hi.astype("<u4").view(np.uint8).reshape(rows, n, 32)], axis=2).reshape(rows, -1)
    else:
        halves = q.reshape(rows, n, 8, 2, 16)
        h = np.stack([_bit_words(halves[..., 0, :], 4, 2), _bit_words(halves[..., 1, :], 4, 2)], axis=-1)
        body = np.concatenate([nib, h.astype("<u4").view(np.uint8).reshape(rows, n, 64)], axis=2)
        wq = np.zeros((rows, wq_row_bytes(type_name, K)), dtype=np.uint8)
        for g in range(0, n, Q6K_GROUP):
            s = slice(g, min(g + Q6K_GROUP, n))
            base = g // Q6K_GROUP * (16 + 192 * Q6K_GROUP)
            cnt = s.stop - s.start
            wq[:, base:base + 2 * cnt] = d16[:, s].astype("<u2").view(np.uint8).reshape(rows, 2 * cnt)
            wq[:, base + 16:base + 16 + 192 * cnt] = body[:, s].reshape(rows, 192 * cnt)
        wd = sc.view(np.uint8).reshape(rows, n, 8, 2).copy().view("<u2").reshape(rows, 8 * n)
        return wq, wd.astype(np.uint16)
    j = np.arange(8)
    shifts = np.array(_DD_SHIFT * 2, dtype=np.uint16)
    src = np.where(j < 4, d16[..., None], dmin16[..., None]).astype(np.uint16)  # (rows, n, 8)
    nibble = (src >> shifts) & np.uint16(15)
    wd = sc.astype(np.uint16) | (m.astype(np.uint16) << np.uint16(6)) | (nibble << np.uint16(12))
    return np.ascontiguousarray(wq), wd.reshape(rows, 8 * n).astype(np.uint16)


_M0F = 0x0F0F0F0F
_MF0 = 0xF0F0F0F0
_HOST_CHUNK = 4096  # super-blocks per NumPy step (its temporaries stay in cache)


def repack(raw: Any, type_name: str, K: int, xp: Any = np) -> tuple[Any, Any]:
    """The file's raw blocks of whole rows of K values -> (wq (rows, wq_row_bytes) uint8, wd (rows, K/32)
    uint16), with word-wide array operations only, so that `xp` may be numpy (host, a few thousand
    super-blocks at a time) or cupy (device: ops.upload_weight runs it on the copied raw rows);
    `repack_reference` is the same bytes value by value. Temporaries: about 2x the input's bytes."""
    if type_name not in KQUANT_TYPES:
        raise ValueError(f"{type_name} is not a K-quant format ({', '.join(KQUANT_TYPES)})")
    if K <= 0 or K % 256:
        raise ValueError(f"{type_name} rows must be a multiple of 256 values, got {K}")
    sb = SUPER_BYTES[type_name]
    flat = xp.ascontiguousarray(raw).reshape(-1).view(xp.uint8)
    n = K // 256
    if flat.size % (n * sb):
        raise ValueError(f"{flat.size} bytes are not whole rows of {K} {type_name} values ({n * sb} bytes each)")
    rows = flat.size // (n * sb)
    blk = flat.reshape(rows * n, sb)
    body_bytes = {"Q4_K": 128, "Q5_K": 160, "Q6_K": 192}[type_name]
    body = xp.empty((rows * n, body_bytes), dtype=xp.uint8)
    wd = xp.empty((rows * n, 8), dtype=xp.uint16)
    step = _HOST_CHUNK if xp is np else max(1, rows * n)
    for i in range(0, rows * n, step):
        _repack_super_blocks(xp, blk[i:i + step], type_name, body[i:i + step], wd[i:i + step])
    wd = wd.reshape(rows, 8 * n)
    if type_name != "Q6_K":
        return body.reshape(rows, -1), wd
    # Q6_K: groups of 8 super-blocks behind a 16-byte header of their fp16 d
    G = -(-n // Q6K_GROUP)
    wq = xp.zeros((rows, G, 16 + 192 * Q6K_GROUP), dtype=xp.uint8)
    body = body.reshape(rows, n, 192)
    d = blk[:, 208:210].reshape(rows, n, 2)
    for g in range(G):
        cnt = min(Q6K_GROUP, n - g * Q6K_GROUP)
        s0 = g * Q6K_GROUP
        wq[:, g, :2 * cnt] = d[:, s0:s0 + cnt].reshape(rows, 2 * cnt)
        wq[:, g, 16:16 + 192 * cnt] = body[:, s0:s0 + cnt].reshape(rows, 192 * cnt)
    return xp.ascontiguousarray(wq.reshape(rows, -1)[:, :wq_row_bytes(type_name, K)]), wd


def _nibble_words(xp: Any, qs: Any) -> tuple[Any, Any]:
    """qs (N, G, 2, 4) u32: 32-byte groups whose bytes l hold value l (low nibble) / l (high nibble) of
    two 32-value runs -> (low-run words, high-run words) (N, G, 4), byte i = value i | value 16 + i << 4."""
    m0f = xp.uint32(_M0F)
    lo = qs & m0f  # whole-array operations first (contiguous), the half-strided ones last
    hi = (qs >> xp.uint32(4)) & m0f
    four = xp.uint32(4)
    return lo[:, :, 0] | (lo[:, :, 1] << four), hi[:, :, 0] | (hi[:, :, 1] << four)


def _transpose_bits8(xp: Any, x: Any) -> Any:
    """Each u64 as an 8 x 8 bit matrix (byte r, bit c) -> its transpose (byte c, bit r)."""
    u = xp.uint64
    for shift, mask in ((7, 0x00AA00AA00AA00AA), (14, 0x0000CCCC0000CCCC), (28, 0x00000000F0F0F0F0)):
        t = (x ^ (x >> u(shift))) & u(mask)
        x = x ^ t ^ (t << u(shift))
    return x


def _transpose_pairs4(xp: Any, x: Any) -> Any:
    """Each u32 as a 4 x 4 matrix of 2-bit fields (byte r, bits 2c..2c+1) -> its transpose."""
    u = xp.uint32
    for shift, mask in ((6, 0x00CC00CC), (12, 0x0000F0F0)):
        t = (x ^ (x >> u(shift))) & u(mask)
        x = x ^ t ^ (t << u(shift))
    return x


def _repack_super_blocks(xp: Any, blk: Any, type_name: str, body: Any, wd: Any) -> None:
    """Super-blocks blk (N, file bytes) -> their wq bytes `body` (N, 128 / 160 / 192; Q6_K without the
    group headers) and wd entries (N, 8) u16, written in place."""
    N = blk.shape[0]
    u32 = xp.uint32
    if type_name == "Q6_K":
        ql = xp.ascontiguousarray(blk[:, 0:128]).view(u32).reshape(N, 4, 2, 4)  # [2 half + (quadrant & 1)]
        low, high = _nibble_words(xp, ql)  # quadrants 0, 1 (low nibbles) and 2, 3 (high nibbles)
        nib = xp.concatenate([low.reshape(N, 2, 2, 4), high.reshape(N, 2, 2, 4)], axis=2)  # [half, quadrant]
        body[:, :128] = nib.reshape(N, 32).view(xp.uint8)
        # qh byte l of a half holds the top bits of values l, l + 32, l + 64, l + 96 (quadrants); block
        # (half, quadrant)'s words want, per byte i of H_h, the fields of values 16 h + 4 k + i at bits 2 k:
        # a 4 x 4 transpose of 2-bit fields over k and the quadrant, for each (half, h, i)
        qh = xp.ascontiguousarray(blk[:, 128:192].reshape(N, 2, 2, 4, 4).transpose(0, 1, 2, 4, 3))
        t = _transpose_pairs4(xp, qh.view(u32)).view(xp.uint8).reshape(N, 2, 2, 4, 4)  # [half, h, i, quadrant]
        body[:, 128:] = t.transpose(0, 1, 4, 2, 3).reshape(N, 64)
        wd[:] = xp.ascontiguousarray(blk[:, 192:208]).view(xp.uint16)
        return
    qs = xp.ascontiguousarray(blk[:, -128:]).view(u32).reshape(N, 4, 2, 4)
    low, high = _nibble_words(xp, qs)  # sub-blocks 2 p and 2 p + 1
    body[:, :128] = xp.stack([low, high], axis=2).reshape(N, 32).view(xp.uint8)
    if type_name == "Q5_K":
        # bit j of qh[l] is bit 4 of value l of sub-block j; H_j's byte i wants those of values
        # 4 k + i (bit k) and 16 + 4 k + i (bit 4 + k): an 8 x 8 bit transpose for each i
        qh = xp.ascontiguousarray(blk[:, 16:48].reshape(N, 8, 4).transpose(0, 2, 1))  # [i, 4 half + k]
        t = _transpose_bits8(xp, qh.view(xp.uint64)).view(xp.uint8).reshape(N, 4, 8)  # [i, j]
        body[:, 128:] = t.transpose(0, 2, 1).reshape(N, 32)
    w = xp.ascontiguousarray(blk[:, 4:16]).view(u32)  # the 12 scale bytes as 3 words A, B, C
    A, B, C = w[:, 0:1], w[:, 1:2], w[:, 2:3]
    m3f, m03, m0f = u32(0x3F3F3F3F), u32(0x03030303), u32(_M0F)
    sc = xp.concatenate([A & m3f, (C & m0f) | (((A >> u32(6)) & m03) << u32(4))], axis=1)
    m = xp.concatenate([B & m3f, ((C >> u32(4)) & m0f) | (((B >> u32(6)) & m03) << u32(4))], axis=1)
    dd = xp.ascontiguousarray(blk[:, 0:4]).view(xp.uint16)  # (N, 2): d, dmin bits
    src = xp.repeat(dd, 4, axis=1)  # blocks 0-3: d, 4-7: dmin
    shifts = xp.asarray(np.array(_DD_SHIFT * 2, np.uint16)).reshape(1, 8)
    u16 = xp.uint16
    wd[:] = (sc.view(xp.uint8).astype(u16) | (m.view(xp.uint8).astype(u16) << u16(6))
             | (((src >> shifts) & u16(15)) << u16(12)))


def _f16(bits: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(bits.astype(np.uint16)).view(np.float16).astype(np.float32)


def unpack_ints(wq: np.ndarray, wd: np.ndarray, type_name: str, K: int):
    """The device layout back to the file's integers (same tuple as `decode_ints`)."""
    rows = wq.shape[0]
    n = K // 256
    if wq.shape != (rows, wq_row_bytes(type_name, K)) or wd.shape != (rows, K // 32):
        raise ValueError(f"{type_name} device arrays of shapes {wq.shape}, {wd.shape} do not hold {K}-value rows")
    wd = wd.astype(np.uint16).reshape(rows, n, 8)
    if type_name == "Q6_K":
        d16 = np.zeros((rows, n), dtype=np.uint16)
        body = np.zeros((rows, n, 192), dtype=np.uint8)
        for g in range(0, n, Q6K_GROUP):
            cnt = min(Q6K_GROUP, n - g)
            base = g // Q6K_GROUP * (16 + 192 * Q6K_GROUP)
            d16[:, g:g + cnt] = wq[:, base:base + 2 * cnt].copy().view("<u2")
            body[:, g:g + cnt] = wq[:, base + 16:base + 16 + 192 * cnt].reshape(rows, cnt, 192)
    else:
        body = wq.reshape(rows, n, -1)
    nib = body[..., :128].reshape(rows, n, 8, 16)
    q = np.concatenate([nib & 15, nib >> 4], axis=-1).astype(np.uint32)  # (rows, n, 8, 32)
    k = (np.arange(16) // 4).astype(np.uint32)
    i = (np.arange(16) % 4).astype(np.uint32)
    if type_name == "Q5_K":
        h = body[..., 128:160].copy().view("<u4").reshape(rows, n, 8, 1)
        q[..., :16] |= ((h >> (8 * i + k)) & 1) << 4
        q[..., 16:] |= ((h >> (8 * i + 4 + k)) & 1) << 4
    if type_name == "Q6_K":
        h = body[..., 128:192].copy().view("<u4").reshape(rows, n, 8, 2, 1)
        q[..., :16] |= ((h[..., 0, :] >> (8 * i + 2 * k)) & 3) << 4
        q[..., 16:] |= ((h[..., 1, :] >> (8 * i + 2 * k)) & 3) << 4
        sc = wd.copy().view(np.uint8).view(np.int8).reshape(rows, n, 16)
        return q.astype(np.uint8), sc, None, d16, None
    sc = (wd & 63).astype(np.uint8)
    m = ((wd >> 6) & 63).astype(np.uint8)
    nibble = (wd >> 12).astype(np.uint16)
    shifts = np.array(_DD_SHIFT, dtype=np.uint16)
    d16 = (nibble[..., :4] << shifts).sum(axis=-1, dtype=np.uint16)
    dmin16 = (nibble[..., 4:] << shifts).sum(axis=-1, dtype=np.uint16)
    return q.astype(np.uint8), sc, m, d16, dmin16


def unpack(wq: np.ndarray, wd: np.ndarray, type_name: str, K: int) -> np.ndarray:
    """The device layout -> float32 (rows, K), rounded as the file format's dequantization rounds."""
    q, sc, m, d16, dmin16 = unpack_ints(wq, wd, type_name, K)
    rows, n = q.shape[:2]
    if type_name == "Q6_K":
        scale = _f16(d16)[..., None] * sc.astype(np.float32)  # (rows, n, 16)
        v = q.reshape(rows, n, 16, 16).astype(np.int8) - np.int8(32)
        return (scale[..., None] * v.astype(np.float32)).reshape(rows, K)
    scale = _f16(d16)[..., None] * sc.astype(np.float32)  # (rows, n, 8)
    offset = _f16(dmin16)[..., None] * m.astype(np.float32)
    return (scale[..., None] * q.astype(np.float32) - offset[..., None]).reshape(rows, K)
