"""Routed experts that live apart from their layer: the layer on one device, its experts on another.

A mixture-of-experts model is mostly experts (Qwen3.6-35B-A3B: ~95% of the bytes), and a token reads
only a few of them. When the GPUs run out of memory, the experts can stay in host RAM: the layer's
attention / Gated DeltaNet, norms and shared expert run on the GPU, and each MoE block's routed
experts run where it pays:

- a decode token (and any short chunk) on the CPU backend next to the weights (the NumPy backend,
  which uses the integer kernels of engine/cpu_experts.py for one token). The layer's router stays on
  the GPU and routes there (`moe_route_rows`), so only the hidden state and its routing cross the
  link: one (T, hidden + 2k) row block there and a (T, hidden) one back per MoE layer, and the host
  does nothing but the experts (routing on the host read the float32 router, 2 MiB a layer, on one
  core: 9 ms of a 35 ms 35B-A3B token on the H200 host);
- a prefill chunk of at least `stream_min_tokens` tokens on the GPU: the layer's experts are copied
  over the link into a GPU staging buffer (engine/backends/expert_stream.py, double-buffered: the
  next host-held layer's copy starts when this layer's MoE starts) and the GPU's own `moe` runs
  them. The threshold is arithmetic (engine/placement.py stream_min_tokens_for): stream when copying
  the layer's expert bytes over the link takes less time than the CPU computing the chunk's tokens.

`ExpertsApart` is the device backend of such a device: a thin proxy that passes every op to the real
backend except `moe` on expert weights held by the experts' backend. Every part on that device shares
the one proxy (the executor runs a device's parts through one backend). With the experts in host
RAM the round trip is queued as the GPU's own stream work, so a decode step still replays as one CUDA
graph: one kernel that posts the call to the expert pool's waiting CPU threads and waits for their
answer (DeviceHooks.expert_call, engine/expert_pool.py) where the integer kernels take the experts'
types, else a copy to pinned memory, a host function that runs the experts on the CPU, a copy back
(DeviceHooks.host_round_trip); experts on another GPU go through the calling thread and that device's
decode runs eagerly.

What this is not: the placement of experts (engine/placement.py prices and plans them per layer;
load_model's `experts` option puts them), or the GPU MoE kernels (the backend's `moe`).
"""

from __future__ import annotations

import os
import re
from typing import Any

from .backends.base import Backend, DeviceHooks, MoeShared, compose_moe_block
from .backends.numpy_backend import NumpyBackend
from .expert_pool import ExpertChannel, ExpertPool, shared_pool
from .placement import (
    CPU_SPEED,
    DEFAULT_LINK,
    DeviceSpeed,
    Link,
    host_expert_seconds,
    stream_min_tokens_for,
)
from .rig import RigBackend
from .sampling import PickSpec
from .threads import expert_threads

_LAYER = re.compile(r"blk\.(\d+)\.")


def _bucket(T: int) -> int:
    """Rows of the pinned buffers that hold T tokens' rows (ExpertsApart._host_buffers): the next power of two."""
    return 1 << max(0, T - 1).bit_length()


def _measured_link(inner: Backend, experts: Backend) -> Link | None:
    """The GPU's own link to host RAM as measured on it (DeviceHooks.host_copy_rate), when `experts`
    are in host RAM: a card on a Gen1 x1 riser is not the desktop slot DEFAULT_LINK assumes, and the
    stream threshold set from the slot's rate would stream every 2K-token chunk's experts over the
    riser (a 35B-A3B's 13.6 GB: 54 s a chunk, where the CPU takes 21 s)."""
    if not str(experts.device).startswith("cpu"):
        return None
    gpu = inner.inner if isinstance(inner, RigBackend) else inner
    rate = gpu.host_copy_rate() if isinstance(gpu, DeviceHooks) else None
    return None if rate is None else Link(rate[0], rate[1], "measured on the card")


