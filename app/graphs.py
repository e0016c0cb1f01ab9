"""Live performance graphs: prefill and decode tokens/s over time, and memory used per device over time.

Fed from the engine's Metrics ring buffers (engine/metrics.py) by a QTimer at 10 Hz; a curve is redrawn
only when its buffer changed (`setData` with clip-to-view and auto-downsampling), never once per token.
The x axis is "seconds ago" so the newest point is always at the right edge.

What the plots must not do, and how they avoid it: draw a line across idle time (a gap longer than
GAP_S breaks the line); let one outlier set the axis (the first running rate of a reply is measured
over a token or two and reads 800-5,500 tok/s, so it is left out, and the y range comes from the
points that remain); hide the newest points under a legend (the legend is a row of labels above each
plot); mix units (memory is in GiB, as everywhere in the app).

Not here: the metrics themselves (engine/metrics.py) or per-card telemetry (telemetry.py).
"""

from __future__ import annotations

import math
import time

import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from . import theme

pg.setConfigOptions(antialias=True, background=theme.PANEL, foreground=theme.MUTED)

GAP_S = 2.0  # live points come every 0.25 s while decoding; a longer silence is idle time
# Memory is sampled all the time (every 0.5 s), idle or not: only a stopped sampler leaves a hole, but
# a busy load can hold the sampler's thread back for a few seconds
MEMORY_GAP_S = 10.0
GIB = float(1 << 30)


def with_gaps(x: list[float], y: list[float], gap_s: float = GAP_S) -> tuple[list[float], list[float]]:
    """The series with a NaN point wherever two neighbours are more than gap_s apart (with
    connect="finite" the line breaks there instead of crossing the idle time)."""
    xs: list[float] = []
    ys: list[float] = []
    for i, (a, b) in enumerate(zip(x, y, strict=True)):
        if i and a - x[i - 1] > gap_s:
            xs.append((a + x[i - 1]) / 2)
            ys.append(math.nan)
        xs.append(a)
        ys.append(b)
    return xs, ys


def without_run_starts(x: list[float], y: list[float], gap_s: float = GAP_S) -> tuple[list[float], list[float]]:
    """The live series without the first point of each run (the rate over the first token or two)."""
    keep = [i for i in range(len(x)) if i and x[i] - x[i - 1] <= gap_s]
    return [x[i] for i in keep], [y[i] for i in keep]


def y_top(values: list[float]) -> float:
    """The top of a y axis that shows every value given, with a little room above."""
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) * 1.15 if finite and max(finite) > 0 else 1.0


def _plot(title: str, y_label: str) -> pg.PlotWidget:
    w = pg.PlotWidget()
    w.setMenuEnabled(False)
    w.setMouseEnabled(x=False, y=False)
    w.hideButtons()
    item = w.getPlotItem()
    item.setTitle(f"<span style='color:{theme.TEXT}; font-size:10.5pt; font-weight:600'>{title}</span>")
    item.showGrid(x=True, y=True, alpha=0.12)
    item.setLabel("bottom", "seconds ago", color=theme.MUTED)
    item.setLabel("left", y_label, color=theme.MUTED)
    for ax in ("left", "bottom"):
        axis = item.getAxis(ax)
        axis.setPen(pg.mkPen("#3a4050"))
        axis.setTextPen(pg.mkPen(theme.MUTED))
        axis.enableAutoSIPrefix(False)
    item.setClipToView(True)
    item.setDownsampling(auto=True, mode="peak")
    vb = item.getViewBox()
    vb.setLimits(yMin=0)
    vb.enableAutoRange(y=False)  # the y range is set from the data each tick (see y_top)
    return w


