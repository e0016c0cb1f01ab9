"""The one place a forward pass runs: stages of parts on backends, and one executor over them.

A model is cut into *parts* ("global" = the token embedding, "layer.<i>", "head" = final norm + LM
head), each placed on a device. A `Stage` is a run of consecutive parts on one device: its backend and
the parts it holds. One device is a one-stage plan; a layer split is several stages with a `HostBridge`
between each pair (device -> pinned host buffer -> device; peer access is never used).

`Executor.forward` is the only loop that runs embed -> layers -> head. Every caller goes through it:
a single device, a split, a chunked prefill (the chunks, one after another or pipelined), an image's
embedding override (an input of the embedding part), the hidden-state hook of tests, and a decode
step captured as a CUDA graph (the backend captures one *stage* through `graph_step`; it never sees a
model). In detail:

- a single chunk runs on the calling thread, stage after stage through the bridges;
- a decode step (one token, last-row logits) runs each stage through its backend's `graph_step`
  (replayed CUDA graph on the CuPy backend; a host backend runs it eagerly). Each bridge has one fixed
  (1, hidden) pinned `step_buffer`: the D2H target of stage k and the H2D source of stage k+1.
  Consecutive graphed stages follow each other through events: the host launches every stage's
  graph at once and waits only for the last stage's logits. A simulated link (engine/rig.py) charges
  its time inside the graphs (the sender's after its copy out, the receiver's before its copy in:
  RigBackend.graph_step), not on the host;
- several chunks on one stage run one after another; on several stages they are pipelined: one
  worker thread per device runs that device's stages in order (CUDA contexts are per thread), one
  link thread per bridge moves hidden states, so device A computes chunk k+1 while device B computes
  chunk k. Each layer still sees its chunks in order, so the result equals running them one after
  another; at most `max_in_flight` chunks are in flight, which bounds the memory of hidden states;
- `cancel` (a threading.Event) is checked before each chunk starts; a cancelled run raises
  GenerationCancelled whose `tokens_done` counts the tokens that went through every layer;
- a batch of sequences (`forward_batch`: B sequences, each with its own states, positions and one or
  more new tokens) is one more input shape of the same loop: their rows are stacked into one chunk, so
  every projection and FFN matmul sees (N, H) rows at once, while each layer's mixer runs per sequence
  on its own LayerState (engine/models/batch.py's SequenceRows). The head returns each sequence's
  last row;
- `top` > 0 (a decode step whose sampler needs only the largest logits, engine/sampling.py): the
  head's rows stay on the device, which picks their `top` largest (backend.top_k), and the step
  returns those (TopLogits): a token then copies k values to the host, not the vocabulary, and a
  captured step's graph holds the pick.

Also here: what turns a placement into stages (`part_names`, `plan_devices`, `make_backend`,
`resolve_devices`). What this is not: a scheduler of several sequences (runtime.py), or tensor
parallelism (a layer never spans two devices). Which sequences share a batch is the scheduler's choice
(engine/scheduler.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .backends.base import Backend
from .config import ModelConfig
from .devices import DeviceInfo, fits_in_ram, format_bytes, ram_bytes
from .errors import DeviceError, GenerationCancelled
from .models.batch import SequenceRows
from .placement import (
    STREAMED_EXPERTS_CHUNK,
    DeviceSpec,
    GiB,
    ModelCosts,
    Placement,
    faster_with_experts_apart,
    model_costs,
    plan_auto,
    streams_experts,
)
from .rig import Rig, device_spec
from .sampling import LaunchedStep, PickSpec, TopLogits

log = logging.getLogger(__name__)

HEAD_ROWS = 256  # rows per LM-head block when full logit rows are requested

Override = tuple[Any, Any]  # (rows (n,), values (n, H)): input rows given as embeddings (images)
# which logit rows a run returns: "last", "all", None (no head), or the given row indices (a batch's
# last row of each sequence)
Rows = str | tuple[int, ...] | None


# ------------------------------------------------------------------------------------------------
# Parts, devices and backends


def part_names(config: ModelConfig) -> list[str]:
    return ["global"] + [f"layer.{i}" for i in range(config.n_layers)] + ["head"]


def normalize_device(device: str) -> str:
    device = str(device).strip().lower()
    if device in ("cpu", "cuda"):
        return device + ":0"
    return device


def _cupy_backend_module():
    """engine.backends.cupy_backend, or None when it (or CuPy) cannot be imported here."""
    try:
        # local import: CuPy is an optional dependency, and importing it starts CUDA
        from .backends import cupy_backend
    except Exception:  # ImportError, or CUDA libraries failing to load
        return None
    return cupy_backend


def default_devices() -> list[str]:
    """["cuda:0"] when the CuPy backend imports and a GPU answers, else ["cpu:0"]."""
    mod = _cupy_backend_module()
    if mod is not None:
        try:
            if int(mod.device_count()) > 0:
                return ["cuda:0"]
        except Exception:  # noqa: BLE001 - a broken driver means: no GPU here
            pass
    return ["cpu:0"]


def make_backend(device: str) -> Backend:
    """A backend for one device string ("cpu:0", "cuda:1")."""
    device = normalize_device(device)
    if device.startswith("cpu"):
        from .backends.numpy_backend import NumpyBackend

        return NumpyBackend(device=device)
    if device.startswith("cuda"):
        mod = _cupy_backend_module()
        if mod is None:
            raise DeviceError(f"device '{device}': the CuPy backend is not available (install minecart "
                              "with the cuda12 or cuda13 extra, or use the CPU device cpu:0)")
        try:
            return mod.CupyBackend(device=device)
        except Exception as exc:
            raise DeviceError(f"device '{device}' could not be opened ({exc}); check the GPU index and "
                              "driver, or use the CPU device cpu:0") from exc
    raise DeviceError(f"unknown device '{device}'; use 'cpu:0' or 'cuda:N'")


def plan_devices(config: ModelConfig, placement: Placement | Mapping[str, str] | None = None,
                 devices: Sequence[str] | None = None) -> dict[str, str]:
    """part -> device, from a Placement, a part -> device Mapping, or (neither) contiguous, nearly
    equal runs of layers over `devices` (embedding with the first device, head with the last)."""
    parts = part_names(config)
    if isinstance(placement, Placement):
        return {part: normalize_device(placement.device_of(part)) for part in parts}
    if isinstance(placement, Mapping):
        return {part: normalize_device(placement[part]) for part in parts}
    if placement is not None:
        raise TypeError("placement must be a Placement or map part names ('global', 'layer.<i>', "
                        "'head') to devices")
    devs = [normalize_device(d) for d in (devices or default_devices())]
    plan = {"global": devs[0], "head": devs[-1]}
    n = config.n_layers
    for i in range(n):
        plan[f"layer.{i}"] = devs[min(len(devs) - 1, i * len(devs) // max(n, 1))]
    return plan


def device_specs(devices) -> list[DeviceSpec]:
    """DeviceSpecs for plan_auto from what the caller passed: DeviceSpecs as they are, a Rig's specs,
    device names with what the device listing reports (rig.device_spec: free memory and, for a card
    resources/gpu_profiles.json knows, its speed and link, so the plan puts layers on the faster card
    first, not the first card in order; CPU devices share the RAM)."""
    if isinstance(devices, Rig):
        return devices.device_specs()
    items = list(devices)
    if all(isinstance(d, DeviceSpec) for d in items):
        return items
    names = [d.name if isinstance(d, DeviceSpec) else str(d) for d in items]
    listed: dict[str, DeviceInfo] = {}
    try:
        from .devices import list_devices  # local import: the listing may initialise NVML

        listed = {info.id: info for info in list_devices(include_cpu=True, with_probe=False)}
    except Exception:  # noqa: BLE001 - the listing is a convenience: without it devices count as equal
        pass
    cpu_names = [n for n in names if n.startswith("cpu:")]
    ram = listed["cpu:0"].free_bytes if "cpu:0" in listed else 0
    out = []
    for n in names:
        info = listed.get(n)
        if n.startswith("cpu:"):
            out.append(DeviceSpec(n, ram // max(1, len(cpu_names)) if ram > 0 else 64 * GiB))
        elif info is not None and info.free_bytes > 0:
            out.append(device_spec(info))
        else:
            out.append(DeviceSpec(n, 64 * GiB) if info is None else device_spec(info, 64 * GiB))
    return out


def costs_for_devices(config: ModelConfig, gguf_file, device_names: Sequence[str],
                      cpu_weights: str | None = None) -> ModelCosts:
    """model_costs in the layout the devices will hold the weights in. Beside a GPU: "stored" (the CPU's
    layers too: NumpyBackend.hold_weights; its types other than the integer kernels' stay float32).
    On the CPU alone: "numpy" (the reference backend's float32 copies) unless cpu_weights is "stored",
    or is None and those copies would not fit in the RAM available (devices.fits_in_ram): then
    "stored", with a warning that says so."""
    cpu_only = all(str(d).startswith("cpu") for d in device_names)
    if not cpu_only or cpu_weights == "stored":
        return model_costs(config, gguf_file, layout="stored")
    as_f32 = model_costs(config, gguf_file, layout="numpy")
    f32_bytes = as_f32.weight_bytes
    if cpu_weights is None and not fits_in_ram(f32_bytes):
        log.warning("float32 copies of %s's weights (%s) would not fit in the RAM available (%s): holding "
                    "them as the file stores them (--cpu-weights stored)", Path(str(gguf_file.path)).name,
                    format_bytes(f32_bytes), format_bytes(ram_bytes()[1]))
        return model_costs(config, gguf_file, layout="stored")
    return as_f32


def resolve_devices(config: ModelConfig, gguf_file, placement=None, devices=None, *,
                    make: Callable[[str], Backend] | None = None, plan_experts: bool = True,
                    cpu_weights: str | None = None) -> tuple[Placement, dict[str, str], dict[str, Backend]]:
    """What load_model needs from a placement and/or devices: (Placement, part -> device, device ->
    backend).

    placement: a Placement, a part -> device Mapping, or None; devices: device names, DeviceSpecs, or
    an engine.rig.Rig (its logical devices then provide the backends). Several devices without a
    placement are planned with plan_auto (in proportion to free memory, contiguous; with plan_experts, an
    MoE model over GPUs and the CPU with its routed experts in host RAM instead when that is predicted
    to decode faster: placement.faster_with_experts_apart, the returned Placement's `experts`).
    plan_experts=False: the caller places the experts itself (load_model's `experts`). cpu_weights:
    load_model's (CPU_WEIGHTS): "stored" holds them as stored on the CPU alone too (beside a GPU they
    always are); a given Placement's layout decides for itself."""
    parts = part_names(config)
    rig = devices if isinstance(devices, Rig) else None
    names = None
    if devices is not None:
        names = rig.names if rig is not None else [d.name if isinstance(d, DeviceSpec) else str(d)
                                                   for d in devices]

    def costs(device_names):
        return costs_for_devices(config, gguf_file, device_names, cpu_weights)

    if placement is None and names is not None and len(names) > 1:
        specs = device_specs(devices)
        split = costs(names)
        # an MoE model over GPUs and the CPU: its experts in host RAM when that decodes faster
        placement = plan_auto(split, devices=specs)
        if plan_experts:
            placement = faster_with_experts_apart(placement, split, specs)
    if isinstance(placement, Placement):
        plan = {p: normalize_device(placement.device_of(p)) for p in parts}
    else:
        plan = plan_devices(config, placement, names)
        placement = Placement(costs(plan.values()), [plan[p] for p in parts])
    factory = rig.backend if rig is not None else (make or make_backend)
    by_device = {dev: factory(dev) for dev in dict.fromkeys(plan.values())}
    hold_as_priced(by_device, placement.costs.layout)
    return placement, plan, by_device


def hold_as_priced(by_device: Mapping[str, Backend], layout: str) -> None:
    """Tell the CPU devices' backends to hold the weights they load as the plan priced them (its costs'
    layout: Backend.hold_weights). A backend that answers to a GPU's name is not told: a GPU holds the
    file's blocks whatever the layout."""
    for dev, be in by_device.items():
        if dev.startswith("cpu"):
            be.hold_weights(layout)


# ------------------------------------------------------------------------------------------------
# Threads and bridges


class DeviceWorker:
    """A thread that runs submitted callables in order; the backend's `bind_thread()` runs first on
    the thread (the CuPy backend makes its device current there)."""

    def __init__(self, name: str, backend: Backend | None = None):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._backend = backend
        self._thread = threading.Thread(target=self._run, name=f"minecart-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._backend is not None:
            self._backend.bind_thread()
        while True:
            task = self._queue.get()
            if task is None:
                return
            task()

    def submit(self, task: Callable[[], None]) -> None:
        self._queue.put(task)

    def close(self) -> None:
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)


class HostBridge:
    """One cross-device edge: src -> host staging buffer -> dst, with a link thread for pipelined
    chunks. The buffer is pinned when either backend pins host memory, grows when a larger hidden
    state arrives, and is used by one copy at a time (the link thread, or the calling thread for a
    single chunk; never both at once)."""

    def __init__(self, src: Backend, dst: Backend, *, rows: int = 1, width: int = 1):
        self.src = src
        self.dst = dst
        self.name = f"{src.device}->{dst.device}"
        self.buffer = self._allocate(max(1, rows * width))
        # a decode step's hidden state: a fixed address, baked into the stages' CUDA graphs
        self.step_buffer = self._allocate(max(1, width)).reshape(1, max(1, width))
        self.worker: DeviceWorker | None = None  # the link thread, made for the first pipelined run
        self.bytes_moved = 0
        self.seconds = 0.0

    def _allocate(self, n: int) -> np.ndarray:
        for be in (self.src, self.dst):
            if be.pins_host_memory:
                return be.pinned_empty((n,), "float32")
        return np.empty(n, np.float32)

    def move(self, x):
        """x (an array of src) -> the same values as an array of dst."""
        t0 = time.perf_counter()
        shape = tuple(x.shape)
        n = int(np.prod(shape)) if shape else 1
        if n > self.buffer.size:
            self.buffer = self._allocate(n)
        host = self.buffer[:n].reshape(shape)
        self.src.to_numpy_into(x, host)
        y = self.dst.asarray(host)
        if isinstance(y, np.ndarray) and np.shares_memory(y, self.buffer):
            y = y.copy()  # a CPU backend may wrap the host array as is; the buffer is reused next hop
        self.bytes_moved += host.nbytes
        self.seconds += time.perf_counter() - t0
        return y

    def link_worker(self) -> DeviceWorker:
        if self.worker is None:
            self.worker = DeviceWorker(f"link {self.name}")
        return self.worker

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


# ------------------------------------------------------------------------------------------------
# Stages and the executor


def _first_token(positions) -> bool:
    """Whether a one-token pass is its sequence's very first token (position 0): it runs eagerly, its
    states being fresh (a capture there failed once and switched the backend's graphs off)."""
    return int(np.asarray(positions).reshape(-1)[0]) == 0


@dataclass
class Stage:
    """A run of consecutive parts on one device."""

    device: str
    backend: Backend
    parts: list[str]
    worker: DeviceWorker | None = None  # this device's thread for pipelined chunks (several stages)

    @property
    def layers(self) -> list[int]:
        return [int(p.split(".")[1]) for p in self.parts if p.startswith("layer.")]


@dataclass
class _Job:
    """One pipelined forward call in flight: results per chunk, the first error, completion."""

    n_chunks: int
    rows: str | None
    results: list = field(default_factory=list)
    error: BaseException | None = None
    cancelled_at: int | None = None
    ended: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)
    slots: threading.Semaphore | None = None

    def end_chunk(self) -> None:
        with self.lock:
            self.ended += 1
            finished = self.ended == self.n_chunks
        if self.slots is not None:
            self.slots.release()
        if finished:
            self.done.set()

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = exc


@dataclass(frozen=True)
class _Chunk:
    index: int
    ids: list[int]
    positions: Any
    override: Override | None
    rows: Rows  # what this chunk returns: "all", "last", None, or these row indices
    top: int = 0  # > 0: the rows' `top` largest logits (TopLogits) instead of the rows


def shift_override(override: Override | None, start: int, stop: int) -> Override | None:
    """The part of an override that falls in tokens [start, stop), rows made relative."""
    if override is None:
        return None
    rows = np.asarray(override[0], dtype=np.int64).reshape(-1)
    sel = (rows >= start) & (rows < stop)
    if not sel.any():
        return None
    return rows[sel] - start, np.asarray(override[1], dtype=np.float32)[sel]


def _cancelled(tokens_done: int) -> GenerationCancelled:
    exc = GenerationCancelled("prefill cancelled")
    exc.tokens_done = tokens_done
    return exc


class Executor:
    """Runs a model's parts, placed on backends, as stages (see the module docstring).

    config / module: the model's config and model module (engine/models/<arch>.py); plan: part ->
    device; backends: part -> backend; weights: part -> {GGUF name: Weight} (read at each call, so a
    placement change that replaces a part's weights is seen)."""

    def __init__(self, config: ModelConfig, module: Any, plan: Mapping[str, str],
                 backends: Mapping[str, Backend], weights: Mapping[str, dict], *,
                 max_in_flight: int | None = None):
        self.config = config
        self.module = module
        self.weights = weights
        self.stages: list[Stage] = []
        for part in part_names(config):
            dev = plan[part]
            if self.stages and self.stages[-1].device == dev:
                self.stages[-1].parts.append(part)
            else:
                self.stages.append(Stage(dev, backends[part], [part]))
        self.workers: dict[str, DeviceWorker] = {}
        if len(self.stages) > 1:  # pipelined chunks: one thread per device
            for st in self.stages:
                if st.device not in self.workers:
                    self.workers[st.device] = DeviceWorker(st.device, st.backend)
                st.worker = self.workers[st.device]
        hidden = config.hidden
        self.bridges = [HostBridge(a.backend, b.backend, rows=512, width=hidden)
                        for a, b in zip(self.stages, self.stages[1:], strict=False)]
        self.max_in_flight = max_in_flight or (2 * len(self.stages) + 1)
        # several chunks on several devices go through the worker threads; False runs them one after
        # another on the calling thread (tests compare both)
        self.pipelined = len(self.stages) > 1
        self.inline_single_chunk = True  # False: a single chunk goes through the worker threads too
        self.use_graphs = True  # decode steps through the stages' graph_step
        # the fewest tokens of a prefill run when a chunk size is asked for (0: as asked): a model whose
        # routed experts are streamed from host RAM copies every host-held layer's experts once per run,
        # so it runs longer ones (engine/model.py load_model, placement.STREAMED_EXPERTS_CHUNK)
        self.min_chunk = STREAMED_EXPERTS_CHUNK if streams_experts(plan) else 0
        # consecutive graphed stages follow each other through events (no host wait between them); a
        # simulated link passes its time inside their graphs (engine/rig.py RigBackend.graph_step)
        self.chain_graphs = True
        self.graphed_stage_steps = 0  # decode stage runs replayed (or captured) as graphs
        self.chained_steps = 0  # of those, steps launched on the device's pick of the step before (launch_next)
        self.eager_stage_steps = 0  # decode stage runs done eagerly (no graph, or not valid this step)
        self.batch_graph_steps = 0  # batched decode steps replayed (or captured) as one graph
        self._call_lock = threading.Lock()

    @property
    def devices(self) -> list[str]:
        return list(dict.fromkeys(st.device for st in self.stages))

    @property
    def split(self) -> bool:
        """True when the parts sit on more than one device."""
        return len(self.devices) > 1

    def close(self) -> None:
        for b in self.bridges:
            b.close()
        for w in self.workers.values():
            w.close()
        self.bridges = []
        self.workers = {}
        # a part's weights share one device allocation (CupyBackend.part_arena): a vector still held
        # here would keep its whole part on the device after Model.close or a re-plan
        self.weights = {}

    # ---- the forward pass ----------------------------------------------------------------------------
    def forward(self, ids: Sequence[int], states: list, positions, *, rows: str | None = "last",
                hidden_hook: Callable[[int, np.ndarray], None] | None = None,
                chunk: int | None = None, cancel: threading.Event | None = None,
                embed_override: Override | None = None, top: int = 0) -> np.ndarray | TopLogits | None:
        """Run `ids` through every part, updating `states` (one per layer) in place.

        rows: "last" -> host float32 logits (1, vocab) of the last token; "all" -> (T, vocab); None ->
        no head (returns None). positions: (T,) or (3, T) for M-RoPE. chunk: tokens per run (None =
        one run; at least `min_chunk`); cancel: checked before each chunk. hidden_hook(index, host array) receives the
        residual stream after the embedding (0) and after each layer (1..L); it needs one chunk.
        embed_override: rows of the token embeddings replaced by given values (image embeddings).
        top > 0 (rows "last"): the last token's `top` largest logits (TopLogits (1, top)) instead
        (`top` at or above the vocabulary size: the row itself)."""
        top = self._top(top)
        if top and rows != "last":
            raise ValueError(f"top {top} needs rows='last', got rows={rows!r}")
        ids = [int(t) for t in ids]
        positions = np.asarray(positions)
        T = len(ids)
        step = T if not chunk else max(1, int(chunk), self.min_chunk)
        starts = list(range(0, T, step)) or [0]
        if hidden_hook is not None and len(starts) > 1:
            raise ValueError("hidden_hook needs the whole sequence in one chunk")
        chunks = [_Chunk(c, ids[s : s + step], positions[..., s : s + step],
                         shift_override(embed_override, s, s + step),
                         rows if rows != "last" else ("last" if c == len(starts) - 1 else None),
                         top if c == len(starts) - 1 else 0)
                  for c, s in enumerate(starts)]
        with self._call_lock:  # one sequence at a time: states are updated in place
            if self.pipelined and (len(chunks) > 1 or not self.inline_single_chunk):
                out = self._pipelined(chunks, states, rows, step, cancel)
            else:
                out = []
                for c in chunks:
                    if cancel is not None and cancel.is_set():
                        raise _cancelled(c.index * step)
                    out.append(self._one_chunk(c, states, hidden_hook))
        if rows is None:
            return None
        got = [o for o in out if o is not None]
        return got[-1] if rows == "last" else (got[0] if len(got) == 1 else np.concatenate(got, axis=0))

    def launch_decode(self, token: int, states: list, positions, top: int = 0,
                      pick: PickSpec | None = None) -> LaunchedStep:
        """One decode step (`token` at `positions`, (1,) or (3, 1)) launched without a host wait where
        the stages' graphs replay: the host may work meanwhile, and result() gives what
        forward([token], states, positions, top=top) returns. Anything else (no graphs, a capture, an
        eager step, a sequence's first token) runs here and comes back done. pick: how a graphed step
        draws the next token from its top logits on the device (TopLogits.picks; a next step can then
        be chained on it, launch_next)."""
        top = self._top(top)
        positions = np.asarray(positions)
        ids = [int(token)]
        if _first_token(positions) or (self.pipelined and not self.inline_single_chunk):
            out = self.forward(ids, states, positions, top=top)
            assert out is not None  # rows="last" always has logits
            return LaunchedStep.done(out)
        with self._call_lock:  # the launch is serialized with other passes; its wait is the caller's
            launched = self._decode_step(ids, states, positions, top, defer=True, pick=pick)
        return launched if isinstance(launched, LaunchedStep) else LaunchedStep.done(launched)

    def launch_next(self, states: list, positions, top: int, pick: PickSpec) -> LaunchedStep | None:
        """The decode step whose token is the device's pick of this sequence's previous step (launched
        with a PickSpec), launched behind that step before the host has seen the pick: the device goes
        from one token to the next without waiting for the host. positions: the new token's; pick: how
        this step draws its own. None when that is not possible (several stages, graphs off, whole
        rows, a previous step that did not leave its pick on the device, a capture that failed): the
        caller takes the previous step's result and launches its pick with launch_decode."""
        top = self._top(top)
        if len(self.stages) != 1 or not self.use_graphs or not top:
            return None
        stage = self.stages[0]
        positions = np.asarray(positions)

        def run(x):
            return self.run_stage(stage, x, positions, states, "last", top=top)

        with self._call_lock:
            done = stage.backend.graph_step(("stage", 0, top), run, [0], positions, owner=states,
                                            watch=[states[i] for i in stage.layers], wait=False, chained=True,
                                            pick=pick)
        if done is None:
            return None
        self.graphed_stage_steps += 1
        self.chained_steps += 1
        return done if isinstance(done, LaunchedStep) else LaunchedStep.done(done)

    def _top(self, top: int) -> int:
        """A requested number of top logits as the head gives them: 0 (whole rows) from the
        vocabulary size up."""
        top = int(top)
        if top < 0:
            raise ValueError(f"top must be >= 0, got {top}")
        return 0 if top >= self.config.vocab_size else top

    def forward_batch(self, ids: Sequence[Sequence[int]], states: Sequence[list],
                      positions: Sequence[Any], top: int = 0) -> np.ndarray | TopLogits:
        """Run B sequences' new tokens in one pass -> host float32 logits (B, vocab) of each sequence's
        last token, or with top > 0 their `top` largest (TopLogits (B, top)). ids[b]: sequence b's new
        tokens (one while it decodes, a prompt chunk while it prefills); states[b]: its per-layer
        states (updated in place); positions[b]: (T_b,) or (3, T_b).

        The rows of all sequences go through `forward`'s loop as one chunk (see the module docstring);
        each sequence's logits equal running it alone up to fp32 rounding. A batch of one is `forward`
        itself, so a lone decode keeps its captured graph."""
        return self.launch_batch(ids, states, positions, top).result()

    def launch_batch(self, ids: Sequence[Sequence[int]], states: Sequence[list],
                     positions: Sequence[Any], top: int = 0) -> LaunchedStep:
        """forward_batch without its host wait where a batch graph replays: result() gives what
        forward_batch returns (the step's own error, raised there, included); the host may work
        meanwhile (the scheduler wakes the previous step's callers). Anything else runs here and comes
        back done. Take the result before the next pass of any of these sequences."""
        B = len(ids)
        if not B or len(states) != B or len(positions) != B:
            raise ValueError(f"forward_batch needs as many state lists and position arrays as sequences "
                             f"({B} sequences, {len(states)} state lists, {len(positions)} positions)")
        if any(len(t) == 0 for t in ids):
            raise ValueError("every sequence of a batch needs at least one new token")
        top = self._top(top)
        if B == 1:
            out = self.forward(ids[0], states[0], positions[0], rows="last", top=top)
            assert out is not None  # rows="last" always returns logits
            return LaunchedStep.done(out)
        flat = [int(t) for seq in ids for t in seq]
        bounds = [0]
        for seq in ids:
            bounds.append(bounds[-1] + len(seq))
        # int64 as the backends convert them, so a captured step recognises each sequence's own array
        pos = [np.asarray(p, dtype=np.int64) for p in positions]
        if any(p.ndim == 2 for p in pos):  # M-RoPE in any sequence: every one as (3, T)
            pos = [p if p.ndim == 2 else np.broadcast_to(p, (3, p.shape[0])) for p in pos]
        stacked = np.concatenate(pos, axis=-1)

        def layer_rows() -> list:  # built only when the step runs eagerly or is captured, not replayed
            return [SequenceRows(tuple(st[i] for st in states), tuple(bounds), tuple(pos))
                    for i in range(self.config.n_layers)]

        chunk = _Chunk(0, flat, stacked, None, tuple(b - 1 for b in bounds[1:]), top)
        with self._call_lock:  # the launch is serialized with other passes; a replay's wait is the caller's
            if len(flat) == B:  # every sequence decodes one token
                launched = self._batch_graph_step(chunk, tuple(states), tuple(pos), layer_rows)
                if launched is not None:
                    return launched
            out = self._one_chunk(chunk, layer_rows(), None)
        assert out is not None  # row indices always reach the head
        return LaunchedStep.done(out)

    def _batch_graph_step(self, c: _Chunk, owners: tuple, pos: tuple,
                          layer_rows: Callable[[], list]) -> LaunchedStep | None:
        """A batched decode step (one token per sequence) through the backend's graph_step (which keeps
        a graph per batch size and binds it to the sequences of each step: CupyBackend.graph_step),
        launched without its host wait when the graph replays. None: run it eagerly (graphs off, a
        split model, a backend without graphs, a cache that must grow, a new batch no graph can take
        yet)."""
        if not (self.use_graphs and len(self.stages) == 1):
            return None
        stage = self.stages[0]
        watch = [st for seq in owners for st in seq]

        def run(x):
            return self.run_stage(stage, x, c.positions, layer_rows(), c.rows, top=c.top)

        out = stage.backend.graph_step(("batch", len(owners), c.top), run, c.ids, pos, owner=owners,
                                       watch=watch, wait=False)
        if out is None:
            return None
        self.batch_graph_steps += 1
        return out if isinstance(out, LaunchedStep) else LaunchedStep.done(out)

    def _one_chunk(self, c: _Chunk, states: list, hook) -> np.ndarray | TopLogits | None:
        """One chunk on the calling thread: a decode step through the stages' graphs, or stage after
        stage through the bridges (nothing to overlap; thread hand-offs would only add latency)."""
        # a sequence's very first token (a one-token prompt) runs eagerly: its states are fresh, and a
        # capture there failed once and switched the backend's graphs off (tests/gpu/test_batch_mixers.py)
        if len(c.ids) == 1 and c.rows == "last" and hook is None and c.override is None and \
                not _first_token(c.positions):
            out = self._decode_step(c.ids, states, c.positions, c.top)
            assert not isinstance(out, LaunchedStep)  # waited for (defer is False)
            return out
        x: Any = c.ids
        for s, stage in enumerate(self.stages):
            if s:
                x = self.bridges[s - 1].move(x)
            x = self.run_stage(stage, x, c.positions, states, c.rows, hook, c.override, c.top)
        return x

    def run_stage(self, stage: Stage, x, positions, states: list, rows: Rows, hook=None,
                  override: Override | None = None, top: int = 0):
        """The parts of one stage on its backend: x (token ids for the embedding, else the hidden state
        on this backend) -> the hidden state, or host logits when the stage ends with the head (None
        when rows is None; with top > 0 the rows' `top` largest logits, TopLogits)."""
        cfg, mod, weights = self.config, self.module, self.weights
        be = stage.backend
        for part in stage.parts:
            if part == "global":
                x = mod.embed(cfg, be, weights[part], x)
                if override is not None:  # image embeddings replace their placeholder rows
                    host = be.to_numpy(x)
                    host[np.asarray(override[0], dtype=np.int64)] = np.asarray(override[1], np.float32)
                    x = be.asarray(host)
                if hook is not None:
                    hook(0, be.to_numpy(x))
            elif part == "head":
                if rows is None:
                    return None
                if rows == "last":
                    x = x[x.shape[0] - 1 :]
                elif isinstance(rows, tuple) and len(rows) < x.shape[0]:
                    x = x[list(rows)]  # a batch: each sequence's last row
                return self.run_head(x, be, top)
            else:
                i = int(part.split(".")[1])
                x = mod.layer(cfg, be, weights[part], i, x, states[i], positions)
                if hook is not None:
                    hook(i + 1, be.to_numpy(x))
        return x

    def run_head(self, x, be: Backend, top: int = 0) -> np.ndarray | TopLogits:
        """Host float32 logits (T, vocab) of final hidden states x on `be` (the head's backend). The LM
        head runs in blocks of HEAD_ROWS rows, so full rows of a long prompt never sit on the device
        at once. top > 0 (a decode step's rows, one per sequence): their `top` largest logits, picked
        on the device from the rows' logits (TopLogits)."""
        if top:
            return be.top_k(self.module.head(self.config, be, self.weights["head"], x), top)
        T = x.shape[0]
        out = None
        for start in range(0, T, HEAD_ROWS):
            block = self.module.head(self.config, be, self.weights["head"], x[start : start + HEAD_ROWS])
            block = np.asarray(be.to_numpy(block), dtype=np.float32)
            if T <= HEAD_ROWS:
                return block
            if out is None:
                out = np.empty((T, block.shape[1]), np.float32)
            out[start : start + block.shape[0]] = block
        assert out is not None
        return out

    # ---- decode: one token, each stage through its backend's graph_step ---------------------------------
    def _decode_step(self, ids: list[int], states: list, positions, top: int,
                     defer: bool = False, pick: PickSpec | None = None) -> np.ndarray | TopLogits | LaunchedStep:
        """defer: the last stage's graph may be launched without a host wait (a LaunchedStep); pick:
        the last stage's (graph_step)."""
        last = len(self.stages) - 1
        out = pending = None
        for s, stage in enumerate(self.stages):
            host_in = self.bridges[s - 1].step_buffer if s else None
            host_out = self.bridges[s].step_buffer if s < last else None
            out, pending = self._decode_stage(s, stage, ids, states, positions, host_in, host_out, pending,
                                              top if s == last else 0, defer and s == last,
                                              pick if s == last else None)
            if host_out is not None:
                self.bridges[s].bytes_moved += host_out.nbytes
        assert out is not None
        return out

    def _decode_stage(self, s: int, stage: Stage, ids, states, positions, host_in, host_out, pending,
                      top: int, defer: bool = False, pick: PickSpec | None = None):
        """One stage of a decode step -> (host logits of the last stage (TopLogits with top > 0; with
        defer, possibly a LaunchedStep not waited for) or None, the event of a graph launched without a
        host wait or None). pending: such an event of the previous stage."""
        be = stage.backend

        def run(x):
            return self.run_stage(stage, x, positions, states, "last", top=top)

        if self.use_graphs:
            done = be.graph_step(("stage", s, top), run, ids, positions, owner=states,
                                 watch=[states[i] for i in stage.layers], host_in=host_in,
                                 host_out=host_out, after=pending,
                                 wait=not defer if host_out is None else not self.chain_graphs, pick=pick)
            if done is not None:
                self.graphed_stage_steps += 1
                if host_out is None:
                    return done, None
                return None, (None if done is True else done)
        if pending is not None:
            pending.synchronize()  # the previous stage's output must be in host_in
        self.eager_stage_steps += 1
        x: Any = ids
        if host_in is not None:
            x = be.asarray(host_in)
            if isinstance(x, np.ndarray) and np.shares_memory(x, host_in):
                x = x.copy()  # a CPU backend may wrap the host array; the buffer is rewritten next token
        out = run(x)
        if host_out is None:
            return out, None
        be.to_numpy_into(out, host_out)
        return None, None

    # ---- several chunks over several devices --------------------------------------------------------------
    def _pipelined(self, chunks: list[_Chunk], states, rows, step: int, cancel) -> list:
        slots = threading.Semaphore(self.max_in_flight)
        job = _Job(len(chunks), rows, results=[None] * len(chunks), slots=slots)
        for c in chunks:
            slots.acquire()
            if job.error is not None or (cancel is not None and cancel.is_set()):
                if job.error is None:
                    job.cancelled_at = c.index
                slots.release()
                for _ in range(c.index, len(chunks)):
                    job.end_chunk()
                break
            first = self.stages[0].worker
            assert first is not None
            first.submit(self._stage_task(job, 0, c, c.ids, states))
        job.done.wait()
        if job.error is not None:
            raise job.error
        if job.cancelled_at is not None:
            raise _cancelled(min(sum(len(c.ids) for c in chunks), job.cancelled_at * step))
        return job.results

    def _stage_task(self, job: _Job, s: int, c: _Chunk, x, states):
        def run() -> None:
            if job.error is not None:
                job.end_chunk()
                return
            try:
                self._run_pipelined_stage(job, s, c, x, states)
            except BaseException as exc:  # reported to the caller, who re-raises it
                job.fail(exc)
                job.end_chunk()

        return run

    def _run_pipelined_stage(self, job: _Job, s: int, c: _Chunk, x, states) -> None:
        stage = self.stages[s]
        be = stage.backend
        out = self.run_stage(stage, x, c.positions, states, c.rows, None, c.override if s == 0 else None, c.top)
        if s == len(self.stages) - 1:
            job.results[c.index] = out
            be.synchronize()
            job.end_chunk()
            return
        be.synchronize()  # the link thread reads `out`; make sure this device finished writing it
        bridge = self.bridges[s]
        nxt = self.stages[s + 1]

        def hop() -> None:
            if job.error is not None:
                job.end_chunk()
                return
            try:
                y = bridge.move(out)
            except BaseException as exc:
                job.fail(exc)
                job.end_chunk()
                return
            assert nxt.worker is not None
            nxt.worker.submit(self._stage_task(job, s + 1, c, y, states))

        bridge.link_worker().submit(hop)
