"""Causal attention of a few query rows over one sequence's KV cache on the CPU, compiled, and its
NumPy twin.

What this is: the NumPy backend's `attention` after the new keys and values are appended (docs/qwen35.md
3.3; Gemma 3's sliding layers pass a window): for each query row t at absolute position p and head h,
softmax over the visible keys l (l <= p, and l > p - window when a window is set) of
scale * q[t, h] . K[l, h // group], then the values averaged with those weights. Heads share a key head
in contiguous groups (GQA).

The twin (`attend_twin`) is that formula in NumPy, in float64 over every head at once and queries in
blocks (a prompt's chunk never holds more than ATTN_QUERY_BLOCK rows of scores per key). It widens the
whole cache to float64 first, and a decode token pays a dozen array calls per layer and sequence: ~140 us
for one token over 100 f16 keys on the 2-core test machine, most of it the widening and the calls'
fixed cost. A batched decode step pays it once per sequence and layer.

The compiled kernel (`attend`, numba) takes one key head at a time: each visible key row is read once in
the cache's own type (float32, or float16 through an exact 65,536-entry table) and dotted with the
group's queries in float64; the scores' maximum, exponentials and sum are float64 as in the twin; each
value row is read once and added into the group's float64 outputs, divided by the sum at the end. The
products are the twin's; only the order of the sums differs, so the two agree to float32 rounding
(tests/engine/test_cpu_attention.py, on fresh random inputs). It serves rows up to KERNEL_ROWS_MAX (a
decode step, a short chunk); longer prompts keep the twin, whose matrix products run on BLAS.

What this is not: the quantized caches (q8_0, q3: their own `read` dequantizes; the twin serves them), a
GPU kernel, or bidirectional attention (the vision tower's `attention_full`).
numba is optional: `available()` says whether the kernel can run; the backend otherwise keeps the twin.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import numpy as np

F32 = np.float32
F64 = np.float64

ATTN_QUERY_BLOCK = 256  # float64 score rows a block of queries holds per key (the twin; attention_full too)
KERNEL_ROWS_MAX = 16  # query rows the kernel takes; longer chunks run the twin (BLAS matrix products)

_HAVE_NUMBA = importlib.util.find_spec("numba") is not None
_compiled: list[Callable[..., None]] = []  # the compiled kernel, made on first use
_HALF_TABLE: list[np.ndarray] = []  # every float16 bit pattern's float32 value, made on first use


def available() -> bool:
    """Whether numba is installed (imported on the first call only)."""
    return _HAVE_NUMBA


def attend_twin(q: np.ndarray, keys: np.ndarray, values: np.ndarray, *, scale: float,
                window: int = 0) -> np.ndarray:
    """The NumPy twin: q (T, nh, d), the first L cached keys (L, n_kv, d) and values (L, n_kv, dv) in any
    float type, the T queries being the last T positions (L - T .. L - 1). Returns (T, nh, dv) float32."""
    T, nh, _ = q.shape
    L, n_kv, _ = keys.shape
    group = nh // n_kv
    dv = values.shape[2]
    k_pos = np.arange(L)
    out = np.empty((T, nh, dv), F32)
    kh = keys.astype(F64).transpose(1, 2, 0)[:, None]  # (n_kv, 1, d, L)
    vh = values.astype(F64).transpose(1, 0, 2)[:, None]  # (n_kv, 1, L, dv)
    # every head at once (head h = kv * group + g), queries in blocks of ATTN_QUERY_BLOCK / nh
    block = max(1, ATTN_QUERY_BLOCK // nh)
    for q0 in range(0, T, block):
        q1 = min(q0 + block, T)
        q_pos = np.arange(L - T + q0, L - T + q1)  # absolute index of each query
        visible = k_pos[None, :] <= q_pos[:, None]  # causal
        if window > 0:
            visible &= k_pos[None, :] > q_pos[:, None] - window
        qh = q[q0:q1].astype(F64).reshape(q1 - q0, n_kv, group, -1).transpose(1, 2, 0, 3)
        scores = (qh @ kh) * scale  # (n_kv, group, queries, L)
        scores = np.where(visible, scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out[q0:q1] = (p @ vh).transpose(2, 0, 1, 3).reshape(q1 - q0, nh, dv)
    return out


def _row_of(cache, l, hk, table, scratch):  # pragma: no cover - replaced by _row_of_overload's forms
    """Key or value row (l, hk) of a cache to compute with: a float32 cache's own row, or a float16
    cache's row (held as its uint16 bit patterns) widened into `scratch` through `table`."""
    if cache.dtype == np.uint16:
        n = cache.shape[2]
        scratch[:n] = table[cache[l, hk]]
        return scratch[:n]
    return cache[l, hk]


