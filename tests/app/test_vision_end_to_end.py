"""A picture dropped on the chat reaches the vision tower: the real Runtime loads the fixture vision model
(tiny random-weight Qwen3.5 + its mmproj, found beside it) with the NumPy engine, the dropped image
goes out as an image part, the tower encodes it, and the reply's stats show the image tokens. A file
that is not a picture gives an error notice, and the next turn still works."""

from __future__ import annotations

import shutil

import pytest
from minecart.app.chat import ChatPanel
from minecart.app.engine_bridge import EngineBridge
from minecart.app.settings import Settings
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent


def _drop(panel, path):
    md = QMimeData()
    md.setUrls([QUrl.fromLocalFile(str(path))])
    panel.dropEvent(QDropEvent(QPointF(50, 50), Qt.DropAction.CopyAction, md, Qt.MouseButton.LeftButton,
                               Qt.KeyboardModifier.NoModifier))


def test_dropped_picture_reaches_the_tower(qtbot, fixtures_dir, tmp_path):
    vision = fixtures_dir / "vision"
    if not vision.is_dir():
        pytest.skip("vision fixtures not found")
    from minecart.engine.runtime import Runtime

    bridge = EngineBridge(runtime=Runtime(sample_memory_s=0))
    try:
        settings = Settings()
        settings["sampling"] = dict(settings["sampling"], max_tokens=4, temperature=0.0, seed=1)
        panel = ChatPanel(bridge, settings)
        qtbot.addWidget(panel)
        panel.settings_panel.max_tokens.setValue(4)
        with qtbot.waitSignal(bridge.loaded, timeout=120000) as loaded:
            bridge.load(str(vision / "qwen35-tiny-vl-f16.gguf"), devices=["cpu"])
        info = loaded.args[0]
        assert info.has_vision  # the mmproj beside the model was found
        panel.set_model(True, info.name, info.has_vision, info.path)
        pic = tmp_path / "native.png"
        shutil.copy(vision / "images" / "native_352x192.png", pic)
        _drop(panel, pic)
        assert panel.pending_images == [str(pic)] and not panel.attach_notice.isVisibleTo(panel)
        panel.input.setPlainText("Describe this image.")
        with qtbot.waitSignal(bridge.chat_done, timeout=120000) as done:
            panel.send()
        qtbot.wait(60)
        usage = done.args[0]["usage"]
        assert usage.image_tokens == 66 and usage.prompt_tokens > 66 + 5  # the app adds a system prompt
        assert "66 image tokens" in panel.widgets[-1].stats.text()
        # a broken picture: an error for this turn only
        bad = tmp_path / "broken.png"
        bad.write_bytes(pic.read_bytes()[:300])
        _drop(panel, bad)
        panel.input.setPlainText("and this?")
        with qtbot.waitSignal(bridge.chat_error, timeout=120000):
            panel.send()
        qtbot.wait(200)
        texts = " ".join(str(m.get("content", "")) for m in panel.conv.messages)
        assert "broken.png" in texts
        panel.input.setPlainText("plain text now")
        with qtbot.waitSignal(bridge.chat_done, timeout=120000):
            panel.send()
    finally:
        bridge.shutdown()
