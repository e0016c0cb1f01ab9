"""Per-card telemetry from NVML: what a mining-rig owner watches (power, temperature, fan, clocks,
throttle reasons, PCIe link, utilization) and the energy each generated token costs.

Pieces:
- `read_cards(nvml)`: one `CardReading` per GPU from an NVML module (pynvml, or any object with the same
  function names: tests inject a fake). A value the card does not report (no fan sensor on a passive
  mining card, no energy counter before Volta) is None, never an exception.
- `fmt_*` / `throttle_words`: the words and units the window shows for each field.
- `EnergyLedger`: cumulative joules over all cards, from NVML's total-energy counter where a card has one
  and from power integrated over time where it does not; `joules_per_token(timing)` divides the energy of
  a finished request's window by the tokens it generated.
- `TelemetryHistory`: ring buffers per card and field for the sparklines.
- `TelemetryPoller`: a QThread that reads NVML about once a second and emits the readings; NVML is never
  touched on the GUI thread. Without a driver it emits `unavailable("no NVIDIA driver")` once and stops.

Not here: widgets (app/telemetry_panel.py) and device memory series (engine/metrics.py samples those).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from PySide6.QtCore import QThread, Signal

# NVML's clock-event ("throttle") reason bits (nvml.h nvmlClocksEventReason*), in words a person reads.
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x001, "idle"),
    (0x002, "application clocks"),
    (0x004, "power cap"),
    (0x008, "hardware slowdown"),
    (0x010, "sync boost"),
    (0x020, "thermal (driver)"),
    (0x040, "thermal (hardware)"),
    (0x080, "power brake"),
    (0x100, "display clocks"),
    (0x200, "board limit"),
    (0x400, "reliability"),
)
THROTTLE_IDLE = 0x001
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NO_DRIVER = "no NVIDIA driver"
HISTORY_POINTS = 300  # five minutes at 1 Hz
FIELDS = ("power_w", "temperature_c", "fan_percent", "sm_clock_mhz", "mem_clock_mhz", "gpu_util")


@dataclass(frozen=True)
class CardReading:
    """One NVML sample of one card. Units: W, degrees C, %, MHz, joules (cumulative since driver load).
    None where the card or driver does not report the value."""

    index: int
    name: str
    t: float  # time.time() of the sample
    power_w: float | None = None
    power_limit_w: float | None = None
    temperature_c: int | None = None
    fan_percent: int | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    throttle_bits: int | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_max: int | None = None
    gpu_util: int | None = None
    mem_util: int | None = None
    energy_j: float | None = None


def _try(fn: Callable, *args):
    """NVML raises NVMLError_NotSupported (and friends) for what a card lacks: that is None here."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - any NVML error means "not reported", never a crash
        return None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_card(nv, index: int, t: float | None = None) -> CardReading:
    """Every field of card `index`; each read on its own so one unsupported query loses one value."""
    h = nv.nvmlDeviceGetHandleByIndex(index)
    milliwatts = _try(nv.nvmlDeviceGetPowerUsage, h)
    limit_mw = _try(nv.nvmlDeviceGetEnforcedPowerLimit, h)
    energy_mj = _try(nv.nvmlDeviceGetTotalEnergyConsumption, h)
    util = _try(nv.nvmlDeviceGetUtilizationRates, h)
    name = _try(nv.nvmlDeviceGetName, h)
    return CardReading(
        index=index,
        name=_text(name) if name is not None else f"GPU {index}",
        t=time.time() if t is None else t,
        power_w=None if milliwatts is None else milliwatts / 1000.0,
        power_limit_w=None if limit_mw is None else limit_mw / 1000.0,
        temperature_c=_try(nv.nvmlDeviceGetTemperature, h, NVML_TEMPERATURE_GPU),
        fan_percent=_try(nv.nvmlDeviceGetFanSpeed, h),
        sm_clock_mhz=_try(nv.nvmlDeviceGetClockInfo, h, NVML_CLOCK_SM),
        mem_clock_mhz=_try(nv.nvmlDeviceGetClockInfo, h, NVML_CLOCK_MEM),
        sm_clock_max_mhz=_try(nv.nvmlDeviceGetMaxClockInfo, h, NVML_CLOCK_SM),
        throttle_bits=_try(nv.nvmlDeviceGetCurrentClocksThrottleReasons, h),
        pcie_gen=_try(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
        pcie_width=_try(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
        pcie_gen_max=_try(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
        pcie_width_max=_try(nv.nvmlDeviceGetMaxPcieLinkWidth, h),
        gpu_util=None if util is None else int(util.gpu),
        mem_util=None if util is None else int(util.memory),
        energy_j=None if energy_mj is None else energy_mj / 1000.0,
    )


def read_cards(nv, t: float | None = None) -> list[CardReading]:
    """One reading per GPU NVML sees (nvmlInit must have succeeded)."""
    now = time.time() if t is None else t
    return [read_card(nv, i, now) for i in range(int(nv.nvmlDeviceGetCount()))]


# ---- formatting ---------------------------------------------------------------------------------
NA = "n/a"


def throttle_words(bits: int | None) -> str:
    """'none', or the active reasons in words: 'power cap, thermal (hardware)'."""
    if bits is None:
        return NA
    words = [w for bit, w in THROTTLE_REASONS if bits & bit]
    unknown = bits & ~sum(bit for bit, _ in THROTTLE_REASONS)
    if unknown:
        words.append(f"other (0x{unknown:x})")
    return ", ".join(words) if words else "none"


def fmt_power(r: CardReading) -> str:
    if r.power_w is None:
        return NA
    if r.power_limit_w is None:
        return f"{r.power_w:.0f} W"
    return f"{r.power_w:.0f} W of {r.power_limit_w:.0f} W"


def fmt_temperature(r: CardReading) -> str:
    return NA if r.temperature_c is None else f"{r.temperature_c} °C"


def fmt_fan(r: CardReading) -> str:
    return NA if r.fan_percent is None else f"{r.fan_percent} %"


def fmt_clocks(r: CardReading) -> str:
    sm = NA if r.sm_clock_mhz is None else f"{r.sm_clock_mhz} MHz"
    if r.sm_clock_mhz is not None and r.sm_clock_max_mhz:
        sm += f" of {r.sm_clock_max_mhz}"
    mem = NA if r.mem_clock_mhz is None else f"{r.mem_clock_mhz} MHz"
    return f"SM {sm} · mem {mem}"


def _link(gen: int | None, width: int | None) -> str:
    return f"Gen{gen if gen is not None else '?'} x{width if width is not None else '?'}"


def fmt_pcie(r: CardReading) -> str:
    """'Gen1 x1 of Gen3 x16': the link now, and the best the card can do (an x1 riser shows here)."""
    if r.pcie_gen is None and r.pcie_width is None:
        return NA
    now = _link(r.pcie_gen, r.pcie_width)
    if r.pcie_gen_max is None and r.pcie_width_max is None:
        return now
    return f"{now} of {_link(r.pcie_gen_max, r.pcie_width_max)}"


def fmt_util(r: CardReading) -> str:
    gpu = NA if r.gpu_util is None else f"{r.gpu_util} %"
    mem = NA if r.mem_util is None else f"{r.mem_util} %"
    return f"GPU {gpu} · mem {mem}"


def fmt_joules_per_token(jpt: float | None) -> str:
    if jpt is None:
        return NA
    return f"{jpt:.2f} J/token" if jpt < 10 else f"{jpt:.1f} J/token"


# ---- energy -------------------------------------------------------------------------------------
class EnergyLedger:
    """Cumulative energy of all cards since the first sample, as (time, joules) points.

    Per card, the step between two samples is the difference of NVML's total-energy counter when both
    samples have it, else the trapezoid of the two power readings over the time between them (cards
    before Volta have no counter). A card with neither adds nothing, and `complete` turns False so the
    window can say the figure is partial."""

    def __init__(self, capacity: int = 4 * HISTORY_POINTS):
        self.points: deque[tuple[float, float]] = deque(maxlen=capacity)
        self._last: dict[int, CardReading] = {}
        self.total_j = 0.0
        self.complete = True

    def add(self, readings: list[CardReading]) -> None:
        if not readings:
            return
        for r in readings:
            prev = self._last.get(r.index)
            self._last[r.index] = r
            if prev is None:
                continue
            if r.energy_j is not None and prev.energy_j is not None and r.energy_j >= prev.energy_j:
                self.total_j += r.energy_j - prev.energy_j
            elif r.power_w is not None and prev.power_w is not None:
                self.total_j += 0.5 * (r.power_w + prev.power_w) * max(0.0, r.t - prev.t)
            else:
                self.complete = False
        self.points.append((max(r.t for r in readings), self.total_j))

    def energy_at(self, t: float) -> float | None:
        """Cumulative joules at time t (linear between samples); None outside the recorded span."""
        pts = self.points
        if not pts or t < pts[0][0] or t > pts[-1][0]:
            return None
        prev = pts[0]
        for p in pts:
            if p[0] >= t:
                if p[0] == prev[0]:
                    return p[1]
                return prev[1] + (p[1] - prev[1]) * (t - prev[0]) / (p[0] - prev[0])
            prev = p
        return pts[-1][1]

    def joules_between(self, t0: float, t1: float) -> float | None:
        e0, e1 = self.energy_at(t0), self.energy_at(t1)
        return None if e0 is None or e1 is None else e1 - e0

    def joules_per_token(self, timing) -> float | None:
        """Energy of one finished request per token it generated. The window runs from the moment the
        runtime picked the request up (prefill included: a reply's energy is its prompt's too) to its
        last token. `timing` is an engine RequestTiming; None when the window lies outside the
        recorded energy or nothing was generated."""
        if not timing.generated_tokens:
            return None
        start = timing.submitted + timing.queue_wait_s
        end = start + (timing.prefill_s or 0.0) + (timing.decode_s or 0.0)
        joules = self.joules_between(start, end)
        if joules is None:
            return None
        return joules / timing.generated_tokens


# ---- history ------------------------------------------------------------------------------------
class TelemetryHistory:
    """The last HISTORY_POINTS readings per card, as plottable series per field."""

    def __init__(self, capacity: int = HISTORY_POINTS):
        self.capacity = capacity
        self._cards: dict[int, deque[CardReading]] = {}

    def add(self, readings: list[CardReading]) -> None:
        for r in readings:
            self._cards.setdefault(r.index, deque(maxlen=self.capacity)).append(r)

    def cards(self) -> list[int]:
        return sorted(self._cards)

    def latest(self, index: int) -> CardReading | None:
        ring = self._cards.get(index)
        return ring[-1] if ring else None

    def series(self, index: int, field: str) -> tuple[list[float], list[float]]:
        """(times, values) of one field, skipping samples where the card did not report it."""
        if field not in FIELDS:
            raise ValueError(f"unknown telemetry field {field!r}; known: {', '.join(FIELDS)}")
        pts = [(r.t, getattr(r, field)) for r in self._cards.get(index, ())]
        pts = [(t, float(v)) for t, v in pts if v is not None]
        return [p[0] for p in pts], [p[1] for p in pts]


# ---- the worker ---------------------------------------------------------------------------------
def _import_pynvml():
    import pynvml

    return pynvml


class TelemetryPoller(QThread):
    """Reads every card about once a second on its own thread; the GUI only receives signals.

    `nvml`: the NVML module (pynvml when None; tests pass a fake). `interval_s`: seconds between reads."""

    sampled = Signal(list)  # list[CardReading]
    unavailable = Signal(str)  # why there is no telemetry ("no NVIDIA driver", ...)

    def __init__(self, nvml=None, interval_s: float = 1.0, parent=None):
        super().__init__(parent)
        self._nvml = nvml
        self.interval_s = float(interval_s)
        self._stop = threading.Event()

    def stop(self, timeout_ms: int = 3000) -> None:
        self._stop.set()
        self.wait(timeout_ms)

    def run(self) -> None:
        try:
            nv = self._nvml if self._nvml is not None else _import_pynvml()
            nv.nvmlInit()
        except Exception:  # noqa: BLE001 - no library, no driver, no device: say so once
            self.unavailable.emit(NO_DRIVER)
            return
        try:
            while not self._stop.is_set():
                try:
                    readings = read_cards(nv)
                except Exception as exc:  # noqa: BLE001 - a lost GPU must not end the window
                    self.unavailable.emit(f"NVML stopped answering: {exc}")
                    return
                self.sampled.emit(readings)
                self._stop.wait(self.interval_s)
        finally:
            _try(nv.nvmlShutdown)
