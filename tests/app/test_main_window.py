"""The main window and its other widgets: pages, top bar load progress and cancel, an engine exception
shown in the window while the app keeps working, the library scan (bad files become rows), the device
cards, the live graphs fed from metrics, and the offscreen screenshot entry point."""

from __future__ import annotations

import shutil
import threading
import time

from minecart.app.devices_panel import DevicesPanel
from minecart.app.graphs import GraphsPanel
from minecart.app.library_panel import LibraryPanel
from minecart.app.main_window import MainWindow, simulated_devices
from minecart.app.settings import Settings
from minecart.engine.metrics import Metrics, RequestTiming
from PySide6.QtCore import Qt


def _window(qtbot, bridge, devices):
    win = MainWindow(settings=Settings(), bridge=bridge, devices=devices, scan_defaults=False, include_demo=False)
    qtbot.addWidget(win)
    win.show()
    return win


def test_pages_and_load_progress(qtbot, make_bridge, two_gpus, tiny_model, scripted):
    bridge = make_bridge()
    win = _window(qtbot, bridge, two_gpus)
    assert win.graphs is None  # built on first visit (pyqtgraph is slow to import)
    for i, name in enumerate(("chat", "models", "layers", "graphs")):
        win.show_page(name)
        assert win.stack.currentIndex() == i and win.nav.buttons[i].isChecked()
    assert win.graphs is not None and win.graphs.metrics is bridge.metrics
    progress = []
    bridge.load_progress.connect(lambda f, t: progress.append(f))
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        win.load(tiny_model)
        assert win.top.progress.isVisibleTo(win) and win.top.cancel_btn.isVisibleTo(win)
    assert progress and progress[-1] == 1.0
    assert not win.top.progress.isVisibleTo(win)
    assert win.chat.model_loaded and "loaded" in win.top.chip_texts()
    assert win.settings["last_model"] == str(tiny_model)


def test_layer_map_follows_the_engine_placement(qtbot, make_bridge, two_gpus, tiny_model, scripted):
    from minecart.app.layer_map import costs_for_file
    from minecart.engine.placement import Placement

    model = scripted()
    model.placement = Placement.from_layer_counts(costs_for_file(tiny_model), [("cuda:1", 3), ("cpu:0", 5)])
    bridge = make_bridge(model)
    win = _window(qtbot, bridge, two_gpus)
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        win.load(tiny_model)
    qtbot.waitUntil(lambda: win.layer_model.plan is not None
                    and win.layer_model.plan.assignment == model.placement.assignment, timeout=10000)
    assert win.layer_model.rowCount(win.layer_model.index(0, 0)) == 0  # nothing on cuda:0


def test_load_cancelled_midway(qtbot, make_bridge, two_gpus, tiny_model, scripted, loader_factory):
    block = threading.Event()
    bridge = make_bridge(loader=loader_factory(scripted, steps=4, block=block))
    win = _window(qtbot, bridge, two_gpus)
    seen = []
    bridge.load_progress.connect(lambda f, t: seen.append(f))
    win.load(tiny_model)
    qtbot.waitUntil(lambda: len(seen) >= 2, timeout=5000)  # halfway through
    assert win.top.cancel_btn.isVisibleTo(win)
    with qtbot.waitSignal(bridge.load_cancelled, timeout=5000):
        win.top.cancel_btn.click()
    assert not win.chat.model_loaded and not bridge.runtime.loaded
    assert win.status_model.text() == "Loading cancelled"
    assert not win.top.progress.isVisibleTo(win)


def test_engine_exception_becomes_a_message_and_app_keeps_working(qtbot, make_bridge, two_gpus, tiny_model,
                                                                 scripted):
    bridge = make_bridge(scripted(fail_on="explode", reply="fine"))
    win = _window(qtbot, bridge, two_gpus)
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        win.load(tiny_model)
    chat = win.chat
    chat.think_btn.setChecked(False)
    chat.input.setPlainText("please explode")
    with qtbot.waitSignal(bridge.chat_error, timeout=10000):
        chat.send()
    err = chat.conv.messages[-1]
    assert err["role"] == "error" and "simulated engine crash" in err["content"]
    assert chat.widgets[-1].objectName() == "ErrorBubble"
    assert chat.send_btn.isVisibleTo(win) and chat.send_btn.isEnabled()
    chat.input.setPlainText("now something normal")
    with qtbot.waitSignal(bridge.chat_done, timeout=10000):
        chat.send()
    assert chat.conv.messages[-1] == {**chat.conv.messages[-1], "role": "assistant", "content": "fine"}
    assert bridge.runtime.status()["alive"]


