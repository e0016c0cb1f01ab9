"""The Gated DeltaNet recurrence of a decode step on the CPU, compiled, and its NumPy twin.

What this is: the delta-rule update of the NumPy backend's `gdn_step` (docs/qwen35.md 3.4: for each
token and value head h, S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q), for the few
tokens of a decode step. The twin (`gdn_step_twin`) is that formula in NumPy over all heads at once:
it converts the whole state to float64, and each of its five array operations passes over it (a 1 MB
float32 state per layer and sequence at the 0.8B shape), so a step of one sequence cost ~0.6 ms a layer
on the 2-core test machine, and a batched step runs it once per sequence.

The compiled kernel (`gdn_step`, numba) takes one head at a time: its state is copied into a float64
scratch of dk x dv (128 KB, in L2), the token's decay and S^T k in one pass, the rank-1 update and S^T q
in a second, and the scratch rounded back to float32 once at the end, as the twin does. The decay
exp(g) and beta are computed in NumPy before the call, so both use the same exp; the products and sums
are the twin's in float64 (sums over the key index in index order, no fastmath), so the two agree to
float32 rounding (tests/engine/test_cpu_gdn.py, on fresh random inputs).

What this is not: the chunked prefill form (`gdn_chunk`, many tokens at once), or a GPU kernel.
numba is optional: `available()` says whether the kernel can run; the backend otherwise keeps the twin.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import numpy as np

F32 = np.float32
F64 = np.float64

_HAVE_NUMBA = importlib.util.find_spec("numba") is not None
_compiled: list[Callable[..., None]] = []  # the compiled kernel, made on first use


def available() -> bool:
    """Whether numba is installed (imported on the first call only)."""
    return _HAVE_NUMBA


def heads_for_values(q: np.ndarray, k: np.ndarray, n_v: int) -> tuple[np.ndarray, np.ndarray]:
    """q, k (T, n_k, dk) per value head, float64: value head j uses key head j % n_k (GGUF tiled order)."""
    key_head = np.arange(n_v) % q.shape[1]
    return np.asarray(q, F64)[:, key_head], np.asarray(k, F64)[:, key_head]


def gdn_step_twin(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                  state: np.ndarray) -> np.ndarray:
    """The NumPy twin: q, k (T, n_k, dk), v (T, n_v, dv), g and beta (T, n_v) (log-decay and write
    strength), state (n_v, dk, dv) float32 updated in place. Returns (T, n_v, dv) float32."""
    T, n_v, dv = v.shape
    qv, kv = heads_for_values(q, k, n_v)  # (T, n_v, dk)
    S = state.astype(F64)  # (n_v, dk, dv)
    vv = np.asarray(v, F64)
    decay = np.exp(np.asarray(g, F64))  # (T, n_v)
    b = np.asarray(beta, F64)
    out = np.empty((T, n_v, dv), F64)
    for t in range(T):
        S *= decay[t][:, None, None]
        predicted = np.einsum("hkv,hk->hv", S, kv[t])  # S^T k
        delta = b[t][:, None] * (vv[t] - predicted)
        S += kv[t][:, :, None] * delta[:, None, :]  # rank-1 write k delta^T
        out[t] = np.einsum("hkv,hk->hv", S, qv[t])  # S^T q
    state[...] = S.astype(F32)
    return out.astype(F32)


def _kernel(q, k, v, decay, beta, state, out):  # pragma: no cover - compiled
    """q, k (T, n_k, dk), v (T, n_v, dv), decay and beta (T, n_v), all float64; state (n_v, dk, dv) float32
    (updated), out (T, n_v, dv) float32."""
    T, n_v, dv = v.shape
    n_k, dk = q.shape[1], q.shape[2]
    S = np.empty((dk, dv), np.float64)
    delta = np.empty(dv, np.float64)
    o = np.empty(dv, np.float64)
    for h in range(n_v):
        kh = h % n_k
        for i in range(dk):
            for j in range(dv):
                S[i, j] = state[h, i, j]
        for t in range(T):
            d = decay[t, h]
            for j in range(dv):
                delta[j] = 0.0
            for i in range(dk):  # decay, and S^T k
                ki = k[t, kh, i]
                for j in range(dv):
                    s = S[i, j] * d
                    S[i, j] = s
                    delta[j] += s * ki
            b = beta[t, h]
            for j in range(dv):
                delta[j] = b * (v[t, h, j] - delta[j])
                o[j] = 0.0
            for i in range(dk):  # the rank-1 write, and S^T q
                ki = k[t, kh, i]
                qi = q[t, kh, i]
                for j in range(dv):
                    s = S[i, j] + ki * delta[j]
                    S[i, j] = s
                    o[j] += s * qi
            for j in range(dv):
                out[t, h, j] = o[j]
        for i in range(dk):
            for j in range(dv):
                state[h, i, j] = S[i, j]


def _kernel_compiled() -> Callable[..., None]:
    """The compiled kernel (serial, on the calling thread; the interpreter released while it runs, as
    NumPy's own operations release it)."""
    if not _compiled:
        import numba  # local import: optional, and slow to import

        _compiled.append(numba.njit(cache=True, nogil=True, boundscheck=False)(_kernel))
    return _compiled[0]


def compile_kernel() -> None:
    """Compile the kernel now (or load it from numba's disk cache), not inside a first token: one step
    on a few zeros, of the types and layouts a decode token passes."""
    gdn_step(np.zeros((1, 1, 2), F32), np.zeros((1, 1, 2), F32), np.zeros((1, 1, 2), F32),
             np.zeros((1, 1), F32), np.zeros((1, 1), F32), np.zeros((1, 2, 2), F32))


def gdn_step(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
             state: np.ndarray) -> np.ndarray:
    """gdn_step_twin's result from the compiled kernel (same arguments; state float32, C-contiguous,
    updated in place)."""
    if not _HAVE_NUMBA:
        raise RuntimeError("numba is not installed: `pip install numba`, or use gdn_step_twin")
    T, n_v, dv = v.shape
    if (q.ndim != 3 or q.shape != k.shape or q.shape[0] != T or n_v % q.shape[1]
            or state.shape != (n_v, q.shape[2], dv) or np.shape(g) != (T, n_v) or np.shape(beta) != (T, n_v)):
        raise ValueError(f"gdn_step: q, k (T, n_k, dk), v (T, n_v, dv), g, beta (T, n_v) and state (n_v, dk, "
                         f"dv) with n_v a multiple of n_k; got q {q.shape}, k {k.shape}, v {v.shape}, g "
                         f"{np.shape(g)}, beta {np.shape(beta)}, state {state.shape}")
    if state.dtype != F32 or not state.flags.c_contiguous:
        raise ValueError("gdn_step needs a C-contiguous float32 state (the backend's own)")
    out = np.empty((T, n_v, dv), F32)
    # in float64 as the twin reads them (a few KB a token); one signature to compile
    _kernel_compiled()(np.ascontiguousarray(q, F64), np.ascontiguousarray(k, F64), np.ascontiguousarray(v, F64),
                       np.exp(np.asarray(g, F64)), np.ascontiguousarray(beta, F64), state, out)
    return out
