"""Rig emulation: make one machine behave like a mining rig of small cards on slow risers.

A `Rig` is a list of logical devices. Each has a name the placement uses ("cuda:1"), the physical
device that really computes ("cuda:0": several logical devices may share one GPU; "cpu:N": separate
NumPy backends), an optional memory cap, and an optional simulated link (a PCIe Gen1 x1 riser moves
about 250 MB/s). `Rig.backend(name)` returns a `RigBackend`: the real backend behind a thin proxy that

- counts the bytes of what it allocates (weights, KV caches, recurrent state, `zeros`), and raises
  OutOfDeviceMemory (a DeviceError) when a logical device would go over its cap — the error names the device, the cap and
  the allocation, so a plan that would not fit a 4 GiB card fails the same way on a 140 GiB one;
- charges every host<->device copy (`asarray`, `to_numpy`) to the device's link: a copy of N bytes
  waits latency + N / bandwidth, measured from when the copy starts, so compute that overlaps it
  elsewhere is not slowed;
- in a split decode step (engine/execution.py: one captured graph per stage, chained by events, the
  host waiting only for the last stage's logits) charges the hidden state's crossings where a real
  riser's copy would sit: `graph_step` has each stage's graph hold its stream for the link's time
  before its copy of the arriving hidden state and after its copy of the leaving one (a captured
  single-thread kernel waiting on the GPU's global timer, kernels/link.cu), and the next stage follows
  the graph's event as it does without a link. The host thread never sleeps for a link there, as it
  would not on a rig whose copies run on the cards' copy engines. Simulated: the time (latency + bytes / rate, per riser, in
  order with the stages); real: the copies themselves (the H200's PCIe, a few microseconds). A step
  that cannot use its graph runs eagerly through asarray / to_numpy_into (host waits, as above). The
  logits row's copy to the host is not charged in graph decode (placement.predict_speed's
  logits_over_link=False prices that);
- charges a MoE layer's round trip to routed experts in host RAM (`host_round_trip`, engine/experts.py:
  the rows down and back) as one hold of the device's stream before it (inside the decode graph too;
  on a host device, a wait).

What this is not: a memory allocator (the real backend allocates; the cap is bookkeeping over what the
proxy sees, which is everything resident; transient activations are not capped) or a timing model of
compute. `allocated_bytes(obj)` (the sum of the arrays an object holds, file-mapped data excluded) is
also what tests use to compare the placement estimate with what a backend really holds.
"""

from __future__ import annotations

import mmap
import re
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import gpu_profiles
from .backends.base import Backend
from .backends.numpy_backend import NumpyBackend
from .devices import DeviceInfo
from .errors import DeviceError, OutOfDeviceMemory
from .gguf_file import TensorInfo
from .placement import DeviceSpec, DeviceSpeed, GiB, KiB, Link, MiB, check_device_name, format_bytes
from .sampling import PickSpec

# ------------------------------------------------------------------------------------------------
# Links (Link itself lives in engine/placement.py, whose speed prediction prices them)

# Usable one-way rates (after encoding overhead: 8b/10b for Gen1/2, 128b/130b from Gen3). Gen1 x1 is
# the riser every mining rig uses; Gen1 x4 is what most mining cards' own connectors run at.
LINKS = {
    "gen1x1": Link(250e6, 20e-6, "PCIe Gen1 x1"),
    "gen1x4": Link(1e9, 20e-6, "PCIe Gen1 x4"),
    "gen1x16": Link(4e9, 15e-6, "PCIe Gen1 x16"),
    "gen2x1": Link(500e6, 15e-6, "PCIe Gen2 x1"),
    "gen3x1": Link(985e6, 10e-6, "PCIe Gen3 x1"),
    "gen3x4": Link(3.94e9, 10e-6, "PCIe Gen3 x4"),
    "gen3x16": Link(15.75e9, 10e-6, "PCIe Gen3 x16"),
    "gen4x8": Link(15.75e9, 10e-6, "PCIe Gen4 x8"),
    "gen4x16": Link(31.5e9, 10e-6, "PCIe Gen4 x16"),
    "gen5x16": Link(63e9, 10e-6, "PCIe Gen5 x16"),
}


