"""Compute devices this machine offers: each NVIDIA GPU (through NVML, or CuPy when NVML is missing) and
the CPU with its RAM, plus what the per-device kernel probe found.

This module only *lists* devices and reads their memory; it never allocates on a GPU, never compiles a
kernel and never imports Qt. `list_devices()` feeds the desktop app's GPU panel and the placement
planner; `describe_devices()` gives the lines `minecart inspect --gpu` prints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from . import probe_cache

CPU_ID = "cpu:0"  # placement names devices "cuda:N" / "cpu:N"


@dataclass(frozen=True)
class DeviceInfo:
    """One compute device as the user sees it.

    id:        stable key used by placement ("cuda:0", "cuda:1", ..., "cpu").
    kind:      "cuda" or "cpu".
    name:      marketing name ("NVIDIA CMP 170HX", "AMD Ryzen 7 5700X").
    compute_capability: (major, minor) for GPUs, None for the CPU.
    total/used/free_bytes: device memory (RAM for the CPU); -1 where unknown.
    uuid:      NVML UUID ("GPU-…"), "" for the CPU.
    probe:     one line from the kernel probe cache ("tensor cores throttled; DP4A full speed"), or "".
    source:    how the numbers were read: "nvml", "cupy" or "os".
    pcie:      (generation, lanes) of the card's PCIe link as NVML reads it: the highest generation the
               card and the slot both allow, and the lanes the link trained at (a mining riser's x1),
               so an idle card's power-saving lower generation is not taken for its link; None where
               unknown (no NVML, the CPU).
    """

    id: str
    kind: str
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    compute_capability: tuple[int, int] | None = None
    uuid: str = ""
    probe: str = ""
    source: str = ""
    pcie: tuple[int, int] | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def sm(self) -> str:
        """'sm_61' style target name, or '' for the CPU."""
        if not self.compute_capability:
            return ""
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"


def _nvml_devices() -> list[DeviceInfo] | None:
    """GPUs through NVML; None when NVML (the driver library) is unavailable."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded on machines without NVIDIA
        return None
    out = []
    try:
        count = pynvml.nvmlDeviceGetCount()
        for i in range(count):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            try:
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                cc = (int(major), int(minor))
            except Exception:
                cc = None
            try:
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                total, used, free = int(mem.total), int(mem.used), int(mem.free)
            except Exception:
                total = used = free = -1
            try:
                pcie: tuple[int, int] | None = (int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h)),
                                                int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)))
            except Exception:  # NotSupported on some boards and virtual GPUs
                pcie = None
            if pcie is not None and min(pcie) < 1:
                pcie = None
            out.append(DeviceInfo(id=f"cuda:{i}", kind="cuda", name=name, total_bytes=total,
                                  used_bytes=used, free_bytes=free, compute_capability=cc,
                                  uuid=uuid, source="nvml", pcie=pcie))
    except Exception:
        return out or None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return out


def _cupy_devices() -> list[DeviceInfo]:
    """GPUs through the CUDA runtime (CuPy), used only when NVML is missing."""
    try:
        import importlib

        cupy = importlib.import_module("cupy")  # not a static import: the engine keeps cupy optional
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return []
    out = []
    for i in range(n):
        try:
            props = cupy.cuda.runtime.getDeviceProperties(i)
            with cupy.cuda.Device(i):
                free, total = cupy.cuda.runtime.memGetInfo()
            name = props["name"]
            name = name.decode() if isinstance(name, bytes) else str(name)
            out.append(DeviceInfo(id=f"cuda:{i}", kind="cuda", name=name, total_bytes=int(total),
                                  used_bytes=int(total - free), free_bytes=int(free),
                                  compute_capability=(int(props["major"]), int(props["minor"])),
                                  source="cupy"))
        except Exception:
            continue
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "CPU"


