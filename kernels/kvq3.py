"""CuPy launches of kernels/kvq3.cu: the q3 KV cache on the GPU (format: engine/kvquant.py).

What this is: grid/block maths for quantize-on-append, dequantize-to-fp32, the q/output rotations and
rotated-space decode attention, over cache arrays laid out as the NumPy Q3KVCache (codes
(capacity, n_kv, 3D/8) uint8, scales (capacity, n_kv, D/32) float16). What this is not: a KV cache
class (CupyQ3KVCache in engine/backends/cupy_backend.py uses quantize_append + dequantize_into).
tests/gpu/test_kvq3.py checks every launch against engine/kvquant.py.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from .build import HEAD_DIMS, get_kernel


def _check(d: int) -> None:
    if d not in HEAD_DIMS:
        raise ValueError(f"kvq3 kernels are compiled for head dims {HEAD_DIMS}; got {d}")


def alloc(capacity: int, n_kv: int, d: int) -> tuple[cp.ndarray, cp.ndarray]:
    """Empty (codes, scales) cache arrays for `capacity` tokens of one of K or V."""
    _check(d)
    return (cp.zeros((capacity, n_kv, 3 * d // 8), cp.uint8),
            cp.zeros((capacity, n_kv, d // 32), cp.float16))


def quantize_append(x, codes: cp.ndarray, scales: cp.ndarray, start: int,
                    start_ptr: cp.ndarray | None = None) -> None:
    """Quantize x (T, n_kv, D) float32 into cache rows start..start+T-1 of (codes, scales).

    start_ptr (CUDA-graph decode): a device int32 holding the first row, read by the kernel instead of
    `start` (the caller has checked that it is below the capacity)."""
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    T, n_kv, D = x.shape
    _check(D)
    if start_ptr is None and start + T > codes.shape[0]:
        raise ValueError(f"q3 cache of {codes.shape[0]} rows cannot take rows {start}..{start + T - 1}")
    if T:
        get_kernel("kvq3", f"kvq3_quantize<{D}>")(
            (T * n_kv,), (D,), (x, codes, scales, np.int32(T), np.int32(n_kv), np.int32(start),
                                start_ptr if start_ptr is not None else np.uint64(0)))


def dequantize_into(codes: cp.ndarray, scales: cp.ndarray, out: cp.ndarray, kv_len: int,
                    len_ptr: cp.ndarray | None = None) -> None:
    """Rows [0, kv_len) of (codes, scales) -> out[:kv_len] (rows, n_kv, D) float32, in the model's space.

    len_ptr (CUDA-graph decode): a device int32 holding the length before this step's append; the
    kernel then covers kv_len = *len_ptr + 1 rows and the grid spans every row of `out`."""
    rows, n_kv, D = out.shape
    _check(D)
    if out.dtype != cp.float32 or not out.flags.c_contiguous or rows > codes.shape[0]:
        raise ValueError("dequantize_into needs a C-contiguous float32 out of at most the cache's rows")
    span = rows if len_ptr is not None else min(int(kv_len), rows)
    if span:
        get_kernel("kvq3", f"kvq3_dequant<{D}>")(
            (span * n_kv,), (D,), (codes, scales, out, np.int32(n_kv), np.int32(kv_len),
                                   len_ptr if len_ptr is not None else np.uint64(0)))


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


def decode_attention(q, k_codes, k_scales, v_codes, v_scales, kv_len: int, scale: float,
                     window: int = 0) -> cp.ndarray:
    """One query token q (1, nh, D) attending to cache rows [0, kv_len) (the query is the last row):
    rotate q, attend in the rotated space, inverse-rotate the output -> (1, nh, D) float32."""
    _, nh, D = q.shape
    n_kv = k_codes.shape[1]
    if v_codes.shape[2] * 8 // 3 != D:
        raise ValueError("kvq3 decode needs equal K and V head dims")
    q_rot = rotate(q)
    out_rot = cp.empty((nh, D), cp.float32)
    get_kernel("kvq3", f"kvq3_decode<{D}>")(
        (nh,), (128,), (q_rot, k_codes, k_scales, v_codes, v_scales, out_rot, np.int32(nh), np.int32(n_kv),
                        np.int32(kv_len), np.float32(scale), np.int32(window)))
    return unrotate(out_rot).reshape(1, nh, D)


def flash_decode(q, k_codes, k_scales, v_codes, v_scales, kv_len: int, scale: float, window: int = 0,
                 kv_len_ptr: cp.ndarray | None = None) -> cp.ndarray:
    """One query token q (1, nh, D) over q3 cache rows [0, kv_len) (the query is the last row), in the
    rotated space with a context split like ops.attention's flash_decode: rotate q, kvq3_flash_decode
    per (KV head, split), attention.cu's flash_merge, inverse-rotate -> (1, nh, D) float32.

    kv_len_ptr (CUDA-graph decode): a device int32 holding the length before this token's append; the
    split is then sized for the whole cache capacity. Needs nh / n_kv <= 8 (`fits_flash_decode`)."""
    import math

    from .ops import sm_count

    _, nh, D = q.shape
    n_kv = k_codes.shape[1]
    if not fits_flash_decode(nh, n_kv, D, v_codes.shape[2] * 8 // 3):
        raise ValueError(f"kvq3 flash_decode needs nh / n_kv <= 8 and equal K/V dims in {HEAD_DIMS}")
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
    get_kernel("attention", "flash_merge")((nh,), (min(256, max(32, D)),),
                                     (po, pm, pl, out_rot, np.int32(n_splits), np.int32(nh), np.int32(D)))
    return unrotate(out_rot).reshape(1, nh, D)


def fits_flash_decode(nh: int, n_kv: int, d: int, dv: int) -> bool:
    """Whether `flash_decode` takes this shape (at most 8 query heads per KV head, equal K/V dims)."""
    return d in HEAD_DIMS and dv == d and n_kv > 0 and nh % n_kv == 0 and nh // n_kv <= 8
