"""Live performance graphs: prefill and decode tokens/s over time, and memory used per device over time.

Fed from the engine's Metrics ring buffers (engine/metrics.py) by a QTimer at 10 Hz; a curve is redrawn
only when its buffer changed (`setData` with clip-to-view and auto-downsampling), never once per token.
The x axis is "seconds ago" so the newest point is always at the right edge.
"""

from __future__ import annotations

import time

import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from . import theme

pg.setConfigOptions(antialias=True, background=theme.PANEL, foreground=theme.MUTED)


def _plot(title: str, y_label: str, y_units: str | None = None) -> pg.PlotWidget:
    w = pg.PlotWidget()
    w.setMenuEnabled(False)
    w.setMouseEnabled(x=False, y=False)
    w.hideButtons()
    item = w.getPlotItem()
    item.setTitle(f"<span style='color:{theme.TEXT}; font-size:10.5pt; font-weight:600'>{title}</span>")
    item.showGrid(x=True, y=True, alpha=0.12)
    item.setLabel("bottom", "seconds ago", color=theme.MUTED)
    item.setLabel("left", y_label, units=y_units, color=theme.MUTED)
    for ax in ("left", "bottom"):
        axis = item.getAxis(ax)
        axis.setPen(pg.mkPen("#3a4050"))
        axis.setTextPen(pg.mkPen(theme.MUTED))
    item.setClipToView(True)
    item.setDownsampling(auto=True, mode="peak")
    vb = item.getViewBox()
    vb.setLimits(yMin=0)
    legend = item.addLegend(offset=(-10, 8), labelTextColor=theme.TEXT, brush=pg.mkBrush(26, 29, 36, 220),
                            pen=pg.mkPen("#2c313c"))
    legend.setParentItem(vb)
    legend.anchor((1, 0), (1, 0), offset=(-8, 8))
    return w


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
        self.value.setStyleSheet("font-size: 17pt; font-weight: 600; background: transparent;")
        lay.addWidget(self.value)

    def set(self, text: str) -> None:
        self.value.setText(text)


class GraphsPanel(QWidget):
    """Two live plots and a few headline numbers; call `set_metrics(metrics)` once a runtime exists."""

    def __init__(self, metrics=None, window_s: float = 120.0, refresh_hz: float = 10.0, parent=None):
        super().__init__(parent)
        self.metrics = metrics
        self.window_s = float(window_s)
        self._versions: dict[str, int] = {}
        lay = QVBoxLayout(self)
        lay.setContentsMargins(24, 18, 24, 18)
        lay.setSpacing(12)
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
        self.curve_prefill = self.speed.plot([], [], name="prefill", pen=pg.mkPen("#5b8def", width=2),
                                             symbol="o", symbolSize=6, symbolBrush="#5b8def", symbolPen=None)
        self.curve_decode = self.speed.plot([], [], name="decode", pen=pg.mkPen(theme.ACCENT, width=2),
                                            symbol="o", symbolSize=6, symbolBrush=theme.ACCENT, symbolPen=None)
        self.curve_live = self.speed.plot([], [], name="decode (live)",
                                          pen=pg.mkPen(theme.ACCENT, width=1.2, style=Qt.PenStyle.DashLine))
        lay.addWidget(self.speed, 1)
        self.memory = _plot("Memory used per device", "used", "B")
        self.memory_curves: dict[str, pg.PlotDataItem] = {}
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
        v = getattr(buf, "version", None)
        if v is not None and self._versions.get(key) == v:
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
        for key, buf, curve in (("prefill", m.prefill_tps, self.curve_prefill),
                                ("decode", m.decode_tps, self.curve_decode),
                                ("live", m.decode_tps_live, self.curve_live)):
            last = buf.last()
            if last is None or (now - last[0] > self.window_s and not self._changed(key, buf)):
                continue
            x, y = self._series(buf, now)
            curve.setData(x, y)
        mem_devices = []
        for dev in list(getattr(m, "_memory", {}).keys()):
            buf = m.memory(dev)
            if buf is None:
                continue
            mem_devices.append(dev)
            curve = self.memory_curves.get(dev)
            if curve is None:
                color = theme.SERIES_COLORS[len(self.memory_curves) % len(theme.SERIES_COLORS)]
                label = "process RAM (cpu)" if dev == "cpu" else dev
                curve = self.memory.plot([], [], name=label, pen=pg.mkPen(color, width=2),
                                         fillLevel=0, brush=pg.mkBrush(pg.mkColor(color).red(),
                                                                       pg.mkColor(color).green(),
                                                                       pg.mkColor(color).blue(), 28))
                self.memory_curves[dev] = curve
            x, y = self._series(buf, now)
            curve.setData(x, y)
        reqs = m.requests(1)
        if reqs:
            r = reqs[-1]
            self.tile_prefill.set(f"{r.prefill_tokens_per_s:.1f} tok/s" if r.prefill_tokens_per_s else "—")
            self.tile_decode.set(f"{r.decode_tokens_per_s:.1f} tok/s" if r.decode_tokens_per_s else "—")
            self.tile_ttft.set(f"{r.time_to_first_token_s * 1000:.0f} ms" if r.time_to_first_token_s else "—")
            total = sum(x.generated_tokens for x in m.requests())
            self.tile_tokens.set(f"{total:,}")
