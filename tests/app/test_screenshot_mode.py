"""Screenshot mode runs in a throwaway profile: the user's settings file and conversation folder are
untouched by its prompt, its --max-tokens and its thinking switch, and the temporary profile is gone
afterwards. It can also show a saved conversation (the README's rendering picture)."""

from __future__ import annotations

import json
import os

from minecart.app.__main__ import main
from PySide6.QtGui import QImage


def _real_profile(tmp_path, monkeypatch):
    config, data = tmp_path / "real-config", tmp_path / "real-data"
    (data / "conversations").mkdir(parents=True)
    config.mkdir()
    settings = config / "settings.json"
    settings.write_text(json.dumps({"sampling": {"max_tokens": 2048}, "thinking": True}))
    monkeypatch.setenv("MINECART_CONFIG_DIR", str(config))
    monkeypatch.setenv("MINECART_DATA_DIR", str(data))
    monkeypatch.setenv("MINECART_SIMULATE_DEVICES", "Sim A:4,Sim B:2")
    return settings, data


def test_screenshot_with_a_prompt_leaves_the_user_profile_alone(qtbot, tiny_model, tmp_path, monkeypatch):
    settings, data = _real_profile(tmp_path, monkeypatch)
    before = settings.read_bytes()
    out = tmp_path / "shot-{view}.png"
    assert main(["--screenshot", str(out), "--view", "chat,layers", "--model", str(tiny_model), "--no-scan",
                 "--prompt", "Hello", "--max-tokens", "3", "--size", "960x700"]) == 0
    for view in ("chat", "layers"):
        img = QImage(str(tmp_path / f"shot-{view}.png"))
        assert (img.width(), img.height()) == (960, 700)
    assert settings.read_bytes() == before  # no max_tokens 3, no thinking off, no window size
    assert list((data / "conversations").iterdir()) == [] and sorted(p.name for p in data.iterdir()) == [
        "conversations"]
    assert os.environ["MINECART_CONFIG_DIR"] == str(settings.parent)  # the profile is restored


def test_screenshot_shows_a_saved_conversation(qtbot, tiny_model, tmp_path, monkeypatch):
    settings, data = _real_profile(tmp_path, monkeypatch)
    conv = tmp_path / "rendering.json"
    conv.write_text(json.dumps({"id": "render1", "title": "Rendering", "messages": [
        {"role": "user", "content": "Show me some Markdown"},
        {"role": "assistant", "content": "Some **bold** text and code:\n\n```python\nprint(1)\n```",
         "thinking": "The user wants Markdown."}]}))
    out = tmp_path / "chat.png"
    assert main(["--screenshot", str(out), "--view", "chat", "--model", str(tiny_model), "--no-load",
                 "--no-scan", "--conversation", str(conv), "--size", "960x700"]) == 0
    assert QImage(str(out)).width() == 960
    assert list((data / "conversations").iterdir()) == []
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["--screenshot", str(out), "--view", "chat", "--no-load", "--no-scan",
                 "--conversation", str(bad)]) == 2
