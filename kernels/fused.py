"""Launch wrappers of fused.cu: the single-token decode path's fused kernels (grid and block sizes here).

Each function takes and returns cupy arrays on the current device, launches on the current stream and
never synchronizes. Functions ending in `_q8` also return the q8_1 quantization (xq, xd, xs) of their
fp32 output, laid out exactly as ops.quantize_q8_1 writes it; the caller publishes it with
ops.register_quantized so the next matmul skips its quantization. `*_supported` say which shapes a
kernel covers; the backend composes the basic ops for the rest.

Not here: deciding whether a q8 side output is worth writing (the backend knows the matmul path).
"""

from __future__ import annotations

import math

import cupy as cp
import numpy as np

from .build import GDN_KEY_DIMS, HEAD_DIMS, KV_CACHE_TYPES, get_kernel
from .ops import (
    DECODE_BLOCKS_PER_SM,
    MERGE_THREADS,
    decode_kernel,
    decode_partials,
    merge_grid,
    q8_arrays,
    sm_count,
)

GDN_MAX_KW = 8  # fused.cu: longest conv kernel of gdn_decode
GDN_MAX_DV = 128  # fused.cu: a block of 128 threads per 32 value columns of a head, the whole head in one block


def _c32(x):
    return cp.ascontiguousarray(x, dtype=cp.float32)


# rms_norm_q8 spreads a row over ceil(N / 256) blocks (each sums the whole row's squares itself) for up to
# this many rows (decode steps, batched ones included); longer inputs (prefill) take one block a row
RMS_SPREAD_MAX_T = 32


def rms_blocks(T: int, N: int) -> int:
    """Blocks per row of an rms_norm_q8 launch of T rows of N values (fused.cu)."""
    return math.ceil(N / 256) if T <= RMS_SPREAD_MAX_T else 1


def _aligned16(x):
    """x, or a copy of it when its address is not 16-byte aligned (rms_norm_q8 reads float4)."""
    return x if x.data.ptr % 16 == 0 else x.copy()


def rms_norm_q8(x, w, eps: float, delta=None):
    """rms_norm(x, w) (delta None) or add_rms_norm(x, delta, w) of (T, N) rows with N % 32 == 0.
    Returns (out, q8) or (s, out, q8) with s = x + delta. w is a stored weight: the kernel reads it
    before its launch wait (common.cuh pdl_entry), so no kernel launched just before may write it."""
    x = _aligned16(_c32(x))
    T, N = x.shape
    if N % 32:
        raise ValueError(f"rms_norm_q8: row length {N} is not a multiple of 32")
    out = cp.empty_like(x)
    s_out = cp.empty_like(x) if delta is not None else None
    q8 = q8_arrays(T, N)
    if T:
        delta = _aligned16(_c32(delta).reshape(T, N)) if delta is not None else None
        mode = 1 if delta is not None else 0
        get_kernel("fused", f"rms_norm_q8<{mode}>")(
            (T, rms_blocks(T, N)), (256,),
            (x, delta if delta is not None else x, w if w is not None else np.uint64(0), out,
             s_out if s_out is not None else out, q8[0], q8[1], q8[2], np.int32(N), np.float32(eps)))
    return (out, q8) if delta is None else (s_out, out, q8)


def swiglu_q8(gate, up):
    """silu(gate) * up of (T, F) with F % 32 == 0 -> (out, q8)."""
    gate, up = _c32(gate), _c32(up)
    T, F = gate.shape
    if F % 32 or up.shape != gate.shape:
        raise ValueError(f"swiglu_q8: shapes {gate.shape} and {up.shape} (need equal, last a multiple of 32)")
    out = cp.empty_like(gate)
    q8 = q8_arrays(T, F)
    nb = T * F // 32
    if nb:
        warps = 8
        get_kernel("fused", "swiglu_q8")((math.ceil(nb / warps),), (32 * warps,),
                                         (gate, up, out, q8[0], q8[1], q8[2], np.int64(nb)))
    return out, q8


# ---- Gated DeltaNet -----------------------------------------------------------------------------------

_COUNTERS: dict[int, cp.ndarray] = {}


