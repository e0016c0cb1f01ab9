"""The layer map is the plan that runs: Load, Reload and Apply hand the engine exactly the plan on
screen (part -> device), the map then shows what the engine placed, and a failed load or a CPU
fallback says why in the status area (chip, status bar, map notice), never in the chat transcript.
The top bar names the loaded model, not the row selected on the Models page."""

from __future__ import annotations

import dataclasses

from minecart.app.main_window import MainWindow
from minecart.app.settings import Settings
from minecart.engine.errors import DeviceError


def _simulated(devices):
    """The two_gpus rig with cards that exist only on paper (MINECART_SIMULATE_DEVICES)."""
    return [dataclasses.replace(d, source="simulated") if d.kind == "cuda" else d for d in devices]


def _recording_loader(scripted, calls, fail_on_device=None):
    def loader(path, devices=None, placement=None, progress=None, cancel=None, **kw):
        calls.append({"path": path, "devices": devices, "placement": placement, **kw})
        if fail_on_device and placement is not None and fail_on_device in placement.devices_used():
            raise DeviceError(f"device '{fail_on_device}' could not be opened (out of memory)")
        model = scripted(reply="ok")
        if placement is not None:  # what the engine's Model reports of the plan it ran
            model.placement = placement
            model.device_plan = dict(zip(placement.parts, placement.assignment, strict=True))
        return model

    return loader


def _window(qtbot, bridge, devices):
    win = MainWindow(settings=Settings(), bridge=bridge, devices=devices, scan_defaults=False,
                     include_demo=False)
    qtbot.addWidget(win)
    win.show()
    return win


def _chips(win) -> list[str]:
    return win.top.chip_texts()


def _by_part(plan) -> dict[str, str]:
    return dict(zip(plan.parts, plan.assignment, strict=True))


def test_load_and_reload_send_the_plan_on_screen(qtbot, make_bridge, two_gpus, tiny_model, scripted):
    calls = []
    bridge = make_bridge(loader=_recording_loader(scripted, calls))
    win = _window(qtbot, bridge, two_gpus)
    # Load before the plan is on screen: it waits for the automatic plan and runs that one
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        win.load(tiny_model)
        assert win.loading
    shown = win.layer_model.plan
    assert calls[-1]["placement"] is not None
    assert _by_part(calls[-1]["placement"]) == _by_part(shown)
    # the user drags the last layers onto the second card and presses Reload
    n = len(shown.assignment)
    win.layer_model.move_parts(list(range(n - 4, n)), "cuda:1")
    edited = _by_part(win.layer_model.plan)
    assert "cuda:1" in edited.values()
    assert win.top.load_btn.text().strip() == "Reload"
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        win.top.load_btn.click()
    assert _by_part(calls[-1]["placement"]) == edited
    # the map shows what the engine placed, the status bar and chip agree that it is loaded
    assert _by_part(win.layer_model.plan) == edited
    assert "loaded" in _chips(win) and win.status_model.text().startswith("Loaded")
    assert "cuda:1" in win.status_model.text()
    # the plan that ran is the one remembered for this model
    assert win.settings.plan_for(tiny_model)["assignment"] == edited


def test_apply_re_places_with_the_plan_on_screen(qtbot, make_bridge, two_gpus, tiny_model, scripted):
    bridge = make_bridge()
    win = _window(qtbot, bridge, two_gpus)
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        win.load(tiny_model)
    sent = []
    bridge.runtime.replace = lambda placement, _orig=bridge.runtime.replace: (sent.append(placement),
                                                                               _orig(placement))[1]
    win.layer_model.move_parts([1, 2], "cpu:0")
    edited = _by_part(win.layer_model.plan)
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        win.layers.apply_btn.click()
    assert _by_part(sent[-1]) == edited and _by_part(win.layer_model.plan) == edited


