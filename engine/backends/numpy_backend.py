"""NumpyBackend: the reference implementation of the Backend protocol (engine/backends/base.py).

This file is the specification every fast path is checked against, so it is written for reading, not
for speed: activations are float32, and the places where rounding could add up (norm reductions,
softmax, RoPE angles, the whole Gated DeltaNet recurrence and its chunked form) run in float64 and
are rounded to float32 at the end of each op. Weights are dequantized to float32 once at load time;
an embedding table stays quantized and only the looked-up rows are decoded (unless the same table is
also the tied LM head, which then gets one full float32 copy).

Routed experts stay quantized as the file stores them. The MoE op decodes only the experts a batch of
tokens picks; a single token (decode) instead runs the integer kernels of engine/cpu_experts.py (int8
activations, numba, parallel threads) when its experts are of a type they support and numba is installed.
`NumpyBackend(int_experts=False)` keeps the dequantize-then-matmul reference for that case too.

Beside a GPU (a plan that prices the CPU's layers at their file bytes: hold_weights("stored")), the
matmul weights of the integer kernels' types stay as the file stores them too, and decode rows and
prefill chunks alike multiply int8 activations on engine/cpu_experts.py's dense_matmul (a float32 copy
would take 4-7x the RAM the plan priced).

What this file is not: a fast CPU engine. Besides those integer paths it has the few-rows matmul and
the Gated DeltaNet recurrence compiled (engine/cpu_matmul.py, engine/cpu_gdn.py), and no fused kernels.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .. import cpu_attention, cpu_gdn, cpu_matmul, cpu_pointwise
from ..sampling import TopLogits, top_logits
from .base import DeviceHooks, FusedOpsMixin, GrowingKVCache

log = logging.getLogger(__name__)

F32 = np.float32
F64 = np.float64


# ------------------------------------------------------------------------------------------------
# weights


def _dequantize(info) -> np.ndarray:
    from .. import quants

    return np.ascontiguousarray(quants.dequantize(info), dtype=F32)


def _dequantize_rows(info, ids: np.ndarray) -> np.ndarray:
    """float32 rows `ids` of a 2-D GGUF tensor, decoding only those rows."""
    from .. import quants

    return np.asarray(quants.dequantize_rows(info, ids), dtype=F32).reshape(len(ids), info.shape[-1])


class NumpyWeight:
    """A weight on the CPU: float32 data (decoded at load), or, for embeddings, the raw GGUF tensor.

    shape is the logical row-major shape; a 1-D "matmul" weight is seen as (1, n). stored: the
    tensor's blocks as the integer kernels read them (a one-matrix cpu_experts.ExpertStack over the
    file's bytes), for a backend that holds weights as stored (NumpyBackend.hold_weights); the
    matmul then never makes a float32 copy that stays.
    """

    def __init__(self, info, role: str, data: np.ndarray | None, stored: Any = None):
        self.name = info.name
        self.type_name = info.type_name
        self.role = role
        self.info = info
        self._data = data
        self.stored = stored
        shape = tuple(info.shape)
        self.shape = (1, shape[0]) if role == "matmul" and len(shape) == 1 else shape

    def dense(self) -> np.ndarray:
        """The whole tensor in float32; decoded once and kept (the tied LM head case)."""
        if self._data is None:
            self._data = _dequantize(self.info)
        if self._data.shape != self.shape:
            self._data = self._data.reshape(self.shape)
        return self._data

    def rows(self, ids: np.ndarray) -> np.ndarray:
        if self._data is not None:
            return self._data[ids]
        return _dequantize_rows(self.info, ids)

    def expert(self, e: int) -> np.ndarray:
        """Expert e of a 3-D expert stack, (n_out, n_in) float32, decoding only its blocks."""
        if self._data is not None:
            return self._data[e]
        from .. import quants

        return np.asarray(quants.dequantize_rows(self.info, [int(e)])[0], dtype=F32)

    @property
    def nbytes(self) -> int:
        return int(self._data.nbytes) if self._data is not None else int(self.info.n_bytes)


# ------------------------------------------------------------------------------------------------
# attention cache


class NumpyKVCache(GrowingKVCache):
    """K and V of one attention layer for one sequence: (capacity, n_kv, d) arrays, first `length` valid.

    `capacity` is the initial allocation; appending past it doubles the arrays (the reference never
    refuses a long sequence; the GPU backend sizes its caches from the placement plan instead).
    Growth, truncate and clone: base.GrowingKVCache.
    """

    k: np.ndarray  # (capacity, n_kv, d), allocated by GrowingKVCache from _layout
    v: np.ndarray  # (capacity, n_kv, dv)

    def _layout(self):
        return {"k": ((self.n_kv_heads, self.head_dim), F32), "v": ((self.n_kv_heads, self.value_dim), F32)}

    @staticmethod
    def _zeros(shape, dtype):
        return np.zeros(shape, dtype)

    def _write(self, k: np.ndarray, v: np.ndarray, start: int) -> None:
        self.k[start : start + k.shape[0]] = k
        self.v[start : start + k.shape[0]] = v

    def read(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """K (L, n_kv, d) and V (L, n_kv, dv) of the first `length` tokens (views)."""
        return self.k[:length], self.v[:length]


class NumpyF16KVCache(NumpyKVCache):
    """The f16 cache: K and V rounded to float16 (nearest, ties to even) as they are appended; attention
    reads them back widened, so the reference sees exactly the values a GPU f16 cache holds."""

    kv_type = "f16"

    def _layout(self):
        return {"k": ((self.n_kv_heads, self.head_dim), np.float16),
                "v": ((self.n_kv_heads, self.value_dim), np.float16)}

    def _write(self, k: np.ndarray, v: np.ndarray, start: int) -> None:
        self.k[start : start + k.shape[0]] = np.asarray(k, F32).astype(np.float16)
        self.v[start : start + k.shape[0]] = np.asarray(v, F32).astype(np.float16)

    def read(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """K (L, n_kv, d) and V (L, n_kv, dv) of the first `length` tokens, float32."""
        return self.k[:length].astype(F32), self.v[:length].astype(F32)


class NumpyQ8KVCache(GrowingKVCache):
    """The q8_0 cache: each row of K and V in llama.cpp's Q8_0 blocks (engine/kvquant.py quantize_q8_0),
    held as int8 values (capacity, n_kv, d) and fp16 scales (capacity, n_kv, d/32): 34 bytes per 32
    values. Rows are quantized once, on append; attention reads them dequantized."""

    kv_type = "q8_0"
    k_q: np.ndarray  # the arrays _layout names (GrowingKVCache allocates them)
    k_scales: np.ndarray
    v_q: np.ndarray
    v_scales: np.ndarray

    def __init__(self, n_kv_heads: int, head_dim: int, value_dim: int, capacity: int):
        from ..kvquant import check_q8_dims

        check_q8_dims(head_dim, value_dim)
        super().__init__(n_kv_heads, head_dim, value_dim, capacity)

    def _layout(self):
        n, d, dv = self.n_kv_heads, self.head_dim, self.value_dim
        return {"k_q": ((n, d), np.int8), "k_scales": ((n, d // 32), np.float16),
                "v_q": ((n, dv), np.int8), "v_scales": ((n, dv // 32), np.float16)}

    @staticmethod
    def _zeros(shape, dtype):
        return np.zeros(shape, dtype)

    def _write(self, k: np.ndarray, v: np.ndarray, start: int) -> None:
        from ..kvquant import quantize_q8_0

        stop = start + k.shape[0]
        self.k_q[start:stop], self.k_scales[start:stop] = quantize_q8_0(k)
        self.v_q[start:stop], self.v_scales[start:stop] = quantize_q8_0(v)

    def read(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Dequantized K (L, n_kv, d) and V (L, n_kv, dv), float32."""
        from ..kvquant import dequantize_q8_0

        return (dequantize_q8_0(self.k_q[:length], self.k_scales[:length]),
                dequantize_q8_0(self.v_q[:length], self.v_scales[:length]))


