"""Layer map: the item model over engine.placement, drag and drop between device lanes, keyboard moves,
memory bars and overflow warnings, auto-split, and the plan remembered per model."""

from __future__ import annotations

from minecart.app.layer_map import LayerMapModel, LayerMapPanel, costs_for_file, initial_plan
from minecart.engine import placement as pl
from PySide6.QtCore import QPointF, Qt
from PySide6.QtGui import QDragEnterEvent, QDropEvent
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication

_COSTS = {}


def _costs(path):
    # reading the tensor table (and the 250k-token vocabulary) takes a while: once per test run
    if path not in _COSTS:
        _COSTS[path] = costs_for_file(path)
    return _COSTS[path]


def _panel(qtbot, devices, model_path):
    costs = _costs(model_path)
    model = LayerMapModel(devices)
    plan, _ = initial_plan(costs, devices)
    model.set_plan(plan)
    panel = LayerMapPanel(model)
    qtbot.addWidget(panel)
    panel.resize(1100, 700)
    panel.show()
    qtbot.waitExposed(panel)
    return model, panel


def test_model_tree_matches_plan(qtbot, two_gpus, tiny_model):
    model, panel = _panel(qtbot, two_gpus, tiny_model)
    plan = model.plan
    n_parts = len(plan.assignment)
    assert n_parts == plan.costs.n_layers + 2  # embedding + layers + LM head
    assert model.rowCount() == 3
    children = sum(model.rowCount(model.index(r, 0)) for r in range(3))
    assert children == n_parts
    # every child reports the device of its parent row, and kinds tell GDN from attention apart
    kinds = set()
    for r in range(3):
        dev = model.devices[r].id
        parent = model.index(r, 0)
        for c in range(model.rowCount(parent)):
            idx = model.index(c, 0, parent)
            assert idx.data(Qt.ItemDataRole.UserRole + 3) == dev
            assert model.parent(idx) == parent
            kinds.add(idx.data(Qt.ItemDataRole.UserRole + 1))
            assert model.flags(idx) & Qt.ItemFlag.ItemIsDragEnabled
    assert {"embedding", "gdn", "attention", "head"} <= kinds
    assert not panel.kind_swatches["experts"].isVisibleTo(panel)  # a dense model has no expert blocks
    assert model.flags(model.index(0, 0)) & Qt.ItemFlag.ItemIsDropEnabled
    assert len(panel.lanes) == 3


