"""CupyBackend: the Backend protocol (backends/base.py) on one NVIDIA GPU, through minecart.kernels.

Same signatures and semantics as numpy_backend.NumpyBackend (the specification); every op launches
hand-written CUDA kernels (DP4A int8, fp32 FMA, fp16 HFMA2; never tensor cores) on this device's current stream and
returns without synchronizing. Only `to_numpy`, `top_k` (its result goes to the host) and
`synchronize` wait for the GPU, so a decode step has no host sync per layer. A single-token decode
step of each stage is captured once into a CUDA graph and replayed for every later token
(`graph_step`, called by engine/execution.py), so decoding pays one launch per token instead of one
per kernel.

Weights go to the device still quantized, laid out once at upload for the kernels (kernels/ops.py
upload_weight: Q8_0/Q4_0/Q5_0/IQ4_NL with their fp16 scales split off, the K-quants repacked by
kernels/kquant_layout.py, Q4_1/Q5_1/IQ4_XS as their blocks, F32/F16/BF16 as rows); a format or row
length without a kernel (ops.kept_type) is decoded to F32 once.
Matmuls take the DP4A, fp32 FMA or fp16 HFMA2 path according to the per-card probe (kernels/probe.py, cached
per GPU UUID by engine/probe_cache.py); MINECART_MATMUL_PATH=dp4a|dp4a2|fma|hfma2 overrides it.

The Gated DeltaNet prefill takes the chunked WY kernels (kernels/gdn_chunk.py) from 256 tokens on and
the exact recurrence below that; KV caches are fp32, f16 or q8_0 (`CupyTypedKVCache`: the attention
kernels read the stored values) or 3-bit (`CupyQ3KVCache`).

Not here: mixture-of-experts GEMVs have no HFMA2 kernel (the FMA kernel serves that path).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import cupy as cp
import numpy as np
from minecart.kernels import expert_call as expert_call_kernel
from minecart.kernels import fused, gdn_chunk, host_func, kvcache, kvq3, layout, link, ops
from minecart.kernels import moe as moe_kernels
from minecart.kernels.build import kernel_build_tag
from minecart.kernels.kquant_layout import KQUANT_TYPES

from ..sampling import GREEDY_PICK, LaunchedStep, PenaltyHistory, PickSpec, TopLogits
from .base import DeviceHooks, FusedOpsMixin, GrowingKVCache, arena_aligned, whole_pages
from .graph_watch import StateReader, WatchedPointers


def device_count() -> int:
    try:
        return int(cp.cuda.runtime.getDeviceCount())
    except cp.cuda.runtime.CUDARuntimeError:
        return 0


def gpu_uuid(index: int) -> str:
    """The NVML-style UUID ("GPU-xxxxxxxx-xxxx-...") of CUDA device `index`."""
    raw = cp.cuda.runtime.getDeviceProperties(index).get("uuid", b"")
    if isinstance(raw, str):
        raw = raw.encode("latin-1")
    h = bytes(raw).hex()
    if len(h) != 32:
        return f"cuda-{index}"
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class WeightGroup:
    """Matmul weights that the model multiplies one input by (an ArchSpec fused group), laid out at
    load as one QWeight `q` (CupyBackend.load_fused): member i is rows ranges[i] of it, and that
    member's own QWeight holds row views of q's arrays, so nothing is stored twice. q is None once a
    member has been freed (the others keep working on their views; matmul_many then runs them apart)."""

    def __init__(self, q: ops.QWeight, ranges: list[tuple[int, int]]):
        self.q: ops.QWeight | None = q
        self.ranges = ranges


def _type_runs(infos: list) -> list[list]:
    """infos cut into runs of neighbours of one GGML type, in order."""
    runs: list[list] = []
    for info in infos:
        if runs and runs[-1][-1].type_name == info.type_name:
            runs[-1].append(info)
        else:
            runs.append([info])
    return runs


def _logical_shape(info, role: str) -> tuple[int, ...]:
    """The shape CupyBackend.load_weight keeps a tensor in: a 1-D matmul weight as one row."""
    shape = tuple(int(s) for s in info.shape)
    return (1, shape[0]) if role == "matmul" and len(shape) == 1 else shape


def held_array_bytes(info, role: str) -> tuple[int, ...]:
    """Bytes of each device array CupyBackend.load_weight makes for a tensor (a vector: float32 of its
    shape; a matrix: kernels/layout.py array_bytes of the type it is kept in, ops.kept_type), known
    before the upload: what a part's weight arena is sized from."""
    logical = _logical_shape(info, role)
    if role == "vector":
        return (4 * int(np.prod(logical, dtype=np.int64)),)
    K = logical[-1]
    rows = int(np.prod(logical[:-1], dtype=np.int64))
    kept = ops.kept_type(info.type_name, K)
    row_bytes = int(info.n_bytes) // rows if kept == info.type_name else 4 * K
    wq, wd = layout.array_bytes(kept, rows, K, row_bytes)
    return (wq, wd) if wd else (wq,)


