"""A float32 matmul for a few rows on the CPU (a batched decode step), and its NumPy twin.

What this is: `rows_matmul(x, w)` = x @ w.T for x (T, K) with a handful of rows (2..ROWS_MAX: the
B sequences of a batched decode step) and a float32 weight w (N, K) as the NumPy backend holds it.
BLAS handles this shape badly: one row is a matrix-vector product bound by reading w (OpenBLAS
does it at memory speed), but 2-16 rows go through its GEMM, which packs w into panels first, so
a step of 8 rows costs ~3.5x one row, not the ~1.3x the arithmetic needs (the demo model's 671 MB
tied LM head: 20 ms for one row, 70 ms for eight with one thread).

The kernel reads each weight row once per group of 4 activation rows and keeps a 4 x 4 tile of
accumulators (4 weight rows x 4 activation rows): 16 independent fp32 sums per k, enough to hide
the FMA latency, with 8 loads per 16 multiply-adds. Rows of w are taken in blocks of BLOCK (a block
stays in L1 while every group of 4 activation rows passes over it). Activations are padded to a
multiple of 4 rows with zeros. Accumulation is float32 in another order than BLAS's (LLVM may
reassociate each dot product to vectorize it), so results agree with `x @ w.T` to float32 rounding
(relative ~1e-7 * sqrt(K)), not bit for bit; NaN and inf propagate (no finite-math assumption).

What this is not: a quantized matmul (the weights are the backend's float32 copies), a prefill path
(above ROWS_MAX rows BLAS's GEMM is efficient), or a single-row path (BLAS's GEMV is at memory speed).
numba is optional: `available()` says whether the kernel can run; the backend otherwise keeps BLAS.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import numpy as np

F32 = np.float32
ROWS_MIN = 2  # one row: BLAS's GEMV reads w at memory speed already
ROWS_MAX = 16  # past this BLAS's GEMM amortizes its packing (a prefill chunk)
BLOCK = 16  # weight rows per work item (16 rows of K = 640 floats: 40 KB, L1-sized)
# reassociation (to vectorize each dot product) and FMA contraction; no nnan/ninf, so NaN propagates
_FLAGS = {"reassoc", "contract"}


_HAVE_NUMBA = importlib.util.find_spec("numba") is not None
_compiled: dict[bool, Callable[..., None]] = {}  # parallel? -> the compiled kernel, made on first use


def available() -> bool:
    """Whether numba is installed (it is imported on the first call only: importing it takes ~0.5 s)."""
    return _HAVE_NUMBA


def _kernel(x, w, out):  # pragma: no cover - compiled
    """out[t, n] = x[t] . w[n]; x (T4, K) with T4 % 4 == 0, w (N, K), out (T4, N), all float32."""
    T4, K = x.shape
    N = w.shape[0]
    for b in _prange((N + BLOCK - 1) // BLOCK):
        n0 = b * BLOCK
        n1 = min(N, n0 + BLOCK)
        n4 = n0 + (n1 - n0) // 4 * 4
        for g in range(0, T4, 4):
            x0 = x[g]
            x1 = x[g + 1]
            x2 = x[g + 2]
            x3 = x[g + 3]
            for n in range(n0, n4, 4):
                w0 = w[n]
                w1 = w[n + 1]
                w2 = w[n + 2]
                w3 = w[n + 3]
                a00 = a01 = a02 = a03 = np.float32(0.0)
                a10 = a11 = a12 = a13 = np.float32(0.0)
                a20 = a21 = a22 = a23 = np.float32(0.0)
                a30 = a31 = a32 = a33 = np.float32(0.0)
                for k in range(K):
                    u0 = x0[k]
                    u1 = x1[k]
                    u2 = x2[k]
                    u3 = x3[k]
                    v = w0[k]
                    a00 += v * u0
                    a01 += v * u1
                    a02 += v * u2
                    a03 += v * u3
                    v = w1[k]
                    a10 += v * u0
                    a11 += v * u1
                    a12 += v * u2
                    a13 += v * u3
                    v = w2[k]
                    a20 += v * u0
                    a21 += v * u1
                    a22 += v * u2
                    a23 += v * u3
                    v = w3[k]
                    a30 += v * u0
                    a31 += v * u1
                    a32 += v * u2
                    a33 += v * u3
                out[g, n] = a00
                out[g + 1, n] = a01
                out[g + 2, n] = a02
                out[g + 3, n] = a03
                out[g, n + 1] = a10
                out[g + 1, n + 1] = a11
                out[g + 2, n + 1] = a12
                out[g + 3, n + 1] = a13
                out[g, n + 2] = a20
                out[g + 1, n + 2] = a21
                out[g + 2, n + 2] = a22
                out[g + 3, n + 2] = a23
                out[g, n + 3] = a30
                out[g + 1, n + 3] = a31
                out[g + 2, n + 3] = a32
                out[g + 3, n + 3] = a33
            for n in range(n4, n1):  # the block's last 1-3 weight rows
                wr = w[n]
                a0 = a1 = a2 = a3 = np.float32(0.0)
                for k in range(K):
                    v = wr[k]
                    a0 += v * x0[k]
                    a1 += v * x1[k]
                    a2 += v * x2[k]
                    a3 += v * x3[k]
                out[g, n] = a0
                out[g + 1, n] = a1
                out[g + 2, n] = a2
                out[g + 3, n] = a3


_prange: Any = range  # numba.prange once _kernel_for has imported numba


def _kernel_for(parallel: bool) -> Callable[..., None]:
    """The compiled kernel: serial (runs on the calling thread and needs no numba threading layer,
    whose default one must not be entered from two threads at once) or parallel over the blocks."""
    global _prange
    if parallel not in _compiled:
        import numba  # local import: optional, and slow to import

        _prange = numba.prange
        _compiled[parallel] = numba.njit(fastmath=_FLAGS, parallel=parallel, cache=True,
                                         boundscheck=False)(_kernel)
    return _compiled[parallel]


def compile_kernel(threads: int = 1) -> None:
    """Compile now (or load from numba's disk cache) the kernel rows_matmul calls with `threads`, not
    inside a first batched step: one call on a few zeros, of the types and layouts a step passes."""
    rows_matmul(np.zeros((ROWS_MIN, 4), F32), np.zeros((4, 4), F32), threads=threads)


def rows_matmul_twin(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The NumPy twin: x @ w.T in float32 (BLAS)."""
    return np.asarray(x, F32) @ np.asarray(w, F32).T


def rows_matmul(x: np.ndarray, w: np.ndarray, *, threads: int = 1) -> np.ndarray:
    """x (T, K) @ w.T, w (N, K) float32 -> (T, N) float32, for ROWS_MIN <= T <= ROWS_MAX.

    threads: numba threads for this call (1: the serial kernel on the calling thread)."""
    if not _HAVE_NUMBA:
        raise RuntimeError("numba is not installed: `pip install numba`, or use rows_matmul_twin")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"rows_matmul needs x (T, K) and w (N, K); got {x.shape} and {w.shape}")
    T, K = x.shape
    if not ROWS_MIN <= T <= ROWS_MAX:
        raise ValueError(f"rows_matmul is for {ROWS_MIN}..{ROWS_MAX} rows, got {T}")
    if w.dtype != F32 or not w.flags.c_contiguous:
        raise ValueError("rows_matmul needs a C-contiguous float32 weight (the backend's dense copy)")
    T4 = (T + 3) // 4 * 4
    xp = np.zeros((T4, K), F32)  # zero rows pad the last group of 4
    xp[:T] = x
    out = np.empty((T4, w.shape[0]), F32)
    if threads <= 1:
        _kernel_for(False)(xp, w, out)
    else:
        import numba  # local import: optional (imported by _kernel_for already)

        kernel = _kernel_for(True)
        before = numba.get_num_threads()
        config: Any = numba.config  # its attributes are set at import, unknown to mypy
        numba.set_num_threads(max(1, min(int(threads), int(config.NUMBA_NUM_THREADS))))
        try:
            kernel(xp, w, out)
        finally:
            numba.set_num_threads(before)
    return out[:T] if T4 != T else out
