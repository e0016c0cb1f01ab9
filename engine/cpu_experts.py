"""CPU integer kernels for the routed experts of one decode token, and their NumPy twins.

What this is: the W4A8-style matrix-vector products a decode step needs when the experts of a MoE
layer live in host RAM. The token's activations are quantized to int8 in blocks of 32 values (a
float32 scale per block, like ggml's Q8_0 activations); each weight block is multiplied with its
activation block in integers straight from the GGUF bytes (integer sums per 32 values, which fit in
int32; never a float32 copy of the weights), and only then do the fp16/fp32 scales enter, in float32.
Weight types: Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, IQ4_NL, Q4_K, Q5_K, Q6_K, IQ4_XS, as stored in the 3-D expert tensors
`ffn_{gate,up,down}_exps` / `ffn_gate_up_exps` (E, n_out, n_in). The same block work multiplies a
dense layer's weight held as stored (a one-matrix stack: `dense_matmul`, the NumPy backend beside a
GPU or when asked) with any number of activation rows: one row straight through the weight, several
through a tile of 4 weight rows x 8 activation rows whose lanes are the activation rows (see "the
tile" below), bit-identical to the one-row kernels.

Every kernel comes twice:
- a numba kernel (`fast=True`), parallel over (expert, output rows) with `prange`, whose per-block
  work is an LLVM IR intrinsic (u8 x s8 multiply-adds: VNNI, AVX2 or plain IR, whichever the CPU
  has; see "block intrinsics" below);
- a NumPy twin (`fast=False`), vectorized integer unpacking written for reading.
Both do the same float32 operations in the same order (per block: scale products, then one add into
the row's accumulator, blocks in file order), so they agree bit for bit;
tests/engine/test_cpu_experts.py checks that, and checks the twins against `gguf.quants`
dequantize-then-fp64 products.

The per-block float32 formulas (dx: activation block scale, isum/bsum: int32 sums over the block):
  Q8_0, Q4_0, Q5_0  acc += (d * dx) * isum      isum = sum(q * xq), Q4_0's q minus 8, Q5_0's minus 16
  IQ4_NL            acc += (d * dx) * isum      q: the code's level (quants.KVALUES)
  Q4_1, Q5_1  acc += (d * dx) * isum + (m * dx) * bsum                   bsum = sum(xq)
  Q4_K, Q5_K  acc += (d * dx) * (sc * isum) - (dmin * dx) * (m * bsum)
  Q6_K        acc += (d * dx) * (sc_lo * isum_lo + sc_hi * isum_hi)      two 16-value halves, q - 32
  IQ4_XS      acc += (d * dx) * ((ls - 32) * isum)                       per 32-value sub-block

A token's whole expert block, `routed_experts` (ids and weights given: by `route`, or by a GPU's
routing), is one compiled call after a few integer checks: x quantized once (one activation row
shared by the k slots), gate and up in one parallel region, SwiGLU and the quantization of h in one
vectorized loop (its exp from IEEE operations, so that the twin matches it to the bit), then the
down products and their weighted sum in a second region (each output row: its slots' products times
their weights, added in slot order). docs/moe-cpu.md has what each step costs.

The token's routing comes with them: `route` (router logits in float64, softmax, top-k,
renormalized, as the NumPy backend's moe_route) as a numba kernel that reads the float32 router
directly, so a decode token's MoE on the CPU calls no BLAS at all, and its NumPy twin.

What this is not: a GPU kernel, or a general matmul: the weights are always stacks of the types
above, and a MoE prefill chunk's experts still go through the NumPy backend's decoded path.
numba is imported with this module; `numba_available` tells whether it is installed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import quants as Q


def _no_intrinsic(f: Callable) -> Callable:
    return f  # without numba the intrinsics are plain functions that nothing calls


_numba: Any
_ir: Any
_llvm: Any
_cgutils: Any
_nb_config: Any
_intrinsic: Any
try:
    import llvmlite.binding as _llvm_module
    import numba as _numba_module
    from llvmlite import ir as _ir_module
    from numba.core import cgutils as _cgutils_module
    from numba.core import config as _config_module
    from numba.extending import intrinsic as _intrinsic_fn

    _numba, _ir, _llvm, _cgutils, _nb_config, _intrinsic = (
        _numba_module, _ir_module, _llvm_module, _cgutils_module, _config_module, _intrinsic_fn)
except ImportError:  # the twins still work; the backend then keeps the dequantize path
    _numba = _ir = _llvm = _cgutils = _nb_config = None
    _intrinsic = _no_intrinsic

HAVE_NUMBA = _numba is not None


def _no_jit(*args: Any, **kwargs: Any) -> Callable[[Callable], Callable]:
    return lambda f: f


njit = _numba.njit if HAVE_NUMBA else _no_jit
prange = _numba.prange if HAVE_NUMBA else range


F32 = np.float32
QBLOCK = 32  # activation values per int8 block
KERNEL_TYPES = frozenset({Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_1, Q.Q5_1, Q.IQ4_NL, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS})

# fp16 bit pattern -> float32, for the kernels (numba has no fp16 scalar type); the same conversion
# NumPy's astype does, so the twins' scales are the same numbers
_F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(F32)


def numba_available() -> bool:
    return HAVE_NUMBA


# ------------------------------------------------------------------------------------------------
# data


@dataclass(frozen=True)
class ExpertStack:
    """One 3-D expert tensor as the file stores it: raw (E, n_out, row_bytes) uint8 blocks.

    Checked once, here; `raw` is then kept as a read-only C-contiguous view (a copy only if the
    given array was not contiguous), the one array type the kernels are compiled for, so a call
    neither checks nor converts it again. n_experts and n_out are plain ints, read per call."""

    raw: np.ndarray
    ggml_type: int
    n_in: int
    n_experts: int = field(init=False)
    n_out: int = field(init=False)

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
        raw = np.ascontiguousarray(self.raw).view()  # read-only, as a file's map is: one signature
        raw.flags.writeable = False
        object.__setattr__(self, "raw", raw)
        object.__setattr__(self, "n_experts", int(raw.shape[0]))
        object.__setattr__(self, "n_out", int(raw.shape[1]))

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


# the smallest normal float32: a block scale below it (|x| < 1.5e-36 throughout the block) has a reciprocal
# beyond float32's range, so the block quantizes to zeros (its values are zeros at this precision anyway)
_MIN_NORMAL = np.float32(np.finfo(np.float32).tiny)


def _quantize_rows_twin(x: np.ndarray) -> QuantizedRows:
    n, k = x.shape
    blocks = x.reshape(n, k // QBLOCK, QBLOCK)
    amax = np.abs(blocks).max(axis=2)
    finite = np.isfinite(amax)
    d = np.where(finite, amax / F32(127.0), F32(np.nan)).astype(F32)
    use = finite & (d >= _MIN_NORMAL)  # a smaller scale's reciprocal overflows: such a block is zeros
    inv = np.where(use, F32(1.0) / np.where(use, d, F32(1.0)), F32(0.0)).astype(F32)
    q = np.rint(np.where(finite[:, :, None], blocks, F32(0.0)) * inv[:, :, None]).astype(np.int8)
    return QuantizedRows(q.reshape(n, k), d, q.astype(np.int32).sum(axis=2, dtype=np.int32))


@njit(cache=True, error_model="numpy")  # its one division is by a normal float: no check needed
def _quantize_rows_nb(x, q, d, s):  # pragma: no cover - compiled
    n, k = x.shape
    one = np.empty(1, np.int32)  # a block's largest |x|, from its bits
    as_float = one.view(np.float32)
    for r in range(n):
        xr, qr, bits = x[r], q[r], x[r].view(np.int32)
        for b in range(k // 32):
            o = 32 * b
            top = 0
            for l in range(32):  # |x| by its bits: for values >= 0 the integer order is the float
                top = max(top, bits[o + l] & 0x7FFFFFFF)  # order, inf and NaN above all (vectorizes)
            finite = top < 0x7F800000
            one[0] = top
            amax = as_float[0]
            db = amax / np.float32(127.0) if finite else np.float32(np.nan)
            tot = 0
            if finite:
                inv = np.float32(1.0) / db if db >= _MIN_NORMAL else np.float32(0.0)
                for l in range(32):
                    v = np.int8(np.rint(xr[o + l] * inv))
                    qr[o + l] = v
                    tot += v
            else:
                for l in range(32):
                    qr[o + l] = 0
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
# block intrinsics: the work of one weight row on one super-block (K-quants, IQ4_XS) or on 8 or 1
# blocks (the 32-value types), written as LLVM IR through numba's @intrinsic. Why not plain numba
# loops: numba does integer arithmetic in 64 bits, so a loop's byte products went 8 to a vector
# (vpmuldq), and every 32-value sum ended in its own horizontal reduction, with the scalar float32
# work per sub-block on top (6-11 G multiply-adds/s on one Zen 5 core; these reach 22-35,
# docs/moe-cpu.md). Here:
# - the 32 byte products of a sub-block are summed in groups of 4 into 8 int32 lanes by one u8 x s8
#   multiply-add: VNNI's vpdpbusd, or AVX2's vpmaddubsw + vpmaddwd, or plain IR where neither exists
#   (`_DOT4`, from the features numba compiles for). The weights are the unsigned operand
#   (`_tile_values`, shared with the tile below): nibbles, 5- and 6-bit values as they are, their
#   offsets (Q4_0's 8, Q5_0's 16, Q6_K's 32) taken off as offset * the activations' sum; Q8_0's
#   signed weights and IQ4's levels enter as value + 128 with 128 * the sum taken off (VNNI and plain
#   IR sum in int32, exactly), or, on AVX2, as |value| with the sign moved onto x (`_signed_x`).
#   AVX2 saturates a pair of products at int16: the largest pair there is 128 * 127 * 2 = 32512 (|x|
#   <= 127, as quantize_rows makes it for blocks whose largest value is a normal float32), so it
#   never does (value + 128 would reach 255 * 127 * 2);
# - the 8 sub-block sums of a super-block (or 8 blocks) are reduced together (a transposed tree, 7
#   horizontal adds for all 8, in order);
# - the float32 terms of the 8 sub-blocks are one vector expression (elementwise, so each lane is
#   the scalar formula's float, bit for bit; no fused multiply-add), and are then added into the
#   row's accumulator one at a time, in sub-block order: the twins' float32 operations, in their
#   order.
# Integer sums are exact in any order, so the regrouping changes no bit of the result.

_I8: Any = _ir.IntType(8) if HAVE_NUMBA else None
_I16: Any = _ir.IntType(16) if HAVE_NUMBA else None
_I32: Any = _ir.IntType(32) if HAVE_NUMBA else None
_I64: Any = _ir.IntType(64) if HAVE_NUMBA else None
_FLOAT: Any = _ir.FloatType() if HAVE_NUMBA else None


def _dot4_kind() -> str:
    """'vnni', 'avx2' or 'ir': how the byte products are summed on the CPU numba compiles for (its
    NUMBA_CPU_FEATURES when set, else the host's, as numba itself decides)."""
    feats = _nb_config.CPU_FEATURES
    if feats is None:
        feats = _llvm.get_host_cpu_features().flatten()
    have = set(str(feats).split(","))
    if {"+avx512vnni", "+avx512vl"} <= have:
        return "vnni"
    return "avx2" if "+avx2" in have else "ir"


# read when a kernel is compiled; numba's cache keys compiled code by CPU name and features, so a
# cached kernel never meets a CPU it was not built for. Tests set it to compile the other forms.
_DOT4 = _dot4_kind() if HAVE_NUMBA else "ir"


class _Ir:
    """IR building blocks for one intrinsic call: its builder and its array arguments."""

    def __init__(self, context: Any, builder: Any, sig: Any, args: Sequence[Any], table: int) -> None:
        self.b, self.table = builder, table  # table: the index of the _F16_TABLE argument
        self._ctx, self._tys, self._args = context, sig.args, args

    def elem(self, i: int, index: Any) -> Any:
        """Pointer to element `index` (IR i64, or a Python int) of array argument i."""
        ary = self._ctx.make_array(self._tys[i])(self._ctx, self.b, self._args[i])
        return self.b.gep(ary.data, [_ir.Constant(_I64, index) if isinstance(index, int) else index])

    def at(self, base: Any, off: Any) -> Any:
        """base (a pointer) advanced by `off` elements (IR i64, or a Python int)."""
        if isinstance(off, int):
            return base if off == 0 else self.b.gep(base, [_ir.Constant(_I64, off)])
        return self.b.gep(base, [off])

    def load(self, ptr: Any, ty: Any) -> Any:
        """A `ty` read at ptr, any alignment."""
        return self.b.load(self.b.bitcast(ptr, ty.as_pointer()), align=1, typ=ty)

    def bytes(self, p: Any, off: int, n: int = 32) -> Any:
        """<n x i8> at byte pointer p + off."""
        return self.load(self.at(p, off), _ir.VectorType(_I8, n))

    def f16(self, p: Any, off: int) -> Any:
        """float32 of the fp16 at byte pointer p + off, looked up in _F16_TABLE (as the twins'
        astype converts it)."""
        bits = self.load(self.at(p, off), _I16)
        return self.b.load(self.elem(self.table, self.b.zext(bits, _I64)), typ=_FLOAT)

    def splat(self, v: Any, n: int = 8) -> Any:
        vt = _ir.VectorType(v.type, n)
        one = self.b.insert_element(_ir.Constant(vt, _ir.Undefined), v, _ir.Constant(_I32, 0))
        return self.b.shuffle_vector(one, _ir.Constant(vt, _ir.Undefined), _lanes([0] * n))

    def dot4(self, u: Any, s: Any, acc: Any = None) -> Any:
        """<8 x i32>: acc + the sums of 4 adjacent products u[l] * s[l] of two <32 x i8>, u read as
        unsigned, s as signed (lane i: products 4i .. 4i+3)."""
        b, v8 = self.b, _ir.VectorType(_I32, 8)
        if _DOT4 == "vnni":
            fn = _declare(b, "llvm.x86.avx512.vpdpbusd.256", v8, [v8, v8, v8])
            return b.call(fn, [_ir.Constant(v8, None) if acc is None else acc, b.bitcast(u, v8),
                               b.bitcast(s, v8)])
        if _DOT4 == "avx2":
            v16, v32 = _ir.VectorType(_I16, 16), _ir.VectorType(_I8, 32)
            pairs = b.call(_declare(b, "llvm.x86.avx2.pmadd.ub.sw", v16, [v32, v32]), [u, s])
            quads = b.call(_declare(b, "llvm.x86.avx2.pmadd.wd", v8, [v16, v16]),
                           [pairs, _ir.Constant(v16, [1] * 16)])
            return quads if acc is None else b.add(acc, quads)
        wide = _ir.VectorType(_I32, 32)
        p = b.mul(b.zext(u, wide), b.sext(s, wide))
        for k in range(4):
            part = b.shuffle_vector(p, p, _lanes([4 * i + k for i in range(8)]))
            acc = part if acc is None else b.add(acc, part)
        return acc

    def lane_sums(self, vecs: list[Any]) -> Any:
        """Up to 8 <8 x i32> -> one <8 x i32> whose lane j is the sum of vecs[j]'s lanes (0 past
        the last): pairwise sums of even and odd lanes of two vectors, three rounds."""
        zero = _ir.Constant(_ir.VectorType(_I32, 8), None)
        vecs = vecs + [zero] * (8 - len(vecs))
        even, odd = _lanes(list(range(0, 16, 2))), _lanes(list(range(1, 16, 2)))
        while len(vecs) > 1:
            vecs = [self.b.add(self.b.shuffle_vector(a, c, even), self.b.shuffle_vector(a, c, odd))
                    for a, c in zip(vecs[0::2], vecs[1::2], strict=True)]
        return vecs[0]

    def add_in_order(self, acc: Any, terms: Any, n: int = 8) -> Any:
        """acc + terms[0] + ... + terms[n-1], one float32 addition at a time."""
        for j in range(n):
            acc = self.b.fadd(acc, self.b.extract_element(terms, _ir.Constant(_I32, j)))
        return acc

    def const8(self, v: int, n: int = 32) -> Any:
        return _ir.Constant(_ir.VectorType(_I8, n), [v] * n)


def _prefetch_ir(b: Any, ptr: Any) -> None:
    """Ask for the cache line at byte pointer ptr (a read, kept in every cache level); a hint, never a
    fault, so a pointer past the weights' end is harmless."""
    fn = _declare(b, "llvm.prefetch.p0i8", _ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32])
    b.call(fn, [ptr, _ir.Constant(_I32, 0), _ir.Constant(_I32, 3), _ir.Constant(_I32, 1)])


