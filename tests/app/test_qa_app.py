"""QA round for the window: picking a broken file while a model is loaded loses nothing.

Real Runtime and NumPy engine on the fixture vision model (tiny Qwen3.5 + its mmproj, found beside it).
Before the fix the runtime freed the working model before it found out the new file was broken, and the
chat came back as "loaded" without the model's name or its vision, so a dropped picture was refused.
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
        assert "Could not load the model" in chat.conv.messages[-1]["content"]
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
