"""Chat page over a scripted model behind the real Runtime: streaming, thinking block, stop, regenerate,
edit and resend, system prompt, conversations saved and reopened, images with and without vision."""

from __future__ import annotations

import json

from minecart.app.chat import NO_VISION_TEXT, ChatPanel
from minecart.app.conversations import ConversationStore
from minecart.app.settings import Settings
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent, QImage
from PySide6.QtWidgets import QApplication


def _chat(qtbot, bridge, loaded=True, vision=False):
    panel = ChatPanel(bridge, Settings())
    qtbot.addWidget(panel)
    panel.resize(1100, 800)
    panel.show()
    if loaded:
        with qtbot.waitSignal(bridge.loaded, timeout=10000):
            bridge.load("/nonexistent/fake.gguf")
        panel.set_model(True, "Scripted", vision, "/nonexistent/fake.gguf")
    return panel


def _send(qtbot, panel, text):
    panel.input.setPlainText(text)
    with qtbot.waitSignal(panel.bridge.chat_done, timeout=10000):
        panel.send()
    qtbot.wait(60)  # one render tick


def test_streamed_reply_with_thinking_and_markdown(qtbot, make_bridge):
    panel = _chat(qtbot, make_bridge())
    panel.think_btn.setChecked(True)
    _send(qtbot, panel, "hi")
    user, reply = panel.conv.messages[-2:]
    assert user == {"role": "user", "content": "hi", "images": []}
    assert reply["content"] == "Hello **there**.\n\n```python\nprint(1)\n```"
    assert reply["thinking"] == "Let me think."
    w = panel.widgets[-1]
    assert w.thinking.isVisibleTo(panel) and "Thought" in w.thinking.toggle.text()
    w.thinking.toggle.click()  # collapsible
    assert w.thinking.body.isVisibleTo(panel) != (not w.thinking.expanded)
    assert "<b>there</b>" in w.body.text() and "<pre" in w.body.text()
    assert "tokens" in w.stats.text()
    assert not panel.stop_btn.isVisibleTo(panel) and panel.send_btn.isVisibleTo(panel)


def test_thinking_off_and_system_prompt_reach_the_engine(qtbot, make_bridge):
    bridge = make_bridge()
    panel = _chat(qtbot, bridge)
    panel.think_btn.setChecked(False)
    panel.settings_panel.system.setPlainText("Be terse.")
    _send(qtbot, panel, "question")
    prompt = bridge.fake_model.prompts[-1]
    assert prompt[0] == {"role": "system", "content": "Be terse."}
    assert prompt[-1] == {"role": "user", "content": "question"}
    assert panel.conv.messages[-1].get("thinking", "") == ""


def test_stop_keeps_partial_reply_and_chat_continues(qtbot, make_bridge, scripted):
    bridge = make_bridge(scripted(reply="x" * 600, token_delay=0.01))
    panel = _chat(qtbot, bridge)
    panel.think_btn.setChecked(False)
    panel.input.setPlainText("long please")
    panel.send()
    qtbot.waitUntil(lambda: len(panel.conv.messages[-1]["content"]) > 6, timeout=5000)
    assert panel.stop_btn.isVisibleTo(panel)
    with qtbot.waitSignal(bridge.chat_cancelled, timeout=5000):
        panel.stop_btn.click()
    partial = panel.conv.messages[-1]["content"]
    assert 0 < len(partial) < 600 and "stopped" in panel.conv.messages[-1]["stats"]
    bridge.fake_model.token_delay = 0
    bridge.fake_model.reply = "second"
    _send(qtbot, panel, "again")
    assert panel.conv.messages[-1]["content"] == "second"


def test_regenerate_and_edit_resend(qtbot, make_bridge):
    bridge = make_bridge()
    panel = _chat(qtbot, bridge)
    panel.think_btn.setChecked(False)
    _send(qtbot, panel, "first")
    bridge.fake_model.reply = "another answer"
    with qtbot.waitSignal(bridge.chat_done, timeout=10000):
        panel.widgets[-1].regen_btn.click()
    assert [m["role"] for m in panel.conv.messages] == ["user", "assistant"]
    assert panel.conv.messages[-1]["content"] == "another answer"
    # edit the user message: it comes back into the composer and replaces the turn
    panel.widgets[0].edit_btn.click()
    assert panel.input.toPlainText() == "first" and panel.conv.messages == []
    bridge.fake_model.reply = "edited reply"
    _send(qtbot, panel, "first, edited")
    assert [m["content"] for m in panel.conv.messages] == ["first, edited", "edited reply"]


def test_copy_puts_message_on_clipboard(qtbot, make_bridge):
    panel = _chat(qtbot, make_bridge())
    _send(qtbot, panel, "copy me")
    panel.widgets[-1].copy_btn.click()
    assert QApplication.clipboard().text() == panel.conv.messages[-1]["content"]


def test_conversations_saved_atomically_and_reopened(qtbot, make_bridge, private_dirs):
    bridge = make_bridge()
    panel = _chat(qtbot, bridge)
    _send(qtbot, panel, "remember this")
    conv_id = panel.conv.id
    store = ConversationStore()
    path = store.path_of(conv_id)
    saved = json.loads(path.read_text("utf-8"))
    assert saved["title"] == "remember this" and saved["messages"][0]["content"] == "remember this"
    assert not list(path.parent.glob("*.tmp"))  # no temp file left behind
    panel.new_chat()
    assert panel.conv.messages == [] and panel.conv_list.count() == 1
    panel.open_conversation(conv_id)
    assert panel.conv.id == conv_id
    assert [w.message["content"] for w in panel.widgets][0] == "remember this"
    # a second panel (a restarted app) lists it too
    other = ChatPanel(bridge, Settings())
    qtbot.addWidget(other)
    assert other.conv_list.count() == 1


