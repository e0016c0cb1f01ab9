"""The Backend protocol: the few operations the model files need, and nothing else.

Model files (engine/models/*.py) are pure functions over a weights dict and a Backend; they never import
numpy or cupy. `numpy_backend.NumpyBackend` is the specification (float32, float64 where it protects
accuracy, written for reading); `cupy_backend.CupyBackend` has the same signatures and calls the
hand-written kernels. A test runs both on the same inputs.

Conventions
- An "Array" is the backend's own array type (numpy.ndarray, cupy.ndarray). Model code may use only
  `.shape`, `.reshape(...)` and basic slicing on it; everything else goes through the backend.
- Activations are float32. Shapes are written as comments: T tokens, H hidden, nh heads, d head dim.
- A "Weight" is what `load_weight` returned: opaque to the model, with `.shape` (logical row-major
  shape, GGUF `ne` reversed) and `.type_name` (GGML type name, e.g. "Q8_0").
- Matmuls compute x @ W.T (W is (n_out, n_in), as GGUF stores it).
- Ops that own state (KV cache, GDN conv/recurrent state) update it in place; the state objects are made
  by the same backend (`new_kv_cache`, `zeros`).
- Elementwise ops (`add`, `mul`) broadcast like NumPy (e.g. (T, F) * (T, 1)).
- A "matmul" weight stored 1-D (n,) acts as a (1, n) matrix (e.g. the MoE shared-expert gate that
  llama.cpp's C++ tools write 1-D).
- Per-layer sequence state is a `LayerState` (below): a KV cache and/or named recurrent arrays. Sessions
  snapshot and restore it generically (KV: by length; recurrent arrays: by copy through the host).
- Fused ops (`FusedOpsMixin`: matmul_many, matmul_add, matmul_swiglu, gdn_decode, gated_attention) are
  defined by composing the ops below; both backends inherit them, and a fast backend overrides them with
  single kernels (the single-token decode path, the prefill's SwiGLU GEMM) without changing what they
  compute.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..sampling import PickSpec, TopLogits

if TYPE_CHECKING:
    from ..expert_pool import ExpertChannel

Array = Any
Weight = Any


@runtime_checkable
class KVCache(Protocol):
    """Per-layer attention cache for one sequence. `length` = tokens stored so far."""

    length: int
    capacity: int

    def truncate(self, length: int) -> None:
        """Forget everything after `length` tokens (for regenerate / edit-and-resend)."""

    def clone(self) -> KVCache:
        """An independent copy (same device) holding the same `length` tokens (Session.fork)."""


class GrowingKVCache(KVCache):
    """The book-keeping every backend's KV cache shares: per-token arrays of `capacity` rows (the
    first `length` valid), growth by doubling past `capacity`, truncate, clone, byte count.

    A subclass names its arrays in `_layout()` ({attribute: (shape after the token axis, dtype)}),
    allocates zeroed arrays in `_zeros(shape, dtype)` and writes appended rows in `_write(k, v, start)`
    (rows start..start+T-1, already reserved). The array library stays in the subclass."""

    def __init__(self, n_kv_heads: int, head_dim: int, value_dim: int, capacity: int):
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.value_dim = value_dim
        self.capacity = max(1, int(capacity))
        self.length = 0
        for name, (tail, dtype) in self._layout().items():
            setattr(self, name, self._zeros((self.capacity,) + tail, dtype))

    def _layout(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        raise NotImplementedError

    @staticmethod
    def _zeros(shape: tuple[int, ...], dtype) -> Array:
        raise NotImplementedError

    def _write(self, k: Array, v: Array, start: int) -> None:
        raise NotImplementedError

    def reserve(self, need: int) -> None:
        """Make room for `need` tokens: past `capacity` every array doubles (or grows to `need`),
        keeping its first `length` rows (so any device address baked into a graph changes)."""
        if need <= self.capacity:
            return
        new_cap = max(need, 2 * self.capacity)
        for name, (tail, dtype) in self._layout().items():
            old = getattr(self, name)
            grown = self._zeros((new_cap,) + tail, dtype)
            grown[: self.length] = old[: self.length]
            setattr(self, name, grown)
        self.capacity = new_cap

    def append(self, k: Array, v: Array) -> None:
        need = self.length + k.shape[0]
        self.reserve(need)
        self._write(k, v, self.length)
        self.length = need

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a KV cache of {self.length} tokens to {length}")
        self.length = int(length)

    def clone(self) -> GrowingKVCache:
        twin = type(self)(self.n_kv_heads, self.head_dim, self.value_dim, self.capacity)
        for name in self._layout():
            getattr(twin, name)[: self.length] = getattr(self, name)[: self.length]
        twin.length = self.length
        return twin

    @property
    def nbytes(self) -> int:
        return int(sum(getattr(self, name).nbytes for name in self._layout()))


# A part's weight arrays on a device share one allocation (its weight arena: DeviceHooks.part_arena,
# CupyBackend's WeightArena; priced by engine/placement.py _arena_padding): each array starts at a
# multiple of ARENA_ALIGN bytes (cudaMalloc's own alignment) and the arena is whole DRIVER_PAGE pages, the
# CUDA driver's allocation page above 1 MiB (measured: engine/placement.py), so the driver adds nothing.
ARENA_ALIGN = 256
DRIVER_PAGE = 2 << 20


def arena_aligned(n: int) -> int:
    """n rounded up to a multiple of ARENA_ALIGN."""
    return -(-n // ARENA_ALIGN) * ARENA_ALIGN


def whole_pages(n: int) -> int:
    """n rounded up to whole DRIVER_PAGE pages."""
    return -(-n // DRIVER_PAGE) * DRIVER_PAGE


@dataclass
class LayerState:
    """Per-sequence state of one layer, as returned by a model module's `new_layer_state`.

    kv: the attention cache (None for recurrent layers). It can be truncated to any earlier length.
    recurrent: fixed-size arrays that summarize all tokens seen so far (GDN: "conv" (K-1, C) and
    "ssm" (n_v, dk, dv)); they cannot be rewound, only snapshotted and restored. Ops update them in
    place; restoring replaces the dict entries with arrays of the same shape.
    """

    kv: KVCache | None = None
    recurrent: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MoeShared:
    """The shared expert of a MoE block: gate_inp (1, H) gives its sigmoid gate; gate, up (Fs, H) and
    down (H, Fs) its SwiGLU FFN."""

    gate_inp: Weight
    gate: Weight
    up: Weight
    down: Weight


def compose_moe_block(be: Backend, x, router, gate_exps, up_exps, down_exps, k: int,
                      shared: MoeShared | None, residual, *, shared_beside: bool = False):
    """FusedOpsMixin.moe_block from the protocol's ops (the specification; also what a proxy whose
    experts live elsewhere runs, engine/experts.py). shared_beside: the shared expert is queued first,
    to run beside the routed experts (`alongside`: while they make a round trip to the host); the
    same ops, the same result."""
    join = be.alongside(lambda: shared_expert(be, x, shared)) if shared is not None and shared_beside else None
    y = be.moe(x, router, gate_exps, up_exps, down_exps, k)
    if shared is not None:
        y = be.add(y, join() if join is not None else shared_expert(be, x, shared))
    return y if residual is None else be.add(residual, y)


def shared_expert(be: Backend, x, shared: MoeShared):
    """A MoE block's shared expert: sigmoid(x @ gate_inp.T) * SwiGLU FFN of x; x (T, H) -> (T, H)."""
    s = be.matmul(be.matmul_swiglu(x, shared.gate, shared.up), shared.down)
    return be.mul(s, be.sigmoid(be.matmul(x, shared.gate_inp)))  # gate (T, 1)


