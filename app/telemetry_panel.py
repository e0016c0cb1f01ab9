"""The telemetry strip: one card per GPU with power, temperature, fan, clocks, throttle reasons, PCIe link
and utilization, sparklines of the last minutes, and the energy per token of the last reply beside its
tokens/s.

It owns a TelemetryPoller (app/telemetry.py) that reads NVML on its own thread; this widget only reacts
to its signals on the GUI thread (a sample a second: a few label texts and three sparkline repaints per
card).
Without an NVIDIA driver it shows "no NVIDIA driver" and nothing else happens.

Not here: reading NVML, the energy arithmetic or formatting rules (all in app/telemetry.py).
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QPointF, Qt, QTimer
from PySide6.QtGui import QColor, QPainter, QPen
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

# (field drawn as a sparkline, caption, unit, colour index in theme.SERIES_COLORS, smallest range drawn:
# so that 9-11 W of noise does not fill the box the way 30-180 W does)
SPARKS = (("power_w", "power", "W", 0, 40.0), ("temperature_c", "temp", "°C", 3, 20.0),
          ("gpu_util", "use", "%", 2, 100.0))
BUILD_PAUSE_MS = 15  # between building two cards
CARD_WIDTH = 380  # px a card gets at least (its longest line: "SM 1582 MHz of 1911 · mem 5005 MHz")
ROWS = (("Power", tm.fmt_power), ("Temperature", tm.fmt_temperature), ("Fan", tm.fmt_fan),
        ("Clocks", tm.fmt_clocks), ("Utilization", tm.fmt_util),
        ("Throttle", lambda r: tm.throttle_words(r.throttle_bits)), ("PCIe", tm.fmt_pcie))


class Sparkline(QWidget):
    """One value over the last `window_s` seconds, the newest at the right edge, scaled to its own range,
    drawn with QPainter. A pause longer than `gap_s` between samples (NVML stopped answering, the
    machine slept) leaves a gap instead of a line across it.

    Not pyqtgraph: its import alone holds the GUI thread ~230 ms and each plot widget ~8 ms to build, so
    a rig of eight cards would freeze the window when the page first fills; this costs microseconds."""

    def __init__(self, color: str, window_s: float, gap_s: float, min_span: float = 0.0, parent=None):
        super().__init__(parent)
        self.color = QColor(color)
        self.window_s = window_s
        self.gap_s = gap_s
        self.min_span = min_span
        self.xs: list[float] = []
        self.ys: list[float] = []
        self.setFixedHeight(34)
        self.setMinimumWidth(60)

    def set_data(self, xs: list[float], ys: list[float]) -> None:
        self.xs, self.ys = list(xs), list(ys)
        if ys:
            self.setToolTip(f"last {xs[-1] - xs[0]:.0f} s: {min(ys):g} to {max(ys):g}")
        self.update()

    def runs(self) -> list[list[tuple[float, float]]]:
        """The samples inside the window, split where the gap between two is longer than gap_s."""
        if not self.xs:
            return []
        start = self.xs[-1] - self.window_s
        out: list[list[tuple[float, float]]] = []
        prev = None
        for x, y in zip(self.xs, self.ys, strict=True):
            if x < start:
                continue
            if prev is None or x - prev > self.gap_s:
                out.append([])
            out[-1].append((x, y))
            prev = x
        return out

    def y_range(self, runs) -> tuple[float, float]:
        """The values' range, widened about its middle to at least min_span (and to 2 for a flat
        line, so it sits in the middle), kept at or above 0: every value drawn here is >= 0."""
        ys = [y for run in runs for _, y in run]
        lo, hi = min(ys), max(ys)
        span = max(hi - lo, self.min_span, 2.0)
        mid = (lo + hi) / 2
        lo = max(0.0, min(lo, mid - span / 2))
        return lo, lo + span if hi <= lo + span else hi

    def paintEvent(self, e):
        runs = self.runs()
        if not runs:
            return
        lo, hi = self.y_range(runs)
        w, h = self.width() - 2, self.height() - 4
        x1 = self.xs[-1]
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        p.setPen(QPen(self.color, 1.5))
        for run in runs:
            points = [QPointF(1 + w * (1 - (x1 - x) / self.window_s), 2 + h * (1 - (y - lo) / (hi - lo)))
                      for x, y in run]
            if len(points) == 1:
                p.drawPoint(points[0])
            else:
                p.drawPolyline(points)
        p.end()


class CardView(QFrame):
    """One GPU: the numbers now and sparklines of power, temperature and utilization."""

    def __init__(self, reading: tm.CardReading, interval_s: float = 1.0, parent=None):
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
        self.curves: dict[str, Sparkline] = {}
        self.captions: dict[str, QLabel] = {}
        sparks = QHBoxLayout()
        sparks.setSpacing(8)
        for field, label, _, color, span in SPARKS:
            box = QVBoxLayout()
            box.setSpacing(0)
            caption = QLabel(label)
            caption.setObjectName("Subtle")
            box.addWidget(caption)
            self.captions[field] = caption
            line = Sparkline(theme.SERIES_COLORS[color], window_s=tm.HISTORY_POINTS * interval_s,
                             gap_s=3 * interval_s + 1.0, min_span=span)
            box.addWidget(line)
            sparks.addLayout(box, 1)
            self.curves[field] = line
        lay.addLayout(sparks)

    def show_reading(self, r: tm.CardReading, history: tm.TelemetryHistory) -> None:
        for name, fmt in ROWS:
            self.values[name].setText(fmt(r))
        throttled = (r.throttle_bits or 0) & ~tm.THROTTLE_IDLE  # an idle card is not held back
        throttle = self.values["Throttle"]
        if throttle.objectName() != ("WarnText" if throttled else ""):  # re-polish only on a change
            throttle.setObjectName("WarnText" if throttled else "")
            throttle.style().polish(throttle)
        for field, caption, unit, _, _ in SPARKS:
            xs, ys = history.series(self.index, field)
            self.curves[field].set_data(xs, ys)
            # the line is scaled to its own range: the caption says what that range is
            if ys:
                self.captions[field].setText(f"{caption} {min(ys):.0f}–{max(ys):.0f} {unit}")


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
        self._latest: list[tm.CardReading] = []
        self._build_pending = False
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
        outer = QVBoxLayout(self._strip)
        outer.setContentsMargins(0, 0, 0, 0)
        self._grid = QGridLayout()
        self._grid.setSpacing(8)
        outer.addLayout(self._grid)
        outer.addStretch(1)
        self._columns = 0
        self._scroll = QScrollArea()
        self._scroll.setWidgetResizable(True)
        self._scroll.setWidget(self._strip)
        lay.addWidget(self._scroll, 1)
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
        self._show(readings)
        self._update_energy()

    def _show(self, readings: list) -> None:
        self._latest = readings
        for r in readings:
            view = self.cards.get(r.index)
            if view is not None:
                view.show_reading(r, self.history)
        if not self._build_pending:
            self._build_next()

    def _build_next(self) -> None:
        """Build one missing card, and the next one after a short pause: eight cards built and laid
        out at once held the GUI ~45 ms (the first card alone, styled for the first time, ~30 ms).
        The pause is not 0: Qt would run a zero timer in the same pass as the rest."""
        self._build_pending = False
        missing = [r for r in self._latest if r.index not in self.cards]
        if not missing:
            return
        r = missing[0]
        view = self.cards[r.index] = CardView(r, self.poller.interval_s)
        view.show_reading(r, self.history)
        self._reflow()
        if len(missing) > 1:
            self._build_pending = True
            QTimer.singleShot(BUILD_PAUSE_MS, self._build_next)

    def resizeEvent(self, e):
        super().resizeEvent(e)
        self._reflow()

    def _reflow(self) -> None:
        """Cards side by side, as many columns as fit CARD_WIDTH each: a rig of eight cards reads at a
        glance on a wide window and still stacks on a narrow one."""
        width = self._scroll.viewport().width()
        need = max(CARD_WIDTH, max(c.minimumSizeHint().width() for c in self.cards.values())
                   + self._grid.spacing()) if self.cards else CARD_WIDTH
        columns = max(1, min(len(self.cards), width // need)) if self.cards else 0
        placed = self._grid.count()
        if columns == self._columns and placed == len(self.cards):
            return
        if columns != self._columns:
            placed = 0  # the column count changed: lay every card out again
        self._columns = columns
        for i, index in enumerate(sorted(self.cards)):
            if i >= placed:
                self._grid.addWidget(self.cards[index], i // columns, i % columns)

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
