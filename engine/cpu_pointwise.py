"""The NumPy backend's RMS norm, gated activations (GeGLU, SwiGLU) and rotary position embedding
compiled, each with its NumPy twin.

What this is: the formulas of docs/qwen35.md 3.2 (RMS norm), 3.5 (SwiGLU; Gemma 3's GeGLU takes GELU's
tanh form) and 3.3.1 (RoPE) over rows of float32 values, computed in float64 and rounded to float32
once, as the twins do. The twins (`*_twin`) are the specification: whole-array NumPy expressions in
float64, one pass and one temporary array per operator. That costs most at a decode step's small
sizes: on the 2-core test machine the demo model's 8-stream decode (tests/load/bench_scheduler.py)
spent 7.6% of its time in norms (a Gemma 3 layer has six, two of them over each head), 5.8% in GeGLU
and 4.1% in RoPE, against 69% in its matmuls.

The compiled forms (numba, serial, the interpreter released) go through each row once:
- the norm: the float64 sum of squares (added in another order than NumPy's pairwise sum), then each
  value divided and weighted as the twin does;
- the gated activations: one pass writes each value's tanh argument (float64), NumPy's own vectorized
  tanh runs on that in place (numba has no vector math library here, and one C-library tanh a value
  measured slower than the whole twin), a second pass writes the float32 output. The same float64
  operations in the same order as the twin: the results are the twin's, bit for bit;
- RoPE: the twin's table of cosines and sines (`rope_table`, M-RoPE's position components included),
  which the backend makes once per step and base (every head and layer of the step reads it), then
  one pass a row.
So the norm agrees with its twin to float32 rounding, the activations and RoPE exactly
(tests/engine/test_cpu_pointwise.py, on fresh random inputs).

Not here: the GPU's kernels; the Gated DeltaNet output's norm (engine/cpu_gdn.py decodes it with its
recurrence). numba is optional: `available()` says whether the kernels can run; the backend otherwise
keeps the twins.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Sequence

import numpy as np

F32 = np.float32
F64 = np.float64

GELU_C = math.sqrt(2.0 / math.pi)  # GELU's tanh form: 0.5 g (1 + tanh(GELU_C (g + 0.044715 g^3)))
GEGLU, SWIGLU = 0, 1  # the gated kernels' `kind`

_HAVE_NUMBA = importlib.util.find_spec("numba") is not None
_compiled: dict[str, Callable[..., None]] = {}


def available() -> bool:
    """Whether numba is installed (imported on the first call only)."""
    return _HAVE_NUMBA


# ---- the twins ------------------------------------------------------------------------------------
def rms_norm_twin(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) over the last axis, times w when given; float32."""
    x64 = np.asarray(x, F64)
    y = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    if w is not None:
        y = y * w
    return y.astype(F32)


def sigmoid64(x: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-x) in float64, in the overflow-free form 0.5 (1 + tanh(x / 2))."""
    x = np.asarray(x, F64)
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def geglu_twin(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """GELU (its tanh form) of gate, times up; float32."""
    g = np.asarray(gate, F64)
    # g * g * g, not g**3: NumPy's float64 power is ~20x slower
    gelu = 0.5 * g * (1.0 + np.tanh(GELU_C * (g + 0.044715 * (g * g * g))))
    return (gelu * up).astype(F32)


def swiglu_twin(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SiLU of gate (gate * sigmoid(gate)), times up; float32."""
    g = np.asarray(gate, F64)
    return (g * sigmoid64(g) * up).astype(F32)


