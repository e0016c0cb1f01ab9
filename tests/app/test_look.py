"""The look: every text colour of the style sheet reads at a contrast of at least 4.5:1 (WCAG AA) on the
backgrounds it sits on, and the text size zooms (Ctrl+= / Ctrl+- / Ctrl+0) and is remembered."""

from __future__ import annotations

import re

from minecart.app import theme
from minecart.app.main_window import MainWindow
from minecart.app.settings import Settings
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication


def _luminance(hex_color: str) -> float:
    r, g, b = (int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5))

    def lin(c):
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    return 0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b)


def contrast(a: str, b: str) -> float:
    hi, lo = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_contrast_formula_matches_wcag_examples():
    assert round(contrast("#000000", "#ffffff"), 1) == 21.0
    assert round(contrast("#767676", "#ffffff"), 2) == 4.54  # the lightest grey AA allows on white


def test_text_colours_have_at_least_4_5_to_1_contrast():
    surfaces = [theme.BG, theme.PANEL, theme.SURFACE, theme.SURFACE2]
    low = []
    for selector, body in re.findall(r"([^{}]+)\{([^}]*)\}", theme.style_sheet()):
        if ":disabled" in selector or "::" in selector:
            continue  # disabled controls are exempt (WCAG 1.4.3); sub-controls carry no text
        fg = re.search(r"(?<![-\w])color:\s*(#[0-9a-fA-F]{6})", body)
        if fg is None:
            continue
        bg = re.search(r"background(?:-color)?:\s*(#[0-9a-fA-F]{6})", body)
        for back in [bg.group(1)] if bg else surfaces:
            if contrast(fg.group(1), back) < 4.5:
                low.append(f"{selector.strip()}: {fg.group(1)} on {back} = {contrast(fg.group(1), back):.2f}")
    assert not low, "\n".join(low)


def test_text_zooms_and_is_remembered(qtbot, make_bridge):
    app = QApplication.instance()
    win = MainWindow(settings=Settings(), bridge=make_bridge(), devices=[], scan_defaults=False,
                     include_demo=False)
    qtbot.addWidget(win)
    win.show()
    win.activateWindow()
    qtbot.waitUntil(win.isActiveWindow, timeout=2000)
    try:
        base = app.font().pointSizeF()
        qtbot.keyClick(win, Qt.Key.Key_Equal, Qt.KeyboardModifier.ControlModifier)
        assert win.settings["font_zoom"] == 1.1 and app.font().pointSizeF() > base
        assert "11pt" in app.styleSheet()  # the style sheet's 10pt default, zoomed
        qtbot.keyClick(win, Qt.Key.Key_Minus, Qt.KeyboardModifier.ControlModifier)
        qtbot.keyClick(win, Qt.Key.Key_Minus, Qt.KeyboardModifier.ControlModifier)
        assert win.settings["font_zoom"] == 0.9 and app.font().pointSizeF() < base
        qtbot.keyClick(win, Qt.Key.Key_0, Qt.KeyboardModifier.ControlModifier)
        assert win.settings["font_zoom"] == 1.0 and app.font().pointSizeF() == base
    finally:
        theme.set_zoom(app, 1.0)