class Legend(QWidget):
    """A row of coloured marks and names above a plot: never over the data."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.row = QHBoxLayout(self)
        self.row.setContentsMargins(4, 0, 0, 0)
        self.row.setSpacing(14)
        self.row.addStretch(1)
        self.names: list[str] = []

    def add(self, name: str, color: str, dashed: bool = False, mark: str = "") -> None:
        mark = mark or ("╌╌" if dashed else "━━")
        lab = QLabel(f"<span style='color:{color}'>{mark}</span> {name}")
        lab.setObjectName("Subtle")
        self.row.insertWidget(self.row.count() - 1, lab)
        self.names.append(name)


class StatTile(QFrame):
    def __init__(self, title: str, parent=None):
        super().__init__(parent)
        self.setObjectName("Card")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(14, 10, 14, 10)
        lay.setSpacing(2)
        t = QLabel(title)
        t.setObjectName("Subtle")
        lay.addWidget(t)
        self.value = QLabel("—")
        self.value.setObjectName("TileValue")
        lay.addWidget(self.value)

    def set(self, text: str) -> None:
        self.value.setText(text)


def _last(requests, field: str):
    """The newest request's value of `field` that is not None (a prefill-only request has no decode
    rate: the tile keeps the last one measured instead of going back to "—")."""
    for r in reversed(requests):
        v = getattr(r, field)
        if v:
            return v
    return None


class GraphsPanel(QWidget):
    """Two live plots and a few headline numbers; call `set_metrics(metrics)` once a runtime exists."""

    def __init__(self, metrics=None, window_s: float = 120.0, refresh_hz: float = 10.0, parent=None):
        super().__init__(parent)
        self.metrics = metrics
        self.window_s = float(window_s)
        self._versions: dict[str, int] = {}
        lay = QVBoxLayout(self)
        lay.setContentsMargins(24, 18, 24, 18)
        lay.setSpacing(8)
        t = QLabel("Performance")
        t.setObjectName("PageTitle")
        lay.addWidget(t)
        sub = QLabel(f"Live from the engine's metrics, last {int(self.window_s)} s; updates {refresh_hz:g}× a second.")
        sub.setObjectName("Subtle")
        lay.addWidget(sub)
        tiles = QHBoxLayout()
        self.tile_prefill = StatTile("Last prefill")
        self.tile_decode = StatTile("Last decode")
        self.tile_ttft = StatTile("Time to first token")
        self.tile_tokens = StatTile("Tokens generated")
        for tile in (self.tile_prefill, self.tile_decode, self.tile_ttft, self.tile_tokens):
            tiles.addWidget(tile)
        lay.addLayout(tiles)

        self.speed = _plot("Tokens per second", "tokens/s")
        self.speed_legend = Legend()
        prefill, decode = theme.SERIES_COLORS[1], theme.ACCENT
        # one point per reply, not joined: a line between two replies would cross the idle time
        self.curve_prefill = self.speed.plot([], [], pen=None, symbol="o", symbolSize=7, symbolBrush=prefill,
                                             symbolPen=None)
        self.curve_decode = self.speed.plot([], [], pen=None, symbol="o", symbolSize=7, symbolBrush=decode,
                                            symbolPen=None)
        self.curve_live = self.speed.plot([], [], connect="finite",
                                          pen=pg.mkPen(decode, width=1.2, style=Qt.PenStyle.DashLine))
        self.speed_legend.add("prefill (per reply)", prefill, mark="●")
        self.speed_legend.add("decode (per reply)", decode, mark="●")
        self.speed_legend.add("decode (live)", decode, dashed=True)
        lay.addWidget(self.speed_legend)
        lay.addWidget(self.speed, 1)
        self.memory = _plot("Memory used per device", "used (GiB)")
        self.memory_legend = Legend()
        self.memory_curves: dict[str, pg.PlotDataItem] = {}
        lay.addWidget(self.memory_legend)
        lay.addWidget(self.memory, 1)
        for w in (self.speed, self.memory):
            w.setXRange(-self.window_s, 0, padding=0.01)

        self.timer = QTimer(self)
        self.timer.setInterval(int(1000 / max(refresh_hz, 1)))
        self.timer.timeout.connect(self.tick)

    # The plots only refresh while visible; a hidden page costs nothing.
    def showEvent(self, e):
        super().showEvent(e)
        self.tick()
        self.timer.start()

    def hideEvent(self, e):
        super().hideEvent(e)
        self.timer.stop()

    def set_metrics(self, metrics) -> None:
        self.metrics = metrics
        self._versions.clear()

    def _changed(self, key: str, buf) -> bool:
        v = buf.version
        if self._versions.get(key) == v:
            return False
        self._versions[key] = v
        return True

    def _series(self, buf, now: float):
        t, v = buf.snapshot(now - self.window_s)
        return [x - now for x in t], v

    def tick(self) -> None:
        m = self.metrics
        if m is None:
            return
        now = time.time()
        # Points slide left as time passes, so positions are recomputed every tick while data is in view;
        # the buffers are only copied (snapshot) when they changed or still hold visible points.
        shown: list[float] = []
        live_now = None  # the running decode rate, for the tile while the first reply streams
        for key, buf, curve in (("prefill", m.prefill_tps, self.curve_prefill),
                                ("decode", m.decode_tps, self.curve_decode),
                                ("live", m.decode_tps_live, self.curve_live)):
            last = buf.last()
            if last is None or (now - last[0] > self.window_s and not self._changed(key, buf)):
                continue
            x, y = self._series(buf, now)
            if key == "live":
                x, y = without_run_starts(x, y)
                live_now = y[-1] if y and x[-1] > -GAP_S else None  # still decoding
                x, y = with_gaps(x, y)
            curve.setData(x, y, connect="finite")
            shown += y
        self.speed.setYRange(0, y_top(shown), padding=0)
        mem_shown: list[float] = []
        for dev in m.memory_devices():
            buf = m.memory(dev)
            if buf is None:
                continue
            curve = self.memory_curves.get(dev)
            if curve is None:
                color = theme.SERIES_COLORS[len(self.memory_curves) % len(theme.SERIES_COLORS)]
                c = pg.mkColor(color)
                curve = self.memory.plot([], [], pen=pg.mkPen(color, width=2), fillLevel=0,
                                         brush=pg.mkBrush(c.red(), c.green(), c.blue(), 28), connect="finite")
                self.memory_curves[dev] = curve
                self.memory_legend.add("process RAM (cpu)" if dev == "cpu" else dev, color)
            x, y = self._series(buf, now)
            x, y = with_gaps(x, [v / GIB for v in y], MEMORY_GAP_S)
            curve.setData(x, y, connect="finite")
            mem_shown += y
        self.memory.setYRange(0, y_top(mem_shown), padding=0)
        reqs = m.requests()
        if live_now is not None:
            self.tile_decode.set(f"{live_now:.1f} tok/s (live)")
        if reqs:
            prefill, decode = _last(reqs, "prefill_tokens_per_s"), _last(reqs, "decode_tokens_per_s")
            ttft = _last(reqs, "time_to_first_token_s")
            if prefill:
                self.tile_prefill.set(f"{prefill:.1f} tok/s")
            if decode and live_now is None:
                self.tile_decode.set(f"{decode:.1f} tok/s")
            if ttft:
                self.tile_ttft.set(f"{ttft * 1000:.0f} ms")
            self.tile_tokens.set(f"{sum(x.generated_tokens for x in reqs):,}")
