"""The conversation store against hostile or damaged files: every read survives, a bad file is listed
as damaged, saves leave no temporary files behind and fsync the folder.

Each test failed before its fix: a file nested 100k deep raised RecursionError out of `list()` (the app
did not start), a message with an image list of numbers or a thinking of 5 loaded and raised later in Qt
handlers, temporary files of interrupted saves stayed forever, and the folder was not fsynced.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from minecart.app import conversations
from minecart.app.conversations import Conversation, ConversationStore


@pytest.fixture
def store(tmp_path):
    s = ConversationStore(tmp_path)
    s.save(Conversation(id="good", title="fine", messages=[
        {"role": "user", "content": "hi", "images": ["/tmp/a.png"]},
        {"role": "assistant", "content": "hello", "thinking": "hm", "stats": "3 tok/s"}]))
    return s


DAMAGED = {
    "deep": "[" * 100_000 + "]" * 100_000,
    "deep_object": '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "truncated": '{"id": "t", "messages": [{"role": "user", "con',
    "not_utf8": b'{"title": "\xff\xfe"}',
    "images_numbers": {"messages": [{"role": "user", "content": "x", "images": [1, 2]}]},
    "thinking_number": {"messages": [{"role": "assistant", "content": "x", "thinking": 5}]},
    "role_unknown": {"messages": [{"role": "wizard", "content": "x"}]},
    "content_missing": {"messages": [{"role": "user"}]},
    "field_unknown": {"messages": [{"role": "user", "content": "x", "html": "<b>"}]},
    "lone_surrogate": '{"title": "\\ud800"}',
    "title_number": {"title": 7},
    "updated_nan": '{"updated": NaN}',
    "id_empty": {"id": ""},
    "a_list": [1, 2],
}


def _write(folder, name, body):
    p = folder / f"{name}.json"
    if isinstance(body, bytes):
        p.write_bytes(body)
    elif isinstance(body, str):
        p.write_text(body)
    else:
        p.write_text(json.dumps(body))
    return p


def test_damaged_files_are_listed_as_damaged_never_fatal(store, tmp_path):
    for name, body in DAMAGED.items():
        _write(tmp_path, name, body)
    convs, damaged = store.scan()
    assert [c.id for c in convs] == ["good"]
    assert sorted(d.path.stem for d in damaged) == sorted(DAMAGED)
    reasons = {d.path.stem: d.reason for d in damaged}
    assert "nested too deeply" in reasons["deep"] and "truncated" in reasons["truncated"]
    assert "messages[0].images" in reasons["images_numbers"]
    assert "html" in reasons["field_unknown"]
    assert [c.id for c in store.list()] == ["good"]
    for name in DAMAGED:
        with pytest.raises(ValueError):
            store.load(name)


def test_a_huge_file_is_damaged_without_reading_it_whole(store, tmp_path, monkeypatch):
    monkeypatch.setattr(conversations, "MAX_FILE_BYTES", 1000)
    _write(tmp_path, "big", {"title": "x" * 5000})
    _, damaged = store.scan()
    assert [d.path.stem for d in damaged] == ["big"] and "MiB" in damaged[0].reason


def test_a_saved_conversation_round_trips_and_a_bad_one_is_not_written(store, tmp_path):
    conv = store.load("good")
    assert conv.messages[1]["thinking"] == "hm"
    conv.messages.append({"role": "user", "content": "x", "images": [3]})
    with pytest.raises(ValueError, match="images"):
        store.save(conv)
    assert store.load("good").messages == conv.messages[:2]  # the file on disk is the good one


def test_stale_temp_files_are_removed_when_the_store_opens(store, tmp_path):
    stale = tmp_path / ".good.json.abc123.tmp"
    fresh = tmp_path / ".good.json.def456.tmp"
    stale.write_text('{"id": "good", "mess')
    fresh.write_text("{")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    ConversationStore(tmp_path)
    assert not stale.exists() and fresh.exists()  # a young one may be another window's save
    assert [c.id for c in store.list()] == ["good"]


def test_save_fsyncs_the_folder_after_the_rename(store, tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    store.save(store.load("good"))
    assert synced[-1] == os.path.realpath(tmp_path)


def test_the_chat_panel_opens_over_a_folder_of_damaged_files(qtbot, make_bridge, tmp_path):
    from minecart.app.chat import ChatPanel
    from minecart.app.settings import Settings

    store = ConversationStore(tmp_path)
    store.save(Conversation(id="good", title="fine", messages=[{"role": "user", "content": "hi"}]))
    for name, body in DAMAGED.items():
        _write(tmp_path, name, body)
    panel = ChatPanel(make_bridge(), Settings(), store=store)  # raised RecursionError before
    qtbot.addWidget(panel)
    assert panel.conv_list.count() == 1
