"""Conversations on disk: one JSON file per conversation in the user data folder, written atomically.

A conversation is plain data: id, title, model path, created/updated times, the system prompt, and
messages. A message has a fixed schema (MESSAGE_FIELDS): "role" (one of ROLES) and "content" strings,
optional "thinking" and "stats" strings, "images" (a list of file paths) and the chat view's transient
"_folded" flag. The chat widget edits these dicts; this module only stores, lists and deletes them.

Reading survives any file: a file that is not a conversation (wrong types, truncated JSON, nested
100k deep, larger than MAX_FILE_BYTES, not UTF-8) is reported by `scan()` as damaged and left alone,
never fatal. Saving writes a temporary file, renames it over the old one and fsyncs the folder; temporary
files left by an interrupted save are removed when the store opens. No Qt here.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .settings import atomic_write_text, data_dir

ROLES = ("system", "user", "assistant", "tool", "error", "notice")
# key -> the type its value must have; "images" is a list of strings
MESSAGE_FIELDS: dict[str, type] = {"role": str, "content": str, "thinking": str, "stats": str,
                                   "images": list, "_folded": bool}
# Conversations hold text and image paths (the pictures live in their own folder): a file past this
# is not one of ours, and reading it whole would only cost memory.
MAX_FILE_BYTES = 64 * 1024 * 1024
# A temporary file this old belongs to no save still running (a save takes milliseconds).
STALE_TMP_S = 60.0


@dataclass
class Conversation:
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    title: str = "New chat"
    model: str = ""
    system_prompt: str = ""
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    messages: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Conversation:
        """A conversation from its JSON; raises ValueError naming the field when the data is not one
        (wrong kinds of values from a hand edit or another program), so the store reports the file
        instead of the chat crashing on it later."""
        if not isinstance(d, dict):
            raise ValueError("a conversation file holds a JSON object")
        known = {k: d[k] for k in ("id", "title", "model", "system_prompt", "created", "updated", "messages") if k in d}
        for key in ("id", "title", "model", "system_prompt"):
            _check_text(known.get(key, ""), f"'{key}'")
        if not known.get("id", "x"):
            raise ValueError("'id' is empty")
        for key in ("created", "updated"):
            value = known.get(key, 0.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"'{key}' is not a number")
        messages = known.get("messages", [])
        if not isinstance(messages, list):
            raise ValueError("'messages' is not a list")
        known["messages"] = [check_message(m, i) for i, m in enumerate(messages)]
        return cls(**known)

    def auto_title(self) -> None:
        """Name a new chat after its first user message."""
        if self.title != "New chat":
            return
        for m in self.messages:
            if m.get("role") == "user" and m.get("content", "").strip():
                text = " ".join(m["content"].split())
                self.title = text[:48] + ("…" if len(text) > 48 else "")
                return


def check_message(m: Any, i: int = 0) -> dict:
    """`m` when it fits MESSAGE_FIELDS (role and content present, every key known and of its type);
    else ValueError naming the message and key."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ValueError(f"{where} is not an object")
    for key in ("role", "content"):
        if key not in m:
            raise ValueError(f"{where} has no '{key}'")
    for key, value in m.items():
        kind = MESSAGE_FIELDS.get(key)
        if kind is None:
            raise ValueError(f"{where} has an unknown field '{key}' (known: {', '.join(MESSAGE_FIELDS)})")
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ValueError(f"{where}.{key} is not a {kind.__name__}")
        if kind is str:
            _check_text(value, f"{where}.{key}")
    if m["role"] not in ROLES:
        raise ValueError(f"{where}.role is {str(m['role'])[:20]!r}, not one of {', '.join(ROLES)}")
    for path in m.get("images", []):
        _check_text(path, f"{where}.images")
    return m


def _check_text(value: Any, what: str) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{what} is not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate from a \\ud800 escape: Qt and saving choke on it
        raise ValueError(f"{what} holds text that is not valid Unicode ({exc.reason})") from None


@dataclass(frozen=True)
class DamagedFile:
    """A file in the conversations folder that is not a readable conversation, and why."""

    path: Path
    reason: str


class ConversationStore:
    def __init__(self, folder: Path | None = None):
        self.folder = Path(folder) if folder else data_dir() / "conversations"
        self.remove_stale_temp_files()

    def path_of(self, conv_id: str) -> Path:
        safe = "".join(c for c in conv_id if c.isalnum() or c in "-_")
        return self.folder / f"{safe}.json"

    def save(self, conv: Conversation) -> None:
        conv.updated = time.time()
        data = conv.to_dict()
        Conversation.from_dict(data)  # never write a file this store would call damaged
        atomic_write_text(self.path_of(conv.id), json.dumps(data, indent=1, ensure_ascii=False))
        _fsync_folder(self.folder)  # the rename itself survives a power cut

    def load(self, conv_id: str) -> Conversation:
        """The conversation saved under `conv_id`; OSError when it cannot be read, ValueError when
        the file is not a conversation (the message says why)."""
        return _read(self.path_of(conv_id))

    def scan(self) -> tuple[list[Conversation], list[DamagedFile]]:
        """(every readable conversation, newest first; every damaged file with its reason)."""
        out: list[Conversation] = []
        damaged: list[DamagedFile] = []
        if not self.folder.is_dir():
            return out, damaged
        for p in sorted(self.folder.glob("*.json")):
            try:
                out.append(_read(p))
            except (OSError, ValueError) as exc:
                damaged.append(DamagedFile(p, str(exc) or type(exc).__name__))
        return sorted(out, key=lambda c: c.updated, reverse=True), damaged

    def list(self) -> list[Conversation]:
        """Every readable conversation, newest first; damaged files are skipped (see `scan`)."""
        return self.scan()[0]

    def delete(self, conv_id: str) -> None:
        try:
            self.path_of(conv_id).unlink()
        except FileNotFoundError:
            pass

    def remove_stale_temp_files(self) -> int:
        """Delete the temporary files of saves that never finished (the app was killed mid-save);
        returns how many. Young ones are left: another window may be saving right now."""
        removed = 0
        try:
            candidates = list(self.folder.glob(".*.json.*.tmp"))
        except OSError:
            return 0
        now = time.time()
        for p in candidates:
            try:
                if now - p.stat().st_mtime > STALE_TMP_S:
                    p.unlink()
                    removed += 1
            except OSError:
                continue
        return removed


def _read(path: Path) -> Conversation:
    with open(path, "rb") as fh:
        raw = fh.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES // (1024 * 1024)} MiB: not a conversation file")
    try:
        data = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ValueError("nested too deeply to be a conversation") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON (truncated?): {exc}") from None
    try:
        return Conversation.from_dict(data)
    except RecursionError:
        raise ValueError("nested too deeply to be a conversation") from None


def _fsync_folder(folder: Path) -> None:
    if os.name == "nt":  # Windows cannot open a folder to fsync it; NTFS journals the rename
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
