"""The layer map's KV cache type is the one the engine runs: only the engine's KV_TYPES are offered (f32
by default), Apply with another type loads the model again with it (the runtime's load gets kv_type),
the estimate and the lanes' numbers follow, the loaded type shows in the window, and the type is always
named to the engine (its own default is not the app's)."""

from __future__ import annotations

from minecart.app import layer_map as lm
from minecart.app.main_window import MainWindow
from minecart.app.settings import Settings
from minecart.engine import KV_TYPES
from minecart.engine import placement as pl
from PySide6.QtCore import Qt


def _recording_bridge(make_bridge, scripted, make_loader):
    """A bridge over a real Runtime whose fake loader takes the load options; records every load's
    runtime.load keyword arguments and the options the loader got."""
    model = scripted()
    calls, loader_calls = [], []
    inner = make_loader(lambda: model)

    def loader(path, devices=None, placement=None, progress=None, cancel=None, **options):
        loader_calls.append(dict(options, placement=placement))
        return inner(path, devices=devices, placement=placement, progress=progress, cancel=cancel)

    bridge = make_bridge(model, loader)
    real_load = bridge.runtime.load

    def load(path, **kwargs):
        calls.append(kwargs)
        return real_load(path, **kwargs)

    bridge.runtime.load = load
    return bridge, calls, loader_calls


def _window(qtbot, bridge, devices):
    win = MainWindow(settings=Settings(), bridge=bridge, devices=devices, scan_defaults=False, include_demo=False)
    qtbot.addWidget(win)
    win.show()
    return win


def _chips(win) -> list[str]:
    return win.top.chip_texts()


def test_combo_offers_the_engine_types(qtbot, two_gpus, tiny_model):
    model = lm.LayerMapModel(two_gpus)
    plan, _ = lm.initial_plan(lm.costs_for_file(tiny_model), two_gpus)
    assert plan.kv_type == pl.DEFAULT_KV_TYPE == "f16"  # a fresh plan prices the engine's default cache
    model.set_plan(plan)
    panel = lm.LayerMapPanel(model)
    qtbot.addWidget(panel)
    items = [panel.kv_type.itemText(i) for i in range(panel.kv_type.count())]
    assert tuple(items) == tuple(KV_TYPES) and "f32" in items and "q3" in items
    assert panel.kv_type.currentText() == "f16"
    assert "9x smaller" in panel.kv_type.toolTip() and "q3" in panel.kv_type.toolTip()
    for i, name in enumerate(items):
        assert panel.kv_type.itemData(i, Qt.ItemDataRole.ToolTipRole) == lm.KV_TYPE_TIPS[name]


def test_apply_q3_loads_the_model_with_a_q3_cache(qtbot, make_bridge, scripted, loader_factory, two_gpus, tiny_model):
    bridge, calls, loader_calls = _recording_bridge(make_bridge, scripted, loader_factory)
    win = _window(qtbot, bridge, two_gpus)
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        win.load(tiny_model)
    assert calls[-1]["kv_type"] == "f16" and loader_calls[-1]["kv_type"] == "f16"  # named, not left to the engine
    assert bridge.kv_type == "f16" and "KV f16" in _chips(win)
    qtbot.waitUntil(lambda: win.layer_model.plan is not None, timeout=10000)
    panel = win.layers
    assert panel.kv_type.currentText() == "f16"
    panel.kv_type.setCurrentText("f32")  # the exact cache's estimate, to compare q3 with
    kv_f32 = sum(b.kv_cache for b in win.layer_model.bytes_per_device().values())
    lines_f32 = [lane.numbers.text() for lane in panel.lanes]
    assert any("(f32)" in t for t in lines_f32)

    panel.kv_type.setCurrentText("q3")
    assert win.layer_model.plan.kv_type == "q3"
    kv_q3 = sum(b.kv_cache for b in win.layer_model.bytes_per_device().values())
    assert 0 < kv_q3 < kv_f32 / 8  # 11/32 bytes per value against 4
    lines_q3 = [lane.numbers.text() for lane in panel.lanes]
    assert lines_q3 != lines_f32 and any("(q3)" in t for t in lines_q3)
    print(f"\nKV estimate f32 {kv_f32} B -> q3 {kv_q3} B; lane: {[t for t in lines_q3 if '(q3)' in t][0]}")

    n_loads = len(calls)
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        panel.apply_btn.click()
    assert len(calls) == n_loads + 1  # a new KV type is a load, not a re-placement
    assert calls[-1]["kv_type"] == "q3" and loader_calls[-1]["kv_type"] == "q3"
    assert calls[-1]["placement"].kv_type == "q3"
    assert bridge.kv_type == "q3"
    assert "KV q3" in _chips(win) and "KV cache q3" in win.status_model.text()
    assert win.settings.plan_for(tiny_model)["settings"]["kv_type"] == "q3"
    # the map now shows the engine's placement, still with the q3 cache it runs
    qtbot.waitUntil(lambda: win.layer_model.plan is not None and win.layer_model.plan.kv_type == "q3",
                    timeout=10000)
    assert panel.kv_type.currentText() == "q3"

    # the same type again only re-places the layers (no load)
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        panel.apply_btn.click()
    assert len(calls) == n_loads + 1 and bridge.kv_type == "q3"

    # back to f32: loaded again, with the default
    panel.kv_type.setCurrentText("f32")
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        panel.apply_btn.click()
    assert len(calls) == n_loads + 2 and calls[-1]["kv_type"] == "f32" and bridge.kv_type == "f32"
    assert "KV f32" in _chips(win)


def test_remembered_q3_plan_loads_with_q3(qtbot, make_bridge, scripted, loader_factory, two_gpus, tiny_model):
    costs = lm.costs_for_file(tiny_model)
    settings = Settings()
    settings.remember_plan(tiny_model, pl.Placement.single(costs, "cuda:0", kv_type="q3").to_dict())
    bridge, calls, loader_calls = _recording_bridge(make_bridge, scripted, loader_factory)
    win = _window(qtbot, bridge, two_gpus)
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        win.load(tiny_model)
    assert calls[-1]["kv_type"] == "q3" and loader_calls[-1]["kv_type"] == "q3"
    assert bridge.kv_type == "q3" and "KV q3" in _chips(win)


def test_saved_f16_plan_loads_with_f16(qtbot, make_bridge, scripted, loader_factory, two_gpus, tiny_model):
    costs = lm.costs_for_file(tiny_model)
    Settings().remember_plan(tiny_model, pl.Placement.single(costs, "cuda:1", kv_type="f16").to_dict())
    bridge, calls, loader_calls = _recording_bridge(make_bridge, scripted, loader_factory)
    win = _window(qtbot, bridge, two_gpus)
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        win.load(tiny_model)
    placement = calls[-1]["placement"]
    assert calls[-1]["kv_type"] == "f16" and loader_calls[-1]["kv_type"] == "f16"
    assert placement.kv_type == "f16" and placement.assignment == ["cuda:1"] * len(placement.assignment)
    assert bridge.kv_type == "f16" and win.layers.kv_type.currentText() == "f16"
