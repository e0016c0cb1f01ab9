"""Launch wrappers of moe.cu: the routed experts of a mixture-of-experts layer on the DP4A path.

`routed_experts(x, ids, wts, gate, up, down, k)` is the whole expert part of a MoE block after routing
(ops.moe_route gives ids and wts): for a few tokens (decode, T <= DECODE_MAX_T) two launches for all
experts of all tokens (moe_gate_up_q8, moe_down_sum); for more (prefill) a device-side counting sort of
the (token, slot) pairs by expert and one grouped DP4A GEMM launch per projection (moe_gemm_dp4a), each
tile reading its expert's weights once, with SwiGLU + q8_1 between them and ops.moe_combine after. No
host synchronization and no allocation whose size depends on the routing (CUDA-graph safe); every
result is deterministic. `bench_moe` times this against the per-pair GEMV path (ops.matmul_experts).

`decode_block(x, router, gate, up, down, k, shared, residual)` is a whole Qwen3.5/3.6 MoE block of a
few tokens (T <= DECODE_MAX_T): routing, routed experts, the sigmoid-gated shared expert and the
residual add, in three launches (four when the shared expert's down matrix is in another format than
the routed ones). Kernels of one decode MoE block, before and after (35B-A3B: H 2048, 256 experts,
top-8, expert FFN 512, shared FFN 512; f and its q8_1 come from the fused add + RMSNorm before it):

    before (qwen35._moe -> CupyBackend.moe + the composed shared expert): 12 launches
      1 router GEMV (fp32)          2 moe_route (softmax top-k)      3 moe_gate_up_q8     4 moe_down_sum
      5 shared gate+up GEMV (one fused group)   6 swiglu_q8   7 shared down GEMV
      8 shared gate-logit GEMV (fp32)   9 sigmoid   10 mul (broadcast)   11 add (routed + shared)
      12 add (residual, in feed_forward)   (+ the q8_1 of f: already made by the norm, no launch)
    after (decode_block): 3 launches
      moe_dec_router   router logits + the shared gate logit (E + 1 fp32 rows) and the shared expert's
                       gate/up + SwiGLU, written as q8_1 blocks, side by side in one grid
      moe_dec_gate_up  routing (softmax top-k of the logits, in every block: the 256-value top-8
                       costs less than a launch) and the k routed experts' gate/up + SwiGLU -> q8_1 h
      moe_dec_down     the k routed down rows weighted by the routing, the shared down row times
                       sigmoid(gate logit), plus the residual, per output column
    (+1 shared down GEMV, ops.matmul, when its format differs from the routed down format: the fused
    down kernel is compiled for one format to keep the build small.)
`bench_decode_block` times both at the 35B-A3B shape, each replayed as a CUDA graph (as decode runs).

Each function takes and returns cupy arrays on the current device and launches on the current stream.
Not here: choosing DP4A or FMA for a card (the backend), prefill routing (ops.moe_route + the sort).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cupy as cp
import numpy as np

from . import ops
from .build import DP4A_TYPES, QT, get_kernel
from .ops import QWeight

MOE_BM = 64  # sorted rows per tile of moe_gemm_dp4a (moe.cu)
MOE_BN = 128  # output columns per tile
DECODE_MAX_T = ops.GEMV_MAX_T  # up to this many tokens: the two fused decode kernels
_SORT_SMEM = 48 * 1024  # moe_sort's dynamic shared memory: 4 * (E * (warps + 3) + 2) bytes at most
MAX_EXPERTS = (_SORT_SMEM // 4 - 2) // 4  # experts moe_sort can count (one warp)

Q8 = tuple[cp.ndarray, cp.ndarray, cp.ndarray]  # q8_1 activations: (xq int8 (T, K), xd, xs (T, K / 32))


def _module(w: QWeight) -> str:
    return f"moe_{w.type_name}"


def sort_warps(n_experts: int) -> int:
    """Warps of the moe_sort block for E experts: up to 16, as many as its shared memory allows."""
    nw = min(16, (_SORT_SMEM // 4 - 2) // max(1, n_experts) - 3)
    if nw < 1:
        raise ValueError(f"moe_sort handles at most {MAX_EXPERTS} experts; got {n_experts}")
    return nw


def max_tiles(pairs: int, n_experts: int) -> int:
    """Row tiles the grouped GEMM may need for `pairs` pairs over E experts, whatever the routing:
    sum over experts of ceil(count / MOE_BM) <= pairs // MOE_BM + (experts with a pair)."""
    return pairs // MOE_BM + min(n_experts, pairs)