@_intrinsic
def _prefetch(typingctx, row, at):  # pragma: no cover - compiled
    """_prefetch(row, at): the cache line at byte `at` of the uint8 array row (past its end too)."""
    from numba import types as nbt

    if not (isinstance(row, nbt.Array) and row.ndim == 1 and row.layout == "C" and row.dtype == nbt.uint8):
        raise TypeError(f"prefetch: a C-contiguous 1-D uint8 array, got {row}")

    def codegen(context: Any, builder: Any, sig: Any, args: Sequence[Any]) -> Any:
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        _prefetch_ir(builder, builder.gep(builder.bitcast(ary.data, _I8.as_pointer()), [args[1]]))
        return context.get_dummy_value()

    return nbt.none(row, nbt.intp), codegen


def _lanes(idx: list[int]) -> Any:
    return _ir.Constant(_ir.VectorType(_I32, len(idx)), idx)


def _declare(builder: Any, name: str, ret: Any, args: list[Any]) -> Any:
    return _cgutils.get_or_insert_function(builder.module, _ir.FunctionType(ret, args), name)


def _k_scales_mins_ir(g: _Ir, p: Any) -> tuple[Any, Any]:
    """<8 x i32> scales and mins of the 8 sub-blocks from the 12 bytes at byte pointer p (the
    layout of quants.k_scales_mins; a 16-byte read, which stays inside the super-block)."""
    b, c = g.b, lambda v: g.const8(v, 8)
    raw = g.bytes(p, 0, 16)
    lo = b.shuffle_vector(raw, raw, _lanes(list(range(8))))  # byte j
    hi = b.shuffle_vector(raw, raw, _lanes(list(range(4, 12))))  # byte j + 4
    back = b.shuffle_vector(raw, raw, _lanes([0, 0, 0, 0, 0, 1, 2, 3]))  # byte j - 4 (j >= 4)
    first = _ir.Constant(_ir.VectorType(_ir.IntType(1), 8), [1, 1, 1, 1, 0, 0, 0, 0])
    sc = b.select(first, b.and_(lo, c(63)), b.or_(b.and_(hi, c(15)), b.shl(b.lshr(back, c(6)), c(4))))
    m = b.select(first, b.and_(hi, c(63)), b.or_(b.lshr(hi, c(4)), b.shl(b.lshr(lo, c(6)), c(4))))
    v8 = _ir.VectorType(_I32, 8)
    return b.zext(sc, v8), b.zext(m, v8)


def _k_affine_ir(g: _Ir, row: Any, x: Any, dx: Any, xs: Any, acc: Any, q5: bool) -> Any:
    """acc + the 8 sub-block terms of one Q4_K (Q5_K: q5) super-block at byte pointer row, against
    the activations at x (int8), their scales at dx and block sums at xs:
    (d * dx) * (sc * isum) - (dmin * dx) * (m * xs), sub-block 2g from the low nibbles of the g-th
    32 quant bytes, 2g+1 from the high ones (Q5_K: bit j of qh[l] is value l's 5th bit)."""
    b = g.b
    quants = 48 if q5 else 16
    qh = g.bytes(row, 16) if q5 else None
    sums = []
    for grp in range(4):
        w = g.bytes(row, quants + 32 * grp)
        lo, hi = b.and_(w, g.const8(15)), b.lshr(w, g.const8(4))
        if q5:
            lo = b.or_(lo, b.shl(b.and_(b.lshr(qh, g.const8(2 * grp)), g.const8(1)), g.const8(4)))
            hi = b.or_(hi, b.shl(b.and_(b.lshr(qh, g.const8(2 * grp + 1)), g.const8(1)), g.const8(4)))
        sums.append(g.dot4(lo, g.bytes(x, 64 * grp)))
        sums.append(g.dot4(hi, g.bytes(x, 64 * grp + 32)))
    isum = g.lane_sums(sums)
    sc, m = _k_scales_mins_ir(g, g.at(row, 4))
    v8f = _ir.VectorType(_FLOAT, 8)
    d, dmin = g.splat(g.f16(row, 0)), g.splat(g.f16(row, 2))
    dxv = g.load(dx, v8f)
    xsv = g.load(xs, _ir.VectorType(_I32, 8))
    terms = b.fsub(b.fmul(b.fmul(d, dxv), b.sitofp(b.mul(sc, isum), v8f)),
                   b.fmul(b.fmul(dmin, dxv), b.sitofp(b.mul(m, xsv), v8f)))
    return g.add_in_order(acc, terms)


def _q6_k_ir(g: _Ir, row: Any, x: Any, dx: Any, acc: Any) -> Any:
    """acc + the 8 sub-block terms (d * dx) * s of one Q6_K super-block at byte pointer row.
    Sub-block 4h+i (h: 128-value half, i: 0..3) takes the low nibbles of ql bytes 64h (i = 0) or
    64h+32 (i = 1), their high nibbles for i = 2, 3, bits 2i..2i+1 of qh byte 128+32h+l as its top
    bits, minus 32; s is the sum of those values times x times the int8 scale of its 16-value group
    (bytes 192 + 2(4h+i) and the next)."""
    b = g.b
    v8 = _ir.VectorType(_I32, 8)
    scales = b.sext(g.bytes(row, 192, 16), _ir.VectorType(_I32, 16))
    sums = []
    for h in range(2):
        ql_a, ql_b, qh = g.bytes(row, 64 * h), g.bytes(row, 64 * h + 32), g.bytes(row, 128 + 32 * h)
        lows = [b.and_(ql_a, g.const8(15)), b.and_(ql_b, g.const8(15)), b.lshr(ql_a, g.const8(4)),
                b.lshr(ql_b, g.const8(4))]
        for i in range(4):
            j = 4 * h + i
            top = b.shl(b.and_(b.lshr(qh, g.const8(2 * i)), g.const8(3)), g.const8(4))
            xv = g.bytes(x, 32 * j)
            diff = g.dot4(b.or_(lows[i], top), xv, b.sub(_ir.Constant(v8, None), g.dot4(g.const8(32), xv)))
            group = b.shuffle_vector(scales, scales, _lanes([2 * j] * 4 + [2 * j + 1] * 4))
            sums.append(b.mul(diff, group))
    s = g.lane_sums(sums)
    v8f = _ir.VectorType(_FLOAT, 8)
    d = g.splat(g.f16(row, 208))
    terms = b.fmul(b.fmul(d, g.load(dx, v8f)), b.sitofp(s, v8f))
    return g.add_in_order(acc, terms)


_ROW_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q5_0": 22, "q4_1": 20, "q5_1": 24, "iq4_nl": 18}


def _row_blocks_ir(g: _Ir, row: Any, x: Any, dx: Any, xs: Any, acc: Any, n: int, kind: str) -> Any:
    """acc + the terms of n (8 or 1) consecutive blocks of a 32-value `kind` (q8_0, q4_0, q5_0, q4_1,
    q5_1, iq4_nl) at byte pointer row, or of the 8 sub-blocks of the iq4_xs super-block there: each
    block's values unpacked by _tile_values (the tile's unpacking) and dotted with x, the 8 sums
    reduced together (a transposed tree), then the block terms of _block_terms, one vector over the
    blocks, added into acc one at a time."""
    b = g.b
    v8f = _ir.VectorType(_FLOAT, 8)
    sums = []
    for i in range(n):
        p, j = (row, i) if kind == "iq4_xs" else (g.at(row, _ROW_BLOCK_BYTES[kind] * i), 0)
        xv = g.bytes(x, 32 * i)
        sums.append(g.dot4(_tile_values(g, kind, p, j), _signed_x(g, kind, p, j, xv)))
    isum = g.lane_sums(sums)

    def per_block(v: Any, ty: Any) -> Any:  # n == 8: the 8 values at v; n == 1: the one, in lane 0
        return g.load(v, _ir.VectorType(ty, 8)) if n == 8 else \
            b.insert_element(_ir.Constant(_ir.VectorType(ty, 8), None), b.load(v, typ=ty), _i32(0))

    dxv, xsv = per_block(dx, _FLOAT), per_block(xs, _I32)
    if kind == "iq4_xs":
        d, scale = g.splat(g.f16(row, 0)), _iq4_xs_scales_ir(g, row)
        terms = _block_terms(g, kind, isum, dxv, xsv, d, None, scale)
    else:
        size = _ROW_BLOCK_BYTES[kind]
        d = mins = _ir.Constant(v8f, None)
        for i in range(n):
            d = b.insert_element(d, g.f16(row, size * i), _i32(i))
            if kind in ("q4_1", "q5_1"):
                mins = b.insert_element(mins, g.f16(row, size * i + 2), _i32(i))
        terms = _block_terms(g, kind, isum, dxv, xsv, d, mins, None)
    return g.add_in_order(acc, terms, n)


