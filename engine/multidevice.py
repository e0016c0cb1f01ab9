"""Running one model across several devices without peer-to-peer: bridges, workers, pipelined prefill.

A loaded Model (engine/model.py) whose parts sit on more than one device gets a `Pipeline`:

- one worker thread per device runs every part placed there (CUDA contexts are per thread, and one
  thread per device keeps each device's work in order);
- one `HostBridge` per cross-device edge (consecutive parts on different devices) owns one host
  staging buffer — pinned when the backend can allocate pinned memory (`pinned_empty`), plain NumPy on
  CPU devices — and a link thread that moves the hidden state source -> host buffer -> destination.
  Peer access is never enabled; nothing here calls a device-to-device copy;
- chunked prefill is pipelined: the caller feeds chunk k+1 to the first device while chunk k is on the
  wire or on the next device, so device A computes chunk k+1 while device B computes chunk k. Each
  layer still sees its chunks in order (one worker per device, FIFO queues and links), so the result
  equals running the chunks one after another on one device; at most `max_in_flight` chunks are
  between the caller and the head at once, which bounds the memory of hidden states in flight;
- a single chunk has nothing to overlap: it runs on the calling thread, stage after stage through the
  same bridges, which saves the thread hand-offs;
- a decode step (one token, last-row logits) runs stage after stage on the calling thread too, each
  stage through its backend's `graph_step` when it has one (the CuPy backend replays a CUDA graph of
  the stage: token/positions or the hidden state in from a pinned host buffer, the hidden state out
  to the next pinned buffer or the logits out), else eagerly. Each edge has one fixed (1, hidden)
  pinned `step_buffer`, the D2H target of stage k and the H2D source of stage k+1. Per token: launch
  stage 0; launch stage 1 behind an event recorded after stage 0 (the GPU orders them, across
  devices too, while the host prepares the next launch); ...; wait for the last. With a simulated
  link (engine/rig.py) each stage is waited for instead and the link's time passes before the next
  is launched. A stage whose graph is not valid this step (a cache grows, states were replaced)
  waits for the previous one, runs eagerly through the same buffers and re-captures next token.

Also here: `resolve_devices` (placement + devices -> part plan and backends, used by load_model),
`attach_pipeline`, and `bench_split` (the measurement `minecart bench --devices` prints).

What this is not: a scheduler for several sequences, or tensor parallelism (a layer never spans two
devices). Timing of slow links and memory caps live in engine/rig.py.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .errors import GenerationCancelled
from .placement import DeviceSpec, GiB, Placement, model_costs, plan_auto

# ------------------------------------------------------------------------------------------------
# Threads


class DeviceWorker:
    """A thread that runs submitted callables in order. `bind_thread()` of the backend, when it has
    one, runs first on the thread (the CuPy backend makes its device current there)."""

    def __init__(self, name: str, backend=None):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._backend = backend
        self._thread = threading.Thread(target=self._run, name=f"minecart-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        bind = getattr(self._backend, "bind_thread", None)
        if bind is not None:
            bind()
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
    """One cross-device edge: src -> host staging buffer -> dst, on its own link thread.

    The buffer is allocated once (pinned through `pinned_empty(shape, dtype)` on the source or
    destination backend when either has it) and grows if a larger hidden state arrives. The link
    thread copies one hidden state at a time, so the single buffer is never written while read.
    """

    def __init__(self, src, dst, *, rows: int = 1, width: int = 1, name: str = ""):
        self.src = src
        self.dst = dst
        self.name = name or f"{getattr(src, 'device', '?')}->{getattr(dst, 'device', '?')}"
        self.buffer = self._allocate(max(1, rows * width))
        # a decode step's hidden state: a fixed address, baked into the stages' CUDA graphs
        self.step_buffer = self._allocate(max(1, width)).reshape(1, max(1, width))
        self.worker = DeviceWorker(f"link {self.name}")
        self.bytes_moved = 0
        self.seconds = 0.0

    def _allocate(self, n: int) -> np.ndarray:
        for be in (self.src, self.dst):
            alloc = getattr(be, "pinned_empty", None)
            if alloc is not None:
                return alloc((n,), "float32")
        return np.empty(n, np.float32)

    def move(self, x):
        """x (an array of src) -> the same values as an array of dst (on the link thread for pipelined
        chunks, on the calling thread for a single chunk; never both at once)."""
        t0 = time.perf_counter()
        shape = tuple(x.shape)
        n = int(np.prod(shape)) if shape else 1
        if n > self.buffer.size:
            self.buffer = self._allocate(n)
        host = self.buffer[:n].reshape(shape)
        into = getattr(self.src, "to_numpy_into", None)
        if into is not None:
            into(x, host)
        else:
            np.copyto(host, self.src.to_numpy(x), casting="same_kind")
        y = self.dst.asarray(host)
        if isinstance(y, np.ndarray) and np.shares_memory(y, self.buffer):
            y = y.copy()  # a CPU backend may wrap the host array as is; the buffer is reused next hop
        self.bytes_moved += host.nbytes
        self.seconds += time.perf_counter() - t0
        return y

    def close(self) -> None:
        self.worker.close()


# ------------------------------------------------------------------------------------------------
# One forward pass split into chunks


@dataclass
class _Stage:
    """A run of consecutive parts on one device."""

    device: str
    backend: object
    parts: list[str]
    worker: DeviceWorker

    @property
    def layers(self) -> list[int]:
        return [int(p.split(".")[1]) for p in self.parts if p.startswith("layer.")]


@dataclass
class _Job:
    """One forward call in flight: results per chunk, the first error, completion."""

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


class Pipeline:
    """Runs a Model whose parts sit on several devices (see the module docstring).

    Built from the model's own `device_plan` (part -> device), `backends` (part -> backend) and
    `weights` (part -> {name: Weight}), so loading stays in engine/model.py.
    """

    def __init__(self, model, *, max_in_flight: int | None = None):
        self.model = model
        self.config = model.config
        self.module = model.module
        plan = model.device_plan
        parts = ["global"] + [f"layer.{i}" for i in range(self.config.n_layers)] + ["head"]
        workers: dict[str, DeviceWorker] = {}
        self.stages: list[_Stage] = []
        for part in parts:
            dev = plan[part]
            if dev not in workers:
                workers[dev] = DeviceWorker(dev, model.backends[part])
            if self.stages and self.stages[-1].device == dev:
                self.stages[-1].parts.append(part)
            else:
                self.stages.append(_Stage(dev, model.backends[part], [part], workers[dev]))
        self.workers = workers
        hidden = self.config.hidden
        self.bridges = [HostBridge(a.backend, b.backend, rows=512, width=hidden)
                        for a, b in zip(self.stages, self.stages[1:], strict=False)]
        self.max_in_flight = max_in_flight or (2 * len(self.stages) + 1)
        # a single chunk (a decode step) runs on the calling thread (see _forward_inline)
        self.inline_single_chunk = True
        self.use_graphs = True  # decode steps through the stages' graph_step where a backend has one
        # consecutive graphed stages follow each other through events (no host wait between them),
        # unless a simulated link has to pass its time between them
        self.chain_graphs = not any(getattr(getattr(st.backend, "rig_device", None), "link", None)
                                    for st in self.stages)
        self.graphed_stage_steps = 0  # decode stage runs replayed (or captured) as graphs
        self.eager_stage_steps = 0  # decode stage runs done eagerly (no graph, or not valid this step)
        self._call_lock = threading.Lock()

    @property
    def devices(self) -> list[str]:
        return list(self.workers)

    def close(self) -> None:
        for b in self.bridges:
            b.close()
        for w in self.workers.values():
            w.close()
        self.bridges = []
        self.workers = {}

    # ---- the forward pass ----------------------------------------------------------------------------
    def forward(self, ids, states, positions, *, rows: str | None = "last", hidden_hook=None,
                chunk: int | None = None, cancel: threading.Event | None = None):
        """Same contract as Model.forward, with `chunk` (tokens per pipelined chunk; None = one) and
        `cancel` (checked before each chunk enters the pipeline; chunks already in flight finish, then
        GenerationCancelled is raised with `tokens_done`, the tokens that went through every layer).

        rows: "last" -> logits (1, vocab) of the last token; "all" -> (T, vocab); None -> no head.
        """
        ids = [int(t) for t in ids]
        positions = np.asarray(positions)
        T = len(ids)
        step = T if not chunk else max(1, int(chunk))
        starts = list(range(0, T, step)) or [0]
        if hidden_hook is not None and len(starts) > 1:
            raise ValueError("hidden_hook needs the whole sequence in one chunk")
        if len(starts) == 1 and self.inline_single_chunk:
            with self._call_lock:
                if T == 1 and rows == "last" and hidden_hook is None:
                    return self._decode_step(ids, states, positions)
                return self._forward_inline(ids, states, positions, rows, hidden_hook)
        with self._call_lock:  # one sequence at a time: states are updated in place
            job = _Job(len(starts), rows, results=[None] * len(starts),
                       slots=threading.Semaphore(self.max_in_flight))
            for c, s in enumerate(starts):
                job.slots.acquire()
                if job.error is not None or (cancel is not None and cancel.is_set()):
                    if job.error is None:
                        job.cancelled_at = c
                    job.slots.release()
                    for _ in range(c, len(starts)):
                        job.end_chunk()
                    break
                piece = ids[s : s + step]
                pos = positions[..., s : s + step]
                want = rows == "all" or (rows == "last" and c == len(starts) - 1)
                task = self._stage_task(job, 0, c, piece, pos, states, want, hidden_hook)
                self.stages[0].worker.submit(task)
            job.done.wait()
        if job.error is not None:
            raise job.error
        if job.cancelled_at is not None:
            exc = GenerationCancelled("prefill cancelled")
            exc.tokens_done = min(T, job.cancelled_at * step)
            raise exc
        if rows is None:
            return None
        out = [r for r in job.results if r is not None]
        if rows == "last":
            return out[-1]
        return np.concatenate(out, axis=0)

    def _stage_task(self, job: _Job, s: int, c: int, x, positions, states, want: bool, hook):
        def run() -> None:
            if job.error is not None:
                job.end_chunk()
                return
            try:
                self._run_stage(job, s, c, x, positions, states, want, hook)
            except BaseException as exc:  # reported to the caller, who re-raises it
                job.fail(exc)
                job.end_chunk()

        return run

    def _run_parts(self, stage: _Stage, x, positions, states, rows: str | None, hook):
        """The parts of one stage on its backend: x (token ids for the embedding, else the hidden state
        on this backend) -> the hidden state, or host logits when the stage ends with the head."""
        cfg, mod, weights = self.config, self.module, self.model.weights
        be = stage.backend
        for part in stage.parts:
            if part == "global":
                x = mod.embed(cfg, be, weights[part], x)
                if hook is not None:
                    hook(0, be.to_numpy(x))
            elif part == "head":
                if rows is None:
                    return None
                if rows == "last":
                    x = x[x.shape[0] - 1 :]
                run_head = getattr(self.model, "run_head", None)  # the LM head in blocks of rows
                if run_head is not None:
                    return run_head(x, be)
                return np.asarray(be.to_numpy(mod.head(cfg, be, weights[part], x)), dtype=np.float32)
            else:
                i = int(part.split(".")[1])
                x = mod.layer(cfg, be, weights[part], i, x, states[i], positions)
                if hook is not None:
                    hook(i + 1, be.to_numpy(x))
        return x

    def _forward_inline(self, ids, states, positions, rows: str | None, hook):
        """One chunk on the calling thread, stage after stage through the same staging buffers: for a
        decode step nothing can overlap, and thread hand-offs would only add latency."""
        x = ids
        for s, stage in enumerate(self.stages):
            if s:
                x = self.bridges[s - 1].move(x)
            x = self._run_parts(stage, x, positions, states, rows, hook)
        return x

    def _decode_step(self, ids, states, positions):
        """One token, stage after stage on the calling thread through the bridges' step buffers (see
        the module doc); returns the host logits (1, vocab) of the last stage."""
        last = len(self.stages) - 1
        out = pending = None
        for s, stage in enumerate(self.stages):
            host_in = self.bridges[s - 1].step_buffer if s else None
            host_out = self.bridges[s].step_buffer if s < last else None
            out, pending = self._decode_stage(s, stage, ids, states, positions, host_in, host_out, pending)
            if host_out is not None:
                self.bridges[s].bytes_moved += host_out.nbytes
        return out

    def _decode_stage(self, s: int, stage: _Stage, ids, states, positions, host_in, host_out, pending):
        """One stage of a decode step -> (host logits of the last stage or None, the event of a graph
        launched without a host wait or None). pending: such an event of the previous stage."""
        be = stage.backend

        def run(x):
            return self._run_parts(stage, x, positions, states, "last", None)

        step = getattr(be, "graph_step", None) if self.use_graphs else None
        if step is not None:
            done = step(("stage", s), run, ids, positions, owner=states,
                        watch=[states[i] for i in stage.layers], host_in=host_in, host_out=host_out,
                        after=pending, wait=not self.chain_graphs)
            if done is not None:
                self.graphed_stage_steps += 1
                charge = getattr(be, "charge_link", None)  # the rig's simulated link (engine/rig.py)
                if charge is not None:
                    for buf in (host_in, host_out):
                        if buf is not None:
                            charge(buf.nbytes)
                if host_out is None:
                    return done, None
                return None, (None if done is True else done)
        if pending is not None:
            pending.synchronize()  # the previous stage's output must be in host_in
        self.eager_stage_steps += 1
        x = ids
        if host_in is not None:
            x = be.asarray(host_in)
            if isinstance(x, np.ndarray) and np.shares_memory(x, host_in):
                x = x.copy()  # a CPU backend may wrap the host array; the buffer is rewritten next token
        out = run(x)
        if host_out is None:
            return out, None
        into = getattr(be, "to_numpy_into", None)
        if into is not None:
            into(out, host_out)
        else:
            np.copyto(host_out, be.to_numpy(out).reshape(host_out.shape), casting="same_kind")
        return None, None

    def _run_stage(self, job: _Job, s: int, c: int, x, positions, states, want: bool, hook) -> None:
        stage = self.stages[s]
        be = stage.backend
        out = self._run_parts(stage, x, positions, states, job.rows if want else None, hook)
        if s == len(self.stages) - 1:
            job.results[c] = out
            be.synchronize()
            job.end_chunk()
            return
        x = out
        be.synchronize()  # the link thread reads x; make sure this device finished writing it
        bridge = self.bridges[s]
        nxt = self.stages[s + 1]

        def hop() -> None:
            if job.error is not None:
                job.end_chunk()
                return
            try:
                y = bridge.move(x)
            except BaseException as exc:
                job.fail(exc)
                job.end_chunk()
                return
            nxt.worker.submit(self._stage_task(job, s + 1, c, y, positions, states, want, hook))

        bridge.worker.submit(hop)


# ------------------------------------------------------------------------------------------------
# Hooks used by engine/model.py


def attach_pipeline(model) -> Pipeline | None:
    """Give `model` a Pipeline when its parts use more than one device (replacing an old one)."""
    old = getattr(model, "pipeline", None)
    if old is not None:
        old.close()
    model.pipeline = None
    if len(set(model.device_plan.values())) > 1:
        model.pipeline = Pipeline(model)
    return model.pipeline


def _device_specs(config, devices) -> list[DeviceSpec]:
    """DeviceSpecs for plan_auto from what the caller passed: DeviceSpecs as they are, a Rig's specs,
    device names with the free memory the device listing reports (CPU devices share the RAM)."""
    if hasattr(devices, "device_specs"):
        return devices.device_specs()
    items = list(devices)
    if all(isinstance(d, DeviceSpec) for d in items):
        return items
    names = [d.name if isinstance(d, DeviceSpec) else str(d) for d in items]
    free: dict[str, int] = {}
    try:
        from .devices import list_devices

        for info in list_devices(include_cpu=True, with_probe=False):
            free[info.id] = int(info.free_bytes)
    except Exception:  # the listing is a convenience: without it every device counts as equal
        pass
    cpu_names = [n for n in names if n.startswith("cpu:")]
    ram = free.get("cpu:0", 0)
    out = []
    for n in names:
        if n.startswith("cpu:"):
            f = ram // max(1, len(cpu_names)) if ram > 0 else 64 * GiB
        else:
            f = free.get(n, -1)
            if f <= 0:
                f = 64 * GiB
        out.append(DeviceSpec(n, f))
    return out


def resolve_devices(config, gguf_file, placement=None, devices=None, *, make_backend=None):
    """What load_model needs from a placement and/or devices: (Placement, part -> device, device ->
    backend).

    placement: a Placement, a part -> device Mapping, or None; devices: device names, DeviceSpecs, or
    an engine.rig.Rig (its logical devices then provide the backends). Several devices without a
    placement are planned with plan_auto (in proportion to free memory, contiguous).
    """
    from .model import make_backend as default_make_backend
    from .model import part_names, plan_devices

    parts = part_names(config)
    rig = devices if hasattr(devices, "backend") and hasattr(devices, "device_specs") else None
    names = None
    if devices is not None:
        names = rig.names if rig is not None else [d.name if isinstance(d, DeviceSpec) else str(d)
                                                   for d in devices]
    def costs(device_names) -> object:
        # CPU devices run the NumPy reference backend, which holds float32 weights
        cpu_only = all(str(d).startswith("cpu") for d in device_names)
        return model_costs(config, gguf_file, layout="numpy" if cpu_only else "stored")

    if placement is None and names is not None and len(names) > 1:
        placement = plan_auto(costs(names), devices=_device_specs(config, devices))
    if isinstance(placement, Placement):
        plan = {p: placement.device_of(p) for p in parts}
    else:
        plan = plan_devices(config, placement, names)
        placement = Placement(costs(plan.values()), [plan[p] for p in parts])
    make = rig.backend if rig is not None else (make_backend or default_make_backend)
    by_device = {dev: make(dev) for dev in dict.fromkeys(plan.values())}
    return placement, plan, by_device


# ------------------------------------------------------------------------------------------------
# Benchmark of a split (called by `minecart bench --devices ...`)


@dataclass(frozen=True)
class SplitBenchResult:
    devices: list[str]
    segments: list[str]  # "cuda:0: the embedding and layers 0-15", ...
    prompt_tokens: int
    chunk: int
    prefill_seconds: float
    prefill_tokens_per_s: float
    sequential_prefill_seconds: float  # the same chunks without overlap (one chunk in flight); 0 = not run
    decode_tokens: int
    decode_seconds: float
    decode_tokens_per_s: float  # CUDA-graph decode where the backends capture one
    bytes_per_device: dict = field(default_factory=dict)  # device -> estimated total bytes
    link_bytes: int = 0
    decode_eager_tokens_per_s: float = 0.0  # the same decode with graphs switched off (0 = not run)
    graphed_stage_steps: int = 0  # split decode: stage runs replayed as graphs / run eagerly
    eager_stage_steps: int = 0
    memory: dict = field(default_factory=dict)  # device -> estimate vs measured (see _memory_report)

    @property
    def overlap_speedup(self) -> float:
        if not self.prefill_seconds or not self.sequential_prefill_seconds:
            return 0.0
        return self.sequential_prefill_seconds / self.prefill_seconds

    def lines(self) -> list[str]:
        out = [f"split over {', '.join(self.devices)}:"]
        out += [f"  {s}" for s in self.segments]
        line = (f"  prefill {self.prompt_tokens} tokens in chunks of {self.chunk}: "
                f"{self.prefill_tokens_per_s:.1f} tok/s ({self.prefill_seconds:.3f} s")
        if self.sequential_prefill_seconds:
            line += (f"; without overlap {self.sequential_prefill_seconds:.3f} s, overlap speedup "
                     f"{self.overlap_speedup:.2f}x")
        out.append(line + ")")
        line = f"  decode {self.decode_tokens} tokens: {self.decode_tokens_per_s:.1f} tok/s"
        if self.decode_eager_tokens_per_s:
            line += f" (graphs off: {self.decode_eager_tokens_per_s:.1f} tok/s)"
        out.append(line)
        for dev, m in self.memory.items():
            out.append(f"  memory {dev}: estimate {m['estimate'] / GiB:.2f} GiB, measured "
                       f"{m['measured'] / GiB:.2f} GiB ({m['how']}), measured/estimate {m['ratio']:.3f}")
            if "pool_peak" in m:
                t = m["estimate_terms"]
                out.append(f"    measured: context {m['context'] / GiB:.3f} + pool peak {m['pool_peak'] / GiB:.3f} GiB; "
                           f"device used at the end {m['device_used'] / GiB:.3f} GiB, of it outside the pool "
                           f"{m['outside_pool'] / GiB:.3f} GiB")
                out.append("    estimate: " + ", ".join(f"{k} {v / GiB:.3f}" for k, v in t.items()) + " GiB "
                           "(fragmentation and staging are part of activations)")
        return out


def _graph_switches(model) -> list:
    """(object, attribute) pairs that turn CUDA-graph decode on or off for this model: the pipeline's
    switch and each real backend's `use_graphs`."""
    out = []
    pipeline = getattr(model, "pipeline", None)
    if pipeline is not None:
        out.append((pipeline, "use_graphs"))
    seen = set()
    for be in model.backends.values():
        inner = getattr(be, "inner", be)
        if id(inner) not in seen and hasattr(inner, "use_graphs"):
            seen.add(id(inner))
            out.append((inner, "use_graphs"))
    return out