class FusedOpsMixin:
    """Fused operations of the decode path, defined by composing the protocol's basic ops.

    The compositions here are the specification (NumpyBackend inherits them unchanged); a fast backend
    overrides a method where it has one kernel for the whole group, and falls back to these for the
    shapes its kernels do not cover. The results equal the composition up to fp32 rounding.
    """

    def matmul_many(self: Backend, x, ws) -> list:
        """[x @ W.T for W in ws]: several weights applied to one input (fused projections)."""
        return [self.matmul(x, w) for w in ws]

    def load_fused(self: Backend, infos) -> list:
        """[load_weight(info, role="matmul") for info in infos]: the matmul weights of one group that
        the model applies to one input (an ArchSpec fused group; engine/model.py loads every group
        through here). A backend may hold them as one array, each returned weight a row range of it
        (so that matmul_many runs them as one matmul); each still works on its own, and the results
        are the same."""
        return [self.load_weight(info, role="matmul") for info in infos]

    def matmul_add(self: Backend, x, w, residual):
        """residual + x @ W.T (the residual add of a layer, folded into its last matmul)."""
        return self.add(residual, self.matmul(x, w))

    def matmul_swiglu(self: Backend, x, gate, up):
        """silu(x @ gate.T) * (x @ up.T): a SwiGLU feed-forward's input side (gate and up usually one
        fused group)."""
        g, u = self.matmul_many(x, [gate, up])
        return self.swiglu(g, u)

    def gdn_decode(self: Backend, mixed, z, b, alpha, conv_state, ssm_state, conv_w, ssm_a, dt_bias,
                   norm_w, *, n_k: int, n_v: int, dk: int, dv: int, eps: float):
        """A Gated DeltaNet mixer between its input projections and ssm_out, for T tokens.

        mixed (T, 2 n_k dk + n_v dv) the raw [q | k | v] projection, z (T, n_v dv), b and alpha (T, n_v).
        conv_state (K-1, C) and ssm_state (n_v, dk, dv) are updated in place. Returns the gated,
        normalized output (T, n_v dv), the input of ssm_out."""
        T = mixed.shape[0]
        key_dim = n_k * dk
        uq, uk, uv = self.conv1d_silu(mixed, conv_state, conv_w, cuts=(key_dim, 2 * key_dim))
        q = uq.reshape(T, n_k, dk)
        k = uk.reshape(T, n_k, dk)
        v = uv.reshape(T, n_v, dv)
        q = self.scale(self.l2_norm(q, eps), 1.0 / math.sqrt(dk))
        k = self.l2_norm(k, eps)
        g, beta = self.gdn_gates(alpha, b, ssm_a, dt_bias)
        if T == 1:
            o = self.gdn_step(q, k, v, g, beta, ssm_state)
        else:
            o = self.gdn_chunk(q, k, v, g, beta, ssm_state, chunk=64)
        y = self.gated_rms_norm(o, z.reshape(T, n_v, dv), norm_w, eps)  # (T, n_v, dv)
        return y.reshape(T, n_v * dv)

    def gated_attention(self: Backend, qg, k, v, cache, q_norm, k_norm, positions, *, n_rot: int,
                        base: float, sections: tuple[int, ...] = (), scale: float, eps: float,
                        window: int = 0):
        """Gated attention of qwen35 between its projections and the output projection.

        qg (T, nh, 2, d): per head the query then the output gate (attn_q's interleaved rows); k (T, n_kv, d),
        v (T, n_kv, dv). q and k get their RMSNorm (weights (d,)) and partial NEOX (M-)RoPE, k and v are
        appended to `cache`, and the attention output is multiplied by sigmoid(gate). -> (T, nh dv)."""
        T, nh = qg.shape[0], qg.shape[1]
        q = self.rms_norm(qg[:, :, 0, :], q_norm, eps)
        gate = qg[:, :, 1, :]
        k = self.rms_norm(k, k_norm, eps)
        q = self.rope(q, positions, n_rot, base, sections=sections)
        k = self.rope(k, positions, n_rot, base, sections=sections)
        o = self.attention(q, k, v, cache, scale=scale, window=window)  # (T, nh, dv)
        o = self.mul(o, self.sigmoid(gate))
        return o.reshape(T, nh * o.shape[-1])


    # ---- one decode token of each of B sequences (engine/models/batch.py) --------
    def gdn_decode_batch(self: Backend, mixed, z, b, alpha, conv_states, ssm_states, conv_w, ssm_a, dt_bias,
                         norm_w, *, n_k: int, n_v: int, dk: int, dv: int, eps: float):
        """gdn_decode for one token of each of B sequences: row s of mixed (B, 2 n_k dk + n_v dv), z
        (B, n_v dv), b and alpha (B, n_v) belongs to the sequence whose states are conv_states[s] and
        ssm_states[s] (updated in place). Returns (B, n_v dv). Defined as gdn_decode row by row."""
        B = mixed.shape[0]
        if len(conv_states) != B or len(ssm_states) != B:
            raise ValueError(f"gdn_decode_batch: {B} rows need {B} conv and ssm states, got "
                             f"{len(conv_states)} and {len(ssm_states)}")
        out = self.zeros((B, n_v * dv))
        for s in range(B):
            out[s : s + 1] = self.gdn_decode(mixed[s : s + 1], z[s : s + 1], b[s : s + 1], alpha[s : s + 1],
                                             conv_states[s], ssm_states[s], conv_w, ssm_a, dt_bias, norm_w,
                                             n_k=n_k, n_v=n_v, dk=dk, dv=dv, eps=eps)
        return out

    def gated_attention_batch(self: Backend, qg, k, v, caches, q_norm, k_norm, positions, *, n_rot: int,
                              base: float, sections: tuple[int, ...] = (), scale: float, eps: float,
                              window: int = 0):
        """gated_attention for one token of each of B sequences: row s of qg (B, nh, 2, d), k (B, n_kv, d)
        and v (B, n_kv, dv) belongs to the sequence whose cache is caches[s] and whose position is
        positions[s] ((1,) or (3, 1)). Returns (B, nh dv). Defined as gated_attention row by row."""
        B, nh = qg.shape[0], qg.shape[1]
        if len(caches) != B or len(positions) != B:
            raise ValueError(f"gated_attention_batch: {B} rows need {B} caches and positions, got "
                             f"{len(caches)} and {len(positions)}")
        out = self.zeros((B, nh * v.shape[2]))
        for s in range(B):
            out[s : s + 1] = self.gated_attention(qg[s : s + 1], k[s : s + 1], v[s : s + 1], caches[s], q_norm,
                                                  k_norm, positions[s], n_rot=n_rot, base=base,
                                                  sections=sections, scale=scale, eps=eps, window=window)
        return out

    def moe_block(self: Backend, x, router, gate_exps, up_exps, down_exps, k: int,
                  shared: MoeShared | None = None, residual=None):
        """A whole MoE feed-forward (qwen35 section 3.6): the routed experts (`moe`), plus, with
        `shared`, sigmoid(x @ shared.gate_inp.T) * SwiGLU shared expert, plus `residual` when given.
        x (T, H) -> (T, H). Defined by compose_moe_block; a device backend runs it in a few kernels."""
        return compose_moe_block(self, x, router, gate_exps, up_exps, down_exps, k, shared, residual)


