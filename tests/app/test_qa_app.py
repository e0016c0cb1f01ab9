"""QA round for the window: bad input loses nothing.

- Picking a broken file while a model is loaded (real Runtime and NumPy engine on the fixture vision
  model): the runtime used to free the working model before it found the new file broken, and the chat
  came back "loaded" without the model's name or vision, so a dropped picture was refused.
- Settings with values of the wrong kind used to crash the chat page (a string in a spin box, an int
  beyond 32 bits); an unreadable settings file was overwritten by the next save.
- Conversation files of the wrong shape were listed and crashed the chat when opened.
- A new chat (or another conversation) while a reply streamed lost the question and the partial answer,
  and left the deleted reply widget queued for rendering: an exception on every render tick.
"""

from __future__ import annotations

import pytest
from minecart.app.main_window import MainWindow
from minecart.app.settings import Settings


@pytest.fixture
def vision_model(fixtures_dir):
    path = fixtures_dir / "vision" / "qwen35-tiny-vl-f16.gguf"
    if not path.is_file():
        pytest.skip("vision fixtures not found")
    return path


def test_a_broken_pick_keeps_the_loaded_model_and_its_vision(qtbot, vision_model, fixtures_dir, tmp_path):
    from minecart.app.engine_bridge import EngineBridge
    from minecart.engine.runtime import Runtime

    settings = Settings()
    settings["sampling"] = dict(settings["sampling"], max_tokens=3, temperature=0.0, seed=1)
    bridge = EngineBridge(runtime=Runtime(sample_memory_s=0))
    win = MainWindow(settings=settings, bridge=bridge, devices=None, scan_defaults=False, include_demo=False)
    qtbot.addWidget(win)
    try:
        with qtbot.waitSignal(bridge.loaded, timeout=120000):
            win.load(vision_model)
        chat = win.chat
        assert chat.model_loaded and chat.model_has_vision
        name = chat.model_name
        broken = tmp_path / "half-downloaded.gguf"
        broken.write_bytes(vision_model.read_bytes()[:4096])
        with qtbot.waitSignal(bridge.load_failed, timeout=60000):
            win.load(broken)
        assert win.status_model.text().startswith("Loading failed:")
        assert not any(m["role"] == "error" for m in chat.conv.messages)  # not in the transcript
        assert bridge.runtime.loaded
        assert chat.model_loaded and chat.model_has_vision and chat.model_name == name
        assert chat.model_path == str(vision_model)
        chat.settings_panel.max_tokens.setValue(3)
        chat.think_btn.setChecked(False)
        chat.attach_image(str(fixtures_dir / "vision" / "images" / "tiny_40x30.png"))
        chat.input.setPlainText("what is in the picture?")
        with qtbot.waitSignal(bridge.chat_done, timeout=120000) as done:
            chat.send()
        assert done.args[0]["usage"].image_tokens > 0  # the picture reached the tower
        assert chat.conv.messages[-1]["role"] == "assistant"
    finally:
        bridge.shutdown()


# -- settings and conversations that are not what the app wrote ------------------------------------


def test_settings_of_the_wrong_kind_fall_back_per_value_and_a_broken_file_is_kept(qtbot, tmp_path):
    import json

    from minecart.app.chat import ChatPanel

    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"sampling": {"temperature": "hot", "max_tokens": 10**12, "top_k": 7,
                                             "seed": 2**40},
                                "thinking": "yes", "system_prompt": 5, "model_folders": ["/m"]}))
    s = Settings(path)
    assert s["sampling"]["temperature"] == Settings(tmp_path / "none.json")["sampling"]["temperature"]
    assert s["sampling"]["top_k"] == 7 and s["model_folders"] == ["/m"]
    assert isinstance(s["thinking"], bool) and isinstance(s["system_prompt"], str)
    assert s["sampling"]["seed"] == 2**40
    panel = ChatPanel(_NoEngine(), s)  # a seed beyond 32 bits and a huge max_tokens are clamped
    qtbot.addWidget(panel)
    assert panel.settings_panel.max_tokens.value() == panel.settings_panel.max_tokens.maximum()
    assert panel.settings_panel.seed.value() == panel.settings_panel.seed.maximum()

    path.write_text('{"sampling": {"temperature": 0.3,}}')  # a hand edit with a trailing comma
    s = Settings(path)
    assert "using defaults" in s.load_error and "kept as" in s.load_error
    s.save()
    kept = tmp_path / "settings.json.broken"
    assert kept.read_text() == '{"sampling": {"temperature": 0.3,}}'