def parse_link(text: str) -> Link:
    """ "gen1x1", or a rate such as "250MB/s" (optionally "+20us" latency)."""
    key = text.strip().lower()
    if key in LINKS:
        return LINKS[key]
    m = re.fullmatch(r"([\d.]+)\s*([kmg]?)b/s(?:\+([\d.]+)us)?", key)
    if not m:
        raise DeviceError(f"link '{text}' is not understood; use one of {', '.join(LINKS)} or a rate like "
                          f"'250MB/s' or '250MB/s+20us'")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    latency = float(m.group(3)) * 1e-6 if m.group(3) else 20e-6
    return Link(float(m.group(1)) * scale, latency, text)


def _is_size(text: str) -> bool:
    return re.fullmatch(r"\s*[\d.]+\s*(b|kib|mib|gib|kb|mb|gb)?\s*", text.lower()) is not None


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*(b|kib|mib|gib|kb|mb|gb)?\s*", text.lower())
    if not m:
        raise DeviceError(f"memory size '{text}' is not understood; write e.g. '4GiB' or '3500MiB'")
    unit = {None: 1, "b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "kb": 1e3, "mb": 1e6, "gb": 1e9}[m.group(2)]
    return int(float(m.group(1)) * unit)


# ------------------------------------------------------------------------------------------------
# Measuring what an object holds


def _root(a):
    """The array that owns the memory of a view (or the file map / buffer it was made from)."""
    seen = 0
    while getattr(a, "base", None) is not None and seen < 64:
        a = a.base
        seen += 1
    return a


def _is_array(obj) -> bool:
    return hasattr(obj, "nbytes") and hasattr(obj, "dtype") and hasattr(obj, "shape")


def _file_backed(obj) -> bool:
    """True for numpy views of a memory-mapped file: they cost page cache, not allocations."""
    import numpy as np

    a = obj
    for _ in range(64):
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        if isinstance(a, memoryview):  # a buffer over the file map (engine.gguf_file's reader)
            return isinstance(a.obj, mmap.mmap)
        base = getattr(a, "base", None)
        if base is None:
            return False
        a = base
    return False


def allocated_bytes(obj, _seen: set | None = None, _depth: int = 0) -> int:
    """Bytes of the arrays `obj` holds (arrays, dicts, lists, tuples, plain objects), each buffer once.

    Views count their owning buffer; memory-mapped file data counts nothing (that is where an
    embedding table left in the GGUF file lives). GGUF TensorInfo objects are skipped for that reason.
    """
    seen = set() if _seen is None else _seen
    if obj is None or isinstance(obj, (str, bytes, int, float, bool)) or _depth > 8:
        return 0
    if _is_array(obj):
        if _file_backed(obj):
            return 0
        root = _root(obj)
        owner = root if _is_array(root) else obj
        if id(owner) in seen:
            return 0
        seen.add(id(owner))
        return int(owner.nbytes)
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, dict):
        return sum(allocated_bytes(v, seen, _depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(allocated_bytes(v, seen, _depth + 1) for v in obj)
    if isinstance(obj, TensorInfo):  # file data
        return 0
    if isinstance(obj, (type, types.FunctionType, types.MethodType, types.ModuleType)):
        return 0
    fields = dict(getattr(obj, "__dict__", {}))
    for slot in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, slot):
            fields[slot] = getattr(obj, slot)
    return sum(allocated_bytes(v, seen, _depth + 1) for v in fields.values())


# ------------------------------------------------------------------------------------------------
# Logical devices


# usable one-way bytes/s of one lane and the fixed cost of a copy, by PCIe generation (as LINKS)
_LANE = {1: (250e6, 20e-6), 2: (500e6, 15e-6), 3: (984.4e6, 10e-6), 4: (1968.75e6, 10e-6),
         5: (3937.5e6, 10e-6), 6: (7875e6, 10e-6)}


def pcie_link(generation: int, lanes: int) -> Link:
    """The link of a PCIe generation and lane count (LINKS' own entry where it has one)."""
    if generation < 1 or lanes < 1:
        raise DeviceError(f"PCIe Gen{generation} x{lanes} is not a link")
    known = LINKS.get(f"gen{generation}x{lanes}")
    if known is not None:
        return known
    rate, latency = _LANE[min(generation, max(_LANE))]
    return Link(rate * lanes, latency, f"PCIe Gen{generation} x{lanes}")


def device_spec(info: DeviceInfo, free_bytes: int | None = None) -> DeviceSpec:
    """What placement needs to know about a listed device (engine/devices.py): its name, the bytes it
    can give (its free memory unless `free_bytes` says otherwise), its name for people, its PCIe link
    as NVML read it (a card on an x1 riser is priced as one), else the link of its
    resources/gpu_profiles.json profile, and that profile's speed (for the speed prediction and
    speed-aware splits). Used by the engine's automatic plans, `minecart plan` and the app's map."""
    free = info.free_bytes if free_bytes is None else free_bytes
    profile = gpu_profiles.find(info.name) if info.kind == "cuda" else None
    read = pcie_link(*info.pcie) if info.pcie is not None else None
    if profile is None:
        return DeviceSpec(info.id, int(free), info.name, link=read)
    return DeviceSpec(info.id, int(free), info.name, speed=profile.speed, link=read or LINKS.get(profile.link))


@dataclass(frozen=True)
class RigDevice:
    """One logical device: placement name, physical device, memory cap (None = none), link (None = free),
    and the card it stands for (a resources/gpu_profiles.json profile name; its speed, for planning)."""

    name: str
    physical: str
    memory_cap: int | None = None
    link: Link | None = None
    card: str = ""
    speed: DeviceSpeed | None = None

    def __post_init__(self):
        check_device_name(self.name)
        check_device_name(self.physical)
        if self.name.split(":")[0] != self.physical.split(":")[0]:
            raise DeviceError(f"logical device {self.name} cannot run on {self.physical}: "
                              f"cuda devices map to a GPU, cpu devices to the CPU")


class RigBackend:
    """A real backend behind a proxy that enforces its logical device's cap and link (see module doc).

    Every attribute not defined here is the real backend's (so all ops run unchanged).
    """

    def __init__(self, inner: Backend, device: RigDevice):
        self._inner = inner
        self.rig_device = device
        self.device = device.name
        self.name = inner.name
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}  # id(object) -> bytes counted for it
        self.used_bytes = 0
        self.peak_bytes = 0
        self.transferred_bytes = 0
        self.transfer_seconds = 0.0

    def __getattr__(self, attr):
        return getattr(self._inner, attr)

    def __repr__(self) -> str:
        cap = format_bytes(self.rig_device.memory_cap) if self.rig_device.memory_cap else "no cap"
        link = self.rig_device.link.name if self.rig_device.link else "no link limit"
        return f"RigBackend({self.device} on {self.rig_device.physical}, {cap}, {link})"

    @property
    def inner(self):
        return self._inner

    @property
    def free_bytes(self) -> int | None:
        cap = self.rig_device.memory_cap
        return None if cap is None else cap - self.used_bytes

    # ---- memory ---------------------------------------------------------------------------------------
    def _charge(self, obj, what: str, n: int | None = None):
        n = allocated_bytes(obj) if n is None else n
        with self._lock:
            cap = self.rig_device.memory_cap
            if cap is not None and self.used_bytes + n > cap:
                over = True
            else:
                over = False
                self._held[id(obj)] = self._held.get(id(obj), 0) + n
                self.used_bytes += n
                self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        if over:
            assert cap is not None
            self._inner.free(obj)
            raise OutOfDeviceMemory(
                f"{self.device} is out of memory: {what} needs {format_bytes(n)}, "
                f"{format_bytes(self.used_bytes)} of its {format_bytes(cap)} cap are in use; "
                f"move layers to another device or lower the context")
        return obj

    def load_weight(self, info, *, role: str = "matmul"):
        return self._charge(self._inner.load_weight(info, role=role), f"weight '{info.name}'")

    def load_fused(self, infos):
        """A weight group (one array on the real backend, each weight a view of its rows): each
        weight is charged its own rows' bytes (allocated_bytes would count the whole array per view)."""
        ws = self._inner.load_fused(infos)
        charged = 0
        try:
            for info, w in zip(infos, ws, strict=True):
                self._charge(w, f"weight '{info.name}'", int(w.nbytes))
                charged += 1
        except DeviceError:  # _charge freed the weight it refused; the rest of the group goes too
            for j, w in enumerate(ws):
                if j != charged:
                    (self.free if j < charged else self._inner.free)(w)
            raise
        return ws

    def zeros(self, shape, dtype: str = "float32"):
        return self._charge(self._inner.zeros(shape, dtype), f"a {dtype} array of shape {tuple(shape)}")

    def new_kv_cache(self, n_kv_heads: int, head_dim: int, value_dim: int, capacity: int,
                     kv_type: str = "f32"):
        return self._charge(self._inner.new_kv_cache(n_kv_heads, head_dim, value_dim, capacity, kv_type=kv_type),
                            f"a {kv_type} KV cache of {capacity} tokens")

    def free(self, obj) -> None:
        with self._lock:
            n = self._held.pop(id(obj), 0)
            self.used_bytes -= n
        self._inner.free(obj)

    def measure(self, objects) -> int:
        """Re-measure everything resident (e.g. after lazy allocations) and check the cap again."""
        n = allocated_bytes(objects)
        cap = self.rig_device.memory_cap
        if cap is not None and n > cap:
            raise DeviceError(f"{self.device} holds {format_bytes(n)}, more than its {format_bytes(cap)} cap; "
                              f"move layers to another device or lower the context")
        return n

    # ---- link -------------------------------------------------------------------------------------------
    def _wait_link(self, n_bytes: int, started: float) -> None:
        link = self.rig_device.link
        if link is None:
            return
        _wait_until(started + link.seconds(n_bytes))
        with self._lock:
            self.transferred_bytes += n_bytes
            self.transfer_seconds += link.seconds(n_bytes)

    def graph_step(self, key, run, ids, positions, *, owner, watch=None, host_in=None, host_out=None,
                   after=None, wait: bool = True, link_seconds: tuple[float, float] = (0.0, 0.0),
                   chained: bool = False, pick: PickSpec | None = None):
        """The real backend's captured decode step (engine/execution.py) with this device's link charged
        for the hidden state the step receives (`host_in`) and sends (`host_out`), where a riser's copy
        would take it: inside a CUDA device's graph, the stream is held for the link's time before the
        graph's copy from `host_in` and after its copy to `host_out` (CupyBackend.graph_step
        `link_seconds`), so the stages follow each other through the same events as without a link,
        and the host thread never waits for a link. A step that cannot use a graph (None) is run
        eagerly by the executor, whose copies (asarray / to_numpy_into) pay the link."""
        link = self.rig_device.link
        if link is None or (host_in is None and host_out is None):
            return self._inner.graph_step(key, run, ids, positions, owner=owner, watch=watch, host_in=host_in,
                                          host_out=host_out, after=after, wait=wait, link_seconds=link_seconds,
                                          chained=chained, pick=pick)
        crossed = [0 if b is None else int(b.nbytes) for b in (host_in, host_out)]
        held = (0.0 if host_in is None else link.seconds(crossed[0]),
                0.0 if host_out is None else link.seconds(crossed[1]))
        done = self._inner.graph_step(key, run, ids, positions, owner=owner, watch=watch, host_in=host_in,
                                      host_out=host_out, after=after, wait=wait, link_seconds=held,
                                      chained=chained, pick=pick)
        if done is not None:
            with self._lock:
                self.transferred_bytes += sum(crossed)
                self.transfer_seconds += sum(held)
        return done

    def host_round_trip(self, x, host_x, host_y, fn, arg: int):
        """The real backend's round trip (DeviceHooks.host_round_trip: routed experts in host RAM) with
        this device's link charged for the rows going down and coming back: on a CUDA device as a hold
        of its stream queued before the round trip (inside a captured graph too), on a host device as
        a wait."""
        self._charge_round_trip(host_x, host_y)
        return self._inner.host_round_trip(x, host_x, host_y, fn, arg)

    def expert_call(self, x, router, k: int, host_x, host_y, channel, entry: int):
        """The real backend's call to the expert pool (DeviceHooks.expert_call) with this device's link
        charged for the rows going down and coming back, as host_round_trip charges them."""
        self._charge_round_trip(host_x, host_y)
        return self._inner.expert_call(x, router, k, host_x, host_y, channel, entry)

    def _charge_round_trip(self, host_x, host_y) -> None:
        link = self.rig_device.link
        if link is None:
            return
        seconds = link.seconds(int(host_x.nbytes)) + link.seconds(int(host_y.nbytes))
        self._hold(seconds)
        with self._lock:
            self.transferred_bytes += int(host_x.nbytes) + int(host_y.nbytes)
            self.transfer_seconds += seconds

    def _hold(self, seconds: float) -> None:
        """The link's `seconds`, from now: on a CUDA device the real backend's graph stream is held
        that long on the GPU (CupyBackend.hold, kernels/link.cu) and the host goes on; on a host device
        (no streams) the host waits."""
        if self.rig_device.physical.startswith("cuda:"):
            # CupyBackend.hold: a host backend has no stream to hold, so it is not a Backend member
            self._inner.hold(seconds)  # type: ignore[attr-defined]
            return
        _wait_until(time.perf_counter() + seconds)

    def asarray(self, host_array):
        started = time.perf_counter()
        out = self._inner.asarray(host_array)
        self._wait_link(int(out.nbytes), started)
        return out

    def to_numpy(self, x):
        started = time.perf_counter()
        out = self._inner.to_numpy(x)
        self._wait_link(int(out.nbytes), started)
        return out

    def to_numpy_into(self, x, out) -> None:
        """Copy x into the host array `out` (the bridges' staging buffer), charged to the link."""
        started = time.perf_counter()
        self._inner.to_numpy_into(x, out)
        self._wait_link(int(out.nbytes), started)


