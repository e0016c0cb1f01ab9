"""GGML tensor types: the table of block sizes, NumPy dequantizers, and simple quantizers.

What this is: the one place that knows how GGML stores numbers. `GGML_TYPES` lists every type id the
GGUF format defines (so a file can be opened and sized even when a tensor uses a type we cannot decode);
`dequantize` / `dequantize_rows` turn the raw blocks of the `SUPPORTED_TYPES` into float32, vectorized,
bit-exact with `gguf.quants` (tests/engine/test_quants.py checks that); `quantize` goes the other way for
tests and the synthetic-model writer.

What this is not: a matmul. The backends multiply quantized weights without dequantizing whole matrices;
this module is the NumPy specification of the block formats and the slow path for small tensors.

Block layouts (little-endian; fp16 scales; "qs" holds 4-bit values two per byte):
  Q8_0  [d f16][32 x int8]                                         x = d*q
  Q4_0  [d f16][16 B qs]          lo nibble = value j, hi = j+16   x = d*(q-8)
  Q4_1  [d f16][m f16][16 B qs]                                    x = d*q + m
  Q5_0  [d f16][qh u32][16 B qs]  5th bit of value j = bit j of qh x = d*(q-16)
  Q5_1  [d f16][m f16][qh u32][16 B qs]                            x = d*q + m
  Q4_K  [d][dmin][12 B packed 6-bit scales/mins][128 B qs]         x = d*sc*q - dmin*m (8 x 32 values)
  Q5_K  as Q4_K with [32 B qh] before qs
  Q6_K  [128 B ql][64 B qh][16 x int8 scales][d f16]               x = d*sc*(q-32) (16 x 16 values)
  IQ4_NL [d f16][16 B qs]         lo nibble = value j, hi = j+16   x = d*KVALUES[q]
  IQ4_XS [d f16][scales_h u16][scales_l 4 B][128 B qs]             x = d*(ls-32)*KVALUES[q] (8 x 32
         values; sub-block ib: 6-bit ls = low 4 bits from nibble ib%2 of scales_l[ib/2], high 2 bits
         from bits 2ib..2ib+1 of scales_h; its 16 qs bytes as IQ4_NL's)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import GGUFError, UnsupportedQuantError


@dataclass(frozen=True)
class GGMLType:
    """One GGML tensor type: `block_values` numbers are stored in `block_bytes` bytes."""

    type_id: int
    name: str
    block_values: int
    block_bytes: int


# Every type id of the GGUF format (gguf-py 0.19 constants): id, name, values per block, bytes per block.
# Ids 4, 5, 31-33 and 36-38 were retired upstream and never appear in current files.
_TYPE_TABLE = (
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 40),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
    (40, "NVFP4", 64, 36),
    (41, "Q1_0", 128, 18),
)
GGML_TYPES: dict[int, GGMLType] = {t[0]: GGMLType(*t) for t in _TYPE_TABLE}
TYPE_IDS: dict[str, int] = {t.name: t.type_id for t in GGML_TYPES.values()}
# type id -> (values per block, bytes per block)
BLOCK_SIZES: dict[int, tuple[int, int]] = {
    t.type_id: (t.block_values, t.block_bytes) for t in GGML_TYPES.values()
}

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q4_K, Q5_K, Q6_K, BF16 = 12, 13, 14, 30
IQ4_NL, IQ4_XS = 20, 23
QK_K = 256
# the 16 non-linear levels of IQ4_NL / IQ4_XS, indexed by a 4-bit code
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)

# The types minecart decodes. Everything else opens (the file is readable) but cannot be computed with.
SUPPORTED_TYPES = frozenset({F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS})

# Blocks per dequantization step: bounds the temporaries (a few arrays of this many blocks) so that a
# multi-gigabyte tensor dequantizes without several times its size in scratch memory.
_CHUNK_BLOCKS = 1 << 15
_INTO_CHUNK_VALUES = 1 << 16  # values per step of the in-place decoders (256 KiB of float32 output)


def type_name(type_id: int) -> str:
    t = GGML_TYPES.get(int(type_id))
    return t.name if t else f"unknown type {int(type_id)}"


def bytes_per_row(type_id: int, n_values: int) -> int:
    """Bytes of one row of `n_values` numbers (must be a whole number of blocks)."""
    bv, bb = BLOCK_SIZES[int(type_id)]
    if n_values % bv:
        raise ValueError(f"{type_name(type_id)} rows must hold a multiple of {bv} values, got {n_values}")
    return n_values // bv * bb


# ---------------------------------------------------------------------------------------------------
# dequantizers: (n_blocks, block_bytes) uint8 -> (n_blocks, block_values) float32


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block, as a float32 column (n_blocks, 1)."""
    return blocks[:, start : start + 2].view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, k) bytes -> (n, 2k): low nibbles first, then high nibbles (the Q4_0/Q4_K split)."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes read as a little-endian u32 -> (n, 32) uint8 with bit j in column j."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def _deq_f32(blocks):
    return blocks.view("<f4").astype(np.float32)


