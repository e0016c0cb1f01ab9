"""CuPy launches of kernels/kvq3.cu: the q3 KV cache on the GPU (format: engine/kvquant.py).

What this is: grid/block maths for quantize-on-append, the q/output rotations and attention read straight
from the codes (single-token split decode and multi-token prefill, both in the rotated space), over cache
arrays laid out as the NumPy Q3KVCache (K codes (capacity, n_kv, 3D/8) and V codes (capacity, n_kv, 2D/8)
uint8, scales (capacity, n_kv, D/64) float16 each). What this is not: a KV cache class (CupyQ3KVCache in
engine/backends/cupy_backend.py holds the arrays and calls quantize_append + attention).
tests/gpu/test_kvq3.py checks every launch against engine/kvquant.py.
"""

from __future__ import annotations

import math

import cupy as cp
import numpy as np

from .build import HEAD_DIMS, get_kernel

K_BITS, V_BITS, BLOCK = 3, 2, 64  # = engine/kvquant.py K_BITS, V_BITS, BLOCK (a test checks)
MAX_GROUP = 8  # kvq3_flash_decode serves at most this many query heads per KV head


def _check(d: int) -> None:
    if d not in HEAD_DIMS:
        raise ValueError(f"kvq3 kernels are compiled for head dims {HEAD_DIMS}; got {d}")


