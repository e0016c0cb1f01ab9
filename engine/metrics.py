"""Metrics: thread-safe, timestamped ring buffers that the engine appends to and readers snapshot.

What is recorded:
- prefill and decode tokens/s, once per finished request and (decode) a few times a second while a
  request is generating, so a live plot moves during a long answer;
- memory used per device over time: NVML for CUDA devices (device-wide used bytes, as nvidia-smi shows),
  the process resident set size for "cpu";
- per-request timings: queue wait, prefill time, time to first token, decode time, token counts.

The engine (runtime thread, a sampler thread) only appends; the desktop app reads `snapshot()` on a
QTimer at 10-20 Hz and the HTTP server serves it at `/metrics`. Nothing here calls back into a reader, and
nothing here imports Qt, numpy or cupy: snapshots are plain lists and dicts (JSON-ready).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

# How many points each series keeps. At a 2 Hz memory sample rate 1800 points is 15 minutes of history.
DEFAULT_CAPACITY = 1800
# Live decode-rate points are rate-limited so a 100 tok/s stream does not flood the buffer.
LIVE_RATE_INTERVAL_S = 0.25


class RingBuffer:
    """A fixed-size series of (timestamp, value) points; appends and snapshots may come from any thread.

    Timestamps are `time.time()` seconds (wall clock, comparable across processes and plot-friendly).
    `version` counts appends, so a reader can skip redrawing when nothing changed.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"ring buffer capacity must be >= 1, got {capacity}")
        self._points: deque[tuple[float, float]] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.version = 0

    @property
    def capacity(self) -> int:
        return self._points.maxlen or 0

    def append(self, value: float, t: float | None = None) -> None:
        point = (time.time() if t is None else float(t), float(value))
        with self._lock:
            self._points.append(point)
            self.version += 1

    def snapshot(self, since: float | None = None) -> tuple[list[float], list[float]]:
        """Copies of (times, values), oldest first; only points newer than `since` when given."""
        with self._lock:
            points = list(self._points)
        if since is not None:
            points = [p for p in points if p[0] > since]
        return [p[0] for p in points], [p[1] for p in points]

    def last(self) -> tuple[float, float] | None:
        with self._lock:
            return self._points[-1] if self._points else None

    def clear(self) -> None:
        with self._lock:
            self._points.clear()
            self.version += 1

    def __len__(self) -> int:
        with self._lock:
            return len(self._points)


@dataclass(frozen=True)
class RequestTiming:
    """Where the time of one generation request went. Durations in seconds; None = did not happen."""

    request_id: int
    kind: str  # "chat" or "completion"
    submitted: float  # time.time() when the client queued it
    queue_wait_s: float  # submitted -> the runtime thread picked it up
    prefill_s: float | None  # picked up -> the first token was sampled (prompt processing)
    time_to_first_token_s: float | None  # submitted -> first token (what a user waits)
    decode_s: float | None  # first token -> last token
    prompt_tokens: int
    generated_tokens: int
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None
    finish_reason: str  # "stop", "length", "cancelled", "error"

    def to_dict(self) -> dict:
        return asdict(self)