def _drop(view, parts, model):
    """Deliver a drop of `parts` onto a lane the way Qt does at the end of a drag."""
    src_indexes = []
    for r in range(model.rowCount()):
        parent = model.index(r, 0)
        for c in range(model.rowCount(parent)):
            idx = model.index(c, 0, parent)
            if model.part_of(idx) in parts:
                src_indexes.append(idx)
    mime = model.mimeData(src_indexes)
    pos = QPointF(view.viewport().width() - 5, view.viewport().height() - 5)
    assert view.viewport().acceptDrops()
    enter = QDragEnterEvent(pos.toPoint(), Qt.DropAction.MoveAction, mime, Qt.MouseButton.LeftButton,
                            Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(view.viewport(), enter)
    assert enter.isAccepted()  # the lane says it takes these blocks
    ev = QDropEvent(pos, Qt.DropAction.MoveAction, mime, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(view.viewport(), ev)


def test_drag_layers_to_another_device_moves_them(qtbot, two_gpus, tiny_model):
    model, panel = _panel(qtbot, two_gpus, tiny_model)
    model.set_plan(pl.Placement.single(model.plan.costs, "cuda:0"))
    model.keep_contiguous = False
    last_layer = model.plan.costs.n_layers  # part index of the last layer
    before = list(model.plan.assignment)
    _drop(panel.lanes[1].view, [last_layer - 1, last_layer], model)
    after = model.plan.assignment
    assert after[last_layer] == "cuda:1" and after[last_layer - 1] == "cuda:1"
    assert sum(a != b for a, b in zip(before, after, strict=True)) == 2
    assert model.rowCount(model.index(1, 0)) == 2
    # the lane's view follows the model (rooted at its device again after the reset)
    assert panel.lanes[1].view.model().rowCount(panel.lanes[1].view.rootIndex()) == 2


def test_drop_with_contiguity_moves_the_boundary(qtbot, two_gpus, tiny_model):
    model, panel = _panel(qtbot, two_gpus, tiny_model)
    costs = model.plan.costs
    n = costs.n_layers
    model.set_plan(pl.Placement.from_layer_counts(costs, [("cuda:0", n - 2), ("cuda:1", 2)]))
    model.keep_contiguous = True
    first_b = model.plan.assignment.index("cuda:1")
    # drag one block three places before the boundary onto B: the blocks between come along
    _drop(panel.lanes[1].view, [first_b - 3], model)
    assert model.plan.assignment.index("cuda:1") == first_b - 3
    assert model.plan.is_contiguous()


def test_keyboard_moves_selection_to_next_device(qtbot, two_gpus, tiny_model):
    model, panel = _panel(qtbot, two_gpus, tiny_model)
    model.set_plan(pl.Placement.single(model.plan.costs, "cuda:0"))
    view = panel.lanes[0].view
    view.setFocus()
    root = view.rootIndex()
    last = model.index(model.rowCount(root) - 1, 0, root)  # the LM head
    view.setCurrentIndex(last)
    view.selectionModel().select(last, view.selectionModel().SelectionFlag.ClearAndSelect)
    QTest.keyClick(view, Qt.Key.Key_Down, Qt.KeyboardModifier.AltModifier)
    assert model.plan.assignment[-1] == "cuda:1"
    assert model.plan.assignment[:-1] == ["cuda:0"] * (len(model.plan.assignment) - 1)


def test_memory_bars_warn_before_overflow(qtbot, two_gpus, tiny_model):
    from dataclasses import replace

    small = [replace(two_gpus[0], free_bytes=300 << 20)] + two_gpus[1:]
    model, panel = _panel(qtbot, small, tiny_model)
    model.set_plan(pl.Placement.single(model.plan.costs, "cuda:0"))
    lane = panel.lanes[0]
    assert lane.bar.overflow
    assert lane.warning.isVisibleTo(panel) and "more than cuda:0 has free" in lane.warning.text()
    assert not panel.apply_btn.isEnabled()
    assert panel.issues.isVisibleTo(panel)
    # moving everything to the roomy GPU clears the warning and enables Apply
    model.move_parts(list(range(len(model.plan.assignment))), "cuda:1")
    assert not lane.bar.overflow and not lane.warning.isVisibleTo(panel)
    assert panel.apply_btn.isEnabled()


def test_auto_split_uses_gpus_and_apply_emits_plan(qtbot, two_gpus, tiny_model):
    model, panel = _panel(qtbot, two_gpus, tiny_model)
    model.set_plan(pl.Placement.single(model.plan.costs, "cpu:0"))
    panel.auto_btn.click()  # planned on a worker thread
    assert not panel.auto_btn.isEnabled() and panel.auto_btn.text().strip() == "Planning…"
    qtbot.waitUntil(lambda: panel.auto_btn.isEnabled(), timeout=5000)
    assert set(model.plan.devices_used()) <= {"cuda:0", "cuda:1"}
    with qtbot.waitSignal(panel.apply_requested, timeout=2000) as sig:
        panel.apply_btn.click()
    assert sig.args[0].assignment == model.plan.assignment
    assert sig.args[0] is not model.plan  # a copy: later edits do not change the applied plan


def test_context_and_kv_type_change_the_estimate(qtbot, two_gpus, tiny_model):
    model, panel = _panel(qtbot, two_gpus, tiny_model)
    kv_before = sum(b.kv_cache for b in model.bytes_per_device().values())
    panel.context.setValue(model.plan.context * 4)
    panel.context.editingFinished.emit()
    kv_after = sum(b.kv_cache for b in model.bytes_per_device().values())
    assert kv_after == 4 * kv_before > 0
    panel.kv_type.setCurrentText("q3")
    assert model.plan.kv_type == "q3"
    assert sum(b.kv_cache for b in model.bytes_per_device().values()) < kv_after


def test_plan_is_remembered_per_model(qtbot, two_gpus, tiny_model, make_bridge):
    from minecart.app.main_window import MainWindow
    from minecart.app.settings import Settings

    win = MainWindow(settings=Settings(), bridge=make_bridge(), devices=two_gpus, scan_defaults=False,
                     include_demo=False)
    qtbot.addWidget(win)
    win.select_model(tiny_model)
    qtbot.waitUntil(lambda: win.layer_model.plan is not None, timeout=10000)
    plan = pl.Placement.single(win.layer_model.plan.costs, "cuda:1")
    win.apply_plan(plan)
    # a new window (fresh settings read from disk) restores it for the same file
    win2 = MainWindow(settings=Settings(), bridge=make_bridge(), devices=two_gpus, scan_defaults=False,
                      include_demo=False)
    qtbot.addWidget(win2)
    win2.select_model(tiny_model)
    qtbot.waitUntil(lambda: win2.layer_model.plan is not None, timeout=10000)
    assert win2.layer_model.plan.assignment == ["cuda:1"] * len(plan.assignment)


def test_item_model_passes_qt_model_tester(qtmodeltester, two_gpus, tiny_model):
    model = LayerMapModel(two_gpus)
    plan, _ = initial_plan(_costs(tiny_model), two_gpus)
    model.set_plan(plan)
    qtmodeltester.check(model, force_py=True)
    model.move_parts([1, 2, 3], "cpu:0")  # still consistent after an edit
    qtmodeltester.check(model, force_py=True)


def test_auto_split_uses_the_fewest_devices_that_fit(two_gpus, tiny_model):
    """Cards of unknown speed (no profile): as few devices as hold the model, in the order given."""
    from dataclasses import replace

    from minecart.app.layer_map import auto_split_plan, device_spec

    costs = _costs(tiny_model)
    specs = [device_spec(d) for d in two_gpus]
    assert auto_split_plan(costs, specs).devices_used() == ["cuda:0"]  # fits on the first card
    # the first card too small for all of it: the second one joins, the CPU stays out
    one = pl.Placement.single(costs, "cuda:0").bytes_per_device()["cuda:0"].total
    # the first card cannot hold it all: the second card is brought in, the CPU stays out
    tight = [replace(specs[0], free_bytes=one - costs.weight_bytes // 2)] + specs[1:]
    plan = auto_split_plan(costs, tight)
    assert "cuda:1" in plan.devices_used() and "cpu:0" not in plan.devices_used()
    assert plan.is_contiguous() and not [i for i in pl.validate(plan, tight) if i.severity == "error"]
    # no card big enough: the CPU takes the rest
    tiny = [replace(s, free_bytes=int(one * 0.55)) if s.is_cuda else s for s in specs]
    assert "cpu:0" in auto_split_plan(costs, tiny).devices_used()


def test_layer_moves_undo_and_redo(qtbot, two_gpus, tiny_model):
    from PySide6.QtCore import Qt

    model, panel = _panel(qtbot, two_gpus, tiny_model)
    start = list(model.plan.assignment)
    n = len(start)
    assert model.move_parts([n - 2, n - 1], "cuda:1")
    moved = list(model.plan.assignment)
    assert f"moved layer {n - 3} and the LM head to cuda:1" in panel.hint.text()  # what it did, in words
    model.auto_split()
    view = panel.lanes[0].view
    panel.activateWindow()
    view.setFocus()
    qtbot.waitUntil(view.hasFocus, timeout=2000)
    qtbot.keyClick(view, Qt.Key.Key_Z, Qt.KeyboardModifier.ControlModifier)
    assert model.plan.assignment == moved
    qtbot.keyClick(view, Qt.Key.Key_Z, Qt.KeyboardModifier.ControlModifier)
    assert model.plan.assignment == start
    panel.redo_action.trigger()
    assert model.plan.assignment == moved
    assert not model.move_parts([n - 1], "cuda:1")  # no change: no undo step
    assert model.undo_stack.index() == 1
    model.set_plan(model.plan)  # another plan shown (a load): earlier edits are not undone into it
    assert not model.undo_stack.canUndo()


def test_leaving_a_card_out(qtbot, two_gpus, tiny_model):
    """A GPU's "Use" box: unticked, the card's layers move to the other devices at once (an Auto-split,
    one undo step) and later Auto-splits leave it out; the lane says so. The CPU has no such box.
    Dragging layers onto the card takes it back in."""
    model, panel = _panel(qtbot, two_gpus, tiny_model)
    model.set_plan(pl.Placement.single(model.plan.costs, "cuda:0"))
    lane = panel.lanes[0]
    assert lane.use is not None and lane.use.isChecked()
    assert panel.lanes[2].use is None  # the CPU
    lane.use.setChecked(False)
    assert model.excluded == {"cuda:0"}
    qtbot.waitUntil(lambda: panel.auto_btn.isEnabled() and "cuda:0" not in model.plan.devices_used(), timeout=5000)
    assert model.plan.devices_used() == ["cuda:1"]  # it fits the other card: the CPU stays out
    assert "left out" in panel.lanes[0].numbers.text()
    model.undo_stack.undo()  # the re-plan was one edit
    assert model.plan.devices_used() == ["cuda:0"] and model.excluded == {"cuda:0"}
    panel.auto_btn.click()
    qtbot.waitUntil(lambda: panel.auto_btn.isEnabled(), timeout=5000)
    assert "cuda:0" not in model.plan.devices_used()
    # by hand: the head dragged onto the card takes the card back in, and its box follows
    model.keep_contiguous = False
    assert model.move_parts([len(model.plan.assignment) - 1], "cuda:0")
    assert model.excluded == set() and panel.lanes[0].use.isChecked()
    assert not model.set_excluded("cpu:0", True) and "cpu:0" not in model.excluded


def test_cards_left_out_are_remembered_and_stay_out_of_a_new_plan(qtbot, two_gpus, tiny_model, make_bridge):
    from minecart.app.main_window import MainWindow
    from minecart.app.settings import Settings

    win = MainWindow(settings=Settings(), bridge=make_bridge(), devices=two_gpus, scan_defaults=False,
                     include_demo=False)
    qtbot.addWidget(win)
    win.layer_model.set_excluded("cuda:0", True)
    win.layers.contiguous.setChecked(False)
    # a new window (settings read from disk): the card is still out, the first plan avoids it
    win2 = MainWindow(settings=Settings(), bridge=make_bridge(), devices=two_gpus, scan_defaults=False,
                      include_demo=False)
    qtbot.addWidget(win2)
    assert win2.layer_model.excluded == {"cuda:0"} and not win2.layer_model.keep_contiguous
    # the download page's fit is judged on the devices a plan may use
    assert [d.id for d in win2.cockpit.download._devices()] == ["cuda:1", "cpu:0"]
    win2.select_model(tiny_model)
    qtbot.waitUntil(lambda: win2.layer_model.plan is not None, timeout=10000)
    assert "cuda:0" not in win2.layer_model.plan.devices_used()
    assert not win2.layers.lanes[0].use.isChecked()


def test_auto_split_takes_the_fastest_cards_that_fit():
    """Cards with profiles (a P104-100 listed first, a CMP 100-210 second): the 9B shape fits either
    alone, and Auto-split takes the plan the speed model says is fastest, the HBM2 card, where the
    first-card-first rule put it on the P104-100 at less than half the predicted decode speed. Left
    out, the CMP 100-210 is not used; the 27B shape, too big for either card, is split over both."""
    from minecart.app.layer_map import auto_split_plan
    from minecart.engine.devices import DeviceInfo
    from minecart.engine.placement import costs_for_shape

    gib = 1 << 30
    devs = [DeviceInfo(id="cuda:0", kind="cuda", name="NVIDIA P104-100", total_bytes=8 * gib, used_bytes=gib // 4,
                       free_bytes=8 * gib - gib // 4, compute_capability=(6, 1), source="nvml"),
            DeviceInfo(id="cuda:1", kind="cuda", name="NVIDIA CMP 100-210", total_bytes=16 * gib,
                       used_bytes=gib // 4, free_bytes=16 * gib - gib // 4, compute_capability=(7, 0), source="nvml"),
            DeviceInfo(id="cpu:0", kind="cpu", name="Test CPU", total_bytes=32 * gib, used_bytes=4 * gib,
                       free_bytes=28 * gib, extra={"threads": 8}, source="os")]
    model = LayerMapModel(devs)
    specs = model.auto_specs()
    assert all(s.speed is not None for s in specs if s.is_cuda)
    costs = costs_for_shape("qwen3.5-9b", "Q4_K")
    plan = auto_split_plan(costs, specs, context=8192, kv_type="f16")
    assert plan.devices_used() == ["cuda:1"]
    first = pl.Placement.single(costs, "cuda:0", context=8192, kv_type="f16")
    assert not [i for i in pl.validate(first, specs) if i.severity == "error"]  # it would have fitted
    assert pl.predict_speed(plan, specs).decode_tokens_per_s > 2 * pl.predict_speed(first, specs).decode_tokens_per_s
    model.excluded.add("cuda:1")
    assert auto_split_plan(costs, model.auto_specs(), context=8192, kv_type="f16").devices_used() == ["cuda:0"]
    big = auto_split_plan(costs_for_shape("qwen3.5-27b", "Q4_K"), specs, context=8192, kv_type="f16")
    assert {"cuda:0", "cuda:1"} <= set(big.devices_used())
    assert not [i for i in pl.validate(big, specs) if i.severity == "error"]