class ExpertsApart:
    """`inner` runs everything except the routed experts whose weights `experts` holds.

    Streaming host-held experts to the GPU for long prefill chunks is on when `inner` is a CUDA
    backend and `experts` a host one (set `streaming = False`, or the environment variable
    MINECART_NO_EXPERT_STREAM, to compute every chunk on the host). `min_stream_tokens` overrides
    the computed threshold (tests); `link` / `cpu` are its inputs: the GPU's link (a rig's simulated
    link when there is one, else the card's own as measured on it, else DEFAULT_LINK) and the host's
    speed, whose integer expert kernels run a chunk that is not streamed one token after another
    (placement.host_expert_seconds, until the expert pool has measured its own rate).
    Counters: host_moe_calls (MoE blocks run on the host), streamed_moe_calls (run on the GPU with
    streamed experts)."""

    def __init__(self, inner: Backend, experts: Backend, *, link: Link | None = None,
                 cpu: DeviceSpeed | None = None, stream: Any = None):
        self._inner = inner
        self.experts = experts
        self._held: set[int] = set()  # id() of the expert weights loaded on `experts`
        self._routers: dict[int, Any] = {}  # layer -> its router on `inner` (experts in host RAM)
        self._layer_of: dict[int, int] = {}  # id() of a held layer's first expert tensor -> layer index
        self.device = inner.device
        self.name = inner.name
        self._host_calls = 0  # MoE blocks run on the host by this thread (the pool counts its own)
        self.streamed_moe_calls = 0
        rig_link = inner.rig_device.link if isinstance(inner, RigBackend) else None
        self.link = link or rig_link or _measured_link(inner, experts) or DEFAULT_LINK
        self.cpu = cpu or CPU_SPEED
        self.min_stream_tokens: int | None = None
        self.streaming = not os.environ.get("MINECART_NO_EXPERT_STREAM")
        # backends.expert_stream.ExpertStream, made for the first held layer when none is given (a
        # given one, with its add_layer / prefetch / acquire / release / settle, serves the tests)
        self._stream: Any = stream
        # the host backend under a rig's proxy: its moe_routed runs a layer's experts (_run_host)
        host = experts.inner if isinstance(experts, RigBackend) else experts
        self._host: NumpyBackend | None = host if isinstance(host, NumpyBackend) else None
        if self._host is not None and self._host.expert_threads is None and inner.pins_host_memory:
            # host-RAM experts of a GPU's layers: every core (threads.expert_threads)
            self._host.expert_threads = expert_threads(beside_gpu=True)
        self._simulated = rig_link is not None
        # routed experts in host RAM as stream work (_host_moe): each layer's expert weights and k, the
        # pinned row buffers by power-of-two row count, the first error a host function met
        self._host_args: dict[int, tuple[Any, Any, Any, int]] = {}
        self._pinned: dict[int, tuple[Any, Any]] = {}
        self._host_error: BaseException | None = None
        self._host_fn = self._run_host  # one bound method: its identity names the host function
        # a GPU's layers whose experts the integer kernels take: the expert pool's channel of this
        # device, each layer's entry in the pool, and the channel's answers before this proxy's first
        self._channel: ExpertChannel | None = None
        self._entries: dict[int, int] = {}
        self._answered_before = 0
        self.use_pool = not os.environ.get("MINECART_NO_EXPERT_POOL")

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)

    def __repr__(self) -> str:
        return f"ExpertsApart({self._inner!r}, experts on {self.experts.device})"

    @property
    def inner(self) -> Backend:
        return self._inner

    @property
    def host_moe_calls(self) -> int:
        """MoE blocks whose routed experts ran on the host (by the expert pool or a host function)."""
        served = 0 if self._channel is None else self._channel.answered - self._answered_before
        return self._host_calls + served

    @property
    def expert_pool(self) -> ExpertPool | None:
        """The expert pool serving this device's host-RAM layers (None until its first call, or where
        host functions run them)."""
        return None if self._channel is None else self._channel.pool

    @property
    def stream(self) -> Any:
        """The ExpertStream staging this device's host-held experts (None: they are never streamed)."""
        return self._stream

    def hold(self, weights: dict) -> None:
        """Note the weights of a "layer.<i>.experts" part, loaded on the experts' backend; on a GPU
        with host-held experts, also their page-locked copy for streaming."""
        self._held.update(id(w) for w in weights.values())
        experts = {n: w for n, w in weights.items() if w.role == "experts"}
        if not experts:
            return
        first = next(iter(experts.values()))
        m = _LAYER.match(first.name)
        if m is None:
            raise ValueError(f"'{first.name}' is not a layer tensor (blk.N.*)")
        key = int(m.group(1))
        for w in experts.values():
            self._layer_of[id(w)] = key
        if not self._host_nodes:
            return
        (router,) = [w for w in weights.values() if w.role != "experts"]
        self._routers[key] = self._inner.load_weight(router.info, role="matmul")
        stream = self._ensure_stream()
        if stream is not None:
            stream.add_layer(key, experts, self._routers[key])

    def release(self, weights: dict) -> None:
        self._held.difference_update(id(w) for w in weights.values())
        for w in weights.values():
            key = self._layer_of.pop(id(w), None)
            if key is not None and key in self._routers and key not in self._layer_of.values():
                self._inner.free(self._routers.pop(key))
                self._drop_entry(key)

    def _drop_entry(self, layer: int) -> None:
        entry = self._entries.pop(layer, None)
        if entry is not None and self._channel is not None:
            self._channel.pool.drop_entries([entry])

    def close(self) -> None:
        """Let go of the staging buffers and page-locked copies (waiting for any copy in flight), and
        of this device's entries and channel in the expert pool."""
        if self._channel is not None:
            pool = self._channel.pool
            pool.drop_entries(list(self._entries.values()))
            self._entries.clear()
            pool.release_channel(self._channel)
            self._host_calls, self._channel = self.host_moe_calls, None
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        for router in self._routers.values():
            self._inner.free(router)
        self._routers.clear()

    def _ensure_stream(self) -> Any:
        if self._stream is not None:
            return self._stream
        gpu = self._inner.inner if isinstance(self._inner, RigBackend) else self._inner
        if not (isinstance(gpu, DeviceHooks) and gpu.pins_host_memory and str(self.device).startswith("cuda")
                and str(self.experts.device).startswith("cpu")):
            return None
        # local import: CuPy is optional, and only a GPU with host-held experts needs the stream
        from .backends.expert_stream import make_stream

        inner = self._inner
        link = self.link if self._simulated else None
        self._stream = make_stream(gpu, inner, link.seconds if link is not None else None)
        return self._stream

    # ---- the MoE block ------------------------------------------------------------------------------
    def stream_min_tokens(self, layer: int, k: int) -> int:
        """Fewest tokens of a chunk for which layer `layer`'s experts are streamed to the GPU: the
        link's time for the layer's expert bytes over the host's time for a token of them. The host's
        time is the expert pool's own once it has served enough (ExpertPool.seconds_per_token: a rig's
        two-core CPU is not the 16-thread host the planner's figure was fitted on, and behind a slow
        link it should stream sooner), else the planner's (placement.host_expert_seconds)."""
        if self.min_stream_tokens is not None:
            return self.min_stream_tokens
        st = self._stream
        pool = self.expert_pool
        measured = pool.seconds_per_token() if pool is not None else None
        per_token = measured if measured is not None else host_expert_seconds(st.active_bytes(layer, k), self.cpu)
        return stream_min_tokens_for(st.layer_bytes(layer), per_token, self.link)

    def _apart_layer(self, gate_exps) -> int | None:
        """The layer whose routed experts `gate_exps` is, when they live apart from this device; None
        when they sit on it (the inner backend's own ops take them)."""
        return self._layer_of.get(id(gate_exps)) if id(gate_exps) in self._held else None

    def moe(self, x, router, gate_exps, up_exps, down_exps, k: int):
        layer = self._apart_layer(gate_exps)
        if layer is None:
            return self._inner.moe(x, router, gate_exps, up_exps, down_exps, k)
        st = self._stream
        T = int(x.shape[0])  # one token (decode) never pays for a layer's copy
        if st is not None and self.streaming and T > 1 and T >= self.stream_min_tokens(layer, k):
            return self._streamed_moe(layer, x, gate_exps, up_exps, down_exps, k)
        if self._host_nodes:
            return self._host_moe(layer, x, gate_exps, up_exps, down_exps, k)
        self._host_calls += 1
        xe = self.experts.asarray(self._inner.to_numpy(x))
        y = self.experts.moe(xe, router, gate_exps, up_exps, down_exps, k)
        return self._inner.asarray(self.experts.to_numpy(y))

    # ---- routed experts on the host, as stream work ------------------------------------------------
    @property
    def _host_nodes(self) -> bool:
        """The experts' backend is the host: the round trip runs as the device's stream work (copies
        and a host function: DeviceHooks.host_round_trip), which a captured decode graph holds."""
        return str(self.experts.device).startswith("cpu")

    def _host_moe(self, layer: int, x, gate_exps, up_exps, down_exps, k: int):
        T, H = int(x.shape[0]), int(x.shape[1])
        if T >= 1 << 31 or layer >= 1 << 31:
            raise ValueError(f"{T} tokens at layer {layer}: too many for one host round trip")
        host_x, host_y = self._host_buffers(T, H, int(k))
        entry = self._pool_entry(layer, gate_exps, up_exps, down_exps)
        if entry is not None:
            assert self._channel is not None
            y = self._inner.expert_call(x, self._routers[layer], int(k), host_x, host_y, self._channel, entry)
        else:
            rows = self._inner.moe_route_rows(x, self._routers[layer], int(k))  # (T, H + 2k)
            self._host_args[layer] = (gate_exps, up_exps, down_exps, int(k))  # what the host function reads
            y = self._inner.host_round_trip(rows, host_x, host_y, self._host_fn, (layer << 32) | T)
        self._raise_host_error()  # eagerly the experts have run by now (in a capture: they will)
        return y

    def _pool_entry(self, layer: int, gate_exps, up_exps, down_exps) -> int | None:
        """Layer `layer`'s entry in the expert pool (engine/expert_pool.py), registered on its first
        call; None where the pool does not serve it (a host inner backend, expert types without integer
        kernels, no numba, or `use_pool` off): then the round trip is a host function."""
        entry = self._entries.get(layer)
        if entry is not None or not self.use_pool or not self._inner.pins_host_memory or self._host is None:
            return entry
        stacks = self._host.int_expert_stacks(gate_exps, up_exps, down_exps)
        if stacks is None:
            return None
        if self._channel is None:
            self._channel = shared_pool(self._host.expert_thread_count(), self._inner.pinned_empty).channel()
            self._answered_before = self._channel.answered
        entry = self._entries[layer] = self._channel.pool.add_entry(*stacks)
        return entry

    def _host_buffers(self, T: int, H: int, k: int) -> tuple[Any, Any]:
        """(x, y) host rows for T tokens: views of page-locked float32 buffers, (rows, H + 2k) for the
        routed rows going down, (rows, H) for the experts' output coming back, kept per power-of-two
        row count. Never freed or regrown while the proxy lives: a captured graph's copies and host
        function read and write these addresses on every replay."""
        rows = _bucket(T)
        pair = self._pinned.get(rows)
        if pair is None or pair[0].shape[1] != H + 2 * k:
            pair = (self._inner.pinned_empty((rows, H + 2 * k)), self._inner.pinned_empty((rows, H)))
            self._pinned[rows] = pair
        return pair[0][:T], pair[1][:T]

    def _run_host(self, arg: int) -> None:
        """The host function of one round trip (called by the driver's thread, or directly on a host
        backend): layer `arg >> 32`'s routed experts for the first `arg & 0xFFFFFFFF` rows of the
        pinned x (each token's values, then its k expert ids and weights), into the pinned y. Errors
        are kept for the caller (`_raise_host_error`) and leave NaN rows, never an exception into the
        driver."""
        layer, T = arg >> 32, arg & 0xFFFFFFFF
        host_x, host_y = self._pinned[_bucket(T)]
        try:
            gate_exps, up_exps, down_exps, k = self._host_args[layer]
            if self._host is None:
                raise RuntimeError(f"routed experts on {self.experts.device} need the host backend")
            H = host_y.shape[1]
            rows = host_x[:T]
            # serving a GPU, a short chunk's tokens go one by one through the integer kernels (its long
            # chunks stream to the GPU; dequantizing the experts they pick would take seconds here)
            host_y[:T] = self._host.moe_routed(rows[:, :H], rows[:, H : H + k], rows[:, H + k : H + 2 * k],
                                               gate_exps, up_exps, down_exps,
                                               one_by_one=self._inner.pins_host_memory)
            self._host_calls += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            host_y[:T] = float("nan")
            if self._host_error is None:
                self._host_error = exc

    def _raise_host_error(self) -> None:
        exc, self._host_error = self._host_error, None
        if exc is None and self._channel is not None:
            try:
                self._channel.check()
            except (IndexError, RuntimeError) as found:
                exc = found
        if exc is not None:
            raise RuntimeError(f"routed experts on the host failed: {exc}") from exc

    def moe_block(self, x, router, gate_exps, up_exps, down_exps, k: int, shared: MoeShared | None = None,
                  residual=None):
        """The whole block, composed when the routed experts live apart (the inner backend's fused
        decode kernels cannot read them), so that `moe` above takes the routed part."""
        if self._apart_layer(gate_exps) is None:
            return self._inner.moe_block(x, router, gate_exps, up_exps, down_exps, k, shared, residual)
        # with the experts in host RAM the shared expert runs on the GPU while the routed ones make their
        # round trip (it would wait behind the host function otherwise)
        return compose_moe_block(self, x, router, gate_exps, up_exps, down_exps, k, shared, residual,
                                 shared_beside=self._host_nodes)

    def _streamed_moe(self, layer: int, x, gate_exps, up_exps, down_exps, k: int):
        st = self._stream
        w = st.acquire(layer)
        try:
            nxt = min((i for i in set(self._layer_of.values()) if i > layer), default=None)
            if nxt is not None and int(x.shape[0]) >= self.stream_min_tokens(nxt, k):
                st.prefetch(nxt)  # the next host-held layer's copy runs while this one computes
            y = self._inner.moe(x, w["router"], w[gate_exps.name],
                                None if up_exps is None else w[up_exps.name], w[down_exps.name], k)
        except BaseException:
            st.settle()  # no copy left in flight behind a failed or cancelled chunk
            raise
        finally:
            st.release(layer)
        self.streamed_moe_calls += 1
        return y

    def graph_step(self, key, run, ids, positions, *, owner, watch=None, host_in=None, host_out=None,
                   after=None, wait: bool = True, link_seconds: tuple[float, float] = (0.0, 0.0),
                   chained: bool = False, pick: PickSpec | None = None) -> Any:
        """The inner backend's captured step: with experts in host RAM the graph holds each layer's round
        trip (copies and a host function, `_host_moe`). None (run eagerly) when experts sit on another
        device: that round trip goes through this thread and cannot be captured."""
        if (self._held and not self._host_nodes) or chained:  # chained: every step is waited for here
            return None
        if self._channel is not None:
            self._channel.pool.ensure_running()  # a replay's expert calls need the pool's threads up
        try:
            # the last stage's logits are waited for here (wait=True without host_out), so a host
            # function's error is raised by this step, not by a later wait
            return self._inner.graph_step(key, run, ids, positions, owner=owner, watch=watch,
                                          host_in=host_in, host_out=host_out, after=after,
                                          wait=wait or host_out is None, link_seconds=link_seconds, pick=pick)
        finally:
            self._raise_host_error()