def gdn_counters_ready(n: int) -> bool:
    """Whether n of gdn_decode's counters (n_k for one mixer) exist on this device (they must be
    made outside a graph capture, where a memset would only be recorded, not run)."""
    c = _COUNTERS.get(cp.cuda.Device().id)
    return c is not None and c.size >= n


_OLD_COUNTERS: list[cp.ndarray] = []  # replaced counter arrays: captured graphs may still use them


def make_gdn_counters(n: int) -> None:
    """At least n zeroed int32 counters of gdn_decode on this device (each launch leaves them at zero
    again). A smaller array made before stays allocated: a captured graph baked its address in."""
    if not gdn_counters_ready(n):
        c = cp.zeros(max(n, 1024), dtype=cp.int32)
        cp.cuda.get_current_stream().synchronize()
        old = _COUNTERS.get(cp.cuda.Device().id)
        if old is not None:
            _OLD_COUNTERS.append(old)
        _COUNTERS[cp.cuda.Device().id] = c


def _counters(n: int) -> cp.ndarray:
    if not gdn_counters_ready(n):
        raise RuntimeError("gdn_decode: make_gdn_counters() first (outside any graph capture)")
    return _COUNTERS[cp.cuda.Device().id]


def gdn_threads(dv: int) -> int:
    """Threads of a gdn_decode block: 4 warps (the state's row quarters) per 32 value columns."""
    return 128 * ((dv + 31) // 32)


def gdn_decode_supported(n_k: int, n_v: int, dk: int, dv: int, kw: int) -> bool:
    return (dk in GDN_KEY_DIMS and 1 <= dv <= GDN_MAX_DV and 2 <= kw <= GDN_MAX_KW and 1 <= n_k <= n_v)


def gdn_decode(mixed, z, b, alpha, conv_state, ssm_state, conv_w, ssm_a, dt_bias, norm_w, *, n_k: int,
               n_v: int, dk: int, dv: int, eps: float, want_q8: bool):
    """One token (T == 1) of a Gated DeltaNet mixer; conv_state (K-1, C) and ssm_state (n_v, dk, dv)
    updated in place. Returns (y (1, n_v dv), q8 or None); q8 only when want_q8 and dv % 32 == 0."""
    mixed, z, b, alpha = _c32(mixed), _c32(z), _c32(b), _c32(alpha)
    conv_w = _c32(conv_w)
    kw = int(conv_w.shape[1])
    C = 2 * n_k * dk + n_v * dv
    if mixed.size != C or conv_state.shape != (kw - 1, C) or ssm_state.shape != (n_v, dk, dv):
        raise ValueError(f"gdn_decode: shapes {mixed.shape}, {conv_state.shape}, {ssm_state.shape} do not "
                         f"match n_k={n_k} n_v={n_v} dk={dk} dv={dv} kernel={kw}")
    for name, a in (("conv state", conv_state), ("ssm state", ssm_state)):
        if not a.flags.c_contiguous or a.dtype != cp.float32:
            raise ValueError(f"gdn_decode: the {name} must be a contiguous float32 array made by the backend")
    y = cp.empty((1, n_v * dv), dtype=cp.float32)
    q8 = q8_arrays(1, n_v * dv) if want_q8 and dv % 32 == 0 else None
    nul = np.uint64(0)
    # a block per value head; counters: one per key head (its q/k conv state's readers)
    get_kernel("fused", f"gdn_decode<{dk}>")(
        (n_v,), (gdn_threads(dv),),
        (mixed, z, b, alpha, conv_state, conv_w, _c32(ssm_a), _c32(dt_bias), _c32(norm_w), ssm_state, y,
         q8[0] if q8 else nul, q8[1] if q8 else nul, q8[2] if q8 else nul, _counters(n_k), np.int32(n_k),
         np.int32(n_v), np.int32(dv), np.int32(kw), np.float32(1.0 / math.sqrt(dk)), np.float32(eps)))
    return y, q8


# ---- one decode token of each of B sequences in one launch per kernel --------
# Each sequence keeps its states (GDN conv / delta-rule state, KV cache) where its session allocated them;
# a kernel finds sequence s's through a device table of their addresses (uint64, one per sequence).

POINTER_TABLES_KEPT = 4096  # tables cached per device (a few bytes each), least recently used dropped
_TABLES: dict[int, dict[tuple[int, ...], cp.ndarray]] = {}


def cached_pointer_table(ptrs: tuple[int, ...]) -> cp.ndarray | None:
    """The device table of these addresses made by pointer_table on this device, or None."""
    tables = _TABLES.setdefault(cp.cuda.Device().id, {})
    tab = tables.pop(ptrs, None)
    if tab is not None:
        tables[ptrs] = tab  # most recently used last
    return tab


def pointer_table(ptrs: tuple[int, ...]) -> cp.ndarray:
    """A device uint64 array holding the device addresses `ptrs` (a host-to-device copy: not inside a
    graph capture), cached for cached_pointer_table. Whoever bakes a table into a graph keeps a reference
    to it for the graph's lifetime (a dropped table is freed)."""
    tab = cached_pointer_table(ptrs)
    if tab is None:
        tab = cp.asarray(np.asarray(ptrs, dtype=np.uint64))
        tables = _TABLES.setdefault(cp.cuda.Device().id, {})
        while len(tables) >= POINTER_TABLES_KEPT:
            tables.pop(next(iter(tables)))
        tables[ptrs] = tab
    return tab


def _check_table(name: str, tab, n: int) -> None:
    if tab.dtype != cp.uint64 or tab.shape != (n,):
        raise ValueError(f"{name}: a pointer table of {n} sequences must be a (n,) uint64 device array, "
                         f"got {tab.dtype} {tab.shape}")


def gdn_decode_batch(mixed, z, b, alpha, conv_states, ssm_states, conv_table, ssm_table, conv_w, ssm_a, dt_bias,
                     norm_w, *, n_k: int, n_v: int, dk: int, dv: int, eps: float, want_q8: bool):
    """gdn_decode for one token of each of B sequences: row s of mixed (B, C), z (B, n_v dv), b and alpha
    (B, n_v) with the states conv_states[s] (K-1, C) and ssm_states[s] (n_v, dk, dv), updated in place;
    conv_table / ssm_table: pointer_table of those states' addresses. Needs make_gdn_counters(B n_k).
    Returns (y (B, n_v dv), q8 or None)."""
    B = mixed.shape[0]
    mixed, z, b, alpha = _c32(mixed), _c32(z), _c32(b), _c32(alpha)
    conv_w = _c32(conv_w)
    kw = int(conv_w.shape[1])
    C = 2 * n_k * dk + n_v * dv
    if mixed.shape != (B, C) or z.size != B * n_v * dv or b.size != B * n_v or alpha.size != B * n_v \
            or len(conv_states) != B or len(ssm_states) != B:
        raise ValueError(f"gdn_decode_batch: {B} rows of shapes {mixed.shape}, {z.shape}, {b.shape}, "
                         f"{alpha.shape} with {len(conv_states)} / {len(ssm_states)} states do not match "
                         f"n_k={n_k} n_v={n_v} dk={dk} dv={dv}")
    for s in range(B):
        cs, ss = conv_states[s], ssm_states[s]
        if cs.shape != (kw - 1, C) or ss.shape != (n_v, dk, dv):
            raise ValueError(f"gdn_decode_batch: sequence {s}'s states {cs.shape}, {ss.shape} do not match "
                             f"n_k={n_k} n_v={n_v} dk={dk} dv={dv} kernel={kw}")
        for name, a in (("conv state", cs), ("ssm state", ss)):
            if not a.flags.c_contiguous or a.dtype != cp.float32:
                raise ValueError(f"gdn_decode_batch: sequence {s}'s {name} must be a contiguous float32 "
                                 "array made by the backend")
    _check_table("gdn_decode_batch", conv_table, B)
    _check_table("gdn_decode_batch", ssm_table, B)
    y = cp.empty((B, n_v * dv), dtype=cp.float32)
    q8 = q8_arrays(B, n_v * dv) if want_q8 and dv % 32 == 0 else None
    nul = np.uint64(0)
    get_kernel("fused", f"gdn_decode_batch<{dk}>")(
        (n_v, B), (gdn_threads(dv),),
        (mixed, z, b, alpha, conv_table, conv_w, _c32(ssm_a), _c32(dt_bias), _c32(norm_w), ssm_table, y,
         q8[0] if q8 else nul, q8[1] if q8 else nul, q8[2] if q8 else nul, _counters(B * n_k),
         np.int32(n_k), np.int32(n_v), np.int32(dv), np.int32(kw), np.float32(1.0 / math.sqrt(dk)),
         np.float32(eps)))
    return y, q8


def decode_batch_splits(spans: list[int], n_kv: int) -> int:
    """Context slices per sequence of flash_decode_batch: about DECODE_BLOCKS_PER_SM blocks per
    multiprocessor over the B sequences' n_kv heads, each slice at least 32 keys of the longest span
    (its capacity inside a graph capture, where lengths are only known on the device)."""
    want = max(1, (DECODE_BLOCKS_PER_SM * sm_count()) // (n_kv * max(1, len(spans))))
    span = max(max(spans), 1)
    split_len = max(32, math.ceil(span / want / 32) * 32)
    return max(1, math.ceil(span / split_len))


def attention_decode_batch(qg, k, v, q_norm, k_norm, k_table, v_table, rows, pos, comp, inv_freq, n_rot: int,
                           eps: float, scale: float, n_splits: int, window: int = 0, rope_scale: float = 1.0,
                           want_q8: bool = False, kv_type: str = "f32"):
    """Gated attention of one token of each of B sequences, each over its own cache: attn_prep_batch
    (q/k RMSNorm and RoPE, k and v written to row rows[s] of sequence s's cache in its kv_type),
    flash_decode_batch over rows [0, rows[s] + 1) in n_splits slices each (decode_batch_splits), and
    attn_merge_gate_batch (times sigmoid(gate)). qg (B, nh, 2, d), k (B, n_kv, d), v (B, n_kv, dv);
    k_table / v_table: pointer_table of the caches' K and V arrays (all of one shape and kv_type); rows
    (B,) int32 on the device (each cache's length before the append); pos (B, 3) int32 on the device.
    Returns (o (B, nh d), q8 or None)."""
    qg, k, v = _c32(qg), _c32(k), _c32(v)
    B, nh, _, d = qg.shape
    n_kv, dv = k.shape[1], v.shape[2]
    if k.shape != (B, n_kv, d) or v.shape[:2] != (B, n_kv) or dv != d or not attention_supported(nh, n_kv, d, dv):
        raise ValueError(f"attention_decode_batch: shapes {qg.shape}, {k.shape}, {v.shape} are not covered")
    if rows.shape != (B,) or rows.dtype != cp.int32 or pos.shape != (B, 3) or pos.dtype != cp.int32:
        raise ValueError(f"attention_decode_batch: rows {rows.shape} {rows.dtype} and positions {pos.shape} "
                         f"{pos.dtype} must be int32 device arrays (B,) and (B, 3)")
    _check_table("attention_decode_batch", k_table, B)
    _check_table("attention_decode_batch", v_table, B)
    module = _attention_module(kv_type)
    q = cp.empty((B, nh, d), dtype=cp.float32)
    get_kernel(module, "attn_prep_batch")(
        (nh + n_kv, B), (128,),
        (qg, k, v, _c32(q_norm), _c32(k_norm), q, k_table, v_table, rows, pos, comp, inv_freq, np.int32(nh),
         np.int32(n_kv), np.int32(d), np.int32(dv), np.int32(n_rot), np.float32(1.0 / rope_scale),
         np.float32(eps)))
    po = cp.empty((B, n_splits, nh, d), dtype=cp.float32)
    pm = cp.empty((B, n_splits, nh), dtype=cp.float32)
    pl = cp.empty((B, n_splits, nh), dtype=cp.float32)
    get_kernel(module, decode_kernel(d, nh, n_kv).replace("flash_decode<", "flash_decode_batch<"))(
        (n_kv, n_splits, B), (128,),
        (q, k_table, v_table, po, pm, pl, np.int32(nh), np.int32(n_kv), rows, np.float32(scale), np.int32(window)))
    out = cp.empty((B, nh * d), dtype=cp.float32)
    q8 = q8_arrays(B, nh * d) if want_q8 else None
    nul = np.uint64(0)
    get_kernel("fused", "attn_merge_gate_batch")(
        (*merge_grid(nh, d), B), (MERGE_THREADS,),
        (po, pm, pl, qg, out, q8[0] if q8 else nul, q8[1] if q8 else nul, q8[2] if q8 else nul, np.int32(n_splits),
         np.int32(nh), np.int32(d), rows))
    return out, q8


# ---- gated attention ----------------------------------------------------------------------------------

def attention_supported(nh: int, n_kv: int, d: int, dv: int) -> bool:
    return d in HEAD_DIMS and dv == d and n_kv >= 1 and nh % n_kv == 0 and nh // n_kv <= 8


def _attention_module(kv_type: str) -> str:
    """The module holding attn_prep / flash_decode for a cache of `kv_type` (kernels/build.py)."""
    if kv_type == "f32":
        return "attention"
    if kv_type not in KV_CACHE_TYPES:
        raise ValueError(f"no fused decode attention for a {kv_type!r} KV cache (f32, {', '.join(KV_CACHE_TYPES)})")
    return f"attention_{kv_type}"


def attn_prep(qg, k, v, q_norm, k_norm, kc, vc, row: int, row_ptr, pos3, comp, inv_freq, n_rot: int,
              eps: float, rope_scale: float = 1.0, kv_type: str = "f32"):
    """One token: q (1, nh, d) normed and roped from qg (1, nh, 2, d); k normed and roped and v written to
    cache row `row` (or the device int32 at row_ptr) in the cache's type (kv_type f32, f16 or q8_0:
    kernels/kvcache.py layouts). pos3 (3, 1) int32 on the device; comp and inv_freq as ops.rope takes
    them. Returns q."""
    qg, k, v = _c32(qg), _c32(k), _c32(v)
    nh, d = qg.shape[1], qg.shape[3]
    n_kv, dv = k.shape[1], v.shape[2]
    q = cp.empty((1, nh, d), dtype=cp.float32)
    get_kernel(_attention_module(kv_type), "attn_prep")(
        (nh + n_kv,), (128,),
        (qg, k, v, _c32(q_norm), _c32(k_norm), q, kc, vc, row_ptr if row_ptr is not None else np.uint64(0),
         np.int32(row), pos3, comp, inv_freq, np.int32(nh), np.int32(n_kv), np.int32(d), np.int32(dv),
         np.int32(n_rot), np.float32(1.0 / rope_scale), np.float32(eps)))
    return q


def attention_decode_gated(q, qg, kc, vc, kv_len: int, scale: float, window: int = 0, kv_len_ptr=None,
                           want_q8: bool = False, kv_type: str = "f32"):
    """Single-token attention over cache rows [0, kv_len) (kv_len_ptr: the device length before this
    token, inside a captured graph) with flash_decode (attention.cu, reading the cache in its kv_type),
    merged and multiplied by sigmoid(gate) (gate = qg[:, :, 1, :]). Returns (o (1, nh d), q8 or None)."""
    nh, D = q.shape[1], q.shape[2]
    n_kv = kc.shape[1]
    # the same context split as ops.attention's decode branch (graph: slices sized on the device)
    n_splits, split_len, po, pm, pl = decode_partials(kc, kv_len, nh, D, kv_len_ptr)
    lp = kv_len_ptr if kv_len_ptr is not None else np.uint64(0)
    get_kernel(_attention_module(kv_type), decode_kernel(D, nh, n_kv))(
        (n_kv, n_splits), (128,), (q, kc, vc, po, pm, pl, np.int32(nh), np.int32(n_kv), np.int32(kv_len),
                                   lp, np.int32(split_len), np.float32(scale), np.int32(window)))
    out = cp.empty((1, nh * D), dtype=cp.float32)
    q8 = q8_arrays(1, nh * D) if want_q8 else None
    nul = np.uint64(0)
    get_kernel("fused", "attn_merge_gate")(
        merge_grid(nh, D), (MERGE_THREADS,), (po, pm, pl, _c32(qg), out, q8[0] if q8 else nul, q8[1] if q8 else nul,
                      q8[2] if q8 else nul, np.int32(n_splits), np.int32(nh), np.int32(D), np.int32(kv_len), lp,
                      np.int32(split_len)))
    return out, q8
