"""CuPy launches for the f16 and q8_0 KV caches (kernels/kv_f16.cu, kernels/kv_q8_0.cu).

What this is: the cache arrays' layout (`alloc`) and appending rows to them (`append`, eagerly at a host
row or at a row held on the device inside a captured decode step). Attention over these caches is
ops.attention(..., kv_type=...), whose kernels (attention.cu in the modules attention_f16 and
attention_q8_0) read the stored values and dequantize them in registers.

Layouts (per K or V, `capacity` rows of n_kv heads x D values):
- f16: float16 (capacity, n_kv, D), rounded to nearest even (NumPy twin: NumpyF16KVCache);
- q8_0: uint8 (capacity, n_kv, D / 32 * 34), ggml Q8_0 blocks (fp16 scale + 32 int8), the bytes gguf-py's
  Q8_0 quantizer writes (NumPy twin: engine/kvquant.py quantize_q8_0 / NumpyQ8KVCache).

What this is not: a cache class (CupyF16KVCache / CupyQ8KVCache in engine/backends/cupy_backend.py).
"""

from __future__ import annotations

import math

import cupy as cp
import numpy as np

from .build import HEAD_DIMS, KV_CACHE_TYPES, get_kernel

Q8_BLOCK_BYTES = 34  # fp16 scale + 32 int8 values


def row_shape(n_kv: int, d: int, kv_type: str) -> tuple[tuple[int, int], type]:
    """(shape after the token axis, dtype) of one token's K or V in a `kv_type` cache."""
    if kv_type not in KV_CACHE_TYPES:
        raise ValueError(f"no kernels for a {kv_type!r} KV cache here ({', '.join(KV_CACHE_TYPES)})")
    if d not in HEAD_DIMS:
        raise ValueError(f"{kv_type} KV cache kernels are compiled for head dims {HEAD_DIMS}; got {d}")
    if kv_type == "f16":
        return (n_kv, d), cp.float16
    return (n_kv, d // 32 * Q8_BLOCK_BYTES), cp.uint8


def alloc(capacity: int, n_kv: int, d: int, kv_type: str) -> cp.ndarray:
    """A zeroed cache array for `capacity` tokens of one of K or V."""
    tail, dtype = row_shape(n_kv, d, kv_type)
    return cp.zeros((capacity,) + tail, dtype)


def append(k, v, kc: cp.ndarray, vc: cp.ndarray, kv_type: str, start: int,
           start_ptr: cp.ndarray | None = None) -> None:
    """Store k (T, n_kv, D) and v (T, n_kv, Dv) float32 in cache rows start..start+T-1 of kc / vc.

    start_ptr (CUDA-graph decode): a device int32 holding the first row, read by the kernel instead of
    `start` (the caller has checked it is below the capacity)."""
    k = cp.ascontiguousarray(k, dtype=cp.float32)
    v = cp.ascontiguousarray(v, dtype=cp.float32)
    T = k.shape[0]
    if T != v.shape[0]:
        raise ValueError(f"K has {T} rows and V {v.shape[0]}")
    if start_ptr is None and start + T > kc.shape[0]:
        raise ValueError(f"a KV cache of {kc.shape[0]} rows cannot take rows {start}..{start + T - 1}")
    if not T:
        return
    ptr = start_ptr if start_ptr is not None else np.uint64(0)
    row_k, row_v = k[0].size, v[0].size
    if kv_type == "f16":
        n = T * max(row_k, row_v)
        get_kernel("attention_f16", "kv_append_f16")(
            (min(4096, math.ceil(n / 256)),), (256,),
            (k, v, kc, vc, np.int32(start), ptr, np.int32(T), np.int32(row_k), np.int32(row_v)))
        return
    if kv_type != "q8_0":
        raise ValueError(f"no kernels for a {kv_type!r} KV cache here ({', '.join(KV_CACHE_TYPES)})")
    for x, c, row in ((k, kc, row_k), (v, vc, row_v)):
        blocks = T * row // 32  # one warp per block, four warps per thread block
        get_kernel("attention_q8_0", "kv_append_q8_0")(
            (math.ceil(blocks / 4),), (128,), (x, c, np.int32(start), ptr, np.int32(T), np.int32(row)))
