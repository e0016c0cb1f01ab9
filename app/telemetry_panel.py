"""The telemetry strip: one card per GPU with power, temperature, fan, clocks, throttle reasons, PCIe link
and utilization, sparklines of the last minutes, and the energy per token of the last reply beside its
tokens/s.

It owns a TelemetryPoller (app/telemetry.py) that reads NVML on its own thread; this widget only reacts
to its signals on the GUI thread (a sample a second: a few label texts and three setData calls per card).
Without an NVIDIA driver it shows "no NVIDIA driver" and nothing else happens.

Not here: reading NVML, the energy arithmetic or formatting rules (all in app/telemetry.py).
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from . import telemetry as tm
from . import theme

# (field shown as a sparkline, its label, its colour in theme.SERIES_COLORS)
SPARKS = (("power_w", "power", 0), ("temperature_c", "temperature", 3), ("gpu_util", "utilization", 2))
ROWS = (("Power", tm.fmt_power), ("Temperature", tm.fmt_temperature), ("Fan", tm.fmt_fan),
        ("Clocks", tm.fmt_clocks), ("Utilization", tm.fmt_util),
        ("Throttle", lambda r: tm.throttle_words(r.throttle_bits)), ("PCIe", tm.fmt_pcie))


def _sparkline(color: str):
    import pyqtgraph as pg

    w = pg.PlotWidget()
    w.setBackground(theme.PANEL)
    w.setMenuEnabled(False)
    w.setMouseEnabled(x=False, y=False)
    w.hideButtons()
    item = w.getPlotItem()
    for ax in ("left", "bottom"):
        item.hideAxis(ax)
    item.setContentsMargins(0, 0, 0, 0)
    w.setFixedHeight(34)
    curve = item.plot(pen=pg.mkPen(color, width=1.5))
    return w, curve


class CardView(QFrame):
    """One GPU: the numbers now and sparklines of power, temperature and utilization."""

    def __init__(self, reading: tm.CardReading, parent=None):
        super().__init__(parent)
        self.setObjectName("Card")
        self.index = reading.index
        lay = QVBoxLayout(self)
        lay.setContentsMargins(14, 10, 14, 10)
        lay.setSpacing(6)
        self.title = QLabel(f"GPU {reading.index} · {reading.name}")
        self.title.setObjectName("SectionTitle")
        lay.addWidget(self.title)
        grid = QGridLayout()
        grid.setHorizontalSpacing(12)
        grid.setVerticalSpacing(3)
        self.values: dict[str, QLabel] = {}
        for row, (name, _) in enumerate(ROWS):
            key = QLabel(name)
            key.setObjectName("Subtle")
            value = QLabel(tm.NA)
            value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            grid.addWidget(key, row, 0)
            grid.addWidget(value, row, 1)
            self.values[name] = value
        grid.setColumnStretch(1, 1)
        lay.addLayout(grid)
        self.curves = {}
        sparks = QHBoxLayout()
        sparks.setSpacing(8)
        for field, label, color in SPARKS:
            box = QVBoxLayout()
            box.setSpacing(0)
            caption = QLabel(label)
            caption.setObjectName("Subtle")
            box.addWidget(caption)
            plot, curve = _sparkline(theme.SERIES_COLORS[color])
            box.addWidget(plot)
            sparks.addLayout(box, 1)
            self.curves[field] = curve
        lay.addLayout(sparks)

    def show_reading(self, r: tm.CardReading, history: tm.TelemetryHistory) -> None:
        for name, fmt in ROWS:
            self.values[name].setText(fmt(r))
        throttled = (r.throttle_bits or 0) & ~0x001  # idle is not a problem
        self.values["Throttle"].setObjectName("WarnText" if throttled else "")
        self.values["Throttle"].style().polish(self.values["Throttle"])
        for field, curve in self.curves.items():
            t, v = history.series(self.index, field)
            curve.setData([x - r.t for x in t], v)


class TelemetryPanel(QWidget):
    """The strip of GPU cards plus the energy line. `metrics()` returns the engine's Metrics (or None):
    its finished requests give the tokens for joules per token. `nvml` is injected by tests."""

    def __init__(self, metrics: Callable[[], object] | None = None, nvml=None, interval_s: float = 1.0,
                 parent=None):
        super().__init__(parent)
        self._metrics = metrics or (lambda: None)
        self.history = tm.TelemetryHistory()
        self.ledger = tm.EnergyLedger()
        self.cards: dict[int, CardView] = {}
        self.last_joules_per_token: float | None = None
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 12, 16, 12)
        lay.setSpacing(8)
        self.energy = QLabel("Energy per token: waiting for a reply")
        self.energy.setObjectName("SectionTitle")
        lay.addWidget(self.energy)
        self.status = QLabel("Reading NVML…")
        self.status.setObjectName("Subtle")
        self.status.setWordWrap(True)
        lay.addWidget(self.status)
        self._strip = QWidget()
        self._strip_lay = QVBoxLayout(self._strip)
        self._strip_lay.setContentsMargins(0, 0, 0, 0)
        self._strip_lay.setSpacing(8)
        self._strip_lay.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(self._strip)
        lay.addWidget(scroll, 1)
        self.poller = tm.TelemetryPoller(nvml, interval_s, self)
        self.poller.sampled.connect(self.on_sample)
        self.poller.unavailable.connect(self.on_unavailable)

    def start(self) -> None:
        if not self.poller.isRunning():
            self.poller.start()

    def stop(self) -> None:
        self.poller.stop()

    def on_unavailable(self, why: str) -> None:
        self.status.setText(why)
        self.energy.setText("Energy per token: n/a")

    def on_sample(self, readings: list) -> None:
        self.history.add(readings)
        self.ledger.add(readings)
        self.status.setText(f"{len(readings)} GPU{'s' if len(readings) != 1 else ''} · NVML, every "
                            f"{self.poller.interval_s:g} s")
        for r in readings:
            view = self.cards.get(r.index)
            if view is None:
                view = self.cards[r.index] = CardView(r)
                self._strip_lay.insertWidget(self._strip_lay.count() - 1, view)
            view.show_reading(r, self.history)
        self._update_energy()

    def _update_energy(self) -> None:
        metrics = self._metrics()
        if metrics is None:
            return
        done = [t for t in metrics.requests(last=8) if t.generated_tokens]
        if not done:
            return
        timing = done[-1]
        jpt = self.ledger.joules_per_token(timing)
        if jpt is None:
            return
        self.last_joules_per_token = jpt
        speed = f" at {timing.decode_tokens_per_s:.1f} tok/s" if timing.decode_tokens_per_s else ""
        partial = "" if self.ledger.complete else " (a card reports no power: partial)"
        self.energy.setText(f"Energy per token: {tm.fmt_joules_per_token(jpt)}{speed}, last reply "
                            f"({timing.generated_tokens} tokens){partial}")


__all__ = ["TelemetryPanel", "CardView"]
