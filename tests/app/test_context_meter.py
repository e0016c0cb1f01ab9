"""The chat and the context limit: the meter beside Send shows how much of the loaded model's context
the chat holds (following a streaming reply), and a turn beyond the limit gets a note with two ways
out: a new chat (carrying nothing) or a longer context (the window re-places the model, bounded by
what fits, and asks again). The first tests run the real engine (NumPy backend, the fixture GGUF)."""

from __future__ import annotations

import pytest
from minecart.app.chat import ChatPanel
from minecart.app.engine_bridge import EngineBridge
from minecart.app.main_window import MainWindow
from minecart.app.settings import Settings
from minecart.engine.errors import ContextFullError
from minecart.engine.placement import Placement, model_costs
from PySide6.QtWidgets import QApplication

TIMEOUT = 120000
LIMIT = 64


@pytest.fixture
def real_bridge(qapp):
    pytest.importorskip("minecart.engine.model")
    from minecart.engine.runtime import Runtime

    bridge = EngineBridge(runtime=Runtime(sample_memory_s=0))
    yield bridge
    bridge.shutdown()


def _plan(path, context: int) -> Placement:
    from minecart.engine.config import ModelConfig
    from minecart.engine.gguf_file import GGUFFile

    gf = GGUFFile(path)
    try:
        return Placement.single(model_costs(ModelConfig.from_gguf(gf), gf, layout="numpy"), "cpu:0",
                                context=context)
    finally:
        gf.close()


def _panel(qtbot, bridge, path):
    settings = Settings()
    settings["sampling"] = dict(settings["sampling"], max_tokens=6, temperature=0.0, seed=1)
    panel = ChatPanel(bridge, settings)
    qtbot.addWidget(panel)
    panel.resize(1100, 800)
    panel.show()
    with qtbot.waitSignal(bridge.loaded, timeout=TIMEOUT) as loaded:
        bridge.load(path, placement=_plan(path, LIMIT))
    info = loaded.args[0]
    panel.set_model(True, info.name, info.has_vision, info.path)
    panel.think_btn.setChecked(False)
    return panel


def _meter_numbers(panel) -> tuple[int, int]:
    used, limit = panel.context_meter.label.text().removesuffix(" tokens").split(" / ")
    return int(used.replace(",", "")), int(limit.replace(",", ""))


def test_the_meter_follows_a_turn_on_the_real_engine(qtbot, real_bridge, tiny_model):
    panel = _panel(qtbot, real_bridge, tiny_model)
    assert real_bridge.context_limit == LIMIT
    assert panel.context_meter.isVisibleTo(panel) and _meter_numbers(panel) == (0, LIMIT)
    seen: list[int] = []
    real_bridge.context_used.connect(seen.append)
    panel.input.setPlainText("Hello")
    with qtbot.waitSignal(real_bridge.chat_done, timeout=TIMEOUT) as done:
        panel.send()
    qtbot.wait(60)
    usage = done.args[0]["usage"]
    total = usage.prompt_tokens + usage.completion_tokens
    assert 0 < usage.prompt_tokens < total <= LIMIT
    # counted while streaming (batch by batch, never backwards) and at the end
    assert seen and seen == sorted(seen) and seen[-1] == total
    assert seen[0] > usage.prompt_tokens - 1
    assert _meter_numbers(panel) == (total, LIMIT)
    assert panel.context_meter.bar.value() == total and panel.context_meter.bar.maximum() == LIMIT
    assert f"{total:,} of the {LIMIT:,}" in panel.context_meter.toolTip()