# ------------------------------------------------------------------------------------------------
# the backend


def _softplus(x: np.ndarray) -> np.ndarray:
    # log(1 + e^x), and x itself above 20 (the threshold both references use)
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _compiles(compile_kernel, what: str, instead: str) -> bool:
    """Whether compile_kernel() succeeds; a failure (numba / LLVM raise many kinds) is a warning, and the
    caller switches the kernel off so that `instead` runs."""
    try:
        compile_kernel()
    except Exception as exc:  # noqa: BLE001
        log.warning("%s did not compile (%s: %s); %s runs instead", what, type(exc).__name__, exc, instead)
        return False
    return True


_ROPE_TABLES_KEPT = 8  # a step's tables (a base per layer kind, Gemma 3 has two) and a few steps' more


class NumpyBackend(FusedOpsMixin, DeviceHooks):
    name = "numpy"

    def __init__(self, device: str = "cpu:0", *, int_experts: bool | None = None,
                 expert_threads: int | None = None, rows_kernel: bool = True, gdn_kernel: bool = True,
                 attention_kernel: bool = True, pointwise_kernel: bool = True, int_weights: bool = False):
        """int_experts: a decode token's routed experts on the integer kernels (engine/cpu_experts.py);
        None: wherever numba imports. expert_threads: their threads, and those of the rows kernel (None:
        engine.threads.expert_threads: --threads N, else the BLAS rule). rows_kernel: matmuls of
        2-16 rows (a batched decode step) on engine/cpu_matmul.py's kernel where numba imports; False
        keeps BLAS. gdn_kernel: a decode token's Gated DeltaNet recurrence on engine/cpu_gdn.py's
        kernel where numba imports; False keeps its NumPy twin. attention_kernel: the attention of a
        decode token or short chunk over a float32 / float16 cache on engine/cpu_attention.py's kernel
        where numba imports; False keeps its NumPy twin. pointwise_kernel: RMS norms, GeGLU / SwiGLU
        and RoPE of float32 rows on engine/cpu_pointwise.py's kernels where numba imports; False keeps
        their NumPy twins. int_weights: matmul weights of the integer kernels' types held as the file
        stores them and multiplied on int8 activations (engine/cpu_experts.py dense_matmul; see
        hold_weights); False: decoded to float32 at load, the reference."""
        if not str(device).startswith("cpu"):
            raise ValueError(f"NumpyBackend runs on the CPU; got device '{device}' (use 'cpu:0')")
        self.device = str(device)
        self.int_experts = int_experts
        self.expert_threads = expert_threads
        self.rows_kernel = rows_kernel
        self.gdn_kernel = gdn_kernel
        self.attention_kernel = attention_kernel
        self.pointwise_kernel = pointwise_kernel
        self.int_weights = int_weights
        # rope tables of the last few steps (_rope_table): (positions, n_rot, base, sections, scale) -> (cos, sin)
        self._rope_tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        # a MoE layer's expert tensors as cpu_experts stacks, made on first use: (weights, stacks) by
        # the weights' ids (int_expert_stacks)
        self._stacks: dict[tuple[int, int, int], tuple[tuple[Any, ...], Any]] = {}

    def __repr__(self) -> str:
        return f"NumpyBackend({self.device!r})"

    # ---- data movement -------------------------------------------------------------------------
    def asarray(self, host_array) -> np.ndarray:
        a = np.asarray(host_array)
        if a.dtype.kind == "f":
            return np.ascontiguousarray(a, dtype=F32)
        return np.ascontiguousarray(a)

    def to_numpy(self, x) -> np.ndarray:
        return np.array(x, copy=True)

    def zeros(self, shape, dtype: str = "float32") -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def hold_weights(self, layout: str) -> None:
        """DeviceHooks.hold_weights: "stored" (a plan over GPUs and the CPU, which prices the CPU's
        layers at their file bytes) holds the matmul weights of the integer kernels' types as stored
        (int_weights); "numpy" (a plan on the CPU alone) decodes them to float32, the reference. Weights
        of other types are float32 either way."""
        self.int_weights = layout == "stored"

    def _holds_stored(self, info, role: str) -> bool:
        """Whether this backend holds a 2-D matmul or embedding weight as stored: it holds weights so
        and the integer kernels take the type."""
        if not self.int_weights or len(info.shape) != 2 or role not in ("matmul", "embedding"):
            return False
        from .. import cpu_experts

        return cpu_experts.numba_available() and int(info.ggml_type) in cpu_experts.KERNEL_TYPES

    def _stored(self, info, role: str) -> Any:
        """The one-matrix stack of a weight this backend holds as stored (_holds_stored), else None."""
        if not self._holds_stored(info, role):
            return None
        from .. import cpu_experts

        n_out, n_in = (int(d) for d in info.shape)
        raw = np.asarray(info.raw).reshape(1, n_out, -1)
        return cpu_experts.ExpertStack(raw, int(info.ggml_type), n_in)

    def load_weight(self, info, *, role: str = "matmul"):
        if role == "vector":
            return _dequantize(info)
        if role == "embedding":
            return NumpyWeight(info, role, None, self._stored(info, role))
        if role == "matmul":
            stored = self._stored(info, role)
            return NumpyWeight(info, role, None if stored is not None else _dequantize(info), stored)
        if role == "experts":  # kept as stored; moe decodes the experts a call uses
            return NumpyWeight(info, role, None)
        raise ValueError(f"unknown weight role '{role}' for tensor '{info.name}'")

    def load_fused(self, infos: list) -> list[NumpyWeight]:
        """The weights of one group (base.FusedOpsMixin.load_fused) decoded into one float32 array,
        each weight a row range (view) of it, as the CUDA backend lays them out; weights of differing
        row lengths are loaded apart. The group is never held twice: one tensor at a time is decoded and
        copied into its rows."""
        shapes = [(1, int(i.shape[0])) if len(i.shape) == 1 else tuple(int(d) for d in i.shape) for i in infos]
        if (len({s[1:] for s in shapes}) != 1 or any(len(s) != 2 for s in shapes)
                or any(self._holds_stored(i, "matmul") for i in infos)):
            return super().load_fused(infos)
        group = np.empty((sum(s[0] for s in shapes), shapes[0][1]), dtype=F32)
        out, r0 = [], 0
        for info, (rows, _) in zip(infos, shapes, strict=True):
            group[r0 : r0 + rows] = _dequantize(info).reshape(rows, -1)
            out.append(NumpyWeight(info, "matmul", group[r0 : r0 + rows]))
            r0 += rows
        return out

    def prepare_lm_head(self, weight) -> None:
        """Decode a tied embedding/LM-head table to float32 now (load time), not in the first token.
        (engine.model calls it when a person waits); the one table then serves both the
        lookup and the head, so there is never a second float32 copy."""
        if isinstance(weight, NumpyWeight) and weight.role == "embedding" and weight.stored is None:
            weight.dense()

    def prepare_kernels(self, gdn: bool) -> None:
        """The compiled kernels this backend decodes with (numba: each about 0.8 s the first time, a
        few hundredths of a second from its disk cache): the few-rows matmul of a batched step
        (engine/cpu_matmul.py), a decode token's attention (engine/cpu_attention.py), the norms, gated
        activations and RoPE (engine/cpu_pointwise.py), and, when GDN layers decode here, their
        recurrence (engine/cpu_gdn.py).
        One that does not compile is switched off with a warning: its NumPy twin runs."""
        if self.rows_kernel and cpu_matmul.available():
            threads = self.expert_thread_count()
            self.rows_kernel = _compiles(lambda: cpu_matmul.compile_kernel(threads),
                                         "the few-rows matmul kernel", "BLAS")
        if gdn and self.gdn_kernel and cpu_gdn.available():
            self.gdn_kernel = _compiles(cpu_gdn.compile_kernel, "the Gated DeltaNet kernel", "its NumPy twin")
        if self.attention_kernel and cpu_attention.available():
            self.attention_kernel = _compiles(cpu_attention.compile_kernel, "the decode attention kernel",
                                              "its NumPy twin")
        if self.pointwise_kernel and cpu_pointwise.available():
            self.pointwise_kernel = _compiles(cpu_pointwise.compile_kernels,
                                              "the norm, activation and RoPE kernels", "their NumPy twins")

    def free(self, obj) -> None:
        """Nothing to release on the host but the expert stacks made over obj's bytes."""
        for key in [key for key, (ws, _) in self._stacks.items() if any(w is obj for w in ws)]:
            del self._stacks[key]

    def synchronize(self) -> None:
        return None

    # ---- elementwise and norms -----------------------------------------------------------------
    def add(self, a, b):
        return np.add(a, b, dtype=F32)

    def mul(self, a, b):
        return np.multiply(a, b, dtype=F32)

    def scale(self, x, s: float):
        return (np.asarray(x, F64) * s).astype(F32)

    def sigmoid(self, x):
        return cpu_pointwise.sigmoid64(x).astype(F32)

    def silu(self, x):
        x64 = np.asarray(x, F64)
        return (x64 * cpu_pointwise.sigmoid64(x64)).astype(F32)

    def _pointwise(self, *arrays) -> bool:
        """Whether engine/cpu_pointwise.py's kernels take these arrays (else their twins run)."""
        return self.pointwise_kernel and cpu_pointwise.available() and cpu_pointwise.takes(*arrays)

    def swiglu(self, gate, up):
        if self._pointwise(gate, up) and gate.shape == up.shape:
            return cpu_pointwise.swiglu(gate, up)
        return cpu_pointwise.swiglu_twin(gate, up)

    def geglu(self, gate, up):
        if self._pointwise(gate, up) and gate.shape == up.shape:
            return cpu_pointwise.geglu(gate, up)
        return cpu_pointwise.geglu_twin(gate, up)

    def rms_norm(self, x, w, eps: float):
        if self._pointwise(x) and x.ndim >= 1 and (w is None or np.shape(w) == x.shape[-1:]):
            return cpu_pointwise.rms_norm(x, w, eps)
        return cpu_pointwise.rms_norm_twin(x, w, eps)

    def add_rms_norm(self, x, delta, w, eps: float):
        s = self.add(x, delta)
        return s, self.rms_norm(s, w, eps)

    def l2_norm(self, x, eps: float):
        x64 = np.asarray(x, F64)
        return (x64 / np.sqrt(np.sum(x64 * x64, axis=-1, keepdims=True) + eps)).astype(F32)

    def gated_rms_norm(self, x, z, w, eps: float):
        z64 = np.asarray(z, F64)
        normed = self.rms_norm(x, w, eps).astype(F64)
        return (normed * z64 * cpu_pointwise.sigmoid64(z64)).astype(F32)

    # ---- matmuls and lookups -------------------------------------------------------------------
    def embed(self, table: NumpyWeight, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n_rows = table.shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
            raise ValueError(f"token id out of range [0, {n_rows}) for '{table.name}'")
        return np.ascontiguousarray(table.rows(ids), dtype=F32)

    def matmul(self, x, w: NumpyWeight):
        # float32 BLAS with float32 accumulation: relative error ~1e-7 * sqrt(n_in), well inside the
        # 1e-4 budget, and the same arithmetic class as the float32 references.
        x = np.asarray(x, F32)
        if w.stored is not None:
            # [stored weights] int8 activation blocks on the integer kernels, whatever the row count: one
            # row straight through the weight, several through its tile (faster than decoding the weight
            # for the call and BLAS's GEMM at every chunk length measured, 64-2048 rows: docs/BENCHMARKS.md)
            from .. import cpu_experts

            out = cpu_experts.dense_matmul(w.stored, x.reshape(-1, x.shape[-1]), threads=self.expert_thread_count())
            return out.reshape(*x.shape[:-1], w.shape[0])
        dense = w.dense()
        # [batched decode] 2-16 rows (a batch of decoding sequences): engine/cpu_matmul.py's kernel,
        # same float32 arithmetic in another order; BLAS's GEMM packs the whole weight for so few rows
        if (self.rows_kernel and x.ndim == 2 and dense.flags.c_contiguous
                and cpu_matmul.ROWS_MIN <= x.shape[0] <= cpu_matmul.ROWS_MAX and cpu_matmul.available()):
            return cpu_matmul.rows_matmul(x, dense, threads=self.expert_thread_count())
        return x @ dense.T

    # ---- positions and attention ---------------------------------------------------------------
    def rope(self, x, positions, n_rot: int, base: float, *, sections=(), scale: float = 1.0):
        x = np.asarray(x, F32)
        cos, sin = self._rope_table(positions, n_rot, base, tuple(sections), scale)
        if self._pointwise(x) and x.ndim == 3:
            return cpu_pointwise.rope(x, cos, sin, n_rot)
        return cpu_pointwise.rope_twin(x, cos, sin, n_rot)

    def _rope_table(self, positions, n_rot: int, base: float, sections: tuple[int, ...], scale: float):
        """cpu_pointwise.rope_table (docs/qwen35.md 3.3.1), kept for the last few (positions, n_rot, base,
        sections, scale): every layer of a step rotates its queries and keys by the same table."""
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        key = (pos.shape, pos.tobytes(), int(n_rot), float(base), sections, float(scale))
        table = self._rope_tables.get(key)
        if table is None:
            table = cpu_pointwise.rope_table(pos, n_rot, base, sections, scale)
            if len(self._rope_tables) >= _ROPE_TABLES_KEPT:
                self._rope_tables.clear()  # (one call, whatever other threads decoding on this backend do)
            self._rope_tables[key] = table
        return table

    def new_kv_cache(self, n_kv_heads: int, head_dim: int, value_dim: int, capacity: int,
                     kv_type: str = "f32"):
        from .. import kvquant

        kv_type = kvquant.check_kv_type(kv_type)
        if kv_type == "q3":  # 3-bit codes + fp16 scales (engine/kvquant.py)
            return kvquant.Q3KVCache(n_kv_heads, head_dim, value_dim, capacity)
        if kv_type == "q8_0":
            return NumpyQ8KVCache(n_kv_heads, head_dim, value_dim, capacity)
        if kv_type == "f16":
            return NumpyF16KVCache(n_kv_heads, head_dim, value_dim, capacity)
        return NumpyKVCache(n_kv_heads, head_dim, value_dim, capacity)

    def attention(self, q, k, v, cache: NumpyKVCache, *, scale: float, window: int = 0):
        cache.append(k, v)
        L = cache.length
        # a decode token or a short chunk over a float32 / float16 cache: compiled (engine/cpu_attention.py);
        # a long chunk, or a quantized cache (its read dequantizes): the float64 NumPy twin
        if self.attention_kernel and isinstance(cache, NumpyKVCache) and cpu_attention.takes(cache.k, q.shape[0]):
            return cpu_attention.attend(q, cache.k[:L], cache.v[:L], scale=scale, window=window)
        keys, values = cache.read(L)
        return cpu_attention.attend_twin(q, keys, values, scale=scale, window=window)

    # ---- vision tower ----------------------------------------------------------------------------
    def layer_norm(self, x, w, b, eps: float):
        x64 = np.asarray(x, F64)
        centred = x64 - x64.mean(axis=-1, keepdims=True)
        var = np.mean(centred * centred, axis=-1, keepdims=True)
        return (centred / np.sqrt(var + eps) * np.asarray(w, F64) + np.asarray(b, F64)).astype(F32)

    def gelu(self, x, *, exact: bool = False):
        x64 = np.asarray(x, F64)
        if exact:
            from math import erf, sqrt

            return (0.5 * x64 * (1.0 + np.vectorize(erf, otypes=[F64])(x64 / sqrt(2.0)))).astype(F32)
        inner = np.sqrt(2.0 / np.pi) * (x64 + 0.044715 * x64**3)
        return (0.5 * x64 * (1.0 + np.tanh(inner))).astype(F32)

    def vision_rope(self, x, positions, base: float):
        x = np.asarray(x, F32)
        d = x.shape[-1]
        half, quarter = d // 2, d // 4
        inv_freq = np.asarray(base, F64) ** (-4.0 * np.arange(quarter) / d)  # (d/4,)
        pos = np.asarray(positions, dtype=np.int64).astype(F64)  # (2, T): row, col
        angle = np.concatenate([pos[0][:, None] * inv_freq, pos[1][:, None] * inv_freq], axis=1)
        cos = np.cos(angle)[:, None, :]  # (T, 1, d/2)
        sin = np.sin(angle)[:, None, :]
        x1 = x[..., :half].astype(F64)
        x2 = x[..., half:].astype(F64)
        return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(F32)

    def attention_full(self, q, k, v, *, scale: float):
        T, nh, _ = q.shape
        out = np.empty((T, nh, v.shape[-1]), F32)
        block = cpu_attention.ATTN_QUERY_BLOCK  # bounded score memory for big images
        for h in range(nh):
            keys = np.asarray(k[:, h, :], F64)
            values = np.asarray(v[:, h, :], F64)
            for q0 in range(0, T, block):
                scores = (np.asarray(q[q0 : q0 + block, h, :], F64) @ keys.T) * scale
                scores -= scores.max(axis=1, keepdims=True)
                p = np.exp(scores)
                p /= p.sum(axis=1, keepdims=True)
                out[q0 : q0 + block, h, :] = p @ values
        return out

    # ---- Gated DeltaNet ------------------------------------------------------------------------
    def conv1d_silu(self, x, state, w, cuts=()):
        K = w.shape[1]
        T = x.shape[0]
        X = np.concatenate([state, x], axis=0).astype(F64)  # (K-1+T, C): history then new rows
        conv = np.zeros((T, x.shape[1]), F64)
        for tap in range(K):  # tap K-1 multiplies the current token
            conv += X[tap : tap + T] * np.asarray(w[:, tap], F64)
        state[...] = X[T:].astype(F32)  # last K-1 raw inputs
        out = (conv * cpu_pointwise.sigmoid64(conv)).astype(F32)
        bounds = (0, *cuts, out.shape[1])
        return [out[:, a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def gdn_gates(self, alpha, beta, ssm_a, dt_bias):
        a = np.asarray(alpha, F64) + np.asarray(dt_bias, F64)
        g = np.asarray(ssm_a, F64) * _softplus(a)
        return g.astype(F32), cpu_pointwise.sigmoid64(beta).astype(F32)

    def gdn_step(self, q, k, v, g, beta, state):
        # the delta rule token by token (engine/cpu_gdn.py): compiled where numba imports, else its twin
        if self.gdn_kernel and cpu_gdn.available() and state.dtype == F32 and state.flags.c_contiguous:
            return cpu_gdn.gdn_step(q, k, v, g, beta, state)
        return cpu_gdn.gdn_step_twin(q, k, v, g, beta, state)

    def gdn_chunk(self, q, k, v, g, beta, state, chunk: int = 64):
        """docs/qwen35.md 3.4.1, per chunk of `chunk` tokens, all heads at once.

        The last chunk is shorter instead of zero-padded: padding rows (g = 0, beta = 0) contribute
        nothing, so this is the same algebra.
        """
        T, n_v, dv = v.shape
        qv, kv = cpu_gdn.heads_for_values(q, k, n_v)
        S = state.astype(F64)  # (n_v, dk, dv), S[key, value]
        out = np.empty((T, n_v, dv), F64)
        for start in range(0, T, chunk):
            stop = min(start + chunk, T)
            C = stop - start
            Q = qv[start:stop].transpose(1, 0, 2)  # (n_v, C, dk)
            Kc = kv[start:stop].transpose(1, 0, 2)  # (n_v, C, dk)
            V = np.asarray(v[start:stop], F64).transpose(1, 0, 2)  # (n_v, C, dv)
            B = np.asarray(beta[start:stop], F64).T  # (n_v, C)
            gamma = np.cumsum(np.asarray(g[start:stop], F64).T, axis=1)  # (n_v, C)
            causal = np.tril(np.ones((C, C), dtype=bool))  # j <= i
            strict = np.tril(np.ones((C, C), dtype=bool), -1)  # j < i
            diff = gamma[:, :, None] - gamma[:, None, :]  # gamma_i - gamma_j
            D = np.where(causal, np.exp(np.where(causal, diff, 0.0)), 0.0)  # mask BEFORE exp
            A = np.where(strict, B[:, :, None] * (Kc @ Kc.transpose(0, 2, 1)) * D, 0.0)
            # U = (I + A)^-1 (beta V), W = (I + A)^-1 (beta e^gamma K): forward substitution
            rhs = np.concatenate(
                [B[:, :, None] * V, (B * np.exp(gamma))[:, :, None] * Kc], axis=2
            )  # (n_v, C, dv + dk)
            sol = np.empty_like(rhs)
            for i in range(C):
                sol[:, i] = rhs[:, i] - np.einsum("hj,hjc->hc", A[:, i, :i], sol[:, :i])
            U, W = sol[:, :, :dv], sol[:, :, dv:]
            Vnew = U - W @ S  # corrected values (n_v, C, dv)
            P = np.where(causal, (Q @ Kc.transpose(0, 2, 1)) * D, 0.0)
            O = (np.exp(gamma)[:, :, None] * Q) @ S + P @ Vnew
            tail = np.exp(gamma[:, -1:] - gamma)  # exp(gamma_C - gamma_j), (n_v, C)
            S = np.exp(gamma[:, -1])[:, None, None] * S + (Kc * tail[:, :, None]).transpose(0, 2, 1) @ Vnew
            out[start:stop] = O.transpose(1, 0, 2)
        state[...] = S.astype(F32)
        return out.astype(F32)

    # ---- mixture of experts ----------------------------------------------------------------------
    def moe_route(self, x, router: NumpyWeight, k: int):
        """(ids (T, k) int64, weights (T, k) float64): softmax, top-k (ties -> lower index), renormalize."""
        logits = np.asarray(x, F64) @ router.dense().astype(F64).T  # (T, E)
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
        w = np.take_along_axis(p, ids, axis=1)
        w /= np.maximum(w.sum(axis=1, keepdims=True), 6.1e-5)
        return ids, w

    def moe(self, x, router, gate_exps, up_exps, down_exps, k: int):
        x = np.asarray(x, F32)
        if x.shape[0] == 1 and self.int_expert_stacks(gate_exps, up_exps, down_exps) is not None:
            from .. import cpu_experts  # one token for the CPU kernels: routing without a BLAS call

            tok_ids, tok_w = cpu_experts.route(x[0], router.dense(), k)
            return self.moe_routed(x, tok_ids[None, :], tok_w[None, :], gate_exps, up_exps, down_exps)
        ids, weights = self.moe_route(x, router, k)
        return self.moe_routed(x, ids, weights, gate_exps, up_exps, down_exps)

    def moe_route_rows(self, x, router: NumpyWeight, k: int) -> np.ndarray:
        """Backend.moe_route_rows: x's rows, each followed by its k expert ids and their weights."""
        x = np.asarray(x, F32)
        ids, weights = self.moe_route(x, router, k)
        return np.concatenate([x, ids.astype(F32), weights.astype(F32)], axis=1)

    def moe_routed(self, x, ids, weights, gate_exps, up_exps, down_exps, *, one_by_one: bool = False
                   ) -> np.ndarray:
        """The routed experts of tokens x (T, H) whose routing is given: ids (T, k) (any integer or
        integral float values) and weights (T, k). `moe` is moe_route then this; routed experts in
        host RAM serving a GPU get the routing from the GPU (engine/experts.py). One token runs on the
        integer kernels (engine/cpu_experts.py) where they apply, more on dequantize-then-matmul;
        one_by_one: every token on the integer kernels, one after another (a GPU's short chunks:
        dequantizing the ~8 T experts that T tokens pick takes ~9 ms an expert on a 16-core host, so a
        10-token chunk of a 30-layer model took ~20 s, where the kernels take ~0.5 ms a token)."""
        x = np.asarray(x, F32)
        ids = np.asarray(ids).astype(np.int64)
        if x.shape[0] == 1 or one_by_one:
            stacks = self.int_expert_stacks(gate_exps, up_exps, down_exps)
            if stacks is not None:
                from .. import cpu_experts

                gate, up, down = stacks
                w, threads = np.asarray(weights), self.expert_thread_count()
                each = [cpu_experts.routed_experts(x[t], ids[t], w[t], gate, up, down, threads=threads)
                        for t in range(x.shape[0])]
                return np.stack(each) if each else np.zeros(x.shape, F32)
        # float32 weights, as the kernels above and a GPU's routing give them (so a layer's experts give
        # the same rows wherever its routing ran), products summed in float64
        weights = np.asarray(weights, F32).astype(F64)
        out = np.zeros(x.shape, F64)
        for e in np.unique(ids):
            rows, slot = np.nonzero(ids == e)
            xe = x[rows]
            gate = gate_exps.expert(e)
            if up_exps is None:  # fused (E, 2 Fe, H): gate rows first, then up rows
                fe = gate.shape[0] // 2
                gate, up = gate[:fe], gate[fe:]
            else:
                up = up_exps.expert(e)
            h = self.swiglu(xe @ gate.T, xe @ up.T)
            out[rows] += weights[rows, slot][:, None] * (h @ down_exps.expert(e).T)
        return out.astype(F32)

    def int_expert_stacks(self, gate_exps, up_exps, down_exps):
        """The expert tensors as cpu_experts stacks when the integer path applies, else None."""
        if self.int_experts is False:
            return None
        from .. import cpu_experts
        from .. import quants as Q

        if self.int_experts is None:
            self.int_experts = cpu_experts.numba_available()
            if not self.int_experts:
                return None
        key = (id(gate_exps), id(up_exps), id(down_exps))
        kept = self._stacks.get(key)
        if kept is not None:  # the weights are kept with their stacks, so their ids stay theirs
            return kept[1]
        names = {Q.type_name(t) for t in cpu_experts.KERNEL_TYPES}
        weights = [gate_exps, down_exps] + ([] if up_exps is None else [up_exps])
        if any(not isinstance(w, NumpyWeight) or w.type_name not in names for w in weights):
            return None

        def stack(w: NumpyWeight):
            # (E, n_out, row bytes), whether the tensor's raw bytes come as 3-D or as (E * n_out) rows
            raw = np.asarray(w.info.raw).reshape(int(w.shape[0]), int(w.shape[1]), -1)
            return cpu_experts.ExpertStack(raw, int(w.info.ggml_type), int(w.shape[-1]))

        stacks = stack(gate_exps), None if up_exps is None else stack(up_exps), stack(down_exps)
        self._stacks[key] = ((gate_exps, up_exps, down_exps), stacks)
        return stacks

    def expert_thread_count(self) -> int:
        if self.expert_threads is None:  # --threads N, else the engine's rule for BLAS
            from ..threads import expert_threads

            self.expert_threads = expert_threads()
        return self.expert_threads

    # ---- sampling helpers --------------------------------------------------------------------------
    def top_k(self, logits, k: int) -> TopLogits:
        rows = np.asarray(logits, F32).reshape(-1, np.shape(logits)[-1])
        return TopLogits(*top_logits(rows, k), fetch=rows.__getitem__)