def rope_table(positions: np.ndarray, n_rot: int, base: float, sections: Sequence[int] = (),
               scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) of the rotation angles, each (T, n_rot // 2) float64: position / scale x
    base^(-2i / n_rot) for pair i; positions (T,), or (3, T) for M-RoPE, whose pair i takes component 1
    or 2 (height, width) where `sections` say. One table serves every head and every layer of a step
    that has these positions and this base."""
    half = n_rot // 2
    pair = np.arange(half)
    inv_freq = np.asarray(base, F64) ** (-2.0 * pair / n_rot)  # (half,)
    pos = np.asarray(positions, dtype=np.int64)
    if pos.ndim == 2:  # M-RoPE: (3, T) components (t, h, w)
        comp = np.zeros(half, dtype=np.int64)
        if sections:
            s = list(sections) + [0, 0, 0]
            comp[(pair % 3 == 1) & (pair < 3 * s[1])] = 1
            comp[(pair % 3 == 2) & (pair < 3 * s[2])] = 2
        pos_pair = pos[comp, :].T.astype(F64)  # (T, half)
    else:
        pos_pair = np.broadcast_to(pos.reshape(-1, 1).astype(F64), (pos.shape[0], half))
    angles = pos_pair / scale * inv_freq
    return np.cos(angles), np.sin(angles)


def rope_twin(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int) -> np.ndarray:
    """x (T, heads, d) float32 with its first n_rot values of each head rotated in pairs (i, i + n_rot/2)
    by the angles whose cosines and sines are `cos` and `sin` (rope_table); the rest of each head
    copied."""
    x = np.asarray(x, F32)
    half = n_rot // 2
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    x1 = x[..., :half].astype(F64)
    x2 = x[..., half:n_rot].astype(F64)
    y = x.copy()
    y[..., :half] = x1 * cos - x2 * sin
    y[..., half:n_rot] = x1 * sin + x2 * cos
    return y


# ---- the kernels ----------------------------------------------------------------------------------
def _rms_norm_kernel(x, w, has_w, eps, out):  # pragma: no cover - compiled
    """x, out (R, D) float32; w (D,) float32 (read when has_w)."""
    R, D = x.shape
    for r in range(R):
        ss = 0.0
        for i in range(D):
            v = np.float64(x[r, i])
            ss += v * v
        den = math.sqrt(ss / D + eps)
        if has_w:
            for i in range(D):
                out[r, i] = np.float64(x[r, i]) / den * np.float64(w[i])
        else:
            for i in range(D):
                out[r, i] = np.float64(x[r, i]) / den


def _rope_kernel(x, cos, sin, n_rot, out):  # pragma: no cover - compiled
    """x, out (T, heads, d) float32; cos, sin (T, n_rot // 2) float64."""
    T, H, d = x.shape
    half = n_rot // 2
    for t in range(T):
        for i in range(half):
            c = cos[t, i]
            s = sin[t, i]
            for h in range(H):
                x1 = np.float64(x[t, h, i])
                x2 = np.float64(x[t, h, half + i])
                out[t, h, i] = x1 * c - x2 * s
                out[t, h, half + i] = x1 * s + x2 * c
        for h in range(H):
            for i in range(n_rot, d):
                out[t, h, i] = x[t, h, i]


def _gate_arg_kernel(gate, kind, u):  # pragma: no cover - compiled
    """The tanh's argument of each gate value into u (n,) float64: GELU's, or g / 2 (the sigmoid's)."""
    for i in range(gate.shape[0]):
        g = np.float64(gate[i])
        if kind == GEGLU:
            u[i] = GELU_C * (g + 0.044715 * (g * g * g))
        else:
            u[i] = 0.5 * g


def _gate_out_kernel(gate, up, t, kind, out):  # pragma: no cover - compiled
    """out (n,) float32: GELU(g) * up or g sigmoid(g) * up, from t = the tanh of _gate_arg_kernel's u."""
    for i in range(gate.shape[0]):
        g = np.float64(gate[i])
        if kind == GEGLU:
            out[i] = 0.5 * g * (1.0 + t[i]) * np.float64(up[i])
        else:
            out[i] = g * (0.5 * (1.0 + t[i])) * np.float64(up[i])


_KERNELS: dict[str, Callable[..., None]] = {"rms_norm": _rms_norm_kernel, "rope": _rope_kernel,
                                             "gate_arg": _gate_arg_kernel, "gate_out": _gate_out_kernel}


def _kernel(name: str) -> Callable[..., None]:
    fn = _compiled.get(name)
    if fn is None:
        import numba

        # no fastmath: the kernels' float64 operations are the twins', value for value
        fn = _compiled[name] = numba.njit(cache=True, nogil=True, boundscheck=False)(_KERNELS[name])
    return fn


def compile_kernels() -> None:
    """Compile the kernels now (or load them from numba's disk cache), not inside a first token."""
    z = np.zeros((1, 4), F32)
    rms_norm(z, np.ones(4, F32), 1e-6)
    rms_norm(z, None, 1e-6)
    geglu(z, z)
    rope(z.reshape(1, 1, 4), *rope_table(np.zeros(1, np.int64), 4, 10_000.0), 4)


def takes(*arrays: np.ndarray) -> bool:
    """Whether the kernels take these arrays as they are: float32 (the twins widen anything)."""
    return all(isinstance(a, np.ndarray) and a.dtype == F32 for a in arrays)


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """rms_norm_twin's result (x float32 of any shape, normalized over its last axis)."""
    shape = x.shape
    rows = np.ascontiguousarray(x).reshape(-1, shape[-1])
    out = np.empty(rows.shape, F32)
    weight = np.empty(0, F32) if w is None else np.ascontiguousarray(w, F32)
    if w is not None and weight.shape != (shape[-1],):
        raise ValueError(f"a norm of rows of {shape[-1]} takes a weight of that many, not {weight.shape}")
    _kernel("rms_norm")(rows, weight, w is not None, float(eps), out)
    return out.reshape(shape)


def _gated(kind: int, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    if gate.shape != up.shape:
        raise ValueError(f"gate {gate.shape} and up {up.shape} differ")
    g, u = np.ascontiguousarray(gate).reshape(-1), np.ascontiguousarray(up).reshape(-1)
    t = np.empty(g.shape, F64)
    _kernel("gate_arg")(g, kind, t)
    np.tanh(t, out=t)  # NumPy's vectorized tanh, the twin's own
    out = np.empty(gate.shape, F32)
    _kernel("gate_out")(g, u, t, kind, out.reshape(-1))
    return out


def geglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """geglu_twin's result, bit for bit (gate and up float32 of one shape)."""
    return _gated(GEGLU, gate, up)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """swiglu_twin's result, bit for bit (gate and up float32 of one shape)."""
    return _gated(SWIGLU, gate, up)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int) -> np.ndarray:
    """rope_twin's result, bit for bit (x (T, heads, d) float32; cos, sin (T, n_rot // 2) float64)."""
    want = (x.shape[0], n_rot // 2) if x.ndim == 3 else None
    if want is None or cos.shape != want or sin.shape != want or not 0 < n_rot <= x.shape[2]:
        raise ValueError(f"rope of {x.shape} rotating {n_rot} values a head needs a table of "
                         f"{want}, not {cos.shape} / {sin.shape}")
    out = np.empty(x.shape, F32)
    _kernel("rope")(np.ascontiguousarray(x), np.ascontiguousarray(cos, F64), np.ascontiguousarray(sin, F64),
                    int(n_rot), out)
    return out