def _real_backends(model) -> list:
    """The distinct device backends of a model (a rig's logical devices unwrapped)."""
    out = {}
    for be in model.backends.values():
        inner = getattr(be, "inner", be)
        out[id(inner)] = inner
    return list(out.values())


def _sample_memory(model, reset: bool = False) -> None:
    """Let every CUDA backend note its memory pool's total (reset: start a new peak window)."""
    for be in _real_backends(model):
        f = getattr(be, "reset_memory_peak" if reset else "sample_memory", None)
        if f is not None:
            f()


def _memory_report(model, states, context: int, chunk: int) -> dict:
    """Per device: the placement's estimate for this context and chunk, and what was measured.

    A physical GPU holding one logical device is measured as its CUDA context (`context_bytes`: device
    memory in use when the process first made a backend there, less the pool) plus the highest total
    of CuPy's memory pool on it over the run (`memory_peak`: sampled after every prefill and decode of
    bench_split; the pool keeps freed blocks, so this is what the run held from the device, holes
    included). The estimate is priced with that measured context as its CUDA overhead, so the ratio
    judges everything else. Beside it: "device_used" (device total - free at the end) and
    "outside_pool" (device memory the pool does not account for: context, kernel modules, graph
    executables, driver page rounding), for the record. Logical devices sharing a GPU and CPU devices
    are measured as the arrays their parts' weights and the sequence's states hold
    (rig.allocated_bytes) against the estimate's resident bytes (weights, KV cache, recurrent state)."""
    import dataclasses

    from .rig import allocated_bytes

    placement = model.placement
    kv_type = getattr(model, "kv_type", None) or placement.kv_type
    plan = dataclasses.replace(placement, context=context, chunk=chunk, kv_type=kv_type)
    est = plan.bytes_per_device()
    physical = {}
    for part, dev in model.device_plan.items():
        be = model.backends[part]
        rig_dev = getattr(be, "rig_device", None)
        physical[dev] = rig_dev.physical if rig_dev is not None else str(getattr(be, "device", dev))
    out = {}
    for dev, e in est.items():
        be = next(model.backends[p] for p, d in model.device_plan.items() if d == dev)
        shared = sum(1 for d, ph in physical.items() if ph == physical[dev]) > 1
        real = getattr(be, "inner", be)
        if hasattr(real, "memory_peak") and not shared:
            ctx = int(real.context_bytes)
            e = dataclasses.replace(plan, cuda_context_bytes=ctx).bytes_per_device()[dev]
            pool = int(real.memory_peak())
            measured, estimate, how = ctx + pool, e.total, "CUDA context + pool peak"
            extra = {"context": ctx, "pool_peak": pool, "device_used": int(real.peak_memory()),
                     "outside_pool": int(real.outside_pool_bytes()),
                     "estimate_terms": {"weights": e.weights, "kv_cache": e.kv_cache, "recurrent": e.recurrent,
                                        "activations": e.activations, "fragmentation": e.fragmentation,
                                        "staging": e.staging, "overhead": e.overhead}}
        else:
            parts = [p for p, d in model.device_plan.items() if d == dev]
            held = [model.weights[p] for p in parts]
            held += [states[int(p.split(".")[1])] for p in parts if p.startswith("layer.")]
            measured, estimate, how = allocated_bytes(held), e.resident, "resident arrays"
            extra = {}
        out[dev] = {"estimate": int(estimate), "measured": measured, "how": how,
                    "ratio": measured / estimate if estimate else 0.0, **extra}
    return out