@dataclass(frozen=True)
class ExpertSort:
    """The (token, slot) pairs sorted by expert, on the device (moe_sort). perm[s]: the pair at sorted
    position s; expert e owns sorted rows offsets[e] .. offsets[e + 1] - 1 (counts[e] of them); tile i <
    n_tiles[0] of the grouped GEMM covers rows offsets[tile_e[i]] + tile_r0[i] + (0 .. MOE_BM - 1)."""

    counts: cp.ndarray  # (E,) int32
    offsets: cp.ndarray  # (E + 1,) int32
    perm: cp.ndarray  # (P,) int32
    tile_e: cp.ndarray  # (max_tiles,) int32, first n_tiles[0] written
    tile_r0: cp.ndarray  # (max_tiles,) int32
    n_tiles: cp.ndarray  # (1,) int32
    max_tiles: int

    @property
    def pairs(self) -> int:
        return int(self.perm.size)


def sort_pairs(ids: cp.ndarray, n_experts: int, module: str = "moe_Q8_0") -> ExpertSort:
    """Stable counting sort of the pairs p (expert ids[p], int32 in [0, n_experts)) by expert, in one
    launch of one block (no host sync)."""
    ids = cp.ascontiguousarray(ids, dtype=cp.int32).reshape(-1)
    P, E = int(ids.size), int(n_experts)
    nt = max_tiles(P, E)
    i32 = cp.int32
    srt = ExpertSort(cp.empty(E, i32), cp.empty(E + 1, i32), cp.empty(P, i32), cp.empty(max(nt, 1), i32),
                     cp.empty(max(nt, 1), i32), cp.empty(1, i32), nt)
    nw = sort_warps(E)
    nbits = max(0, (E - 1).bit_length())
    get_kernel(module, "moe_sort")((1,), (32 * nw,),
                                   (ids, np.int32(P), np.int32(E), np.int32(nbits), np.int32(nt), srt.counts,
                                    srt.offsets, srt.perm, srt.tile_e, srt.tile_r0, srt.n_tiles),
                                   shared_mem=4 * (E * (nw + 3) + 2))
    return srt


def grouped_matmul(q8: Q8, w: QWeight, srt: ExpertSort, x_div: int, gather: bool, scatter: bool,
                   nblk: int = 1) -> cp.ndarray:
    """Row s of the sorted products: (activation row) @ W[expert of s]^T -> (P, R) fp32, one launch.

    q8: the q8_1 activations; their row is perm[s] // x_div with gather (the gate/up input x, x_div = k),
    else s (the down input, already in sorted order). The result row is perm[s] with scatter (pair
    order), else s. nblk: quant blocks per shared-memory stage (1 or 2, as gemm_dp4a)."""
    xq, xd, xs = q8
    R, K = w.rows, w.cols
    if xq.shape[-1] != K:
        raise ValueError(f"grouped matmul: input has {xq.shape[-1]} columns, weight has {K}")
    y = cp.empty((srt.pairs, R), dtype=cp.float32)
    if srt.pairs == 0 or srt.max_tiles == 0:
        return y
    wd = w.wd if w.wd is not None else ops._dummy()
    k = get_kernel(_module(w), f"moe_gemm_dp4a<{QT[w.type_name]}, {int(nblk)}>")
    k((srt.max_tiles, math.ceil(R / MOE_BN)), (256,),
      (w.wq, wd, xq, xd, xs, y, np.int32(R), np.int32(K), srt.perm, srt.offsets, srt.tile_e, srt.tile_r0,
       srt.n_tiles, np.int32(x_div), np.int32(bool(gather)), np.int32(bool(scatter))))
    return y


