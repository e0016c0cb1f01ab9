"""Device listing: NVML GPUs (through a stand-in pynvml), the CPU as a device, the probe line, and the
lines `minecart inspect --gpu` prints. No GPU is needed."""

from __future__ import annotations

import sys
import types
from collections import namedtuple

from minecart.engine import devices as dv

Mem = namedtuple("Mem", "total used free")


def _fake_nvml(monkeypatch, gpus):
    m = types.ModuleType("pynvml")
    m.nvmlInit = lambda: None
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: gpus[h][0].encode()
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h:04d}"
    m.nvmlDeviceGetCudaComputeCapability = lambda h: gpus[h][1]
    m.nvmlDeviceGetMemoryInfo = lambda h: Mem(gpus[h][2], gpus[h][2] // 4, gpus[h][2] - gpus[h][2] // 4)
    monkeypatch.setitem(sys.modules, "pynvml", m)


def test_gpus_from_nvml_then_cpu(monkeypatch):
    gib = 1 << 30
    _fake_nvml(monkeypatch, [("NVIDIA P104-100", (6, 1), 8 * gib), ("NVIDIA CMP 30HX", (7, 5), 6 * gib)])
    devs = dv.list_devices(with_probe=False)
    assert [d.id for d in devs] == ["cuda:0", "cuda:1", "cpu:0"]
    a = devs[0]
    assert (a.name, a.compute_capability, a.sm, a.uuid) == ("NVIDIA P104-100", (6, 1), "sm_61", "GPU-0000")
    assert (a.total_bytes, a.used_bytes, a.free_bytes) == (8 * gib, 2 * gib, 6 * gib)
    cpu = devs[-1]
    assert cpu.kind == "cpu" and cpu.total_bytes > 0 and 0 <= cpu.free_bytes <= cpu.total_bytes
    lines = dv.describe_devices(devs)
    assert lines[0].startswith("cuda:0: NVIDIA P104-100, compute 6.1 (sm_61), VRAM 8.0 GiB total")
    assert "GPU-0001" in lines[1] and lines[2].startswith("cpu:0: ")


def test_probe_line_is_attached(monkeypatch, tmp_path):
    from minecart.engine import probe_cache

    _fake_nvml(monkeypatch, [("NVIDIA CMP 170HX", (8, 0), 8 << 30)])
    monkeypatch.setenv("MINECART_CACHE_DIR", str(tmp_path))  # a real probe cache file
    probe_cache.save("GPU-0000", {"summary": "tensor cores throttled; DP4A full speed"})
    probe_cache.save("GPU-9999", {"summary": "another card"})
    devs = dv.list_devices()
    assert devs[0].probe == "tensor cores throttled; DP4A full speed"
    assert dv.describe_devices(devs)[0].endswith("probe: tensor cores throttled; DP4A full speed")


def test_no_nvml_no_gpu_says_so(monkeypatch):
    broken = types.ModuleType("pynvml")

    def fail():
        raise OSError("NVML Shared Library Not Found")

    broken.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    monkeypatch.setattr(dv, "_cupy_devices", lambda: [])
    devs = dv.list_devices()
    assert [d.kind for d in devs] == ["cpu"]
    lines = dv.describe_devices(devs)
    assert "No NVIDIA GPU found" in lines[0] and lines[1].startswith("cpu:0")


def test_format_bytes():
    assert dv.format_bytes(0) == "0 B" and dv.format_bytes(-1) == "?"
    assert dv.format_bytes(1536) == "1.5 KiB" and dv.format_bytes(3 << 30) == "3.0 GiB"
