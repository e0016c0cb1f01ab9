"""The app's side of the engine: a QObject on the GUI thread that owns one engine Runtime and turns its
request events into Qt signals.

The Runtime (engine/runtime.py) runs the model on its own thread. For each request this bridge starts a
small QThread (`_Watcher`) that blocks on the request's event stream and re-emits every event as a
signal, which Qt queues to the GUI thread (tokens gathered for 25 ms into one signal). So the GUI thread never waits on the engine: it only calls
methods that return at once (`load`, `chat`, `stop`, `replace`) and reacts to signals. An engine exception
arrives as an "error" event and becomes `chat_error` / `load_failed`; the window shows it and keeps
working. A prompt beyond the loaded model's context limit becomes `context_full` instead (the chat
offers a new chat or a longer context), and `context_used` tells how many tokens of the context the
running chat holds (after each batch of tokens and at the end of a turn).

Not here: widgets, or any knowledge of how a model runs.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import TypedDict

from minecart.engine.errors import ContextFullError
from minecart.engine.metrics import RequestTiming
from minecart.engine.placement import DEFAULT_KV_TYPE
from minecart.engine.runtime import ModelInfo, Runtime, Usage
from minecart.engine.sampling import SamplingParams
from PySide6.QtCore import QObject, QThread, Signal


class _Watcher(QThread):
    """Reads one request's events on its own thread; each event becomes `event` (queued to the GUI).

    Tokens are gathered for up to BATCH_S and sent as one "token" event: an engine that streams
    thousands of tokens a second would otherwise queue thousands of signals, and the GUI thread
    works through queued signals in one go (a stall while the window cannot repaint)."""

    BATCH_S = 0.025

    event = Signal(object)
    failed = Signal(str)

    def __init__(self, handle, parent=None):
        super().__init__(parent)
        self.handle = handle

    def run(self) -> None:
        text: list[str] = []
        thinking: list[str] = []
        since = 0.0
        used = 0  # prompt + generated tokens after the newest token of the batch (0: not known)

        def flush() -> None:
            if text or thinking or used:
                self.event.emit(_Tokens("".join(text), "".join(thinking), used))
                text.clear()
                thinking.clear()

        try:
            while True:
                wait = None if not (text or thinking) else max(0.0, since + self.BATCH_S - time.monotonic())
                try:
                    ev = self.handle.get(wait)
                except TimeoutError:
                    flush()
                    continue
                if ev.kind == "token":
                    if not (text or thinking):
                        since = time.monotonic()
                    text.append(ev.text or "")
                    thinking.append(ev.thinking or "")
                    if ev.generation is not None:
                        used = ev.generation.prompt_tokens + ev.generation.generated_tokens
                    if time.monotonic() - since >= self.BATCH_S:
                        flush()
                    continue
                flush()
                self.event.emit(ev)
                if ev.terminal:
                    return
        except Exception as exc:  # a broken stream must not kill the app
            flush()
            self.failed.emit(f"{type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class _Tokens:
    """The text and thinking of the tokens that arrived within one batch, and the tokens the sequence
    holds after them (prompt + generated so far; 0 = not known)."""

    text: str
    thinking: str
    used: int = 0
    kind: str = "token"


class TurnEnd(TypedDict, total=False):
    """What `chat_done` and `chat_cancelled` carry: how the turn ended, its token counts and where
    its time went (None when the engine did not report them, e.g. a request that never ran)."""

    finish_reason: str | None
    usage: Usage | None
    timing: RequestTiming | None


# The chat settings' names (resources/default_settings.json, ChatPanel's SettingsPanel) and the
# SamplingParams field each one sets (engine/sampling.py).
SETTING_TO_FIELD = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repeat_penalty": "repetition_penalty", "max_tokens": "max_tokens", "seed": "seed"}


def sampling_params(settings: dict) -> SamplingParams:
    """The engine's SamplingParams from the app's sampling settings. A setting the engine does not
    know, or a value it refuses, raises ValueError with a message for the user: a setting is never
    dropped in silence."""
    unknown = sorted(set(settings) - set(SETTING_TO_FIELD))
    if unknown:
        raise ValueError(f"unknown sampling setting {', '.join(unknown)} (known: "
                         f"{', '.join(SETTING_TO_FIELD)})")
    values = {}
    for key, value in settings.items():
        if key == "seed" and (value is None or int(value) < 0):
            continue  # -1 in the settings: a new random seed each reply
        values[SETTING_TO_FIELD[key]] = value
    try:
        return SamplingParams(**values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the sampling settings are not usable: {exc}") from exc


class EngineBridge(QObject):
    """Qt face of the engine runtime. All methods return immediately; results come as signals."""

    load_progress = Signal(float, str)
    loaded = Signal(object)  # runtime ModelInfo
    load_failed = Signal(str)
    load_cancelled = Signal()
    token = Signal(str, str)  # answer delta, thinking delta
    chat_done = Signal(dict)  # a TurnEnd
    chat_error = Signal(str)
    chat_cancelled = Signal(dict)  # a TurnEnd
    context_full = Signal(int, int)  # tokens the turn needed, the loaded model's context limit
    context_used = Signal(int)  # tokens the running chat holds (prompt + answer so far)
    busy_changed = Signal(bool)

    def __init__(self, runtime=None, parent=None):
        super().__init__(parent)
        self.runtime = runtime
        self.runtime_error = ""
        if self.runtime is None:
            try:
                self.runtime = Runtime()
            except Exception as exc:
                self.runtime_error = f"the engine runtime could not start: {exc}"
        self._load = None
        self._chat = None
        self._watchers: set[_Watcher] = set()
        self.model_info: ModelInfo | None = None
        self.kv_type: str | None = None  # KV cache type of the loaded model (engine KV_TYPES); None: none loaded
        self._loading_kv_type = DEFAULT_KV_TYPE

    # ---- state -----------------------------------------------------------------------------------
    @property
    def metrics(self):
        return self.runtime.metrics if self.runtime is not None else None

    @property
    def loading(self) -> bool:
        return self._load is not None

    @property
    def generating(self) -> bool:
        return self._chat is not None

    @property
    def context_limit(self) -> int:
        """The most tokens a chat of the loaded model holds, prompt and answer (0: no model)."""
        info = self.model_info
        return int(info.context_limit) if info is not None else 0

    # ---- requests --------------------------------------------------------------------------------
    def _submit(self, slot: str, request, failed, on_event) -> bool:
        """Send `request()` to the runtime, keep its handle in `slot` ("_load" or "_chat") and watch
        its events with `on_event(handle, ev)`; a request refused at once goes to `failed`."""
        try:
            handle = request()
        except Exception as exc:
            failed.emit(str(exc))
            return False
        setattr(self, slot, handle)
        self.busy_changed.emit(True)
        self._watch(handle, lambda ev: on_event(handle, ev))
        return True

    def _watch(self, handle, on_event) -> None:
        w = _Watcher(handle, self)
        w.event.connect(on_event)
        w.failed.connect(lambda msg: on_event(_SyntheticError(msg)))
        w.finished.connect(lambda: self._watchers.discard(w))
        w.finished.connect(w.deleteLater)
        self._watchers.add(w)
        w.start()

    def load(self, path, placement=None, devices=None, kv_type: str | None = None) -> bool:
        """Load a model; kv_type: its KV cache type (engine KV_TYPES; None: the engine's default)."""
        if self.runtime is None:
            self.load_failed.emit(self.runtime_error or "the engine is not available")
            return False
        if self._chat is not None:
            self._chat.cancel()
        if self._load is not None:
            self._load.cancel()
        # always named: the type on screen is the type that runs, whatever the engine's default
        kv_type = kv_type or DEFAULT_KV_TYPE
        self._loading_kv_type = kv_type
        return self._submit("_load",
                            lambda: self.runtime.load(path, devices=devices, placement=placement,
                                                      kv_type=kv_type),
                            self.load_failed, self._on_load_event)

    def replace(self, placement) -> bool:
        """Apply a new placement to the loaded model (reloads through the runtime when needed)."""
        if self.runtime is None or not self.runtime.loaded:
            self.load_failed.emit("load a model before applying a layer plan")
            return False
        # the runtime re-places the model with the options it was loaded with: the KV type stays
        self._loading_kv_type = self.kv_type or DEFAULT_KV_TYPE
        return self._submit("_load", lambda: self.runtime.replace(placement), self.load_failed,
                            self._on_load_event)

    def cancel_load(self) -> None:
        if self._load is not None:
            self._load.cancel()

    def _on_load_event(self, handle, ev) -> None:
        if handle is not self._load:
            return  # a superseded load still draining its events
        kind = ev.kind
        if kind == "progress":
            self.load_progress.emit(float(ev.fraction or 0.0), ev.text or "")
        elif kind == "done":
            self._load = None
            info = (ev.data or {}).get("model") or self.runtime.model_info
            self.model_info = info
            self.kv_type = self._loading_kv_type
            self.busy_changed.emit(False)
            self.loaded.emit(info)
        elif kind in ("cancelled", "error"):
            self._load = None
            if not self.runtime.loaded:
                self.kv_type = None  # the failed load freed the model that was there
            self.busy_changed.emit(False)
            if kind == "cancelled":
                self.load_cancelled.emit()
            else:
                self.load_failed.emit(ev.text or "loading failed")

    def chat(self, messages: list[dict], sampling: dict | None = None, thinking: bool = False,
             conversation_id=None) -> bool:
        return self._submit_chat(lambda runtime: runtime.chat(
            messages, sampling_params(sampling or {}), enable_thinking=thinking, conversation_id=conversation_id))

    def complete(self, prompt: str, sampling: dict | None = None, conversation_id=None) -> bool:
        """Continue raw text without the chat template (base models); events as for chat."""
        return self._submit_chat(lambda runtime: runtime.complete(
            prompt, sampling_params(sampling or {}), conversation_id=conversation_id))

    def _submit_chat(self, request) -> bool:
        """Start `request(runtime)` as the chat's generation, cancelling the one running."""
        runtime = self.runtime
        if runtime is None:
            self.chat_error.emit(self.runtime_error or "the engine is not available")
            return False
        if self._chat is not None:
            self._chat.cancel()
        return self._submit("_chat", lambda: request(runtime), self.chat_error, self._on_chat_event)

    def stop(self) -> None:
        if self._chat is not None:
            self._chat.cancel()

    def _on_chat_event(self, handle, ev) -> None:
        if handle is not self._chat:
            return
        kind = ev.kind
        if kind == "token":
            if ev.text or ev.thinking:
                self.token.emit(ev.text or "", ev.thinking or "")
            if isinstance(ev, _Tokens) and ev.used:
                self.context_used.emit(ev.used)
            return
        if kind not in ("done", "cancelled", "error"):
            return
        self._chat = None
        self.busy_changed.emit(False)
        info: TurnEnd = {"finish_reason": ev.finish_reason, "usage": ev.usage,
                         "timing": (ev.data or {}).get("timing")}
        if ev.usage is not None and ev.usage.total_tokens:
            self.context_used.emit(ev.usage.total_tokens)
        if kind == "done":
            self.chat_done.emit(info)
        elif kind == "cancelled":
            self.chat_cancelled.emit(info)
        elif isinstance(ev.error, ContextFullError):
            self.context_full.emit(ev.error.needed, ev.error.limit)
        else:
            self.chat_error.emit(ev.text or "generation failed")

    def shutdown(self) -> None:
        for h in (self._chat, self._load):
            if h is not None:
                h.cancel()
        if self.runtime is not None:
            try:
                self.runtime.close(timeout=3.0)
            except Exception:
                traceback.print_exc()
        for w in list(self._watchers):
            w.wait(3000)


class _SyntheticError:
    """Stands in for an "error" event when reading the event stream itself failed."""

    kind = "error"
    finish_reason = "error"
    usage = None
    error = None
    data: dict = {}
    fraction = None
    thinking = ""

    def __init__(self, text: str):
        self.text = text