def ram_bytes() -> tuple[int, int]:
    """(total, available) system memory in bytes; (-1, -1) where the OS does not say."""
    try:
        info = {}
        with open("/proc/meminfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
        return info["MemTotal"], info.get("MemAvailable", info.get("MemFree", 0))
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES")
        return pages * page, avail * page
    except (ValueError, OSError, AttributeError):
        pass
    if os.name == "nt":
        try:
            import ctypes

            class _MemStatus(ctypes.Structure):
                _fields_ = [("dwLength", ctypes.c_ulong), ("dwMemoryLoad", ctypes.c_ulong),
                            ("ullTotalPhys", ctypes.c_ulonglong), ("ullAvailPhys", ctypes.c_ulonglong),
                            ("ullTotalPageFile", ctypes.c_ulonglong), ("ullAvailPageFile", ctypes.c_ulonglong),
                            ("ullTotalVirtual", ctypes.c_ulonglong), ("ullAvailVirtual", ctypes.c_ulonglong),
                            ("ullAvailExtendedVirtual", ctypes.c_ulonglong)]

            st = _MemStatus()
            st.dwLength = ctypes.sizeof(st)
            ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(st))  # type: ignore[attr-defined]
            return int(st.ullTotalPhys), int(st.ullAvailPhys)
        except Exception:
            pass
    return -1, -1


def cpu_device() -> DeviceInfo:
    total, avail = ram_bytes()
    used = total - avail if total >= 0 and avail >= 0 else -1
    return DeviceInfo(id=CPU_ID, kind="cpu", name=_cpu_name(), total_bytes=total, used_bytes=used,
                      free_bytes=avail, extra={"threads": os.cpu_count() or 1}, source="os")


def _probe_summary(dev: DeviceInfo) -> str:
    """One line from the kernel probe cache (engine/probe_cache.py, keyed by GPU UUID) for this GPU,
    or '' if it was not probed yet."""
    return probe_cache.summary_for(dev.uuid) if dev.uuid else ""


def list_devices(include_cpu: bool = True, with_probe: bool = True) -> list[DeviceInfo]:
    """Every GPU (NVML first, CuPy if NVML is missing), then the CPU. Never raises."""
    gpus = _nvml_devices()
    if gpus is None or not gpus:
        gpus = _cupy_devices() if os.environ.get("MINECART_NO_CUPY_PROBE") != "1" else []
    if with_probe:
        gpus = [_with_probe(d) for d in gpus]
    return gpus + ([cpu_device()] if include_cpu else [])


def _with_probe(dev: DeviceInfo) -> DeviceInfo:
    from dataclasses import replace

    probe = _probe_summary(dev)
    return replace(dev, probe=probe) if probe else dev


# what a model's weights may take of the RAM available when it loads (the rest: activations, caches,
# the OS and the programs beside it)
RAM_FOR_WEIGHTS = 0.8


def fits_in_ram(n_bytes: int) -> bool:
    """Whether n_bytes fit in RAM_FOR_WEIGHTS of the memory available now (True where the OS does
    not say)."""
    avail = ram_bytes()[1]
    return avail <= 0 or n_bytes <= RAM_FOR_WEIGHTS * avail


def format_bytes(n: int) -> str:
    if n is None or n < 0:
        return "?"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def describe_devices(devices: list[DeviceInfo] | None = None) -> list[str]:
    """Human-readable lines, one per device, for `minecart inspect --gpu`."""
    devices = list_devices() if devices is None else devices
    lines = []
    for d in devices:
        mem = (f"{format_bytes(d.total_bytes)} total, {format_bytes(d.used_bytes)} used, "
               f"{format_bytes(d.free_bytes)} free")
        if d.kind == "cpu":
            threads = d.extra.get("threads")
            line = f"{d.id}: {d.name} ({threads} threads) RAM {mem}"
        else:
            cc = d.compute_capability
            ccs = f"compute {cc[0]}.{cc[1]} ({d.sm})" if cc else "compute capability unknown"
            line = f"{d.id}: {d.name}, {ccs}, VRAM {mem}"
            if d.pcie:
                line += f", PCIe Gen{d.pcie[0]} x{d.pcie[1]}"
            if d.uuid:
                line += f", {d.uuid}"
        if d.probe:
            line += f"; probe: {d.probe}"
        lines.append(line)
    if not any(d.kind == "cuda" for d in devices):
        lines.insert(0, "No NVIDIA GPU found (NVML and CuPy see none); minecart will run on the CPU.")
    return lines
