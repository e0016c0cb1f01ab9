"""The "q3" KV cache: Walsh-Hadamard rotation + Lloyd-Max scalar codebooks, 2.75 bits per value.

What this is: the host (NumPy) specification of the q3 KV format and the NumPy backend's q3 cache
(`Q3KVCache`). Every K and V row that attention appends (per token, per KV head, AFTER RoPE, so a
partial-RoPE head is rotated as one whole vector: the rotated-by-RoPE dims and the pass-through dims
are mixed together, which is what spreads the energy evenly) is stored as:

0. keys only: centred, x = k - k_ref, k_ref the cache's fixed reference row (the mean of its first
   append's keys; softmax ignores the shift, see Q3KVCache). Values are stored as they come.
1. rotated: y = H_d (s * x), H_d the normalized Sylvester Walsh-Hadamard matrix (entries +-1/sqrt(d),
   d = 64/128/256, a power of two) and s a fixed +-1 sign per dimension (`rotation_signs`). The sign
   flips cost nothing and stop a constant or Hadamard-row shaped vector (all dims equal) from landing
   in a single coordinate. R = H_d diag(s) is orthonormal, so R^-1 = R^T = diag(s) H_d.
   After the rotation every coordinate is a mix of all d inputs, close to Gaussian whatever the
   outlier channels of the input were: that is what makes a Gaussian codebook fit.
2. split into blocks of BLOCK = 64 coordinates; each block gets one scale, stored as float16 (its
   relative rounding, 2^-11, is far below the quantization error). A scale is clipped to the fp16
   maximum (65504): a block of K/V values with an RMS above that would not fit an f16 cache either.
3. codes: K_BITS = 3 for keys (the 8-level Lloyd-Max quantizer of N(0, 1)), V_BITS = 2 for values (the
   4-level one). The scale starts as the block RMS; each coordinate takes the nearest level of
   y / scale (codes ascending with the levels); the scale is then refit by least squares given the
   codes (scale = <y, c> / <c, c>), which lowers the block's squared error for the same codes.
4. packing: a group of 8 codes takes `bits` bytes, code i at bits bits*i.. of the little-endian word
   (3-bit: 8 codes per 3 bytes; 2-bit: 4 codes per byte).
So a K row costs 3.25 and a V row 2.25 bits per value (2.75 on average: Qwen3.5-27B at 262,144 tokens
holds 2.95 GB of KV). Why this split (keys get the bits, values fewer), the block size and the measured
quality: docs/kv-cache.md.

Dequantize = level[code] * scale, then the inverse rotation. The NumPy backend dequantizes what it
reads and runs the ordinary fp64 attention on it (the reference path: the cache "holds" the
dequantized K and V). Because R is orthonormal, q . k = (R q) . (R k) and sum_j p_j v_j =
R^T sum_j p_j (R v_j), so a GPU kernel can instead rotate q once, score against the rotated codes
and inverse-rotate only the output row (`attention_rotated` below is that form; a test checks both
agree to rounding).

What this is not: the CUDA implementation (kernels/kvq3.cu, used by the CuPy backend: it attends in
the rotated space straight from the codes) or a fast CPU path.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .errors import RequestError

# The KV cache types the backends store (docs/kv-cache.md): "f16" (the default, as llama.cpp's), "f32"
# (exact), "q8_0" (llama.cpp's Q8_0 blocks: 32 int8 + an fp16 scale) and "q3" (this file's format).
# KV_BYTES_PER_VALUE is what each cache allocates per stored value (engine/placement.py prices with it).
KV_TYPES = ("f32", "f16", "q8_0", "q3")
DEFAULT_KV_TYPE = "f16"
Q8_BLOCK = 32  # values per fp16 scale of a q8_0 block
BLOCK = 64  # q3: rotated values per fp16 scale
K_BITS = 3  # q3: bits per key code (8 Lloyd-Max levels)
V_BITS = 2  # q3: bits per value code (4 Lloyd-Max levels)
# q8_0: the int8 values plus one fp16 scale per Q8_BLOCK; q3: the K/V average of codes + one fp16 scale
# per BLOCK (K 3.25 and V 2.25 bits: 11/32 bytes per value, exact whenever K and V rows have the same
# length, which every supported model has and the CUDA backend requires)
KV_BYTES_PER_VALUE = {"f32": 4.0, "f16": 2.0, "q8_0": 1 + 2 / Q8_BLOCK,
                      "q3": (K_BITS + V_BITS) / 16 + 2 / BLOCK}

# The Lloyd-Max quantizers of N(0, 1) with 8 and 4 levels: levels (ascending) and the decision thresholds
# between them (midpoints of neighbouring levels). Computed once by `derive_lloyd_max(n)` (float64
# Lloyd iteration to a fixed point, repr digits kept); tests/engine/test_kvquant.py re-derives them.
# Mean squared error per unit-variance sample: 0.034548 (8 levels), 0.117482 (4 levels).
LEVELS = np.array([
    -2.151945704536989, -1.3439092785050035, -0.7560052812058804, -0.2450941789442228,
    0.2450941789442228, 0.7560052812058804, 1.3439092785050035, 2.151945704536989,
], dtype=np.float64)
LEVELS2 = np.array([-1.5104176084990963, -0.4527800346364924, 0.4527800346364924, 1.5104176084990963],
                   dtype=np.float64)
CODEBOOKS = {3: LEVELS, 2: LEVELS2}  # bits -> levels
THRESHOLDS = (LEVELS[1:] + LEVELS[:-1]) / 2.0
LEVELS_F32 = LEVELS.astype(np.float32)
N_LEVELS = len(LEVELS)
FP16_MAX = 65504.0


# ------------------------------------------------------------------------------------------------
# the codebook


def _normal_pdf(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi) if math.isfinite(x) else 0.0


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def derive_lloyd_max(n_levels: int = N_LEVELS, *, max_iter: int = 10_000, tol: float = 1e-15):
    """Lloyd's iteration for the minimum-MSE scalar quantizer of a unit Gaussian, in float64.

    Alternates: thresholds = midpoints of the levels; levels = E[x | x in cell] (for N(0,1) on
    (a, b): (pdf(a) - pdf(b)) / (cdf(b) - cdf(a))). Starts from evenly spaced levels; stops when no
    level moves by more than `tol` (about 300 iterations for 8 levels). Returns (levels, thresholds, mse), levels ascending."""
    levels = np.linspace(-2.0, 2.0, n_levels)
    for _ in range(max_iter):
        edges = np.concatenate(([-np.inf], (levels[1:] + levels[:-1]) / 2.0, [np.inf]))
        new = np.array([
            (_normal_pdf(a) - _normal_pdf(b)) / (_normal_cdf(b) - _normal_cdf(a))
            for a, b in zip(edges[:-1], edges[1:], strict=True)
        ])
        moved = float(np.max(np.abs(new - levels)))
        levels = new
        if moved <= tol:
            break
    levels = (levels - levels[::-1]) / 2.0  # exactly symmetric (the iteration leaves ~1e-16 skew)
    thresholds = (levels[1:] + levels[:-1]) / 2.0
    # E[(x - Q(x))^2] = E[x^2] - sum_i level_i^2 P(cell_i) for centroid levels (orthogonality)
    edges = np.concatenate(([-np.inf], thresholds, [np.inf]))
    mass = np.array([_normal_cdf(b) - _normal_cdf(a) for a, b in zip(edges[:-1], edges[1:], strict=True)])
    mse = 1.0 - float(np.sum(levels**2 * mass))
    return levels, thresholds, mse


# ------------------------------------------------------------------------------------------------
# the rotation


def _check_dim(d: int, block: int = BLOCK) -> None:
    if d < block or d & (d - 1):
        raise RequestError(
            f"the q3 KV cache needs a head dimension that is a power of two and at least {block} "
            f"(Walsh-Hadamard rotation, {block}-value scale blocks); this model has {d}: use kv_type 'f32'")


def rotation_signs(d: int) -> np.ndarray:
    """Fixed +-1.0 per dimension (float64 (d,)): bit 31 of a murmur3-style hash of the index, so a CUDA
    kernel computes the same signs without a table."""
    i = np.arange(d, dtype=np.uint64)
    h = ((i + np.uint64(1)) * np.uint64(0x9E3779B1)) & np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(13)
    return np.where((h >> np.uint64(31)) & np.uint64(1), -1.0, 1.0)


_HADAMARD: dict[int, np.ndarray] = {}


def hadamard(d: int) -> np.ndarray:
    """The normalized Sylvester Walsh-Hadamard matrix (d, d) float64: symmetric, H @ H = I."""
    if d not in _HADAMARD:
        _check_dim(d)
        h = np.ones((1, 1))
        while h.shape[0] < d:
            h = np.block([[h, h], [h, -h]])
        _HADAMARD[d] = h / math.sqrt(d)
    return _HADAMARD[d]


def rotate(x: np.ndarray) -> np.ndarray:
    """R x for every row of x (..., d): float64."""
    d = x.shape[-1]
    return (np.asarray(x, np.float64) * rotation_signs(d)) @ hadamard(d)  # H symmetric: row @ H = (H x)^T


def unrotate(y: np.ndarray) -> np.ndarray:
    """R^T y for every row of y (..., d): float64 (the inverse of `rotate`)."""
    d = y.shape[-1]
    return (np.asarray(y, np.float64) @ hadamard(d)) * rotation_signs(d)


# ------------------------------------------------------------------------------------------------
# codes


def pack3(codes: np.ndarray) -> np.ndarray:
    """uint8 codes 0..7 (..., n), n a multiple of 8 -> uint8 (..., 3n/8): 8 codes per 3 bytes, code i
    of a group at bits 3i..3i+2 of the little-endian 24-bit word."""
    c = np.asarray(codes)
    n = c.shape[-1]
    if n % 8:
        raise ValueError(f"pack3 needs a multiple of 8 codes per row, got {n}")
    g = c.reshape(c.shape[:-1] + (n // 8, 8)).astype(np.uint32)
    word = np.zeros(g.shape[:-1], np.uint32)
    for i in range(8):
        word |= (g[..., i] & 7) << (3 * i)
    out = np.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], axis=-1).astype(np.uint8)
    return out.reshape(c.shape[:-1] + (3 * n // 8,))


def unpack3(packed: np.ndarray) -> np.ndarray:
    """The inverse of `pack3`: uint8 (..., 3m) -> uint8 codes (..., 8m)."""
    p = np.asarray(packed, np.uint8)
    m = p.shape[-1] // 3
    b = p.reshape(p.shape[:-1] + (m, 3)).astype(np.uint32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    codes = np.stack([(word >> (3 * i)) & 7 for i in range(8)], axis=-1).astype(np.uint8)
    return codes.reshape(p.shape[:-1] + (8 * m,))


def pack2(codes: np.ndarray) -> np.ndarray:
    """uint8 codes 0..3 (..., n), n a multiple of 4 -> uint8 (..., n/4): code i of a byte at bits 2i..2i+1."""
    c = np.asarray(codes)
    n = c.shape[-1]
    if n % 4:
        raise ValueError(f"pack2 needs a multiple of 4 codes per row, got {n}")
    g = c.reshape(c.shape[:-1] + (n // 4, 4)).astype(np.uint8) & 3
    return (g[..., 0] | (g[..., 1] << 2) | (g[..., 2] << 4) | (g[..., 3] << 6)).astype(np.uint8)


def unpack2(packed: np.ndarray) -> np.ndarray:
    """The inverse of `pack2`: uint8 (..., m) -> uint8 codes (..., 4m)."""
    p = np.asarray(packed, np.uint8)
    codes = np.stack([(p >> (2 * i)) & 3 for i in range(4)], axis=-1).astype(np.uint8)
    return codes.reshape(p.shape[:-1] + (4 * p.shape[-1],))


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    return pack3(codes) if bits == 3 else pack2(codes)


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    return unpack3(packed) if bits == 3 else unpack2(packed)


def quantize_rotated(y: np.ndarray, bits: int = K_BITS, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Already-rotated rows y (..., d) -> (packed `bits`-bit codes uint8 (..., bits*d/8), scales float16
    (..., d/block)). Per block: first scale = the block RMS, codes = the nearest level of y / scale (ties
    go to the lower level), then the least-squares scale for those codes, rounded to fp16."""
    levels = CODEBOOKS[bits]
    thresholds = (levels[1:] + levels[:-1]) / 2.0
    y = np.asarray(y, np.float64)
    d = y.shape[-1]
    blocks = y.reshape(y.shape[:-1] + (d // block, block))
    rms = np.sqrt(np.mean(blocks * blocks, axis=-1, keepdims=True))
    safe = np.where(rms > 0, rms, 1.0)
    codes = np.searchsorted(thresholds, blocks / safe).astype(np.uint8)  # nearest level (ties go down)
    c = levels[codes]
    cc = np.sum(c * c, axis=-1)  # > 0: every level is nonzero
    scale = np.sum(blocks * c, axis=-1) / cc  # least-squares scale for these codes, >= 0
    scale = np.minimum(scale, FP16_MAX).astype(np.float16)
    return pack(codes.reshape(y.shape), bits), scale


def dequantize_rotated(packed: np.ndarray, scales: np.ndarray, bits: int = K_BITS) -> np.ndarray:
    """Rotated-space rows (..., d) float32 = level[code] * scale (no inverse rotation); the block length
    is d / (number of scales)."""
    codes = unpack(packed, bits)
    d = codes.shape[-1]
    nb = np.asarray(scales).shape[-1]
    vals = CODEBOOKS[bits].astype(np.float32)[codes].reshape(codes.shape[:-1] + (nb, d // nb))
    vals = vals * np.asarray(scales, np.float32)[..., None]
    return vals.reshape(codes.shape)


def quantize(x: np.ndarray, bits: int = K_BITS, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Rows x (..., d) in the model's space -> (packed codes, float16 scales); see the module doc."""
    _check_dim(x.shape[-1], block)
    return quantize_rotated(rotate(x), bits, block)


def dequantize(packed: np.ndarray, scales: np.ndarray, bits: int = K_BITS) -> np.ndarray:
    """(packed codes, scales) -> rows (..., d) float32 in the model's space (inverse rotation applied)."""
    return unrotate(dequantize_rotated(packed, scales, bits)).astype(np.float32)


def bytes_per_row(d: int, bits: int = K_BITS, block: int = BLOCK) -> int:
    """Stored bytes of one q3 row of d values: bits*d/8 code bytes + 2 bytes per `block`-value scale."""
    return bits * d // 8 + 2 * (d // block)


# ------------------------------------------------------------------------------------------------
# q8_0: llama.cpp's Q8_0 block (ggml quantize_row_q8_0_ref), kept as int8 values + fp16 scales


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows x (..., d), d a multiple of 32 -> (int8 (..., d), float16 scales (..., d/32)), as ggml's
    reference does it: per block of 32, d = max|x| / 127 (fp32), q = round-half-away(x / d), scale
    stored as fp16 (the quantization used the fp32 d)."""
    x = np.asarray(x, np.float32)
    n = x.shape[-1]
    blocks = x.reshape(x.shape[:-1] + (n // Q8_BLOCK, Q8_BLOCK))
    d = np.max(np.abs(blocks), axis=-1, keepdims=True) / np.float32(127.0)
    inv = np.divide(np.float32(1.0), d, out=np.zeros_like(d), where=d != 0)
    y = blocks * inv
    # roundf (halves away from zero) without the a + 0.5 rounding trap (0.49999997 + 0.5 == 1.0 in fp32)
    a = np.abs(y)
    whole = np.floor(a)
    q = np.sign(y) * (whole + np.floor(2 * (a - whole)))
    return q.astype(np.int8).reshape(x.shape), d[..., 0].astype(np.float16)


def dequantize_q8_0(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(int8 (..., d), float16 (..., d/32)) -> float32 (..., d): value x scale."""
    n = q.shape[-1]
    blocks = q.astype(np.float32).reshape(q.shape[:-1] + (n // Q8_BLOCK, Q8_BLOCK))
    return (blocks * np.asarray(scales, np.float32)[..., None]).reshape(q.shape)


def check_q8_dims(*dims: int) -> None:
    for d in dims:
        if d % Q8_BLOCK:
            raise RequestError(f"the q8_0 KV cache stores blocks of {Q8_BLOCK} values; this model's head "
                               f"dimension {d} is not a multiple of {Q8_BLOCK}: use kv_type 'f16'")


def check_kv_type(kv_type: str) -> str:
    if kv_type not in KV_TYPES:
        raise RequestError(f"KV cache type '{kv_type}' is not known; use one of {', '.join(KV_TYPES)}")
    return kv_type


# ------------------------------------------------------------------------------------------------
# attention in the rotated space (the form a GPU kernel uses; the NumPy backend dequantizes instead)


def attention_rotated(q: np.ndarray, k_packed, k_scales, v_packed, v_scales, *, scale: float,
                      q_positions: np.ndarray, window: int = 0) -> np.ndarray:
    """Causal GQA attention of q (T, nh, d) over a q3 cache of L rows (K: 3-bit codes (L, n_kv, 3d/8),
    V: 2-bit codes (L, n_kv, dv/4), scales (L, n_kv, d/BLOCK) each) without leaving the rotated space
    for K or V: scores = (R q) . k_rot, output = R^T (p @ v_rot). The keys' reference row (Q3KVCache
    k_ref) is not needed: it shifts every score of a query alike. q_positions: absolute index of each
    query (T,). Returns (T, nh, dv) float32."""
    T, nh, _ = q.shape
    k_rot = dequantize_rotated(k_packed, k_scales, K_BITS).astype(np.float64)  # (L, n_kv, d)
    v_rot = dequantize_rotated(v_packed, v_scales, V_BITS).astype(np.float64)  # (L, n_kv, dv)
    L, n_kv, dv = v_rot.shape
    group = nh // n_kv
    q_rot = rotate(q)  # (T, nh, d)
    k_pos = np.arange(L)
    visible = k_pos[None, :] <= q_positions[:, None]
    if window > 0:
        visible &= k_pos[None, :] > q_positions[:, None] - window
    out_rot = np.empty((T, nh, dv))
    for h in range(nh):
        s = (q_rot[:, h, :] @ k_rot[:, h // group, :].T) * scale
        s = np.where(visible, s, -np.inf)
        s -= s.max(axis=1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=1, keepdims=True)
        out_rot[:, h, :] = p @ v_rot[:, h // group, :]
    return unrotate(out_rot).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# the NumPy backend's cache


class Q3KVCache:
    """K and V of one attention layer for one sequence in the q3 format: K codes (capacity, n_kv,
    k_bits*d/8) and V codes (capacity, n_kv, v_bits*dv/8) uint8, scales (capacity, n_kv, d/block)
    float16, first `length` valid.

    Same contract as NumpyKVCache (append / truncate / clone, growing by doubling past `capacity`);
    `read(L)` returns the dequantized first L rows of K and V as float32 for the reference attention.
    Rows are quantized once, on append, so re-reading never adds error.

    Keys are stored centred: `k_ref` (n_kv, d) float32 is the mean of the FIRST append's K rows per
    KV head (float64 mean rounded to float32), fixed for the cache's life (truncate and clone keep it),
    and every K row is quantized as k - k_ref (float32 subtraction). Attention needs no correction:
    q . (k - k_ref) differs from q . k by q . k_ref, the same for every key of a query, and softmax is
    blind to that shift. `read` adds k_ref back. Real models' keys share a large common component
    (50-80% of the energy on the demo model, docs/kv-cache.md); centring stops the 3-bit error from
    scaling with it. k_ref is one fp32 row per KV head per layer, not per token (not in `nbytes`).
    k_bits / v_bits / block: the
    format (the engine uses the module's K_BITS, V_BITS, BLOCK; other values are for measuring
    candidate formats, docs/kv-cache.md).
    """

    kv_type = "q3"

    def __init__(self, n_kv_heads: int, head_dim: int, value_dim: int, capacity: int, *,
                 k_bits: int = K_BITS, v_bits: int = V_BITS, block: int = BLOCK):
        _check_dim(head_dim, block)
        _check_dim(value_dim, block)
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.value_dim = value_dim
        self.k_bits, self.v_bits, self.block = k_bits, v_bits, block
        self.capacity = max(1, int(capacity))
        self.length = 0
        self.k_codes, self.k_scales = self._alloc(self.capacity, head_dim, k_bits)
        self.v_codes, self.v_scales = self._alloc(self.capacity, value_dim, v_bits)
        self.k_ref: np.ndarray | None = None  # set by the first append

    def _alloc(self, rows: int, d: int, bits: int):
        return (np.zeros((rows, self.n_kv_heads, bits * d // 8), np.uint8),
                np.zeros((rows, self.n_kv_heads, d // self.block), np.float16))

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        need = self.length + k.shape[0]
        if need > self.capacity:
            new_cap = max(need, 2 * self.capacity)
            for name in ("k_codes", "k_scales", "v_codes", "v_scales"):
                old = getattr(self, name)
                grown = np.zeros((new_cap,) + old.shape[1:], old.dtype)
                grown[: self.length] = old[: self.length]
                setattr(self, name, grown)
            self.capacity = new_cap
        k = np.asarray(k, np.float32)
        if self.k_ref is None:
            self.k_ref = np.asarray(np.mean(k, axis=0, dtype=np.float64), np.float32)
        self.k_codes[self.length : need], self.k_scales[self.length : need] = quantize(
            k - self.k_ref, self.k_bits, self.block)
        self.v_codes[self.length : need], self.v_scales[self.length : need] = quantize(v, self.v_bits, self.block)
        self.length = need

    def read(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Dequantized K (L, n_kv, d) (k_ref added back) and V (L, n_kv, dv), float32."""
        k = dequantize(self.k_codes[:length], self.k_scales[:length], self.k_bits)
        if self.k_ref is not None:
            k = k + self.k_ref
        return k, dequantize(self.v_codes[:length], self.v_scales[:length], self.v_bits)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a KV cache of {self.length} tokens to {length}")
        self.length = int(length)

    def clone(self) -> Q3KVCache:
        twin = Q3KVCache(self.n_kv_heads, self.head_dim, self.value_dim, self.capacity,
                         k_bits=self.k_bits, v_bits=self.v_bits, block=self.block)
        for name in ("k_codes", "k_scales", "v_codes", "v_scales"):
            getattr(twin, name)[: self.length] = getattr(self, name)[: self.length]
        twin.length = self.length
        twin.k_ref = None if self.k_ref is None else self.k_ref.copy()
        return twin

    @property
    def bytes_per_token(self) -> int:
        """Stored bytes per token of this layer (K and V, every KV head)."""
        return self.n_kv_heads * (bytes_per_row(self.head_dim, self.k_bits, self.block)
                                  + bytes_per_row(self.value_dim, self.v_bits, self.block))

    @property
    def nbytes(self) -> int:
        return int(self.k_codes.nbytes + self.k_scales.nbytes + self.v_codes.nbytes + self.v_scales.nbytes)


# ------------------------------------------------------------------------------------------------
# measuring a model with q3 against f32 (python -m minecart.engine.kv_report MODEL; docs/kv-cache.md)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.sum(np.exp(x), axis=-1, keepdims=True))


def compare_logits(ref: np.ndarray, test: np.ndarray) -> dict:
    """Per-position agreement of two logit arrays (T, vocab): relative L2 error, top-1 match, KL(ref||test)."""
    ref = np.asarray(ref, np.float64)
    test = np.asarray(test, np.float64)
    rel = np.linalg.norm(test - ref, axis=-1) / np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)
    lp, lq = _log_softmax(ref), _log_softmax(test)
    kl = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    top1 = np.argmax(ref, axis=-1) == np.argmax(test, axis=-1)
    return {"positions": int(ref.shape[0]), "rel_err_mean": float(rel.mean()), "rel_err_max": float(rel.max()),
            "top1_agree": float(top1.mean()), "kl_mean": float(kl.mean()), "kl_max": float(kl.max())}


def sequence_logits(model, ids, kv_type: str) -> np.ndarray:
    """Logits (T, vocab) of a fresh sequence with a `kv_type` cache (Model.forward, rows="all")."""
    states = model.new_state(len(ids), kv_type=kv_type)
    try:
        return model.forward([int(t) for t in ids], states, np.arange(len(ids)), rows="all")
    finally:
        model._free_states(states)


def greedy_tokens(model, prompt, n: int, kv_type: str) -> list[int]:
    """n greedy (argmax) tokens after `prompt` with a `kv_type` cache, through a Session."""
    session = model.new_session(kv_type=kv_type)
    try:
        logits = session.prefill([int(t) for t in prompt])
        out: list[int] = []
        for _ in range(n):
            out.append(int(np.argmax(logits)))
            logits = session.step(out[-1])
        return out
    finally:
        session.close()


def kv_bytes_per_token(config, kv_type: str) -> int:
    """Stored KV bytes per token per attention layer (K and V, every KV head; head dims are whole
    blocks, so the product is exact; for q3 when K and V rows have the same length)."""
    values = config.n_kv_heads * (config.head_dim + config.value_head_dim)
    return round(values * KV_BYTES_PER_VALUE[check_kv_type(kv_type)])


def measure(model, sequences: dict, *, greedy: int = 32, kv_type: str = "q3") -> dict:
    """`kv_type` (q3 by default) against f32 on `model` (loaded on the NumPy backend): compare_logits per
    named sequence of token ids, greedy agreement over `greedy` tokens after each, and bytes per token
    per layer of every type."""
    check_kv_type(kv_type)
    report: dict[str, Any] = {"kv_type": kv_type, "sequences": {},
                              "bytes_per_token_layer": {t: kv_bytes_per_token(model.config, t) for t in KV_TYPES}}
    for name, ids in sequences.items():
        row = compare_logits(sequence_logits(model, ids, "f32"), sequence_logits(model, ids, kv_type))
        if greedy:
            a, b = greedy_tokens(model, ids, greedy, "f32"), greedy_tokens(model, ids, greedy, kv_type)
            same = [x == y for x, y in zip(a, b, strict=True)]
            row["greedy_same"] = int(sum(same))
            row["greedy_first_diff"] = same.index(False) if False in same else None
        report["sequences"][name] = row
    return report