class Metrics:
    """All series of one runtime. Create one per Runtime; readers call `snapshot()`."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, request_capacity: int = 256):
        self.capacity = capacity
        self.prefill_tps = RingBuffer(capacity)  # one point per finished request
        self.decode_tps = RingBuffer(capacity)  # one point per finished request
        self.decode_tps_live = RingBuffer(capacity)  # running rate while a request decodes
        self._memory: dict[str, RingBuffer] = {}
        self._memory_total: dict[str, float] = {}
        self._requests: deque[RequestTiming] = deque(maxlen=request_capacity)
        self._lock = threading.Lock()
        self._last_live_point = 0.0
        self._sampler: threading.Thread | None = None
        self._sampler_stop = threading.Event()
        self._devices: list[str] = ["cpu"]
        self._nvml = _NvmlProbe()

    # -- writers (engine side) -------------------------------------------------------------------

    def record_request(self, timing: RequestTiming) -> None:
        with self._lock:
            self._requests.append(timing)
        t = time.time()
        if timing.prefill_tokens_per_s is not None:
            self.prefill_tps.append(timing.prefill_tokens_per_s, t)
        if timing.decode_tokens_per_s is not None:
            self.decode_tps.append(timing.decode_tokens_per_s, t)

    def record_live_decode_rate(self, tokens_per_s: float, force: bool = False) -> None:
        """A running decode rate during generation; rate-limited to a few points per second."""
        now = time.time()
        with self._lock:
            if not force and now - self._last_live_point < LIVE_RATE_INTERVAL_S:
                return
            self._last_live_point = now
        self.decode_tps_live.append(tokens_per_s, now)

    def record_memory(self, device: str, used_bytes: float, total_bytes: float | None = None) -> None:
        with self._lock:
            buf = self._memory.get(device)
            if buf is None:
                buf = self._memory[device] = RingBuffer(self.capacity)
            if total_bytes is not None:
                self._memory_total[device] = float(total_bytes)
        buf.append(used_bytes)

    def set_devices(self, devices) -> None:
        """The devices whose memory the sampler reads ("cpu", "cuda:0", ...). "cpu" is always kept."""
        # "cpu:0" and "cpu" are the same memory (this process's RSS): one series called "cpu".
        names = ["cpu"] + [str(d) for d in devices if not str(d).startswith("cpu")]
        with self._lock:
            self._devices = list(dict.fromkeys(names))

    def sample_memory(self) -> None:
        """Read memory use of every known device once and append it."""
        with self._lock:
            devices = list(self._devices)
        for device in devices:
            if device == "cpu":
                rss = process_rss_bytes()
                if rss is not None:
                    self.record_memory("cpu", rss)
            elif device.startswith("cuda"):
                index = int(device.split(":", 1)[1]) if ":" in device else 0
                info = self._nvml.memory(index)
                if info is not None:
                    self.record_memory(device, info[0], info[1])

    def start_sampler(self, interval_s: float = 0.5) -> None:
        """Sample memory every `interval_s` on a daemon thread (idempotent)."""
        if self._sampler is not None and self._sampler.is_alive():
            return
        self._sampler_stop.clear()

        def loop():
            while not self._sampler_stop.is_set():
                try:
                    self.sample_memory()
                except Exception:  # noqa: BLE001 - telemetry must never take the engine down
                    pass
                self._sampler_stop.wait(interval_s)

        self._sampler = threading.Thread(target=loop, name="minecart-metrics", daemon=True)
        self._sampler.start()

    def stop_sampler(self) -> None:
        self._sampler_stop.set()
        if self._sampler is not None:
            self._sampler.join(timeout=2.0)
            self._sampler = None

    # -- readers ------------------------------------------------------------------------------------

    def requests(self, last: int | None = None) -> list[RequestTiming]:
        with self._lock:
            items = list(self._requests)
        return items if last is None else items[-last:]

    def memory_devices(self) -> list[str]:
        """Devices that have a memory series, in the order they first appeared."""
        with self._lock:
            return list(self._memory)

    def memory(self, device: str) -> RingBuffer | None:
        with self._lock:
            return self._memory.get(device)

    def snapshot(self, since: float | None = None, last_requests: int = 32) -> dict:
        """A JSON-ready copy of everything: {"time", "prefill_tps", "decode_tps", "decode_tps_live",
        "memory": {device: {"t", "used_bytes", "total_bytes"}}, "requests": [RequestTiming dicts]}.
        Series are {"t": [...], "v": [...]}; `since` keeps only newer points (incremental readers)."""

        def series(buf: RingBuffer) -> dict:
            t, v = buf.snapshot(since)
            return {"t": t, "v": v}

        with self._lock:
            memory = dict(self._memory)
            totals = dict(self._memory_total)
        mem = {}
        for device, buf in memory.items():
            t, v = buf.snapshot(since)
            mem[device] = {"t": t, "used_bytes": v, "total_bytes": totals.get(device)}
        return {
            "time": time.time(),
            "prefill_tps": series(self.prefill_tps),
            "decode_tps": series(self.decode_tps),
            "decode_tps_live": series(self.decode_tps_live),
            "memory": mem,
            "requests": [r.to_dict() for r in self.requests(last_requests)],
        }


def process_rss_bytes() -> int | None:
    """Resident set size of this process in bytes (Linux /proc, Windows psapi, else peak RSS)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    if sys.platform == "win32":
        return _windows_rss()
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # macOS reports bytes, other Unixes kilobytes.
        return int(peak if sys.platform == "darwin" else peak * 1024)
    except (ImportError, OSError):
        return None


def _windows_rss() -> int | None:
    try:
        import ctypes
        from ctypes import wintypes

        class Counters(ctypes.Structure):
            _fields_ = [
                ("cb", wintypes.DWORD),
                ("PageFaultCount", wintypes.DWORD),
                ("PeakWorkingSetSize", ctypes.c_size_t),
                ("WorkingSetSize", ctypes.c_size_t),
                ("QuotaPeakPagedPoolUsage", ctypes.c_size_t),
                ("QuotaPagedPoolUsage", ctypes.c_size_t),
                ("QuotaPeakNonPagedPoolUsage", ctypes.c_size_t),
                ("QuotaNonPagedPoolUsage", ctypes.c_size_t),
                ("PagefileUsage", ctypes.c_size_t),
                ("PeakPagefileUsage", ctypes.c_size_t),
            ]

        counters = Counters()
        counters.cb = ctypes.sizeof(Counters)
        windll = ctypes.windll  # type: ignore[attr-defined]  # Windows only; this branch runs only there
        process = windll.kernel32.GetCurrentProcess()
        if not windll.psapi.GetProcessMemoryInfo(process, ctypes.byref(counters), counters.cb):
            return None
        return int(counters.WorkingSetSize)
    except (OSError, AttributeError):
        return None


class _NvmlProbe:
    """Lazy NVML access. NVML numbers GPUs by PCI order; CUDA does too when CUDA_DEVICE_ORDER=PCI_BUS_ID,
    and otherwise usually agrees on single-vendor rigs. Any NVML failure turns GPU sampling off quietly."""

    def __init__(self):
        self._lock = threading.Lock()
        self._state = "new"  # "new", "ok", "off"
        self._handles: dict[int, object] = {}
        self._pynvml = None

    def memory(self, index: int) -> tuple[int, int] | None:
        with self._lock:
            if self._state == "new":
                try:
                    import pynvml

                    pynvml.nvmlInit()
                    self._pynvml = pynvml
                    self._state = "ok"
                except Exception:  # noqa: BLE001 - no driver, no library: no GPU telemetry
                    self._state = "off"
            if self._state != "ok":
                return None
            nv = self._pynvml
            try:
                handle = self._handles.get(index)
                if handle is None:
                    handle = self._handles[index] = nv.nvmlDeviceGetHandleByIndex(index)
                info = nv.nvmlDeviceGetMemoryInfo(handle)
                return int(info.used), int(info.total)
            except Exception:  # noqa: BLE001 - a vanished or unknown device: skip this sample
                return None