def swiglu_q8(g: cp.ndarray, u: cp.ndarray, F: int, want_h: bool = False, module: str = "moe_Q8_0"):
    """silu(g) * u of rows of F values (F % 32 == 0) -> (h fp32 (rows, F) or None, q8_1 of h).

    g, u: views of the first / next F columns of one (rows, 2F) array (fused gate/up) or two (rows, F)
    arrays; both must share the row stride."""
    rows = g.shape[0]
    ld = g.strides[0] // 4
    if F % 32 or u.strides[0] != g.strides[0] or g.dtype != cp.float32 or u.dtype != cp.float32:
        raise ValueError("moe swiglu_q8: fp32 rows of a multiple of 32 values with one row stride")
    hq = cp.empty((rows, F), dtype=cp.int8)
    hd = cp.empty((rows, F // 32), dtype=cp.float32)
    hs = cp.empty((rows, F // 32), dtype=cp.float32)
    h = cp.empty((rows, F), dtype=cp.float32) if want_h else None
    nb = rows * F // 32
    if nb:
        warps = 8
        get_kernel(module, "moe_swiglu_q8")((math.ceil(nb / warps),), (32 * warps,),
                                            (g, u, np.int32(ld), np.int32(F), np.int64(nb), hq, hd, hs,
                                             h if h is not None else np.uint64(0)))
    return h, (hq, hd, hs)


def _ffn(gate: QWeight, up: QWeight | None, down: QWeight) -> int:
    """The expert FFN width F, after checking that the three stacks fit together."""
    fused = up is None
    F = gate.rows // 2 if fused else gate.rows
    H = gate.cols
    if fused and gate.rows % 2:
        raise ValueError(f"fused gate/up experts have an odd row count {gate.rows}")
    if up is not None and up.type_name != gate.type_name:
        raise ValueError(f"MoE kernels need gate and up experts in one format; got {gate.type_name} and "
                         f"{up.type_name}")
    if up is not None and (up.rows, up.cols, up.experts) != (gate.rows, gate.cols, gate.experts):
        raise ValueError(f"gate experts ({gate.experts}, {gate.rows}, {gate.cols}) and up experts "
                         f"({up.experts}, {up.rows}, {up.cols}) differ in shape")
    if (down.rows, down.cols, down.experts) != (H, F, gate.experts):
        raise ValueError(f"down experts ({down.experts}, {down.rows}, {down.cols}) do not fit gate/up "
                         f"experts of {gate.experts} x ({F}, {H})")
    return F


def supported(gate: QWeight, up: QWeight | None, down: QWeight) -> bool:
    """Whether these expert stacks run on the kernels here: DP4A formats, gate and up in one format
    (moe_gate_up_q8 is compiled for equal formats only, to keep the build small), a sortable expert
    count."""
    ws = [gate, down] + ([] if up is None else [up])
    same = up is None or up.type_name == gate.type_name
    return same and all(w.type_name in DP4A_TYPES for w in ws) and 0 < gate.experts <= MAX_EXPERTS


def gate_up_q8(q8: Q8, gate: QWeight, up: QWeight | None, ids: cp.ndarray, x_div: int,
               want_h: bool = False):
    """Decode: h[p] = silu(gate_e . x) * (up_e . x) for every pair p (e = ids[p], x = q8 row p // x_div),
    one launch -> (h fp32 (P, F) or None, q8_1 of h)."""
    xq, xd, xs = q8
    F = gate.rows // 2 if up is None else gate.rows
    K = gate.cols
    P = int(ids.size)
    hq = cp.empty((P, F), dtype=cp.int8)
    hd = cp.empty((P, F // 32), dtype=cp.float32)
    hs = cp.empty((P, F // 32), dtype=cp.float32)
    h = cp.empty((P, F), dtype=cp.float32) if want_h else None
    if P:
        u = gate if up is None else up
        k = get_kernel(_module(gate), f"moe_gate_up_q8<{QT[gate.type_name]}, {QT[u.type_name]}>")
        gd = gate.wd if gate.wd is not None else ops._dummy()
        ud = u.wd if u.wd is not None else ops._dummy()
        k((F // 32, P), (256,),
          (gate.wq, gd, u.wq, ud, np.int32(gate.rows), np.int32(u.rows), np.int32(F if up is None else 0),
           np.int32(F), np.int32(K), xq, xd, xs, ids, np.int32(x_div), hq, hd, hs,
           h if h is not None else np.uint64(0)))
    return h, (hq, hd, hs)


def down_sum(hq8: Q8, down: QWeight, ids: cp.ndarray, wts: cp.ndarray, T: int, k: int) -> cp.ndarray:
    """Decode: out[t] = sum over slots s of wts[t k + s] * h[t k + s] @ down_e^T (e = ids[t k + s]), the
    slots added in order, one launch -> (T, H)."""
    hq, hd, hs = hq8
    H, F = down.rows, down.cols
    out = cp.empty((T, H), dtype=cp.float32)
    if T:
        wd = down.wd if down.wd is not None else ops._dummy()
        get_kernel(_module(down), f"moe_down_sum<{QT[down.type_name]}>")(
            (math.ceil(H / 4), T), (128,),
            (down.wq, wd, np.int32(H), np.int32(F), hq, hd, hs, ids, wts, np.int32(k), out))
    return out


def routed_experts(x: cp.ndarray, ids: cp.ndarray, wts: cp.ndarray, gate: QWeight, up: QWeight | None,
                   down: QWeight, k: int, nblk: int = 1) -> cp.ndarray:
    """The routed experts of a MoE block: x (T, H) fp32, ids / wts (T * k,) from ops.moe_route, expert
    stacks gate (E, F or 2F (fused gate/up: gate rows first), H), up (E, F, H) or None, down (E, H, F)
    -> (T, H) = sum over slots of wts * down(silu(gate x) * up x). DP4A formats only (`supported`)."""
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    T, H = x.shape
    if H != gate.cols:
        raise ValueError(f"MoE input has {H} columns, the expert matrices {gate.cols}")
    F = _ffn(gate, up, down)
    ids = cp.ascontiguousarray(ids, dtype=cp.int32).reshape(-1)
    wts = cp.ascontiguousarray(wts, dtype=cp.float32).reshape(-1)
    if ids.size != T * k or wts.size != T * k:
        raise ValueError(f"MoE routing has {ids.size} ids and {wts.size} weights for {T} tokens x {k}")
    if T == 0:
        return cp.empty((0, H), dtype=cp.float32)
    q8 = ops.quantize_cached(x)
    if T <= DECODE_MAX_T:
        _, hq8 = gate_up_q8(q8, gate, up, ids, k)
        return down_sum(hq8, down, ids, wts, T, k)
    srt = sort_pairs(ids, gate.experts, _module(gate))
    if up is None:
        gu = grouped_matmul(q8, gate, srt, k, gather=True, scatter=False, nblk=nblk)  # (P, 2F) sorted
        g, u = gu[:, :F], gu[:, F:]
    else:
        g = grouped_matmul(q8, gate, srt, k, gather=True, scatter=False, nblk=nblk)
        u = grouped_matmul(q8, up, srt, k, gather=True, scatter=False, nblk=nblk)
    _, hq8 = swiglu_q8(g, u, F, module=_module(gate))
    y = grouped_matmul(hq8, down, srt, 1, gather=False, scatter=True, nblk=nblk)  # (P, H) pair order
    return ops.moe_combine(y, wts, T, k)


# ---- decode block ----------------------------------------------------------------------------------

DEC_MAX_K = 32  # moe.cu MOE_DEC_MAXK: experts per token the decode block selects at most
DEC_MAX_E = 512  # experts the decode block routes at most: one logit a thread of moe_dec_gate_up's block


@dataclass(frozen=True)
class SharedExpert:
    """The shared expert of a Qwen3.5/3.6 MoE block: sigmoid(x . gate_inp) * SwiGLU(x) on its own
    gate (Fs, H), up (Fs, H) and down (H, Fs) matrices; gate_inp is one fp32 row (1, H)."""

    gate_inp: QWeight
    gate: QWeight
    up: QWeight
    down: QWeight


def decode_block_problem(router: QWeight, gate: QWeight, up: QWeight | None, down: QWeight, k: int,
                         shared: SharedExpert | None) -> str | None:
    """Why `decode_block` cannot run this block (a sentence), or None when it can."""
    if not supported(gate, up, down):
        return "the routed experts are not in one DP4A format for gate and up"
    E, H = gate.experts, gate.cols
    if router.type_name != "F32" or router.experts != 1 or (router.rows, router.cols) != (E, H):
        return f"the router is {router.type_name} ({router.rows}, {router.cols}), not F32 ({E}, {H})"
    if not 1 <= k <= min(DEC_MAX_K, E):
        return f"top-{k} of {E} experts (the decode block selects 1..{DEC_MAX_K})"
    if E > DEC_MAX_E:
        return f"{E} experts (the decode block routes at most {DEC_MAX_E})"
    try:
        F = _ffn(gate, up, down)
    except ValueError as e:
        return str(e)
    if F % 32 or H % 32:
        return f"expert FFN {F} or hidden {H} is not a multiple of 32"
    if shared is None:
        return None
    g, u, d, gi = shared.gate, shared.up, shared.down, shared.gate_inp
    if gi.type_name != "F32" or (gi.rows, gi.cols, gi.experts) != (1, H, 1):
        return f"the shared gate row is {gi.type_name} ({gi.rows}, {gi.cols}), not F32 (1, {H})"
    if g.type_name != u.type_name or g.type_name not in DP4A_TYPES or d.type_name not in DP4A_TYPES:
        return f"shared expert formats {g.type_name}/{u.type_name}/{d.type_name} (gate and up in one DP4A format)"
    Fs = g.rows
    if (g.cols, u.rows, u.cols, d.rows, d.cols) != (H, Fs, H, H, Fs) or g.experts != 1 or u.experts != 1 \
            or d.experts != 1 or Fs % 32:
        return (f"shared expert shapes gate ({g.rows}, {g.cols}), up ({u.rows}, {u.cols}), down ({d.rows}, "
                f"{d.cols}) do not fit hidden {H}")
    return None


@dataclass(frozen=True)
class DecodeBlock:
    """What decode_block computed: out (T, H), and on the way the logits (T, E + 1: router logits, then
    the shared gate logit), the routing ids / wts (T k,) and the q8_1 h of the routed pairs."""

    out: cp.ndarray
    logits: cp.ndarray
    ids: cp.ndarray
    wts: cp.ndarray
    h: Q8


def decode_block_parts(x: cp.ndarray, router: QWeight, gate: QWeight, up: QWeight | None, down: QWeight,
                       k: int, shared: SharedExpert | None = None,
                       residual: cp.ndarray | None = None) -> DecodeBlock:
    """`decode_block` with its intermediate results (the tests check each)."""
    why = decode_block_problem(router, gate, up, down, k, shared)
    if why is not None:
        raise ValueError(f"MoE decode block: {why}")
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    T, H = x.shape
    if H != gate.cols:
        raise ValueError(f"MoE input has {H} columns, the expert matrices {gate.cols}")
    if T > DECODE_MAX_T:
        raise ValueError(f"the MoE decode block takes at most {DECODE_MAX_T} tokens; got {T}")
    if residual is not None:
        residual = cp.ascontiguousarray(residual, dtype=cp.float32).reshape(T, H)
    E = gate.experts
    F = gate.rows // 2 if up is None else gate.rows
    P = T * k
    f32, i32 = cp.float32, cp.int32
    out = cp.empty((T, H), dtype=f32)
    logits = cp.empty((T, E + 1), dtype=f32)
    ids = cp.empty(P, dtype=i32)
    wts = cp.empty(P, dtype=f32)
    hq8 = (cp.empty((P, F), dtype=cp.int8), cp.empty((P, F // 32), dtype=f32), cp.empty((P, F // 32), dtype=f32))
    if T == 0:
        return DecodeBlock(out, logits, ids, wts, hq8)
    xq, xd, xs = ops.quantize_cached(x)
    null = np.uint64(0)

    def wd(w: QWeight) -> cp.ndarray:
        return w.wd if w.wd is not None else ops._dummy()

    # 1. router logits (+ the shared gate logit) and the shared expert's SwiGLU
    nrb = math.ceil((E + (shared is not None)) / 4)  # router blocks: 4 rows of 4 warps each
    Fs = shared.gate.rows if shared is not None else 32
    sq8 = (cp.empty((T, Fs), dtype=cp.int8), cp.empty((T, Fs // 32), dtype=f32),
           cp.empty((T, Fs // 32), dtype=f32))
    apart = shared is not None and shared.down.type_name != down.type_name
    hsf = cp.empty((T, Fs), dtype=f32) if apart else None
    sg = shared.gate if shared is not None else gate  # (a stand-in format without a shared expert)
    su = shared.up if shared is not None else gate
    get_kernel(_module(sg), f"moe_dec_router<{QT[sg.type_name]}>")(
        (nrb + (Fs // 32 if shared is not None else 0), T), (512,),
        (x, np.int32(H), router.wq, np.int32(E), shared.gate_inp.wq if shared is not None else null, logits,
         np.int32(nrb), sg.wq, wd(sg), su.wq, wd(su), np.int32(Fs), xq, xd, xs, sq8[0], sq8[1], sq8[2],
         hsf if hsf is not None else null))
    # 2. routing + the routed experts' gate/up + SwiGLU
    u = gate if up is None else up
    get_kernel(_module(gate), f"moe_dec_gate_up<{QT[gate.type_name]}, {QT[u.type_name]}>")(
        (F // 32, P), (512,),
        (logits, np.int32(E), np.int32(k), gate.wq, wd(gate), u.wq, wd(u), np.int32(gate.rows),
         np.int32(u.rows), np.int32(F if up is None else 0), np.int32(F), np.int32(H), xq, xd, xs, ids, wts,
         hq8[0], hq8[1], hq8[2]), shared_mem=4 * E)
    # 3. (the shared down GEMV, when its format differs) + the weighted down sums and the residual
    ys = None
    if shared is not None and apart:
        assert hsf is not None
        ops.register_quantized(hsf, sq8)
        ys = ops.matmul(hsf, shared.down, "dp4a")
    fused_down = shared is not None and not apart
    sd = shared.down if shared is not None and fused_down else down
    get_kernel(_module(down), f"moe_dec_down<{QT[down.type_name]}>")(
        (math.ceil(H / 4), T), (128,),
        (down.wq, wd(down), np.int32(H), np.int32(F), hq8[0], hq8[1], hq8[2], ids, wts, np.int32(k), logits,
         np.int32(E), sd.wq if fused_down else null, wd(sd) if fused_down else null, np.int32(Fs),
         sq8[0], sq8[1], sq8[2], ys if ys is not None else null,
         residual if residual is not None else null, out))
    return DecodeBlock(out, logits, ids, wts, hq8)


def decode_block(x: cp.ndarray, router: QWeight, gate: QWeight, up: QWeight | None, down: QWeight, k: int,
                 shared: SharedExpert | None = None, residual: cp.ndarray | None = None) -> cp.ndarray:
    """A MoE block of T <= DECODE_MAX_T tokens x (T, H) fp32 -> (T, H):
    residual + sum over the top-k experts of w_e * down_e(silu(gate_e x) * up_e x)
             + sigmoid(x . shared.gate_inp) * shared.down(silu(shared.gate x) * shared.up x),
    routed as the NumPy backend's moe_route (softmax of fp32 router logits, top-k with ties to the
    lower expert index, renormalized). Expert stacks as routed_experts; router (E, H) F32. Three
    launches (four with the shared down in another format); DP4A formats (`decode_block_problem`)."""
    return decode_block_parts(x, router, gate, up, down, k, shared, residual).out


# ---- benchmark ----------------------------------------------------------------------------------------

def _random_weight(rng: np.random.Generator, type_name: str, E: int, R: int, K: int) -> QWeight:
    """Random expert stack with sane scales (fp16 fields set to small positive values)."""
    per, nbytes = ops._BLOCK_BYTES[type_name]
    nblocks = E * R * (K // per)
    raw = rng.integers(0, 256, size=(nblocks, nbytes), dtype=np.uint8)
    f16 = lambda v: np.frombuffer(np.float16(v).tobytes(), np.uint8)  # noqa: E731
    if type_name in ("Q8_0", "Q4_0"):
        raw[:, 0:2] = f16(0.01)
    elif type_name == "Q4_K":
        raw[:, 0:2] = f16(0.002)
        raw[:, 2:4] = f16(0.001)
    elif type_name == "Q6_K":
        raw[:, 208:210] = f16(0.0005)
    return ops.upload_weight(raw, type_name, (E, R, K))


def _old_path(x, ids, wts, gate, up, down, k):
    """The per-pair GEMV path the backend used before these kernels (for comparison)."""
    T = x.shape[0]
    if up is None:
        gu = ops.matmul_experts(x, gate, ids, k, "dp4a")
        fe = gu.shape[1] // 2
        h = ops.ewise("swiglu", cp.ascontiguousarray(gu[:, :fe]), cp.ascontiguousarray(gu[:, fe:]))
    else:
        h = ops.ewise("swiglu", ops.matmul_experts(x, gate, ids, k, "dp4a"),
                      ops.matmul_experts(x, up, ids, k, "dp4a"))
    y = ops.matmul_experts(h, down, ids, 1, "dp4a")
    return ops.moe_combine(y, wts, T, k)


def bench_moe(tokens=(1, 8, 512, 4096), H: int = 2048, E: int = 256, k: int = 8, F: int = 512,
              type_name: str = "Q4_K", down_type: str | None = None, fused: bool = False, nblk: int = 1,
              repeats: int = 10, seed: int = 0) -> list[dict]:
    """Time the routed experts of one MoE layer, old (per-pair GEMVs) vs new (moe.cu), at each token
    count, on random weights and a softmax top-k routing of random logits; prints one line per T and
    returns the records. Default shape: Qwen3.6-35B-A3B (n_embd 2048, 256 experts, top-8, FFN 512).

    GB/s counts the weight bytes of the experts the batch routes to, read once; TOPS counts
    2 * (T k) * 3 F H multiply-adds per layer. Also reports the max relative difference new vs old."""
    rng = np.random.default_rng(seed)
    gate = _random_weight(rng, type_name, E, 2 * F if fused else F, H)
    up = None if fused else _random_weight(rng, type_name, E, F, H)
    down = _random_weight(rng, down_type or type_name, E, H, F)
    per_expert = (gate.nbytes + (0 if up is None else up.nbytes) + down.nbytes) / E
    out = []
    for T in tokens:
        x = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
        ids, wts = ops.moe_route(cp.asarray(rng.standard_normal((T, E)).astype(np.float32)), k)
        used = int(cp.unique(ids).size)
        rec: dict = {"T": T, "experts_used": used, "type": type_name, "down_type": down_type or type_name}
        # a new activation array each run, so the q8_1 cache (ops.quantize_cached) never skips a launch
        xs = [x.copy() for _ in range(repeats)]
        results = {}
        for name in ("old", "new"):
            def fn(xx, name=name, ids=ids, wts=wts):
                if name == "old":
                    return _old_path(xx, ids, wts, gate, up, down, k)
                return routed_experts(xx, ids, wts, gate, up, down, k, nblk)

            results[name] = fn(x)  # warm-up (compiles)
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for xx in xs:
                fn(xx)
            stop.record()
            stop.synchronize()
            ms = cp.cuda.get_elapsed_time(start, stop) / repeats
            rec[f"{name}_ms"] = ms
            rec[f"{name}_gbs"] = used * per_expert / (ms * 1e-3) / 1e9
            rec[f"{name}_tops"] = 2.0 * T * k * 3 * F * H / (ms * 1e-3) / 1e12
        a, b = (cp.asnumpy(results[n]).astype(np.float64) for n in ("old", "new"))
        rec["max_rel_diff"] = float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))
        rec["speedup"] = rec["old_ms"] / rec["new_ms"]
        print(f"MoE {type_name}/{rec['down_type']} H={H} E={E} k={k} F={F} T={T:5d} ({used:3d} experts): "
              f"old {rec['old_ms']:8.3f} ms {rec['old_gbs']:7.1f} GB/s {rec['old_tops']:6.2f} TOPS | "
              f"new {rec['new_ms']:8.3f} ms {rec['new_gbs']:7.1f} GB/s {rec['new_tops']:6.2f} TOPS | "
              f"x{rec['speedup']:.2f}, max rel diff {rec['max_rel_diff']:.1e}")
        out.append(rec)
    return out


def _row_range(w: QWeight, r0: int, r1: int) -> QWeight:
    """Rows r0 .. r1 - 1 of a one-matrix QWeight, as views (a member of a loaded weight group)."""
    return QWeight(w.type_name, r1 - r0, w.cols, 1, w.wq[r0:r1], None if w.wd is None else w.wd[r0:r1])


def _old_block(x, res, router, gate, up, down, k, gate_up_s: QWeight, shared: SharedExpert):
    """The decode MoE block as the backend composed it before decode_block (12 launches at T = 1):
    router GEMV, moe_route, routed_experts, the shared gate+up group GEMV, swiglu_q8, the shared down
    GEMV, the shared gate-logit GEMV, sigmoid, broadcast mul, add, residual add."""
    from . import fused

    T = x.shape[0]
    logits = ops.matmul(x, router, "fma")
    ids, wts = ops.moe_route(logits, k)
    routed = routed_experts(x, ids, wts, gate, up, down, k)
    gu = ops.matmul(x, gate_up_s, "dp4a")
    Fs = shared.gate.rows
    if T == 1:
        g, u = gu.reshape(-1)[:Fs].reshape(1, Fs), gu.reshape(-1)[Fs:].reshape(1, Fs)
    else:
        g, u = cp.ascontiguousarray(gu[:, :Fs]), cp.ascontiguousarray(gu[:, Fs:])
    h, hq8 = fused.swiglu_q8(g, u)
    ops.register_quantized(h, hq8)
    s = ops.matmul(h, shared.down, "dp4a")
    sg = ops.ewise("sigmoid", ops.matmul(x, shared.gate_inp, "fma"))  # (T, 1)
    y = ops.ewise("add", routed, s * sg)
    return ops.ewise("add", res, y)


def bench_decode_block(tokens=(1, 8), H: int = 2048, E: int = 256, k: int = 8, F: int = 512, Fs: int = 512,
                       type_name: str = "Q4_K", down_type: str | None = None, shared_type: str | None = None,
                       shared_down_type: str | None = None, repeats: int = 20, seed: int = 0) -> list[dict]:
    """Time one whole decode MoE block (router, routing, routed experts, shared expert, residual), the
    old composed launches vs decode_block, each as `repeats` calls replayed in one CUDA graph (as the
    decode step runs), at each token count; prints one line per T (us per layer and per 40-layer
    token, the ratio, the max relative difference of the MoE output) and returns the records.
    Default shape: Qwen3.6-35B-A3B, all Q4_K, gate and up apart (as engine/synth.py writes it)."""
    from .probe import time_gpu

    rng = np.random.default_rng(seed)
    gate = _random_weight(rng, type_name, E, F, H)
    up = _random_weight(rng, type_name, E, F, H)
    down = _random_weight(rng, down_type or type_name, E, H, F)
    st, sdt = shared_type or type_name, shared_down_type or down_type or type_name
    gate_up_s = _random_weight(rng, st, 1, 2 * Fs, H)  # the shared gate + up group, loaded as one array
    f32 = lambda a: ops.upload_weight(a.astype(np.float32).view(np.uint8), "F32", a.shape)  # noqa: E731
    router = f32(rng.standard_normal((E, H)) * (2.0 / math.sqrt(H)))
    shared = SharedExpert(f32(rng.standard_normal((1, H)) / math.sqrt(H)), _row_range(gate_up_s, 0, Fs),
                          _row_range(gate_up_s, Fs, 2 * Fs), _random_weight(rng, sdt, 1, H, Fs))
    out = []
    for T in tokens:
        x = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
        res = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
        q8 = ops.quantize_q8_1(x)

        def old(x=x, res=res, q8=q8):
            ops.register_quantized(x, q8)  # the norm before the block publishes x's q8_1
            return _old_block(x, res, router, gate, up, down, k, gate_up_s, shared)

        def new(x=x, res=res, q8=q8):
            ops.register_quantized(x, q8)
            return decode_block(x, router, gate, up, down, k, shared, res)

        a, b = (cp.asnumpy(fn() - res).astype(np.float64) for fn in (old, new))
        rec: dict = {"T": T, "type": type_name, "down_type": down_type or type_name, "shared_type": st,
                     "shared_down_type": sdt,
                     "old_us": time_gpu(old, repeats) * 1e6, "new_us": time_gpu(new, repeats) * 1e6,
                     "max_rel_diff": float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))}
        rec["speedup"] = rec["old_us"] / rec["new_us"]
        print(f"MoE decode block {type_name}/{rec['down_type']} shared {st}/{sdt} H={H} E={E} k={k} F={F} "
              f"Fs={Fs} T={T}: old {rec['old_us']:7.1f} us/layer ({rec['old_us'] * 40 / 1e3:.3f} ms per "
              f"40 layers) | new {rec['new_us']:7.1f} us/layer ({rec['new_us'] * 40 / 1e3:.3f} ms) | "
              f"x{rec['speedup']:.2f}, max rel diff {rec['max_rel_diff']:.1e}")
        out.append(rec)
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Time the MoE expert kernels, old (per-pair GEMVs) vs new "
                                             "(moe.cu), at the Qwen3.6-35B-A3B shape by default.")
    ap.add_argument("--type", default="Q4_K", choices=DP4A_TYPES, help="gate/up expert format")
    ap.add_argument("--down-type", default=None, choices=DP4A_TYPES, help="down expert format (default --type)")
    ap.add_argument("--tokens", default="1,8,512,4096",
                    help="comma-separated token counts of the routed-experts timing; empty to skip")
    ap.add_argument("--fused", action="store_true", help="one gate_up stack (default: gate and up apart, "
                                                         "as engine/synth.py writes the 35B-A3B file)")
    ap.add_argument("--nblk", type=int, default=1, choices=(1, 2), help="quant blocks per GEMM stage")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs per measurement")
    ap.add_argument("--block-tokens", default="1,8",
                    help="comma-separated token counts of the whole decode MoE block timing (old composed "
                         "launches vs decode_block, CUDA graphs); empty to skip")
    ap.add_argument("--shared-type", default=None, choices=DP4A_TYPES,
                    help="shared expert gate/up format for the block timing (default --type)")
    ap.add_argument("--shared-down-type", default=None, choices=DP4A_TYPES,
                    help="shared expert down format for the block timing (default the routed down format)")
    a = ap.parse_args()
    if a.tokens:
        bench_moe(tuple(int(t) for t in a.tokens.split(",")), type_name=a.type, down_type=a.down_type,
                  fused=a.fused, nblk=a.nblk, repeats=a.repeats)
    if a.block_tokens:
        bench_decode_block(tuple(int(t) for t in a.block_tokens.split(",")), type_name=a.type,
                           down_type=a.down_type, shared_type=a.shared_type,
                           shared_down_type=a.shared_down_type)


if __name__ == "__main__":
    main()
