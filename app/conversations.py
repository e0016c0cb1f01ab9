"""Conversations on disk: one JSON file per conversation in the user data folder, written atomically.

A conversation is plain data: id, title, model path, created/updated times, the system prompt, and
messages ({"role", "content", "thinking", "images", "stats"}). The chat widget edits these dicts; this
module only stores, lists and deletes them. No Qt here.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .settings import atomic_write_text, data_dir


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
    def from_dict(cls, d: dict) -> Conversation:
        """A conversation from its JSON; raises ValueError when the file is not one (wrong kinds of
        values from a hand edit or another program), so the store skips it instead of the chat
        crashing on it later."""
        if not isinstance(d, dict):
            raise ValueError("a conversation file holds a JSON object")
        known = {k: d[k] for k in ("id", "title", "model", "system_prompt", "created", "updated", "messages") if k in d}
        for key in ("id", "title", "model", "system_prompt"):
            if not isinstance(known.get(key, ""), str):
                raise ValueError(f"'{key}' is not a string")
        for key in ("created", "updated"):
            if isinstance(known.get(key, 0.0), bool) or not isinstance(known.get(key, 0.0), (int, float)):
                raise ValueError(f"'{key}' is not a number")
        messages = known.get("messages", [])
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content", ""), str) for m in messages):
            raise ValueError("'messages' is not a list of {role, content} objects")
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


class ConversationStore:
    def __init__(self, folder: Path | None = None):
        self.folder = Path(folder) if folder else data_dir() / "conversations"

    def path_of(self, conv_id: str) -> Path:
        safe = "".join(c for c in conv_id if c.isalnum() or c in "-_")
        return self.folder / f"{safe}.json"

    def save(self, conv: Conversation) -> None:
        conv.updated = time.time()
        atomic_write_text(self.path_of(conv.id), json.dumps(conv.to_dict(), indent=1, ensure_ascii=False))

    def load(self, conv_id: str) -> Conversation:
        return Conversation.from_dict(json.loads(self.path_of(conv_id).read_text("utf-8")))

    def list(self) -> list[Conversation]:
        """Every readable conversation, newest first; unreadable files are skipped, not fatal."""
        out = []
        if not self.folder.is_dir():
            return out
        for p in self.folder.glob("*.json"):
            try:
                out.append(Conversation.from_dict(json.loads(p.read_text("utf-8"))))
            except (OSError, ValueError, TypeError):
                continue
        return sorted(out, key=lambda c: c.updated, reverse=True)

    def delete(self, conv_id: str) -> None:
        try:
            self.path_of(conv_id).unlink()
        except FileNotFoundError:
            pass