def bench_split(model, *, prompt_tokens: int = 512, chunk: int = 128, decode_tokens: int = 16,
                seed: int = 0, sequential: bool = True, eager_decode: bool = True) -> SplitBenchResult:
    """Time pipelined chunked prefill (and, with `sequential`, the same chunks with one chunk in
    flight, i.e. no overlap) and greedy decode on a loaded Model (one device or several): decode with
    CUDA graphs where the backends capture them and, with `eager_decode`, with graphs switched off.
    Token ids are random (seeded). The warm-up is a short prefill and a few decode steps."""
    rng = np.random.default_rng(seed)
    ids = [int(t) for t in rng.integers(0, model.config.vocab_size, size=prompt_tokens)]
    pipeline = getattr(model, "pipeline", None)
    capacity = prompt_tokens + 2 * decode_tokens + 4

    def prefill(tokens: list, in_flight: int | None) -> tuple[float, list, np.ndarray]:
        states = model.new_state(capacity)
        old = pipeline.max_in_flight if pipeline is not None else None
        if pipeline is not None and in_flight is not None:
            pipeline.max_in_flight = in_flight
        try:
            t0 = time.perf_counter()
            logits = model.forward(tokens, states, np.arange(len(tokens)), rows="last", chunk=chunk)
            dt = time.perf_counter() - t0
            _sample_memory(model)  # the pool's total after prefill (memory report)
            return dt, states, logits
        finally:
            if pipeline is not None:
                pipeline.max_in_flight = old

    def decode(states, token: int, start: int, n: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        for k in range(n):
            logits = model.forward([token], states, np.array([start + k]), rows="last")
            token = int(np.argmax(logits[-1]))
        dt = time.perf_counter() - t0
        _sample_memory(model)  # and after decode
        return dt, token

    _sample_memory(model, reset=True)  # the memory report's peak covers this run (from the load on)
    # warm-up: kernel compilation, first allocations, one graph capture per stage
    _, states, logits = prefill(ids[: min(prompt_tokens, 2 * chunk)], None)
    decode(states, int(np.argmax(logits[-1])), min(prompt_tokens, 2 * chunk), 3)
    model._free_states(states)
    seq_s = 0.0
    if sequential and pipeline is not None:
        seq_s, states, _ = prefill(ids, 1)
        model._free_states(states)
    for b in pipeline.bridges if pipeline is not None else ():
        b.bytes_moved = 0  # count the timed prefill's hops only
    pre_s, states, logits = prefill(ids, None)
    link = sum(b.bytes_moved for b in pipeline.bridges) if pipeline is not None else 0
    counts0 = (pipeline.graphed_stage_steps, pipeline.eager_stage_steps) if pipeline is not None else (0, 0)
    _, token = decode(states, int(np.argmax(logits[-1])), prompt_tokens, 1)  # (re-)captures the graphs
    dec_s, token = decode(states, token, prompt_tokens + 1, decode_tokens)
    graphed = (pipeline.graphed_stage_steps - counts0[0]) if pipeline is not None else 0
    eager_steps = (pipeline.eager_stage_steps - counts0[1]) if pipeline is not None else 0
    eager_s = 0.0
    if eager_decode:
        switches = _graph_switches(model)
        saved = [getattr(o, a) for o, a in switches]
        try:
            for o, a in switches:
                setattr(o, a, False)
            eager_s, token = decode(states, token, prompt_tokens + 1 + decode_tokens, decode_tokens)
        finally:
            for (o, a), v in zip(switches, saved, strict=True):
                setattr(o, a, v)
    memory = _memory_report(model, states, capacity, chunk) if getattr(model, "placement", None) is not None else {}
    model._free_states(states)
    placement = model.placement
    segs = [f"{s.device}: {placement.describe(range(s.start, s.stop))}" for s in placement.segments()]
    return SplitBenchResult(
        devices=placement.devices_used(), segments=segs, prompt_tokens=prompt_tokens, chunk=chunk,
        prefill_seconds=pre_s, prefill_tokens_per_s=prompt_tokens / pre_s, sequential_prefill_seconds=seq_s,
        decode_tokens=decode_tokens, decode_seconds=dec_s,
        decode_tokens_per_s=decode_tokens / dec_s if dec_s else 0.0,
        bytes_per_device={d: b.total for d, b in placement.bytes_per_device().items()}, link_bytes=link,
        decode_eager_tokens_per_s=decode_tokens / eager_s if eager_s else 0.0,
        graphed_stage_steps=graphed, eager_stage_steps=eager_steps, memory=memory)


def forward_in_chunks(model, ids, states, positions, *, rows: str | None, chunk: int, cancel=None):
    """Model.forward on one device for `chunk`-token pieces, one after another (no pipeline); the
    same contract and cancel behaviour as Pipeline.forward."""
    ids = [int(t) for t in ids]
    positions = np.asarray(positions)
    out = []
    for s in range(0, len(ids), chunk):
        if cancel is not None and cancel.is_set():
            exc = GenerationCancelled("prefill cancelled")
            exc.tokens_done = s
            raise exc
        last = s + chunk >= len(ids)
        want = "all" if rows == "all" else ("last" if rows == "last" and last else None)
        logits = model.forward(ids[s : s + chunk], states, positions[..., s : s + chunk], rows=want)
        if logits is not None:
            out.append(logits)
    if rows is None:
        return None
    return out[-1] if rows == "last" else np.concatenate(out, axis=0)