def _iq4_xs_scales_ir(g: _Ir, p: Any) -> Any:
    """<8 x i32>: the signed sub-block scales ls - 32 of the IQ4_XS super-block at byte pointer p (ls:
    nibble j of the little-endian scales_l word at 4, with bits 2j..2j+1 of scales_h at 2 on top)."""
    b = g.b
    v8 = _ir.VectorType(_I32, 8)
    low = b.and_(b.lshr(g.splat(g.load(g.at(p, 4), _I32)), _ir.Constant(v8, [4 * j for j in range(8)])),
                 _ir.Constant(v8, [15] * 8))
    high = b.and_(b.lshr(g.splat(b.zext(g.load(g.at(p, 2), _I16), _I32)), _ir.Constant(v8, [2 * j for j in range(8)])),
                  _ir.Constant(v8, [3] * 8))
    return b.sub(b.or_(low, b.shl(high, _ir.Constant(v8, [4] * 8))), _ir.Constant(v8, [32] * 8))


def _block_terms(g: _Ir, kind: str, isum: Any, dxv: Any, xsv: Any, d: Any, mins: Any, scale: Any) -> Any:
    """<8 x float> block terms, lane by lane (blocks of one row, or one block of 8 activation rows),
    from the lanes' dot products `isum` of the unsigned operand (_tile_values) with x (_signed_x),
    activation scales dxv and block sums xsv, and the weight's scales d, Q4_1 / Q5_1's mins, IQ4_XS's
    sub-block scales (each <8 x ...>, lane by lane):
      Q8_0, Q4_0, Q5_0, IQ4_NL  (d * dx) * isum
      Q4_1, Q5_1                (d * dx) * isum + (m * dx) * bsum
      IQ4_XS                    (d * dx) * ((ls - 32) * isum)
    where isum has the operand's offset taken off first (_operand_offset * bsum)."""
    b = g.b
    v8, v8f = _ir.VectorType(_I32, 8), _ir.VectorType(_FLOAT, 8)
    offset = _operand_offset(kind)
    if offset:
        isum = b.sub(isum, b.mul(xsv, _ir.Constant(v8, [offset] * 8)))
    if kind == "iq4_xs":
        isum = b.mul(scale, isum)
    term = b.fmul(b.fmul(d, dxv), b.sitofp(isum, v8f))
    if kind in ("q4_1", "q5_1"):
        term = b.fadd(term, b.fmul(b.fmul(mins, dxv), b.sitofp(xsv, v8f)))
    return term


# The intrinsics. Arguments: row (a weight row, uint8), o (byte offset of the block in it), x (the
# activation row, int8), xo (its offset), dx (the activation block scales), [xs (block sums),] bo
# (index of the first activation block), table (_F16_TABLE), acc (the row's float32 accumulator);
# result: acc with the blocks' terms added. Offsets are not checked: the kernels pass in-range ones.


def _offsets_codegen(body: Callable[..., Any], with_sums: bool) -> Callable[..., Any]:
    def codegen(context: Any, builder: Any, sig: Any, args: Sequence[Any]) -> Any:
        g = _Ir(context, builder, sig, args, 7 if with_sums else 6)
        row = builder.bitcast(g.elem(0, args[1]), _I8.as_pointer())
        x = builder.bitcast(g.elem(2, args[3]), _I8.as_pointer())
        bo = args[6] if with_sums else args[5]
        dx = g.elem(4, bo)
        if with_sums:
            return body(g, row, x, dx, g.elem(5, bo), args[8])
        return body(g, row, x, dx, args[7])

    return codegen


def _block_signature(row: Any, x: Any, dx: Any, xs: Any | None, table: Any) -> Any:
    """The intrinsics' signature, after checking that every array is 1-D and C-contiguous (the IR
    reads them through their data pointers, ignoring strides) of the dtype the IR assumes."""
    from numba import types as nbt

    want = [(row, nbt.uint8, "row"), (x, nbt.int8, "x"), (dx, nbt.float32, "dx"),
            (table, nbt.float32, "table")] + ([(xs, nbt.int32, "xs")] if xs is not None else [])
    for ty, dtype, name in want:
        if not (isinstance(ty, nbt.Array) and ty.ndim == 1 and ty.layout == "C" and ty.dtype == dtype):
            raise TypeError(f"block intrinsic: {name} must be a C-contiguous 1-D {dtype} array, got {ty}")
    if xs is None:
        return nbt.float32(row, nbt.intp, x, nbt.intp, dx, nbt.intp, table, nbt.float32)
    return nbt.float32(row, nbt.intp, x, nbt.intp, dx, xs, nbt.intp, table, nbt.float32)


@_intrinsic
def _q4_k_block(typingctx, row, o, x, xo, dx, xs, bo, table, acc):  # pragma: no cover - compiled
    return (_block_signature(row, x, dx, xs, table),
            _offsets_codegen(lambda g, r, xx, d, s, a: _k_affine_ir(g, r, xx, d, s, a, False), True))


@_intrinsic
def _q5_k_block(typingctx, row, o, x, xo, dx, xs, bo, table, acc):  # pragma: no cover - compiled
    return (_block_signature(row, x, dx, xs, table),
            _offsets_codegen(lambda g, r, xx, d, s, a: _k_affine_ir(g, r, xx, d, s, a, True), True))


@_intrinsic
def _q6_k_block(typingctx, row, o, x, xo, dx, bo, table, acc):  # pragma: no cover - compiled
    return _block_signature(row, x, dx, None, table), _offsets_codegen(_q6_k_ir, False)


def _row_blocks_intrinsic(n: int, kind: str) -> Any:
    @_intrinsic
    def blocks(typingctx, row, o, x, xo, dx, xs, bo, table, acc):  # pragma: no cover - compiled
        return (_block_signature(row, x, dx, xs, table),
                _offsets_codegen(lambda g, r, xx, d, s, a: _row_blocks_ir(g, r, xx, d, s, a, n, kind), True))

    return blocks


_q8_0_blocks8, _q8_0_block1 = _row_blocks_intrinsic(8, "q8_0"), _row_blocks_intrinsic(1, "q8_0")
_q4_0_blocks8, _q4_0_block1 = _row_blocks_intrinsic(8, "q4_0"), _row_blocks_intrinsic(1, "q4_0")
_q5_0_blocks8, _q5_0_block1 = _row_blocks_intrinsic(8, "q5_0"), _row_blocks_intrinsic(1, "q5_0")
_q4_1_blocks8, _q4_1_block1 = _row_blocks_intrinsic(8, "q4_1"), _row_blocks_intrinsic(1, "q4_1")
_q5_1_blocks8, _q5_1_block1 = _row_blocks_intrinsic(8, "q5_1"), _row_blocks_intrinsic(1, "q5_1")
_iq4_nl_blocks8, _iq4_nl_block1 = _row_blocks_intrinsic(8, "iq4_nl"), _row_blocks_intrinsic(1, "iq4_nl")
_iq4_xs_block = _row_blocks_intrinsic(8, "iq4_xs")


# ------------------------------------------------------------------------------------------------
# numba kernels. A job is four rows of one expert for Q4_K, Q5_K and Q4_0 (their accumulator chains
# overlap; with a row count not a multiple of 4 the last rows repeat, computing and storing the same
# values again) and one row, read straight through, for Q8_0 and Q6_K: on the 2-core Zen 5 machine
# (one thread, experts from RAM) four rows in step were 10-30% faster for the first three and 1.5-3x
# slower for these two (Q6_K gate rows: 4.5 against 13 GB/s). Each row's blocks go in file order.
# A token takes two regions (prange loops):
# - matvec: out[st, s, r] = row r of expert ids[s] of stack st . activation row s * xstep (xstep 0:
#   one row shared by every slot, a token's x quantized once), for the first n_stacks (1 or 2) of
#   w_a, w_b: a token's gate and up of one type share the region (one start of the threads);
# - down sum: out[r] = the sum over slots s, in slot order, of wts[s] * (row r of expert ids[s] .
#   activation row s), in float32 (product rounded, then added: the twin's weighted sum), so the
#   down products and the weighted sum are one region with no (k, H) temporary.
# The job bodies (_matvec_job, _down_sum_job) take the type t; the compiled functions are made per
# type (or per combination of types: _token_kernel) by small factories whose closures hold t as a
# constant, so LLVM compiles each for its type alone and a model compiles only the types it has
# (one loop over a runtime type made Q4_K's gate+up 25-40% slower here, and compiling every type's
# code for a first token took 28 s on this machine, ~1 s a type now). numba's cache keeps each
# closure's code apart (its key hashes the closure's constants).

_Q4_K, _Q5_K, _Q6_K, _Q8_0, _Q4_0, _Q5_0 = Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q5_0
_Q4_1, _Q5_1, _IQ4_NL, _IQ4_XS = Q.Q4_1, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS


@njit(inline="always")
def _rows_per_job(t):  # pragma: no cover - compiled
    return 1 if t == _Q8_0 or t == _Q6_K else 4


@njit(inline="always")
def _k_affine_block(t, row, o, x, xo, dx, xs, bo, table, acc):  # pragma: no cover - compiled
    """A Q4_K or Q5_K super-block's term (t a constant of the kernel compiled for it: the other branch
    is folded away)."""
    if t == _Q4_K:
        return _q4_k_block(row, o, x, xo, dx, xs, bo, table, acc)
    return _q5_k_block(row, o, x, xo, dx, xs, bo, table, acc)


@njit(inline="always")
def _legacy_bytes(t):  # pragma: no cover - compiled
    """Bytes of a block of the 32-value types taken 8 blocks at a time, then one at a time."""
    if t == _Q4_0 or t == _IQ4_NL:
        return 18
    if t == _Q5_0:
        return 22
    return 20 if t == _Q4_1 else 24


@njit(inline="always")
def _legacy_blocks8(t, row, o, x, xo, dx, xs, bo, table, acc):  # pragma: no cover - compiled
    """8 blocks' terms of a 32-value type other than Q8_0 (t a constant: the other branches are folded
    away)."""
    if t == _Q4_0:
        return _q4_0_blocks8(row, o, x, xo, dx, xs, bo, table, acc)
    if t == _Q5_0:
        return _q5_0_blocks8(row, o, x, xo, dx, xs, bo, table, acc)
    if t == _Q4_1:
        return _q4_1_blocks8(row, o, x, xo, dx, xs, bo, table, acc)
    if t == _Q5_1:
        return _q5_1_blocks8(row, o, x, xo, dx, xs, bo, table, acc)
    return _iq4_nl_blocks8(row, o, x, xo, dx, xs, bo, table, acc)


@njit(inline="always")
def _legacy_block1(t, row, o, x, xo, dx, xs, bo, table, acc):  # pragma: no cover - compiled
    """One block's term (the types of _legacy_blocks8)."""
    if t == _Q4_0:
        return _q4_0_block1(row, o, x, xo, dx, xs, bo, table, acc)
    if t == _Q5_0:
        return _q5_0_block1(row, o, x, xo, dx, xs, bo, table, acc)
    if t == _Q4_1:
        return _q4_1_block1(row, o, x, xo, dx, xs, bo, table, acc)
    if t == _Q5_1:
        return _q5_1_block1(row, o, x, xo, dx, xs, bo, table, acc)
    return _iq4_nl_block1(row, o, x, xo, dx, xs, bo, table, acc)


# The one-row kernels ask for the bytes they will read next: without that a row read straight through
# ran at 12.7 GB/s (Q8_0, one thread, rows from memory) where this CPU reads 33; the hardware's own
# prefetcher does not run far enough ahead of a loop this busy. A row read alone asks ROW_PREFETCH_BYTES
# on (Q8_0 17.6 GB/s; 1x, 3x, 4x and 8x a 680-byte row tried, and 4 and 8 KB: ~3 KB was best for
# rows of 680 and 4352 bytes); four rows in step ask for the next job's four rows at the same offset.
ROW_PREFETCH_BYTES = 3072


@njit(inline="always")
def _ahead(row, at, span):  # pragma: no cover - compiled
    """Prefetch the cache lines of row[at : at + span] (past row's end too: a hint never faults)."""
    for line in range(0, span + 63, 64):
        _prefetch(row, at + line)


@njit(inline="always")
def _ahead_4(w0, w1, w2, w3, at, span):  # pragma: no cover - compiled
    _ahead(w0, at, span)
    _ahead(w1, at, span)
    _ahead(w2, at, span)
    _ahead(w3, at, span)