def _wait_until(deadline: float) -> None:
    """Sleep until perf_counter() reaches `deadline`. A plain sleep oversleeps by 0.1-1 ms (more in
    sandboxed kernels), which would swamp the ~60 us a decode step's hop takes on a real riser, so
    the last stretch yields in a loop instead (sleep(0) lets the other threads run meanwhile)."""
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        if left > 2e-3:
            time.sleep(left - 1.5e-3)
        else:
            time.sleep(0)


def _make_backend(physical: str):
    if physical.startswith("cpu:"):
        return NumpyBackend(device=physical)
    try:
        # local import: CuPy is an optional dependency, and importing it starts CUDA
        from .backends.cupy_backend import CupyBackend
    except ImportError as exc:
        raise DeviceError(f"{physical} needs the CUDA backend, which could not be imported ({exc}); "
                          f"install minecart[cuda12] or use cpu devices") from exc
    return CupyBackend(device=physical)


@dataclass
class Rig:
    """A set of logical devices (see module doc). `backend(name)` makes each backend once."""

    devices: list[RigDevice]
    backend_factory: Callable[[str], Any] | None = None  # physical -> backend; default: NumPy for cpu, CuPy for cuda
    _backends: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        names = [d.name for d in self.devices]
        if len(set(names)) != len(names):
            raise DeviceError(f"a logical device is listed twice in {names}")

    @classmethod
    def logical(cls, physical: str, caps, link: Link | str | None = None, prefix: str | None = None,
                **kwargs) -> Rig:
        """len(caps) logical devices on one physical device: names "<kind>:0", "<kind>:1", ...
        caps: bytes per logical device (None = no cap)."""
        kind = prefix or physical.split(":")[0]
        lk = parse_link(link) if isinstance(link, str) else link
        return cls([RigDevice(f"{kind}:{i}", physical, cap, lk) for i, cap in enumerate(caps)], **kwargs)

    @classmethod
    def cpus(cls, n: int, caps=None, link: Link | str | None = None, **kwargs) -> Rig:
        """n CPU devices "cpu:0".."cpu:{n-1}", each its own NumPy backend."""
        lk = parse_link(link) if isinstance(link, str) else link
        caps = list(caps) if caps is not None else [None] * n
        return cls([RigDevice(f"cpu:{i}", f"cpu:{i}", caps[i], lk) for i in range(n)], **kwargs)

    @classmethod
    def parse(cls, text: str, physical_gpus: int = 1, **kwargs) -> Rig:
        """From a command-line description: comma-separated `NAME[=CAP|=CARD|=CARD/CAP][@LINK]`, e.g.
        "cuda:0=P104-100@gen1x1,cuda:1=4GiB@gen1x1,cpu:0=64GiB". CARD is a profile of
        resources/gpu_profiles.json: its memory is the cap (unless CAP follows it) and its speed is
        the device's for planning; without @LINK a card has its own link, a bare cap none.
        Logical cuda:N runs on physical cuda:(N mod physical_gpus); cpu:N on its own NumPy backend."""
        devices = []
        for item in filter(None, (s.strip() for s in text.split(","))):
            m = re.fullmatch(r"((?:cuda|cpu):\d+)(?:=([^@]+))?(?:@(.+))?", item)
            if not m:
                raise DeviceError(f"rig device '{item}' is not understood; write NAME[=CAP|=CARD][@LINK], "
                                  f"e.g. 'cuda:1=4GiB@gen1x1' or 'cuda:0=P104-100@gen1x1'")
            name = m.group(1)
            kind, idx = name.split(":")
            physical = f"cuda:{int(idx) % max(1, physical_gpus)}" if kind == "cuda" else name
            value = (m.group(2) or "").strip()
            cap, card, speed = None, "", None
            link = parse_link(m.group(3)) if m.group(3) else None
            if value and _is_size(value):
                cap = parse_bytes(value)
            elif value:
                card_name, _, card_cap = value.partition("/")
                if kind != "cuda":
                    raise DeviceError(f"{name} is a CPU device; give its memory (e.g. {name}=64GiB), not a card")
                profile = gpu_profiles.card(card_name.strip())
                card, speed = profile.name, profile.speed
                cap = parse_bytes(card_cap) if card_cap else profile.memory_bytes
                link = link or LINKS[profile.link]
            devices.append(RigDevice(name, physical, cap, link, card, speed))
        if not devices:
            raise DeviceError("the rig description names no devices")
        return cls(devices, **kwargs)

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.devices]

    def device(self, name: str) -> RigDevice:
        for d in self.devices:
            if d.name == name:
                return d
        raise DeviceError(f"{name} is not a device of this rig ({', '.join(self.names)})")

    def backend(self, name: str) -> RigBackend:
        if name not in self._backends:
            dev = self.device(name)
            factory = self.backend_factory or _make_backend
            self._backends[name] = RigBackend(factory(dev.physical), dev)
        return self._backends[name]

    def backends(self) -> dict[str, RigBackend]:
        return {n: self.backend(n) for n in self.names}

    def device_specs(self, default_free: int = 1 << 40) -> list[DeviceSpec]:
        """DeviceSpecs for plan_auto: the cap minus what is already held (default_free when uncapped).
        The CUDA context is not part of a logical device's use, so plan with cuda_context_bytes=0 when
        several logical devices share one physical GPU (they share one context)."""
        out = []
        for d in self.devices:
            used = self._backends[d.name].used_bytes if d.name in self._backends else 0
            free = (d.memory_cap - used) if d.memory_cap is not None else default_free
            label = f"{d.card} on {d.physical}" if d.card else f"on {d.physical}"
            out.append(DeviceSpec(d.name, free, label=label, speed=d.speed, link=d.link))
        return out