def alloc(capacity: int, n_kv: int, d: int, bits: int) -> tuple[cp.ndarray, cp.ndarray]:
    """Empty (codes, scales) cache arrays for `capacity` tokens of K (bits 3) or V (bits 2)."""
    _check(d)
    return (cp.zeros((capacity, n_kv, bits * d // 8), cp.uint8),
            cp.zeros((capacity, n_kv, d // BLOCK), cp.float16))


def _bits(codes: cp.ndarray, d: int) -> int:
    bits = codes.shape[2] * 8 // d
    if bits not in (K_BITS, V_BITS) or codes.shape[2] * 8 != bits * d:
        raise ValueError(f"q3 code rows of {codes.shape[2]} bytes do not hold {d} values of 2 or 3 bits")
    return bits


def quantize_append(x, codes: cp.ndarray, scales: cp.ndarray, start: int,
                    start_ptr: cp.ndarray | None = None, ref: cp.ndarray | None = None) -> None:
    """Quantize x (T, n_kv, D) float32 into cache rows start..start+T-1 of (codes, scales); the code
    width (3 bits for K, 2 for V) follows from the codes array's row length.

    start_ptr (CUDA-graph decode): a device int32 holding the first row, read by the kernel instead of
    `start` (the caller has checked that it is below the capacity). ref: the keys' reference row
    (n_kv, D) float32 (engine/kvquant.py Q3KVCache.k_ref), subtracted before quantizing."""
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    T, n_kv, D = x.shape
    _check(D)
    bits = _bits(codes, D)
    if codes.shape[1] != n_kv or scales.shape[1:] != (n_kv, D // BLOCK):
        raise ValueError(f"q3 cache arrays {codes.shape}/{scales.shape} do not match rows of {n_kv} x {D}")
    if start_ptr is None and start + T > codes.shape[0]:
        raise ValueError(f"q3 cache of {codes.shape[0]} rows cannot take rows {start}..{start + T - 1}")
    if ref is not None and (ref.shape != (n_kv, D) or ref.dtype != cp.float32 or not ref.flags.c_contiguous):
        raise ValueError(f"the q3 reference row must be a contiguous float32 ({n_kv}, {D}) array")
    if T:
        get_kernel("kvq3", f"kvq3_quantize<{D}, {bits}>")(
            (T * n_kv,), (D,), (x, codes, scales, np.int32(T), np.int32(n_kv), np.int32(start),
                                start_ptr if start_ptr is not None else np.uint64(0),
                                ref if ref is not None else np.uint64(0)))


def rotate(x) -> cp.ndarray:
    """R x over the last axis (D), float32."""
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    D = x.shape[-1]
    _check(D)
    y = cp.empty_like(x)
    if x.size:
        get_kernel("kvq3", f"kvq3_rotate<{D}>")((x.size // D,), (D,), (x, y))
    return y


def unrotate(y) -> cp.ndarray:
    """R^T y over the last axis (D), float32."""
    y = cp.ascontiguousarray(y, dtype=cp.float32)
    D = y.shape[-1]
    _check(D)
    x = cp.empty_like(y)
    if y.size:
        get_kernel("kvq3", f"kvq3_unrotate<{D}>")((y.size // D,), (D,), (y, x))
    return x


def fits_flash_decode(nh: int, n_kv: int) -> bool:
    """Whether a single-token step can take `flash_decode` (at most MAX_GROUP query heads per KV head)."""
    return n_kv > 0 and nh % n_kv == 0 and nh // n_kv <= MAX_GROUP


def _check_cache(q, k_codes, k_scales, v_codes, v_scales) -> tuple[int, int, int, int]:
    T, nh, D = q.shape
    _check(D)
    n_kv = k_codes.shape[1]
    if _bits(k_codes, D) != K_BITS or _bits(v_codes, D) != V_BITS:
        raise ValueError(f"q3 attention needs K codes of {K_BITS} bits and V codes of {V_BITS} bits per value "
                         f"(rows of {K_BITS * D // 8} and {V_BITS * D // 8} bytes)")
    if n_kv == 0 or nh % n_kv or v_codes.shape[1] != n_kv:
        raise ValueError(f"q3 attention needs the query heads ({nh}) to be a multiple of the KV heads ({n_kv})")
    for s in (k_scales, v_scales):
        if s.shape[1:] != (n_kv, D // BLOCK) or s.shape[0] != k_codes.shape[0]:
            raise ValueError(f"q3 scales {s.shape} do not match codes {k_codes.shape}")
    return T, nh, D, n_kv


def flash_decode(q, k_codes, k_scales, v_codes, v_scales, kv_len: int, scale: float, window: int = 0,
                 kv_len_ptr: cp.ndarray | None = None) -> cp.ndarray:
    """One query token q (1, nh, D) over q3 cache rows [0, kv_len) (the query is the last row), in the
    rotated space with a context split like ops.attention's flash_decode: rotate q, kvq3_flash_decode
    per (KV head, split), attention.cu's flash_merge, inverse-rotate -> (1, nh, D) float32.

    kv_len_ptr (CUDA-graph decode): a device int32 holding the length before this token's append; the
    split is then sized for the whole cache capacity. Needs `fits_flash_decode`."""
    from .ops import MERGE_THREADS, merge_grid, sm_count

    _, nh, D, n_kv = _check_cache(q, k_codes, k_scales, v_codes, v_scales)
    if q.shape[0] != 1 or not fits_flash_decode(nh, n_kv):
        raise ValueError(f"kvq3 flash_decode takes one token and at most {MAX_GROUP} query heads per KV head")
    q_rot = rotate(q.reshape(nh, D))
    span = k_codes.shape[0] if kv_len_ptr is not None else int(kv_len)
    want = max(1, (6 * sm_count()) // n_kv)
    split_len = max(32, math.ceil(span / want / 32) * 32)
    n_splits = max(1, math.ceil(span / split_len))
    po = cp.empty((n_splits, nh, D), dtype=cp.float32)
    pm = cp.empty((n_splits, nh), dtype=cp.float32)
    pl = cp.empty((n_splits, nh), dtype=cp.float32)
    get_kernel("kvq3", f"kvq3_flash_decode<{D}>")(
        (n_kv, n_splits), (128,), (q_rot, k_codes, k_scales, v_codes, v_scales, po, pm, pl, np.int32(nh),
                                   np.int32(n_kv), np.int32(kv_len),
                                   kv_len_ptr if kv_len_ptr is not None else np.uint64(0),
                                   np.int32(split_len), np.float32(scale), np.int32(window)))
    out_rot = cp.empty((nh, D), dtype=cp.float32)
    get_kernel("attention", "flash_merge")(merge_grid(nh, D), (MERGE_THREADS,),
                                     (po, pm, pl, out_rot, np.int32(n_splits), np.int32(nh), np.int32(D)))
    return unrotate(out_rot).reshape(1, nh, D)


def prefill(q, k_codes, k_scales, v_codes, v_scales, start: int, kv_len: int, scale: float,
            window: int = 0) -> cp.ndarray:
    """Queries q (T, nh, D) at positions start..start+T-1 over q3 cache rows [0, kv_len) (the T rows
    already appended): rotate q, kvq3_prefill (causal, GQA, optional window), inverse-rotate ->
    (T, nh, D) float32. Any T >= 1 (the eager path of a step that cannot take flash_decode)."""
    T, nh, D, n_kv = _check_cache(q, k_codes, k_scales, v_codes, v_scales)
    if not (0 <= start and start + T <= kv_len <= k_codes.shape[0]):
        raise ValueError(f"q3 prefill: queries at {start}..{start + T - 1} need cache rows up to {kv_len} "
                         f"<= {k_codes.shape[0]}")
    q_rot = rotate(q)
    out_rot = cp.empty((T, nh, D), dtype=cp.float32)
    if T:
        get_kernel("kvq3", f"kvq3_prefill<{D}>")(
            (math.ceil(T / 32), nh), (128,), (q_rot, k_codes, k_scales, v_codes, v_scales, out_rot, np.int32(T),
                                              np.int32(nh), np.int32(n_kv), np.int32(start), np.int32(kv_len),
                                              np.float32(scale), np.int32(window)))
    return unrotate(out_rot)


def attention(q, k_codes, k_scales, v_codes, v_scales, start: int, kv_len: int, scale: float, window: int = 0,
              kv_len_ptr: cp.ndarray | None = None) -> cp.ndarray:
    """Causal GQA attention of q (T, nh, D) at positions start.. over q3 cache rows [0, kv_len), read
    from the codes: a single token with at most MAX_GROUP query heads per KV head takes flash_decode,
    everything else prefill. kv_len_ptr (CUDA-graph decode, single token only): as flash_decode's."""
    T, nh = q.shape[0], q.shape[1]
    n_kv = k_codes.shape[1]
    if T == 1 and fits_flash_decode(nh, n_kv):
        return flash_decode(q, k_codes, k_scales, v_codes, v_scales, kv_len, scale, window, kv_len_ptr)
    if kv_len_ptr is not None:
        raise ValueError("a device-side context length needs a single token and at most "
                         f"{MAX_GROUP} query heads per KV head")
    return prefill(q, k_codes, k_scales, v_codes, v_scales, start, kv_len, scale, window)
