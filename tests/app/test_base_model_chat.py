"""A base (pretrained) model: the chat says so and sends the message as raw text to continue."""

from __future__ import annotations

from minecart.app.chat import ChatPanel
from minecart.app.settings import Settings


def _panel(qtbot, bridge, base_model):
    panel = ChatPanel(bridge, Settings())
    qtbot.addWidget(panel)
    panel.resize(1100, 800)
    panel.show()
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        bridge.load("/nonexistent/fake.gguf")
    panel.set_model(True, "Scripted", False, "/nonexistent/fake.gguf", base_model=base_model)
    return panel


def _send(qtbot, panel, text):
    panel.input.setPlainText(text)
    with qtbot.waitSignal(panel.bridge.chat_done, timeout=10000):
        panel.send()
    qtbot.wait(60)


def test_base_model_continues_raw_text(qtbot, make_bridge):
    bridge = make_bridge()
    panel = _panel(qtbot, bridge, base_model=True)
    assert panel.base_notice.isVisibleTo(panel) and "base model" in panel.base_notice.text()
    assert panel.complete_btn.isChecked()
    _send(qtbot, panel, "The capital of France is")
    prompt = bridge.fake_model.prompts[-1]
    # raw token ids of the text (no chat template, no roles)
    assert isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
    assert bridge.fake_model.tokenizer.decode(prompt) == "The capital of France is"
    assert panel.conv.messages[-1]["role"] == "assistant" and panel.conv.messages[-1]["content"]


def test_chat_model_uses_the_template(qtbot, make_bridge):
    bridge = make_bridge()
    panel = _panel(qtbot, bridge, base_model=False)
    assert not panel.base_notice.isVisibleTo(panel)
    assert not panel.complete_btn.isChecked()
    _send(qtbot, panel, "hello")
    assert bridge.fake_model.prompts[-1][-1] == {"role": "user", "content": "hello"}
