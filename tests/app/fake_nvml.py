"""A stand-in for the pynvml module: the same function names, answering from plain per-card dicts.

A card dict holds NVML's raw units (milliwatts, millijoules, MHz, ...); a key set to None makes that
query raise NotSupported, as NVML does for a passive mining card's fan or a Pascal card's energy counter.
`calls_from` records which threads called in, so tests can check NVML stays off the GUI thread."""

from __future__ import annotations

import threading
from types import SimpleNamespace


class NVMLError(Exception):
    pass


class NotSupported(NVMLError):
    pass


def mining_card(**over) -> dict:
    """A P104-100 on an x1 riser, power-capped and hot."""
    card = {"name": "NVIDIA P104-100", "power_mw": 87_500, "limit_mw": 180_000, "energy_mj": 5_000_000,
            "temp": 64, "fan": 45, "sm": 1582, "mem": 5005, "sm_max": 1911, "throttle": 0x4 | 0x40,
            "gen": 1, "width": 1, "gen_max": 3, "width_max": 16, "util_gpu": 97, "util_mem": 41}
    card.update(over)
    return card


class FakeNvml:
    def __init__(self, cards: list[dict], init_error: Exception | None = None):
        self.cards = cards
        self.init_error = init_error
        self.calls_from: set[str] = set()
        self.shut_down = False

    def _get(self, h, key):
        self.calls_from.add(threading.current_thread().name)
        value = self.cards[h][key]
        if value is None:
            raise NotSupported(key)
        return value

    def nvmlInit(self):
        self.calls_from.add(threading.current_thread().name)
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self):
        self.shut_down = True

    def nvmlDeviceGetCount(self):
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self._get(h, "name").encode()

    def nvmlDeviceGetPowerUsage(self, h):
        return self._get(h, "power_mw")

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._get(h, "limit_mw")

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        return self._get(h, "energy_mj")

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == 0
        return self._get(h, "temp")

    def nvmlDeviceGetFanSpeed(self, h):
        return self._get(h, "fan")

    def nvmlDeviceGetClockInfo(self, h, clock):
        return self._get(h, {1: "sm", 2: "mem"}[clock])

    def nvmlDeviceGetMaxClockInfo(self, h, clock):
        assert clock == 1
        return self._get(h, "sm_max")

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return self._get(h, "throttle")

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self._get(h, "gen")

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self._get(h, "width")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._get(h, "gen_max")

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._get(h, "width_max")

    def nvmlDeviceGetUtilizationRates(self, h):
        gpu = self._get(h, "util_gpu")
        return SimpleNamespace(gpu=gpu, memory=self._get(h, "util_mem"))