class WeightArena:
    """One device allocation holding the arrays of one part's weights (CupyBackend.part_arena): whole
    2 MiB pages (base.py DRIVER_PAGE) from CuPy's pool, each array a view at a base.py ARENA_ALIGN offset made
    with ndarray(memptr=...) (its `.data.mem` is the arena's `base.mem`, its `.base` None, so each array
    counts only its own bytes). The CUDA driver rounds every allocation above 1 MiB up to whole 2 MiB
    pages; arrays allocated apart lose up to 2 MiB each (27B: ~541 MiB over its devices), an arena
    less than one page per part (placement.py `_arena_padding`).

    Only the views keep the allocation: the backend drops the arena once the part is loaded, so the
    memory goes back to the pool when the part's last weight is freed (CupyBackend.free, or its
    vectors dropped). `empty` past the size planned up front (a layout held_array_bytes did not
    foresee) makes an allocation of its own, so a wrong size costs rounding, never correctness."""

    def __init__(self, nbytes: int):
        self.size = whole_pages(nbytes)
        self.base = cp.cuda.alloc(self.size) if self.size else None  # a MemoryPointer (pool memory)
        self.used = 0

    def empty(self, shape, dtype):
        """An uninitialized array of `shape` and `dtype` at the arena's next aligned offset."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if self.base is None or self.used + n > self.size:
            return cp.empty(shape, dtype)
        out = cp.ndarray(shape, dtype, memptr=self.base + self.used)
        self.used += arena_aligned(n)
        return out


class CupyWeight:
    """A weight on the GPU. `.shape` is the logical shape, `.type_name` the GGML type as stored here.
    `group` / `index`: the WeightGroup this weight is member `index` of (None: loaded on its own)."""

    def __init__(self, name: str, shape: tuple[int, ...], type_name: str, q: ops.QWeight, role: str):
        self.name = name
        self.shape = shape
        self.type_name = type_name
        self.q = q
        self.role = role
        self.group: WeightGroup | None = None
        self.index = 0

    @property
    def nbytes(self) -> int:
        return self.q.nbytes


class CupyKVCache(GrowingKVCache):
    """K and V of one attention layer: fp32 (capacity, n_kv, d) device arrays, first `length` valid.

    fp32 (not fp16) so that results match the fp32 references to ~1e-5; appending past `capacity`
    doubles the arrays (growth, truncate, clone: base.GrowingKVCache)."""

    k: Any  # cupy (capacity, n_kv, d) float32, allocated by GrowingKVCache from _layout
    v: Any  # (capacity, n_kv, dv)

    def _layout(self):
        return {"k": ((self.n_kv_heads, self.head_dim), cp.float32),
                "v": ((self.n_kv_heads, self.value_dim), cp.float32)}

    @staticmethod
    def _zeros(shape, dtype):
        return cp.zeros(shape, dtype)

    def _write(self, k, v, start: int) -> None:
        self.k[start : start + k.shape[0]] = k
        self.v[start : start + k.shape[0]] = v


class CupyTypedKVCache(CupyKVCache):
    """K and V stored as f16 or q8_0 (kernels/kvcache.py layouts: float16 values, or ggml Q8_0 blocks as
    uint8), appended by kernels that round / quantize on the device. Attention reads the stored values
    directly (ops.attention(kv_type=...): dequantized in registers, fp32 accumulation; no fp32 copy).
    A subclass of CupyKVCache for the shared book-keeping (free, graph pointers), but never on the
    fused fp32 decode path (gated_attention checks the exact type)."""

    kv_type = ""

    def _layout(self):
        return {"k": kvcache.row_shape(self.n_kv_heads, self.head_dim, self.kv_type),
                "v": kvcache.row_shape(self.n_kv_heads, self.value_dim, self.kv_type)}

    def _write(self, k, v, start: int) -> None:
        kvcache.append(k, v, self.k, self.v, self.kv_type, start)


class CupyF16KVCache(CupyTypedKVCache):
    kv_type = "f16"


class CupyQ8KVCache(CupyTypedKVCache):
    kv_type = "q8_0"


class CupyQ3KVCache(GrowingKVCache):
    """K and V of one attention layer in the q3 format of engine/kvquant.py, on the device: K codes
    (capacity, n_kv, 3d/8) and V codes (capacity, n_kv, 2dv/8) uint8, fp16 scales (capacity, n_kv,
    d/64) each, first `length` valid.

    Rows are quantized on the device as they are appended (kernels/kvq3.py); attention reads the codes
    directly (kvq3.attention: tiles dequantized in shared memory, fp32 accumulation; no fp32 copy of
    the cache). Keys are stored centred on `k_ref` (n_kv, d) float32, the mean of the first append's
    keys (engine/kvquant.py Q3KVCache: float64 mean, fixed for the cache's life). `k` / `v` are the
    code arrays (None once freed), the names the decode-graph checks read."""

    kv_type = "q3"

    k_codes: Any  # cupy arrays, allocated by GrowingKVCache from _layout
    k_scales: Any
    v_codes: Any
    v_scales: Any

    def _layout(self):
        n, d, dv = self.n_kv_heads, self.head_dim, self.value_dim
        kb, vb, blk = kvq3.K_BITS, kvq3.V_BITS, kvq3.BLOCK
        return {"k_codes": ((n, kb * d // 8), cp.uint8), "k_scales": ((n, d // blk), cp.float16),
                "v_codes": ((n, vb * dv // 8), cp.uint8), "v_scales": ((n, dv // blk), cp.float16)}

    @staticmethod
    def _zeros(shape, dtype):
        return cp.zeros(shape, dtype)

    k_ref: Any = None  # set by the first append

    def _write(self, k, v, start: int) -> None:
        k = _f32(k)
        if self.k_ref is None:
            self.k_ref = cp.ascontiguousarray(cp.mean(k, axis=0, dtype=cp.float64).astype(cp.float32))
        kvq3.quantize_append(k, self.k_codes, self.k_scales, start, ref=self.k_ref)
        kvq3.quantize_append(v, self.v_codes, self.v_scales, start)

    def clone(self):
        twin = super().clone()
        assert isinstance(twin, CupyQ3KVCache)
        twin.k_ref = None if self.k_ref is None else self.k_ref.copy()
        return twin

    @property
    def k(self):
        return self.k_codes

    @property
    def v(self):
        return self.v_codes


def _fused_kv_type(cache) -> str:
    """The type in which the fused decode kernels read and write `cache` in place ("f32", "f16" or
    "q8_0": attn_prep stores the row in that type), "" for a q3 cache (composed ops: quantize on
    append, kvq3 attention)."""
    if type(cache) is CupyKVCache:
        return "f32"
    return cache.kv_type if isinstance(cache, CupyTypedKVCache) else ""


class _CacheFull(RuntimeError):
    """A cache must grow during this step: run it eagerly (a graph cannot reallocate)."""


def _cache_full(exc: BaseException) -> bool:
    """Whether a failed capture failed because a cache must grow (that step only runs eagerly)."""
    return isinstance(exc, _CacheFull) or isinstance(exc.__context__, _CacheFull)


_SLOTS = 1024  # int32 inputs of a captured decode step: [token, pos t, pos h, pos w, cache lengths...]
_PICK_SLOT = _SLOTS - 16  # ... and in the last 16, the step's PickSpec as 8 float64 (8-byte aligned)


def _sleep_event():
    """An event made with blocking sync: waiting for it, the thread sleeps until the GPU signals (a few
    microseconds more latency than a spinning stream.synchronize())."""
    return cp.cuda.Event(block=True, disable_timing=True)


def _wait_stream(stream, sleeper=None) -> None:
    """stream.synchronize(), or, given a _sleep_event, the same wait through it."""
    if sleeper is None:
        stream.synchronize()
        return
    sleeper.record(stream)
    sleeper.synchronize()


class _Feed:
    """The token input of one sequence's decode graphs that embed their token (a device int32 (1,)): a
    launch with a token from the host copies it here first, and a step that leaves top logits draws its
    pick here at its end (ops.pick_top, with the PickSpec of its launch), so that the pick is the input
    of a next step launched chained (graph_step chained=True) before the host has seen it. fresh: this
    sequence's last step was such a launch with a PickSpec (arr holds its pick); parity: which of the
    sequence's two graphs of a key a chained launch takes, so that it never rewrites the pinned buffers
    of the one still running.

    table: the sequence's penalty table (engine/sampling.py PenaltyHistory; kernels/sampling.cu
    penalize) for steps launched with a penalized PickSpec, None before the first; table_of: the history
    it was built from, counted: how many of its generated tokens are in it (each penalized launch counts
    the token it embeds)."""

    def __init__(self):
        self.arr = cp.zeros(1, dtype=cp.int32)
        self.fresh = False
        self.parity = 0
        self.table: Any = None
        self.table_of: PenaltyHistory | None = None
        self.counted = 0

    def table_follows(self, history: PenaltyHistory) -> bool:
        """Whether a chained launch (its token the device's pick of the step before, not on the host yet)
        finds the table in step: built from `history` and holding all its generated tokens."""
        return self.table_of is history and self.counted == len(history.generated)

    def sync_table(self, history: PenaltyHistory, token: int) -> None:
        """Make the table hold the prompt and the generated tokens before `token`, the last one, which
        this launch embeds and counts itself (rebuilt from the lists when it is not in step)."""
        gen = history.generated
        if not gen or int(gen[-1]) != token:
            raise ValueError(f"a penalized pick's history must end with the token its step embeds ({token})")
        if self.table is None or self.table.shape != (history.vocab,):
            self.table, self.table_of = cp.zeros(history.vocab, dtype=cp.int32), None
        if self.table_of is not history or self.counted != len(gen) - 1:
            keys, vals = history.table(len(gen) - 1)
            self.table.fill(0)
            if keys.size:
                self.table[cp.asarray(keys)] = cp.asarray(vals)
            self.table_of, self.counted = history, len(gen) - 1


class _Capture:
    """Book-keeping while a decode step is captured: the pinned input buffer and its device copy,
    the caches the step appends to, and the host buffers the step's outputs are copied into."""

    def __init__(self, stream):
        import cupyx

        self.stream = stream
        self.host = cupyx.empty_pinned((_SLOTS,), dtype=np.int32)
        self.host[:] = 0
        self.dev = cp.zeros(_SLOTS, dtype=cp.int32)
        self.caches: list[tuple[Any, int]] = []  # CupyKVCache or CupyQ3KVCache (both have .k)
        self.outputs: list[np.ndarray] = []
        self.result: np.ndarray | TopLogits | None = None  # what the captured step returned: its host outputs
        self._out_dev: list = []
        # a _sleep_event when the step holds host functions (CupyBackend.host_round_trip), else None
        self.sleeper: Any = None
        self.feed: _Feed | None = None  # where the step reads its token and leaves its pick (if it embeds)
        self.picking = False  # this launch came with a PickSpec (its pick is the one it was asked for)
        self.penalizing = False  # ... with penalties, which the step applies from the feed's table

    def wait(self) -> None:
        """Wait for the work queued on the capture's stream (a launch of its graph). A graph with host
        functions is waited for through its sleeper: this thread sleeps instead of spinning on a core
        the host functions' CPU threads need (35B-A3B with 16 expert threads on 16 cores: 1.17 tok/s
        with the spinning wait, 20.3 with this one; docs/moe-cpu.md)."""
        _wait_stream(self.stream, self.sleeper)

    def write_inputs(self, token: int, pos: np.ndarray, pick: PickSpec | None = None) -> None:
        self.host[0] = token
        self.host[1:4] = pos if pos.size == 3 else np.repeat(pos, 3)
        self.host[_PICK_SLOT:].view(np.float64)[:] = (GREEDY_PICK if pick is None else pick).as_array()
        self.picking = pick is not None
        self.penalizing = pick is not None and pick.history is not None and self.feed is not None

    def pick_params(self):
        """The device copy of the launch's PickSpec: float64 (1, 8) (ops.pick_top's prm)."""
        return self.dev[_PICK_SLOT:].view(cp.float64).reshape(1, ops.PICK_PRM)

    def penalty_params(self):
        """The device copy of the launch's penalties: float64 (3,) (ops.penalize's prm)."""
        return self.dev[_PICK_SLOT:].view(cp.float64)[5:8]

    def copy_inputs(self) -> None:
        cp.cuda.runtime.memcpyAsync(self.dev.data.ptr, self.host.ctypes.data, _SLOTS * 4,
                                    cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)

    def ids_dev(self, ids):
        if len(ids) != 1:
            raise RuntimeError("a captured decode step embeds exactly one token")
        return self.dev[0:1] if self.feed is None else self.feed.arr[0:1]

    def launch(self, graph, chained: bool = False) -> None:
        """Launch the step's graph on this capture's stream. With a feed, the host's token (slot 0 of
        the pinned inputs) is copied there first, unless the step is chained (its token is there
        already); after it the feed holds this step's pick when the step leaves top logits."""
        if self.feed is not None and not chained:
            cp.cuda.runtime.memcpyAsync(self.feed.arr.data.ptr, self.host.ctypes.data, 4,
                                        cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
        graph.launch(self.stream)
        if self.feed is not None:
            self.feed.fresh = self.picking and isinstance(self.result, TopLogits)  # its pick_top ran
            if self.penalizing:
                self.feed.counted += 1  # its penalize counted the token it embeds

    def positions_dev(self, pos):
        return self.dev[1:4].reshape(3, 1)

    def cache_row(self, cache: GrowingKVCache):
        if cache.length + 1 > cache.capacity:
            raise _CacheFull("KV cache full: this step grows it eagerly; the next one re-captures")
        i = len(self.caches)
        if 4 + i >= _PICK_SLOT:
            raise RuntimeError("too many attention layers for one captured step")
        self.caches.append((cache, cache.length))
        self.host[4 + i] = cache.length
        return self.dev[4 + i : 5 + i]

    def receive(self, host_in: np.ndarray, link_seconds: float = 0.0):
        """A device array the graph refills from the pinned float32 host array `host_in` on every
        replay (a split model's hidden state, left there by the stage on the previous device), after
        holding the stream for `link_seconds` (a simulated riser's time for that copy: engine/rig.py)."""
        if link_seconds > 0:
            link.hold(self.stream, link_seconds)
        x = cp.empty(host_in.shape, dtype=cp.float32)
        cp.cuda.runtime.memcpyAsync(x.data.ptr, host_in.ctypes.data, x.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
        return x

    def send(self, x, host_out: np.ndarray, link_seconds: float = 0.0) -> None:
        """Copy the device array x into the pinned float32 host array `host_out` on every replay
        (where the stage on the next device picks the hidden state up), then hold the stream for
        `link_seconds` (a simulated riser's time for that copy: engine/rig.py)."""
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        if x.nbytes != host_out.nbytes or host_out.dtype != np.float32:
            raise ValueError(f"stage output {x.shape} does not fit the host buffer {host_out.shape}")
        cp.cuda.runtime.memcpyAsync(host_out.ctypes.data, x.data.ptr, x.nbytes,
                                    cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        self._out_dev.append(x)
        if link_seconds > 0:
            link.hold(self.stream, link_seconds)

    def output(self, x):
        import cupyx

        x = cp.ascontiguousarray(x)
        host = cupyx.empty_pinned(x.shape, dtype=x.dtype)
        cp.cuda.runtime.memcpyAsync(host.ctypes.data, x.data.ptr, x.nbytes,
                                    cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        self._out_dev.append(x)
        self.outputs.append(host)
        return host


# What a replayed decode graph checks before each launch (graph_watch.py): the cupy arrays reachable from
# the states it baked in. An fp32/f16/q8_0 cache is read as its k and v (its other fields are sizes); a
# q3 cache, like any other object, field by field.
_GRAPH_STATES = StateReader(cp.ndarray, {CupyKVCache: ("k", "v")})


def _host_ptr(a) -> int:
    return 0 if a is None else int(a.ctypes.data)


class _DecodeGraph:
    """A captured decode step (the whole model, or one stage of a split model) and what it needs to
    be replayed for the next token.

    owner: the sequence's states list (identity); watch: the states the step touches (their device
    addresses are baked in); io: the pinned host buffers it reads its input from / writes its output
    to (None: token ids in, host logits out)."""

    def __init__(self, graph, cap: _Capture, kept: list, owner, watch, io=(None, None),
                 link_seconds: tuple[float, float] = (0.0, 0.0)):
        self.graph = graph
        self.cap = cap
        self.kept = kept
        self.done = cp.cuda.Event(disable_timing=True)  # recorded after a replay that does not wait
        self.states = owner
        self.io = tuple(_host_ptr(a) for a in io)
        self.sends = io[1] is not None
        self.link_seconds = link_seconds  # the simulated link holds captured around its copies
        self.watched = _GRAPH_STATES.watch(watch)  # every device address of the states, compiled
        self.launches = 0  # replays, and the launch after the capture: what guarded() checks

    def valid(self, owner, watch, io=(None, None), link_seconds: tuple[float, float] = (0.0, 0.0)) -> bool:
        if owner is not self.states or tuple(_host_ptr(a) for a in io) != self.io:
            return False
        if link_seconds != self.link_seconds:
            return False
        for c, _ in self.cap.caches:
            if c.k is None or c.length + 1 > c.capacity:
                return False
        return self.watched.unchanged(watch)

    def result(self):
        """After a launch: True when the output went to the host buffer, else a copy of what the step
        returns (logits, or the top logits)."""
        return True if self.sends else _host_copy(self.cap.result, self)

    def finish(self):
        """The wait and the result of a launch that did not wait (replay with wait=False): for this
        launch's end only (`done`, recorded after it), not for a chained step launched behind it on the
        same stream; a graph with host functions is waited for through its sleeper (cap.wait)."""
        if self.cap.sleeper is None:
            self.done.synchronize()
        else:
            self.cap.wait()
        return self.result()

    def guarded(self, fetch):
        """fetch (TopLogits.fetch of this graph's rows), refusing once the graph has run again."""
        stamp = self.launches

        def read(r: int):
            if self.launches != stamp:
                raise RuntimeError("a later step overwrote these rows")
            return fetch(r)

        return read

    def replay(self, token: int, pos: np.ndarray, after=None, wait: bool = True, chained: bool = False,
               pick: PickSpec | None = None):
        """Launch for the next token. after: an event the graph must follow (the previous stage of a
        split, still running); wait=False: return the event recorded after the launch instead of
        waiting (the inputs stay in the pinned buffer until the caller's final wait). chained: the
        token is the previous step's pick, already in the feed on the device (`token` unused). pick:
        how this step draws its own pick into the feed (graph_step)."""
        cap = self.cap
        cap.write_inputs(token, pos, pick)
        for i, (c, _) in enumerate(cap.caches):
            cap.host[4 + i] = c.length
        if after is not None:
            cap.stream.wait_event(after)
        self.launches += 1
        cap.launch(self.graph, chained)
        for c, _ in cap.caches:
            c.length += 1
        if not wait:
            self.done.record(cap.stream)
            return self.done
        cap.wait()
        return self.result()


# ---- [batched decode graphs] a decode step of B sequences as one graph (engine/execution.py forward_batch)
_BATCH_SLOTS = 8192  # int32 inputs of a captured batch step: 7 B token/position slots, then cache lengths
_BATCH_TABLE_SLOTS = 8192  # pointer-table entries in one block a batch graph (2 x 32 layers x 32 sequences: 2,048)
BATCH_GRAPHS_KEPT = 4  # batch graphs kept (the most recently used); each holds its step's activations


def _pos3(p) -> np.ndarray:
    """One sequence's decode position as (t, h, w): a (1,) text position, or a (3, 1) M-RoPE column."""
    a = np.asarray(p, dtype=np.int64).reshape(-1)
    if a.size == 1:
        return np.repeat(a, 3)
    if a.size == 3:
        return a
    raise ValueError(f"a decode position must be (1,) or (3, 1), got {np.shape(p)}")


class _BatchCapture(_Capture):
    """The inputs of a captured decode step of n sequences, one token each. Slots: [0, n) the tokens;
    [n, 4n) every row's (t, h, w) position as (3, n) (what a layer's rope over the stacked rows reads);
    [4n, 7n) each sequence's own (t, h, w) (what a per-sequence mixer's rope reads, contiguous (3, 1));
    then one KV length per cache the step appends to. A position array handed to the backend during the
    capture is told apart by identity (one of the sequences' own arrays, bound by `bind`) or else by
    width (n columns: the stacked rows)."""

    def __init__(self, stream, n: int):
        import cupyx

        self.stream = stream
        self.n = n
        self.host = cupyx.empty_pinned((_BATCH_SLOTS,), dtype=np.int32)
        self.host[:] = 0
        self.dev = cp.zeros(_BATCH_SLOTS, dtype=cp.int32)
        self.caches = []
        self.outputs = []
        self.result = None
        self._out_dev = []
        self.sleeper = None
        self.cache_base = 7 * n
        self._seq_of: dict[int, int] = {}
        self.feed = None  # a batch step's tokens come from the host
        self.picking = False
        # the pointer tables the step reads its sequences' states through, each with the addresses it
        # held at capture: owned by the graph, views of one block (one copy writes them all), written
        # outside it (_BatchGraph.bind)
        self.tables: list[tuple[Any, tuple[int, ...]]] = []
        self.table_block = cp.empty(_BATCH_TABLE_SLOTS, dtype=cp.uint64)
        self.table_used = 0
        self.table_offsets: list[int] = []  # each table's place in the block (-1: a table of its own)

    def bind(self, positions) -> None:
        self._seq_of = {id(p): b for b, p in enumerate(positions)}

    def write_batch(self, ids, positions) -> None:
        n = self.n
        self.host[0:n] = np.asarray(ids, dtype=np.int64)
        p3 = np.stack([_pos3(p) for p in positions], axis=1)  # (3, n)
        self.host[n : 4 * n] = p3.reshape(-1)
        self.host[4 * n : 7 * n] = p3.T.reshape(-1)

    def copy_inputs(self) -> None:
        cp.cuda.runtime.memcpyAsync(self.dev.data.ptr, self.host.ctypes.data, _BATCH_SLOTS * 4,
                                    cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)

    def ids_dev(self, ids):
        if len(ids) != self.n:
            raise RuntimeError(f"a captured batch step embeds {self.n} tokens, got {len(ids)}")
        return self.dev[0 : self.n]

    def positions_dev(self, pos):
        n = self.n
        b = self._seq_of.get(id(pos))
        if b is not None:
            return self.dev[4 * n + 3 * b : 4 * n + 3 * b + 3].reshape(3, 1)
        if np.shape(pos)[-1] == n:
            return self.dev[n : 4 * n].reshape(3, n)
        raise RuntimeError("a position array that is neither the batch's rows nor one sequence's")

    def cache_row(self, cache: GrowingKVCache):
        if cache.length + 1 > cache.capacity:
            raise _CacheFull("KV cache full: this step grows it eagerly; the next one re-captures")
        i = self.cache_base + len(self.caches)
        if i >= _BATCH_SLOTS:
            raise RuntimeError("too many sequences x attention layers for one captured batch step")
        self.caches.append((cache, cache.length))
        self.host[i] = cache.length
        return self.dev[i : i + 1]

    def write_inputs(self, token: int, pos: np.ndarray, pick: PickSpec | None = None) -> None:
        raise RuntimeError("a batch step's inputs are written by write_batch")

    # ---- what CupyBackend.gdn_decode_batch / gated_attention_batch ask of a capture --------
    def sequence_positions(self, positions) -> Any:
        """(n, 3) device int32: each sequence's own (t, h, w) (slots [4n, 7n)), for `positions` that are
        the batch's own position arrays, in order (a batched mixer's)."""
        n = self.n
        if len(positions) != n or any(self._seq_of.get(id(p)) != b for b, p in enumerate(positions)):
            raise RuntimeError("a batched mixer's positions are not the captured batch's, in order")
        return self.dev[4 * n : 7 * n].reshape(n, 3)

    def cache_rows(self, caches) -> Any:
        """cache_row of each cache, in order: their slots are consecutive, so the (len(caches),) device
        int32 array of the lengths before this step's appends."""
        first = self.cache_base + len(self.caches)
        for c in caches:
            self.cache_row(c)
        return self.dev[first : first + len(caches)]

    def hold(self, table) -> None:
        """Keep a device array the graph reads (a pointer table) alive as long as the graph."""
        self._out_dev.append(table)

    def table(self, arrays) -> Any:
        """A device pointer table of the arrays' addresses for the step being captured: allocated here,
        written after the capture (a copy inside it would be replayed every step), rewritten when the
        graph is bound to other sequences (_BatchGraph.bind)."""
        n = len(arrays)
        if self.table_used + n <= _BATCH_TABLE_SLOTS:
            tab = self.table_block[self.table_used : self.table_used + n]
            self.table_offsets.append(self.table_used)
            self.table_used += n
        else:
            tab = cp.empty(n, dtype=cp.uint64)  # past the block: a table of its own
            self.table_offsets.append(-1)
        self.tables.append((tab, tuple(int(a.data.ptr) for a in arrays)))
        self.hold(tab)
        return tab


def _copy_to(dst, host: np.ndarray, stream) -> np.ndarray:
    """Copy the host array into the front of the device array dst, queued on `stream` (the graph's):
    the graph launched after it on that stream reads what was written (a copy on another stream, from
    pageable memory, may still be in flight when a launch on this non-blocking one starts). Returns the
    host array the copy reads: the caller keeps it until the stream has passed the copy."""
    host = np.ascontiguousarray(host)
    if host.nbytes > dst.nbytes:
        raise ValueError(f"{host.nbytes} bytes do not fit a device array of {dst.nbytes}")
    cp.cuda.runtime.memcpyAsync(dst.data.ptr, host.ctypes.data, host.nbytes, cp.cuda.runtime.memcpyHostToDevice,
                                stream.ptr)
    return host


def _layout_of(states: list) -> tuple:
    """What a batch graph bakes in of one sequence's states besides their addresses: every layer
    state's cache type, array shapes and dtypes (capacity included) and recurrent arrays' names, shapes
    and dtypes. Two sequences of one layout can take each other's place in a graph."""
    out = []
    for st in states:
        kv = st.kv
        cache = None if kv is None else (type(kv), kv.capacity, tuple(
            (name, None if a is None else (a.shape, a.dtype.str)) for name, a in sorted(vars(kv).items())
            if isinstance(a, cp.ndarray) or name in ("k", "v")))
        rec = tuple((name, type(a), a.shape if isinstance(a, cp.ndarray) else None,
                     a.dtype.str if isinstance(a, cp.ndarray) else None) for name, a in st.recurrent.items())
        out.append((type(st), cache, rec))
    return tuple(out)


class _Rebinding:
    """How a captured batch step is bound to other sequences of the same layouts: the (sequence,
    index in its state walk) of each pointer-table entry, in table order; the (sequence, layer) of
    each cache whose length the step reads; each sequence's layout."""

    def __init__(self, entries: list[tuple[int, int]], caches: list[tuple[int, int]], layouts: list[tuple]):
        self.entries = entries
        self.caches = caches
        self.layouts = layouts

    @classmethod
    def of(cls, cap: _BatchCapture, owners: tuple, walks: list[list[int]]) -> _Rebinding | None:
        """The rebinding of a step captured for `owners` (walks: each one's state walk, the addresses in
        order), or None when the step reaches a state some other way than through its pointer tables
        (a per-sequence path: q3 caches, Gemma 3's attention), so that its addresses are baked into
        kernels."""
        where: dict[int, tuple[int, int]] = {}
        for b, ptrs in enumerate(walks):
            for j, a in enumerate(ptrs):
                where.setdefault(a, (b, j))
        in_tables = [a for _, addrs in cap.tables for a in addrs]
        if any(a not in where for a in in_tables) or set(where) - set(in_tables):
            return None
        layer_of = {id(st.kv): (b, i) for b, o in enumerate(owners) for i, st in enumerate(o) if st.kv is not None}
        caches = [layer_of.get(id(c)) for c, _ in cap.caches]
        if any(c is None for c in caches):
            return None
        return cls([where[a] for a in in_tables], [c for c in caches if c is not None],
                   [_layout_of(o) for o in owners])


class _BatchGraph(_DecodeGraph):
    """A captured decode step of a list of sequences (owner: their state lists, in order). When the
    step reads every state through its pointer tables (`rebinding`), the graph serves any sequences of
    the same layouts: bind() writes their addresses into the tables, so a batch whose members changed
    replays at once instead of running eagerly and being captured again (one graph per batch
    size)."""

    def __init__(self, graph, cap: _BatchCapture, kept: list, owners: tuple):
        # the states are checked one sequence at a time (owner_watches, so that a bind walks only the
        # sequences new to the graph), not as _DecodeGraph's one walk over them all
        super().__init__(graph, cap, kept, owners, watch=[])
        self.owner_watches: list[WatchedPointers] = [_GRAPH_STATES.watch(o) for o in owners]
        self.rebinding = _Rebinding.of(cap, owners, [w.pointers for w in self.owner_watches])
        self.released = False  # its sequences ended; kept, without their states, for others (bind)
        self._table_sources: list[np.ndarray] = []  # the host arrays of the last table copies
        self.write_tables(None)  # the captured sequences' addresses

    def valid(self, owner, watch, io=(None, None), link_seconds: tuple[float, float] = (0.0, 0.0)) -> bool:
        if self.released or len(owner) != len(self.states) or \
                any(a is not b for a, b in zip(owner, self.states, strict=True)):
            return False
        return self.alive() and all(map(WatchedPointers.unchanged, self.owner_watches, owner))

    def alive(self) -> bool:
        """False once a sequence's cache was freed (its session closed) or has no room for a token."""
        return not self.released and all(c.k is not None and c.length + 1 <= c.capacity for c, _ in self.cap.caches)

    def release(self) -> None:
        """Let the states of its sequences that ended go (their recurrent arrays are freed with them),
        keeping the graph for other sequences and the others' walks for the next bind (they are still
        held here, so their ids stay theirs)."""
        self.states = tuple(None if o is None or any(st.kv is not None and st.kv.k is None for st in o) else o
                            for o in self.states)
        self.cap.caches = []
        self.released = True

    def bind(self, owners: tuple) -> bool:
        """Make this graph the step of `owners` (their states' addresses into the pointer tables, their
        caches' lengths into the inputs): False, nothing changed, when it cannot (no rebinding, another
        number of sequences or another layout, a cache without room for the token)."""
        rb = self.rebinding
        if rb is None or len(owners) != len(rb.layouts):
            return False
        was = {id(o): i for i, o in enumerate(self.states) if o is not None}
        watches: list[WatchedPointers | None] = []
        for b, o in enumerate(owners):
            i = was.get(id(o))
            if i is not None and self.owner_watches[i].unchanged(o):  # still here, its arrays unmoved
                if rb.layouts[i] != rb.layouts[b]:
                    return False
                watches.append(self.owner_watches[i])
            elif _layout_of(o) != rb.layouts[b]:
                return False
            else:
                watches.append(None)  # new here: walked below
        caches = [owners[b][i].kv for b, i in rb.caches]
        if any(c.k is None or c.length + 1 > c.capacity for c in caches):
            return False
        self.owner_watches = [_GRAPH_STATES.watch(o) if w is None else w for w, o in zip(watches, owners, strict=True)]
        self.write_tables([w.pointers for w in self.owner_watches])
        self.cap.caches = [(c, c.length) for c in caches]
        self.states = owners
        self.released = False
        return True

    def write_tables(self, walks: list[list[int]] | None) -> None:
        """Fill the pointer tables with the addresses at the rebinding's places in `walks` (each
        sequence's state walk), or, with None, with the addresses they had at capture."""
        cap = self.cap
        assert isinstance(cap, _BatchCapture)
        rb = self.rebinding
        if walks is None or rb is None:
            ptrs = [a for _, addrs in cap.tables for a in addrs]
        else:
            ptrs = [walks[b][j] for b, j in rb.entries]
        host = np.asarray(ptrs, dtype=np.uint64)
        block = np.empty(cap.table_used, dtype=np.uint64)
        sources = []  # what the queued copies read: kept until the next bind, after the launches' waits
        at = 0
        for (tab, addrs), off in zip(cap.tables, cap.table_offsets, strict=True):
            n = len(addrs)
            if off >= 0:
                block[off : off + n] = host[at : at + n]
            else:  # a table past the block
                sources.append(_copy_to(tab, host[at : at + n], cap.stream))
            at += n
        if cap.table_used:
            sources.append(_copy_to(cap.table_block, block, cap.stream))  # one copy for the block
        self._table_sources = sources

    def launch_batch(self, ids, positions) -> LaunchedStep:
        """Replay for these tokens; result() waits for the replay and copies its host outputs (before
        the next replay, which rewrites them)."""
        cap = self.cap
        assert isinstance(cap, _BatchCapture)
        cap.write_batch(ids, positions)
        for i, (c, _) in enumerate(cap.caches):
            cap.host[cap.cache_base + i] = c.length
        self.launches += 1
        self.graph.launch(cap.stream)
        for c, _ in cap.caches:
            c.length += 1

        def finish() -> np.ndarray | TopLogits:
            cap.wait()
            return _host_copy(cap.result, self)

        return LaunchedStep(finish)


def _host_copy(out, rec: _DecodeGraph):
    """A copy of a captured step's host outputs (the graph rewrites them on its next replay); top
    logits keep a fetch of the whole rows, valid until then."""
    if isinstance(out, TopLogits):
        fetch = None if out.fetch is None else rec.guarded(out.fetch)
        picks = np.array(out.picks) if out.picks is not None and rec.cap.picking else None
        return TopLogits(np.array(out.values), np.array(out.ids), fetch, out.first, picks,
                         out.penalized and rec.cap.penalizing)
    if not isinstance(out, np.ndarray):
        raise RuntimeError(f"a captured step returned {type(out).__name__}, not host logits")
    return np.array(out)


def _f32(x):
    return cp.ascontiguousarray(x, dtype=cp.float32)


def _rows_first(q: ops.QWeight) -> bool:
    """Whether a QWeight's arrays hold one matrix row per index of their first axis (so that the rows
    of several such matrices concatenated along it are one matrix)."""
    return q.experts == 1 and q.wq is not None and q.wq.shape[0] == q.rows and \
        (q.wd is None or q.wd.shape[0] == q.rows)


class CupyBackend(FusedOpsMixin, DeviceHooks):
    name = "cupy"

    def __init__(self, device: str = "cuda:0", *, path: str | None = None, probe: bool = True):
        dev = str(device)
        if not dev.startswith("cuda"):
            raise ValueError(f"CupyBackend runs on a CUDA GPU; got device '{device}' (use 'cuda:N')")
        self.index = int(dev.split(":", 1)[1]) if ":" in dev else 0
        n = device_count()
        if self.index >= n:
            raise ValueError(f"device '{device}' does not exist: this machine has {n} CUDA device(s)")
        self.device = f"cuda:{self.index}"
        self._dev = cp.cuda.Device(self.index)
        _note_context_bytes(self.index)  # before this backend allocates anything (the probe does)
        self._rope_tables: dict = {}
        self.probe_record: dict | None = None
        self._capture: _Capture | None = None  # set while a decode step is being captured
        self._graphs: dict[Any, _DecodeGraph] = {}
        self._graph_stream = None
        self._cap_stream = None
        self._batch_graphs: dict[Any, _BatchGraph] = {}  # batched decode steps, most recently used last
        self._batch_eager: set[int] = set()  # batch sizes whose capture failed
        self._batch_last: tuple[int, ...] = ()  # ids of the previous batched decode step's sequences
        self.batch_rebinds = 0  # batch graphs bound to other sequences than they were captured for
        self.batch_capture_error = ""  # why the last of them failed (shown by tests and MINECART_DEBUG)
        self.graph_capture_error = ""  # why the last single-token capture failed
        self._pool_peak = 0  # the pool's highest total seen by sample_memory (memory_peak)
        self._load_pool_peak = 0  # the pool's highest total while weights were uploaded (load_memory_peak)
        self._arena: WeightArena | None = None  # the part being loaded (part_arena)
        self._hold_done: Any = None  # the event `hold` records again after each simulated link's hold
        self._sleeper: Any = None  # the _sleep_event of waits for host functions (host_round_trip)
        self._expert_seqs: dict[int, Any] = {}  # an expert pool channel's word -> its request counter here
        self._side: Any = None  # (stream, fork event, join event) of `alongside`, made on first use
        self._copy_rate: tuple[float, float] | None = None  # host_copy_rate, once measured
        self.use_graphs = not os.environ.get("MINECART_NO_CUDA_GRAPH")
        forced = path or os.environ.get("MINECART_MATMUL_PATH")
        self.gemv_path = self.gemm_path = "dp4a"
        self.gemm_kquant_path = "dp4a"  # the prefill path of the K-quants (the probe's gemm_kquant)
        if forced:
            if forced not in ops.MATMUL_PATHS:
                raise ValueError(f"matmul path must be one of {', '.join(ops.MATMUL_PATHS)}, got '{forced}'")
            self.gemm_path = self.gemm_kquant_path = forced
            self.gemv_path = "dp4a" if forced.startswith("dp4a") else forced
        elif probe:
            self._choose_paths()

    def __repr__(self) -> str:
        return f"CupyBackend({self.device!r}, decode={self.gemv_path}, prefill={self.gemm_path})"

    def _choose_paths(self) -> None:
        """Reuse this card's cached probe result, or probe now (< 1 s) and cache it."""
        from .. import probe_cache

        tag = kernel_build_tag()  # kernels loaded from PTX (MINECART_KERNEL_PTX) are timed apart
        uuid = gpu_uuid(self.index) + (f"+{tag}" if tag else "")
        rec = probe_cache.get(uuid)
        if rec is None:
            from minecart.kernels import probe

            with self._dev:
                rec = probe.run_probe()
            try:
                probe_cache.save(uuid, rec)
            except OSError:
                pass  # a read-only cache dir only costs a re-probe next time
        self.probe_record = rec
        self.gemv_path = rec.get("gemv", "dp4a")
        self.gemm_path = rec.get("gemm", "dp4a")
        self.gemm_kquant_path = rec.get("gemm_kquant", self.gemm_path)

    # ---- data movement -------------------------------------------------------------------------
    def asarray(self, host_array):
        a = np.asarray(host_array)
        with self._dev:
            if a.dtype.kind == "f":
                return cp.asarray(np.ascontiguousarray(a, dtype=np.float32))
            return cp.asarray(np.ascontiguousarray(a))

    def to_numpy(self, x):
        with self._dev:
            if self._capture is not None:
                return self._capture.output(x)
            return cp.asnumpy(x)

    # execution hooks (engine/execution.py): pinned staging buffers for cross-device hops, and the
    # worker thread of this device making it current once
    pins_host_memory = True

    def pinned_empty(self, shape, dtype: str = "float32") -> np.ndarray:
        """A host array in page-locked memory (device <-> pinned host copies run at full link speed)."""
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        mem = cp.cuda.alloc_pinned_memory(max(n, 1))
        return np.frombuffer(mem, dtype, int(np.prod(shape))).reshape(shape)

    def host_copy_rate(self) -> tuple[float, float]:
        """(bytes/s, seconds per copy) of pinned host -> device copies on this card's real link (a
        riser's x1 lane, the slot's generation), measured once: the best of 3 copies of 16 MiB and of
        5 copies of 4 KiB, timed by events on a stream of their own. At most ~0.3 s (a Gen1 x1
        riser), ~1 ms on a Gen4 x16 slot."""
        if self._copy_rate is None:
            small, big = 4096, 16 << 20
            host = self.pinned_empty((big,), "uint8")
            host[:] = 1
            with self._dev:
                dev = cp.empty(big, cp.uint8)
                stream = cp.cuda.Stream(non_blocking=True)
                # dev comes from the current stream's pool, which may hand over memory that work queued
                # there still reads: the copies wait for that work
                queued = cp.cuda.Event(disable_timing=True)
                queued.record(cp.cuda.get_current_stream())
                stream.wait_event(queued)

                def seconds(n: int) -> float:
                    start, end = cp.cuda.Event(), cp.cuda.Event()
                    start.record(stream)
                    dev[:n].set(host[:n], stream=stream)
                    end.record(stream)
                    end.synchronize()
                    return cp.cuda.get_elapsed_time(start, end) / 1e3

                seconds(1 << 20)  # the first copy also maps the buffers
                t_small = min(seconds(small) for _ in range(5))
                t_big = min(seconds(big) for _ in range(3))
                del dev
            rate = (big - small) / max(t_big - t_small, 1e-9)
            self._copy_rate = (rate, max(t_small - small / rate, 1e-6))
        return self._copy_rate

    def to_numpy_into(self, x, out: np.ndarray) -> None:
        """Copy x into the host array `out` (blocking)."""
        with self._dev:
            cp.ascontiguousarray(x).get(out=out)

    def bind_thread(self) -> None:
        self._dev.use()

    def host_round_trip(self, x, host_x, host_y, fn, arg: int):
        """The round trip as stream work (DeviceHooks.host_round_trip): a copy into the pinned host_x,
        fn(arg) as a host function (kernels/host_func.py), a copy of the pinned host_y into a new array.
        Under a capture these are nodes of the decode graph; eagerly the stream is waited for before
        returning (fn needs the GIL, which this thread would otherwise hold while it queues more)."""
        if host_x.dtype != np.float32 or host_y.dtype != np.float32:
            raise ValueError(f"host buffers must be float32, got {host_x.dtype} and {host_y.dtype}")
        with self._dev:
            stream = cp.cuda.get_current_stream()
            x = cp.ascontiguousarray(x, dtype=cp.float32)
            if x.nbytes != host_x.nbytes:
                raise ValueError(f"{x.shape} does not fit the host buffer {host_x.shape}")
            out = cp.empty(host_y.shape, dtype=cp.float32)
            rt = cp.cuda.runtime
            rt.memcpyAsync(host_x.ctypes.data, x.data.ptr, x.nbytes, rt.memcpyDeviceToHost, stream.ptr)
            host_func.launch(stream.ptr, fn, arg)
            rt.memcpyAsync(out.data.ptr, host_y.ctypes.data, out.nbytes, rt.memcpyHostToDevice, stream.ptr)
            self._wait_for_host_work(stream)
            # (under a capture, x and out came from the capture's allocator: the graph keeps them)
            return out

    def expert_call(self, x, router: CupyWeight, k: int, host_x, host_y, channel, entry: int):
        """DeviceHooks.expert_call as the routing and one kernel on the current stream
        (kernels/expert_call.cu): the kernel writes the rows and their routing into the page-locked
        host_x, posts the call into the channel's words of the pool's control block, waits there for the
        pool's answer and reads host_y's rows back into a new array. Eagerly the stream is waited for
        before returning (so the caller can check the channel's status); under a capture the kernel is a
        node of the decode graph."""
        if host_x.dtype != np.float32 or host_y.dtype != np.float32:
            raise ValueError(f"host buffers must be float32, got {host_x.dtype} and {host_y.dtype}")
        with self._dev:
            stream = cp.cuda.get_current_stream()
            x = _f32(x)
            T, H = (int(d) for d in x.shape)
            if host_x.shape != (T, H + 2 * int(k)) or host_y.shape != (T, H):
                raise ValueError(f"{x.shape} with {k} experts a token does not fit the host buffers "
                                 f"{host_x.shape} / {host_y.shape}")
            ids, wts = self._route(x, router, k)
            seq = self._expert_seqs.get(channel.word)
            if seq is None:  # the channel's request counter on this device, from the last one posted
                seq = cp.full((1,), channel.posted, dtype=cp.uint64)
                self._expert_seqs[channel.word] = seq
            out = cp.empty(host_y.shape, dtype=cp.float32)
            channel.pool.ensure_running()
            expert_call_kernel.call(x, ids, wts, out, channel.word_address, host_x.ctypes.data, host_y.ctypes.data,
                                    seq, entry, channel.timeout_s)
            self._wait_for_host_work(stream)
            return out

    def _wait_for_host_work(self, stream) -> None:
        """After stream work that waits for the host's threads (a host function, the expert pool):
        eagerly, wait for the stream asleep (_wait_stream: those threads want every core); under a
        capture, have the graph's replays waited for the same way."""
        if self._sleeper is None:
            self._sleeper = _sleep_event()
        if self._capture is None:
            _wait_stream(stream, self._sleeper)
        else:
            self._capture.sleeper = self._sleeper

    def alongside(self, fn):
        """DeviceHooks.alongside on a second stream of this device: it waits for the current stream's
        work so far (an event), runs fn's ops, and join() makes the current stream wait for them (a
        second event). Under a capture this forks and joins the graph; eagerly it overlaps the same
        way. The side stream's arrays go back to its own pool arena, and its next work waits for the
        next fork, which comes after every use of them on the current stream."""
        with self._dev:
            main = cp.cuda.get_current_stream()
            if self._side is None:
                self._side = (cp.cuda.Stream(non_blocking=True), cp.cuda.Event(disable_timing=True),
                              cp.cuda.Event(disable_timing=True))
            side, forked, done = self._side
            forked.record(main)
            side.wait_event(forked)
            with side:
                out = fn()
            done.record(side)

        def join():
            with self._dev:
                cp.cuda.get_current_stream().wait_event(done)
            return out

        return join

    def zeros(self, shape, dtype: str = "float32"):
        with self._dev:
            return cp.zeros(shape, dtype=dtype)

    @contextlib.contextmanager
    def part_arena(self, tensors: Sequence[tuple[Any, str]]) -> Iterator[None]:
        """The weights loaded inside this block (load_weight, load_fused) are laid out in one
        WeightArena, sized up front for `tensors` ((TensorInfo, role) of the part's tensors still to
        load, in any order: held_array_bytes each), so the driver rounds one allocation per part
        instead of one per array. A weight group's arrays are in it, its members' own uploads (copied
        into them) not: those are temporaries. engine/model.py opens one per part it loads."""
        nbytes = sum(arena_aligned(n) for info, role in tensors for n in held_array_bytes(info, role))
        with self._dev:
            arena = WeightArena(nbytes)
        self._load_pool_peak = max(self._load_pool_peak, self.memory_used())
        self._arena = arena
        try:
            yield
        finally:
            self._arena = None  # from here on only the weights' views hold the allocation

    def _empty(self):
        """The allocator of a loaded weight's arrays: the open part's arena, else CuPy's pool."""
        return cp.empty if self._arena is None else self._arena.empty

    def load_weight(self, info, *, role: str = "matmul"):
        return self._load_weight(info, role, self._empty())

    def _load_weight(self, info, role: str, empty) -> Any:
        """load_weight with the allocator of the result's arrays (load_fused: the pool, for a member
        that is copied into its group's arrays)."""
        with self._dev:
            if role == "vector":
                from .. import quants

                host = np.ascontiguousarray(quants.dequantize(info), dtype=np.float32)
                out = empty(host.shape, np.float32)
                out.set(host)
                return out
            if role not in ("matmul", "embedding", "experts"):
                raise ValueError(f"unknown weight role '{role}' for tensor '{info.name}'")
            logical = _logical_shape(info, role)
            type_name = info.type_name
            if ops.kept_type(type_name, logical[-1]) == type_name:
                q = ops.upload_weight(np.asarray(info.raw), type_name, logical, empty)
                self._return_load_blocks()
            else:
                # No kernel for this format or row length: decode once to F32 on the host.
                from .. import quants

                dense = np.ascontiguousarray(quants.dequantize(info), dtype=np.float32).reshape(logical)
                if logical[-1] % 32:
                    raise ValueError(f"tensor '{info.name}': row length {logical[-1]} is not a multiple of 32")
                q = ops.upload_weight(dense.view(np.uint8), "F32", logical, empty)
                type_name = "F32"
            return CupyWeight(info.name, logical, type_name, q, role)

    def _return_load_blocks(self) -> None:
        """After a weight's upload: note the pool's total (with the upload's temporaries still in it,
        nothing freed since they were made: the load's high-water mark, `load_memory_peak`), then hand
        the pool's unused blocks back to the device. A K-quant repack leaves ~5.6x its 64 MiB chunk of
        freed temporaries and a staged upload its raw copy; kept in the pool they were ~0.6 GB of
        device memory that no later array used (tools/plan_vs_measured.py, v10)."""
        pool = cp.get_default_memory_pool()
        self._load_pool_peak = max(self._load_pool_peak, int(pool.total_bytes()))
        pool.free_all_blocks()

    def load_memory_peak(self) -> int:
        """The highest total of the memory pool while this backend uploaded weights (0 before any):
        what loading took from the device at its peak beside the CUDA context and kernel modules."""
        return self._load_pool_peak

    def load_fused(self, infos: list) -> list[CupyWeight]:
        """The weights of one group (base.FusedOpsMixin.load_fused) in one device array per QWeight
        field, each weight's QWeight a row range (view) of it. Tensor by tensor, upload_weight lays
        the tensor out for the kernels and its rows are copied into the group's arrays (allocated
        once the first tensor shows the layout); the tensor's own arrays are then dropped, so the
        group is never on the device twice, only one tensor beside it. Tensors of differing types (a
        llama-quantize mix: Q6_K attn_qkv beside Q4_K attn_gate, ssm_beta and ssm_alpha) make one
        group per run of neighbours of one type (matmul_many then runs one matmul per run). Loaded
        apart instead (each its own weight) when the row lengths differ, or the layout does not keep a
        matrix's rows along its first axis (a concatenation of such layouts would not be one matrix)."""
        infos = list(infos)
        logical = [(1, int(i.shape[0])) if len(i.shape) == 1 else tuple(int(d) for d in i.shape)
                   for i in infos]
        if len(infos) < 2 or any(len(s) != 2 for s in logical) or len({s[1] for s in logical}) != 1:
            return super().load_fused(infos)
        runs = _type_runs(infos)
        if len(runs) > 1:
            loaded: list[CupyWeight] = []
            try:
                for run in runs:
                    loaded += self.load_fused(run) if len(run) > 1 else [self.load_weight(run[0], role="matmul")]
            except BaseException:
                for done in loaded:
                    self.free(done)
                raise
            return loaded
        total = sum(s[0] for s in logical)
        out: list[CupyWeight] = []
        ranges: list[tuple[int, int]] = []
        group: ops.QWeight | None = None
        w: CupyWeight | None = None
        empty = self._empty()  # the group's arrays: the part's arena when one is open
        with self._dev:
            try:
                for info, (rows, _) in zip(infos, logical, strict=True):
                    w = None
                    # this tensor alone, in the kernels' layout, in the pool (copied into the group)
                    w = self._load_weight(info, "matmul", cp.empty)
                    q = w.q
                    if group is None:
                        if not _rows_first(q):  # each tensor apart
                            out.append(w)
                            for other in infos[1:]:
                                w = None
                                w = self.load_weight(other, role="matmul")
                                out.append(w)
                            return out
                        wq = empty((total,) + q.wq.shape[1:], q.wq.dtype)
                        wd = None if q.wd is None else empty((total,) + q.wd.shape[1:], q.wd.dtype)
                        group = ops.QWeight(q.type_name, total, q.cols, 1, wq, wd)
                    r0 = ranges[-1][1] if ranges else 0
                    if not _rows_first(q) or q.type_name != group.type_name or \
                            q.wq.shape[1:] != group.wq.shape[1:] or q.wq.dtype != group.wq.dtype or \
                            (q.wd is None) != (group.wd is None):
                        raise RuntimeError(f"'{info.name}' is laid out unlike the first tensor of its group")
                    group.wq[r0 : r0 + rows] = q.wq
                    q.wq = group.wq[r0 : r0 + rows]
                    if group.wd is not None:
                        group.wd[r0 : r0 + rows] = q.wd
                        q.wd = group.wd[r0 : r0 + rows]
                    ranges.append((r0, r0 + rows))
                    out.append(w)
            except BaseException:
                for done in out + ([] if w is None or w in out else [w]):
                    self.free(done)
                raise
            finally:
                # hand the tensors' own (now unused) arrays back to the device: no pool holes
                cp.get_default_memory_pool().free_all_blocks()
        assert group is not None
        rec = WeightGroup(group, ranges)
        for i, w in enumerate(out):
            w.group, w.index = rec, i
        return out

    def free(self, obj) -> None:
        if isinstance(obj, CupyWeight):
            obj.q.wq = None
            obj.q.wd = None
            if obj.group is not None:  # the group's arrays live on in the other members' views
                obj.group.q = None
                obj.group = None
        elif isinstance(obj, CupyKVCache):
            obj.k = obj.v = None
        elif isinstance(obj, CupyQ3KVCache):
            obj.k_codes = obj.k_scales = obj.v_codes = obj.v_scales = obj.k_ref = None

    def synchronize(self) -> None:
        if self._capture is not None:
            return  # no host waits inside a captured graph
        with self._dev:
            cp.cuda.get_current_stream().synchronize()

    # ---- elementwise and norms -----------------------------------------------------------------
    def _binary(self, op: str, a, b):
        with self._dev:
            if a.shape == b.shape:
                return ops.ewise(op, a, b)
            # general broadcasting (e.g. (T, H) * (T, 1)) through CuPy's own elementwise kernels
            a32, b32 = _f32(a), _f32(b)
            return (a32 + b32) if op == "add" else (a32 * b32)

    def add(self, a, b):
        return self._binary("add", a, b)

    def mul(self, a, b):
        return self._binary("mul", a, b)

    def scale(self, x, s: float):
        with self._dev:
            return ops.ewise("scale", x, None, float(s))

    def sigmoid(self, x):
        with self._dev:
            return ops.ewise("sigmoid", x)

    def silu(self, x):
        with self._dev:
            return ops.ewise("silu", x)

    def swiglu(self, gate, up):
        with self._dev:
            if gate.ndim == 2 and gate.shape == up.shape and self._q8_rows(gate):
                out, q8 = fused.swiglu_q8(gate, up)  # also writes the down projection's int8 input
                ops.register_quantized(out, q8)
                return out
            return ops.ewise("swiglu", gate, up)

    def geglu(self, gate, up):
        with self._dev:
            return ops.ewise("geglu", gate, up)

    def _q8_rows(self, x) -> bool:
        """Whether a producer of the 2-D activation x should also write its q8_1 quantization: rows
        of whole 32-value blocks, and the matmul path that will read x takes int8 activations."""
        if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] % 32:
            return False
        path = self.gemv_path if x.shape[0] <= ops.GEMV_MAX_T else self.gemm_path
        return path.startswith("dp4a")

    def rms_norm(self, x, w, eps: float):
        with self._dev:
            if self._q8_rows(x):  # (T, H): the input of the next matmuls
                out, q8 = fused.rms_norm_q8(x, w, eps)
                ops.register_quantized(out, q8)
                return out
            return ops.rms_norm(x, w, eps)

    def add_rms_norm(self, x, delta, w, eps: float):
        with self._dev:
            if self._q8_rows(x) and delta.shape == x.shape:
                s, out, q8 = fused.rms_norm_q8(x, w, eps, delta=delta)
                ops.register_quantized(out, q8)
                return s, out
            return ops.add_rms_norm(x, delta, w, eps)

    def l2_norm(self, x, eps: float):
        with self._dev:
            return ops.l2_norm(x, eps)

    def gated_rms_norm(self, x, z, w, eps: float):
        with self._dev:
            return ops.gated_rms_norm(x, z, w, eps)

    # ---- matmuls and lookups -------------------------------------------------------------------
    def embed(self, table: CupyWeight, ids):
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n_rows = table.shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
            raise ValueError(f"token id out of range [0, {n_rows}) for '{table.name}'")
        with self._dev:
            if self._capture is not None:
                return ops.embed(table.q, self._capture.ids_dev(ids))
            return ops.embed(table.q, cp.asarray(ids.astype(np.int32)))

    def _matmul_path(self, T: int, q: ops.QWeight) -> str:
        """The matmul path for T rows of activations against `q`: the decode (GEMV) path up to the rows
        its launches serve while reading the weights once (ops.gemv_max_t: more for the K-quants'
        multi-token GEMV, so a batch of up to 32 decoding sequences stays on it), the prefill (GEMM)
        path above, the K-quants' own (kernels/probe.py pick_kquant_gemm)."""
        limit = ops.gemv_max_t(q) if self.gemv_path.startswith("dp4a") else ops.GEMV_MAX_T
        if T <= limit:
            return self.gemv_path
        return self.gemm_kquant_path if q.type_name in KQUANT_TYPES else self.gemm_path

    def matmul(self, x, w: CupyWeight):
        with self._dev:
            lead = x.shape[:-1]
            x2 = _f32(x).reshape(-1, x.shape[-1])
            path = self._matmul_path(x2.shape[0], w.q)
            y = ops.matmul(x2, w.q, path)
            return y.reshape(*lead, w.q.rows)

    # ---- positions and attention ---------------------------------------------------------------
    def _rope_table(self, n_rot: int, base: float, sections):
        key = (n_rot, float(base), tuple(sections))
        tab = self._rope_tables.get(key)
        if tab is None:
            half = n_rot // 2
            pair = np.arange(half)
            comp = np.zeros(half, dtype=np.int32)
            if sections:
                s = list(sections) + [0, 0, 0]
                comp[(pair % 3 == 1) & (pair < 3 * s[1])] = 1
                comp[(pair % 3 == 2) & (pair < 3 * s[2])] = 2
            inv_freq = (np.float64(base) ** (-2.0 * pair / n_rot)).astype(np.float32)
            tab = (cp.asarray(comp), cp.asarray(inv_freq), comp)
            self._rope_tables[key] = tab
        return tab

    def rope(self, x, positions, n_rot: int, base: float, *, sections=(), scale: float = 1.0):
        with self._dev:
            comp_d, inv_freq, comp = self._rope_table(n_rot, base, sections)
            pos = np.asarray(positions, dtype=np.int64)
            T = x.shape[0]
            if self._capture is not None:
                pos3 = self._capture.positions_dev(pos)
            elif pos.ndim == 1 and T and (T == 1 or np.all(np.diff(pos) == 1)):
                # Consecutive text positions: built on the device, no host-to-device copy (no sync).
                pos3 = cp.broadcast_to(cp.arange(int(pos[0]), int(pos[0]) + T, dtype=cp.int32), (3, T))
                pos3 = cp.ascontiguousarray(pos3)
            else:
                p = pos.reshape(1, T) if pos.ndim == 1 else pos.reshape(3, T)
                pos3 = cp.asarray(np.ascontiguousarray(np.broadcast_to(p, (3, T)), dtype=np.int32))
            return ops.rope(x, pos3, comp_d, inv_freq, n_rot, scale)

    def new_kv_cache(self, n_kv_heads: int, head_dim: int, value_dim: int, capacity: int,
                     kv_type: str = "f32"):
        from ..kvquant import check_kv_type

        if check_kv_type(kv_type) in ("f16", "q8_0"):
            from minecart.kernels.build import HEAD_DIMS

            from ..errors import RequestError

            if head_dim not in HEAD_DIMS or value_dim != head_dim:
                raise RequestError(f"the {kv_type} KV cache on the CUDA backend needs equal K and V head dims in "
                                   f"{HEAD_DIMS}; this model has {head_dim}/{value_dim}: use kv_type 'f32'")
            with self._dev:
                typed = CupyF16KVCache if kv_type == "f16" else CupyQ8KVCache
                return typed(n_kv_heads, head_dim, value_dim, capacity)
        if kv_type == "q3":  # 3-bit K / 2-bit V codes + fp16 scales (engine/kvquant.py, kernels/kvq3.py)
            from minecart.kernels.build import HEAD_DIMS

            from ..errors import RequestError

            if head_dim not in HEAD_DIMS or value_dim != head_dim:
                raise RequestError(f"the q3 KV cache on the CUDA backend needs equal K and V head dims in "
                                   f"{HEAD_DIMS}; this model has {head_dim}/{value_dim}: use kv_type 'f32'")
            with self._dev:
                return CupyQ3KVCache(n_kv_heads, head_dim, value_dim, capacity)
        with self._dev:
            return CupyKVCache(n_kv_heads, head_dim, value_dim, capacity)

    def _attention_q3(self, q, k, v, cache: CupyQ3KVCache, scale: float, window: int):
        """Attention over a q3 cache: quantize this call's K/V rows into it, then attend straight from
        the codes (kvq3.attention: split decode for one token, the tiled prefill kernel otherwise).
        Under a CUDA-graph capture the row and the length come from the device
        (`_Capture.cache_row`), as for CupyKVCache."""
        n, d, dv = cache.n_kv_heads, cache.head_dim, cache.value_dim
        k = _f32(k).reshape(-1, n, d)
        v = _f32(v).reshape(-1, n, dv)
        if self._capture is not None:
            if not kvq3.fits_flash_decode(q.shape[1], n):
                raise RuntimeError("q3 decode with more than 8 query heads per KV head is not captured")
            if cache.k_ref is None:
                raise _CacheFull("an empty q3 cache takes its reference row in an eager step")
            row_ptr = self._capture.cache_row(cache)
            kvq3.quantize_append(k, cache.k_codes, cache.k_scales, 0, start_ptr=row_ptr, ref=cache.k_ref)
            kvq3.quantize_append(v, cache.v_codes, cache.v_scales, 0, start_ptr=row_ptr)
            cache.length += 1
            return kvq3.flash_decode(q, cache.k_codes, cache.k_scales, cache.v_codes, cache.v_scales,
                                     cache.length, float(scale), int(window), kv_len_ptr=row_ptr)
        start = cache.length
        cache.append(k, v)
        return kvq3.attention(q, cache.k_codes, cache.k_scales, cache.v_codes, cache.v_scales, start,
                              cache.length, float(scale), int(window))

    def attention(self, q, k, v, cache: CupyKVCache, *, scale: float, window: int = 0):
        if isinstance(cache, CupyQ3KVCache):
            with self._dev:
                return self._attention_q3(q, k, v, cache, scale, window)
        if isinstance(cache, CupyTypedKVCache):  # f16 / q8_0: the kernels read the stored values
            with self._dev:
                kv = cache.kv_type
                if self._capture is not None:
                    row_ptr = self._capture.cache_row(cache)
                    kvcache.append(k, v, cache.k, cache.v, kv, 0, start_ptr=row_ptr)
                    cache.length += 1
                    return ops.attention(q, cache.k, cache.v, cache.length - 1, cache.length, float(scale),
                                         int(window), kv_len_ptr=row_ptr, kv_type=kv)
                start = cache.length
                cache.append(_f32(k), _f32(v))
                return ops.attention(q, cache.k, cache.v, start, cache.length, float(scale), int(window),
                                     kv_type=kv)
        with self._dev:
            if self._capture is not None:
                row_ptr = self._capture.cache_row(cache)
                ops.kv_append(k, v, cache.k, cache.v, row_ptr)
                cache.length += 1
                return ops.attention(q, cache.k, cache.v, cache.length - 1, cache.length, float(scale),
                                     int(window), kv_len_ptr=row_ptr)
            start = cache.length
            cache.append(_f32(k), _f32(v))
            return ops.attention(q, cache.k, cache.v, start, cache.length, float(scale), int(window))

    # ---- vision tower (engine/vision/encoder.py) -------------------------------------------------
    # Plain CuPy array ops (elementwise kernels and cuBLAS SGEMM for the scores), once per image:
    # not on the decode path, so no hand-written kernels yet.
    def layer_norm(self, x, w, b, eps: float):
        with self._dev:
            x32 = _f32(x)
            centred = x32 - x32.mean(axis=-1, keepdims=True)
            inv = cp.reciprocal(cp.sqrt((centred * centred).mean(axis=-1, keepdims=True) + cp.float32(eps)))
            return centred * inv * _f32(w) + _f32(b)

    def gelu(self, x, *, exact: bool = False):
        with self._dev:
            x32 = _f32(x)
            if exact:
                from cupyx.scipy.special import erf

                return cp.float32(0.5) * x32 * (cp.float32(1.0) + erf(x32 * cp.float32(0.7071067811865476)))
            inner = cp.float32(0.7978845608028654) * (x32 + cp.float32(0.044715) * x32 * x32 * x32)
            return cp.float32(0.5) * x32 * (cp.float32(1.0) + cp.tanh(inner))

    def vision_rope(self, x, positions, base: float):
        with self._dev:
            x32 = _f32(x)
            d = x32.shape[-1]
            half, quarter = d // 2, d // 4
            inv_freq = np.float64(base) ** (-4.0 * np.arange(quarter) / d)
            pos = np.asarray(positions, dtype=np.float64)  # (2, T): row, col
            angle = np.concatenate([pos[0][:, None] * inv_freq, pos[1][:, None] * inv_freq], axis=1)
            cos = cp.asarray(np.cos(angle).astype(np.float32))[:, None, :]
            sin = cp.asarray(np.sin(angle).astype(np.float32))[:, None, :]
            x1, x2 = x32[..., :half], x32[..., half:]
            return cp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)

    def attention_full(self, q, k, v, *, scale: float):
        with self._dev:
            qh = _f32(q).transpose(1, 0, 2)  # (nh, T, d)
            kh = _f32(k).transpose(1, 0, 2)
            vh = _f32(v).transpose(1, 0, 2)
            T = qh.shape[1]
            out = cp.empty((qh.shape[0], T, vh.shape[2]), dtype=cp.float32)
            block = max(1, (1 << 26) // max(T * qh.shape[0], 1))  # bounds the (nh, block, T) scores
            for q0 in range(0, T, block):
                scores = cp.matmul(qh[:, q0 : q0 + block], kh.transpose(0, 2, 1)) * cp.float32(scale)
                scores -= scores.max(axis=-1, keepdims=True)
                p = cp.exp(scores)
                p /= p.sum(axis=-1, keepdims=True)
                out[:, q0 : q0 + block] = cp.matmul(p, vh)
            return cp.ascontiguousarray(out.transpose(1, 0, 2))

    # ---- Gated DeltaNet ------------------------------------------------------------------------
    def conv1d_silu(self, x, state, w, cuts=()):
        with self._dev:
            return ops.conv1d_silu(x, state, _f32(w), cuts)

    def gdn_gates(self, alpha, beta, ssm_a, dt_bias):
        with self._dev:
            return ops.gdn_gates(alpha, beta, _f32(ssm_a), _f32(dt_bias))

    def gdn_chunk(self, q, k, v, g, beta, state, chunk: int = 64):
        # Long runs take the chunked WY kernels (chunk 64, fixed), short ones the token-serial scan;
        # kernels/gdn_chunk.py `use_chunked` decides. Both compute the same function up to fp32 rounding.
        with self._dev:
            if gdn_chunk.use_chunked(q.shape[0], q.shape[2], v.shape[2]):
                return gdn_chunk.gdn_chunked(q, k, v, g, beta, state)
            return ops.gdn_scan(q, k, v, g, beta, state)

    def gdn_step(self, q, k, v, g, beta, state):
        with self._dev:
            return ops.gdn_scan(q, k, v, g, beta, state)

    # ---- fused decode ops (base.FusedOpsMixin; kernels/fused.py) ------------------------------------
    def matmul_many(self, x, ws):
        """One matmul over each group's concatenated rows (the weights load_fused made: a whole group,
        in order, is one matmul), split into each weight's output; any other weight runs alone."""
        ws = list(ws)
        out: list = []
        i = 0
        while i < len(ws):
            w = ws[i]
            rec = w.group if isinstance(w, CupyWeight) else None
            n = len(rec.ranges) if rec is not None and rec.q is not None else 0
            run = ws[i : i + n]
            if n < 2 or len(run) != n or \
                    any(not isinstance(m, CupyWeight) or m.group is not rec or m.index != j for j, m in enumerate(run)):
                out.append(self.matmul(x, w))
                i += 1
                continue
            assert rec is not None and rec.q is not None
            big, ranges = rec.q, rec.ranges
            with self._dev:
                lead = x.shape[:-1]
                x2 = _f32(x).reshape(-1, x.shape[-1])
                path = self._matmul_path(x2.shape[0], big)
                outs = ops.matmul_split(x2, big, ranges, path)  # contiguous (T, rows) each
                out += [o.reshape(*lead, b - a) for o, (a, b) in zip(outs, ranges, strict=True)]
            i += n
        return out

    def matmul_swiglu(self, x, gate, up):
        """The SwiGLU feed-forward's gate and up: where they are one fused group [gate; up] of equal halves and
        the prefill GEMM ops.matmul would run is the Q8_0 one (ops.swiglu_fusable), one GEMM launch with
        silu(gate) * up and its q8_1 blocks (the down projection's input) in the epilogue; otherwise the
        composition (matmul_many, then swiglu)."""
        rec = gate.group if isinstance(gate, CupyWeight) else None
        if rec is not None and rec.q is not None and isinstance(up, CupyWeight) and up.group is rec \
                and (gate.index, up.index) == (0, 1) and len(rec.ranges) == 2 \
                and rec.ranges[0][1] * 2 == rec.ranges[1][1]:
            big = rec.q
            T = math.prod(x.shape[:-1])
            path = self._matmul_path(T, big)
            if ops.swiglu_fusable(big, T, path):
                with self._dev:
                    h, q8 = ops.matmul_swiglu(_f32(x).reshape(T, x.shape[-1]), big, path)
                    ops.register_quantized(h, q8)  # the down projection's int8 input
                return h.reshape(*x.shape[:-1], big.rows // 2)
        return super().matmul_swiglu(x, gate, up)

    def matmul_add(self, x, w: CupyWeight, residual):
        with self._dev:
            x2 = _f32(x).reshape(-1, x.shape[-1])
            path = self._matmul_path(x2.shape[0], w.q)
            if path == "hfma2" or residual.size != x2.shape[0] * w.q.rows:
                return super().matmul_add(x, w, residual)
            y = ops.matmul(x2, w.q, path, residual=residual)  # residual added in the GEMV epilogue
            return y.reshape(*x.shape[:-1], w.q.rows)

    def gdn_decode(self, mixed, z, b, alpha, conv_state, ssm_state, conv_w, ssm_a, dt_bias, norm_w, *,
                   n_k: int, n_v: int, dk: int, dv: int, eps: float):
        kw = int(conv_w.shape[1])
        supported = fused.gdn_decode_supported(n_k, n_v, dk, dv, kw)
        if supported and not fused.gdn_counters_ready(n_k):
            if self._capture is not None:  # a memset in a capture is only recorded: make them eagerly
                raise _CacheFull("gdn_decode counters are made by an eager step; the next one captures")
            with self._dev:
                fused.make_gdn_counters(n_k)
        if mixed.shape[0] != 1 or not supported:
            return super().gdn_decode(mixed, z, b, alpha, conv_state, ssm_state, conv_w, ssm_a, dt_bias,
                                      norm_w, n_k=n_k, n_v=n_v, dk=dk, dv=dv, eps=eps)
        with self._dev:
            y, q8 = fused.gdn_decode(mixed, z, b, alpha, conv_state, ssm_state, conv_w, ssm_a, dt_bias, norm_w,
                                     n_k=n_k, n_v=n_v, dk=dk, dv=dv, eps=eps,
                                     want_q8=self.gemv_path.startswith("dp4a"))
            if q8 is not None:
                ops.register_quantized(y, q8)  # ssm_out's int8 input
            return y

    def gated_attention(self, qg, k, v, cache, q_norm, k_norm, positions, *, n_rot: int, base: float,
                        sections=(), scale: float, eps: float, window: int = 0):
        T, nh, _, d = qg.shape
        n_kv, dv = k.shape[1], v.shape[2]
        kv_type = _fused_kv_type(cache)
        fast = (T == 1 and kv_type != "" and cache.k is not None
                and fused.attention_supported(nh, n_kv, d, dv)
                and (self._capture is not None or cache.length + 1 <= cache.capacity))
        if not fast:  # prefill, q3 caches, other shapes, and an eager step that must grow the cache
            return super().gated_attention(qg, k, v, cache, q_norm, k_norm, positions, n_rot=n_rot, base=base,
                                           sections=sections, scale=scale, eps=eps, window=window)
        with self._dev:
            comp_d, inv_freq, _ = self._rope_table(n_rot, base, sections)
            pos = np.asarray(positions, dtype=np.int64)
            if self._capture is not None:
                pos3 = self._capture.positions_dev(pos)
                row_ptr, row = self._capture.cache_row(cache), 0
            else:
                p = pos.reshape(1, 1) if pos.ndim == 1 else pos.reshape(3, 1)
                pos3 = cp.asarray(np.ascontiguousarray(np.broadcast_to(p, (3, 1)), dtype=np.int32))
                row_ptr, row = None, cache.length
            q = fused.attn_prep(qg, k, v, q_norm, k_norm, cache.k, cache.v, row, row_ptr, pos3, comp_d,
                                inv_freq, n_rot, eps, kv_type=kv_type)
            cache.length += 1
            o, q8 = fused.attention_decode_gated(q, qg, cache.k, cache.v, cache.length, float(scale),
                                                 int(window), kv_len_ptr=row_ptr,
                                                 want_q8=self.gemv_path.startswith("dp4a"), kv_type=kv_type)
            if q8 is not None:
                ops.register_quantized(o, q8)  # attn_output's int8 input
            return o

    # ---- one decode token of each of B sequences (base.FusedOpsMixin; fused.py) --------
    def _pointer_table(self, arrays) -> Any:
        """The device table of the arrays' addresses (fused.pointer_table): for an eager step the cached
        one; in a batch capture the graph's own (_BatchCapture.table), written after the capture and
        whenever the graph is bound to other sequences."""
        if isinstance(self._capture, _BatchCapture):
            return self._capture.table(arrays)  # the graph's own, written outside it
        ptrs = tuple(int(a.data.ptr) for a in arrays)
        tab = fused.cached_pointer_table(ptrs)
        if tab is None:
            if self._capture is not None:
                raise _CacheFull("pointer tables are made by an eager step; the next one captures")
            tab = fused.pointer_table(ptrs)
        return tab

    def gdn_decode_batch(self, mixed, z, b, alpha, conv_states, ssm_states, conv_w, ssm_a, dt_bias, norm_w, *,
                         n_k: int, n_v: int, dk: int, dv: int, eps: float):
        B = mixed.shape[0]
        kw = int(conv_w.shape[1])
        if self._capture is not None and not isinstance(self._capture, _BatchCapture) or \
                not fused.gdn_decode_supported(n_k, n_v, dk, dv, kw):
            return super().gdn_decode_batch(mixed, z, b, alpha, conv_states, ssm_states, conv_w, ssm_a, dt_bias,
                                            norm_w, n_k=n_k, n_v=n_v, dk=dk, dv=dv, eps=eps)
        if not fused.gdn_counters_ready(B * n_k):
            if self._capture is not None:  # a memset in a capture is only recorded: make them eagerly
                raise _CacheFull("gdn_decode counters are made by an eager step; the next one captures")
            with self._dev:
                fused.make_gdn_counters(B * n_k)
        with self._dev:
            y, q8 = fused.gdn_decode_batch(mixed, z, b, alpha, conv_states, ssm_states,
                                           self._pointer_table(conv_states), self._pointer_table(ssm_states),
                                           conv_w, ssm_a, dt_bias, norm_w, n_k=n_k, n_v=n_v, dk=dk, dv=dv,
                                           eps=eps, want_q8=self.gemv_path.startswith("dp4a"))
            if q8 is not None:
                ops.register_quantized(y, q8)  # ssm_out's int8 input
            return y

    def gated_attention_batch(self, qg, k, v, caches, q_norm, k_norm, positions, *, n_rot: int, base: float,
                              sections=(), scale: float, eps: float, window: int = 0):
        """One launch per kernel for all B sequences when their caches are f32, f16 or q8_0 caches of one
        type and shape (q3 caches and other shapes: the per-sequence loop)."""
        B, nh, _, d = qg.shape
        n_kv, dv = k.shape[1], v.shape[2]
        kv_type = ""
        if len(caches) == B and len(positions) == B and B:
            first = caches[0]
            kv_type = _fused_kv_type(first)
            if kv_type and (first.k is None or any(
                    type(c) is not type(first) or c.k is None or c.k.shape[1:] != first.k.shape[1:]
                    or c.v.shape[1:] != first.v.shape[1:] for c in caches)):
                kv_type = ""
        fast = (kv_type != ""
                and fused.attention_supported(nh, n_kv, d, dv)
                and (self._capture is None or isinstance(self._capture, _BatchCapture)))
        if not fast:
            return super().gated_attention_batch(qg, k, v, caches, q_norm, k_norm, positions, n_rot=n_rot,
                                                 base=base, sections=sections, scale=scale, eps=eps, window=window)
        with self._dev:
            comp_d, inv_freq, _ = self._rope_table(n_rot, base, sections)
            cap = self._capture
            if isinstance(cap, _BatchCapture):
                pos = cap.sequence_positions(positions)
                rows = cap.cache_rows(caches)  # raises _CacheFull when a cache has no room (eager step)
            else:
                for c in caches:
                    c.reserve(c.length + 1)  # grows before its addresses go into the table
                pos = cp.asarray(np.stack([_pos3(p) for p in positions]).astype(np.int32))  # (B, 3)
                rows = cp.asarray(np.array([c.length for c in caches], dtype=np.int32))
            # slices sized for the capacities, eager or captured (lengths are only known on the device in
            # a graph), so that a replayed step computes exactly what the eager step does
            spans = [c.capacity for c in caches]
            k_tab = self._pointer_table([c.k for c in caches])
            v_tab = self._pointer_table([c.v for c in caches])
            o, q8 = fused.attention_decode_batch(qg, k, v, q_norm, k_norm, k_tab, v_tab, rows, pos, comp_d,
                                                 inv_freq, n_rot, eps, float(scale),
                                                 fused.decode_batch_splits(spans, n_kv), int(window),
                                                 want_q8=self.gemv_path.startswith("dp4a"), kv_type=kv_type)
            for c in caches:
                c.length += 1
            if q8 is not None:
                ops.register_quantized(o, q8)  # attn_output's int8 input
            return o

    # ---- mixture of experts ----------------------------------------------------------------------
    def moe(self, x, router: CupyWeight, gate_exps: CupyWeight, up_exps, down_exps: CupyWeight, k: int):
        with self._dev:
            x = _f32(x)
            T = x.shape[0]
            ids, wts = self._route(x, router, k)
            ups = None if up_exps is None else up_exps.q
            path = self.gemv_path if T <= moe_kernels.DECODE_MAX_T else self.gemm_path
            if path.startswith("dp4a") and moe_kernels.supported(gate_exps.q, ups, down_exps.q):
                # decode: 2 launches for all experts; prefill: sort by expert + grouped GEMMs (moe.cu)
                return moe_kernels.routed_experts(x, ids, wts, gate_exps.q, ups, down_exps.q, int(k),
                                                  nblk=2 if path == "dp4a2" else 1)
            path = self.gemv_path
            if up_exps is None:  # fused gate+up: first Fe rows gate, next Fe rows up
                gu = ops.matmul_experts(x, gate_exps.q, ids, int(k), path)
                fe = gu.shape[1] // 2
                h = ops.ewise("swiglu", cp.ascontiguousarray(gu[:, :fe]), cp.ascontiguousarray(gu[:, fe:]))
            else:
                gate = ops.matmul_experts(x, gate_exps.q, ids, int(k), path)
                up = ops.matmul_experts(x, up_exps.q, ids, int(k), path)
                h = ops.ewise("swiglu", gate, up)
            y = ops.matmul_experts(h, down_exps.q, ids, 1, path)
            return ops.moe_combine(y, wts, T, int(k))

    @staticmethod
    def _route(x, router: CupyWeight, k: int):
        """A MoE block's routing of x (float32): (ids (T*k,) int32, weights (T*k,)), fp32 logits (the
        router stays fp32, doc 3.6) through ops.moe_route."""
        return ops.moe_route(ops.matmul(x, router.q, "fma"), int(k))

    def moe_route_rows(self, x, router: CupyWeight, k: int):
        """Backend.moe_route_rows, routed as `moe` routes (_route)."""
        with self._dev:
            x = _f32(x)
            T, H = x.shape
            ids, wts = self._route(x, router, k)
            out = cp.empty((T, H + 2 * int(k)), dtype=cp.float32)
            out[:, :H] = x
            out[:, H : H + k] = ids.reshape(T, k)  # expert ids < 2**24: exact in float32
            out[:, H + k :] = wts.reshape(T, k)
            return out

    def moe_block(self, x, router, gate_exps, up_exps, down_exps, k: int, shared=None, residual=None):
        """A few tokens on the DP4A path: the whole block in three or four launches (kernels/moe.py
        decode_block); anything else (prefill, the FMA / HFMA2 paths, other formats) composed."""
        T = int(x.shape[0]) if x.ndim == 2 else -1
        ws = [router, gate_exps, down_exps] + ([] if up_exps is None else [up_exps])
        if shared is not None:
            ws += [shared.gate_inp, shared.gate, shared.up, shared.down]
        if 0 < T <= moe_kernels.DECODE_MAX_T and self.gemv_path.startswith("dp4a") and \
                all(isinstance(w, CupyWeight) for w in ws) and (residual is None or residual.shape == x.shape):
            sh = None if shared is None else moe_kernels.SharedExpert(shared.gate_inp.q, shared.gate.q,
                                                                     shared.up.q, shared.down.q)
            ups = None if up_exps is None else up_exps.q
            if moe_kernels.decode_block_problem(router.q, gate_exps.q, ups, down_exps.q, int(k), sh) is None:
                with self._dev:
                    return moe_kernels.decode_block(_f32(x), router.q, gate_exps.q, ups, down_exps.q, int(k),
                                                    sh, None if residual is None else _f32(residual))
        return super().moe_block(x, router, gate_exps, up_exps, down_exps, k, shared, residual)

    # ---- sampling helpers --------------------------------------------------------------------------
    def top_k(self, logits, k: int) -> TopLogits:
        if k > ops.TOPK_MAX:  # ops.top_k would sort the rows with CuPy's argsort: not inside a graph
            raise ValueError(f"top_k on the device takes at most {ops.TOPK_MAX} logits, got {k}")
        dev = self._dev
        with dev:
            logits = cp.ascontiguousarray(logits, dtype=cp.float32).reshape(-1, logits.shape[-1])
            cap = self._capture
            feed = cap.feed if cap is not None and logits.shape[0] == 1 else None  # a captured step of one sequence
            penalized = False
            if cap is not None and feed is not None and cap.penalizing:
                # the sampler's penalties over the whole row first (the feed's table)
                ops.penalize(logits[0], feed.arr, feed.table, cap.penalty_params())
                penalized = True
            vals, ids = ops.top_k(logits, int(k))
            picks = None
            if cap is not None and feed is not None:
                # it draws its pick into the feed: a chained next step's token
                ops.pick_top(vals, ids, cap.pick_params(), out=feed.arr)
                picks = self.to_numpy(feed.arr)

            def fetch(r: int):  # the whole row, for a pick the top logits do not decide
                with dev:
                    return cp.asnumpy(logits[r])

            return TopLogits(self.to_numpy(vals), self.to_numpy(ids), fetch=fetch, picks=picks, penalized=penalized)

    # ---- CUDA-graph decode ---------------------------------------------------------------------------
    def graph_step(self, key, run, ids, positions, *, owner, watch=None, host_in=None, host_out=None,
                   after=None, wait: bool = True, link_seconds: tuple[float, float] = (0.0, 0.0),
                   chained: bool = False, pick: PickSpec | None = None):
        """Run `run` for one decode token as a CUDA graph kept under `key` (captured on the first call,
        replayed after that while it stays valid): each stage of a model's decode step
        (engine/execution.py; a single device is one stage). One launch per token instead of ~1,000
        kernel launches, and one host wait.

        run(x) is the eager step on this backend: x is `ids` (a stage that embeds the token) or, with
        `host_in`, a (1, H) device array the graph fills from that pinned float32 host array; it
        returns host logits through to_numpy, or, with `host_out`, the device hidden state the graph
        copies into that pinned host array. owner: the sequence's states (identity); watch: the
        states `run` touches (default owner; a reallocation invalidates the graph, as does a cache
        that must grow: that step runs eagerly and the next one re-captures).
        after: a CUDA event (of the previous stage, on any device) this step must follow; wait=False
        (with host_out): launch and return an event the next stage can follow instead of waiting;
        wait=False without host_out: launch and return a LaunchedStep whose result() waits for the
        host logits (a replay; a capture runs the step and returns its logits).
        pick (a stage that embeds its token and returns top logits): how the step draws the next token
        from them on the device (ops.pick_top) into the sequence's feed; the TopLogits returned carry it
        (picks). chained (a stage that embeds its token, wait=False): the token is the pick of this
        sequence's previous step, which must have been a graph launch with a pick and may still be
        running: the step is launched behind it without the host seeing that pick (ids unused), on the
        other of the sequence's two graphs of this key (_Feed). None: not possible now (the caller
        waits for the previous step and launches with its token). A pick with penalties (its history)
        has the step apply them to its row first, from the sequence's table (_Feed), in
        graphs of their own; a stage that does not embed its token leaves them to the host.
        link_seconds: (before the copy from host_in, after the copy to host_out) a simulated riser's
        time (engine/rig.py), held on the graph's stream by nodes of the graph itself, where a real
        riser's copies would take it.
        Returns host logits (1, vocab), True when the output is in `host_out`, an event when it will
        be once that event completes, or None when this step cannot use a graph (nothing ran and
        `after` was not waited for: the caller waits for it and runs the step eagerly).

        A batched decode step (engine/execution.py launch_batch: len(ids) = B > 1 sequences, one token
        each) comes with owner = a tuple of the sequences' state lists and positions = a tuple of their
        own position arrays; it returns host logits (B, vocab) (with wait=False a replay returns a
        LaunchedStep of them) or None (see _graph_batch_step)."""
        if self.use_graphs and self._capture is None and len(ids) > 1 and isinstance(owner, tuple):
            return self._graph_batch_step(key, run, ids, positions, owner, watch, wait)  # [batched decode]
        if not self.use_graphs or self._capture is not None or len(ids) != 1:
            return None
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if pos.size not in (1, 3):
            return None
        watch = owner if watch is None else watch
        io = (host_in, host_out)
        feed = self._feed_of(owner)  # None before the sequence's first graph
        history = pick.history if pick is not None and host_in is None else None
        if chained:
            if feed is None or not feed.fresh or wait or host_in is not None or host_out is not None:
                return None
            if history is not None and not feed.table_follows(history):
                return None
            feed.parity ^= 1  # the graph not running now
        elif history is not None:
            feed = _Feed() if feed is None else feed
            with self._dev:
                feed.sync_table(history, int(ids[0]))
        key = (key, feed.parity if feed is not None else 0, history is not None)  # penalizing: a graph of its own
        rec = self._graphs.get(key)
        if rec is not None and not rec.valid(owner, watch, io, link_seconds):
            self._graphs.pop(key, None)
            rec = None
        with self._dev:
            if rec is None:
                if after is not None:
                    after.synchronize()  # capturing runs the step once, with a host wait
                out = self._capture_graph(key, run, ids, pos, owner, watch, io, link_seconds, feed, chained, pick)
                if out is None and feed is not None:
                    feed.fresh = False  # the caller runs the step eagerly: its pick is not in the feed
                return out
            if host_out is None and not wait:  # host logits the caller takes later (Executor.launch_decode)
                rec.replay(int(ids[0]), pos, after, wait=False, chained=chained, pick=pick)
                return LaunchedStep(rec.finish)
            return rec.replay(int(ids[0]), pos, after, wait or host_out is None, pick=pick)

    def _feed_of(self, owner) -> _Feed | None:
        """The token feed of `owner`'s decode graphs (shared by them all), or None before its first one."""
        for rec in self._graphs.values():
            if rec.states is owner and rec.cap.feed is not None:
                return rec.cap.feed
        return None

    def _record(self, cap, body) -> tuple[Any, list]:
        """Capture body() into a CUDA graph (launched on this backend's graph stream), with `cap` (a _Capture or
        _BatchCapture) as the step's book-keeping: its inputs copied by the graph's first node, every
        allocation kept for the replays. -> (graph, the kept allocations). When the capture fails the
        caches' host lengths are put back and the error is raised again (the caller decides whether
        that step, or that kind of step, stays eager)."""
        # captured on a stream of its own, non-blocking: device work that other threads queue on the
        # legacy stream meanwhile (a request's new session zeroing its states, a snapshot) is then not
        # tied to the capture, which a blocking stream would make it (cudaErrorStreamCaptureImplicit,
        # seen in tools/bench_batch_gpu.py when a request arrived while the scheduler captured a batch).
        # Nothing runs on it: cap.stream is the graph stream again for the launches.
        replay_stream = cap.stream
        stream = self._capture_stream()
        cap.stream = stream
        pool = cp.get_default_memory_pool()
        kept: list = []

        def keep_alloc(size):
            mem = pool.malloc(size)
            kept.append(mem)  # the graph reuses these addresses on every replay
            return mem

        self._capture = cap
        # no cyclic garbage collection while capturing: a collection that frees another object's pinned
        # buffer or graph (cudaFreeHost, cudaGraphDestroy) puts work on the legacy stream, which
        # invalidated the capture when it ran on the blocking graph stream (seen on the H200 as
        # cudaErrorStreamCaptureImplicit in tools/bench_batch_gpu.py's run after other tests)
        try:
            with host_func.paused_gc(), stream:
                cp.cuda.set_allocator(keep_alloc)
                try:
                    from minecart.kernels.probe import begin_capture

                    begin_capture(stream)
                    try:
                        cap.copy_inputs()
                        body()
                    finally:
                        graph = stream.end_capture()
                finally:
                    cp.cuda.set_allocator(pool.malloc)
        except Exception:
            for cache, length in cap.caches:
                cache.length = length  # undo the host bookkeeping of the aborted capture
            raise
        finally:
            self._capture = None
            cap.stream = replay_stream
        return graph, kept

    def _capture_graph(self, key, run, ids, pos, owner, watch, io, link_seconds, feed=None, chained=False,
                       pick: PickSpec | None = None):
        host_in, host_out = io
        cap = _Capture(self._graph_stream_for_capture())
        if host_in is None:  # the stage embeds its token: from the sequence's feed (a new one at first)
            cap.feed = feed if feed is not None else _Feed()
        cap.write_inputs(int(ids[0]), pos, pick)

        def body() -> None:
            y = run(ids if host_in is None else cap.receive(host_in, link_seconds[0]))
            if host_out is not None:
                cap.send(y, host_out, link_seconds[1])
            else:
                cap.result = y

        try:
            graph, kept = self._record(cap, body)
        except Exception as exc:
            self.graph_capture_error = f"{type(exc).__name__}: {exc}"
            if not _cache_full(exc):
                self.use_graphs = False  # this model/backend pair cannot be captured: stay eager
            return None
        if host_out is None and not cap.outputs:
            return None
        rec = _DecodeGraph(graph, cap, kept, owner, watch, io, link_seconds)
        # the live graphs of one sequence (one per stage this backend runs); others are dropped
        self._graphs = {k: g for k, g in self._graphs.items() if g.states is owner}
        self._graphs[key] = rec
        cap.launch(graph, chained)
        cap.wait()
        return rec.result()

    def hold(self, seconds: float, after=None):
        """Hold this backend's decode-graph stream for `seconds`, starting once `after` (a CUDA event of
        any device; None: the work already queued there) has completed, and return an event recorded
        at the end of the hold, without a host wait. engine/rig.py charges a simulated link's time with
        it between the stages of a split decode step, where a real riser's copy would take it."""
        stream = self._graph_stream_for_capture()
        with self._dev:
            if after is not None:
                stream.wait_event(after)
            link.hold(stream, seconds)
            if self._hold_done is None:
                # one event, recorded again each hold: the next stage queues its wait on it at once
                self._hold_done = cp.cuda.Event(disable_timing=True)
            self._hold_done.record(stream)
        return self._hold_done

    def _capture_stream(self):
        """The non-blocking stream decode graphs are captured on (made on first use; see _record)."""
        if self._cap_stream is None:
            self._cap_stream = cp.cuda.Stream(non_blocking=True)
        return self._cap_stream

    def _graph_stream_for_capture(self):
        """The stream decode graphs are launched on (made on first use; captured on _capture_stream)."""
        if self._graph_stream is None:
            # a blocking stream: ordered with the eager work that CuPy issues on the legacy stream
            self._graph_stream = cp.cuda.Stream(non_blocking=False)
        return self._graph_stream

    # ---- [batched decode graphs] -------------------------------------------------------------------
    def _graph_batch_step(self, key, run, ids, positions, owners: tuple, watch, wait: bool = True):
        """graph_step for a decode step of B = len(ids) sequences, one token each (engine/execution.py
        launch_batch): positions holds each sequence's own position array ((1,) or (3, 1)), owners
        each sequence's state list, watch every state the step touches. One graph per key (the
        executor's ("batch", B, top)): replayed while the same sequences decode, bound to the new ones
        when they changed (_BatchGraph.bind: any sequences of the same layouts); otherwise captured the
        second time in a row the same sequences decode together, so a set that changes every step never
        pays a capture. Returns what `run` returns (host logits (B, vocab) or their top logits; a replay
        with wait=False: a LaunchedStep of them, its wait left to result()), or None: run eagerly (a
        new set no graph can take, a cache that must grow, or a batch size that cannot be captured: it
        then stays eager)."""
        n = len(ids)
        ident = tuple(map(id, owners))
        again, self._batch_last = ident == self._batch_last, ident
        if n in self._batch_eager or len(positions) != n or len(owners) != n:
            return None
        # graphs of sequences that have ended hold their states: let them go, and the graphs too unless
        # they can be bound to others
        for g in self._batch_graphs.values():
            if g.rebinding is not None and (g.released or not g.alive()):
                g.release()
        self._batch_graphs = {k: g for k, g in self._batch_graphs.items() if g.alive() or g.released}
        rec = self._batch_graphs.pop(key, None)
        with self._dev:
            if rec is not None and not rec.valid(owners, watch):
                if rec.bind(owners):
                    self.batch_rebinds += 1
                elif not again:
                    self._batch_graphs[key] = rec  # kept for the sequences it may serve next
                    return None
                else:
                    rec = None
            if rec is None:
                return self._capture_batch(key, run, ids, positions, owners, watch) if again else None
            self._batch_graphs[key] = rec  # most recently used last
            launched = rec.launch_batch(ids, positions)
            return launched.result() if wait else launched

    def _capture_batch(self, key, run, ids, positions, owners: tuple, watch):
        cap = _BatchCapture(self._graph_stream_for_capture(), len(ids))
        cap.write_batch(ids, positions)
        cap.bind(positions)
        try:
            def body() -> None:
                cap.result = run(ids)

            graph, kept = self._record(cap, body)
        except Exception as exc:
            self.batch_capture_error = f"{type(exc).__name__}: {exc}"
            if not _cache_full(exc):
                self._batch_eager.add(len(ids))  # e.g. a host sync inside: this size runs eagerly
            return None
        if not cap.outputs:
            self._batch_eager.add(len(ids))
            self.batch_capture_error = "the captured step produced no host output"
            return None
        rec = _BatchGraph(graph, cap, kept, owners)
        while len(self._batch_graphs) >= BATCH_GRAPHS_KEPT:
            self._batch_graphs.pop(next(iter(self._batch_graphs)))
        self._batch_graphs[key] = rec
        graph.launch(cap.stream)
        cap.wait()
        return rec.result()

    # ---- measurements (bench, probe) --------------------------------------------------------------
    def measure_ceilings(self, seconds: float = 0.3) -> dict:
        """Copy bandwidth (GB/s, bytes read + written), DP4A (TOPS) and fp32 FMA (TFLOP/s) of this card."""
        from minecart.kernels import probe

        with self._dev:
            return probe.measure_ceilings(seconds)

    def time_matmul(self, x, w: CupyWeight, reps: int = 20) -> float:
        """GPU seconds of one matmul(x, w) on this backend's chosen path (no Python overhead)."""
        from minecart.kernels import probe

        with self._dev:
            x2 = _f32(x).reshape(-1, x.shape[-1])
            path = self._matmul_path(x2.shape[0], w.q)
            return probe.time_gpu(lambda: ops.matmul(x2, w.q, path), reps)

    # What the placement estimate is compared with (engine/multidevice.py `_memory_report`): the CUDA
    # context (`context_bytes`) plus the highest total of CuPy's memory pool on this device over the
    # samples a run takes (`sample_memory` after prefill and after decode; `memory_peak`). The pool keeps
    # freed blocks for reuse, so its total is what the process holds from the device, holes included.
    # Device memory outside the pool (kernel modules loaded later, graph executables, the driver's page
    # rounding, other processes) is `outside_pool_bytes`.
    def memory_used(self) -> int:
        """Bytes held by CuPy's pool on this device (weights, caches, scratch, free blocks it keeps)."""
        with self._dev:
            return int(cp.get_default_memory_pool().total_bytes())

    @property
    def context_bytes(self) -> int:
        """Device memory in use when this process first made a backend on this device, less what the
        pool held then: the CUDA context (driver state, local memory reservation), plus anything other
        processes held at that moment."""
        return _CONTEXT_BYTES.get(self.index, 0)

    def sample_memory(self) -> int:
        """Note the pool's total now for `memory_peak` and return it."""
        now = self.memory_used()
        self._pool_peak = max(self._pool_peak, now)
        return now

    def reset_memory_peak(self) -> None:
        """Start a new `memory_peak` window at the pool's total now."""
        self._pool_peak = self.memory_used()

    def memory_peak(self) -> int:
        """Highest pool total seen by sample_memory since reset_memory_peak (or creation), now included."""
        return max(self._pool_peak, self.memory_used())

    def outside_pool_bytes(self) -> int:
        """Device memory in use now that the pool does not account for (the CUDA context included)."""
        return self.peak_memory() - self.memory_used()

    def release_cached(self) -> None:
        """Drop captured decode graphs, this thread's cached q8_1 / fp16 activation copies and return the
        memory pool's unused blocks to the driver (between benchmark configurations, so each one's memory
        is measured alone: a small array left alive keeps its whole pool chunk). The RoPE tables go too;
        they are made again when next needed."""
        self._graphs = {}
        self._batch_graphs = {}  # [batched decode]
        self._rope_tables = {}
        from minecart.kernels import hfma2

        for local in (ops._LAST_Q, hfma2._LAST):
            local.__dict__.clear()
        with self._dev:
            cp.get_default_memory_pool().free_all_blocks()
        self._pool_peak = self.memory_used()

    def peak_memory(self) -> int:
        """Device memory in use now (device total - free): everything of every process on this GPU."""
        with self._dev:
            free, total = cp.cuda.runtime.memGetInfo()
            return int(total - free)


_CONTEXT_BYTES: dict[int, int] = {}  # device index -> CupyBackend.context_bytes


def _note_context_bytes(index: int) -> None:
    """Measure the CUDA context of device `index` once per process, the first time a backend is made
    there: device memory in use (memGetInfo makes the context if there is none yet) less what CuPy's
    pool already holds on it."""
    if index in _CONTEXT_BYTES:
        return
    try:
        with cp.cuda.Device(index):
            free, total = cp.cuda.runtime.memGetInfo()
            _CONTEXT_BYTES[index] = int(total - free) - int(cp.get_default_memory_pool().total_bytes())
    except cp.cuda.runtime.CUDARuntimeError:
        pass


__all__ = ["CupyBackend", "CupyF16KVCache", "CupyKVCache", "CupyQ3KVCache", "CupyQ8KVCache", "CupyWeight",
           "WeightArena", "device_count", "gpu_uuid", "held_array_bytes"]
