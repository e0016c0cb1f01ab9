"""One real chat turn: the real Runtime loads the fixture GGUF (tiny random-weight Qwen3.5) with the
NumPy engine, the chat page streams the reply, and the metrics the graphs read get a request timing.
The weights are random, so the text is meaningless; what is checked is the path from the composer to
the engine and back."""

from __future__ import annotations

import pytest
from minecart.app.chat import ChatPanel
from minecart.app.engine_bridge import EngineBridge
from minecart.app.settings import Settings


def test_chat_turn_on_fixture_model(qtbot, tiny_model):
    pytest.importorskip("minecart.engine.model")
    from minecart.engine.runtime import Runtime

    bridge = EngineBridge(runtime=Runtime(sample_memory_s=0))
    try:
        settings = Settings()
        settings["sampling"] = dict(settings["sampling"], max_tokens=8, temperature=0.0, seed=1)
        panel = ChatPanel(bridge, settings)
        qtbot.addWidget(panel)
        panel.settings_panel.max_tokens.setValue(8)
        progress = []
        bridge.load_progress.connect(lambda f, t: progress.append(f))
        with qtbot.waitSignal(bridge.loaded, timeout=120000) as loaded:
            bridge.load(tiny_model)
        info = loaded.args[0]
        assert info.architecture == "qwen35" and progress
        panel.set_model(True, info.name, info.has_vision, info.path)
        panel.think_btn.setChecked(False)
        tokens = []
        bridge.token.connect(lambda a, t: tokens.append(a + t))
        panel.input.setPlainText("Hello")
        with qtbot.waitSignal(bridge.chat_done, timeout=120000) as done:
            panel.send()
        qtbot.wait(60)
        reply = panel.conv.messages[-1]
        assert reply["role"] == "assistant"
        assert len(tokens) >= 1 and "".join(tokens).strip()  # streamed, not delivered at once
        assert (reply["content"] + reply.get("thinking", "")).strip()
        usage = done.args[0]["usage"]
        assert 1 <= usage.completion_tokens <= 8
        timings = bridge.metrics.requests()
        assert timings and timings[-1].generated_tokens == usage.completion_tokens
        assert timings[-1].prompt_tokens > 0
    finally:
        bridge.shutdown()