def test_a_turn_beyond_the_limit_gets_a_note_with_two_ways_out(qtbot, real_bridge, tiny_model):
    panel = _panel(qtbot, real_bridge, tiny_model)
    before = real_bridge.runtime.metrics.requests()
    panel.input.setPlainText(" ".join(["word"] * 200))
    with qtbot.waitSignal(real_bridge.context_full, timeout=TIMEOUT) as full:
        panel.send()
    needed, limit = full.args
    assert limit == LIMIT and needed > LIMIT
    qtbot.wait(60)
    roles = [m["role"] for m in panel.conv.messages]
    assert roles == ["user", "notice"]  # no empty assistant reply, no engine error
    note = panel.context_notice
    assert note is not None and note is panel.widgets[-1]
    assert f"{needed:,} tokens" in note.message["content"] and f"at most {LIMIT:,}" in note.message["content"]
    assert [b.text() for b in note.actions] == ["Start a new chat", "Raise the limit"]
    assert all(b.isVisibleTo(panel) for b in note.actions)
    assert _meter_numbers(panel) == (needed, LIMIT)
    assert not real_bridge.generating and panel.send_btn.isVisibleTo(panel)
    assert len(real_bridge.runtime.metrics.requests()) == len(before)  # no token was computed
    # "Raise the limit" asks the window for a longer context for this many tokens
    with qtbot.waitSignal(panel.raise_context_requested, timeout=2000) as raised:
        note.actions[1].click()
    assert raised.args == [needed]
    # "Start a new chat" leaves this chat (saved) and opens an empty one
    old = panel.conv.id
    note.actions[0].click()
    assert panel.conv.id != old and panel.conv.messages == [] and panel.context_notice is None
    assert _meter_numbers(panel) == (0, LIMIT)
    assert any(c.id == old for c in panel.store.list())


def _window(qtbot, bridge, devices, context: int):
    settings = Settings()
    settings["context_length"] = context
    settings["sampling"] = dict(settings["sampling"], max_tokens=4, temperature=0.0, seed=1)
    win = MainWindow(settings=settings, bridge=bridge, devices=devices, scan_defaults=False,
                     include_demo=False)
    qtbot.addWidget(win)
    win.resize(1280, 800)
    win.show()
    return win


def _cpu_only(two_gpus):
    return [d for d in two_gpus if d.kind == "cpu"]


def test_raise_the_limit_re_places_the_model_and_asks_again(qtbot, real_bridge, tiny_model, two_gpus):
    win = _window(qtbot, real_bridge, _cpu_only(two_gpus), LIMIT)
    with qtbot.waitSignal(real_bridge.loaded, timeout=TIMEOUT):
        win.load(tiny_model)
    assert real_bridge.context_limit == LIMIT and win.layer_model.plan.context == LIMIT
    chat = win.chat
    chat.think_btn.setChecked(False)
    chat.input.setPlainText(" ".join(["word"] * 120))
    with qtbot.waitSignal(real_bridge.context_full, timeout=TIMEOUT) as full:
        chat.send()
    needed = full.args[0]
    assert LIMIT < needed < 1024
    qtbot.wait(60)
    # the re-place runs, then the same turn is asked again and answered
    with qtbot.waitSignals([real_bridge.loaded, real_bridge.chat_done], timeout=TIMEOUT, order="strict"):
        chat.context_notice.actions[1].click()
    qtbot.wait(60)
    assert real_bridge.context_limit == 1024 == win.layer_model.plan.context  # needed, rounded up
    assert [m["role"] for m in chat.conv.messages] == ["user", "assistant"]
    used, limit = _meter_numbers(chat)
    assert limit == 1024 and needed - 1 < used <= needed - 1 + 4


def test_raise_the_limit_opens_the_context_field_when_nothing_longer_fits(qtbot, make_bridge, scripted,
                                                                         two_gpus, tiny_model):
    class TooLong(scripted):
        def generate(self, prompt, params=None, session=None, cancel=None, enable_thinking=True,
                     **extras):
            raise ContextFullError("too long", needed=10**7, limit=4096, trained=262144)
            yield  # a generator, as the engine's

    def loader(path, devices=None, placement=None, progress=None, cancel=None, **options):
        model = TooLong(reply="ok")
        model.placement = placement
        model.device_plan = dict(zip(placement.parts, placement.assignment, strict=True))
        return model

    bridge = make_bridge(loader=loader)
    win = _window(qtbot, bridge, two_gpus, 4096)
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        win.load(tiny_model)
    win.chat.input.setPlainText("hi")
    with qtbot.waitSignal(bridge.context_full, timeout=10000):
        win.chat.send()
    qtbot.wait(60)
    before = win.layer_model.plan.context
    win.chat.context_notice.actions[1].click()
    qtbot.wait(60)
    assert win.stack.currentIndex() == 2  # the layers page
    field = win.layers.context
    assert field.lineEdit().selectedText() == str(field.value()) == "4096"  # ready to type over
    if QApplication.focusWindow() is not None:  # focus needs an active window (offscreen: maybe none)
        assert field.hasFocus() or field.lineEdit().hasFocus()
    assert "10,000,000 tokens" in win.statusBar().currentMessage()
    assert win.layer_model.plan.context == before and not bridge.loading  # nothing was changed