@njit(inline="always")
def _dot_rows(t, w, e, r0, r1, r2, r3, x, dx, xs, table):  # pragma: no cover - compiled
    """float32 dot products of rows r0..r3 of expert e of the raw blocks w (type t) with the int8
    activation row x, its block scales dx and block sums xs: all four for the four-row types, only
    r0's for Q8_0 and Q6_K (the others 0)."""
    nbytes = w.shape[2]
    a0 = a1 = a2 = a3 = np.float32(0.0)
    if t == _Q4_K or t == _Q5_K:
        w0, w1, w2, w3 = w[e, r0], w[e, r1], w[e, r2], w[e, r3]
        sb = 144 if t == _Q4_K else 176  # super-block bytes
        for b in range(nbytes // sb):
            o, xo, bo = sb * b, 256 * b, 8 * b
            _ahead_4(w0, w1, w2, w3, o + 4 * nbytes, sb)
            a0 = _k_affine_block(t, w0, o, x, xo, dx, xs, bo, table, a0)
            a1 = _k_affine_block(t, w1, o, x, xo, dx, xs, bo, table, a1)
            a2 = _k_affine_block(t, w2, o, x, xo, dx, xs, bo, table, a2)
            a3 = _k_affine_block(t, w3, o, x, xo, dx, xs, bo, table, a3)
    elif t == _IQ4_XS:
        w0, w1, w2, w3 = w[e, r0], w[e, r1], w[e, r2], w[e, r3]
        for b in range(nbytes // 136):
            o, xo, bo = 136 * b, 256 * b, 8 * b
            _ahead_4(w0, w1, w2, w3, o + 4 * nbytes, 136)
            a0 = _iq4_xs_block(w0, o, x, xo, dx, xs, bo, table, a0)
            a1 = _iq4_xs_block(w1, o, x, xo, dx, xs, bo, table, a1)
            a2 = _iq4_xs_block(w2, o, x, xo, dx, xs, bo, table, a2)
            a3 = _iq4_xs_block(w3, o, x, xo, dx, xs, bo, table, a3)
    elif t != _Q8_0 and t != _Q6_K:  # the other 32-value types
        w0, w1, w2, w3 = w[e, r0], w[e, r1], w[e, r2], w[e, r3]
        bs = _legacy_bytes(t)
        nb = nbytes // bs
        n8 = nb // 8
        for c in range(n8):
            o, xo, bo = 8 * bs * c, 256 * c, 8 * c
            _ahead_4(w0, w1, w2, w3, o + 4 * nbytes, 8 * bs)
            a0 = _legacy_blocks8(t, w0, o, x, xo, dx, xs, bo, table, a0)
            a1 = _legacy_blocks8(t, w1, o, x, xo, dx, xs, bo, table, a1)
            a2 = _legacy_blocks8(t, w2, o, x, xo, dx, xs, bo, table, a2)
            a3 = _legacy_blocks8(t, w3, o, x, xo, dx, xs, bo, table, a3)
        for b in range(8 * n8, nb):
            a0 = _legacy_block1(t, w0, bs * b, x, 32 * b, dx, xs, b, table, a0)
            a1 = _legacy_block1(t, w1, bs * b, x, 32 * b, dx, xs, b, table, a1)
            a2 = _legacy_block1(t, w2, bs * b, x, 32 * b, dx, xs, b, table, a2)
            a3 = _legacy_block1(t, w3, bs * b, x, 32 * b, dx, xs, b, table, a3)
    elif t == _Q6_K:
        row = w[e, r0]
        for b in range(nbytes // 210):
            _ahead(row, 210 * b + ROW_PREFETCH_BYTES, 210)
            a0 = _q6_k_block(row, 210 * b, x, 256 * b, dx, 8 * b, table, a0)
    else:  # Q8_0
        row = w[e, r0]
        nb = nbytes // 34
        n8 = nb // 8
        for c in range(n8):
            _ahead(row, 272 * c + ROW_PREFETCH_BYTES, 272)
            a0 = _q8_0_blocks8(row, 272 * c, x, 256 * c, dx, xs, 8 * c, table, a0)
        for b in range(8 * n8, nb):
            a0 = _q8_0_block1(row, 34 * b, x, 32 * b, dx, xs, b, table, a0)
    return a0, a1, a2, a3


@njit(inline="always")
def _matvec_job(t, i, w_a, w_b, per, jobs, ids, xq, xd, xs, xstep, table, out):  # pragma: no cover - compiled
    """Job i of a matvec region: (stack, slot, rows) from i over stacks x slots x row groups."""
    n_out = w_a.shape[1]
    g = _rows_per_job(t)
    st = i // per
    j = i - st * per
    s = j // jobs
    r0 = g * (j - s * jobs)
    r1, r2, r3 = min(r0 + 1, n_out - 1), min(r0 + 2, n_out - 1), min(r0 + 3, n_out - 1)
    xr = s * xstep
    a0, a1, a2, a3 = _dot_rows(t, w_a if st == 0 else w_b, ids[s], r0, r1, r2, r3, xq[xr], xd[xr],
                               xs[xr], table)
    out[st, s, r0] = a0
    if g == 4:
        out[st, s, r1] = a1
        out[st, s, r2] = a2
        out[st, s, r3] = a3


@njit(inline="always")
def _matvec_jobs(t, n_out, k):  # pragma: no cover - compiled
    """(jobs per slot, jobs per stack) of a matvec region."""
    jobs = (n_out + _rows_per_job(t) - 1) // _rows_per_job(t)
    return jobs, k * jobs


def _matvec_kernel(t: int) -> Any:
    """The matvec region for weights of type t: (w_a, w_b, n_stacks, ids, xq, xd, xs, xstep, table,
    out)."""

    @njit(parallel=True, cache=True)
    def matvec(w_a, w_b, n_stacks, ids, xq, xd, xs, xstep, table, out):  # pragma: no cover - compiled
        jobs, per = _matvec_jobs(t, w_a.shape[1], ids.shape[0])
        for i in prange(n_stacks * per):  # stack a's jobs, then stack b's
            _matvec_job(t, i, w_a, w_b, per, jobs, ids, xq, xd, xs, xstep, table, out)

    return matvec


@njit(inline="always")
def _down_sum_job(t, j, rows, w, ids, wts, xq, xd, xs, table, out):  # pragma: no cover - compiled
    """Job j of a down-sum region: output rows rows*j .. rows*(j+1)-1, every slot."""
    g = _rows_per_job(t)
    start = rows * j
    end = min(start + rows, w.shape[1])
    for r in range(start, end):
        out[r] = np.float32(0.0)
    for s in range(ids.shape[0]):  # slot after slot, each expert's rows of the job in one run
        ws = wts[s]
        for r0 in range(start, end, g):
            r1, r2, r3 = min(r0 + 1, end - 1), min(r0 + 2, end - 1), min(r0 + 3, end - 1)
            a0, a1, a2, a3 = _dot_rows(t, w, ids[s], r0, r1, r2, r3, xq[s], xd[s], xs[s], table)
            out[r0] += ws * a0
            if g == 4:  # a repeated last row is computed again but added once
                if r0 + 1 < end:
                    out[r0 + 1] += ws * a1
                if r0 + 2 < end:
                    out[r0 + 2] += ws * a2
                if r0 + 3 < end:
                    out[r0 + 3] += ws * a3


@njit(inline="always")
def _down_jobs(n_out, n_threads):  # pragma: no cover - compiled
    """(rows per job, jobs) of a down-sum region: one job per thread, each a run of rows (a multiple
    of 4). An expert's rows of a job are read in one pass, and the longer that pass, the faster
    (Q4_K down, one thread here: runs of 32 rows took 2x the time of whole experts, 128 rows 1.15x,
    512 rows 0.95x)."""
    n_jobs = max(1, min(n_threads, (n_out + 3) // 4))
    rows = (n_out + 4 * n_jobs - 1) // (4 * n_jobs) * 4
    return rows, (n_out + rows - 1) // rows


def _down_sum_kernel(t: int) -> Any:
    """The down-sum region for weights of type t: (w, ids, wts, xq, xd, xs, table, n_threads, out)."""

    @njit(parallel=True, cache=True)
    def down_sum(w, ids, wts, xq, xd, xs, table, n_threads, out):  # pragma: no cover - compiled
        rows, n = _down_jobs(w.shape[1], n_threads)
        for j in prange(n):
            _down_sum_job(t, j, rows, w, ids, wts, xq, xd, xs, table, out)

    return down_sum


_MATVEC = {t: _matvec_kernel(t) for t in sorted(KERNEL_TYPES)}
_DOWN_SUM = {t: _down_sum_kernel(t) for t in sorted(KERNEL_TYPES)}


def _dense_kernel(t: int) -> Any:
    """The one-row region for a one-matrix stack of type t: (w, xq, xd, xs, table, out); out[0, r] =
    row r of w[0] dotted with the activation row (a decode step of one sequence: the weight read
    once, straight through). Several activation rows take the tile region (_tile_kernel)."""

    @njit(parallel=True, cache=True)
    def dense(w, xq, xd, xs, table, out):  # pragma: no cover - compiled
        g = _rows_per_job(t)
        n_out = w.shape[1]
        for j in prange((n_out + g - 1) // g):
            r0 = g * j
            r1, r2, r3 = min(r0 + 1, n_out - 1), min(r0 + 2, n_out - 1), min(r0 + 3, n_out - 1)
            a0, a1, a2, a3 = _dot_rows(t, w, 0, r0, r1, r2, r3, xq[0], xd[0], xs[0], table)
            out[0, r0] = a0
            if g == 4:  # a repeated last row gets the same value again
                out[0, r1] = a1
                out[0, r2] = a2
                out[0, r3] = a3

    return dense


# ------------------------------------------------------------------------------------------------
# the tile: 4 weight rows x 8 activation rows (a batched decode step's sequences, a short prefill
# chunk's tokens), for T >= 2 activation rows. The one-row kernels put a block's 32 products in 8
# int32 lanes and must then sum the lanes (a transposed tree per 8 blocks) before the float32 work,
# and with the Q8_0 sign trick that is ~125 instructions per 256 multiply-adds. Here a lane is an
# activation row instead:
# - the activations are packed once per call (`_pack_lanes`): for each group of 8 rows and each 4
#   values k..k+3, one 32-byte vector holding those 4 bytes of each of the 8 rows;
# - a weight row's 4 values k..k+3 are one 32-bit word, broadcast to the 8 lanes; one u8 x s8
#   multiply-add (`_Ir.dot4`) of it with the packed vector adds those 4 products to each row's lane.
#   8 such per block leave each lane with its row's whole block sum: no horizontal sums at all;
# - a packed vector is loaded once for the tile's 4 weight rows;
# - the float32 terms are then vectors over the 8 rows, each lane the scalar formula's operations in
#   the twin's order (one add per block into the row's accumulator, blocks in order): so the tile
#   gives the one-row kernels' and the twins' float32 bits exactly.
# The weights are the unsigned operand, as in the one-row intrinsics: nibbles and 6-bit values as
# they are, their offsets subtracted as offset * (the activation block's sum, packed per lane); Q8_0
# enters as w + 128 (its bits xor 0x80) with 128 * the block sum subtracted (VNNI and plain IR sum
# exactly in int32; AVX2's vpmaddubsw would saturate 255 * 127 * 2 at int16, so there Q8_0 keeps the
# sign trick: |w| with w's sign moved onto x, the largest pair 128 * 127 * 2 = 32512).
# The loop over blocks is in the IR (its accumulators registers after numba's SROA); the numba kernel
# loops over tiles, a thread taking runs of 4-row jobs, each job's rows with every group in turn (so
# the rows are read from memory once).

TILE_LANES = 8  # activation rows a tile takes (one lane each); it takes 4 weight rows
TILE_CHUNKS_PER_THREAD = 8  # runs of jobs a thread's share is cut into (a late thread's share is taken up)


@dataclass(frozen=True)
class PackedLanes:
    """T int8 activation rows in groups of TILE_LANES lanes (padded with zero rows; a zero row has
    scale 0, so its terms are 0 and it is never stored):
    x (groups, K/4, lanes, 4) int8 flat: the bytes 4i..4i+3 of each lane's row, lane after lane;
    d, s (groups, K/32, lanes) float32 / int32 flat: block scales and block sums per lane;
    h (groups, K/32, 2, lanes) int32 flat: sums of each block's two 16-value halves (Q6_K's offset),
    or one zero where the type has no use for them."""

    rows: int
    blocks: int
    x: np.ndarray
    d: np.ndarray
    s: np.ndarray
    h: np.ndarray


def _pack_lanes(x: QuantizedRows, halves: bool) -> PackedLanes:
    t, k = x.q.shape
    nb = k // QBLOCK
    groups = -(-t // TILE_LANES)
    xp = np.zeros(groups * k * TILE_LANES, np.int8)
    dp = np.zeros(groups * nb * TILE_LANES, F32)
    sp = np.zeros(groups * nb * TILE_LANES, np.int32)
    hp = np.zeros(groups * nb * 2 * TILE_LANES if halves else 1, np.int32)
    q, d, s = _kernel_rows(x)
    _pack_lanes_nb(q.view(np.int32), d, s, q, halves, xp.view(np.int32), dp, sp, hp)
    return PackedLanes(t, nb, xp, dp, sp, hp)


@njit(cache=True)
def _pack_lanes_nb(q32, d, s, q, halves, xp32, dp, sp, hp):  # pragma: no cover - compiled
    """Row r of the T rows into lane r % 8 of group r // 8 (the arrays zeroed by the caller: padding
    lanes stay zero): its 4-byte words, block scales, block sums and (halves) half-block sums."""
    t, words = q32.shape
    nb = d.shape[1]
    for r in range(t):
        g, lane = r // 8, r % 8
        base = g * words * 8
        for i in range(words):
            xp32[base + 8 * i + lane] = q32[r, i]
        for b in range(nb):
            at = (g * nb + b) * 8 + lane
            dp[at] = d[r, b]
            sp[at] = s[r, b]
            if halves:
                h0 = 0
                h1 = 0
                for c in range(16):
                    h0 += q[r, 32 * b + c]
                    h1 += q[r, 32 * b + 16 + c]
                hp[(g * nb + b) * 16 + lane] = h0
                hp[(g * nb + b) * 16 + 8 + lane] = h1


def _word_splat(g: _Ir, word: Any) -> Any:
    """<32 x i8>: the i32 `word`'s 4 bytes in each of the 8 lanes."""
    return g.b.bitcast(g.splat(word), _ir.VectorType(_I8, 32))


def _i32(v: int) -> Any:
    return _ir.Constant(_I32, v)


def _nibble_values(g: _Ir, p: Any, at: int) -> Any:
    """<32 x i8>: the 16 bytes at p + at as 32 values, value l < 16 the low nibble of byte l, 16 + l
    its high nibble (Q4_0's, Q4_1's, Q5_x's low bits, IQ4's codes)."""
    qs = g.bytes(p, at, 16)
    return g.b.shuffle_vector(g.b.and_(qs, g.const8(15, 16)), g.b.lshr(qs, g.const8(4, 16)), _lanes(list(range(32))))


def _fifth_bits(g: _Ir, q: Any, p: Any, at: int) -> Any:
    """q with bit l of the little-endian u32 at p + at as value l's fifth bit (Q5_0, Q5_1)."""
    b = g.b
    v32i = _ir.VectorType(_I32, 32)
    qh = g.splat(g.load(g.at(p, at), _I32), 32)
    bits = b.and_(b.lshr(qh, _ir.Constant(v32i, list(range(32)))), _ir.Constant(v32i, [1] * 32))
    return b.or_(q, b.shl(b.trunc(bits, _ir.VectorType(_I8, 32)), g.const8(4)))


_IQ4_CODES_AT = {"iq4_nl": 2, "iq4_xs": 8}  # bytes to the codes of a block (iq4_xs: of sub-block 0)


def _iq4_codes(g: _Ir, kind: str, p: Any, j: int) -> Any:
    """<32 x i8>: the 4-bit codes of IQ4 block j (IQ4_XS: sub-block j of the super-block at p)."""
    return _nibble_values(g, p, _IQ4_CODES_AT[kind] + (16 * j if kind == "iq4_xs" else 0))


def _iq4_lookup(g: _Ir, codes: Any) -> Any:
    """<32 x i8>: the unsigned operand of each code: its level + 128, or on AVX2 |level| (the sign then
    goes onto x: _signed_x), by vpshufb on x86, else lane by lane."""
    table = [abs(int(v)) if _DOT4 == "avx2" else int(v) + 128 for v in Q.KVALUES]
    b = g.b
    if _DOT4 in ("vnni", "avx2"):
        v32 = _ir.VectorType(_I8, 32)
        fn = _declare(b, "llvm.x86.avx2.pshuf.b", v32, [v32, v32])
        return b.call(fn, [_ir.Constant(v32, [t - 256 if t > 127 else t for t in table * 2]), codes])
    out = _ir.Constant(_ir.VectorType(_I8, 32), None)
    levels = _ir.Constant(_ir.VectorType(_I8, 16), [t - 256 if t > 127 else t for t in table])
    for lane in range(32):
        code = b.extract_element(codes, _i32(lane))
        out = b.insert_element(out, b.extract_element(levels, b.zext(code, _I32)), _i32(lane))
    return out


def _operand_offset(kind: str) -> int:
    """What the unsigned operand adds to each weight value (taken off as offset * the block's
    activation sum): Q4_0's 8, Q5_0's 16; Q8_0's and IQ4's 128 where w + 128 is the operand."""
    if kind in ("q8_0", "iq4_nl", "iq4_xs"):
        return 0 if _DOT4 == "avx2" else 128
    return {"q4_0": 8, "q5_0": 16}.get(kind, 0)


def _signed_x(g: _Ir, kind: str, p: Any, j: int, xv: Any) -> Any:
    """The signed operand for block j's values against the activation bytes xv: xv, or on AVX2 for Q8_0
    and IQ4 xv with the sign of each weight (IQ4: codes 0-7 are the negative levels)."""
    if _DOT4 != "avx2" or kind not in ("q8_0", *_IQ4_CODES_AT):
        return xv
    if kind == "q8_0":  # x with w's sign (0 where w is 0)
        b, w, zero = g.b, g.bytes(p, 2), g.const8(0)
        return b.select(b.icmp_signed("<", w, zero), b.sub(zero, xv), b.select(b.icmp_signed("==", w, zero), zero, xv))
    return _negated_where(g, _iq4_codes(g, kind, p, j), xv)


def _negated_where(g: _Ir, codes: Any, xv: Any) -> Any:
    b = g.b
    return b.select(b.icmp_unsigned("<", codes, g.const8(8)), b.sub(g.const8(0), xv), xv)


def _tile_values(g: _Ir, kind: str, p: Any, j: int) -> Any:
    """<32 x i8>: the unsigned operand values of 32-value block j (the sub-block within a K-quant or
    IQ4_XS super-block; 0 otherwise) of the block or super-block at byte pointer p: the weights' own
    values (nibbles, 5- and 6-bit values), or IQ4's levels (+ 128, or |level| on AVX2)."""
    b = g.b
    if kind == "q8_0":  # w + 128 (bits xor 0x80), or |w| on AVX2 (w's sign then goes onto x)
        w = g.bytes(p, 2)
        if _DOT4 == "avx2":
            return b.select(b.icmp_signed("<", w, g.const8(0)), b.sub(g.const8(0), w), w)
        return b.xor(w, g.const8(-128))
    if kind in ("q4_0", "q5_0", "q4_1", "q5_1"):
        qs_at = {"q4_0": 2, "q5_0": 6, "q4_1": 4, "q5_1": 8}[kind]
        q = _nibble_values(g, p, qs_at)
        return _fifth_bits(g, q, p, qs_at - 4) if kind in ("q5_0", "q5_1") else q
    if kind in _IQ4_CODES_AT:
        return _iq4_lookup(g, _iq4_codes(g, kind, p, j))
    if kind in ("q4_k", "q5_k"):  # sub-block j: low (j even) or high nibbles of 32 bytes 32 * (j >> 1)
        qs = g.bytes(p, (16 if kind == "q4_k" else 48) + 32 * (j >> 1))
        q = b.and_(b.lshr(qs, g.const8(4 * (j & 1))), g.const8(15))
        if kind == "q5_k":  # bit j of qh byte l is value l's fifth bit
            q = b.or_(q, b.shl(b.and_(b.lshr(g.bytes(p, 16), g.const8(j)), g.const8(1)), g.const8(4)))
        return q
    # q6_k: sub-block j = 4h + i; low nibbles of ql bytes 64h + 32 (i & 1) (i < 2) or their high
    # nibbles, bits 2i..2i+1 of qh bytes 128 + 32h as bits 4-5
    h, i = j >> 2, j & 3
    low = b.and_(b.lshr(g.bytes(p, 64 * h + 32 * (i & 1)), g.const8(4 * (i >> 1))), g.const8(15))
    top = b.and_(b.lshr(g.bytes(p, 128 + 32 * h), g.const8(2 * i)), g.const8(3))
    return b.or_(low, b.shl(top, g.const8(4)))


def _word_of(g: _Ir, q: Any, m: int) -> Any:
    """<32 x i8>: bytes 4m..4m+3 of q in each of the 8 lanes."""
    v8 = _ir.VectorType(_I32, 8)
    words = g.b.bitcast(q, v8)
    return g.b.bitcast(g.b.shuffle_vector(words, words, _lanes([m] * 8)), _ir.VectorType(_I8, 32))


_TILE_BLOCK = {"q8_0": (34, 1), "q4_0": (18, 1), "q5_0": (22, 1), "q4_1": (20, 1), "q5_1": (24, 1),
               "iq4_nl": (18, 1), "q4_k": (144, 8), "q5_k": (176, 8), "q6_k": (210, 8),
               "iq4_xs": (136, 8)}  # (bytes of a block or super-block, 32-value blocks in it)


def _tile_ir(g: _Ir, kind: str, rows: list[Any], x: Any, dx: Any, xs: Any, xh: Any, nb: Any, ahead: Any,
             res: Any) -> None:
    """res[8k + l] = row k of `rows` (byte pointers) dotted with lane l's activation row, over nb
    32-value blocks: x, dx, xs, xh point at the group's packed bytes, scales, sums and half sums. The
    IR loop takes a block or a K-quant super-block (its 8 blocks written out) an iteration, and asks
    for the bytes `ahead` of each block (the next tile's rows: without that, reading the rows from
    memory and multiplying them took turns, 10.3 ms for a 262K-row head's quarter where the two
    alone take 3.8 and ~6)."""
    b = g.b
    size, per = _TILE_BLOCK[kind]
    accs = [_cgutils.alloca_once_value(b, _ir.Constant(_ir.VectorType(_FLOAT, 8), None)) for _ in rows]
    # the rows' unpacked blocks, stored so that each 4-byte word reaches the dot products as a broadcast
    # load (see _tile_block_terms); q8_0 reads its words from the rows themselves
    scratch = None if kind == "q8_0" else _cgutils.alloca_once(
        b, _ir.ArrayType(_ir.VectorType(_I8, 32), len(rows)))
    count = b.udiv(nb, _ir.Constant(nb.type, per)) if per > 1 else nb
    with _cgutils.for_range(b, count) as loop:
        ps = [g.at(r, b.mul(loop.index, _ir.Constant(_I64, size))) for r in rows]
        for p in ps:  # the rows' next blocks, on their way while these are multiplied
            _prefetch_ir(b, g.at(p, ahead))
        for j in range(per):
            bi = b.add(b.mul(loop.index, _ir.Constant(_I64, per)), _ir.Constant(_I64, j))
            terms = _tile_block_terms(g, kind, ps, j, bi, x, dx, xs, xh, scratch)
            for acc, term in zip(accs, terms, strict=True):
                b.store(b.fadd(b.load(acc), term), acc)
    for k, acc in enumerate(accs):
        b.store(b.load(acc), b.bitcast(g.at(res, 8 * k), _ir.VectorType(_FLOAT, 8).as_pointer()), align=4)


def _opaque(b: Any, ptr: Any) -> None:
    """A compiler barrier that takes `ptr`'s memory as read and written (an empty inline asm): stores to
    it before stay stores, loads after stay loads."""
    fnty = _ir.FunctionType(_ir.VoidType(), [ptr.type])
    b.call(_ir.InlineAsm(fnty, "", "r,~{memory}", side_effect=True), [ptr])


def _tile_block_terms(g: _Ir, kind: str, ps: list[Any], j: int, bi: Any, x: Any, dx: Any, xs: Any,
                      xh: Any, scratch: Any) -> list[Any]:
    """<8 x float> terms of 32-value block bi (j within its super-block) of each row (its block or
    super-block at ps[k]) with the 8 lanes. `scratch` (an array of a <32 x i8> per row; None for q8_0,
    whose words are read from the rows themselves): each row's unpacked block is stored there and its
    words are loaded back broadcast to the 8 lanes (a load), where a word taken out of a register cost
    shuffles: a Q4_K tile of 4 rows and a super-block had 568
    shuffles to its 256 dot products, now none (`rows.inspect_asm()`). The barrier (_opaque) keeps the
    compiler from turning the loads back into shuffles of the stored value; without its memory clobber
    the Q4_K tile was slower (45-50 GMAC/s). Measured on the 2-core EPYC, one thread, 8 and 16 rows x a
    4096 x 2048 matrix, before / after: Q4_K 62-65 / 61-68 GMAC/s, Q6_K 54-58 / 59-64, Q8_0 (not
    changed: its words come from the rows) 66-67 / 64-66."""
    b = g.b
    v8, v8f = _ir.VectorType(_I32, 8), _ir.VectorType(_FLOAT, 8)
    sign_trick = kind == "q8_0" and _DOT4 == "avx2"
    xb = g.at(x, b.mul(bi, _ir.Constant(_I64, 256)))
    lane = b.mul(bi, _ir.Constant(_I64, 8))
    dxv = g.load(g.at(dx, lane), v8f)
    xsv = g.load(g.at(xs, lane), v8)
    # two chains of dot products per row and half (even and odd words), added at the end: one chain of
    # 8 dependent multiply-adds a block held the tile to the instruction's latency
    sums: list[list[Any]] = [[None, None, None, None] for _ in ps]  # Q6_K: two halves; else one
    values = [None if kind == "q8_0" else _tile_values(g, kind, p, j) for p in ps]
    slots: list[Any] = []
    if scratch is not None:
        for k, v in enumerate(values):
            slot = b.gep(scratch, [_i32(0), _i32(k)])
            b.store(v, slot)
            slots.append(b.bitcast(slot, _I32.as_pointer()))
        _opaque(b, scratch)
    codes = [_iq4_codes(g, kind, p, j) if kind in _IQ4_CODES_AT and _DOT4 == "avx2" else None for p in ps]
    for m in range(8):
        xv = g.bytes(xb, 32 * m)
        half = 1 if kind == "q6_k" and m >= 4 else 0
        for k, p in enumerate(ps):
            if kind == "q8_0":
                w = _word_splat(g, g.load(g.at(p, 2 + 4 * m), _I32))
                if sign_trick:
                    zero = g.const8(0)
                    neg = b.icmp_signed("<", w, zero)
                    sx = b.select(neg, b.sub(zero, xv), b.select(b.icmp_signed("==", w, zero), zero, xv))
                    u, s = b.select(neg, b.sub(zero, w), w), sx
                else:
                    u, s = b.xor(w, g.const8(-128)), xv
            else:
                u = _word_splat(g, b.load(b.gep(slots[k], [_i32(m)])))
                s = xv if codes[k] is None else _negated_where(g, _word_of(g, codes[k], m), xv)
            chain = 2 * half + m % 2
            sums[k][chain] = g.dot4(u, s, sums[k][chain])
    terms = []
    for k, p in enumerate(ps):
        lo = b.add(sums[k][0], sums[k][1])
        hi = b.add(sums[k][2], sums[k][3]) if kind == "q6_k" else None
        if kind in ("q4_k", "q5_k"):
            sc, mn = _k_scales_mins_ir(g, g.at(p, 4))
            scj, mnj = (g.splat(b.extract_element(v, _i32(j))) for v in (sc, mn))
            terms.append(b.fsub(b.fmul(b.fmul(g.splat(g.f16(p, 0)), dxv), b.sitofp(b.mul(scj, lo), v8f)),
                                b.fmul(b.fmul(g.splat(g.f16(p, 2)), dxv), b.sitofp(b.mul(mnj, xsv), v8f))))
        elif kind == "q6_k":  # each half minus 32 * its activation sum, times its int8 scale
            hsum = g.at(xh, b.mul(bi, _ir.Constant(_I64, 16)))
            halves = [g.splat(b.sext(g.load(g.at(p, 192 + 2 * j + e), _I8), _I32)) for e in (0, 1)]
            diffs = [b.sub(v, b.mul(g.load(g.at(hsum, 8 * e), v8), _ir.Constant(v8, [32] * 8)))
                     for e, v in enumerate((lo, hi))]
            s = b.add(b.mul(diffs[0], halves[0]), b.mul(diffs[1], halves[1]))
            terms.append(b.fmul(b.fmul(g.splat(g.f16(p, 208)), dxv), b.sitofp(s, v8f)))
        else:  # the 32-value types and IQ4_XS: _block_terms, its lanes the activation rows
            mins = g.splat(g.f16(p, 2)) if kind in ("q4_1", "q5_1") else None
            scale = g.splat(b.extract_element(_iq4_xs_scales_ir(g, p), _i32(j))) if kind == "iq4_xs" else None
            terms.append(_block_terms(g, kind, lo, dxv, xsv, g.splat(g.f16(p, 0)), mins, scale))
    return terms


def _tile_intrinsic(kind: str) -> Any:
    """The tile of `kind` as an intrinsic: (w0, w1, w2, w3: weight rows, uint8; xp, dp, sp, hp: the
    packed lanes' arrays; xo, so: the group's offsets into xp and into dp / sp (hp's is 2 * so); nb:
    32-value blocks a row; ahead: bytes from a row's block to the one to prefetch; table:
    _F16_TABLE; res: float32, 32 values written)."""

    @_intrinsic
    def tile(typingctx, w0, w1, w2, w3, xp, dp, sp, hp, xo, so, nb, ahead, table, res):  # pragma: no cover - compiled
        from numba import types as nbt

        want = [(w, nbt.uint8) for w in (w0, w1, w2, w3)] + [(xp, nbt.int8), (dp, nbt.float32), (sp, nbt.int32),
                                                             (hp, nbt.int32), (table, nbt.float32), (res, nbt.float32)]
        for ty, dtype in want:
            if not (isinstance(ty, nbt.Array) and ty.ndim == 1 and ty.layout == "C" and ty.dtype == dtype):
                raise TypeError(f"tile intrinsic: a C-contiguous 1-D {dtype} array, got {ty}")
        sig = nbt.none(w0, w1, w2, w3, xp, dp, sp, hp, nbt.intp, nbt.intp, nbt.intp, nbt.intp, table, res)

        def codegen(context: Any, builder: Any, sig: Any, args: Sequence[Any]) -> Any:
            g = _Ir(context, builder, sig, args, 12)
            rows = [builder.bitcast(g.elem(i, 0), _I8.as_pointer()) for i in range(4)]
            so = args[9]
            _tile_ir(g, kind, rows, builder.bitcast(g.elem(4, args[8]), _I8.as_pointer()), g.elem(5, so),
                     g.elem(6, so), g.elem(7, builder.mul(so, _ir.Constant(so.type, 2))), args[10], args[11],
                     g.elem(13, 0))
            return context.get_dummy_value()

        return sig, codegen

    return tile


# One module-level tile intrinsic per type, picked by _tile. A kernel must not hold an intrinsic in its
# closure: numba keys its disk cache by the pickled closure, and an intrinsic pickles with a UUID of its
# own (new in every process), so such a kernel was compiled again in every process (about 2 s at the
# first prompt of several tokens) and its cache gained one more entry each time.
_tile_q8_0, _tile_q4_0, _tile_q5_0 = _tile_intrinsic("q8_0"), _tile_intrinsic("q4_0"), _tile_intrinsic("q5_0")
_tile_q4_1, _tile_q5_1, _tile_iq4_nl = _tile_intrinsic("q4_1"), _tile_intrinsic("q5_1"), _tile_intrinsic("iq4_nl")
_tile_q4_k, _tile_q5_k, _tile_q6_k = _tile_intrinsic("q4_k"), _tile_intrinsic("q5_k"), _tile_intrinsic("q6_k")
_tile_iq4_xs = _tile_intrinsic("iq4_xs")


@njit(inline="always")
def _tile(t, w0, w1, w2, w3, xp, dp, sp, hp, xo, so, nb, ahead, table, res):  # pragma: no cover - compiled
    """The tile intrinsic of type t (a constant of the calling kernel: the other branches are pruned)."""
    if t == _Q8_0:
        _tile_q8_0(w0, w1, w2, w3, xp, dp, sp, hp, xo, so, nb, ahead, table, res)
    elif t == _Q4_0:
        _tile_q4_0(w0, w1, w2, w3, xp, dp, sp, hp, xo, so, nb, ahead, table, res)
    elif t == _Q5_0:
        _tile_q5_0(w0, w1, w2, w3, xp, dp, sp, hp, xo, so, nb, ahead, table, res)
    elif t == _Q4_1:
        _tile_q4_1(w0, w1, w2, w3, xp, dp, sp, hp, xo, so, nb, ahead, table, res)
    elif t == _Q5_1:
        _tile_q5_1(w0, w1, w2, w3, xp, dp, sp, hp, xo, so, nb, ahead, table, res)
    elif t == _IQ4_NL:
        _tile_iq4_nl(w0, w1, w2, w3, xp, dp, sp, hp, xo, so, nb, ahead, table, res)
    elif t == _Q4_K:
        _tile_q4_k(w0, w1, w2, w3, xp, dp, sp, hp, xo, so, nb, ahead, table, res)
    elif t == _Q5_K:
        _tile_q5_k(w0, w1, w2, w3, xp, dp, sp, hp, xo, so, nb, ahead, table, res)
    elif t == _Q6_K:
        _tile_q6_k(w0, w1, w2, w3, xp, dp, sp, hp, xo, so, nb, ahead, table, res)
    else:
        _tile_iq4_xs(w0, w1, w2, w3, xp, dp, sp, hp, xo, so, nb, ahead, table, res)


def _tile_kernel(t: int) -> Any:
    """The tile region for a one-matrix stack of type t: (w, xp, dp, sp, hp, n, nb, table, chunks, out);
    out[s, r] = row r of w[0] dotted with activation row s (n of them, packed)."""

    @njit(parallel=True, cache=True)
    def rows(w, xp, dp, sp, hp, n, nb, table, chunks, out):  # pragma: no cover - compiled
        n_out = w.shape[1]
        jobs = (n_out + 3) // 4
        groups = (n + 7) // 8
        ahead = 4 * w.shape[2]  # the next job's rows
        chunks = max(1, min(chunks, jobs))
        for c in prange(chunks):
            res = np.empty(32, np.float32)
            for job in range(jobs * c // chunks, jobs * (c + 1) // chunks):
                r0 = 4 * job
                r1, r2, r3 = min(r0 + 1, n_out - 1), min(r0 + 2, n_out - 1), min(r0 + 3, n_out - 1)
                for gi in range(groups):
                    _tile(t, w[0, r0], w[0, r1], w[0, r2], w[0, r3], xp, dp, sp, hp, 256 * nb * gi, 8 * nb * gi,
                          nb, ahead, table, res)
                    for k in range(min(4, n_out - r0)):
                        for lane in range(min(8, n - 8 * gi)):
                            out[8 * gi + lane, r0 + k] = res[8 * k + lane]

    return rows


_DENSE = {t: _dense_kernel(t) for t in sorted(KERNEL_TYPES)}
_TILE = {t: _tile_kernel(t) for t in sorted(KERNEL_TYPES)}


# ------------------------------------------------------------------------------------------------
# SwiGLU of the gate and up products, h = silu(g) * u = g / (1 + exp(-g)) * u, in float64 rounded to
# float32, then h quantized (quantize_rows), in one compiled call. exp is computed here, from IEEE
# operations only (+, -, *, /, rint, a product with an exact power of two), in the same order in the
# kernel and its twin: libm's and NumPy's exp or tanh may differ in the last bit, and the two must
# agree to the bit. exp(t) = 2^n * P(r), n = rint(t / ln 2), r = t - n ln 2 (ln 2 in two parts, n * hi
# exact), |r| <= 0.35, P the degree-13 Taylor polynomial (error < 5e-18 relative): h is float64's
# silu(g) * u to far better than float32's rounding, so it is the backend's tanh-form swiglu but for
# a rare last-bit tie (tests check <= 1 float32 ulp). t = -g is clipped to +-708 (exp finite and
# normal; beyond it h is g * u, or a float32 zero for any float32 u). A non-finite g gives h = NaN
# (its block then quantizes to NaN, as any non-finite value does). The kernel's loops have no calls or
# branches, so they vectorize: 5.8 us with h's quantization for 8 x 512 values on one Zen 5 core,
# where NumPy's float64 tanh-form swiglu alone took 15.8.

_INV_LN2 = 1.0 / 0.6931471805599453
_LN2_HI = 6.93147180369123816490e-01  # ln 2 = hi + lo; hi has 32 significant bits: n * hi is exact
_LN2_LO = 1.90821492927058770002e-10
_EXP_ARG_MAX = 708.0
_C2, _C3, _C4, _C5, _C6, _C7 = (1.0 / math.factorial(i) for i in range(2, 8))
_C8, _C9, _C10, _C11, _C12, _C13 = (1.0 / math.factorial(i) for i in range(8, 14))


@njit(inline="always")
def _exp_poly(r):  # pragma: no cover - compiled
    return 1.0 + r * (1.0 + r * (_C2 + r * (_C3 + r * (_C4 + r * (_C5 + r * (_C6 + r * (_C7 + r * (
        _C8 + r * (_C9 + r * (_C10 + r * (_C11 + r * (_C12 + r * _C13))))))))))))


def _exp_poly_twin(r: np.ndarray) -> np.ndarray:
    return 1.0 + r * (1.0 + r * (_C2 + r * (_C3 + r * (_C4 + r * (_C5 + r * (_C6 + r * (_C7 + r * (
        _C8 + r * (_C9 + r * (_C10 + r * (_C11 + r * (_C12 + r * _C13))))))))))))


def _swiglu_twin(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """float32 h = silu(g) * u of float32 arrays: the kernel's operations, elementwise."""
    gv = g.astype(np.float64)
    finite = np.isfinite(gv)
    t = np.minimum(np.maximum(-np.where(finite, gv, 0.0), -_EXP_ARG_MAX), _EXP_ARG_MAX)
    nf = np.rint(t * _INV_LN2)
    r = (t - nf * _LN2_HI) - nf * _LN2_LO
    e = _exp_poly_twin(r) * np.ldexp(1.0, nf.astype(np.int32))  # times 2^n: exact
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0, and h beyond float32: as the kernel
        h = (gv / (1.0 + e)) * u.astype(np.float64)
        return np.where(finite, h, np.nan).astype(F32)


@njit(cache=True, error_model="numpy")  # no zero-division check (1 + e >= 1): the loops vectorize
def _swiglu_quantize_nb(gu, ust, uoff, f, q, d, s):  # pragma: no cover - compiled
    """h[r, j] = silu(gu[0, r, j]) * gu[ust, r, uoff + j] for j < f (separate gate and up: ust 1,
    uoff 0; the fused stack's rows: ust 0, uoff f), quantized into q, d, s."""
    k = gu.shape[1]
    h = np.empty((k, f), np.float32)
    poly = np.empty(f, np.float64)
    bits = np.empty(f, np.int64)
    two_n = bits.view(np.float64)  # 2^n, made from its bits
    for r in range(k):
        g, u, hr = gu[0, r, :f], gu[ust, r, uoff : uoff + f], h[r]  # plain indices below: they vectorize
        for j in range(f):
            gv = np.float64(g[j])
            t = min(max(-gv, -_EXP_ARG_MAX), _EXP_ARG_MAX) if abs(gv) < np.inf else 0.0
            nf = np.rint(t * _INV_LN2)
            poly[j] = _exp_poly((t - nf * _LN2_HI) - nf * _LN2_LO)
            bits[j] = (np.int64(nf) + 1023) << 52
        for j in range(f):
            gv = np.float64(g[j])
            hv = np.float32((gv / (1.0 + poly[j] * two_n[j])) * np.float64(u[j]))
            hr[j] = hv if abs(gv) < np.inf else np.float32(np.nan)
    _quantize_rows_nb(h, q, d, s)


# ------------------------------------------------------------------------------------------------
# a token's expert ids and weights: any integer or float array (ids that came over from a GPU as
# float32 values), checked and converted once, with x quantized, in one compiled call.


@njit(cache=True)
def _token_nb(x, ids, wts, n_experts, idx, w32, xq, xd, xs):  # pragma: no cover - compiled
    """idx = ids as int64, w32 = wts as float32, x (1, H) quantized; returns the first slot whose id
    is not a whole number in 0..n_experts-1 (then nothing is quantized), else -1."""
    for s in range(ids.shape[0]):
        v = ids[s]
        if not (v >= 0 and v < n_experts):  # a NaN fails here too
            return s
        e = np.int64(v)
        if e != v:
            return s
        idx[s] = e
        w32[s] = np.float32(wts[s])
    _quantize_rows_nb(x, xq, xd, xs)
    return -1


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
    xq = x.q.reshape(-1, 1, blocks.shape[2], 32).astype(np.int32)  # one row per slot, or one for all
    isum = (q * xq).sum(axis=3, dtype=np.int32)
    return (_f16_field(blocks, 0) * x.d[:, None, :]) * isum.astype(F32)


def _terms_q4_0(rows, x: QuantizedRows):
    k, n_out, _ = rows.shape
    blocks = rows.reshape(k, n_out, -1, 18)
    qs = blocks[..., 2:18].astype(np.int32)
    q = np.concatenate([qs & 15, qs >> 4], axis=3) - 8  # value l < 16: low nibble of byte l
    xq = x.q.reshape(-1, 1, blocks.shape[2], 32).astype(np.int32)
    isum = (q * xq).sum(axis=3, dtype=np.int32)
    return (_f16_field(blocks, 0) * x.d[:, None, :]) * isum.astype(F32)


def _terms_q5_0(rows, x: QuantizedRows):
    k, n_out, _ = rows.shape
    blocks = rows.reshape(k, n_out, -1, 22)
    qh = blocks[..., 2:6].copy().view("<u4").astype(np.int64)  # (k, n_out, nb, 1): bit l is value l's
    high = (qh >> np.arange(32)) & 1
    qs = blocks[..., 6:22].astype(np.int32)
    q = (np.concatenate([qs & 15, qs >> 4], axis=3) | (high << 4).astype(np.int32)) - 16
    xq = x.q.reshape(-1, 1, blocks.shape[2], 32).astype(np.int32)
    isum = (q * xq).sum(axis=3, dtype=np.int32)
    return (_f16_field(blocks, 0) * x.d[:, None, :]) * isum.astype(F32)


def _terms_affine(rows, x: QuantizedRows, size: int, fifth: bool):
    """Q4_1 / Q5_1: x = d*q + m; terms (d * dx) * isum + (m * dx) * bsum."""
    k, n_out, _ = rows.shape
    blocks = rows.reshape(k, n_out, -1, size)
    qs = blocks[..., size - 16 : size].astype(np.int32)
    q = np.concatenate([qs & 15, qs >> 4], axis=3)
    if fifth:
        qh = blocks[..., 4:8].copy().view("<u4").astype(np.int64)
        q = q | (((qh >> np.arange(32)) & 1) << 4).astype(np.int32)
    xq = x.q.reshape(-1, 1, blocks.shape[2], 32).astype(np.int32)
    isum = (q * xq).sum(axis=3, dtype=np.int32)
    dx = x.d[:, None, :]
    return (_f16_field(blocks, 0) * dx) * isum.astype(F32) + (_f16_field(blocks, 2) * dx) * x.s[:, None, :].astype(F32)


def _terms_q4_1(rows, x: QuantizedRows):
    return _terms_affine(rows, x, 20, False)


def _terms_q5_1(rows, x: QuantizedRows):
    return _terms_affine(rows, x, 24, True)


def _iq4_levels(codes: np.ndarray) -> np.ndarray:
    """(..., 16) code bytes -> (..., 32) int32 levels: value l < 16 from byte l's low nibble, 16 + l
    from its high nibble."""
    c = codes.astype(np.int32)
    return Q.KVALUES.astype(np.int32)[np.concatenate([c & 15, c >> 4], axis=-1)]


def _terms_iq4_nl(rows, x: QuantizedRows):
    k, n_out, _ = rows.shape
    blocks = rows.reshape(k, n_out, -1, 18)
    xq = x.q.reshape(-1, 1, blocks.shape[2], 32).astype(np.int32)
    isum = (_iq4_levels(blocks[..., 2:18]) * xq).sum(axis=3, dtype=np.int32)
    return (_f16_field(blocks, 0) * x.d[:, None, :]) * isum.astype(F32)


def _terms_iq4_xs(rows, x: QuantizedRows):
    """x = d * (ls - 32) * level per sub-block of 32; terms (d * dx) * ((ls - 32) * isum)."""
    k, n_out, _ = rows.shape
    blocks = rows.reshape(k, n_out, -1, 136)
    nsb = blocks.shape[2]
    levels = _iq4_levels(blocks[..., 8:136].reshape(k, n_out, nsb * 8, 16))
    xq = x.q.reshape(-1, 1, nsb * 8, 32).astype(np.int32)
    isum = (levels * xq).sum(axis=3, dtype=np.int32)
    ls = Q.iq4_xs_scales(blocks.reshape(-1, 136)).astype(np.int32).reshape(k, n_out, nsb * 8)
    d = np.repeat(_f16_field(blocks, 0), 8, axis=2)
    return (d * x.d[:, None, :]) * (ls * isum).astype(F32)


def _terms_k_affine(blocks, q, x: QuantizedRows):
    """Q4_K / Q5_K: q (k, n_out, nsb, 8, 32) in 0..31; x = d*sc*q - dmin*m per sub-block of 32."""
    k, n_out, nsb = blocks.shape[:3]
    sc, m = Q.k_scales_mins(blocks[..., 4:16].reshape(-1, 12))
    sc = sc.astype(np.int32).reshape(k, n_out, nsb * 8)
    m = m.astype(np.int32).reshape(k, n_out, nsb * 8)
    xq = x.q.reshape(-1, 1, nsb * 8, 32).astype(np.int32)
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
    xq = x.q.reshape(-1, 1, nsb * 8, 2, 16).astype(np.int32)
    isum = ((q * xq).sum(axis=4, dtype=np.int32) * sc).sum(axis=3, dtype=np.int32)
    d = np.repeat(_f16_field(blocks, 208), 8, axis=2)
    return (d * x.d[:, None, :]) * isum.astype(F32)


_TWIN_TERMS = {Q.Q8_0: _terms_q8_0, Q.Q4_0: _terms_q4_0, Q.Q5_0: _terms_q5_0, Q.Q4_1: _terms_q4_1,
               Q.Q5_1: _terms_q5_1, Q.IQ4_NL: _terms_iq4_nl, Q.Q4_K: _terms_q4_k, Q.Q5_K: _terms_q5_k,
               Q.Q6_K: _terms_q6_k, Q.IQ4_XS: _terms_iq4_xs}


# ------------------------------------------------------------------------------------------------
# entry points


def expert_matvec(w: ExpertStack, ids: Sequence[int] | np.ndarray, x: QuantizedRows, *,
                  fast: bool = True, threads: int | None = None) -> np.ndarray:
    """(k, n_out) float32: row s is expert ids[s]'s matrix times activation row s of x (x: k rows,
    or one row that every slot shares).

    threads: numba's thread count for this thread (see `set_threads`; None leaves it)."""
    idx = _checked_ids(w, ids)
    _check_rows(w, x, idx.size)
    if not fast:
        rows = w.raw[idx]  # only the chosen experts' blocks
        with np.errstate(over="ignore", invalid="ignore"):
            return _accumulate(_TWIN_TERMS[w.ggml_type](rows, x))
    xq, xd, xs = _kernel_rows(x)
    out = np.full((1, idx.size, w.n_out), np.nan, F32)  # poisoned: a skipped row shows as NaN
    _matvec([w], idx, xq, xd, xs, threads, out)
    return out[0]


def weighted_matvec(w: ExpertStack, ids: Sequence[int] | np.ndarray, weights: np.ndarray,
                    x: QuantizedRows, *, fast: bool = True, threads: int | None = None) -> np.ndarray:
    """(n_out,) float32: the sum over slots s, in slot order, of weights[s] (as float32) times expert
    ids[s]'s matrix times activation row s of x (k rows), each product rounded to float32, then
    added: a token's down products and their weighted sum (one parallel region in the kernel)."""
    idx = _checked_ids(w, ids)
    _check_rows(w, x, idx.size, shared=False)
    w32 = np.asarray(weights, F32).reshape(-1)
    if w32.size != idx.size:
        raise ValueError(f"{idx.size} experts need {idx.size} weights, got {w32.size}")
    if not fast:
        return _weighted_sum_twin(expert_matvec(w, idx, x, fast=False), w32)
    xq, xd, xs = _kernel_rows(x)
    out = np.full(w.n_out, np.nan, F32)
    _down_sum(w, idx, np.ascontiguousarray(w32), xq, xd, xs, threads, out)
    return out


def dense_matmul(w: ExpertStack, x: np.ndarray, *, fast: bool = True,
                 threads: int | None = None) -> np.ndarray:
    """(T, n_out) float32 = x @ W.T for float32 activations x (T, n_in) and one weight matrix W held
    as a one-matrix stack (n_experts 1: a dense layer's weight as the file stores it). x is quantized
    to int8 blocks first (quantize_rows); each output is the same float32 sum of block terms, in the
    same order, as expert_matvec's for that row, in the kernel and in its twin (fast=False)."""
    if w.n_experts != 1:
        raise ValueError(f"a dense weight is a one-matrix stack, got {w.n_experts} matrices")
    xv = np.ascontiguousarray(x, dtype=F32)
    if xv.ndim != 2 or xv.shape[1] != w.n_in:
        raise ValueError(f"activations must be (T, {w.n_in}), got {xv.shape}")
    xr = quantize_rows(xv, fast=fast)
    if not fast:
        return expert_matvec(w, np.zeros(xv.shape[0], np.int64), xr, fast=False)
    _need_numba()
    n_threads = set_threads(threads)
    out = np.empty((xv.shape[0], w.n_out), F32)  # every value is written (tests compare all with the twin)
    if xv.shape[0] == 1:
        xq, xd, xs = _kernel_rows(xr)
        _DENSE[w.ggml_type](w.raw, xq, xd, xs, _F16_TABLE, out)
    elif xv.shape[0]:
        lanes = _pack_lanes(xr, halves=w.ggml_type == Q.Q6_K)
        _TILE[w.ggml_type](w.raw, lanes.x, lanes.d, lanes.s, lanes.h, lanes.rows, lanes.blocks, _F16_TABLE,
                           TILE_CHUNKS_PER_THREAD * n_threads, out)
    return out


def _weighted_sum_twin(y: np.ndarray, w32: np.ndarray) -> np.ndarray:
    out = np.zeros(y.shape[1], F32)
    for s in range(y.shape[0]):
        out += w32[s] * y[s]
    return out


def _checked_ids(w: ExpertStack, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """The expert ids as a flat int64 array, after checking them against w."""
    idx = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= w.n_experts):
        raise IndexError(f"expert ids {idx.tolist()} out of range for {w.n_experts} experts")
    return idx


def _check_rows(w: ExpertStack, x: QuantizedRows, k: int, shared: bool = True) -> None:
    n = x.q.shape[0] if x.q.ndim == 2 else -1
    if x.q.shape[1:] != (w.n_in,) or n not in ((k, 1) if shared else (k,)):
        want = f"{k}{' (or 1)' if shared else ''}"
        raise ValueError(f"{k} experts need {want} activation rows of {w.n_in}, got {x.q.shape}")
    if x.d.shape != (n, w.n_in // QBLOCK) or x.s.shape != x.d.shape:
        raise ValueError(f"activation scales and sums must be ({n}, {w.n_in // QBLOCK}), got {x.d.shape} "
                         f"and {x.s.shape}")


def _kernel_rows(x: QuantizedRows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x's arrays as the block intrinsics read them (through their data pointers): C-contiguous, of
    these dtypes (copies only where they are not)."""
    return (np.ascontiguousarray(x.q, dtype=np.int8), np.ascontiguousarray(x.d, dtype=F32),
            np.ascontiguousarray(x.s, dtype=np.int32))


def _need_numba() -> None:
    if not HAVE_NUMBA:
        raise RuntimeError("numba is not installed: `pip install numba`, or use fast=False")


def _matvec(stacks: list[ExpertStack], idx: np.ndarray, xq: np.ndarray, xd: np.ndarray,
            xs: np.ndarray, threads: int | None, out: np.ndarray) -> None:
    """out[st] = stack st's (k, n_out) products with x's rows (k of them, or one shared), for one
    stack, or two of the same type and shape in one parallel region (a token's gate and up: one
    start of the threads instead of two). Shapes are the caller's to check."""
    _need_numba()
    w = stacks[0]
    if len(stacks) not in (1, 2) or any(s.ggml_type != w.ggml_type or s.raw.shape != w.raw.shape
                                        for s in stacks):
        raise ValueError("one stack, or two of the same type and shape")
    set_threads(threads)
    _MATVEC[w.ggml_type](w.raw, stacks[-1].raw, len(stacks), idx, xq, xd, xs,
                         0 if xq.shape[0] == 1 else 1, _F16_TABLE, out)


def _down_sum(w: ExpertStack, idx: np.ndarray, w32: np.ndarray, xq: np.ndarray, xd: np.ndarray,
              xs: np.ndarray, threads: int | None, out: np.ndarray) -> None:
    """out = the weighted sum of w's products with x's k rows (weighted_matvec's kernel)."""
    _need_numba()
    n = set_threads(threads)
    _DOWN_SUM[w.ggml_type](w.raw, idx, w32, xq, xd, xs, _F16_TABLE, n, out)


def set_threads(threads: int | None) -> int:
    """numba's thread count for the calling thread set to `threads` (clipped to 1..NUMBA_NUM_THREADS)
    if it is not that already; None leaves it. Returns the count in effect. It is not restored after
    a call: the next token's calls want the same count, and setting it (~1 us) is not free."""
    now = int(_numba.get_num_threads())
    if threads is None:
        return now
    n = max(1, min(int(threads), _NUMBA_MAX_THREADS))
    if n != now:
        _numba.set_num_threads(n)
    return n


_NUMBA_MAX_THREADS = int(_nb_config.NUMBA_NUM_THREADS) if HAVE_NUMBA else 1


def routed_experts(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, gate: ExpertStack,
                   up: ExpertStack | None, down: ExpertStack, *, fast: bool = True,
                   threads: int | None = None) -> np.ndarray:
    """The routed-expert output (H,) float32 of one token x (H,): sum over s of weights[s] *
    down[ids[s]] @ swiglu(gate[ids[s]] @ x, up[ids[s]] @ x), every product on int8 activations.

    up None: `gate` is the fused (E, 2 F_e, H) stack, gate rows first. The routing (ids, weights) is
    the caller's: ids any integer array, or floats holding whole numbers (as a GPU's routing sends
    them); weights of any float type, taken as float32 and summed in float32, slot by slot. x is
    quantized once for every slot; the SwiGLU (see _swiglu_twin) and h's quantization are one call;
    the down products and the weighted sum one parallel region. threads: as `set_threads`.
    """
    xv = np.ascontiguousarray(x, dtype=F32).reshape(1, -1)
    idv, wv = _token_arrays(ids, weights)
    fe = _check_block(gate, up, down, xv.shape[1])
    if idv.size != wv.size:
        raise ValueError(f"{idv.size} expert ids need {idv.size} weights, got {wv.size}")
    if not fast:
        return _routed_experts_twin(xv, idv, wv, gate, up, down, fe)
    _need_numba()
    n_threads = set_threads(threads)
    u = gate if up is None else up
    key = (gate.ggml_type, u.ggml_type, down.ggml_type, _gate_up_mode(gate, up))
    kernel = _TOKEN_KERNELS.get(key) or _TOKEN_KERNELS.setdefault(key, _token_kernel(*key))
    out = np.empty(down.n_out, F32)
    bad = kernel(xv, idv, wv, gate.raw, u.raw, down.raw, fe, _F16_TABLE, n_threads, out)
    if bad >= 0:
        raise IndexError(f"expert id {idv[bad].item()} (slot {bad}) is not one of {gate.n_experts} experts")
    return out


# how a token's kernel runs gate and up: the fused stack (one region), two stacks of one type and
# shape (one region for both), two of different types (a region each)
_FUSED, _ONE_REGION, _TWO_REGIONS = 0, 1, 2


def _gate_up_mode(gate: ExpertStack, up: ExpertStack | None) -> int:
    if up is None:
        return _FUSED
    return _ONE_REGION if up.ggml_type == gate.ggml_type else _TWO_REGIONS  # shapes: _check_block


_TOKEN_KERNELS: dict[tuple[int, int, int, int], Any] = {}  # (gate, up, down types, mode) -> kernel


def _token_kernel(t_g: int, t_u: int, t_d: int, mode: int) -> Any:
    """routed_experts after its checks, as one compiled call for these types and gate/up layout (a
    call from Python into numba costs microseconds, more with the caches cold after a token's
    experts went through them): (x, ids, wts, g_raw, u_raw, d_raw, fe, table, n_threads, out) ->
    the first slot whose id is not an expert's (nothing computed), else -1 with out written."""

    @njit(parallel=True, cache=True)
    def token(x, ids, wts, g_raw, u_raw, d_raw, fe, table, n_threads, out):  # pragma: no cover - compiled
        k, n_in = ids.shape[0], x.shape[1]
        idx, w32 = np.empty(k, np.int64), np.empty(k, np.float32)
        xq = np.empty((1, n_in), np.int8)
        xd, xs = np.empty((1, n_in // 32), np.float32), np.empty((1, n_in // 32), np.int32)
        bad = _token_nb(x, ids, wts, g_raw.shape[0], idx, w32, xq, xd, xs)
        if bad >= 0:
            return bad
        gu = np.empty((1 if mode == _FUSED else 2, k, g_raw.shape[1]), np.float32)
        # each region's bound is computed before its loop: a prange whose bound is an expression
        # with a branch in it stays a serial loop (numba makes no parallel loop of it)
        jobs, per = _matvec_jobs(t_g, g_raw.shape[1], k)
        n_gu = 2 * per if mode == _ONE_REGION else per  # gate's then up's jobs, or one stack's
        for i in prange(n_gu):
            _matvec_job(t_g, i, g_raw, u_raw, per, jobs, idx, xq, xd, xs, 0, table, gu)
        if mode == _TWO_REGIONS:  # up's own region (gu[1]: job numbers per_u on); a constant: pruned
            jobs_u, per_u = _matvec_jobs(t_u, u_raw.shape[1], k)
            for i in prange(per_u):
                _matvec_job(t_u, per_u + i, g_raw, u_raw, per_u, jobs_u, idx, xq, xd, xs, 0, table, gu)
        hq = np.empty((k, fe), np.int8)
        hd, hs = np.empty((k, fe // 32), np.float32), np.empty((k, fe // 32), np.int32)
        if mode == _FUSED:  # gate rows, then up rows
            _swiglu_quantize_nb(gu, 0, fe, fe, hq, hd, hs)
        else:
            _swiglu_quantize_nb(gu, 1, 0, fe, hq, hd, hs)
        rows, n = _down_jobs(d_raw.shape[1], n_threads)
        for j in prange(n):
            _down_sum_job(t_d, j, rows, d_raw, idx, w32, hq, hd, hs, table, out)
        return -1

    return token


def _row_buffers(n: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Empty int8 rows (n, width), their block scales and block sums: quantize_rows's output."""
    nb = width // QBLOCK
    return np.empty((n, width), np.int8), np.empty((n, nb), F32), np.empty((n, nb), np.int32)


def _routed_experts_twin(xv: np.ndarray, ids: np.ndarray, wv: np.ndarray, gate: ExpertStack,
                         up: ExpertStack | None, down: ExpertStack, fe: int) -> np.ndarray:
    """routed_experts on the NumPy twins: the kernels' operations in their order."""
    idx = _twin_ids(ids, gate.n_experts)
    xa = _quantize_rows_twin(xv)  # one row, shared by every slot
    g = expert_matvec(gate, idx, xa, fast=False)
    if up is None:
        g, u = g[:, :fe], g[:, fe:]
    else:
        u = expert_matvec(up, idx, xa, fast=False)
    h = _quantize_rows_twin(_swiglu_twin(g, u))
    return _weighted_sum_twin(expert_matvec(down, idx, h, fast=False), wv.astype(F32))


def _token_arrays(ids: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ids and weights as flat contiguous arrays of a type the token kernel is compiled for (int64,
    float32 or float64 ids; float32 or float64 weights: each pair is a compilation of its own),
    converted only when they are not."""
    idv = np.ascontiguousarray(ids).reshape(-1)
    if idv.dtype.kind not in "iuf":
        raise TypeError(f"expert ids must be integers or whole floats, got {idv.dtype}")
    if idv.dtype not in _ID_TYPES:
        idv = idv.astype(np.float64 if idv.dtype.kind == "f" else np.int64)
    wv = np.ascontiguousarray(weights).reshape(-1)
    if wv.dtype != F32 and wv.dtype != np.float64:
        wv = wv.astype(np.float64)
    return idv, wv


_ID_TYPES = (np.dtype(np.int64), np.dtype(np.float32), np.dtype(np.float64))


def _twin_ids(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """_token_nb's check and conversion of the ids, in NumPy."""
    with np.errstate(invalid="ignore"):
        ok = (ids >= 0) & (ids < n_experts)
    for s in range(ids.size):
        if not ok[s] or int(ids[s]) != ids[s]:
            raise IndexError(f"expert id {ids[s].item()} (slot {s}) is not one of {n_experts} experts")
    return ids.astype(np.int64)


def _check_block(gate: ExpertStack, up: ExpertStack | None, down: ExpertStack, n_in: int) -> int:
    """The expert FFN width F_e, after checking that the stacks make one MoE block for tokens of
    n_in values (integer comparisons only: each stack checked its own blocks when it was made)."""
    fe = gate.n_out if up is not None else gate.n_out // 2
    if gate.n_in != n_in:
        raise ValueError(f"the gate experts take {gate.n_in} values, the token has {n_in}")
    if up is None and gate.n_out % 2:
        raise ValueError(f"a fused gate+up stack has an even number of rows, got {gate.n_out}")
    if up is not None and (up.n_in != n_in or up.n_out != gate.n_out):
        raise ValueError(f"up experts ({up.n_out} x {up.n_in}) differ from gate's "
                         f"({gate.n_out} x {gate.n_in})")
    if down.n_in != fe:
        raise ValueError(f"down experts take {down.n_in} values, the gate gives {fe}")
    if down.n_experts != gate.n_experts or (up is not None and up.n_experts != gate.n_experts):
        raise ValueError("gate, up and down must hold the same number of experts")
    return fe