def _row_of_overload(cache, l, hk, table, scratch):  # pragma: no cover - compiled
    """numba's form of _row_of for the cache type it is compiled for."""
    from numba import types

    if isinstance(cache.dtype, types.Integer):
        def widened(cache, l, hk, table, scratch):
            src = cache[l, hk]
            for i in range(src.shape[0]):
                scratch[i] = table[src[i]]
            return scratch[: src.shape[0]]

        return widened
    return lambda cache, l, hk, table, scratch: cache[l, hk]


def _kernel(q, keys, values, table, scale, window, out):  # pragma: no cover - compiled
    """q (T, nh, d) float64; keys (L, n_kv, d) and values (L, n_kv, dv): float32, or the float16 bit
    patterns as uint16 (widened through `table`); out (T, nh, dv) float32."""
    T, nh, d = q.shape
    L, n_kv, dv = values.shape
    group = nh // n_kv
    weights = np.empty((group, L), np.float64)  # scores, then their exponentials
    totals = np.empty(group, np.float64)
    acc = np.empty((group, dv), np.float64)
    scratch = np.empty(max(d, dv), np.float32)  # a float16 row, widened
    for t in range(T):
        p = L - T + t  # this query's absolute position: keys 0..p are causal
        lo = 0
        if window > 0 and p - window + 1 > 0:
            lo = p - window + 1
        for hk in range(n_kv):
            h0 = hk * group
            for l in range(lo, p + 1):
                kr = _row_of(keys, l, hk, table, scratch)
                for g in range(group):
                    qr = q[t, h0 + g]
                    s = 0.0
                    for i in range(d):
                        s += qr[i] * kr[i]
                    weights[g, l] = s * scale
            for g in range(group):
                m = -np.inf
                for l in range(lo, p + 1):
                    m = max(m, weights[g, l])
                total = 0.0
                for l in range(lo, p + 1):
                    e = np.exp(weights[g, l] - m)
                    weights[g, l] = e
                    total += e
                totals[g] = total
                acc[g, :] = 0.0
            for l in range(lo, p + 1):
                vr = _row_of(values, l, hk, table, scratch)
                for g in range(group):
                    w = weights[g, l]
                    a = acc[g]
                    for j in range(dv):
                        a[j] += w * vr[j]
            for g in range(group):
                for j in range(dv):
                    out[t, h0 + g, j] = acc[g, j] / totals[g]


def _kernel_compiled() -> Callable[..., None]:
    """The compiled kernel (serial, on the calling thread; the interpreter released while it runs)."""
    if not _compiled:
        import numba  # local import: optional, and slow to import
        from numba.extending import overload

        overload(_row_of)(_row_of_overload)
        _compiled.append(numba.njit(cache=True, nogil=True, boundscheck=False, fastmath={'reassoc', 'nsz'})(_kernel))
    return _compiled[0]


def _half_table() -> np.ndarray:
    """float32 value of each of the 65,536 float16 bit patterns (exact: float32 holds every float16)."""
    if not _HALF_TABLE:
        _HALF_TABLE.append(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(F32))
    return _HALF_TABLE[0]


def takes(keys: np.ndarray, rows: int) -> bool:
    """Whether the kernel serves `rows` query rows over keys of this type (float32 or float16)."""
    return _HAVE_NUMBA and rows <= KERNEL_ROWS_MAX and keys.dtype in (F32, np.float16)


def compile_kernel() -> None:
    """Compile the kernel now (or load it from numba's disk cache), not inside a first token: a call on
    a few zeros for each cache type the kernel reads."""
    q = np.zeros((1, 2, 4), F32)
    for dtype in (F32, np.float16):
        kv = np.zeros((3, 1, 4), dtype)
        attend(q, kv, kv, scale=1.0, window=0)


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, *, scale: float, window: int = 0) -> np.ndarray:
    """attend_twin's result from the compiled kernel (same arguments; keys and values float32 or
    float16, C-contiguous: a cache's leading rows)."""
    if not _HAVE_NUMBA:
        raise RuntimeError("numba is not installed: `pip install numba`, or use attend_twin")
    T, nh, d = q.shape
    L, n_kv, dv = values.shape
    if keys.shape != (L, n_kv, d) or n_kv == 0 or nh % n_kv or T > L or keys.dtype != values.dtype:
        raise ValueError(f"attend: q (T, nh, d), keys (L, n_kv, d) and values (L, n_kv, dv) of one type, nh a "
                         f"multiple of n_kv and T <= L; got q {q.shape}, keys {keys.shape} {keys.dtype}, values "
                         f"{values.shape} {values.dtype}")
    if keys.dtype not in (F32, np.float16):
        raise ValueError(f"attend reads float32 or float16 caches, not {keys.dtype}")
    if keys.dtype == np.float16:
        keys, values = keys.view(np.uint16), values.view(np.uint16)
    out = np.empty((T, nh, dv), F32)
    _kernel_compiled()(np.ascontiguousarray(q, F64), np.ascontiguousarray(keys), np.ascontiguousarray(values),
                       _half_table(), float(scale), int(window), out)
    return out
