"""Thin launch wrappers: cupy arrays in, cupy arrays out; grid and block sizes are decided here.

Every function takes and returns cupy arrays on the current device, launches on the current stream and
never synchronizes. Shapes follow the Backend protocol (engine/backends/base.py). The weight container
`QWeight` holds a matmul/embedding tensor in its device layout (see common.cuh): Q8_0, Q4_0, Q5_0 and
IQ4_NL re-laid out as contiguous quants + fp16 scales, the K-quants (Q4_K, Q5_K, Q6_K) repacked on the
device (kquant_layout.py), Q4_1, Q5_1 and IQ4_XS as raw GGUF blocks, F32/F16/BF16 as plain rows.

Not here: choosing between DP4A and FMA for a card (probe.py decides; the backend passes `path`).
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from typing import NamedTuple

import cupy as cp
import numpy as np

from . import kquant_layout, layout
from .build import (
    DECODE_GROUPS,
    DP4A_TYPES,
    GDN_KEY_DIMS,
    GEMM_BATCH_TOKENS,
    GEMV_KQ,
    GEMV_KQ_MT,
    GEMV_KQ_STREAM,
    GEMV_MT,
    GEMV_MT_TYPES,
    GEMV_STREAM,
    GEMV_TOKENS,
    HEAD_DIMS,
    QT,
    get_kernel,
    kq_passes,
)

_BLOCK_BYTES = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 144), "Q6_K": (256, 210),
                "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
                "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136),
                "Q5_K": (256, 176)}
# (layout.SPLIT_SCALES: the formats whose fp16 block scale moves to `wd` at upload, the rest of each block
# staying in `wq`; engine/placement.py STAGED_TYPES prices the raw staging copy of these)
_DUMMY: dict[int, cp.ndarray] = {}


def _dummy():
    dev = cp.cuda.Device().id
    if dev not in _DUMMY:
        _DUMMY[dev] = cp.zeros(8, dtype=cp.uint16)
    return _DUMMY[dev]


_SEGMENTS: dict[tuple[int, tuple[int, ...]], cp.ndarray] = {}


def _segment_bounds(bounds: tuple[int, ...]) -> cp.ndarray:
    """A device copy of a fused group's row bounds (0, a_1, ..., R), made once per device and group shape."""
    key = (cp.cuda.Device().id, bounds)
    if key not in _SEGMENTS:
        _SEGMENTS[key] = cp.asarray(np.asarray(bounds, dtype=np.int32))
    return _SEGMENTS[key]


def kept_type(type_name: str, cols: int) -> str:
    """The type a matrix of `type_name` with rows of `cols` values is kept in on the device: its own
    when a kernel reads it (the row a whole number of its blocks, and of 32 values), else "F32" (the
    loader decodes it once). CupyBackend.load_weight and the host-expert stream both ask this."""
    per = _BLOCK_BYTES.get(type_name, (0, 0))[0]
    if type_name in QT and per and cols % 32 == 0 and cols % per == 0:
        return type_name
    return "F32"


def supported_types() -> tuple[str, ...]:
    return tuple(QT)


@dataclass
class QWeight:
    """A quantized matrix (or stack of E expert matrices) on the device, rows R x K values each."""

    type_name: str
    rows: int  # rows per expert (R)
    cols: int  # K
    experts: int
    wq: cp.ndarray
    wd: cp.ndarray | None

    @property
    def nbytes(self) -> int:
        return int(self.wq.nbytes + (0 if self.wd is None else self.wd.nbytes))

    @property
    def dp4a_ok(self) -> bool:
        return self.type_name in DP4A_TYPES


def upload_weight(raw: np.ndarray, type_name: str, shape: tuple[int, ...], empty=cp.empty) -> QWeight:
    """Copy a GGUF tensor's raw bytes to the device and lay them out for the kernels (no precision change).

    shape: logical (R, K) or (E, R, K). raw: the tensor's bytes (any shape; C order). empty(shape,
    dtype): makes the result's arrays (kernels/layout.py array_bytes gives their sizes; CupyBackend
    passes views of a part's weight arena); the upload's temporaries come from CuPy's pool."""
    if type_name not in _BLOCK_BYTES:
        raise ValueError(f"weight type {type_name} has no GPU kernel (supported: {', '.join(QT)})")
    if len(shape) == 1:
        shape = (1, shape[0])
    experts = shape[0] if len(shape) == 3 else 1
    R, K = int(shape[-2]), int(shape[-1])
    per, nbytes = _BLOCK_BYTES[type_name]
    if K % 32 or K % per:
        raise ValueError(f"row length {K} is not a multiple of the {type_name} block ({max(per, 32)} values)")
    rows = experts * R
    nb_row = K // per * nbytes
    host = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape(rows, nb_row)
    if type_name in kquant_layout.KQUANT_TYPES:  # repacked on the device (kquant_layout.py)
        wq, wd = _upload_kquant(host, type_name, K, empty)
        return QWeight(type_name, R, K, experts, wq, wd)
    if type_name in layout.SPLIT_SCALES:  # the raw blocks staged on the device, then split
        wq, wd = layout.relayout(cp, cp.asarray(host), type_name, rows, K, empty)
        return QWeight(type_name, R, K, experts, wq, wd)
    wq = empty((rows, nb_row), cp.uint8)
    wq.set(host)
    return QWeight(type_name, R, K, experts, wq, None)


_KQ_CHUNK_BYTES = 64 << 20  # raw bytes repacked per step (the repack's temporaries are ~3x this)


