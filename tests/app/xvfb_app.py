"""The app on a real X display, for test_real_window.py: run as `python -m tests.app.xvfb_app MODEL OUT_DIR`
with DISPLAY set. Not a test itself.

It opens the main window on the xcb platform with a two-card rig and an engine Runtime whose loader
records the placement it is given (a fake model: the test is about the window, not the maths), shows the
Hardware page with the automatic plan, and writes OUT_DIR/geometry.json: the screen coordinates of the
LM head block (the last block of the first card's lane), a point in the second card's empty lane and the
Load button. The test then drives the real mouse (xdotool). Once the engine has loaded, the script writes
OUT_DIR/result.json (the plan on screen when Load was pressed and the plan the engine received) and exits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(model: str, out_dir: str) -> int:
    from minecart.app import theme
    from minecart.app.engine_bridge import EngineBridge
    from minecart.app.main_window import MainWindow
    from minecart.app.settings import Settings
    from minecart.engine.devices import DeviceInfo
    from minecart.engine.runtime import Runtime
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from tests.engine.fake_chat_model import FakeModelBase

    out = Path(out_dir)
    app = QApplication(sys.argv[:1])
    theme.apply(app)
    received: list = []

    def loader(path, devices=None, placement=None, progress=None, cancel=None, **kw):
        received.append(placement)
        model = FakeModelBase(name="xvfb")
        model.placement = placement
        return model

    gib = 1 << 30
    devices = [DeviceInfo(id="cuda:0", kind="cuda", name="Card A", total_bytes=8 * gib, used_bytes=0,
                          free_bytes=8 * gib, compute_capability=(6, 1), source="nvml"),
               DeviceInfo(id="cuda:1", kind="cuda", name="Card B", total_bytes=8 * gib, used_bytes=0,
                          free_bytes=8 * gib, compute_capability=(6, 1), source="nvml"),
               DeviceInfo(id="cpu:0", kind="cpu", name="CPU", total_bytes=16 * gib, used_bytes=0,
                          free_bytes=16 * gib, source="os")]
    bridge = EngineBridge(runtime=Runtime(loader=loader, sample_memory_s=0))
    win = MainWindow(settings=Settings(), bridge=bridge, devices=devices, scan_defaults=False,
                     include_demo=False)
    win.resize(1280, 900)
    win.move(0, 0)
    win.show_page("layers")
    win.show()
    win.select_model(Path(model))
    state = {"geometry": False, "shown": None}

    def tick() -> None:
        plan = win.layer_model.plan
        if not state["geometry"] and plan is not None and win.isVisible():
            lane_a, lane_b = win.layers.lanes[0].view, win.layers.lanes[1].view
            root = lane_a.rootIndex()
            head = win.layer_model.index(win.layer_model.rowCount(root) - 1, 0, root)
            win.layers.scroll.ensureWidgetVisible(lane_b)  # the lanes sit in a scroll area
            app.processEvents()
            src = lane_a.viewport().mapToGlobal(lane_a.visualRect(head).center())
            dst = lane_b.viewport().mapToGlobal(lane_b.viewport().rect().center())
            load = win.top.load_btn.mapToGlobal(win.top.load_btn.rect().center())
            (out / "geometry.json").write_text(json.dumps({
                "head": [src.x(), src.y()], "lane_b": [dst.x(), dst.y()], "load": [load.x(), load.y()],
                "before": list(plan.assignment)}))
            state["geometry"] = True
        if received and not bridge.loading:
            sent = received[-1]
            (out / "result.json").write_text(json.dumps({
                "shown": list(win.layer_model.plan.assignment),
                "received": list(sent.assignment) if sent is not None else None}))
            win.close()
            app.quit()

    timer = QTimer()
    timer.timeout.connect(tick)
    timer.start(50)
    rc = app.exec()
    bridge.shutdown()
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