def _deq_f16(blocks):
    return blocks.view("<f2").astype(np.float32)


def _deq_bf16(blocks):
    # bfloat16 is the upper half of a float32
    return (blocks.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)


def _deq_q8_0(blocks):
    return blocks[:, 2:].view(np.int8).astype(np.float32) * _f16(blocks, 0)


def _deq_q4_0(blocks):
    q = _nibbles(blocks[:, 2:18]).astype(np.int8) - np.int8(8)
    return _f16(blocks, 0) * q.astype(np.float32)


def _deq_q4_1(blocks):
    q = _nibbles(blocks[:, 4:20]).astype(np.float32)
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    return _nibbles(qs) | (_bits32(qh) << np.uint8(4))


def _deq_q5_0(blocks):
    q = _q5_values(blocks[:, 2:6], blocks[:, 6:22]).astype(np.int8) - np.int8(16)
    return _f16(blocks, 0) * q.astype(np.float32)


def _deq_q5_1(blocks):
    q = _q5_values(blocks[:, 4:8], blocks[:, 8:24]).astype(np.float32)
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte Q4_K/Q5_K scale field -> (sc, m), each (n, 8) uint8 of 6-bit values.

    Bytes 0-3 hold sc0-3 (low 6 bits) and the top 2 bits of sc4-7; bytes 4-7 the same for the mins;
    bytes 8-11 hold the low 4 bits of sc4-7 (low nibble) and of m4-7 (high nibble).
    """
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=1)
    m = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, m


def pack_k_scales_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Inverse of `k_scales_mins`: (n, 8) 6-bit scales and mins -> (n, 12) bytes."""
    sc = sc.astype(np.uint8)
    m = m.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _k_affine(blocks, q: np.ndarray) -> np.ndarray:
    """x = (d*sc) * q - (dmin*m) over 8 sub-blocks of 32; q is (n, 256) in value order."""
    n = blocks.shape[0]
    sc, m = k_scales_mins(blocks[:, 4:16])
    scale = (_f16(blocks, 0) * sc.astype(np.float32)).reshape(n, 8, 1)
    offset = (_f16(blocks, 2) * m.astype(np.float32)).reshape(n, 8, 1)
    return (scale * q.reshape(n, 8, 32).astype(np.float32) - offset).reshape(n, QK_K)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K 128-byte qs -> (n, 256): group g (32 bytes) gives values 64g..64g+31 from the low
    nibbles and 64g+32..64g+63 from the high nibbles."""
    n = qs.shape[0]
    g = qs.reshape(n, 4, 1, 32)
    return np.concatenate([g & np.uint8(15), g >> np.uint8(4)], axis=2).reshape(n, QK_K)


def _deq_q4_k(blocks):
    return _k_affine(blocks, _k_nibbles(blocks[:, 16:144]))


def _deq_q5_k(blocks):
    n = blocks.shape[0]
    qh = blocks[:, 16:48]  # value l of sub-block j has its 5th bit in bit j of qh[l]
    high = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)
    q = _k_nibbles(blocks[:, 48:176]) | (high.reshape(n, QK_K) << np.uint8(4))
    return _k_affine(blocks, q)


def _deq_q6_k(blocks):
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    # per 128-value half: the low nibbles of ql give values 0..63, the high nibbles 64..127; the four
    # 2-bit fields of each qh byte are the top bits of values l, l+32, l+64, l+96.
    top = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    top = top.reshape(n, 2, 128)
    low = np.concatenate([ql & np.uint8(15), ql >> np.uint8(4)], axis=2)
    q = ((low | (top << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, 16, 16)
    scale = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return (scale.reshape(n, 16, 1) * q.astype(np.float32)).reshape(n, QK_K)


def iq4_xs_scales(blocks: np.ndarray) -> np.ndarray:
    """The 8 signed sub-block scales ls - 32 of IQ4_XS blocks (n, 136) -> (n, 8) int8 in [-32, 31]."""
    low = (blocks[:, 4:8].reshape(-1, 4, 1) >> np.array([0, 4], dtype=np.uint8)) & np.uint8(15)
    high = (blocks[:, 2:4].view("<u2") >> (2 * np.arange(8, dtype=np.uint16))) & np.uint16(3)
    return (low.reshape(-1, 8) | (high.astype(np.uint8) << np.uint8(4))).astype(np.int8) - np.int8(32)


def _deq_iq4_nl(blocks):
    return _f16(blocks, 0) * KVALUES[_nibbles(blocks[:, 2:18])].astype(np.float32)


def _deq_iq4_xs(blocks):
    n = blocks.shape[0]
    dl = _f16(blocks, 0) * iq4_xs_scales(blocks).astype(np.float32)  # (n, 8): d * (ls - 32)
    codes = _nibbles(blocks[:, 8:136].reshape(n * 8, 16)).reshape(n, 8, 32)
    return (dl.reshape(n, 8, 1) * KVALUES[codes].astype(np.float32)).reshape(n, QK_K)


# The hot types decode straight into the output slice (one pass less, no float32 temporary of the whole
# chunk). Same operations in the same order as the functions above, so the values are bit-identical;
# the int8 -> float32 casts inside the ufuncs are exact.


def _into_q8_0(blocks, out):
    np.multiply(blocks[:, 2:].view(np.int8), _f16(blocks, 0), out=out)


def _into_q4_0(blocks, out):
    np.multiply(_f16(blocks, 0), _nibbles(blocks[:, 2:18]).astype(np.int8) - np.int8(8), out=out)


def _into_q5_0(blocks, out):
    q = _q5_values(blocks[:, 2:6], blocks[:, 6:22]).astype(np.int8) - np.int8(16)
    np.multiply(_f16(blocks, 0), q, out=out)


def _into_k_affine(blocks, q, out):
    n = blocks.shape[0]
    sc, m = k_scales_mins(blocks[:, 4:16])
    scale = (_f16(blocks, 0) * sc.astype(np.float32)).reshape(n, 8, 1)
    offset = (_f16(blocks, 2) * m.astype(np.float32)).reshape(n, 8, 1)
    out3 = out.reshape(n, 8, 32)
    np.multiply(scale, q.reshape(n, 8, 32), out=out3)
    np.subtract(out3, offset, out=out3)


def _into_q4_k(blocks, out):
    _into_k_affine(blocks, _k_nibbles(blocks[:, 16:144]), out)


def _into_q6_k(blocks, out):
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    top = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)).reshape(n, 2, 128)
    low = np.concatenate([ql & np.uint8(15), ql >> np.uint8(4)], axis=2)
    q = ((low | (top << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, 16, 16)
    scale = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    np.multiply(scale.reshape(n, 16, 1), q, out=out.reshape(n, 16, 16))


_DEQUANTIZE_INTO = {Q8_0: _into_q8_0, Q4_0: _into_q4_0, Q5_0: _into_q5_0, Q4_K: _into_q4_k, Q6_K: _into_q6_k}

_DEQUANTIZERS = {
    F32: _deq_f32,
    F16: _deq_f16,
    BF16: _deq_bf16,
    Q8_0: _deq_q8_0,
    Q4_0: _deq_q4_0,
    Q4_1: _deq_q4_1,
    Q5_0: _deq_q5_0,
    Q5_1: _deq_q5_1,
    Q4_K: _deq_q4_k,
    Q5_K: _deq_q5_k,
    Q6_K: _deq_q6_k,
    IQ4_NL: _deq_iq4_nl,
    IQ4_XS: _deq_iq4_xs,
}
assert set(_DEQUANTIZERS) == SUPPORTED_TYPES


def dequantize_blocks(raw: np.ndarray, type_id: int) -> np.ndarray:
    """Raw bytes of whole blocks (any shape, C-contiguous per block) -> flat float32 values."""
    bv, bb = BLOCK_SIZES[type_id]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, bb)
    fn = _DEQUANTIZERS[type_id]
    into = _DEQUANTIZE_INTO.get(type_id)
    n = blocks.shape[0]
    out = np.empty((n, bv), dtype=np.float32)
    # cache-sized steps for the types decoded in place (their temporaries stay in L2); a file's
    # inf/NaN scales decode to inf/NaN values, as in ggml; that is data, not a warning
    step = _INTO_CHUNK_VALUES // bv if into is not None else _CHUNK_BLOCKS
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, n, step):
            stop = min(n, start + step)
            if into is not None:
                into(blocks[start:stop], out[start:stop])
            else:
                out[start:stop] = fn(blocks[start:stop])
    return out.reshape(-1)


def _check_supported(info, path) -> None:
    if int(info.ggml_type) not in SUPPORTED_TYPES:
        names = ", ".join(sorted(type_name(t) for t in SUPPORTED_TYPES))
        raise UnsupportedQuantError(
            path,
            f"tensor type {type_name(info.ggml_type)} (ggml type {int(info.ggml_type)}) is not supported; "
            f"minecart decodes {names}. Re-quantize the model to one of these, e.g. "
            f"`llama-quantize --allow-requantize IN.gguf OUT.gguf Q4_K_M` (or Q8_0)",
            tensor=info.name,
        )


def _expected_bytes(info) -> int:
    shape = tuple(int(s) for s in info.shape)
    n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    return n_rows * bytes_per_row(info.ggml_type, shape[-1] if shape else 1)


def dequantize(info, path: str | Path = "<memory>") -> np.ndarray:
    """A whole tensor as float32 in its logical row-major shape (a new array, not tied to the file)."""
    _check_supported(info, path)
    raw = np.asarray(info.raw)
    if raw.size != _expected_bytes(info):
        raise GGUFError(path, f"tensor holds {raw.size} bytes but its shape {tuple(info.shape)} and type "
                        f"{type_name(info.ggml_type)} need {_expected_bytes(info)}; the file is corrupt: "
                        "re-download or re-convert it", tensor=info.name)
    return dequantize_blocks(raw, int(info.ggml_type)).reshape(tuple(info.shape))


def dequantize_rows(info, rows, path: str | Path = "<memory>") -> np.ndarray:
    """Rows `rows` (indices along the first axis) of a tensor with 2+ dimensions, as float32.

    Only those rows are read from the file, so this is how an embedding lookup of a 248320-row table
    works without dequantizing the table. Returns shape (len(rows), *shape[1:]).
    """
    _check_supported(info, path)
    shape = tuple(int(s) for s in info.shape)
    if len(shape) < 2:
        raise ValueError(f"dequantize_rows needs a tensor with 2+ dimensions; {info.name} has shape {shape}")
    idx = np.asarray(rows, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= shape[0]):
        bad = int(idx[(idx < 0) | (idx >= shape[0])][0])
        raise IndexError(f"row {bad} is out of range for {info.name} with {shape[0]} rows")
    raw = np.asarray(info.raw).reshape(shape[0], -1)
    picked = raw[idx]  # reads only these rows from the memory map
    return dequantize_blocks(picked, int(info.ggml_type)).reshape((idx.size, *shape[1:]))


# ---------------------------------------------------------------------------------------------------
# quantizers: float -> raw blocks. Q8_0 and the 32-block types follow ggml's reference rounding (through
# gguf.quants); Q4_K, Q6_K, IQ4_NL and IQ4_XS use a plain absmax/min-max fit with nearest-level codes (no
# error-minimizing search), which is all tests and synthetic models need.


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype("<f2").reshape(-1, 1).view(np.uint8)


def _quant_q4_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)  # x = scale*q - offset with offset >= 0
    hi = np.maximum(sub.max(axis=2), lo)
    step = (hi - lo) / 15.0
    d = (step.max(axis=1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(axis=1) / 63.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(step / d[:, None]), 0).clip(0, 63)
        m = np.where(dmin[:, None] > 0, np.rint(-lo / dmin[:, None]), 0).clip(0, 63)
        scale = (d[:, None] * sc)[:, :, None]
        q = np.where(scale > 0, np.rint((sub + (dmin[:, None] * m)[:, :, None]) / scale), 0)
    q = q.clip(0, 15).astype(np.uint8).reshape(n, 4, 2, 32)
    qs = q[:, :, 0, :] | (q[:, :, 1, :] << np.uint8(4))
    return np.concatenate(
        [_f16_bytes(d), _f16_bytes(dmin), pack_k_scales_mins(sc, m), qs.reshape(n, 128)], axis=1
    )


def _quant_q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    grp = x.reshape(n, 16, 16)
    amax_idx = np.abs(grp).argmax(axis=2)[:, :, None]
    signed_max = np.take_along_axis(grp, amax_idx, axis=2)[:, :, 0]
    step = signed_max / -32.0  # the largest magnitude maps to q = -32 (as ggml does)
    d = (np.abs(step).max(axis=1) / 127.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(step / d[:, None]), 0).clip(-128, 127)
        scale = (d[:, None] * sc)[:, :, None]
        q = np.where(scale != 0, np.rint(grp / scale), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
    ql = (q[:, :, 0:64] & np.uint8(15)) | ((q[:, :, 64:128] & np.uint8(15)) << np.uint8(4))
    top = (q >> np.uint8(4)).reshape(n, 2, 4, 32)
    qh = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8), _f16_bytes(d)],
        axis=1,
    )


def _iq4_codes(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The nearest KVALUES code of x / scale (scale broadcast over x; 0 where scale is 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(scale != 0, x / scale, 0.0)
    mids = (KVALUES[1:].astype(np.float32) + KVALUES[:-1].astype(np.float32)) / 2
    return np.searchsorted(mids, t).astype(np.uint8)


def _iq4_pack(codes: np.ndarray) -> np.ndarray:
    """(n, 32) codes -> (n, 16) bytes: value j in the low nibble of byte j, value j+16 in its high nibble."""
    return codes[:, :16] | (codes[:, 16:] << np.uint8(4))


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The value of largest magnitude along the last axis (its sign kept)."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]


def _quant_iq4_nl(x: np.ndarray) -> np.ndarray:
    blk = x.reshape(-1, 32)
    d = (_signed_absmax(blk) / -127.0).astype(np.float16)  # the largest magnitude maps to the -127 level
    codes = _iq4_codes(blk, d.astype(np.float32)[:, None])
    return np.concatenate([_f16_bytes(d), _iq4_pack(codes)], axis=1)


def _quant_iq4_xs(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    step = _signed_absmax(sub) / -127.0  # (n, 8) wanted sub-block scales
    d = (np.abs(step).max(axis=1) / 31.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.where(d[:, None] > 0, np.rint(step / d[:, None]), 0).clip(-32, 31).astype(np.int16) + 32
    codes = _iq4_codes(sub, (d[:, None] * (ls - 32).astype(np.float32))[:, :, None])
    scales_h = ((ls >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
    low = (ls & 15).astype(np.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << np.uint8(4))
    qs = _iq4_pack(codes.reshape(n * 8, 32)).reshape(n, 128)
    return np.concatenate([_f16_bytes(d), scales_h.astype("<u2").reshape(n, 1).view(np.uint8), scales_l, qs],
                          axis=1)


def quantize(values: np.ndarray, type_id: int) -> np.ndarray:
    """float values (..., n) -> raw uint8 (..., bytes_per_row) in GGML type `type_id`."""
    x = np.asarray(values, dtype=np.float32)
    shape = x.shape
    row_bytes = bytes_per_row(type_id, shape[-1])
    if type_id == F32:
        out = x.astype("<f4").view(np.uint8)
    elif type_id == F16:
        out = x.astype("<f2").view(np.uint8)
    elif type_id in (Q4_K, Q6_K, IQ4_XS, IQ4_NL):
        fn = {Q4_K: _quant_q4_k, Q6_K: _quant_q6_k, IQ4_XS: _quant_iq4_xs, IQ4_NL: _quant_iq4_nl}[type_id]
        blocks = x.reshape(-1, QK_K) if type_id != IQ4_NL else x.reshape(-1, 32)
        out = np.concatenate([fn(blocks[i : i + _CHUNK_BLOCKS]) for i in range(0, max(len(blocks), 1), _CHUNK_BLOCKS)])
    elif type_id in (BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1):
        import gguf

        out = np.asarray(gguf.quants.quantize(x.reshape(-1, shape[-1]), gguf.GGMLQuantizationType(type_id)))
    else:
        raise ValueError(f"no quantizer for {type_name(type_id)}")
    return np.ascontiguousarray(out, dtype=np.uint8).reshape((*shape[:-1], row_bytes))