class DeviceHooks:
    """What the executor (engine/execution.py) asks of every backend beside the model's ops: host
    staging buffers, a worker thread's set-up, captured decode steps and simulated links. The defaults
    are a host backend's (nothing pinned, nothing to bind, no graphs, no link); a device backend
    overrides what it has. Both backends inherit this, so the executor calls these directly."""

    pins_host_memory = False  # pinned_empty returns page-locked memory (fast device <-> host copies)

    def pinned_empty(self, shape: tuple[int, ...], dtype: str = "float32") -> Any:
        """A host (numpy) array for staging copies; page-locked where `pins_host_memory`."""
        import numpy as np  # the host array type; the device array library stays in the subclass

        return np.empty(shape, dtype)

    def host_copy_rate(self) -> tuple[float, float] | None:
        """(bytes per second, seconds per copy) of copies from page-locked host memory to this device,
        measured on it; None where there is no link to measure (a host backend)."""
        return None

    def to_numpy_into(self, x: Array, out: Any) -> None:
        """Copy x into the host array `out` (the bridges' staging buffers)."""
        host = self.to_numpy(x)  # type: ignore[attr-defined]
        out[...] = host.reshape(out.shape)

    def bind_thread(self) -> None:
        """Make this backend's device current on the calling thread (a device worker's first act)."""

    def hold_weights(self, layout: str) -> None:
        """Hold the weights loaded from now on as the plan priced them (engine/placement.py
        WEIGHT_LAYOUTS: "stored", the file's blocks; "numpy", float32 copies). A device backend holds
        the file's blocks either way; the host backend overrides this."""

    def part_arena(self, tensors: Sequence[tuple[Any, str]]) -> contextlib.AbstractContextManager[None]:
        """A context inside which one part's weights (`tensors`: (tensor info, role) of every one it will
        load) are loaded. A device backend lays them out in one allocation of whole driver pages
        (CupyBackend.part_arena); here nothing: host arrays are not rounded to device pages."""
        return contextlib.nullcontext()

    def host_round_trip(self, x: Array, host_x: Any, host_y: Any, fn: Callable[[int], None], arg: int) -> Array:
        """x (float32 on this backend) -> the host array host_x; then fn(arg) on the host (it reads
        host_x and fills host_y); then host_y -> a new array on this backend. Ordered with the work
        queued before and after: on a CUDA device the copies and fn are queued on the current stream,
        so a captured decode graph holds the round trip and replays it with the same `arg`
        (engine/experts.py: routed experts in host RAM). Here (a host backend): copies and a call."""
        host_x[...] = self.to_numpy(x).reshape(host_x.shape)  # type: ignore[attr-defined]
        fn(arg)
        return self.asarray(host_y)  # type: ignore[attr-defined]

    def expert_call(self, x: Array, router: Weight, k: int, host_x: Any, host_y: Any, channel: ExpertChannel,
                    entry: int) -> Array:
        """Routed experts of the expert pool's entry `entry` (engine/expert_pool.py) for the tokens x
        (T, H) float32 on this backend, routed by `router` as `moe` routes them (k experts a token): the
        rows with their routing (`moe_route_rows`) -> the host array host_x (T, H + 2k), the pool runs
        the entry into host_y (T, H), host_y -> a new array here. On a CUDA device the routing and one
        kernel are queued on the current stream; the kernel writes the rows, posts the call into the
        pool's shared memory and waits there for the answer (a captured decode graph holds it); here the
        host posts it (`channel.post`) and waits."""
        rows = self.moe_route_rows(x, router, k)  # type: ignore[attr-defined]
        host_x[...] = self.to_numpy(rows).reshape(host_x.shape)  # type: ignore[attr-defined]
        channel.post(entry, host_x, host_y)
        return self.asarray(host_y)  # type: ignore[attr-defined]

    def alongside(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """Queue fn() (ops of this backend on arrays ready now) to run beside the work queued after
        this call, and return `join`: join() orders the work queued after it behind fn's and returns
        fn's result. A CUDA device runs fn on a second stream (in a captured graph: a branch of it),
        so e.g. a MoE block's shared expert runs while its routed experts make a round trip to the
        host (engine/experts.py). Here (a host backend): fn runs now."""
        out = fn()
        return lambda: out

    def graph_step(self, key, run, ids, positions, *, owner, watch=None, host_in=None, host_out=None,
                   after=None, wait: bool = True, link_seconds: tuple[float, float] = (0.0, 0.0),
                   chained: bool = False, pick: PickSpec | None = None) -> Any:
        """Run `run` for one decode token as a captured graph (see CupyBackend.graph_step); None =
        this backend has no graphs: the caller runs the step eagerly."""
        return None

    def prepare_lm_head(self, weight: Weight) -> None:
        """Decode a lazily decoded LM-head table now (at load time) rather than in the first token."""

    def prepare_kernels(self, gdn: bool) -> None:
        """Compile (or load from a disk cache) the host kernels this backend decodes with now (at load
        time) rather than in the first token; gdn: the model has Gated DeltaNet layers."""


@runtime_checkable
class Backend(Protocol):
    name: str  # "numpy", "cupy"
    device: str  # "cpu:0", "cuda:1", ...

    # ---- data movement -------------------------------------------------------------------------
    def asarray(self, host_array) -> Array:
        """Copy a host (numpy) array to this backend; float arrays become float32."""

    def to_numpy(self, x: Array):
        """Copy to a host numpy array (synchronizes)."""

    def zeros(self, shape: tuple[int, ...], dtype: str = "float32") -> Array: ...

    def load_weight(self, info, *, role: str = "matmul") -> Weight:
        """Prepare a GGUF tensor (engine.gguf_file.TensorInfo) for use on this backend.

        role: "matmul" (x @ W.T), "embedding" (row lookup, may also be the tied LM head), "vector"
        (norm weights, biases, small F32 tensors: returned as a float32 Array of the logical shape),
        "experts" (3-D expert stack (E, n_out, n_in)).
        """

    def free(self, obj: Any) -> None:
        """Release device memory held by a weight or state (no-op on the CPU)."""

    # ---- elementwise and norms -----------------------------------------------------------------
    def add(self, a: Array, b: Array) -> Array: ...

    def mul(self, a: Array, b: Array) -> Array: ...

    def scale(self, x: Array, s: float) -> Array: ...

    def sigmoid(self, x: Array) -> Array: ...

    def silu(self, x: Array) -> Array: ...

    def swiglu(self, gate: Array, up: Array) -> Array:
        """silu(gate) * up."""

    def geglu(self, gate: Array, up: Array) -> Array:
        """gelu_tanh(gate) * up (Gemma)."""

    def rms_norm(self, x: Array, w: Array | None, eps: float) -> Array:
        """x / sqrt(mean(x^2, last axis) + eps) * w (w broadcast over the last axis; None = no weight)."""

    def add_rms_norm(self, x: Array, delta: Array, w: Array, eps: float) -> tuple[Array, Array]:
        """Fused residual: s = x + delta; returns (s, rms_norm(s, w, eps))."""

    def l2_norm(self, x: Array, eps: float) -> Array:
        """x / sqrt(sum(x^2, last axis) + eps)."""

    def gated_rms_norm(self, x: Array, z: Array, w: Array, eps: float) -> Array:
        """rms_norm(x, w, eps) * silu(z), per head over the last axis (Gated DeltaNet output)."""

    # ---- matmuls and lookups -------------------------------------------------------------------
    def embed(self, table: Weight, ids) -> Array:
        """Rows of an embedding table (any quant type) for integer ids (host sequence) -> (T, H)."""

    def matmul(self, x: Array, w: Weight) -> Array:
        """(T, n_in) @ W.T -> (T, n_out), W quantized as stored; fp32 accumulation."""

    # ---- positions and attention ---------------------------------------------------------------
    def rope(self, x: Array, positions, n_rot: int, base: float, *, sections: tuple[int, ...] = (),
             scale: float = 1.0) -> Array:
        """NEOX (half-split) rotary embedding on the first n_rot dims of each head.

        x (T, nh, d); positions: host int array (T,) for text, or (3, T) for M-RoPE (t, h, w) with
        `sections` pairs per component (interleaved rule, docs/qwen35.md 3.3.1).
        Position p is divided by `scale` (linear scaling). Dims >= n_rot pass through.
        """

    def new_kv_cache(self, n_kv_heads: int, head_dim: int, value_dim: int, capacity: int,
                     kv_type: str = "f32") -> KVCache:
        """kv_type: "f32" (exact), or "q3" (3-bit, engine/kvquant.py; NumPy and CUDA backends). A
        backend without a type raises RequestError."""

    def attention(self, q: Array, k: Array, v: Array, cache: Any, *, scale: float,
                  window: int = 0) -> Array:
        """Append k, v (T, n_kv, d) to `cache`, then causal GQA attention of q (T, nh, d) over the
        whole cache. Query head h uses KV head h // (nh // n_kv). window > 0 restricts each query at
        position p to keys at positions > p - window (sliding window). Softmax in fp32.
        Returns (T, nh, dv)."""

    # ---- vision tower (engine/vision/encoder.py) -------------------------------------------------
    def layer_norm(self, x: Array, w: Array, b: Array, eps: float) -> Array:
        """(x - mean) / sqrt(var + eps) * w + b over the last axis (biased variance, as torch)."""

    def gelu(self, x: Array, *, exact: bool = False) -> Array:
        """GELU. exact=False: tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        (gelu_pytorch_tanh, the ViT MLP); exact=True: 0.5 x (1 + erf(x / sqrt(2))) (the merger)."""

    def vision_rope(self, x: Array, positions, base: float) -> Array:
        """2-D (axial) rotary embedding of a ViT, docs/qwen35-vision.md 4.4. x (T, nh, d), positions a host
        int array (2, T) of (row, col) patch coordinates. With q4 = d/4 frequencies
        inv_freq_i = base^(-4i/d), pair j of (j, j + d/2) for j < d/2 rotates by
        row * inv_freq_j (j < q4) or col * inv_freq_(j-q4) (j >= q4), NEOX half-split over the whole head."""

    def attention_full(self, q: Array, k: Array, v: Array, *, scale: float) -> Array:
        """Bidirectional (unmasked) attention without a cache: q, k, v (T, nh, d) with the same head
        count; softmax(q k^T * scale) v per head in fp32 -> (T, nh, d). One image's patches."""

    # ---- Gated DeltaNet ------------------------------------------------------------------------
    def conv1d_silu(self, x: Array, state: Array, w: Array, cuts: tuple[int, ...] = ()) -> list[Array]:
        """Causal depthwise conv + SiLU. x (T, C) new inputs; state (K-1, C) previous raw inputs,
        updated in place to the last K-1 raw inputs; w (C, K) with w[:, K-1] on the current token.
        Returns the output (T, C) cut at the increasing column bounds `cuts` (0 < cut < C): [out[:, :c1],
        out[:, c1:c2], ...] (one piece without cuts), each piece contiguous on the CUDA backend (the
        Gated DeltaNet's q, k and v, which the kernels after it read as whole rows)."""

    def gdn_gates(self, alpha: Array, beta: Array, ssm_a: Array, dt_bias: Array) -> tuple[Array, Array]:
        """g = ssm_a * softplus(alpha + dt_bias) (log decay, <= 0), b = sigmoid(beta); (T, n_v) each."""

    def gdn_chunk(self, q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array,
                  chunk: int = 64) -> Array:
        """Chunked delta rule over T tokens. q, k (T, n_k, dk) normalized (q scaled); v (T, n_v, dv);
        g, beta (T, n_v); value head j uses key head j % n_k. state (n_v, dk, dv) fp32, updated in
        place. Returns o (T, n_v, dv)."""

    def gdn_step(self, q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array) -> Array:
        """The same for T == 1 by the recurrence (also valid token by token for any T)."""

    # ---- mixture of experts ----------------------------------------------------------------------
    def moe(self, x: Array, router: Weight, gate_exps: Weight, up_exps: Weight | None,
            down_exps: Weight, k: int) -> Array:
        """Routed SwiGLU experts: softmax over router logits (fp32), top-k, renormalize, weighted sum
        of the selected experts' SwiGLU outputs. x (T, H) -> (T, H).

        router (E, H); gate_exps, up_exps (E, Fe, H); down_exps (E, H, Fe). up_exps None means
        gate_exps is the fused gate_up tensor (E, 2*Fe, H): rows [0, Fe) gate, [Fe, 2*Fe) up.
        Ties in the top-k go to the lower expert index. The shared expert is not part of this op."""

    def moe_route_rows(self, x: Array, router: Weight, k: int) -> Array:
        """x (T, H) -> (T, H + 2k) float32: each row of x followed by its routing as `moe` chooses it:
        the k expert ids (exact float32 values), then their renormalized weights. What a layer sends
        to the host when its routed experts run there (engine/experts.py): one copy, no routing on
        the host."""

    # ---- sampling helpers --------------------------------------------------------------------------
    def top_k(self, logits: Array, k: int) -> TopLogits:
        """The k largest logits of each row (T, vocab), picked on the device -> host TopLogits (T, k):
        descending, equal values in ascending id order (engine/sampling.py top_logits), with a `fetch`
        of the whole rows from where they are. Inside a captured decode step the host arrays are the
        graph's outputs."""

    def synchronize(self) -> None: ...

    # ---- fused ops (FusedOpsMixin composes them from the ops above; a fast backend overrides them) ----
    def matmul_many(self, x: Array, ws: list) -> list: ...

    def load_fused(self, infos: list) -> list: ...

    def matmul_add(self, x: Array, w: Weight, residual: Array) -> Array: ...

    def matmul_swiglu(self, x: Array, gate: Weight, up: Weight) -> Array: ...

    def gdn_decode(self, mixed: Array, z: Array, b: Array, alpha: Array, conv_state: Array,
                   ssm_state: Array, conv_w: Array, ssm_a: Array, dt_bias: Array, norm_w: Array, *,
                   n_k: int, n_v: int, dk: int, dv: int, eps: float) -> Array: ...

    def gated_attention(self, qg: Array, k: Array, v: Array, cache: Any, q_norm: Array, k_norm: Array,
                        positions: Any, *, n_rot: int, base: float, sections: tuple[int, ...] = (),
                        scale: float, eps: float, window: int = 0) -> Array: ...

    def gdn_decode_batch(self, mixed: Array, z: Array, b: Array, alpha: Array, conv_states: Sequence[Array],
                         ssm_states: Sequence[Array], conv_w: Array, ssm_a: Array, dt_bias: Array,
                         norm_w: Array, *, n_k: int, n_v: int, dk: int, dv: int,
                         eps: float) -> Array: ...

    def gated_attention_batch(self, qg: Array, k: Array, v: Array, caches: Sequence[Any], q_norm: Array,
                              k_norm: Array, positions: Sequence[Any], *, n_rot: int, base: float,
                              sections: tuple[int, ...] = (), scale: float, eps: float,
                              window: int = 0) -> Array: ...

    def moe_block(self, x: Array, router: Weight, gate_exps: Weight, up_exps: Weight | None, down_exps: Weight,
                  k: int, shared: MoeShared | None = None,
                  residual: Array | None = None) -> Array: ...

    # ---- execution hooks (DeviceHooks gives every backend these) ----------------------------------
    pins_host_memory: bool

    def pinned_empty(self, shape: tuple[int, ...], dtype: str = "float32") -> Any: ...

    def to_numpy_into(self, x: Array, out: Any) -> None: ...

    def bind_thread(self) -> None: ...

    def hold_weights(self, layout: str) -> None: ...

    def part_arena(self, tensors: Sequence[tuple[Any, str]]) -> contextlib.AbstractContextManager[None]: ...

    def host_round_trip(self, x: Array, host_x: Any, host_y: Any, fn: Callable[[int], None], arg: int) -> Array: ...

    def expert_call(self, x: Array, router: Weight, k: int, host_x: Any, host_y: Any, channel: ExpertChannel,
                    entry: int) -> Array: ...

    def alongside(self, fn: Callable[[], Any]) -> Callable[[], Any]: ...

    def graph_step(self, key, run, ids, positions, *, owner, watch=None, host_in=None, host_out=None,
                   after=None, wait: bool = True, link_seconds: tuple[float, float] = (0.0, 0.0),
                   chained: bool = False, pick: PickSpec | None = None) -> Any: ...

    def prepare_lm_head(self, weight: Weight) -> None: ...

    def prepare_kernels(self, gdn: bool) -> None: ...