def _image(tmp_path):
    img = QImage(40, 30, QImage.Format.Format_RGB32)
    img.fill(0x3366CC)
    p = tmp_path / "pic.png"
    assert img.save(str(p))
    return p


def _drop_image(panel, path):
    md = QMimeData()
    md.setUrls([QUrl.fromLocalFile(str(path))])
    ev = QDropEvent(QPointF(50, 50), Qt.DropAction.CopyAction, md, Qt.MouseButton.LeftButton,
                    Qt.KeyboardModifier.NoModifier)
    panel.dropEvent(ev)


def test_image_dropped_on_model_without_vision(qtbot, make_bridge, tmp_path):
    bridge = make_bridge()
    panel = _chat(qtbot, bridge, vision=False)
    _drop_image(panel, _image(tmp_path))
    assert len(panel.pending_images) == 1
    assert panel.attach_notice.isVisibleTo(panel) and "no vision tower" in panel.attach_notice.text()
    _send(qtbot, panel, "what is this?")
    roles = [m["role"] for m in panel.conv.messages]
    assert roles == ["user", "notice", "assistant"]
    assert panel.conv.messages[1]["content"] == NO_VISION_TEXT
    assert panel.conv.messages[0]["images"] == [str(tmp_path / "pic.png")]
    assert not panel.widgets[0].images_row.itemAt(0).widget().pixmap().isNull()  # thumbnail shown
    sent = bridge.fake_model.prompts[-1]
    assert sent[-1] == {"role": "user", "content": "what is this?"}  # text only: nothing broke


def test_image_goes_in_request_when_model_has_vision(qtbot, make_bridge, tmp_path, scripted):
    bridge = make_bridge(scripted(has_vision=True))
    panel = _chat(qtbot, bridge, vision=True)
    pic = _image(tmp_path)
    _drop_image(panel, pic)
    assert not panel.attach_notice.isVisibleTo(panel)
    _send(qtbot, panel, "describe")
    sent = bridge.fake_model.prompts[-1]
    assert sent[-1]["content"] == [{"type": "image", "path": str(pic)}, {"type": "text", "text": "describe"}]


def test_pasted_image_becomes_attachment(qtbot, make_bridge):
    panel = _chat(qtbot, make_bridge())
    img = QImage(20, 20, QImage.Format.Format_RGB32)
    img.fill(0xFF8800)
    md = QMimeData()
    md.setImageData(img)
    panel.input.insertFromMimeData(md)
    assert len(panel.pending_images) == 1 and panel.pending_images[0].endswith(".png")
    assert QImage(panel.pending_images[0]).width() == 20


def test_send_without_model_explains(qtbot, make_bridge):
    panel = _chat(qtbot, make_bridge(), loaded=False)
    panel.input.setPlainText("hello?")
    panel.send()
    assert panel.conv.messages[-1]["role"] == "notice" and "No model" in panel.conv.messages[-1]["content"]


def test_sampling_settings_reach_the_engine_params():
    from minecart.app.engine_bridge import sampling_params

    p = sampling_params({"temperature": 0.3, "top_p": 0.5, "top_k": 7, "min_p": 0.1, "repeat_penalty": 1.2,
                          "max_tokens": 99, "seed": -1})
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (0.3, 0.5, 7, 0.1, 99)
    assert p.repetition_penalty == 1.2 and p.seed is None  # -1 = random
    assert sampling_params({"seed": 5}).seed == 5


def test_regenerate_an_older_reply_drops_what_follows(qtbot, make_bridge):
    bridge = make_bridge()
    panel = _chat(qtbot, bridge)
    panel.think_btn.setChecked(False)
    _send(qtbot, panel, "one")
    _send(qtbot, panel, "two")
    bridge.fake_model.reply = "again"
    with qtbot.waitSignal(bridge.chat_done, timeout=10000):
        panel.widgets[1].regen_btn.click()  # the first reply
    assert [m["content"] for m in panel.conv.messages] == ["one", "again"]


def test_escape_stops_generation(qtbot, make_bridge, scripted):
    from PySide6.QtTest import QTest

    bridge = make_bridge(scripted(reply="y" * 600, token_delay=0.01))
    panel = _chat(qtbot, bridge)
    panel.input.setPlainText("go")
    panel.send()
    qtbot.waitUntil(lambda: len(panel.conv.messages[-1]["content"]) > 3, timeout=5000)
    panel.activateWindow()
    panel.input.setFocus()
    with qtbot.waitSignal(bridge.chat_cancelled, timeout=5000):
        QTest.keyClick(panel.input, Qt.Key.Key_Escape)


def test_deleted_chat_can_be_brought_back(qtbot, make_bridge, private_dirs):
    panel = _chat(qtbot, make_bridge())
    _send(qtbot, panel, "remember this")
    conv_id, messages = panel.conv.id, [dict(m) for m in panel.conv.messages]
    assert panel.store.path_of(conv_id).is_file()
    panel.delete_btn.click()
    assert not panel.store.path_of(conv_id).is_file() and panel.conv.id != conv_id
    assert panel.undo_bar.isVisibleTo(panel) and "remember this" in panel.undo_label.text()
    panel.undo_btn.click()
    assert panel.store.path_of(conv_id).is_file() and not panel.undo_bar.isVisibleTo(panel)
    assert panel.conv.id == conv_id and [m["content"] for m in panel.conv.messages] == [
        m["content"] for m in messages]
    # after a while the deleted chat is gone for good
    panel.delete_btn.click()
    panel._undo_timer.timeout.emit()
    assert not panel.undo_bar.isVisibleTo(panel)
    panel.undo_delete()
    assert not panel.store.path_of(conv_id).is_file()
