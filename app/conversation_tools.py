"""Search, rename and export of saved conversations, as functions over the ConversationStore
(app/conversations.py).

- `search(conversations, query)`: every conversation whose title or messages hold all the query's words
  (case-insensitive), best first, each with a snippet around the first match;
- `rename(store, conv_id, title)`: a new title, checked and saved;
- `to_markdown(conv)` / `to_json(conv)` / `export(conv, path)`: a readable Markdown transcript or the full
  JSON, written atomically; the format follows the file's suffix.

Only the conversation itself is exported: the window's own notices and errors ("notice", "error" roles)
are not part of it. No Qt here; the Conversations panel (app/conversations_panel.py) calls these.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from .conversations import Conversation, ConversationStore
from .settings import atomic_write_text

MAX_TITLE = 120
SNIPPET_CHARS = 90
EXPORT_FORMATS = {".md": "markdown", ".markdown": "markdown", ".json": "json"}
TRANSCRIPT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Hit:
    conv_id: str
    title: str
    updated: float
    snippet: str  # the text around the first match ("" when only the title matched)
    matches: int  # how often the query's words occur in the whole conversation


def _texts(conv: Conversation) -> list[str]:
    out = [conv.system_prompt] if conv.system_prompt else []
    for m in conv.messages:
        if m.get("role") in TRANSCRIPT_ROLES:
            out.append(m.get("content") or "")
            out.append(m.get("thinking") or "")
    return [t for t in out if t]


def _snippet(text: str, at: int, length: int) -> str:
    start = max(0, at - SNIPPET_CHARS // 3)
    end = min(len(text), start + SNIPPET_CHARS + length)
    piece = " ".join(text[start:end].split())
    return ("…" if start else "") + piece + ("…" if end < len(text) else "")


def search(conversations: list[Conversation], query: str) -> list[Hit]:
    """Conversations holding every word of `query` in their title or messages; more matches first,
    then newer. An empty query matches everything (newest first)."""
    words = query.lower().split()
    hits = []
    for conv in conversations:
        texts = [conv.title, *_texts(conv)]
        lowered = [t.lower() for t in texts]
        if not all(any(w in t for t in lowered) for w in words):
            continue
        snippet = ""
        for text, low in zip(texts[1:], lowered[1:], strict=True):
            at = min((low.find(w) for w in words if w in low), default=-1)
            if at >= 0:
                snippet = _snippet(text, at, len(words[0]) if words else 0)
                break
        count = sum(t.count(w) for t in lowered for w in words)
        hits.append(Hit(conv.id, conv.title, conv.updated, snippet, count))
    return sorted(hits, key=lambda h: (-h.matches, -h.updated))


def rename(store: ConversationStore, conv_id: str, title: str) -> Conversation:
    """Give a saved conversation a new title; ValueError with the reason when the title is unusable."""
    title = " ".join(title.split())
    if not title:
        raise ValueError("a conversation needs a title; type at least one letter")
    if len(title) > MAX_TITLE:
        raise ValueError(f"a title has at most {MAX_TITLE} characters (this one has {len(title)})")
    conv = store.load(conv_id)
    conv.title = title
    store.save(conv)
    return conv


def to_markdown(conv: Conversation) -> str:
    """A transcript a person reads: title, model and date, then each turn under its speaker's name;
    thinking folds away in a <details> block; pictures are linked by their saved path."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(conv.created))
    lines = [f"# {conv.title}", ""]
    meta = [f"created {when}"]
    if conv.model:
        meta.insert(0, f"model `{Path(conv.model).name}`")
    lines += ["*" + " · ".join(meta) + "*", ""]
    if conv.system_prompt:
        lines += ["## System", "", conv.system_prompt, ""]
    for m in conv.messages:
        role = m.get("role")
        if role not in TRANSCRIPT_ROLES:
            continue
        lines += [f"## {role.capitalize()}", ""]
        if m.get("thinking"):
            lines += ["<details><summary>Thinking</summary>", "", m["thinking"].strip(), "", "</details>", ""]
        for image in m.get("images") or []:
            lines += [f"![picture]({Path(str(image)).as_posix()})", ""]
        lines += [(m.get("content") or "").rstrip(), ""]
    return "\n".join(lines).rstrip() + "\n"


def to_json(conv: Conversation) -> str:
    """The conversation as stored (the same object the store writes), indented."""
    return json.dumps(conv.to_dict(), indent=2, ensure_ascii=False) + "\n"


def export(conv: Conversation, path: str | Path) -> Path:
    """Write `conv` to `path` as Markdown (.md, .markdown) or JSON (.json)."""
    path = Path(path)
    fmt = EXPORT_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"cannot export to '{path.name}': name the file .md (Markdown) or .json (JSON)")
    try:
        atomic_write_text(path, to_markdown(conv) if fmt == "markdown" else to_json(conv))
    except OSError as exc:
        raise ValueError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return path


__all__ = ["Hit", "export", "rename", "search", "to_json", "to_markdown"]