def _upload_kquant(host: np.ndarray, type_name: str, K: int, empty=cp.empty) -> tuple[cp.ndarray, cp.ndarray]:
    """K-quant rows (host (rows, file bytes per row) uint8) -> (wq, wd) in the device layout of
    kquant_layout.py: each chunk of rows is copied to the device and repacked there by
    `kquant_layout.repack` run with CuPy, so device memory holds the result plus one chunk's work."""
    rows = host.shape[0]
    wq = empty((rows, kquant_layout.wq_row_bytes(type_name, K)), cp.uint8)
    wd = empty((rows, K // 32), cp.uint16)
    step = max(1, _KQ_CHUNK_BYTES // max(1, host.shape[1]))
    for r0 in range(0, rows, step):
        q, d = kquant_layout.repack(cp.asarray(host[r0:r0 + step]), type_name, K, xp=cp)
        wq[r0:r0 + step] = q
        wd[r0:r0 + step] = d
    return wq, wd


# ---- activation quantization and matmuls ------------------------------------------------------------

def q8_arrays(T: int, K: int):
    """Fresh (xq int8 (T, K), xd fp32 (T, K/32), xs fp32 (T, K/32)): q8_1 blocks of a (T, K) activation."""
    return (cp.empty((T, K), dtype=cp.int8), cp.empty((T, K // 32), dtype=cp.float32),
            cp.empty((T, K // 32), dtype=cp.float32))


def quantize_q8_1(x: cp.ndarray):
    """x (T, K) fp32 -> (xq int8 (T, K), xd fp32 (T, K/32), xs fp32 (T, K/32))."""
    T, K = x.shape
    nb = T * (K // 32)
    xq, xd, xs = q8_arrays(T, K)
    warps = 8
    get_kernel("quantize", "quantize_q8_1")((math.ceil(nb / warps),), (32 * warps,),
                                           (x, xq, xd, xs, np.int64(nb)))
    return xq, xd, xs


_LAST_Q = threading.local()  # per thread: one worker thread per device in multi-GPU runs


def quantize_cached(x: cp.ndarray):
    """quantize_q8_1(x), reusing the previous result when x is the same activation again (q, k and v
    projections, gate and up, all read one normalized input). Keyed by device pointer, shape and
    strides, with a reference to x held so that its memory cannot be reused while cached; activations
    are never written in place, so the same pointer means the same values."""
    key = (x.data.ptr, x.shape, x.strides)
    last = getattr(_LAST_Q, "entry", None)
    if last is not None and last[0] == key:
        return last[2]
    res = quantize_q8_1(x)
    _LAST_Q.entry = (key, x, res)
    return res


def register_quantized(x: cp.ndarray, q8) -> None:
    """Publish (xq, xd, xs), the q8_1 quantization of x that a fused kernel wrote beside x (exactly
    what quantize_q8_1(x) gives), so that the next matmul of x skips its quantization launch."""
    _LAST_Q.entry = ((x.data.ptr, x.shape, x.strides), x, q8)


def _mm_kernel(w: QWeight, name: str):
    return get_kernel(f"matmul_{w.type_name}", name)


def _chunks(T: int):
    """Split T tokens into GEMV launches of the compiled token counts (8, 4, 2, 1)."""
    t = 0
    while t < T:
        nt = max(n for n in GEMV_TOKENS if n <= T - t)
        yield t, nt
        t += nt


GEMV_MAX_T = 8  # above this, the tiled GEMM reads each weight fewer times
# Single-token DP4A GEMV (env MINECART_GEMV; read per call, so tests can switch it): "old" = gemv_dp4a,
# one warp per row; "splitW" / "splitWpf" = gemv_dp4a_split with W (1, 2, 4) warps per row, "pf" with the
# L2 prefetch of the next round (W = 1, 2); "auto" / "autopf" = W by matrix shape (see _gemv_split);
# "streamN" = gemv_dp4a_stream with N blocks per lane a round (warps streaming rows, _single_gemv).
GEMV_VARIANT = os.environ.get("MINECART_GEMV", "auto")
_GEMV_SPLIT = {"split1": (1, 0), "split2": (2, 0), "split4": (4, 0), "split1pf": (1, 1), "split2pf": (2, 1)}
_GEMV_STREAM = {f"stream{nu}": nu for nu in GEMV_STREAM}  # gemv_dp4a_stream<QT, nu>


# Single-token DP4A GEMV of the K-quants (env MINECART_GEMV_KQ, read per call): "auto" = by shape
# (_gemv_kq), "WxN" = gemv_kq<W, N> (build.GEMV_KQ), "sN" = gemv_kq_stream<N> (build.GEMV_KQ_STREAM),
# "split" = the generic kernels of GEMV_VARIANT (gemv_dp4a_split / gemv_dp4a over the same layout).
GEMV_KQ_VARIANT = os.environ.get("MINECART_GEMV_KQ", "auto")


@dataclass(frozen=True)
class KqGemv:
    """One single-token K-quant GEMV kernel: gemv_kq<QT, wpr, nu> (a block of 4 warps per 4 / wpr rows),
    or gemv_kq_stream<QT, nu> (stream: warps streaming rows, as many blocks as fit on the card)."""

    wpr: int
    nu: int
    stream: bool = False

    @property
    def label(self) -> str:
        return f"s{self.nu}" if self.stream else f"{self.wpr}x{self.nu}"

    def kernel(self, type_name: str) -> str:
        q = QT[type_name]
        return f"gemv_kq_stream<{q}, {self.nu}>" if self.stream else f"gemv_kq<{q}, {self.wpr}, {self.nu}>"


def _kq_variants() -> dict[str, KqGemv]:
    out = {f"{a}x{b}": KqGemv(a, b) for a, b in GEMV_KQ}
    out.update({f"s{n}": KqGemv(1, n, True) for n in GEMV_KQ_STREAM})
    return out


def _gemv_kq(type_name: str, R: int, K: int) -> KqGemv | None:
    """The gemv_kq kernel of a single-token K-quant GEMV, None for the generic kernels. "auto", by the
    H200's bench_gemv (2026-12-02, every 9B decode shape, us; docs/kernels.md): Q4_K gemv_kq_stream with
    2 blocks per lane, the fastest at every shape (4096x12288 +res 9.6 against 12.0 for a warp per row
    and 4 blocks, 12352x4096 9.6 against 10.9); Q5_K the same for rows of up to 4096 values in 8K-16K
    rows (12352x4096 12.0 against 12.9, 10240x4096 10.3 against 11.2), a warp per row and 4 blocks
    elsewhere (its streaming form lost on 24576x4096, the head and the down projection); rows of 32K
    values or more, 4 warps per row and 4 blocks. Q6_K by the H100's bench_gemv (2026-12-06,
    docs/BENCHMARKS.md v46, us, against a warp per row and 2 blocks, its form before): the streaming form
    with 2 blocks per lane on the larger matrices of 4K-value rows (12352x4096 17.6 against 20.2,
    24576x4096 31.7 against 34.0, 10240x4096 14.3 against 15.8, the head 291.5 against 300.2), with 4
    on 4096x4096 (6.2 against 6.9), a warp per row and 4 blocks on the down projection (4096x12288 19.1
    against 21.7; streaming 21.2)."""
    v = GEMV_KQ_VARIANT
    if v == "split" or type_name not in kquant_layout.KQUANT_TYPES:
        return None
    if v != "auto":
        known = _kq_variants()
        if v not in known:
            raise ValueError(f"MINECART_GEMV_KQ={v!r}: use auto, split or one of {', '.join(known)}")
        return known[v]
    if K >= 32768:
        return KqGemv(4, 4)
    if type_name == "Q6_K":
        if K >= 8192:
            return KqGemv(1, 4)
        return KqGemv(1, 4, True) if R * K <= 4096 * 4096 else KqGemv(1, 2, True)
    if type_name == "Q5_K" and not (K <= 4096 and 8192 <= R <= 16384):
        return KqGemv(1, 4)
    return KqGemv(1, 2, True)


def _resident_blocks(kernel, name: str, threads: int) -> int:
    """Blocks of `threads` threads of `kernel` that fit on the current card at once, by its registers a
    thread and the card's registers and threads per multiprocessor (no shared memory: the streaming
    GEMV uses none)."""
    key = (cp.cuda.Device().id, name, threads)
    if key not in _RESIDENT:
        attrs = cp.cuda.Device().attributes
        regs_per_warp = -(-max(1, int(kernel.num_regs)) * 32 // 256) * 256  # allocated per warp, 256 at a time
        warps = -(-threads // 32)
        by_regs = int(attrs["MaxRegistersPerMultiprocessor"]) // (regs_per_warp * warps)
        by_threads = int(attrs["MaxThreadsPerMultiProcessor"]) // threads
        _RESIDENT[key] = max(1, min(by_regs, by_threads, 16)) * sm_count()
    return _RESIDENT[key]


_RESIDENT: dict[tuple[int, str, int], int] = {}


# -- multi-token K-quant GEMV (gemv_kq_mt, batched decode) --
# Multi-token DP4A GEMV of the K-quants (env MINECART_GEMV_KQ_MT, read at import; tests and bench_gemv set
# GEMV_KQ_MT_VARIANT): "auto" = gemv_kq_mt with (warps per row, super-blocks per lane in flight) by shape
# (_gemv_kq_mt), "WxN" = gemv_kq_mt<W, N> (build.GEMV_KQ_MT), "old" = the kernels before it (gemv_dp4a in
# launches of 8/4/2/1 tokens up to GEMV_MAX_T, the tiled GEMM above).
GEMV_KQ_MT_VARIANT = os.environ.get("MINECART_GEMV_KQ_MT", "auto")
# K-quant DP4A matmuls of 2..KQ_PASSES_MAX_T tokens run as ceil(T / 8) passes of gemv_kq_mt (each pass
# reads the weights once), larger ones the tiled GEMM (env MINECART_KQ_PASSES_MAX_T). 32 = batches of up
# to 32 sequences: the GEMM's 128-token tiles are mostly empty there and its 128-row tiles give a 4096-row
# matrix 32 blocks. H200 (bench_gemv --multi, docs/kernels.md): a 9B step's GEMVs at 32 sequences 23.4 ms
# in passes against 53.2 ms in the GEMM.
KQ_PASSES_MAX_T = int(os.environ.get("MINECART_KQ_PASSES_MAX_T", "32"))


def _gemv_kq_mt(type_name: str, T: int, R: int, K: int) -> tuple[int, int] | None:
    """(warps per row, super-blocks per lane in flight) of gemv_kq_mt for a K-quant DP4A matmul of T
    tokens, None for the other kernels (one token, "old", T above max(GEMV_MAX_T, KQ_PASSES_MAX_T), not a
    K-quant). "auto": 4 warps per row group up to 8192 rows (a 4096-row matrix then fills 1024 blocks),
    2 above; 2 super-blocks per lane in flight (the fewest spills, kernel comment). A first guess, to be
    confirmed on the device (bench_gemv --multi prints every compiled shape)."""
    v = GEMV_KQ_MT_VARIANT
    if v == "old" or type_name not in kquant_layout.KQUANT_TYPES or T < 2 or T > max(GEMV_MAX_T, KQ_PASSES_MAX_T):
        return None
    if v != "auto":
        return _mt_shape("MINECART_GEMV_KQ_MT", v, "gemv_kq_mt", GEMV_KQ_MT)
    return (4 if R <= 8192 else 2), 2


def _mt_shape(env: str, v: str, kernel: str, compiled: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The (warps per row, blocks in flight) that a "WxN" setting of `env` names, or a ValueError."""
    shapes = ", ".join(f"{a}x{b}" for a, b in compiled)
    try:
        wpr, nu = (int(a) for a in v.split("x"))
    except ValueError:
        raise ValueError(f"{env}={v!r}: use auto, old or WxN, one of {shapes}") from None
    if (wpr, nu) not in compiled:
        raise ValueError(f"{env}={v!r}: {kernel} is compiled for {shapes}")
    return wpr, nu


# The same for Q8_0 (build.GEMV_MT_TYPES) with gemv_mt (env MINECART_GEMV_MT: "auto", "old" = gemv_dp4a in
# launches of 8/4/2/1 tokens up to GEMV_MAX_T and the tiled GEMM above, or "WxN" of build.GEMV_MT), also in
# passes of up to 8 tokens up to KQ_PASSES_MAX_T: on the H200 (bench_gemv --multi, 2026-12-01) the tiled
# GEMM took 62 ms for a 9B step's Q8_0 GEMVs at 16 and at 32 tokens, gemv_mt 6.5 ms at 8.
GEMV_MT_VARIANT = os.environ.get("MINECART_GEMV_MT", "auto")


def _gemv_mt(type_name: str, T: int, R: int) -> tuple[int, int] | None:
    """(warps per row, rounds of 8 blocks per lane in flight) of gemv_mt for a DP4A matmul of 2..KQ_PASSES_MAX_T
    tokens of a GEMV_MT_TYPES weight (passes of up to 8), None otherwise. "auto": warps as _gemv_kq_mt, one round in flight
    (8 Q8_0 blocks = 272 bytes per row group; no spills at any NT), to be confirmed on the device."""
    v = GEMV_MT_VARIANT
    if v == "old" or type_name not in GEMV_MT_TYPES or T < 2 or T > max(GEMV_MAX_T, KQ_PASSES_MAX_T):
        return None
    if v != "auto":
        return _mt_shape("MINECART_GEMV_MT", v, "gemv_mt", GEMV_MT)
    return (4 if R <= 8192 else 2), 1


def gemv_max_t(w: QWeight) -> int:
    """The most tokens matmul(x, w, "dp4a") serves with launches that read the weights once rather than
    the tiled prefill GEMM: 32 for every DP4A format under gemm_batch, KQ_PASSES_MAX_T for a K-quant
    under gemv_kq_mt and for Q8_0 under gemv_mt, else GEMV_MAX_T. A caller that picks the decode path
    below this and the prefill path above keeps batches of up to this many sequences on the GEMV."""
    if w.type_name in DP4A_TYPES and GEMM_BATCH_VARIANT != "off":  # gemm_batch above the GEMVs
        return max(GEMV_MAX_T, KQ_PASSES_MAX_T, max(GEMM_BATCH_TOKENS))
    if w.type_name in kquant_layout.KQUANT_TYPES and GEMV_KQ_MT_VARIANT != "old":
        return max(GEMV_MAX_T, KQ_PASSES_MAX_T)
    if w.type_name in GEMV_MT_TYPES and GEMV_MT_VARIANT != "old":
        return max(GEMV_MAX_T, KQ_PASSES_MAX_T)
    return GEMV_MAX_T




# -- batched decode GEMM (gemm_batch, kernels/gemm.cu) --
# DP4A matmuls of GEMM_BATCH_MIN_T..32 tokens (a batched decode step of that many sequences) run as one
# gemm_batch launch (32 x 8, 32 x 16 or 64 x 32 row x token tiles, weights read once, split over K to fill
# the card)
# instead of passes of the multi-token GEMVs (K-quants, Q8_0) or the 128x128-tile prefill GEMM (the other
# formats above 8 tokens). Env MINECART_GEMM_BATCH: "auto" (from GEMM_BATCH_MIN_T tokens), "on" (from 2
# tokens), "off" (the kernels before it); MINECART_GEMM_BATCH_MIN_T.
GEMM_BATCH_VARIANT = os.environ.get("MINECART_GEMM_BATCH", "auto")
# From 4 tokens: the 9B Q4_K step's matmuls at 4 sequences took 3.26 ms with the 8-token tile against
# 3.52 with the multi-token GEMVs (H200, bench_gemv --multi, docs/BENCHMARKS.md v15; that tile's map was
# 11% slower at 8 tokens than its rows map now, v32; 2 and 3 tokens not re-measured since).
GEMM_BATCH_MIN_T = int(os.environ.get("MINECART_GEMM_BATCH_MIN_T", "4"))
# split K until the launch has about this many blocks per multiprocessor. H200, 9B Q4_K step's matmuls,
# 8-token tile at 2 / 6 / 12 blocks per multiprocessor: 4.556 / 4.557 / 4.624 ms; 32-token tile at 2 / 4:
# 7.711 / 7.643 ms (env MINECART_GEMM_BATCH_BLOCKS_PER_SM; 0: never split). The whole batched step
# (tools/bench_batch_gpu.py, v29), 8 sequences at 2 / 1 / 0: 1,804-1,818 / 1,606-1,683 / 1,284-1,359
# tok/s: the split-K sums (7% of the step) cost less than the idle multiprocessors without them
GEMM_BATCH_BLOCKS_PER_SM = int(os.environ.get("MINECART_GEMM_BATCH_BLOCKS_PER_SM", "2"))


def _gemm_batch(type_name: str, T: int) -> int | None:
    """The token tile (GEMM_BATCH_TOKENS) of gemm_batch for a DP4A matmul of T tokens, None for the other
    kernels."""
    v = GEMM_BATCH_VARIANT
    if v not in ("auto", "on", "off"):
        raise ValueError(f"MINECART_GEMM_BATCH={v!r}: use auto, on or off")
    if v == "off" or type_name not in DP4A_TYPES or T < 2 or T > max(GEMM_BATCH_TOKENS):
        return None
    if v == "auto" and T < GEMM_BATCH_MIN_T:
        return None
    return next(tt for tt in GEMM_BATCH_TOKENS if T <= tt)


# weight rows a block of each gemm_batch token tile (gemm.cu: the rows map's 32 at 8 and 16 tokens, the row
# quads' 64 at 32)
GEMM_BATCH_ROWS = {8: 32, 16: 32, 32: 64}


def gemm_batch_splits(R: int, K: int, sms: int, tt: int) -> tuple[int, int]:
    """(splits over K, stages of 256 values per split) of a gemm_batch launch of token tile `tt` on a card
    with `sms` multiprocessors: a matrix with fewer row tiles (GEMM_BATCH_ROWS) than
    GEMM_BATCH_BLOCKS_PER_SM blocks per multiprocessor is split along K (a 4096 x 4096 matrix in the
    8-token tile's 32-row tiles: 3 splits of at most 6 stages on 132 multiprocessors), each split at
    least one stage."""
    tiles = -(-R // GEMM_BATCH_ROWS[tt])
    stages = -(-(K // 32) // 8)
    want = -(-(GEMM_BATCH_BLOCKS_PER_SM * sms) // tiles)
    splits = max(1, min(stages, want))
    per = -(-stages // splits)
    return -(-stages // per), per


def _single_gemv(w: QWeight, R: int, K: int) -> tuple[str, object, int] | None:
    """(kernel name, kernel, blocks of 128 threads) of a single-token DP4A GEMV of w, None for gemv_dp4a: gemv_kq /
    gemv_kq_stream for the K-quants (_gemv_kq), else gemv_dp4a_stream ("streamN"; "auto" for matrices
    of up to 4096 x 4096 with one block a lane: H200 bench_gemv 2026-12-02, Q8_0 4096x4096 +res 6.3 us
    against 7.1 for gemv_dp4a_split with one warp per row, while the larger shapes kept
    gemv_dp4a_split's 2-4 warps per row, 10240x4096 13.2 against 14.0) or gemv_dp4a_split
    (_gemv_split) by GEMV_VARIANT. A streaming kernel gets at most the blocks the card holds at once."""
    kq = _gemv_kq(w.type_name, R, K)
    if kq is not None:
        name, blocks, stream = kq.kernel(w.type_name), math.ceil(R * kq.wpr / 4), kq.stream
    elif GEMV_VARIANT in _GEMV_STREAM or (GEMV_VARIANT == "auto" and K < 8192 and R * K <= 4096 * 4096):
        nu = _GEMV_STREAM.get(GEMV_VARIANT, 1)
        name, blocks, stream = f"gemv_dp4a_stream<{QT[w.type_name]}, {nu}>", math.ceil(R / 4), True
    else:
        split = _gemv_split(R, K)
        if split is None:
            return None
        name, blocks, stream = f"gemv_dp4a_split<{QT[w.type_name]}, 1, {split[0]}, {split[1]}>", math.ceil(R * split[0] / 4), False
    kernel = _mm_kernel(w, name)
    if stream:
        blocks = min(blocks, _resident_blocks(kernel, name, 128))
    return name, kernel, blocks


def _gemv_split(R: int, K: int) -> tuple[int, int] | None:
    """(warps per row, prefetch) of the single-token DP4A GEMV for R rows of K values, None for gemv_dp4a.

    "auto": rows of 8K+ values are split over 4 warps, matrices larger than 4096x4096 over 2, the rest
    take one warp per row: the fastest variant per 9B decode shape on the H200 (tests/gpu/test_fused.py
    prints all of them: 4096x12288 82% of copy bandwidth with 4 warps vs 68% with 1; 12352x4096 90% vs
    83%; 10240x4096 87% vs 77%; 4096x4096 65% with 1 vs 59% with 2)."""
    v = GEMV_VARIANT
    if v in _GEMV_SPLIT:
        return _GEMV_SPLIT[v]
    if v not in ("auto", "autopf"):
        return None
    wpr = 4 if K >= 8192 else (1 if R * K <= 4096 * 4096 else 2)
    return (wpr, 1 if v == "autopf" and wpr <= 2 else 0)


def matmul_io(x: cp.ndarray, w: QWeight, out: cp.ndarray | None, residual: cp.ndarray | None):
    """The checked arguments of a matmul launch (matmul here, hfma2.matmul): x as contiguous fp32 (T, K)
    with K = w.cols, the output y (T, R) (`out` or a new array) and the residual as contiguous fp32
    (T, R) (None stays None; left as given when T = 0)."""
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    T, K = x.shape
    if K != w.cols:
        raise ValueError(f"matmul: input has {K} columns, weight has {w.cols}")
    y = out if out is not None else cp.empty((T, w.rows), dtype=cp.float32)
    if T and residual is not None:
        residual = cp.ascontiguousarray(residual, dtype=cp.float32).reshape(T, w.rows)
    return x, y, residual


def _writes_segments(w: QWeight, T: int, path: str) -> bool:
    """Whether matmul(x, w, path) of T tokens runs a kernel that writes a fused group's members apart
    (matmul's `segments`): gemm_batch (a batched decode step) and gemm_dp4a (prefill)."""
    if T < 2 or not (path.startswith("dp4a") and w.dp4a_ok):
        return False
    if _gemm_batch(w.type_name, T) is not None:
        return True
    R, K = w.rows, w.cols
    return T > GEMV_MAX_T and _gemv_kq_mt(w.type_name, T, R, K) is None and _gemv_mt(w.type_name, T, R) is None


def matmul_split(x: cp.ndarray, w: QWeight, ranges, path: str = "dp4a") -> list[cp.ndarray]:
    """matmul of a fused group's rows, split into its members' outputs: the row ranges [(a, b), ...]
    (consecutive, covering 0..R) as contiguous (T, b - a) arrays, views of one buffer. gemm_batch
    (a batched decode step) and gemm_dp4a (prefill) write them in place; the other kernels write (T, R),
    which split_columns splits (one token: the rows are already consecutive)."""
    ranges = [(int(a), int(b)) for a, b in ranges]
    bounds = (0, *(b for _, b in ranges))
    T = x.shape[0]
    if 1 < len(ranges) <= SPLIT_COLS_MAX and _writes_segments(w, T, path) \
            and bounds == tuple(sorted(set(bounds))) and bounds[-1] == w.rows:
        flat = matmul(x, w, path, segments=bounds).reshape(-1)
        return [flat[T * a : T * b].reshape(T, b - a) for a, b in ranges]
    y = matmul(x, w, path)
    if T == 1:
        flat = y.reshape(-1)
        return [flat[a:b].reshape(1, b - a) for a, b in ranges]
    return split_columns(y, ranges)


# ---- requantized prefill (path "dp4a_rq") ----
# A prefill matmul of a format other than Q8_0 may run as the Q8_0 GEMM on its weights requantized to Q8_0
# (gemm.cu requant_q8_0: each 32-value block dequantized exactly, then quantized as ggml's Q8_0 quantizer
# does) a window of rows at a time, into a scratch of at most REQUANT_SCRATCH_BYTES. The Q8_0 kernel does
# fewer instructions per DP4A than the K-quants' (no offset term, no nibble expansion, two quant blocks a
# stage); the requantization reads the weights once and writes ~1.06 bytes a value, once per matmul of T
# tokens, which is why it is taken from REQUANT_MIN_T tokens only. The probe picks it for the K-quants
# where it is faster (kernels/probe.py pick_kquant_gemm); its products carry a second rounding of the
# weights (at most half a Q8_0 step, 1/254 of the block's largest magnitude) beside the int8
# activations' own.
MATMUL_PATHS = ("dp4a", "dp4a2", "dp4a_rq", "fma", "hfma2")  # ops.matmul's `path`
REQUANT_TYPES = tuple(t for t in DP4A_TYPES if t != "Q8_0")
REQUANT_MIN_T = int(os.environ.get("MINECART_REQUANT_MIN_T", "256"))
REQUANT_SCRATCH_BYTES = 64 << 20


def requant_rows(w: QWeight, rlo: int, rows: int, oq: cp.ndarray | None = None,
                 od: cp.ndarray | None = None) -> tuple[cp.ndarray, cp.ndarray]:
    """Rows rlo..rlo+rows-1 of w (a REQUANT_TYPES matrix, one expert) in Q8_0's device layout: (int8 (rows,
    K), fp16 bits uint16 (rows, K / 32)), written into oq / od when given (at least `rows` rows each)."""
    if w.type_name not in REQUANT_TYPES:
        raise ValueError(f"requant_rows: {w.type_name} is not one of {', '.join(REQUANT_TYPES)}")
    if not 0 <= rlo <= rlo + rows <= w.rows * w.experts:
        raise ValueError(f"requant_rows: rows {rlo}..{rlo + rows} outside the matrix's {w.rows * w.experts}")
    K = w.cols
    oq = cp.empty((rows, K), dtype=cp.int8) if oq is None else oq
    od = cp.empty((rows, K // 32), dtype=cp.uint16) if od is None else od
    n = rows * (K // 32)
    if n:
        wd = w.wd if w.wd is not None else _dummy()
        _mm_kernel(w, f"requant_q8_0<{QT[w.type_name]}>")((math.ceil(n / 256),), (256,),
                                                           (w.wq, wd, np.int32(K), np.int32(rlo), np.int32(rows),
                                                            oq, od))
    return oq[:rows], od[:rows]


_NO_PAIR = (np.int32(0), np.uint64(0), np.uint64(0), np.uint64(0))  # gemm_dp4a's PAIR-only arguments


def requant_window(rows: int, K: int, granule: int, parts: int = 1) -> int:
    """Rows of a K-column matrix requantized at a time: as many as `parts` such windows side by side fit in
    REQUANT_SCRATCH_BYTES (K + K / 16 bytes a row: int8 values and fp16 scales), a multiple of `granule`
    (the GEMM's rows a block) and at least one granule, at most `rows` (the whole matrix).
    engine/placement.py prices this scratch: at most the cap, or the whole matrix."""
    step = max(granule, REQUANT_SCRATCH_BYTES // parts // (K + K // 16) // granule * granule)
    return min(step, rows)


class PrefillGemm(NamedTuple):
    """The DP4A prefill GEMM ops.matmul runs (prefill_gemm): gemm_dp4a<Q8_0, 2> on the weights requantized
    a window at a time (requant), else gemm_dp4a<the stored format, nblk>."""
    requant: bool
    nblk: int


def prefill_gemm(w: QWeight, T: int, path: str) -> PrefillGemm | None:
    """Which gemm_dp4a ops.matmul runs for w at T tokens on `path`; None where it runs another kernel (the
    batched-decode GEMM, a GEMV, the FMA / HFMA2 paths). matmul's dispatch and swiglu_fusable both ask
    this, so the fused SwiGLU is taken exactly where the Q8_0 GEMM would run."""
    if not (path.startswith("dp4a") and w.dp4a_ok) or T <= GEMV_MAX_T:
        return None
    if _gemm_batch(w.type_name, T) is not None or _gemv_kq_mt(w.type_name, T, w.rows, w.cols) is not None \
            or _gemv_mt(w.type_name, T, w.rows) is not None:
        return None
    if path == "dp4a_rq" and w.type_name in REQUANT_TYPES and T >= REQUANT_MIN_T and w.experts == 1:
        return PrefillGemm(True, 2)
    # "dp4a_rq" here: a Q8_0 matrix is already what requantizing gives (the same two-block GEMM); any
    # other format below REQUANT_MIN_T takes its own one-block GEMM
    return PrefillGemm(False, 2 if path == "dp4a2" or (path == "dp4a_rq" and w.type_name == "Q8_0") else 1)


def _gemm_requant(w: QWeight, xq, xd, xs, y, T: int, residual, seg, nseg) -> None:
    """y = the Q8_0 GEMM (two quant blocks a stage) of w requantized, REQUANT_SCRATCH_BYTES of rows at a time."""
    R, K = w.rows, w.cols
    step = requant_window(R, K, 128)
    oq = cp.empty((step, K), dtype=cp.int8)
    od = cp.empty((step, K // 32), dtype=cp.uint16)
    k = get_kernel("matmul_Q8_0", f"gemm_dp4a<{QT['Q8_0']}, 2>")
    res = residual if residual is not None else np.uint64(0)
    for rlo in range(0, R, step):
        rows = min(step, R - rlo)
        requant_rows(w, rlo, rows, oq, od)
        k((math.ceil(rows / 128), math.ceil(T / 128)), (256,),
          (oq, od, xq, xd, xs, y, np.int32(T), np.int32(R), np.int32(K), res, seg, nseg, np.int32(rlo),
           np.int32(rlo + rows), *_NO_PAIR))


def matmul(x: cp.ndarray, w: QWeight, path: str = "dp4a", out: cp.ndarray | None = None,
           residual: cp.ndarray | None = None, segments: tuple[int, ...] | None = None) -> cp.ndarray:
    """(T, K) @ W^T -> (T, R), fp32 accumulation. path (MATMUL_PATHS): "dp4a" (int8 activations; "dp4a2" =
    the GEMM variant staging two quant blocks per barrier; "dp4a_rq" = a prefill GEMM of REQUANT_TYPES
    weights from REQUANT_MIN_T tokens on the weights requantized to Q8_0, above) or "fma" (fp32). residual (T, R): added to the
    result (in the DP4A kernels' epilogues; by a separate add on the FMA GEMM). segments (only where
    gemm_batch or gemm_dp4a runs: matmul_split, _writes_segments): row bounds (0, a_1, ..., R); the
    result's rows [a_j, a_j+1) then lie as consecutive (T, a_j+1 - a_j) blocks of the returned buffer."""
    if path not in MATMUL_PATHS:
        raise ValueError(f"matmul path must be one of {', '.join(MATMUL_PATHS)}, got {path!r}")
    if path == "hfma2":  # fp16 products, fp32 accumulation (hfma2.py)
        from . import hfma2

        return hfma2.matmul(x, w, out, residual)
    x, y, residual = matmul_io(x, w, out, residual)
    (T, K), R = x.shape, w.rows
    if T == 0:
        return y
    wd = w.wd if w.wd is not None else _dummy()
    use_dp4a = path.startswith("dp4a") and w.dp4a_ok
    q = QT[w.type_name]
    if use_dp4a:
        xq, xd, xs = quantize_cached(x)
    nb = K // 32
    tt = _gemm_batch(w.type_name, T) if use_dp4a else None
    seg = _segment_bounds(segments) if segments is not None else np.uint64(0)
    nseg = np.int32(len(segments) - 1 if segments is not None else 1)
    if tt is not None:  # batched decode: one launch for all T tokens (+ the split-K sum)
        splits, per = gemm_batch_splits(R, K, sm_count(), tt)
        part = cp.empty((splits, T, R), dtype=cp.float32) if splits > 1 else np.uint64(0)
        res = residual if residual is not None else np.uint64(0)
        _mm_kernel(w, f"gemm_batch<{q}, {tt}>")((math.ceil(R / GEMM_BATCH_ROWS[tt]), splits), (128,),
                                                (w.wq, wd, xq, xd, xs, y, part, np.int32(T), np.int32(R),
                                                 np.int32(K), np.int32(per), res, seg, nseg))
        if splits > 1:
            _mm_kernel(w, "splitk_sum")((math.ceil(T * R / 256),), (256,),
                                        (part, np.int32(splits), np.int32(T), np.int32(R), y, res, seg, nseg))
        return y
    mt = _gemv_kq_mt(w.type_name, T, R, K) if use_dp4a else None
    mt_kernel = "gemv_kq_mt"
    if use_dp4a and mt is None:
        mt, mt_kernel = _gemv_mt(w.type_name, T, R), "gemv_mt"
    # decided by this dispatch itself, so no kernel that ignores `seg` is ever handed segments
    if segments is not None and not (use_dp4a and mt is None and T > GEMV_MAX_T):
        raise ValueError("matmul: segments are laid out by gemm_batch and gemm_dp4a only (use matmul_split)")
    if mt is not None:  # multi-token GEMV (batched decode), grid: 16 / wpr rows per block
        wpr, nu = mt
        for t0, nt in kq_passes(T):
            res = residual[t0:] if residual is not None else np.uint64(0)
            k = _mm_kernel(w, f"{mt_kernel}<{q}, {nt}, {wpr}, {nu}>")
            k((math.ceil(R * wpr / 16),), (128,), (w.wq, wd, xq[t0:], xd[t0:], xs[t0:], y[t0:], np.int32(R),
                                                   np.int32(K), res))
        return y
    if T <= GEMV_MAX_T:
        warps = 4
        grid = (math.ceil(R / warps),)
        for t0, nt in _chunks(T):
            res = residual[t0:] if residual is not None else np.uint64(0)
            one = _single_gemv(w, R, K) if use_dp4a and nt == 1 else None
            if one is not None:
                _, k, blocks = one
                k((blocks,), (128,), (w.wq, wd, xq[t0:], xd[t0:], xs[t0:], y[t0:], np.int32(R), np.int32(K), res))
            elif use_dp4a:
                k = _mm_kernel(w, f"gemv_dp4a<{q}, {nt}>")
                k(grid, (32 * warps,), (w.wq, wd, xq[t0:], xd[t0:], xs[t0:], y[t0:], np.int32(R),
                                        np.int32(K), np.uint64(0), np.int32(1), res))
            else:
                k = _mm_kernel(w, f"gemv_fma<{q}, {nt}>")
                k(grid, (32 * warps,), (w.wq, wd, x[t0:], y[t0:], np.int32(R), np.int32(K),
                                        np.uint64(0), np.int32(1), res))
        del nb
        return y
    gemm = prefill_gemm(w, T, path) if use_dp4a else None
    if gemm is not None:
        if gemm.requant:
            _gemm_requant(w, xq, xd, xs, y, T, residual, seg, nseg)
            return y
        k = _mm_kernel(w, f"gemm_dp4a<{q}, {gemm.nblk}>")
        k((math.ceil(R / 128), math.ceil(T / 128)), (256,),
          (w.wq, wd, xq, xd, xs, y, np.int32(T), np.int32(R), np.int32(K),
           residual if residual is not None else np.uint64(0), seg, nseg, np.int32(0), np.int32(R), *_NO_PAIR))
        return y
    k = _mm_kernel(w, f"gemm_fma<{q}>")
    k((math.ceil(R / 64), math.ceil(T / 64)), (256,), (w.wq, wd, x, y, np.int32(T), np.int32(R), np.int32(K)))
    if residual is not None:
        y += residual  # one extra elementwise launch on the fallback path
    return y


# ---- a feed-forward layer's gate and up with SwiGLU in the GEMM's epilogue ----
# gemm_dp4a<Q8_0, 2, PAIR>: each block takes 64 gate rows and the same 64 up rows of a matrix holding a
# layer's gate rows then its up rows (R = 2F: a fused group), and writes h = silu(gate) * up (T, F) with its
# q8_1 blocks instead of the (T, 2F) products. The same bits as matmul (the gate and up products are
# computed alike) followed by swiglu_q8 (same function, same quantization), for one launch and
# (T x 2F) x 8 bytes of traffic less. Taken where the prefill GEMM ops.matmul would run is that kernel:
# Q8_0 on "dp4a2" / "dp4a_rq", and REQUANT_TYPES on "dp4a_rq" from REQUANT_MIN_T tokens (windows of gate
# rows and the same up rows requantized side by side).

def swiglu_fusable(w: QWeight, T: int, path: str) -> bool:
    """Whether matmul_swiglu runs for w (gate rows then up rows, R = 2F) at T tokens on `path`."""
    gemm = prefill_gemm(w, T, path)
    if gemm is None or w.experts != 1 or w.rows % 64:
        return False
    return gemm.requant or (w.type_name == "Q8_0" and gemm.nblk == 2)


def matmul_swiglu(x: cp.ndarray, w: QWeight, path: str):
    """silu(x @ gate^T) * (x @ up^T) for w = [gate; up] (R = 2F rows) -> (h (T, F) float32, h's q8_1 blocks
    (q8_arrays)), where swiglu_fusable(w, T, path); the Q8_0 GEMM with the PAIR epilogue."""
    if not swiglu_fusable(w, x.shape[0], path):
        raise ValueError(f"matmul_swiglu: not for a {w.type_name} matrix of {w.rows} rows at {x.shape[0]} tokens "
                         f"on path {path!r} (swiglu_fusable)")
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    (T, K), F = x.shape, w.rows // 2
    xq, xd, xs = quantize_cached(x)
    h = cp.empty((T, F), dtype=cp.float32)
    hq, hd, hs = q8_arrays(T, F)
    k = get_kernel("matmul_Q8_0", f"gemm_dp4a<{QT['Q8_0']}, 2, true>")
    no_seg = np.uint64(0)

    def launch(wq, wd, flo: int, fhi: int, uoff: int) -> None:
        k((math.ceil((fhi - flo) / 64), math.ceil(T / 128)), (256,),
          (wq, wd, xq, xd, xs, h, np.int32(T), np.int32(F), np.int32(K), np.uint64(0), no_seg, np.int32(1),
           np.int32(flo), np.int32(fhi), np.int32(uoff), hq, hd, hs))

    if w.type_name == "Q8_0":
        launch(w.wq, w.wd if w.wd is not None else _dummy(), 0, F, F)
        return h, (hq, hd, hs)
    # windows of f: gate rows flo..fhi and up rows F + flo.. requantized into the scratch's two halves
    step = requant_window(F, K, 64, parts=2)
    oq = cp.empty((2 * step, K), dtype=cp.int8)
    od = cp.empty((2 * step, K // 32), dtype=cp.uint16)
    for flo in range(0, F, step):
        n = min(step, F - flo)
        requant_rows(w, flo, n, oq, od)
        requant_rows(w, F + flo, n, oq[n:], od[n:])
        launch(oq, od, flo, flo + n, n)
    return h, (hq, hd, hs)


def matmul_experts(x: cp.ndarray, w: QWeight, ids: cp.ndarray, x_div: int, path: str = "dp4a") -> cp.ndarray:
    """Row p of the result = x[p // x_div] @ W[ids[p]]^T, for p < len(ids) (mixture of experts)."""
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    P = int(ids.size)
    R, K = w.rows, w.cols
    y = cp.empty((P, R), dtype=cp.float32)
    if P == 0:
        return y
    wd = w.wd if w.wd is not None else _dummy()
    q = QT[w.type_name]
    warps = 4
    grid = (math.ceil(R / warps), P)
    if path.startswith("dp4a") and w.dp4a_ok:
        xq, xd, xs = quantize_cached(x)
        _mm_kernel(w, f"gemv_dp4a<{q}, 1>")(grid, (32 * warps,), (w.wq, wd, xq, xd, xs, y, np.int32(R), np.int32(K),
                                                                   ids, np.int32(x_div), np.uint64(0)))
    else:
        _mm_kernel(w, f"gemv_fma<{q}, 1>")(grid, (32 * warps,), (w.wq, wd, x, y, np.int32(R), np.int32(K),
                                                                  ids, np.int32(x_div), np.uint64(0)))
    return y


def embed(w: QWeight, ids: cp.ndarray) -> cp.ndarray:
    """Rows ids (int32 device array) of an embedding table -> (T, K) fp32."""
    T = int(ids.size)
    K = w.cols
    out = cp.empty((T, K), dtype=cp.float32)
    n = T * (K // 32)
    if n:
        wd = w.wd if w.wd is not None else _dummy()
        _mm_kernel(w, f"embed_rows<{QT[w.type_name]}>")((math.ceil(n / 128),), (128,),
                                                        (w.wq, wd, ids, out, np.int32(T), np.int32(K)))
    return out


# ---- norms and elementwise ------------------------------------------------------------------------

def _row_norm(mode: int, x, other, w, eps: float, want_sum: bool = False):
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    N = x.shape[-1]
    rows = x.size // N if N else 0
    out = cp.empty_like(x)
    s_out = cp.empty_like(x) if want_sum else None
    if rows == 0:
        return (s_out, out) if want_sum else out
    other = cp.ascontiguousarray(other, dtype=cp.float32) if other is not None else None
    args = (x, other if other is not None else x, w if w is not None else np.uint64(0), out,
            s_out if s_out is not None else out, np.int32(rows), np.int32(N), np.float32(eps))
    if N <= 1024:
        warps = 8
        get_kernel("elementwise", f"row_norm<true, {mode}>")((math.ceil(rows / warps),), (32 * warps,), args)
    else:
        get_kernel("elementwise", f"row_norm<false, {mode}>")((rows,), (256,), args)
    return (s_out, out) if want_sum else out


def rms_norm(x, w, eps: float):
    return _row_norm(0, x, None, w, eps)


def add_rms_norm(x, delta, w, eps: float):
    return _row_norm(1, x, delta, w, eps, want_sum=True)


def l2_norm(x, eps: float):
    return _row_norm(2, x, None, None, eps)


def gated_rms_norm(x, z, w, eps: float):
    return _row_norm(3, x, z, w, eps)


_EW = {"add": 0, "mul": 1, "scale": 2, "sigmoid": 3, "silu": 4, "swiglu": 5, "geglu": 6, "gate": 7}


SPLIT_COLS_MAX = 8  # column ranges split_cols takes in one launch


def split_columns(y: cp.ndarray, ranges) -> list[cp.ndarray]:
    """The column ranges [(a, b), ...] of y (T, R), consecutive and covering 0..R, as contiguous (T, b - a)
    arrays: views of one buffer filled by one split_cols launch (a copy per range above SPLIT_COLS_MAX)."""
    y = cp.ascontiguousarray(y, dtype=cp.float32)
    T, R = y.shape
    ranges = [(int(a), int(b)) for a, b in ranges]
    if [a for a, _ in ranges[1:]] != [b for _, b in ranges[:-1]] or not ranges or ranges[0][0] != 0 \
            or ranges[-1][1] != R or any(b <= a for a, b in ranges):
        raise ValueError(f"split_columns: ranges {ranges} do not cover 0..{R} in order")
    if len(ranges) > SPLIT_COLS_MAX:
        return [cp.ascontiguousarray(y[:, a:b]) for a, b in ranges]
    buf = cp.empty(T * R, dtype=cp.float32)
    if T:
        starts = [b for _, b in ranges] + [R] * (SPLIT_COLS_MAX - len(ranges))
        get_kernel("elementwise", "split_cols")((math.ceil(T * R / 256),), (256,),
                                                (y, buf, np.int64(T), np.int32(R), np.int32(len(ranges)),
                                                 *(np.int32(v) for v in starts)))
    return [buf[T * a : T * b].reshape(T, b - a) for a, b in ranges]


def ewise(op: str, a, b=None, s: float = 0.0):
    a = cp.ascontiguousarray(a, dtype=cp.float32)
    if b is not None:
        b = cp.ascontiguousarray(b, dtype=cp.float32)
        if b.size != a.size:
            if b.size == 0 or a.size % b.size:
                raise ValueError(f"{op}: cannot broadcast {b.shape} over {a.shape}")
        elif b.shape != a.shape:
            raise ValueError(f"{op}: shapes {a.shape} and {b.shape} differ")
    out = cp.empty_like(a)
    n = a.size
    if n:
        get_kernel("elementwise", f"ewise<{_EW[op]}>")((math.ceil(n / 256),), (256,),
                                                       (a, b if b is not None else a, out, np.int64(n),
                                                        np.int64(b.size if b is not None else n), np.float32(s)))
    return out


def gdn_gates(alpha, beta, ssm_a, dt_bias):
    alpha = cp.ascontiguousarray(alpha, dtype=cp.float32)
    beta = cp.ascontiguousarray(beta, dtype=cp.float32)
    n_v = alpha.shape[-1]
    g = cp.empty_like(alpha)
    b = cp.empty_like(beta)
    n = alpha.size
    if n:
        get_kernel("elementwise", "gdn_gates")((math.ceil(n / 256),), (256,),
                                               (alpha, beta, ssm_a, dt_bias, g, b, np.int32(n), np.int32(n_v)))
    return g, b


def rope(x, pos3: cp.ndarray, comp: cp.ndarray, inv_freq: cp.ndarray, n_rot: int, scale: float):
    """x (T, nh, d); pos3 (3, T) int32; comp (n_rot/2,) int32; inv_freq (n_rot/2,) fp32."""
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    T, nh, d = x.shape
    out = cp.empty_like(x)
    n = x.size
    if n:
        get_kernel("elementwise", "rope_neox")((math.ceil(n / 256),), (256,),
                                               (x, out, pos3, comp, inv_freq, np.int32(T), np.int32(nh),
                                                np.int32(d), np.int32(n_rot), np.float32(1.0 / scale)))
    return out


# ---- attention --------------------------------------------------------------------------------------

_SMS: dict[int, int] = {}


def sm_count() -> int:
    dev = cp.cuda.Device().id
    if dev not in _SMS:
        _SMS[dev] = int(cp.cuda.Device().attributes["MultiProcessorCount"])
    return _SMS[dev]


# context slices of a single-token flash_decode: about this many blocks per multiprocessor over the
# KV heads (the kernel fits 3 at its 168 registers a thread; tools/bench_decode_attention.py --bps 2,3,4 on
# the H200, f16 cache, 16K: 9B heads 37.5 / 39.6 / 45.8 us, 27B 53.3 / 55.1 / 64.9, 35B-A3B 45.4 / 48.2 /
# 48.2, BENCHMARKS.md v20; env MINECART_FD_BLOCKS overrides)
DECODE_BLOCKS_PER_SM = int(os.environ.get("MINECART_FD_BLOCKS", "2"))


# the split merges (flash_merge, flash_merge_len, fused.cu attn_merge_gate): a block of MERGE_THREADS
# per head and MERGE_COLS columns (common.cuh merge_head_splits, whose #defines these equal)
MERGE_COLS = 64
MERGE_THREADS = 256


def merge_grid(nh: int, D: int) -> tuple[int, int]:
    """The grid of a split merge over nh heads of dim D (D % MERGE_COLS == 0: every head dim compiled)."""
    if D % MERGE_COLS:
        raise ValueError(f"the split merge takes head dims that are multiples of {MERGE_COLS}, got {D}")
    return nh, D // MERGE_COLS


def decode_kernel(D: int, nh: int, n_kv: int) -> str:
    """The flash_decode instantiation for head dim D and nh / n_kv query heads per KV head (<= 8): the
    smallest compiled group size GM that holds them (registers scale with GM)."""
    G = nh // n_kv
    gm = next((g for g in DECODE_GROUPS if g >= G), None)
    if gm is None or nh % n_kv:
        raise ValueError(f"decode attention serves up to {DECODE_GROUPS[-1]} query heads per KV head; "
                         f"got {nh} query heads over {n_kv} KV heads")
    return f"flash_decode<{D}, {gm}>"


def decode_partials(kc, kv_len: int, nh: int, D: int, kv_len_ptr=None):
    """The context split of a single-token flash_decode and its partial buffers: DECODE_BLOCKS_PER_SM
    blocks per multiprocessor over the n_kv heads; with kv_len_ptr (graph replay) as many splits as the whole
    capacity needs and split_len 0, so the kernel sizes the slices for the device-side length (splits
    past it exit at once). Returns (n_splits, split_len, po, pm, pl)."""
    n_kv = kc.shape[1]
    span = kc.shape[0] if kv_len_ptr is not None else kv_len
    want = max(1, (DECODE_BLOCKS_PER_SM * sm_count()) // n_kv)
    split_len = max(32, math.ceil(span / want / 32) * 32)
    n_splits = max(1, math.ceil(span / split_len))
    if kv_len_ptr is not None:
        split_len = 0
    po = cp.empty((n_splits, nh, D), dtype=cp.float32)
    pm = cp.empty((n_splits, nh), dtype=cp.float32)
    pl = cp.empty((n_splits, nh), dtype=cp.float32)
    return n_splits, split_len, po, pm, pl


def attention(q, kc, vc, start: int, kv_len: int, scale: float, window: int = 0,
              kv_len_ptr: cp.ndarray | None = None, prefill: str = "tiled", kv_type: str = "f32") -> cp.ndarray:
    """Causal GQA flash attention of q (T, nh, D) at positions start.. over cache rows [0, kv_len).

    kv_len_ptr (decode only): a device int32 holding the length before this token's append; the
    kernel then reads the context length from the device (CUDA-graph replay): the number of splits is
    sized for the whole cache capacity, the slices for the device-side length. prefill: "tiled"
    (flash_prefill_g, 64 query rows of one KV head per block) or "rows" (the older flash_prefill, 32
    queries of one head per block). kv_type: how the cache stores values: "f32" (kc, vc (capacity, n_kv,
    D) float32), "f16" (float16) or "q8_0" (uint8 (capacity, n_kv, D / 32 * 34): Q8_0 blocks); the f16
    and q8_0 kernels (modules attention_f16 / attention_q8_0) dequantize in registers, tiled prefill only."""
    q = cp.ascontiguousarray(q, dtype=cp.float32)
    T, nh, D = q.shape
    n_kv = kc.shape[1]
    row = {"f32": D, "f16": D, "q8_0": D // 32 * 34}.get(kv_type)
    if row is None:
        raise ValueError(f"no attention kernels for a {kv_type!r} cache (f32, f16, q8_0)")
    if D not in HEAD_DIMS or vc.shape[2] != row or kc.shape[2] != row:
        raise ValueError(f"attention kernels are compiled for head dims {HEAD_DIMS} with equal K/V dims; "
                         f"got {D} with a {kv_type} cache of rows {kc.shape[2]}/{vc.shape[2]}")
    module = "attention" if kv_type == "f32" else f"attention_{kv_type}"
    out = cp.empty((T, nh, D), dtype=cp.float32)
    G = nh // n_kv
    if T == 1 and G <= 8:
        # Split the context into DECODE_BLOCKS_PER_SM blocks per multiprocessor over the KV heads.
        n_splits, split_len, po, pm, pl = decode_partials(kc, kv_len, nh, D, kv_len_ptr)
        get_kernel(module, decode_kernel(D, nh, n_kv))(
            (n_kv, n_splits), (128,), (q, kc, vc, po, pm, pl, np.int32(nh), np.int32(n_kv), np.int32(kv_len),
                                       kv_len_ptr if kv_len_ptr is not None else np.uint64(0),
                                       np.int32(split_len), np.float32(scale), np.int32(window)))
        get_kernel("attention", "flash_merge_len")(merge_grid(nh, D), (MERGE_THREADS,),
                                                   (po, pm, pl, out, np.int32(n_splits), np.int32(nh), np.int32(D),
                                                    np.int32(kv_len), kv_len_ptr if kv_len_ptr is not None
                                                    else np.uint64(0), np.int32(split_len)))
        return out
    if kv_len_ptr is not None:
        raise ValueError("device-side context length is only supported for single-token decode")
    return flash_prefill(q, kc, vc, out, start, kv_len, scale, window, prefill, module=module)


def flash_prefill(q, kc, vc, out, start: int, kv_len: int, scale: float, window: int = 0,
                  kernel: str = "tiled", module: str = "attention") -> cp.ndarray:
    """The prefill kernel of `attention` for any T (1 included): q (T, nh, D) fp32 contiguous, out
    the same shape. kernel: "tiled" (flash_prefill_g) or "rows" (flash_prefill, f32 caches only);
    module: "attention" (f32 cache) or attention_f16 / attention_q8_0."""
    T, nh, D = q.shape
    n_kv = kc.shape[1]
    args = (q, kc, vc, out, np.int32(T), np.int32(nh), np.int32(n_kv), np.int32(start), np.int32(kv_len),
            np.float32(scale), np.int32(window))
    if kernel == "rows" and module != "attention":
        raise ValueError("the rows prefill kernel reads f32 caches only; use kernel='tiled'")
    if kernel == "rows":
        get_kernel("attention", f"flash_prefill<{D}>")((math.ceil(T / 32), nh), (128,), args)
    elif kernel == "tiled":
        # one block per 64 rows (position, query head) of a KV head, 1-D grid (the kernel orders it)
        get_kernel(module, f"flash_prefill_g<{D}>")((math.ceil(T * (nh // n_kv) / 64) * n_kv,), (256,), args)
    else:
        raise ValueError(f"unknown prefill kernel {kernel!r} (tiled or rows)")
    return out


def kv_append(k, v, kc, vc, row_ptr: cp.ndarray) -> None:
    """Write one token's k (1, n_kv, d) and v into the caches at the row held on the device."""
    k = cp.ascontiguousarray(k, dtype=cp.float32)
    v = cp.ascontiguousarray(v, dtype=cp.float32)
    n_k, n_v = k.size, v.size
    get_kernel("attention", "kv_append")((max(1, math.ceil(max(n_k, n_v) / 256)),), (256,),
                                         (k, v, kc, vc, row_ptr, np.int32(n_k), np.int32(n_v)))


# ---- Gated DeltaNet ---------------------------------------------------------------------------------

CONV_RUN = 16  # gdn.cu: tokens a thread of conv1d_silu runs through
CONV_KW_MAX = 8  # gdn.cu: the widest causal conv it takes (Qwen3.5: 4)


def conv1d_silu(x, state, w, cuts: tuple[int, ...] = ()) -> list[cp.ndarray]:
    """x (T, C); state (K-1, C) updated in place; w (C, K). Returns silu(conv) (T, C) cut at the column
    bounds `cuts` (at most two, increasing, inside 0..C), each piece a contiguous (T, width) array (the
    kernel writes them apart: no copy of a column slice after it)."""
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    T, C = x.shape
    KW = w.shape[1]
    if not 1 <= KW <= CONV_KW_MAX:
        raise ValueError(f"conv1d_silu: kernel width {KW} outside 1..{CONV_KW_MAX}")
    bounds = (0, *(int(c) for c in cuts), C)
    if len(bounds) > 4 or any(a >= b for a, b in zip(bounds[:-1], bounds[1:], strict=False)):
        raise ValueError(f"conv1d_silu: cuts {cuts} are not at most two increasing columns inside 0..{C}")
    s1, s2 = (list(bounds[1:-1]) + [C, C])[:2]
    out = cp.empty(T * C, dtype=cp.float32)
    if T:
        get_kernel("gdn", "conv1d_silu")((math.ceil(C / 256), math.ceil(T / CONV_RUN)), (256,),
                                         (x, state, w, out, np.int32(T), np.int32(C), np.int32(KW), np.int32(s1),
                                          np.int32(s2)))
        get_kernel("gdn", "conv_state_update")((math.ceil(C / 256),), (256,),
                                               (x, state, np.int32(T), np.int32(C), np.int32(KW)))
    return [out[T * a:T * b].reshape(T, b - a) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def gdn_inputs(q, k, v, g, beta, state, key_dims: tuple[int, ...], what: str):
    """The checked inputs of a delta-rule launch (gdn_scan, gdn_chunk.gdn_chunked): q, k, v, g, beta as
    contiguous float32, the shape (T, n_k, dk, n_v, dv) and a fresh (T, n_v, dv) float32 output.
    Raises ValueError for a key dim outside `key_dims` (`what` names the kernels) or a state that is not
    a contiguous float32 array."""
    q, k, v, g, beta = (cp.ascontiguousarray(a, dtype=cp.float32) for a in (q, k, v, g, beta))
    T, n_k, dk = q.shape
    _, n_v, dv = v.shape
    if dk not in key_dims:
        raise ValueError(f"{what} kernels are compiled for key dims {key_dims}; got {dk}")
    if not state.flags.c_contiguous or state.dtype != cp.float32:
        raise ValueError("GDN state must be a contiguous float32 array made by the backend")
    out = cp.empty((T, n_v, dv), dtype=cp.float32)
    return (q, k, v, g, beta), (T, n_k, dk, n_v, dv), out


def gdn_scan(q, k, v, g, beta, state):
    """Delta-rule recurrence over T tokens; state (n_v, dk, dv) fp32 updated in place; -> (T, n_v, dv)."""
    (q, k, v, g, beta), (T, n_k, dk, n_v, dv), out = gdn_inputs(q, k, v, g, beta, state, GDN_KEY_DIMS,
                                                                 "Gated DeltaNet")
    if T:
        slices = math.ceil(dv / 32)
        get_kernel("gdn", f"gdn_scan<{dk}>")((n_v * slices,), (64,),
                                             (q, k, v, g, beta, state, out, np.int32(T), np.int32(n_k),
                                              np.int32(n_v), np.int32(dv)))
    return out


# ---- sampling and routing ---------------------------------------------------------------------------

TOPK_SLICE = 4096
TOPK_MAX = 128
# top_k by k rounds of block argmax (topk_stage1/2) up to this k, above it in four passes whatever k
# (topk_group_max, topk_threshold, topk_gather, topk_select: a threshold below which no logit of the top k
# lies, then a sort of the few above it): a round's cost grows with k. Env MINECART_TOPK: "auto",
# "rounds" or "select" (tests and tools/bench_topk.py set TOPK_VARIANT). H200, 248,320 logits, us a call
# in a CUDA graph (tools/bench_topk.py, docs/BENCHMARKS.md v29), rounds / select: one row k 1 6.6 / 11.3,
# k 4 10.8 / 12.0, k 8 17.5 / 12.5, k 20 39.7 / 14.0, k 40 85.1 / 14.4; eight rows k 8 21.4 / 22.1.
TOPK_VARIANT = os.environ.get("MINECART_TOPK", "auto")
TOPK_ROUNDS_MAX = 4
TOPK_GROUPS_MAX = 8192  # sampling.cu: group maxima one block holds
TOPK_CAND = 4096  # sampling.cu: candidates a row sorts (more: rounds over the row)


def _topk_selects(k: int) -> bool:
    """Whether top_k runs the four passes (topk_group_max ... topk_select) for this k."""
    v = TOPK_VARIANT
    if v not in ("auto", "rounds", "select"):
        raise ValueError(f"MINECART_TOPK={v!r}: use auto, rounds or select")
    return v == "select" or (v == "auto" and k > TOPK_ROUNDS_MAX)


def top_k(logits: cp.ndarray, k: int):
    """Largest k of each row -> (values (T, k) fp32, ids (T, k) int32) on the device, descending,
    equal values in ascending id order."""
    logits = cp.ascontiguousarray(logits, dtype=cp.float32)
    if logits.ndim == 1:
        logits = logits[None, :]
    T, V = logits.shape
    k = max(1, min(int(k), V))
    out_v = cp.empty((T, k), dtype=cp.float32)
    out_i = cp.empty((T, k), dtype=cp.int32)
    if k <= TOPK_MAX and _topk_selects(k):
        G = 32 * math.ceil(V / (32 * TOPK_GROUPS_MAX))  # logits a group (a multiple of a warp)
        n_groups = math.ceil(V / G)
        gmax = cp.empty((T, n_groups), dtype=cp.uint32)
        thresh = cp.empty(T, dtype=cp.uint32)
        count = cp.empty(T, dtype=cp.int32)
        cand_v = cp.empty((T, TOPK_CAND), dtype=cp.float32)
        cand_i = cp.empty((T, TOPK_CAND), dtype=cp.int32)
        get_kernel("sampling", "topk_group_max")((math.ceil(n_groups / 8), T), (256,),
                                                 (logits, np.int32(V), np.int32(G), np.int32(n_groups), gmax))
        get_kernel("sampling", "topk_threshold")((T,), (1024,), (gmax, np.int32(n_groups), np.int32(k), thresh, count))
        get_kernel("sampling", "topk_gather")((math.ceil(V / 256), T), (256,),
                                              (logits, np.int32(V), thresh, count, cand_v, cand_i))
        get_kernel("sampling", "topk_select")((T,), (256,), (logits, np.int32(V), np.int32(k), count, cand_v, cand_i,
                                                             out_v, out_i))
        return out_v, out_i
    if k > TOPK_MAX or math.ceil(V / TOPK_SLICE) * k > 8192:
        idx = cp.argsort(-logits, axis=1)[:, :k].astype(cp.int32)
        return cp.take_along_axis(logits, idx, axis=1), idx
    n_slices = math.ceil(V / TOPK_SLICE)
    n_cand = n_slices * k
    cand_v = cp.empty((T, n_cand), dtype=cp.float32)
    cand_i = cp.empty((T, n_cand), dtype=cp.int32)
    get_kernel("sampling", "topk_stage1")((n_slices, T), (256,), (logits, np.int32(V), np.int32(k), cand_v, cand_i))
    get_kernel("sampling", "topk_stage2")((T,), (256,), (cand_v, cand_i, np.int32(n_cand), np.int32(k), out_v, out_i),
                                          shared_mem=4 * n_cand)
    return out_v, out_i


def penalize(logits: cp.ndarray, token: cp.ndarray, table: cp.ndarray, prm: cp.ndarray) -> None:
    """A sampler's penalties on one row of logits (V,) float32 in place, from `table` (V,) int32
    (engine/sampling.py PenaltyHistory), which first counts `token` ((1,) int32 on the device: the
    token the step embeds) as generated once more; prm: float64 (repetition, presence, frequency).
    engine/sampling.py apply_penalties is the host's form."""
    V = logits.shape[-1]
    if logits.dtype != cp.float32 or logits.size != V or not logits.flags.c_contiguous:
        raise ValueError(f"penalize: one contiguous float32 row, got {logits.dtype} {logits.shape}")
    if table.dtype != cp.int32 or table.shape != (V,) or token.dtype != cp.int32 or token.size < 1:
        raise ValueError(f"penalize: an int32 table of {V} and an int32 token, got {table.dtype} {table.shape} / "
                         f"{token.dtype} {token.shape}")
    if prm.dtype != cp.float64 or prm.size != 3 or not prm.flags.c_contiguous:
        raise ValueError(f"penalize: prm must be 3 contiguous float64, got {prm.dtype} {prm.shape}")
    get_kernel("sampling", "penalize")((math.ceil(V / 256),), (256,), (logits, np.int32(V), token, table, prm))


PICK_PRM = 8  # float64 values a row of pick_top's prm (engine/sampling.py PickSpec.as_array)


def pick_top(vals: cp.ndarray, ids: cp.ndarray, prm: cp.ndarray, out: cp.ndarray | None = None) -> cp.ndarray:
    """The token drawn from each row's k largest logits (top_k's output, (T, k), k <= TOPK_MAX) with
    that row's PickSpec in prm (T, PICK_PRM) float64 (PickSpec.as_array: u, temperature, top_p, min_p,
    top_k > 0 for the first top_k of the row only, the penalties unread) -> (T,) int32 ids, written into
    `out` when given (engine/sampling.py draw_from_top is the host's form)."""
    T, k = vals.shape
    if not 0 < k <= TOPK_MAX or ids.shape != (T, k) or ids.dtype != cp.int32 or vals.dtype != cp.float32:
        raise ValueError(f"pick_top: float32 values and int32 ids (T, k <= {TOPK_MAX}), got {vals.dtype} "
                         f"{vals.shape} / {ids.dtype} {ids.shape}")
    if prm.dtype != cp.float64 or prm.size != PICK_PRM * T or not prm.flags.c_contiguous:
        raise ValueError(f"pick_top: prm must be contiguous float64 (T, {PICK_PRM}), got {prm.dtype} {prm.shape}")
    out = cp.empty(T, dtype=cp.int32) if out is None else out
    if out.dtype != cp.int32 or out.size != T or not out.flags.c_contiguous:
        raise ValueError(f"pick_top: out must be contiguous int32 ({T},), got {out.dtype} {out.shape}")
    if T:
        get_kernel("sampling", "pick_top")((T,), (32,), (cp.ascontiguousarray(vals), cp.ascontiguousarray(ids),
                                                         np.int32(k), prm, out))
    return out


def moe_route(logits: cp.ndarray, k: int):
    """Router logits (T, E) -> (ids (T*k,) int32, weights (T*k,) fp32): softmax, top-k, renormalized."""
    logits = cp.ascontiguousarray(logits, dtype=cp.float32)
    T, E = logits.shape
    ids = cp.empty(T * k, dtype=cp.int32)
    wts = cp.empty(T * k, dtype=cp.float32)
    if T:
        get_kernel("sampling", "moe_route")((T,), (256,), (logits, np.int32(E), np.int32(k), ids, wts),
                                            shared_mem=4 * E)
    return ids, wts


def moe_combine(y: cp.ndarray, wts: cp.ndarray, T: int, k: int) -> cp.ndarray:
    H = y.shape[1]
    out = cp.empty((T, H), dtype=cp.float32)
    n = T * H
    if n:
        get_kernel("sampling", "moe_combine")((math.ceil(n / 256),), (256,),
                                              (y, wts, out, np.int32(T), np.int32(k), np.int32(H)))
    return out