def test_failed_load_is_told_in_the_status_area_and_the_map_drops_the_plan(qtbot, make_bridge, two_gpus,
                                                                           tiny_model, scripted):
    calls = []
    bridge = make_bridge(loader=_recording_loader(scripted, calls, fail_on_device="cuda:1"))
    win = _window(qtbot, bridge, two_gpus)
    win.select_model(tiny_model)
    qtbot.waitUntil(lambda: win.layer_model.plan is not None, timeout=10000)
    auto = _by_part(win.layer_model.plan)
    win.layer_model.move_parts([len(auto) - 1], "cuda:1")
    failed = _by_part(win.layer_model.plan)
    with qtbot.waitSignal(bridge.load_failed, timeout=10000):
        win.top.load_btn.click()
    assert _by_part(calls[-1]["placement"]) == failed
    assert not any(m["role"] == "error" for m in win.chat.conv.messages)  # not in the transcript
    assert "load failed" in _chips(win) and "loaded" not in _chips(win)
    assert win.status_model.text().startswith("Loading failed:") and "out of memory" in win.status_model.text()
    assert not win.layers.notice.isHidden() and "out of memory" in win.layers.notice.text()
    # the failed plan is not kept: the automatic plan (planned on a worker thread) replaces it
    qtbot.waitUntil(lambda: not win.layer_model.auto_splitting, timeout=5000)
    assert _by_part(win.layer_model.plan) == auto
    assert win.top.title.text() == "No model loaded" and not win.top.unload_btn.isVisible()
    assert win.settings.plan_for(tiny_model) is None  # nor remembered


def test_simulated_gpus_fall_back_to_the_cpu_and_say_why(qtbot, make_bridge, two_gpus, tiny_model, scripted):
    calls = []
    bridge = make_bridge(loader=_recording_loader(scripted, calls))
    win = _window(qtbot, bridge, _simulated(two_gpus))
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        win.load(tiny_model)
    assert set(calls[-1]["placement"].devices_used()) == {"cpu:0"}
    assert set(win.layer_model.plan.assignment) == {"cpu:0"}  # the map shows what runs
    assert "simulated" in win.status_model.text() and "cpu:0" in win.status_model.text()
    assert not win.layers.notice.isHidden() and "simulated" in win.layers.notice.text()
    gpu_lanes = [lane for lane in win.layers.lanes if lane.model.devices[lane.row].kind == "cuda"]
    assert gpu_lanes and all("simulated card" in lane.numbers.text() for lane in gpu_lanes)


def test_top_bar_names_the_loaded_model_not_the_selected_row(qtbot, make_bridge, two_gpus, tiny_model,
                                                             fixtures_dir):
    bridge = make_bridge()
    win = _window(qtbot, bridge, two_gpus)
    assert win.top.title.text() == "No model loaded"
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        win.load(tiny_model)
    loaded_title = win.top.title.text()
    assert loaded_title not in ("", "No model loaded")
    other = fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf"
    win.select_model(other)
    qtbot.waitUntil(lambda: win.selected.path == other, timeout=10000)
    assert win.top.title.text() == loaded_title and "loaded" in _chips(win)
    assert win.top.load_btn.text().strip() == "Load" and other.stem in win.top.load_btn.toolTip() \
        or win.selected.display_name in win.top.load_btn.toolTip()


def test_cancel_while_the_plan_is_being_made_never_loads(qtbot, make_bridge, two_gpus, tiny_model, scripted,
                                                         monkeypatch):
    import time

    from minecart.app import layer_map, main_window

    real = layer_map.costs_for_file
    monkeypatch.setattr(main_window, "costs_for_file", lambda p: (time.sleep(0.3), real(p))[1])
    calls = []
    bridge = make_bridge(loader=_recording_loader(scripted, calls))
    win = _window(qtbot, bridge, two_gpus)
    win.load(tiny_model)
    assert win.loading and win.top.cancel_btn.isVisibleTo(win)
    win.top.cancel_btn.click()
    assert not win.loading and win.status_model.text() == "Loading cancelled"
    qtbot.waitUntil(lambda: win.layer_model.plan is not None, timeout=10000)
    qtbot.wait(100)
    assert calls == [] and not bridge.loading and not win.top.progress.isVisibleTo(win)
