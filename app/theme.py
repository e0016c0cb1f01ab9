"""The look of the app: the dark style sheet, a matching QPalette, colours used in custom painting, and
icons drawn from the SVGs in minecart.resources (recoloured on load, so one file serves every state).

Not here: layout or behaviour. Widgets ask this module for a colour or an icon by name.
"""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

from PySide6.QtCore import QByteArray, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QIcon, QPainter, QPalette, QPixmap
from PySide6.QtSvg import QSvgRenderer

# Palette shared by the style sheet (resources/style.qss) and the custom-painted widgets.
BG = "#14161b"
PANEL = "#1a1d24"
SURFACE = "#20242d"
SURFACE2 = "#272c37"
BORDER = "#2c313c"
TEXT = "#e4e7ee"
MUTED = "#8d96a8"
ACCENT = "#f0a43a"
DANGER = "#ef5b5b"
OK = "#3ecf8e"
WARN = "#f4c06b"

# Layer-kind colours in the layer map (and its legend): GDN and attention layers must look different.
KIND_COLORS = {
    "embedding": "#6b7a99",
    "head": "#6b7a99",
    "gdn": "#2bb3a3",
    "attention": "#f0a43a",
    "sliding": "#9b7cff",
    "experts": "#c9708a",  # an MoE layer's routed experts (their own block in the layer map)
}
# Memory-bar segments.
MEM_COLORS = {"weights": "#5b8def", "kv": "#f0a43a", "state": "#2bb3a3", "scratch": "#8d96a8", "overhead": "#4a5163",
              "pinned": "#34559e"}
# One colour per device in the graphs (VRAM lines), cycling.
SERIES_COLORS = ["#f0a43a", "#5b8def", "#2bb3a3", "#e0607e", "#9b7cff", "#7bc96f", "#e2c044", "#56c2e6"]


def _read_resource(*parts: str) -> bytes:
    ref = resources.files("minecart.resources")
    for p in parts:
        ref = ref.joinpath(p)
    return ref.read_bytes()


ZOOM_STEPS = (0.8, 0.9, 1.0, 1.1, 1.25, 1.4, 1.6, 1.8, 2.0)  # Ctrl+= / Ctrl+- walk these
BASE_POINT_SIZE = 10.0


def style_sheet(zoom: float = 1.0) -> str:
    """The style sheet with every font size (in pt) times `zoom`."""
    text = _read_resource("style.qss").decode("utf-8")
    if zoom == 1.0:
        return text
    return re.sub(r"(\d+(?:\.\d+)?)pt\b", lambda m: f"{float(m.group(1)) * zoom:.4g}pt", text)


def set_zoom(app, zoom: float) -> None:
    """Every font of the app times `zoom` (the default font and the style sheet's sizes)."""
    font = QFont(app.font())
    font.setPointSizeF(BASE_POINT_SIZE * zoom)
    app.setFont(font)
    app.setStyleSheet(style_sheet(zoom))


@lru_cache(maxsize=256)
def icon_pixmap(name: str, color: str = TEXT, size: int = 20, dpr: float = 2.0) -> QPixmap:
    svg = _read_resource("icons", f"{name}.svg").decode("utf-8").replace("currentColor", color)
    renderer = QSvgRenderer(QByteArray(svg.encode("utf-8")))
    px = QPixmap(int(size * dpr), int(size * dpr))
    px.fill(Qt.GlobalColor.transparent)
    painter = QPainter(px)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(painter, QRectF(0, 0, size * dpr, size * dpr))
    painter.end()
    px.setDevicePixelRatio(dpr)
    return px


def icon(name: str, color: str = TEXT, active_color: str | None = None, size: int = 20) -> QIcon:
    """An icon whose normal state uses `color` and checked/active state `active_color`."""
    ic = QIcon()
    ic.addPixmap(icon_pixmap(name, color, size), QIcon.Mode.Normal, QIcon.State.Off)
    ic.addPixmap(icon_pixmap(name, "#5b6373", size), QIcon.Mode.Disabled, QIcon.State.Off)
    ic.addPixmap(icon_pixmap(name, active_color or color, size), QIcon.Mode.Normal, QIcon.State.On)
    return ic


def app_icon() -> QIcon:
    svg = _read_resource("icons", "logo.svg")
    renderer = QSvgRenderer(QByteArray(svg))
    ic = QIcon()
    for s in (16, 32, 48, 64, 128, 256):
        px = QPixmap(s, s)
        px.fill(Qt.GlobalColor.transparent)
        p = QPainter(px)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        renderer.render(p, QRectF(0, 0, s, s))
        p.end()
        ic.addPixmap(px)
    return ic


def apply(app) -> None:
    """Dark palette + style sheet + a readable default font on a QApplication."""
    app.setStyle("Fusion")
    pal = QPalette()
    for role, col in (
        (QPalette.ColorRole.Window, BG), (QPalette.ColorRole.WindowText, TEXT),
        (QPalette.ColorRole.Base, PANEL), (QPalette.ColorRole.AlternateBase, SURFACE),
        (QPalette.ColorRole.Text, TEXT), (QPalette.ColorRole.Button, SURFACE2),
        (QPalette.ColorRole.ButtonText, TEXT), (QPalette.ColorRole.Highlight, "#3b3222"),
        (QPalette.ColorRole.HighlightedText, "#ffffff"), (QPalette.ColorRole.ToolTipBase, SURFACE2),
        (QPalette.ColorRole.ToolTipText, TEXT), (QPalette.ColorRole.PlaceholderText, MUTED),
        (QPalette.ColorRole.Link, "#ffb84d"),
    ):
        pal.setColor(role, QColor(col))
    app.setPalette(pal)
    font = QFont(app.font())
    font.setFamilies(["Inter", "Segoe UI", "Noto Sans", "DejaVu Sans", "Sans Serif"])
    font.setPointSizeF(BASE_POINT_SIZE)
    app.setFont(font)
    app.setStyleSheet(style_sheet())
    app.setWindowIcon(app_icon())


def mono_font(size: float = 9.5) -> QFont:
    f = QFont()
    f.setFamilies(["JetBrains Mono", "Cascadia Mono", "Consolas", "DejaVu Sans Mono", "Monospace"])
    f.setStyleHint(QFont.StyleHint.Monospace)
    f.setPointSizeF(size)
    return f
