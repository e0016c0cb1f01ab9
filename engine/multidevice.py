"""Measuring a model on one device or split over several: `bench_split` and its memory report.

`minecart bench --devices ...` prints what `bench_split` measures: pipelined chunked prefill (and the
same chunks with one chunk in flight, i.e. without overlap), decode with and without CUDA graphs, the
bytes that crossed the host bridges, and per device the placement's memory estimate beside what was
measured. Running the model is engine/execution.py's job (stages, bridges, the one executor); this
file only drives it and reads its counters.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from .placement import GiB
from .rig import RigBackend, allocated_bytes

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
                           "(staging is part of activations; modules, graphs and rounding of overhead)")
        return out


def _real_backends(model) -> list:
    """The distinct device backends of a model (a rig's logical devices unwrapped)."""
    out = {}
    for be in model.backends.values():
        inner = be.inner if isinstance(be, RigBackend) else be
        out[id(inner)] = inner
    return list(out.values())


def _graph_switches(model) -> list:
    """(object, attribute) pairs that turn CUDA-graph decode on or off for this model: the executor's
    switch and each device backend's `use_graphs` (the CuPy backend's)."""
    out: list = [(model.executor, "use_graphs")]
    out += [(be, "use_graphs") for be in _real_backends(model) if be.pins_host_memory]
    return out


def _sample_memory(model, reset: bool = False) -> None:
    """Let every CUDA backend note its memory pool's total (reset: start a new peak window)."""
    for be in _real_backends(model):
        if be.pins_host_memory:  # a CUDA backend: it has a memory pool
            if reset:
                be.reset_memory_peak()
            else:
                be.sample_memory()


def _memory_report(model, states, context: int, chunk: int) -> dict:
    """Per device: the placement's estimate for this context and chunk, and what was measured.

    A physical GPU holding one logical device is measured as its CUDA context (`context_bytes`: device
    memory in use when the process first made a backend there, less the pool) plus the highest total
    of CuPy's memory pool on it over the run (`memory_peak`: sampled after every prefill and decode of
    bench_split; the pool keeps freed blocks, so this is what the run held from the device, holes
    included), plus the device memory outside the pool beyond the context at the end (kernel modules,
    graph executables). The estimate is priced with that measured context as its CUDA overhead, so the
    ratio judges everything else. Beside it: "device_used" (device total - free at the end) and
    "outside_pool" (device memory the pool does not account for: context, kernel modules, graph
    executables, driver page rounding), for the record. Logical devices sharing a GPU and CPU devices
    are measured as the arrays their parts' weights and the sequence's states hold
    (rig.allocated_bytes) against the estimate's resident bytes (weights, KV cache, recurrent state)."""
    placement = model.placement
    kv_type = model.kv_type or placement.kv_type
    plan = dataclasses.replace(placement, context=context, chunk=chunk, kv_type=kv_type)
    est = plan.bytes_per_device()
    physical = {}
    for part, dev in model.device_plan.items():
        be = model.backends[part]
        physical[dev] = be.rig_device.physical if isinstance(be, RigBackend) else be.device
    out = {}
    for dev, e in est.items():
        be = next(model.backends[p] for p, d in model.device_plan.items() if d == dev)
        shared = sum(1 for d, ph in physical.items() if ph == physical[dev]) > 1
        real = be.inner if isinstance(be, RigBackend) else be
        if real.pins_host_memory and not shared:
            ctx = int(real.context_bytes)
            e = dataclasses.replace(plan, cuda_context_bytes=ctx).bytes_per_device()[dev]
            pool = int(real.memory_peak())
            outside = int(real.outside_pool_bytes())
            # beyond the context, outside the pool: kernel modules, graph executables (in the estimate)
            # and the driver's rounding of the arrays allocated one by one (KV caches, states, scratch;
            # not priced). The weights are in whole-page arenas in the pool, their padding `rounding`.
            measured = ctx + pool + max(0, outside - ctx)
            estimate, how = e.total, "CUDA context + pool peak + modules, graphs and the driver's rounding"
            extra = {"context": ctx, "pool_peak": pool, "device_used": int(real.peak_memory()),
                     "outside_pool": outside,
                     "estimate_terms": {"weights": e.weights, "kv_cache": e.kv_cache, "recurrent": e.recurrent,
                                        "activations": e.activations, "staging": e.staging,
                                        "overhead": e.overhead, "modules": e.modules, "graphs": e.graphs,
                                        "rounding": e.rounding}}
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
    ex = model.executor
    pipeline = ex if ex.split else None
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
    memory = _memory_report(model, states, capacity, chunk) if model.placement is not None else {}
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
