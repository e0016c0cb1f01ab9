"""A layout that never widens itself: the window fits 960 px (half of a 1920 screen) on every page,
loading (progress bar, cancel, long messages) does not widen it, and it renders at 150% scaling. The
layer map's legend lists only the kinds of layer the model has."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading

from minecart.app.main_window import MainWindow, simulated_devices
from minecart.app.settings import Settings
from PySide6.QtGui import QImage

WIDTH = 960


def _window(qtbot, bridge, devices):
    win = MainWindow(settings=Settings(), bridge=bridge, devices=devices, scan_defaults=False,
                     include_demo=False)
    qtbot.addWidget(win)
    win.resize(WIDTH, 700)
    win.show()
    return win


def test_every_page_fits_960_px(qtbot, make_bridge, tiny_model):
    devices = simulated_devices("NVIDIA P104-100:8,NVIDIA CMP 30HX:6,NVIDIA P106-090:6,NVIDIA CMP 40HX:8")
    win = _window(qtbot, make_bridge(), devices)
    win.select_model(tiny_model)
    qtbot.waitUntil(lambda: win.layer_model.plan is not None, timeout=10000)
    assert win.minimumSizeHint().width() <= WIDTH
    for page in ("chat", "models", "layers", "graphs"):
        win.show_page(page)
        qtbot.wait(20)
        assert win.width() == WIDTH, page

def test_four_device_cards_fit_a_1280_px_window(qtbot, make_bridge, two_gpus):
    cpu = [d for d in two_gpus if d.kind == "cpu"]
    # with the longest sub line a card shows: each on an x1 riser, as NVML reads it
    devices = [dataclasses.replace(d, pcie=(1, 1))
               for d in simulated_devices("NVIDIA P104-100:8,NVIDIA CMP 30HX:6,NVIDIA P106-090:6")] + cpu
    win = _window(qtbot, make_bridge(), devices)
    win.resize(1280, 800)
    win.show_page("layers")
    qtbot.wait(50)
    cards = win.devices_panel.cards
    assert len(cards) == 4  # three GPUs and the CPU
    viewport = win.devices_panel.scroll.viewport()
    for card in cards:  # none is clipped at the right edge
        right = card.mapTo(viewport, card.rect().topRight()).x()
        assert right <= viewport.width(), card.device.name


def test_loading_does_not_widen_the_window(qtbot, make_bridge, scripted, loader_factory, tiny_model, two_gpus):
    block = threading.Event()
    bridge = make_bridge(loader=loader_factory(scripted, steps=4, block=block))
    win = _window(qtbot, bridge, two_gpus)
    seen = []
    bridge.load_progress.connect(lambda f, t: seen.append(f))
    win.load(tiny_model)
    qtbot.waitUntil(lambda: len(seen) >= 2, timeout=10000)  # the progress bar and Cancel are showing
    win._on_progress(0.5, "reading blk.31.ffn_down.weight " * 6)  # a long loader message
    win.top.set_chips([("loading", ""), ("a very long architecture name", ""), ("123.4B params", ""),
                       ("Q4_K_M", ""), ("63.2 GiB", ""), ("KV q3", "")])
    qtbot.wait(50)
    assert win.top.progress.isVisibleTo(win) and win.width() == WIDTH
    # the chips that do not fit are hidden whole (none is cut); the state chip always shows
    chips = [win.top.chips.itemAt(i).widget() for i in range(win.top.chips.count())]
    chips = [c for c in chips if c is not None]
    assert chips[0].isVisibleTo(win) and not all(c.isVisibleTo(win) for c in chips)
    row = win.top.chips.parentWidget()
    assert all(c.geometry().right() <= row.width() for c in chips if c.isVisibleTo(win))
    with qtbot.waitSignal(bridge.load_cancelled, timeout=5000):
        win.top.cancel_btn.click()
    assert win.width() == WIDTH


def test_legend_lists_only_the_kinds_the_model_has(qtbot, make_bridge, two_gpus, tiny_model):
    win = _window(qtbot, make_bridge(), two_gpus)
    win.select_model(tiny_model)
    qtbot.waitUntil(lambda: win.layer_model.plan is not None, timeout=10000)
    shown = {k for k, w in win.layers.kind_swatches.items() if not w.isHidden()}
    assert shown == {"embedding", "gdn", "attention"}  # a Qwen3.5 hybrid: no sliding window


def test_renders_at_150_percent_scaling(tmp_path, tiny_model):
    out = tmp_path / "layers.png"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", QT_SCALE_FACTOR="1.5", HOME=str(tmp_path),
               XDG_CONFIG_HOME=str(tmp_path / "xdg"), MINECART_SIMULATE_DEVICES="Sim A:8,Sim B:6")
    r = subprocess.run([sys.executable, "-m", "minecart.app", "--screenshot", str(out), "--view", "layers",
                        "--model", str(tiny_model), "--no-load", "--no-scan", "--size", f"{WIDTH}x700"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    img = QImage(str(out))
    assert (img.width(), img.height()) == (int(WIDTH * 1.5), int(700 * 1.5))  # not widened
