"""CPU integer kernels for the routed experts of one decode token, and their NumPy twins.

What this is: the W4A8-style matrix-vector products a decode step needs when the experts of a MoE
layer live in host RAM. The token's activations are quantized to int8 in blocks of 32 values (a
float32 scale per block, like ggml's Q8_0 activations); each weight block is multiplied with its
activation block in integers straight from the GGUF bytes (integer sums per 32 values, which fit in
int32; never a float32 copy of the weights), and only then do the fp16/fp32 scales enter, in float32.
Weight types: Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, as stored in the 3-D expert tensors
`ffn_{gate,up,down}_exps` / `ffn_gate_up_exps` (E, n_out, n_in).

Every kernel comes twice:
- a numba kernel (`fast=True`), parallel over (expert, output row) pairs with `prange`;
- a NumPy twin (`fast=False`), vectorized integer unpacking written for reading.
Both do the same float32 operations in the same order (per block: scale products, then one add into
the row's accumulator, blocks in file order), so they agree bit for bit;
tests/engine/test_cpu_experts.py checks that, and checks the twins against `gguf.quants`
dequantize-then-fp64 products.

The per-block float32 formulas (dx: activation block scale, isum/bsum: int32 sums over the block):
  Q8_0, Q4_0  acc += (d * dx) * isum                       isum = sum(q * xq), Q4_0's q minus 8
  Q4_K, Q5_K  acc += (d * dx) * (sc * isum) - (dmin * dx) * (m * bsum)    bsum = sum(xq)
  Q6_K        acc += (d * dx) * (sc_lo * isum_lo + sc_hi * isum_hi)      two 16-value halves, q - 32

The token's routing comes with them: `route` (router logits in float64, softmax, top-k,
renormalized, as the NumPy backend's moe_route) as a numba kernel that reads the float32 router
directly, so a decode token's MoE on the CPU calls no BLAS at all, and its NumPy twin.

What this is not: a prefill path (several tokens at once stay on dequantize-then-matmul in the NumPy
backend), a GPU kernel, or a general matmul: the weights are always one of the expert stacks above.
numba is imported with this module; `numba_available` tells whether it is installed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import quants as Q

_numba: Any
try:
    import numba as _numba_module

    _numba = _numba_module
except ImportError:  # the twins still work; the backend then keeps the dequantize path
    _numba = None

HAVE_NUMBA = _numba is not None


def _no_jit(*args: Any, **kwargs: Any) -> Callable[[Callable], Callable]:
    return lambda f: f


njit = _numba.njit if HAVE_NUMBA else _no_jit
prange = _numba.prange if HAVE_NUMBA else range


F32 = np.float32
QBLOCK = 32  # activation values per int8 block
KERNEL_TYPES = frozenset({Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})

# fp16 bit pattern -> float32, for the kernels (numba has no fp16 scalar type); the same conversion
# NumPy's astype does, so the twins' scales are the same numbers
_F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(F32)


def numba_available() -> bool:
    return HAVE_NUMBA


# ------------------------------------------------------------------------------------------------
# data


@dataclass(frozen=True)
class ExpertStack:
    """One 3-D expert tensor as the file stores it: raw (E, n_out, row_bytes) uint8 blocks."""

    raw: np.ndarray
    ggml_type: int
    n_in: int

    def __post_init__(self) -> None:
        if self.ggml_type not in KERNEL_TYPES:
            raise ValueError(f"no CPU integer kernel for {Q.type_name(self.ggml_type)} experts; "
                             f"supported: {', '.join(sorted(Q.type_name(t) for t in KERNEL_TYPES))}")
        if self.raw.ndim != 3 or self.raw.dtype != np.uint8:
            raise ValueError(f"expert blocks must be (E, n_out, row_bytes) uint8, got {self.raw.shape} "
                             f"{self.raw.dtype}")
        if self.raw.shape[2] != Q.bytes_per_row(self.ggml_type, self.n_in):
            raise ValueError(f"{self.raw.shape[2]} bytes per row do not hold {self.n_in} "
                             f"{Q.type_name(self.ggml_type)} values")

    @property
    def n_experts(self) -> int:
        return int(self.raw.shape[0])

    @property
    def n_out(self) -> int:
        return int(self.raw.shape[1])

    def active_bytes(self, k: int) -> int:
        """Bytes read for k experts (one matrix-vector product each)."""
        return k * int(self.raw.shape[1]) * int(self.raw.shape[2])


@dataclass(frozen=True)
class QuantizedRows:
    """Rows of activations in int8 blocks of 32: q (n, K) int8, d (n, K/32) float32 scales and
    s (n, K/32) int32 block sums of q (the K-quants' min terms need them)."""

    q: np.ndarray
    d: np.ndarray
    s: np.ndarray


# ------------------------------------------------------------------------------------------------
# activations: float32 -> int8 blocks of 32 (d = amax / 127, q = rint(x / d), as ggml's Q8_0 but
# with a float32 scale and round-half-even). A block holding inf or NaN gets d = NaN and q = 0, so
# the products it enters come out NaN, as the float reference's would (not garbage from casting NaN).


def _quantize_rows_twin(x: np.ndarray) -> QuantizedRows:
    n, k = x.shape
    blocks = x.reshape(n, k // QBLOCK, QBLOCK)
    amax = np.abs(blocks).max(axis=2)
    finite = np.isfinite(amax)
    d = np.where(finite, amax / F32(127.0), F32(np.nan)).astype(F32)
    use = finite & (d > 0)
    inv = np.where(use, F32(1.0) / np.where(use, d, F32(1.0)), F32(0.0)).astype(F32)
    q = np.rint(np.where(finite[:, :, None], blocks, F32(0.0)) * inv[:, :, None]).astype(np.int8)
    return QuantizedRows(q.reshape(n, k), d, q.astype(np.int32).sum(axis=2, dtype=np.int32))


@njit(cache=True)
def _quantize_rows_nb(x, q, d, s):  # pragma: no cover - compiled
    n, k = x.shape
    for r in range(n):
        for b in range(k // 32):
            amax = np.float32(0.0)
            finite = True
            for l in range(32):
                a = abs(x[r, b * 32 + l])
                if a > amax:
                    amax = a
                if not a < np.inf:  # inf or NaN
                    finite = False
            db = amax / np.float32(127.0) if finite else np.float32(np.nan)
            inv = np.float32(1.0) / db if finite and db > 0 else np.float32(0.0)
            tot = 0
            for l in range(32):
                v = np.int8(np.rint(x[r, b * 32 + l] * inv)) if finite else np.int8(0)
                q[r, b * 32 + l] = v
                tot += v
            d[r, b] = db
            s[r, b] = tot


def quantize_rows(x: np.ndarray, *, fast: bool = True) -> QuantizedRows:
    """float32 rows (n, K), K a multiple of 32 -> int8 blocks (see QuantizedRows)."""
    x = np.ascontiguousarray(x, dtype=F32)
    if x.ndim != 2 or x.shape[1] % QBLOCK:
        raise ValueError(f"activations must be (n, K) with K a multiple of {QBLOCK}, got {x.shape}")
    if not fast:
        return _quantize_rows_twin(x)
    n, k = x.shape
    q = np.empty((n, k), np.int8)
    d = np.empty((n, k // QBLOCK), F32)
    s = np.empty((n, k // QBLOCK), np.int32)
    _quantize_rows_nb(x, q, d, s)
    return QuantizedRows(q, d, s)


# ------------------------------------------------------------------------------------------------
# routing of one decode token: router logits in float64, softmax, top-k by probability (ties to the
# lower index), renormalized. The kernel reads the float32 router as it is and widens each weight in
# the loop, with no matrix product: a BLAS call here converts the whole router to float64 on every
# call and wakes BLAS's thread pool, whose spinning threads then take the cores from the expert
# kernels' threads (docs/moe-cpu.md has the measurement: 7x slower decode with 16 BLAS threads).

ROUTE_MIN_SUM = 6.1e-5  # the renormalization's floor on the chosen probabilities' sum (moe_route's)


@njit(cache=True, fastmath={"reassoc", "contract"})
def _router_logits_nb(router, x, logits):  # pragma: no cover - compiled
    # reassociation lets LLVM vectorize the float64 sum; every row runs the same loop, so equal
    # router rows give equal logits (exact ties stay ties). One thread: 256 x 2048 is ~0.1 ms, and a
    # parallel region here cost 0.1-8 ms a call on the 16-core H200 host (thread wake-ups)
    n_exp, h = router.shape
    for e in range(n_exp):
        acc = 0.0
        for i in range(h):
            acc += np.float64(router[e, i]) * np.float64(x[i])
        logits[e] = acc


@njit(cache=True)
def _softmax_top_k_nb(logits, k, ids, weights):  # pragma: no cover - compiled
    n = logits.shape[0]
    m = logits[0]
    for e in range(1, n):
        if logits[e] > m or logits[e] != logits[e]:  # a NaN wins, as in np.max
            m = logits[e]
    p = np.empty(n, np.float64)
    total = 0.0
    for e in range(n):
        p[e] = np.exp(logits[e] - m)
        total += p[e]
    for e in range(n):
        p[e] /= total
    chosen = np.zeros(n, np.bool_)
    wsum = 0.0
    for j in range(k):  # k passes of a max: k is small (8 of 256); strict > keeps the lower index
        best = -1
        for e in range(n):
            if chosen[e]:
                continue
            if best < 0 or p[e] > p[best] or (p[best] != p[best] and p[e] == p[e]):  # NaN last
                best = e
        chosen[best] = True
        ids[j] = best
        weights[j] = p[best]
        wsum += p[best]
    den = wsum if wsum > ROUTE_MIN_SUM or wsum != wsum else ROUTE_MIN_SUM
    for j in range(k):
        weights[j] /= den


def _route_twin(x: np.ndarray, router: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The NumPy backend's moe_route for one token (a float64 matrix product)."""
    logits = x.astype(np.float64) @ router.astype(np.float64).T  # (E,)
    logits -= logits.max()
    p = np.exp(logits)
    p /= p.sum()
    ids = np.argsort(-p, kind="stable")[:k]
    w = p[ids]
    w /= np.maximum(w.sum(), ROUTE_MIN_SUM)
    return ids.astype(np.int64), w


def route(x: np.ndarray, router: np.ndarray, k: int, *, fast: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(ids (k,) int64, weights (k,) float64) of one token x (H,) float32 for a router (E, H)
    float32: logits in float64, softmax, the k most probable experts (ties to the lower index),
    their probabilities renormalized to sum 1 (the sum floored at ROUTE_MIN_SUM), as the NumPy
    backend's moe_route. fast=False: the NumPy twin, which is moe_route's matrix product. One thread
    (see _router_logits_nb).
    """
    xv = np.ascontiguousarray(x, dtype=F32).reshape(-1)
    r = np.ascontiguousarray(router, dtype=F32)
    if r.ndim != 2 or r.shape[1] != xv.size or r.shape[0] < 1:
        raise ValueError(f"a router (E, {xv.size}) routes a token of {xv.size} values, got "
                         f"router {r.shape}")
    if not 1 <= k <= r.shape[0]:
        raise ValueError(f"cannot choose {k} of {r.shape[0]} experts")
    if not fast:
        return _route_twin(xv, r, k)
    if not HAVE_NUMBA:
        raise RuntimeError("numba is not installed: `pip install numba`, or use fast=False")
    logits = np.empty(r.shape[0], np.float64)
    ids = np.empty(k, np.int64)
    weights = np.empty(k, np.float64)
    _router_logits_nb(r, xv, logits)
    _softmax_top_k_nb(logits, k, ids, weights)
    return ids, weights


# ------------------------------------------------------------------------------------------------
# numba kernels: out[s, r] = row r of expert ids[s] . activation row s. One (s, r) pair per prange
# iteration (Q4_K, Q5_K: two rows); the inner loops are the integer dot products of one block.
# The block length comes in as an argument (`qb`, always QBLOCK): with a literal 32 LLVM unrolls the
# loop completely and, numba running no SLP vectorizer, leaves it scalar; with a run-time count it is
# vectorized (VNNI where the CPU has it), about 3x faster. numba widens the integer sums to 64 bits;
# they fit in 32 (the largest, Q6_K's with its group scales folded in, stays below 2^24).


@njit(inline="always")
def _f16(row, o, table):  # pragma: no cover - compiled
    return table[np.int32(row[o]) | (np.int32(row[o + 1]) << 8)]


@njit(parallel=True, cache=True)
def _q8_0_nb(w, ids, xq, xd, table, out, qb):  # pragma: no cover - compiled
    k, n_out, nb = ids.shape[0], w.shape[1], w.shape[2] // 34
    for job in prange(k * n_out):
        s = job // n_out
        r = job - s * n_out
        row = w[ids[s], r]
        acc = np.float32(0.0)
        for b in range(nb):
            o = b * 34
            isum = np.int32(0)
            for l in range(qb):
                isum += np.int32(np.int8(row[o + 2 + l])) * np.int32(xq[s, b * 32 + l])
            acc += (_f16(row, o, table) * xd[s, b]) * np.float32(isum)
        out[s, r] = acc


@njit(parallel=True, cache=True)
def _q4_0_nb(w, ids, xq, xd, table, out, qb):  # pragma: no cover - compiled
    k, n_out, nb = ids.shape[0], w.shape[1], w.shape[2] // 18
    for job in prange(k * n_out):
        s = job // n_out
        r = job - s * n_out
        row = w[ids[s], r]
        acc = np.float32(0.0)
        for b in range(nb):
            o = b * 18
            isum = np.int32(0)
            for l in range(qb // 2):
                byte = np.int32(row[o + 2 + l])
                isum += ((byte & 15) - 8) * np.int32(xq[s, b * 32 + l])
                isum += ((byte >> 4) - 8) * np.int32(xq[s, b * 32 + 16 + l])
            acc += (_f16(row, o, table) * xd[s, b]) * np.float32(isum)
        out[s, r] = acc


@njit(inline="always")
def _k_scale_min(row, o, j):  # pragma: no cover - compiled
    """6-bit scale and min of sub-block j from the 12 bytes at row[o:o+12] (quants.k_scales_mins)."""
    if j < 4:
        return np.int32(row[o + j]) & 63, np.int32(row[o + j + 4]) & 63
    c = np.int32(row[o + j + 4])
    sc = (c & 15) | ((np.int32(row[o + j - 4]) >> 6) << 4)
    m = (c >> 4) | ((np.int32(row[o + j]) >> 6) << 4)
    return sc, m


@njit(inline="always")
def _k_affine_term(row, o, j, isum, d, dmin, dx, xsum):  # pragma: no cover - compiled
    """Sub-block j's float32 term of a Q4_K / Q5_K block at row[o:]: d*sc*isum - dmin*m*xsum."""
    sc, m = _k_scale_min(row, o + 4, j)
    return (d * dx) * np.float32(sc * isum) - (dmin * dx) * np.float32(m * xsum)


@njit(parallel=True, cache=True)
def _q4_k_nb(w, ids, xq, xd, xs, table, out, qb):  # pragma: no cover - compiled
    # two rows per iteration share the activation loads (+20% measured); with an odd row count the
    # last pair is the last row twice. Each row's sums and additions are those of the one-row form.
    k, n_out, nsb = ids.shape[0], w.shape[1], w.shape[2] // 144
    pairs = (n_out + 1) // 2
    for job in prange(k * pairs):
        s = job // pairs
        r = 2 * (job - s * pairs)
        r1 = min(r + 1, n_out - 1)
        ra = w[ids[s], r]
        rb = w[ids[s], r1]
        x = xq[s]
        acc_a = np.float32(0.0)
        acc_b = np.float32(0.0)
        for b in range(nsb):
            o = b * 144
            d_a, dmin_a = _f16(ra, o, table), _f16(ra, o + 2, table)
            d_b, dmin_b = _f16(rb, o, table), _f16(rb, o + 2, table)
            for g in range(4):  # 32 bytes: sub-block 2g in the low nibbles, 2g+1 in the high ones
                qo = o + 16 + 32 * g
                xo = (b * 8 + 2 * g) * qb
                lo_a = hi_a = lo_b = hi_b = 0
                for l in range(qb):
                    x_lo = x[xo + l]
                    x_hi = x[xo + qb + l]
                    va = ra[qo + l]
                    vb = rb[qo + l]
                    lo_a += (va & 15) * x_lo
                    hi_a += (va >> 4) * x_hi
                    lo_b += (vb & 15) * x_lo
                    hi_b += (vb >> 4) * x_hi
                xb = b * 8 + 2 * g
                dx0, dx1, xs0, xs1 = xd[s, xb], xd[s, xb + 1], xs[s, xb], xs[s, xb + 1]
                acc_a += _k_affine_term(ra, o, 2 * g, np.int32(lo_a), d_a, dmin_a, dx0, xs0)
                acc_a += _k_affine_term(ra, o, 2 * g + 1, np.int32(hi_a), d_a, dmin_a, dx1, xs1)
                acc_b += _k_affine_term(rb, o, 2 * g, np.int32(lo_b), d_b, dmin_b, dx0, xs0)
                acc_b += _k_affine_term(rb, o, 2 * g + 1, np.int32(hi_b), d_b, dmin_b, dx1, xs1)
        out[s, r] = acc_a
        out[s, r1] = acc_b


@njit(parallel=True, cache=True)
def _q5_k_nb(w, ids, xq, xd, xs, table, out, qb):  # pragma: no cover - compiled
    # as Q4_K, two rows per iteration; the 5th bit of value l of sub-block j is bit j of qh[l]
    k, n_out, nsb = ids.shape[0], w.shape[1], w.shape[2] // 176
    pairs = (n_out + 1) // 2
    for job in prange(k * pairs):
        s = job // pairs
        r = 2 * (job - s * pairs)
        r1 = min(r + 1, n_out - 1)
        ra = w[ids[s], r]
        rb = w[ids[s], r1]
        x = xq[s]
        acc_a = np.float32(0.0)
        acc_b = np.float32(0.0)
        for b in range(nsb):
            o = b * 176
            d_a, dmin_a = _f16(ra, o, table), _f16(ra, o + 2, table)
            d_b, dmin_b = _f16(rb, o, table), _f16(rb, o + 2, table)
            for g in range(4):
                qo = o + 48 + 32 * g
                xo = (b * 8 + 2 * g) * qb
                qa, ha = ra[qo : qo + qb], ra[o + 16 : o + 16 + qb]  # slices: see _q6_k_nb
                qb2, hb = rb[qo : qo + qb], rb[o + 16 : o + 16 + qb]
                xl, xh = x[xo : xo + qb], x[xo + qb : xo + 2 * qb]
                shift = 2 * g
                lo_a = hi_a = lo_b = hi_b = 0
                for l in range(qb):
                    va, vb = qa[l], qb2[l]
                    hha, hhb = ha[l] >> shift, hb[l] >> shift
                    lo_a += ((va & 15) | ((hha & 1) << 4)) * xl[l]
                    hi_a += ((va >> 4) | ((hha & 2) << 3)) * xh[l]
                    lo_b += ((vb & 15) | ((hhb & 1) << 4)) * xl[l]
                    hi_b += ((vb >> 4) | ((hhb & 2) << 3)) * xh[l]
                xb = b * 8 + 2 * g
                dx0, dx1, xs0, xs1 = xd[s, xb], xd[s, xb + 1], xs[s, xb], xs[s, xb + 1]
                acc_a += _k_affine_term(ra, o, 2 * g, np.int32(lo_a), d_a, dmin_a, dx0, xs0)
                acc_a += _k_affine_term(ra, o, 2 * g + 1, np.int32(hi_a), d_a, dmin_a, dx1, xs1)
                acc_b += _k_affine_term(rb, o, 2 * g, np.int32(lo_b), d_b, dmin_b, dx0, xs0)
                acc_b += _k_affine_term(rb, o, 2 * g + 1, np.int32(hi_b), d_b, dmin_b, dx1, xs1)
        out[s, r] = acc_a
        out[s, r1] = acc_b


@njit(parallel=True, cache=True)
def _q6_k_nb(w, ids, xq, xd, table, out, qb):  # pragma: no cover - compiled
    k, n_out, nsb = ids.shape[0], w.shape[1], w.shape[2] // 210
    half = qb // 2
    for job in prange(k * n_out):
        s = job // n_out
        r = job - s * n_out
        row = w[ids[s], r]
        x = xq[s]
        acc = np.float32(0.0)
        for b in range(nsb):
            o = b * 210
            d = _f16(row, o + 208, table)
            for h in range(2):  # a 128-value half: sub-blocks 4h .. 4h+3 of 32 values
                la = o + 64 * h  # low nibbles: sub-block 4h (and 4h+2 in the high nibbles)
                lb = la + 32  # sub-block 4h+1 (and 4h+3)
                qh = o + 128 + 32 * h  # 2-bit tops of all four, at bits 0, 2, 4, 6
                sb = o + 192 + 8 * h  # int8 scales of the eight 16-value groups
                c0l, c0h = np.int32(np.int8(row[sb])), np.int32(np.int8(row[sb + 1]))
                c1l, c1h = np.int32(np.int8(row[sb + 2])), np.int32(np.int8(row[sb + 3]))
                c2l, c2h = np.int32(np.int8(row[sb + 4])), np.int32(np.int8(row[sb + 5]))
                c3l, c3h = np.int32(np.int8(row[sb + 6])), np.int32(np.int8(row[sb + 7]))
                xo = (b * 8 + 4 * h) * qb
                # one 32-long loop (a 16-long one does not vectorize); each value's group scale is
                # folded into the integer sum, which equals sc_lo * isum_lo + sc_hi * isum_hi
                # slices, so that the loop's indices are known non-negative (no wraparound check
                # per load, which kept the loads from being contiguous vectors: 2x slower)
                qa, qb_, qt = row[la : la + qb], row[lb : lb + qb], row[qh : qh + qb]
                x0, x1 = x[xo : xo + qb], x[xo + qb : xo + 2 * qb]
                x2, x3 = x[xo + 2 * qb : xo + 3 * qb], x[xo + 3 * qb : xo + 4 * qb]
                s0 = s1 = s2 = s3 = 0
                for l in range(qb):
                    first = l < half
                    a, bb, c = qa[l], qb_[l], qt[l]
                    s0 += (((a & 15) | ((c & 3) << 4)) - 32) * (c0l if first else c0h) * x0[l]
                    s1 += (((bb & 15) | ((c & 12) << 2)) - 32) * (c1l if first else c1h) * x1[l]
                    s2 += (((a >> 4) | (c & 48)) - 32) * (c2l if first else c2h) * x2[l]
                    s3 += (((bb >> 4) | ((c & 192) >> 2)) - 32) * (c3l if first else c3h) * x3[l]
                xb = b * 8 + 4 * h
                acc += (d * xd[s, xb]) * np.float32(np.int32(s0))
                acc += (d * xd[s, xb + 1]) * np.float32(np.int32(s1))
                acc += (d * xd[s, xb + 2]) * np.float32(np.int32(s2))
                acc += (d * xd[s, xb + 3]) * np.float32(np.int32(s3))
        out[s, r] = acc


# ------------------------------------------------------------------------------------------------
# NumPy twins: unpack the blocks of the chosen experts into integers, form each block's float32 term
# with the kernels' formula, and add the terms into the accumulator one block after another.


def _f16_field(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of every block (..., block_bytes) -> float32 (...)."""
    return np.ascontiguousarray(blocks[..., at : at + 2]).view("<f2")[..., 0].astype(F32)


def _accumulate(terms: np.ndarray) -> np.ndarray:
    """(k, n_out, n_blocks) float32 terms -> (k, n_out): summed in block order, in float32."""
    acc = np.zeros(terms.shape[:2], F32)
    for b in range(terms.shape[2]):
        acc += terms[:, :, b]
    return acc


def _terms_q8_0(rows, x: QuantizedRows):
    k, n_out, _ = rows.shape
    blocks = rows.reshape(k, n_out, -1, 34)
    q = blocks[..., 2:].view(np.int8).astype(np.int32)  # (k, n_out, nb, 32)
    xq = x.q.reshape(k, 1, -1, 32).astype(np.int32)
    isum = (q * xq).sum(axis=3, dtype=np.int32)
    return (_f16_field(blocks, 0) * x.d[:, None, :]) * isum.astype(F32)


def _terms_q4_0(rows, x: QuantizedRows):
    k, n_out, _ = rows.shape
    blocks = rows.reshape(k, n_out, -1, 18)
    qs = blocks[..., 2:18].astype(np.int32)
    q = np.concatenate([qs & 15, qs >> 4], axis=3) - 8  # value l < 16: low nibble of byte l
    xq = x.q.reshape(k, 1, -1, 32).astype(np.int32)
    isum = (q * xq).sum(axis=3, dtype=np.int32)
    return (_f16_field(blocks, 0) * x.d[:, None, :]) * isum.astype(F32)


def _terms_k_affine(blocks, q, x: QuantizedRows):
    """Q4_K / Q5_K: q (k, n_out, nsb, 8, 32) in 0..31; x = d*sc*q - dmin*m per sub-block of 32."""
    k, n_out, nsb = blocks.shape[:3]
    sc, m = Q.k_scales_mins(blocks[..., 4:16].reshape(-1, 12))
    sc = sc.astype(np.int32).reshape(k, n_out, nsb * 8)
    m = m.astype(np.int32).reshape(k, n_out, nsb * 8)
    xq = x.q.reshape(k, 1, nsb * 8, 32).astype(np.int32)
    isum = (q.reshape(k, n_out, nsb * 8, 32) * xq).sum(axis=3, dtype=np.int32)
    d = np.repeat(_f16_field(blocks, 0), 8, axis=2)  # (k, n_out, nsb * 8)
    dmin = np.repeat(_f16_field(blocks, 2), 8, axis=2)
    dx = x.d[:, None, :]
    return (d * dx) * (sc * isum).astype(F32) - (dmin * dx) * (m * x.s[:, None, :]).astype(F32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 128) bytes -> (..., 8, 32): byte l of 32-byte group g holds value l of sub-block 2g in
    its low nibble and of sub-block 2g+1 in its high nibble."""
    g = qs.reshape(*qs.shape[:-1], 4, 1, 32).astype(np.int32)
    return np.concatenate([g & 15, g >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _terms_q4_k(rows, x: QuantizedRows):
    k, n_out, _ = rows.shape
    blocks = rows.reshape(k, n_out, -1, 144)
    return _terms_k_affine(blocks, _k_low_nibbles(blocks[..., 16:144]), x)


def _terms_q5_k(rows, x: QuantizedRows):
    k, n_out, _ = rows.shape
    blocks = rows.reshape(k, n_out, -1, 176)
    qh = blocks[..., 16:48].astype(np.int32)[..., None, :]  # bit j of byte l: value l of sub-block j
    fifth = (qh >> np.arange(8).reshape(8, 1)) & 1  # (..., 8, 32)
    return _terms_k_affine(blocks, _k_low_nibbles(blocks[..., 48:176]) | (fifth << 4), x)


def _terms_q6_k(rows, x: QuantizedRows):
    k, n_out, _ = rows.shape
    blocks = rows.reshape(k, n_out, -1, 210)
    nsb = blocks.shape[2]
    ql = blocks[..., 0:128].astype(np.int32).reshape(k, n_out, nsb, 2, 2, 32)  # (half, byte group)
    qh = blocks[..., 128:192].astype(np.int32).reshape(k, n_out, nsb, 2, 1, 32)
    # per 128-value half: values 0-63 are the low nibbles of ql, 64-127 the high nibbles; value
    # 32*i + l takes bits 2i..2i+1 of qh[l] as its top two bits
    low = np.concatenate([ql & 15, ql >> 4], axis=4)  # (.., half, 4, 32)
    top = (qh >> (2 * np.arange(4)).reshape(4, 1)) & 3
    q = ((low | (top << 4)) - 32).reshape(k, n_out, nsb * 8, 2, 16)
    sc = blocks[..., 192:208].view(np.int8).astype(np.int32).reshape(k, n_out, nsb * 8, 2)
    xq = x.q.reshape(k, 1, nsb * 8, 2, 16).astype(np.int32)
    isum = ((q * xq).sum(axis=4, dtype=np.int32) * sc).sum(axis=3, dtype=np.int32)
    d = np.repeat(_f16_field(blocks, 208), 8, axis=2)
    return (d * x.d[:, None, :]) * isum.astype(F32)


_TWIN_TERMS = {Q.Q8_0: _terms_q8_0, Q.Q4_0: _terms_q4_0, Q.Q4_K: _terms_q4_k, Q.Q5_K: _terms_q5_k,
               Q.Q6_K: _terms_q6_k}


# ------------------------------------------------------------------------------------------------
# entry points


def expert_matvec(w: ExpertStack, ids: Sequence[int] | np.ndarray, x: QuantizedRows, *,
                  fast: bool = True, threads: int | None = None) -> np.ndarray:
    """(k, n_out) float32: row s is expert ids[s]'s matrix times activation row s of x.

    threads: numba threads for this call (None: numba's default, one per core); restored after.
    """
    idx = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    k = idx.size
    if x.q.shape != (k, w.n_in):
        raise ValueError(f"{k} experts need {k} activation rows of {w.n_in}, got {x.q.shape}")
    if k and (idx.min() < 0 or idx.max() >= w.n_experts):
        raise IndexError(f"expert ids {idx.tolist()} out of range for {w.n_experts} experts")
    if not fast:
        rows = np.asarray(w.raw)[idx]  # only the chosen experts' blocks
        with np.errstate(over="ignore", invalid="ignore"):
            return _accumulate(_TWIN_TERMS[w.ggml_type](rows, x))
    if not HAVE_NUMBA:
        raise RuntimeError("numba is not installed: `pip install numba`, or use fast=False")
    out = np.full((k, w.n_out), np.nan, F32)  # poisoned: a row the kernel skips shows up as NaN
    # one compiled signature whatever the caller holds: contiguous and read-only, as a file's map is
    raw = np.ascontiguousarray(w.raw).view()
    raw.flags.writeable = False
    with _numba_threads(threads):
        t = w.ggml_type
        if t == Q.Q4_K:
            _q4_k_nb(raw, idx, x.q, x.d, x.s, _F16_TABLE, out, QBLOCK)
        elif t == Q.Q5_K:
            _q5_k_nb(raw, idx, x.q, x.d, x.s, _F16_TABLE, out, QBLOCK)
        elif t == Q.Q6_K:
            _q6_k_nb(raw, idx, x.q, x.d, _F16_TABLE, out, QBLOCK)
        elif t == Q.Q8_0:
            _q8_0_nb(raw, idx, x.q, x.d, _F16_TABLE, out, QBLOCK)
        else:
            _q4_0_nb(raw, idx, x.q, x.d, _F16_TABLE, out, QBLOCK)
    return out


@contextmanager
def _numba_threads(threads: int | None) -> Iterator[None]:
    """numba's thread count set to `threads` (clipped to 1..NUMBA_NUM_THREADS) for the block, then
    restored; None leaves it as it is."""
    before = _numba.get_num_threads()
    if threads is not None:
        _numba.set_num_threads(max(1, min(int(threads), _numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        _numba.set_num_threads(before)


def _swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up, in float64 rounded to float32 (the NumPy backend's swiglu)."""
    g = gate.astype(np.float64)
    return (g * (0.5 * (1.0 + np.tanh(0.5 * g))) * up).astype(F32)


def routed_experts(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, gate: ExpertStack,
                   up: ExpertStack | None, down: ExpertStack, *, fast: bool = True,
                   threads: int | None = None) -> np.ndarray:
    """The routed-expert output (H,) float32 of one token x (H,): sum over s of weights[s] *
    down[ids[s]] @ swiglu(gate[ids[s]] @ x, up[ids[s]] @ x), every product on int8 activations.

    up None: `gate` is the fused (E, 2 F_e, H) stack, gate rows first. The routing (ids, weights) is
    the caller's (the backend's softmax top-k); weights are summed in float32, slot by slot.
    """
    idx = np.asarray(ids, dtype=np.int64).reshape(-1)
    k = idx.size
    xa = quantize_rows(np.broadcast_to(np.asarray(x, F32).reshape(1, -1), (k, gate.n_in)), fast=fast)
    gu = expert_matvec(gate, idx, xa, fast=fast, threads=threads)
    if up is None:
        fe = gate.n_out // 2
        g, u = gu[:, :fe], gu[:, fe:]
    else:
        g, u = gu, expert_matvec(up, idx, xa, fast=fast, threads=threads)
    h = quantize_rows(_swiglu(g, u), fast=fast)
    y = expert_matvec(down, idx, h, fast=fast, threads=threads)  # (k, H)
    out = np.zeros(down.n_out, F32)
    wts = np.asarray(weights).reshape(-1).astype(F32)
    for s in range(k):
        out += wts[s] * y[s]
    return out