def test_load_failure_is_shown(qtbot, make_bridge, two_gpus, tmp_path):
    def broken_loader(path, **kw):
        raise ValueError("this file is broken on purpose")

    bridge = make_bridge(loader=broken_loader)
    win = _window(qtbot, bridge, two_gpus)
    with qtbot.waitSignal(bridge.load_failed, timeout=10000):
        win.bridge.load(tmp_path / "x.gguf")
    assert "broken on purpose" in win.status_model.text() and not win.chat.conv.messages
    assert not win.top.progress.isVisibleTo(win)


def test_library_scan_lists_models_and_bad_files(qtbot, fixtures_dir, tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf", folder / "good.gguf")
    data = (fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf").read_bytes()
    (folder / "truncated.gguf").write_bytes(data[:4000])
    (folder / "not-a-model.gguf").write_bytes(b"hello world, not gguf")
    panel = LibraryPanel([str(folder)], include_defaults=False, include_demo=False)
    qtbot.addWidget(panel)
    with qtbot.waitSignal(panel.scan_thread.found if panel.scan_thread else panel.model.modelReset, timeout=20000):
        panel.rescan()
    rows = {r.path.name: r for r in panel.model.rows}
    assert set(rows) == {"good.gguf", "truncated.gguf", "not-a-model.gguf"}
    good = rows["good.gguf"]
    assert good.ok and good.architecture == "qwen35" and good.quant_text.startswith("Q8_0")
    assert rows["truncated.gguf"].error and rows["not-a-model.gguf"].error
    assert "1 model found, 2 unreadable" == panel.status.text()
    # the row says so, and its tooltip carries the reason
    r = [i for i, s in enumerate(panel.model.rows) if s.path.name == "not-a-model.gguf"][0]
    assert panel.model.index(r, 1).data() == "unreadable"
    assert "magic" in panel.model.index(r, 0).data(Qt.ItemDataRole.ToolTipRole)
    assert panel.select_path(folder / "good.gguf") and panel.load_btn.isEnabled()
    with qtbot.waitSignal(panel.load_requested, timeout=1000) as sig:
        panel.load_btn.click()
    assert sig.args[0] == folder / "good.gguf"


def test_devices_panel_shows_each_device(qtbot, two_gpus):
    panel = DevicesPanel(lambda: two_gpus)
    qtbot.addWidget(panel)
    assert [c.device.id for c in panel.cards] == ["cuda:0", "cuda:1", "cpu:0"]
    assert "compute 7.5 (sm_75)" in panel.cards[1].sub.text()
    assert panel.cards[0].sub.text().endswith(" · PCIe\u00a0Gen1\u00a0x1")  # the link NVML read (a riser)
    assert "PCIe" not in panel.cards[1].sub.text()  # none read: none shown
    assert "free" in panel.cards[0].mem.text() and panel.cards[0].bar.value() > 0
    sims = simulated_devices("Rig card:4,Other:2")
    assert [d.total_bytes for d in sims] == [4 << 30, 2 << 30]


def test_graphs_follow_metrics(qtbot):
    m = Metrics(capacity=100)
    panel = GraphsPanel(m, window_s=60, refresh_hz=20)
    qtbot.addWidget(panel)
    now = time.time()
    m.record_request(RequestTiming(1, "chat", now - 1, 0.0, 0.2, 0.2, 0.8, 40, 20, 200.0, 25.0, "stop"))
    m.record_memory("cuda:0", 2 << 30, 8 << 30)
    m.record_memory("cpu", 1 << 30)
    panel.tick()
    xs, ys = panel.curve_decode.getData()
    assert list(ys) == [25.0] and -60 <= xs[0] <= 0
    assert list(panel.curve_prefill.getData()[1]) == [200.0]
    assert set(panel.memory_curves) == {"cuda:0", "cpu"}
    assert panel.tile_decode.value.text() == "25.0 tok/s"
    assert not panel.timer.isActive()  # hidden: no refresh
    panel.show()
    assert panel.timer.isActive() and panel.timer.interval() == 50
    panel.hide()
    assert not panel.timer.isActive()


def test_screenshot_entry_point(qtbot, tiny_model, tmp_path, monkeypatch):
    from minecart.app.__main__ import main
    from PySide6.QtGui import QImage

    monkeypatch.setenv("MINECART_SIMULATE_DEVICES", "Sim A:4,Sim B:2")
    out = tmp_path / "shot.png"
    assert main(["--screenshot", str(out), "--view", "layers", "--model", str(tiny_model), "--no-load",
                 "--no-scan", "--size", "1200x800"]) == 0
    img = QImage(str(out))
    assert img.width() >= 1200 and img.height() >= 800


def test_library_model_passes_qt_model_tester(qtmodeltester, fixtures_dir):
    from minecart.app.library_panel import LibraryModel
    from minecart.engine import model_library as ml

    m = LibraryModel()
    m.set_rows([ml.summarize(fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf"),
                ml.ModelSummary(path=fixtures_dir / "nope.gguf", error="unreadable GGUF header: test")])
    qtmodeltester.check(m, force_py=True)
