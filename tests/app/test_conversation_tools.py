"""Conversation search, rename and export over a real ConversationStore in a temporary folder, and the
panel that reaches them."""

from __future__ import annotations

import json

import pytest
from minecart.app import conversation_tools as ct
from minecart.app.conversations import Conversation, ConversationStore


@pytest.fixture
def store(tmp_path):
    s = ConversationStore(tmp_path / "convs")
    convs = [
        Conversation(id="gpu1", title="Riser cables", model="/m/qwen-9b.gguf", system_prompt="Be brief.",
                     messages=[{"role": "user", "content": "Is a PCIe x1 riser too slow for llama?"},
                               {"role": "assistant", "content": "For a layer split the riser is fine.",
                                "thinking": "Hidden states are small."},
                               {"role": "notice", "content": "model reloaded"}]),
        Conversation(id="cook1", title="Soup", messages=[
            {"role": "user", "content": "A soup recipe with leeks"},
            {"role": "assistant", "content": "Leeks, potatoes, stock.", "images": ["/tmp/pics/soup.png"]}]),
        Conversation(id="gpu2", title="Fans", messages=[
            {"role": "user", "content": "Fan curve for a CMP 30HX riser rig with two risers"}]),
    ]
    for c in convs:
        s.save(c)
    return s


def test_search_words_rank_and_snippet(store):
    hits = ct.search(store.list(), "RISER")
    assert [h.conv_id for h in hits] == ["gpu1", "gpu2"]  # gpu1: 3 mentions (title too), gpu2: 2
    assert hits[0].matches == 3 and hits[1].matches == 2
    assert "riser" in hits[1].snippet.lower()
    assert [h.conv_id for h in ct.search(store.list(), "riser fan")] == ["gpu2"]  # every word
    assert [h.conv_id for h in ct.search(store.list(), "hidden states")] == ["gpu1"]  # thinking too
    assert ct.search(store.list(), "reloaded") == []  # the window's notices are not the chat
    assert {h.conv_id for h in ct.search(store.list(), "")} == {"gpu1", "gpu2", "cook1"}


def test_rename(store):
    ct.rename(store, "cook1", "  Leek   soup ")
    assert store.load("cook1").title == "Leek soup"
    with pytest.raises(ValueError, match="needs a title"):
        ct.rename(store, "cook1", "   ")
    with pytest.raises(ValueError, match="at most 120 characters"):
        ct.rename(store, "cook1", "x" * 121)
    with pytest.raises(FileNotFoundError):
        ct.rename(store, "nope", "title")


def test_export_markdown_and_json(store, tmp_path):
    conv = store.load("gpu1")
    md = ct.export(conv, tmp_path / "out" / "riser.md").read_text("utf-8")
    assert md.startswith("# Riser cables\n\n*model `qwen-9b.gguf` · created ")
    assert "## System\n\nBe brief.\n" in md
    assert "## User\n\nIs a PCIe x1 riser too slow for llama?\n" in md
    assert ("## Assistant\n\n<details><summary>Thinking</summary>\n\nHidden states are small.\n\n"
            "</details>\n\nFor a layer split the riser is fine.\n") in md
    assert "model reloaded" not in md
    soup = ct.to_markdown(store.load("cook1"))
    assert "![picture](/tmp/pics/soup.png)\n\nLeeks, potatoes, stock." in soup
    back = json.loads(ct.export(conv, tmp_path / "riser.JSON").read_text("utf-8"))
    assert Conversation.from_dict(back) == conv
    with pytest.raises(ValueError, match=r"name the file \.md \(Markdown\) or \.json"):
        ct.export(conv, tmp_path / "riser.txt")


def test_panel_search_rename_export_open(qtbot, store, tmp_path):
    from minecart.app.conversations_panel import ConversationsPanel

    panel = ConversationsPanel(store)
    qtbot.addWidget(panel)
    panel.resize(600, 500)
    panel.show()
    assert not panel.open_btn.isEnabled()
    panel.query.setText("riser")  # searched a moment after typing stops
    qtbot.waitUntil(lambda: panel.results.count() == 2, timeout=5000)
    assert panel.status.text() == "2 conversations mention 'riser'"
    panel.results.setCurrentRow(1)
    assert panel.selected_id() == "gpu2" and panel.rename_btn.isEnabled()
    with qtbot.waitSignal(panel.renamed) as sig:
        assert panel.rename_selected("Fan curves")
    assert sig.args == ["gpu2", "Fan curves"]
    qtbot.waitUntil(lambda: not panel.busy() and "Fan curves" in panel.results.currentItem().text(),
                    timeout=5000)
    assert store.load("gpu2").title == "Fan curves"
    assert not panel.rename_selected("")
    assert panel.status.text().startswith("Not renamed: a conversation needs a title")
    out = panel.export_selected(tmp_path / "fans.md")
    assert out.read_text("utf-8").startswith("# Fan curves\n")
    assert panel.export_selected(tmp_path / "fans.doc") is None
    assert "name the file .md" in panel.status.text()
    with qtbot.waitSignal(panel.open_requested) as sig:
        panel.open_btn.click()
    assert sig.args == ["gpu2"]
    panel.shutdown()
