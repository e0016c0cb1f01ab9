"""Device listing: NVML GPUs (through a stand-in pynvml), the CPU as a device, the probe line, and the
lines `minecart inspect --gpu` prints. No GPU is needed."""

from __future__ import annotations

import sys
import types
from collections import namedtuple

import pytest
from minecart.engine import devices as dv
from minecart.engine.errors import DeviceError

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
    # the highest generation card and slot allow, the lanes trained (a P104-100 on an x1 riser); the
    # current generation (1 at idle) is not what the planner reads
    m.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: (3, 1)[h]
    m.nvmlDeviceGetCurrPcieLinkWidth = lambda h: (1, 4)[h]
    m.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: 1
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
    assert [d.pcie for d in devs] == [(3, 1), (1, 4), None]
    assert ", PCIe Gen3 x1, GPU-0000" in lines[0] and ", PCIe Gen1 x4, GPU-0001" in lines[1]


def test_the_planner_prices_a_card_at_the_link_nvml_read(monkeypatch):
    """A listed card's DeviceSpec takes the link NVML read (a riser's one lane) over its profile's
    link as shipped; a card NVML says nothing of keeps the profile's."""
    from minecart.engine.placement import DeviceSpec, link_of
    from minecart.engine.rig import LINKS, device_spec, pcie_link

    gib = 1 << 30
    _fake_nvml(monkeypatch, [("NVIDIA P104-100", (6, 1), 8 * gib), ("Some Unlisted GPU", (8, 6), 12 * gib)])
    p104, other, _ = dv.list_devices(with_probe=False)
    assert device_spec(p104).link == LINKS["gen3x1"] and device_spec(other).link == LINKS["gen1x4"]
    assert device_spec(p104).speed is not None and device_spec(other).speed is None  # profiles: speed only
    shipped = device_spec(dv.DeviceInfo("cuda:0", "cuda", "NVIDIA P104-100", 8 * gib, 0, 8 * gib))
    assert shipped.link is not None and shipped.link.name == "PCIe Gen1 x4"  # resources/gpu_profiles.json
    assert link_of(DeviceSpec("cuda:0", 8 * gib)).name == "PCIe Gen3 x16"  # nothing known: a desktop slot
    assert pcie_link(5, 8).bandwidth == pytest.approx(31.5e9) and pcie_link(2, 4).name == "PCIe Gen2 x4"
    assert pcie_link(4, 16) is LINKS["gen4x16"]
    with pytest.raises(DeviceError, match="not a link"):
        pcie_link(0, 16)


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