def test_conversation_files_of_the_wrong_shape_are_skipped(tmp_path):
    import json

    from minecart.app.conversations import Conversation, ConversationStore

    store = ConversationStore(tmp_path)
    good = Conversation(title="fine", messages=[{"role": "user", "content": "hi"}])
    store.save(good)
    for name, body in (("a", {"id": 5, "messages": []}), ("b", {"messages": "oops"}),
                       ("c", {"messages": [{"role": "user", "content": None}]}), ("d", [1, 2]),
                       ("e", {"messages": [["user", "hi"]]}), ("f", {"updated": "yesterday"})):
        (tmp_path / f"{name}.json").write_text(json.dumps(body))
    assert [c.title for c in store.list()] == ["fine"]


class _NoEngine:
    """The little of EngineBridge a ChatPanel reads when nothing runs."""

    generating = False
    model_info = None

    class _Signal:
        def connect(self, *_):
            pass

    def __getattr__(self, name):
        return self._Signal()


# -- leaving a chat mid-reply keeps it --------------------------------------------------------------


def _panel(qtbot, bridge):
    from minecart.app.chat import ChatPanel

    panel = ChatPanel(bridge, Settings())
    qtbot.addWidget(panel)
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        bridge.load("/nonexistent/fake.gguf")
    panel.set_model(True, "Scripted", False, "/nonexistent/fake.gguf")
    panel.think_btn.setChecked(False)
    return panel


def test_new_chat_mid_reply_keeps_the_question_and_the_partial_answer(qtbot, make_bridge, scripted):
    bridge = make_bridge(scripted(reply="a fairly long answer " * 20, token_delay=0.02))
    panel = _panel(qtbot, bridge)
    panel.input.setPlainText("my only question")
    panel.send()
    old_id = panel.conv.id
    assert panel.store.load(old_id).messages[0]["content"] == "my only question"  # saved at once
    qtbot.waitUntil(lambda: len(panel.conv.messages[-1].get("content", "")) > 6, timeout=10000)
    panel.new_chat()
    assert panel.conv.id != old_id and not panel.conv.messages
    kept = panel.store.load(old_id)
    assert [m["role"] for m in kept.messages] == ["user", "assistant"]
    assert kept.messages[1]["content"].startswith("a fair")
    qtbot.waitUntil(lambda: not bridge.generating, timeout=10000)
    panel.delete_chat()  # deleting is still deleting: nothing is saved back
    panel.open_conversation(old_id)
    assert old_id in [c.id for c in panel.store.list()]
    panel.conv = panel.store.load(old_id)
    panel.delete_chat()
    assert old_id not in [c.id for c in panel.store.list()]


def test_edit_and_regenerate_act_on_the_message_clicked_not_an_equal_earlier_one(qtbot, make_bridge,
                                                                                 scripted):
    bridge = make_bridge(scripted(reply="same answer"))
    panel = _panel(qtbot, bridge)
    for text in ("continue", "continue"):  # the same words twice, the same reply twice
        panel.input.setPlainText(text)
        with qtbot.waitSignal(bridge.chat_done, timeout=10000):
            panel.send()
    assert [m["role"] for m in panel.conv.messages] == ["user", "assistant"] * 2
    first_turn = panel.conv.messages[:2]
    with qtbot.waitSignal(bridge.chat_done, timeout=10000):
        panel._regenerate(panel.widgets[3])  # the second reply
    assert panel.conv.messages[:2] == first_turn and len(panel.conv.messages) == 4
    panel._edit(panel.widgets[2])  # the second question
    assert panel.conv.messages == first_turn and panel.input.toPlainText() == "continue"


def test_screenshot_of_a_broken_model_says_why_without_waiting_out_the_timeout(qtbot, tmp_path, capsys):
    import time

    from minecart.app.__main__ import main

    bad = tmp_path / "notes.gguf"
    bad.write_text("this file is a text note, not a model\n")
    out = tmp_path / "shot.png"
    t0 = time.monotonic()
    assert main(["--screenshot", str(out), "--model", str(bad), "--no-scan", "--timeout", "60"]) == 0
    assert time.monotonic() - t0 < 20  # was the full timeout plus 30 s for a layer plan
    err = capsys.readouterr().err
    assert "could not load the model" in err and "not a GGUF file" in err and out.is_file()


def test_send_while_loading_says_loading_and_keeps_the_message(qtbot, make_bridge, scripted, loader_factory,
                                                               tmp_path):
    import threading

    from minecart.app.chat import ChatPanel

    block = threading.Event()
    bridge = make_bridge(loader=loader_factory(scripted, steps=4, block=block))
    panel = ChatPanel(bridge, Settings())
    qtbot.addWidget(panel)
    panel.set_loading("Qwen3.5 9B")
    bridge.load(tmp_path / "x.gguf")
    panel.input.setPlainText("are you there?")
    panel.send()
    assert "Qwen3.5 9B is still loading" in panel.conv.messages[-1]["content"]
    assert panel.input.toPlainText() == "are you there?"
    panel.set_loading("")
    panel.send()
    assert "No model is loaded yet" in panel.conv.messages[-1]["content"]
    with qtbot.waitSignal(bridge.load_cancelled, timeout=10000):
        bridge.cancel_load()
