"""The hardware panel: one card per device (each GPU, then the CPU) with its name, compute capability,
memory total/used/free as a bar, and what the kernel probe found for it.

Reads `engine.devices.list_devices()` only (NVML numbers; nothing is allocated on a GPU). Refreshing is
cheap, so the panel re-reads on a slow timer while visible.
"""

from __future__ import annotations

from minecart.engine.devices import DeviceInfo, format_bytes
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QScrollArea,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from . import theme


class DeviceCard(QFrame):
    MIN_WIDTH = 220

    def __init__(self, dev: DeviceInfo, parent=None):
        super().__init__(parent)
        self.setObjectName("Card")
        # cards share the row down to MIN_WIDTH (four cards and the CPU fit a 1280 px window); a
        # bigger rig scrolls sideways
        self.setMinimumWidth(self.MIN_WIDTH)
        self.setMaximumWidth(330)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(14, 10, 14, 10)
        lay.setSpacing(4)
        head = QHBoxLayout()
        ic = QLabel()
        ic.setPixmap(theme.icon_pixmap("gpu" if dev.kind == "cuda" else "cpu", theme.ACCENT, 22))
        head.addWidget(ic)
        name = QLabel(f"<b>{dev.name}</b>")
        name.setToolTip(dev.name)
        # one line: a wrapped name made every card (and so the Hardware page) taller
        name.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        head.addWidget(name, 1)
        lay.addLayout(head)
        bits = [dev.id]
        if dev.compute_capability:
            bits.append(f"compute {dev.compute_capability[0]}.{dev.compute_capability[1]} ({dev.sm})")
        if dev.pcie:  # the link the planner prices this card's crossings and expert streaming with
            bits.append(f"PCIe\u00a0Gen{dev.pcie[0]}\u00a0x{dev.pcie[1]}")  # wrapped whole, if at all
        if dev.kind == "cpu":
            bits.append(f"{dev.extra.get('threads', '?')} threads")
        if dev.source == "simulated":
            bits.append("simulated")
        self.sub = QLabel(" · ".join(bits))
        self.sub.setObjectName("Subtle")
        self.sub.setWordWrap(True)  # a second line on a narrow card rather than a wider card
        lay.addWidget(self.sub)
        self.bar = QProgressBar()
        self.bar.setTextVisible(False)
        self.bar.setFixedHeight(8)
        lay.addWidget(self.bar)
        self.mem = QLabel()
        self.mem.setObjectName("Subtle")
        self.mem.setWordWrap(True)
        lay.addWidget(self.mem)
        self.probe = QLabel()
        self.probe.setWordWrap(True)
        lay.addWidget(self.probe)
        if dev.uuid:
            u = QLabel(dev.uuid)
            u.setObjectName("Subtle")
            u.setStyleSheet("font-size: 8pt;")
            lay.addWidget(u)
        self.set_device(dev)

    def set_device(self, dev: DeviceInfo) -> None:
        self.device = dev
        kind = "VRAM" if dev.kind == "cuda" else "RAM"
        if dev.total_bytes > 0:
            self.bar.setRange(0, 1000)
            self.bar.setValue(int(1000 * max(dev.used_bytes, 0) / dev.total_bytes))
            self.mem.setToolTip(f"{kind}: {dev.total_bytes:,} bytes total, {dev.used_bytes:,} used, {dev.free_bytes:,} free")
            self.mem.setText(f"{kind} {format_bytes(dev.total_bytes)} · {format_bytes(dev.used_bytes)} used · "
                             f"<span style='color:#e4e7ee'>{format_bytes(dev.free_bytes)} free</span>")
        else:
            self.bar.setRange(0, 0)
            self.mem.setText(f"{kind}: unknown")
        if dev.probe:
            self.probe.setText(f"<span style='color:{theme.OK}'>●</span> probe: {dev.probe}")
        elif dev.kind == "cuda":
            self.probe.setText("<span style='color:#8d96a8'>○ not probed yet (runs on first load)</span>")
        else:
            self.probe.setText("<span style='color:#8d96a8'>NumPy reference backend</span>")


class DevicesPanel(QWidget):
    """One row of device cards (scrolls sideways on a big rig, so the layer map keeps its room);
    `refresh()` re-reads memory numbers."""

    def __init__(self, list_devices, parent=None):
        super().__init__(parent)
        self._list_devices = list_devices
        self.cards: list[DeviceCard] = []
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        host = QWidget()
        self.row = QHBoxLayout(host)
        self.row.setContentsMargins(0, 0, 0, 4)
        self.row.setSpacing(10)
        self.row.addStretch(1)
        self.scroll.setWidget(host)
        outer.addWidget(self.scroll)
        self.refresh()
        self.timer = QTimer(self)
        self.timer.setInterval(2000)
        self.timer.timeout.connect(self.refresh)

    def showEvent(self, e):
        super().showEvent(e)
        self.timer.start()

    def hideEvent(self, e):
        super().hideEvent(e)
        self.timer.stop()

    def refresh(self) -> None:
        try:
            devices = self._list_devices()
        except Exception as exc:  # device listing must never take the window down
            devices = []
            self.setToolTip(str(exc))
        if [d.id for d in devices] == [c.device.id for c in self.cards]:
            for card, dev in zip(self.cards, devices, strict=True):
                card.set_device(dev)
            return
        for c in self.cards:
            c.hide()
            c.setParent(None)
            c.deleteLater()
        self.cards = []
        for dev in devices:
            card = DeviceCard(dev)
            self.cards.append(card)
            self.row.insertWidget(self.row.count() - 1, card)
        # tall enough for the tallest card plus the sideways scroll bar
        height = max((c.sizeHint().height() for c in self.cards), default=0)
        self.scroll.setFixedHeight(height + 18)
