"""Runtime: one worker thread owns the loaded model; clients send requests and read events back.

Every client (the desktop app's Qt worker, the HTTP server, the CLI) talks to the model through one
`Runtime`. A request goes onto a queue together with its own reply queue; the worker thread takes requests
one at a time (so generations are serialized and the model, its sessions and its device memory are only
ever touched from that thread) and streams `RuntimeEvent`s back. A client gets a `RequestHandle` at once:
it iterates the events (blocking, with a timeout) and may `cancel()` at any moment. Cancellation is a
`threading.Event` the engine polls between tokens, so it works while a generation is running without the
worker having to read its queue.

Every request ends with exactly one terminal event: "done", "error" or "cancelled". Engine exceptions
become "error" events (the worker thread never dies); a cancelled generation leaves its conversation's
session usable for the next turn.

Requests: load (path, devices, placement; "progress" events, cancellable), unload, chat (messages with
text and image parts, tools; turned into tokens by engine/prompt.py, which by default gives a
pretrained base model the plain text of the messages instead of a chat template) and completion (raw
prompt text or token ids), re-place (apply a new placement), forget a conversation. The model is
anything with the `RuntimeModel` interface (engine.model.Model; the tests' fakes). Conversations: a `conversation_id` maps to one model session, so the
next turn of that chat reuses the cached prefix; sessions are kept in LRU order, at most `max_sessions`.

This module does not render HTTP or terminal output, and does not parse tool calls: clients do that.
It does split a reply into thinking and answer text (`<think>...</think>`), because all clients need it.
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .chat_template import THINK_CLOSE, THINK_OPEN
from .errors import GenerationCancelled, MinecartError, RequestError
from .generation import GenerationEvent, StopStrings, partial_suffix
from .metrics import Metrics, RequestTiming
from .prefix_cache import PrefixCache
from .prompt import (
    PromptInput,
    PromptMode,
    PromptModel,
    check_prompt_mode,
    has_images,
    render_prompt,
)
from .sampling import SamplingParams
from .scheduler import QueueFull, Scheduler
from .session import Session, context_limit

TERMINAL_KINDS = frozenset({"done", "error", "cancelled"})
GENERATION_KINDS = frozenset({"chat", "completion"})  # run concurrently when the runtime batches
EVENT_KINDS = frozenset({"started", "progress", "token"}) | TERMINAL_KINDS

_request_ids = itertools.count(1)


# ---------------------------------------------------------------------------------------------------
# Events and handles


@dataclass(frozen=True)
class Usage:
    """Token counts and speeds of one generation."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    cached_tokens: int = 0  # prompt tokens reused from the session (prefix reuse)
    image_tokens: int = 0  # prompt tokens that are picture embeddings (vision models)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class RuntimeEvent:
    """One event of one request.

    kind:     "started" (the worker picked the request up), "progress" (loading: `fraction`, `text`),
              "token" (generation: `text` = answer delta, `thinking` = reasoning delta, either may be
              ""), or a terminal kind: "done", "error" (`text` = message, `error` = exception),
              "cancelled".
    usage, finish_reason: on the terminal event of a generation ("stop", "length", "cancelled").
    generation: the engine's GenerationEvent behind a "token" event (token id, raw text, counters).
    data:     extra facts: the model info after a load, the RequestTiming after a generation.
    """

    kind: str
    request_id: int
    text: str = ""
    thinking: str = ""
    fraction: float | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    generation: GenerationEvent | None = None
    error: BaseException | None = None
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.kind in TERMINAL_KINDS


@dataclass
class _Request:
    kind: str  # "load", "unload", "chat", "completion", "replace", "forget"
    args: dict[str, Any]
    id: int = field(default_factory=lambda: next(_request_ids))
    replies: queue.Queue[RuntimeEvent] = field(default_factory=queue.Queue)
    cancel_event: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.time)
    picked_up: float | None = None  # when the worker thread took it off the queue
    finished: bool = False
    ended_as: str = ""  # the terminal event's kind once finished ("done", "error", "cancelled")
    lock: threading.Lock = field(default_factory=threading.Lock)

    def emit(self, kind: str, **kwargs: Any) -> None:
        with self.lock:
            if self.finished:
                return
            if kind in TERMINAL_KINDS:
                self.finished = True
                self.ended_as = kind
            self.replies.put(RuntimeEvent(kind, self.id, **kwargs))

    def cancel(self) -> None:
        """Set the cancel flag; a request still waiting in the queue ends at once (its client need
        not wait for the generation ahead of it), one that runs ends when the engine notices."""
        with self.lock:
            self.cancel_event.set()
            if self.picked_up is None and not self.finished:
                self.finished = True
                self.replies.put(RuntimeEvent("cancelled", self.id, finish_reason="cancelled"))

    def pick_up(self) -> bool:
        """Called by the worker: False when the request was cancelled while it waited."""
        with self.lock:
            if self.finished or self.cancel_event.is_set():
                return False
            self.picked_up = time.time()
            return True


class RequestHandle:
    """The client's side of one request: read its events, cancel it."""

    def __init__(self, request: _Request, runtime: Runtime):
        self._request = request
        self._runtime = runtime
        self._final: RuntimeEvent | None = None

    @property
    def id(self) -> int:
        return self._request.id

    @property
    def kind(self) -> str:
        return self._request.kind

    @property
    def final(self) -> RuntimeEvent | None:
        """The terminal event, once it has been read."""
        return self._final

    @property
    def done(self) -> bool:
        return self._final is not None

    def cancel(self) -> None:
        """Ask the engine to stop this request; its terminal event will be "cancelled" (or "done" if
        it finished first). Safe from any thread, any number of times."""
        self._request.cancel()

    @property
    def cancelled(self) -> bool:
        return self._request.cancel_event.is_set()

    def get(self, timeout: float | None = None) -> RuntimeEvent:
        """The next event; raises TimeoutError if none arrives within `timeout` seconds, and
        RuntimeError once the terminal event was already read."""
        if self._final is not None:
            raise RuntimeError(f"request {self.id} already ended with '{self._final.kind}'")
        try:
            event = self._request.replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(
                f"request {self.id} ({self.kind}): no event within {timeout} s"
            ) from None
        if event.terminal:
            self._final = event
        return event

    def poll(self) -> RuntimeEvent | None:
        """The next event if one is waiting, else None (for GUI timers)."""
        if self._final is not None:
            return None
        try:
            event = self._request.replies.get_nowait()
        except queue.Empty:
            return None
        if event.terminal:
            self._final = event
        return event

    def events(self, timeout: float | None = None) -> Iterator[RuntimeEvent]:
        """Iterate events up to and including the terminal one. `timeout` bounds the wait for each
        event (TimeoutError); None waits forever."""
        while self._final is None:
            yield self.get(timeout)

    __iter__ = events

    def wait(self, timeout: float | None = None) -> RuntimeEvent:
        """Drain the events and return the terminal one (`timeout` bounds each wait)."""
        for _ in self.events(timeout):
            pass
        assert self._final is not None
        return self._final

    def result(self, timeout: float | None = None) -> RuntimeEvent:
        """Like wait(), but raise the engine's error (or GenerationCancelled) instead of returning it."""
        final = self.wait(timeout)
        if final.kind == "error":
            raise final.error if final.error is not None else MinecartError(final.text)
        if final.kind == "cancelled":
            raise GenerationCancelled(f"request {self.id} ({self.kind}) was cancelled")
        return final


# ---------------------------------------------------------------------------------------------------
# Thinking / answer split


class ThinkingSplitter:
    """Splits streamed text into (thinking, answer) at `<think>` / `</think>`, holding back a partial tag
    that a later delta may complete. `inside=True` when the prompt already opened `<think>` (Qwen3.5's
    generation prompt ends with "<think>\\n"). An opening tag is only honoured before any answer text,
    so an answer that talks about the tag is left alone."""

    def __init__(self, inside: bool = False):
        self.inside = inside
        self._pending = ""
        self._answer_started = False  # once answer text (or a closed think block) came, no reopening
        self._thinking_started = False
        self._strip_newlines = False  # drop the blank lines the template puts after </think>

    def feed(self, delta: str) -> tuple[str, str]:
        text = self._pending + delta
        self._pending = ""
        thinking: list[str] = []
        answer: list[str] = []
        while text:
            if self.inside:
                cut = text.find(THINK_CLOSE)
                if cut >= 0:
                    thinking.append(text[:cut])
                    text = text[cut + len(THINK_CLOSE) :]
                    self.inside = False
                    self._answer_started = True
                    self._strip_newlines = True
                    continue
                keep = partial_suffix(text, THINK_CLOSE)
                thinking.append(text[: len(text) - keep])
                self._pending = text[len(text) - keep :]
                break
            if self._strip_newlines:
                text = text.lstrip("\n")
                if not text:
                    break
                self._strip_newlines = False
            if not self._answer_started:
                stripped = text.lstrip()
                if stripped.startswith(THINK_OPEN):
                    text = stripped[len(THINK_OPEN) :]
                    self.inside = True
                    continue
                if THINK_OPEN.startswith(stripped):  # maybe the start of "<think>"
                    self._pending = text
                    break
            self._answer_started = True
            answer.append(text)
            break
        think_text = "".join(thinking)
        if not self._thinking_started and think_text:
            think_text = think_text.lstrip("\n")  # "<think>\n" leaves a newline before the thoughts
            self._thinking_started = bool(think_text)
        return think_text, "".join(answer)

    def flush(self) -> tuple[str, str]:
        """Whatever is held back, at the end of the stream."""
        rest, self._pending = self._pending, ""
        if not rest:
            return "", ""
        return (rest, "") if self.inside else ("", rest)


# ---------------------------------------------------------------------------------------------------
# The runtime


class ConfigInfo(Protocol):
    """The model config fields the runtime reports (engine.config.ModelConfig has them)."""

    @property
    def name(self) -> str: ...

    @property
    def architecture(self) -> str: ...

    @property
    def context_length(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...  # rows of the token embedding (prompt.py checks token ids)


class RuntimeSession(Protocol):
    """A model session as the runtime holds it: it only frees it (engine.session.Session)."""

    def close(self) -> None: ...


class RuntimeModel(PromptModel, Protocol):
    """What the runtime needs from a loaded model: engine.model.Model has it; so do the tests' fakes."""

    @property
    def config(self) -> ConfigInfo: ...

    @property
    def vision(self) -> object | None: ...  # the vision tower, when the model reads pictures

    @property
    def device_plan(self) -> Mapping[str, str]: ...  # part -> device in use

    @property
    def placement(self) -> Any: ...

    def new_session(self) -> RuntimeSession: ...

    def generate(self, prompt: PromptInput, params: SamplingParams | None = None,
                 session: Any = None, cancel: threading.Event | None = None,
                 enable_thinking: bool = True, **prompt_extras: Any) -> Iterator[GenerationEvent]:
        """prompt_extras: tools (messages with pictures), turn_boundary (see generation.generate)."""
        ...

    def reload_placement(self, placement: Any, *, progress: Progress | None = None,
                         cancel: threading.Event | None = None) -> None: ...

    def close(self) -> None: ...


Progress = Callable[[float, str], None]
Loader = Callable[..., RuntimeModel]  # (path, devices=, placement=, progress=, cancel=, **options)


@dataclass(frozen=True)
class ModelInfo:
    """What clients may know about the loaded model without touching it."""

    path: str
    name: str
    architecture: str
    context_length: int
    devices: tuple[str, ...]
    placement: Any = None
    has_vision: bool = False
    base_model: bool = False  # pretrained, not instruction-tuned: it continues text
    # the most tokens one sequence holds, prompt and answer (engine/session.py context_limit: the
    # planned context, at most context_length); 0 = not known (a ModelInfo made by hand)
    context_limit: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "name": self.name,
            "architecture": self.architecture,
            "context_length": self.context_length,
            "context_limit": self.context_limit,
            "devices": list(self.devices),
            "has_vision": self.has_vision,
            "base_model": self.base_model,
        }


def _default_loader(path: str, devices: list[str] | None = None, placement: Any = None,
                    progress: Progress | None = None, cancel: threading.Event | None = None,
                    **options: Any) -> RuntimeModel:
    from .model import load_model  # the runtime imports without the whole engine (tests, the app)

    # options: mmproj= / max_image_tokens= / kv_type= / experts=, only those that were given
    return load_model(path, devices=devices, placement=placement, progress=progress, cancel=cancel,
                      **options)


_SHUTDOWN = object()


class Runtime:
    """Owns one worker thread and (at most) one loaded model. Methods return a RequestHandle at once.

    `loader(path, devices=, placement=, progress=, cancel=)` builds the model; the default is
    engine.model.load_model (tests pass a fake). `metrics` receives timings and rates (a new Metrics
    when None); `sample_memory_s` > 0 starts its memory sampler.

    parallel > 1 batches generations (engine/scheduler.py, with a prefix cache shared by one-off
    requests): each chat or completion runs on a thread of its own, up to `parallel` at once, up to
    `max_queue` more waiting; past that chat() and complete() raise QueueFull at once. Load, unload and
    re-place still run one at a time on the worker thread (they end the running generations first).
    """

    def __init__(
        self,
        loader: Loader | None = None,
        metrics: Metrics | None = None,
        max_sessions: int = 4,
        sample_memory_s: float = 0.5,
        parallel: int = 1,
        max_queue: int = 16,
    ):
        self._loader: Loader = loader or _default_loader
        self.metrics = metrics if metrics is not None else Metrics()
        self.max_sessions = max(1, int(max_sessions))
        self._queue: queue.Queue[_Request | object] = queue.Queue()
        self._lock = threading.Lock()
        self._live: dict[int, _Request] = {}  # submitted and not yet finished
        self._model: RuntimeModel | None = None  # only the worker thread touches these two
        self._sessions: OrderedDict[Any, RuntimeSession] = OrderedDict()
        self._model_info: ModelInfo | None = None
        self._load_args: dict[str, Any] | None = None
        self._current: _Request | None = None
        self.parallel = max(1, int(parallel))
        self.max_queue = max(0, int(max_queue))
        self._scheduler: Scheduler | None = None  # set while a model is loaded and parallel > 1
        self._busy_sessions: set[int] = set()  # ids of conversation sessions a generation is using
        self._generation_threads: set[threading.Thread] = set()
        self.state_version = 0  # bumps when the loaded model changes (GUI timers compare it)
        self._closed = False
        self._thread = threading.Thread(target=self._worker, name="minecart-runtime", daemon=True)
        self._thread.start()
        if sample_memory_s and sample_memory_s > 0:
            self.metrics.start_sampler(sample_memory_s)

    # -- client API (any thread) ---------------------------------------------------------------------

    def load(self, path: str | Path, devices: list[str] | None = None, placement: Any = None, *,
             mmproj: str | Path | bool | None = None, max_image_tokens: int | None = None,
             kv_type: str | None = None, experts: str | None = None,
             context: int | None = None, cpu_weights: str | None = None) -> RequestHandle:
        """Load a GGUF model (replacing the current one). Events: "progress"..., then "done" with
        data["model"] = ModelInfo. mmproj: the vision projector file (default: found beside the
        model; False: none); max_image_tokens: cap per picture (engine/vision); kv_type: KV cache
        type ("f32" default, "q3": 3-bit, engine/kvquant.py); experts: the device of an MoE model's
        routed experts ("cpu:0" = host RAM; engine/experts.py), default with their layers; context:
        the context limit in tokens (load_model(context=); default the placement's); cpu_weights: how a
        model on the CPU alone holds its weights (load_model(cpu_weights=): "float32" or "stored")."""
        options = {k: v for k, v in (("mmproj", mmproj), ("max_image_tokens", max_image_tokens),
                                    ("kv_type", kv_type), ("experts", experts),
                                    ("context", context), ("cpu_weights", cpu_weights)) if v is not None}
        return self._submit("load", path=str(path), devices=devices, placement=placement, **options)

    def unload(self) -> RequestHandle:
        return self._submit("unload")

    def chat(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        enable_thinking: bool = True,
        conversation_id: Any = None,
        tools: list[dict[str, Any]] | None = None,
        stop: list[str] | None = None,
        chat_template: PromptMode = "auto",
    ) -> RequestHandle:
        """Generate the assistant's reply to `messages` (OpenAI-style dicts; content a string or a list
        of parts {"type": "text"|"image_url"|"image", ...}, passed through to the model). Give the same
        `conversation_id` on every turn of a chat to reuse its cached prefix. `stop` strings end the
        answer (not the thinking) early and are not included.

        chat_template: "auto" (default) sends a pretrained base model the plain text of the messages
        to continue and every other model its chat template; "on" forces the template, "off" plain
        text (engine/prompt.py). The terminal event's data["prompt"] says which was used ("chat" or
        "text")."""
        if not isinstance(messages, list) or not messages:
            raise RequestError("chat needs a non-empty list of messages")
        return self._submit(
            "chat",
            messages=[_with_valid_text(m) for m in messages],
            params=params,
            enable_thinking=bool(enable_thinking),
            conversation_id=conversation_id,
            tools=tools or None,
            stop=list(stop or []),
            chat_template=check_prompt_mode(chat_template),
        )

    def complete(
        self, prompt: str | list[int], params: SamplingParams | None = None, *,
        conversation_id: Any = None, stop: list[str] | None = None
    ) -> RequestHandle:
        """Continue raw `prompt` text (or a list of token ids) without the chat template."""
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            raise RequestError("a completion needs a prompt string or a non-empty list of token ids")
        return self._submit(
            "completion",
            prompt=valid_unicode(prompt) if isinstance(prompt, str) else prompt,
            params=params,
            conversation_id=conversation_id,
            stop=list(stop or []),
        )

    def replace(self, placement: Any) -> RequestHandle:
        """Apply a new placement to the loaded model (sessions are dropped)."""
        return self._submit("replace", placement=placement)

    def set_parallel(self, parallel: int, max_queue: int | None = None) -> RequestHandle:
        """Change how many generations run at once (and, given, how many may wait). Runs in order with
        load and unload, after the generations already running, which finish as they would have (the
        ones submitted after it wait); conversations then start new sessions (a batching runtime's
        sessions come from its scheduler). The loaded model stays loaded. Cancelling the returned
        handle while it waits leaves everything as it was."""
        n = int(parallel)
        q = self.max_queue if max_queue is None else int(max_queue)
        if n < 1 or q < 0:
            raise ValueError(f"parallel must be at least 1 and max_queue at least 0 (got {n}, {q})")
        return self._submit("parallel", parallel=n, max_queue=q)

    def forget(self, conversation_id: Any) -> RequestHandle:
        """Drop a conversation's session (its cached prefix and device memory)."""
        return self._submit("forget", conversation_id=conversation_id)

    def cancel(self, request_id: int) -> bool:
        """Cancel a request by id; False when it is unknown or already over."""
        with self._lock:
            req = self._live.get(request_id)
        if req is None:
            return False
        req.cancel()
        return True

    def cancel_all(self) -> None:
        with self._lock:
            reqs = list(self._live.values())
        for req in reqs:
            req.cancel()

    @property
    def model_info(self) -> ModelInfo | None:
        return self._model_info

    @property
    def loaded(self) -> bool:
        return self._model_info is not None

    def status(self) -> dict[str, Any]:
        """A JSON-ready picture of the runtime: model, busy request, queue length."""
        with self._lock:
            current = self._current
            pending = sum(1 for r in self._live.values() if r is not current)
        sched = self._scheduler
        running = int(sched.metrics()["running"]) if sched is not None else 0  # batched generations
        info = self._model_info
        return {
            "model": info.to_dict() if info else None,
            "busy": current is not None or running > 0,
            "current_request": {"id": current.id, "kind": current.kind} if current else None,
            "queued": max(0, pending - running),
            "sessions": len(self._sessions),
            "alive": self._thread.is_alive(),
            "parallel": self.parallel,
        }

    def batching_metrics(self) -> dict[str, float | int] | None:
        """The scheduler's and its prefix cache's counters (engine/scheduler.py), or None when the
        runtime runs one generation at a time."""
        sched = self._scheduler
        if sched is None:
            return None
        out = sched.metrics()
        if sched.prefix_cache is not None:
            out.update(sched.prefix_cache.metrics())
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Cancel everything, unload the model and stop the worker thread."""
        if self._closed:
            return
        self._closed = True
        self.cancel_all()
        self._queue.put(_SHUTDOWN)
        self._thread.join(timeout)
        self.metrics.stop_sampler()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, kind: str, **args: Any) -> RequestHandle:
        if self._closed:
            raise RuntimeError("the runtime is closed")
        req = _Request(kind, args)
        with self._lock:
            sched = self._scheduler
            if sched is not None and kind in GENERATION_KINDS and sum(
                    r.kind in GENERATION_KINDS and not r.finished
                    for r in self._live.values()) >= self.parallel + self.max_queue:
                raise QueueFull(f"all {self.parallel} generation slots are busy and {self.max_queue} "
                                "requests are waiting; retry later", sched.retry_after())
            self._live[req.id] = req
        self._queue.put(req)
        return RequestHandle(req, self)

    # -- worker thread ---------------------------------------------------------------------------------

    def _handler(self, kind: str) -> Callable[[_Request], None]:
        handlers: dict[str, Callable[[_Request], None]] = {
            "load": self._do_load, "unload": self._do_unload, "chat": self._do_chat,
            "completion": self._do_completion, "replace": self._do_replace, "forget": self._do_forget,
            "parallel": self._do_parallel,
        }
        return handlers[kind]

    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if not isinstance(item, _Request):  # _SHUTDOWN
                break
            req = item
            if self._scheduler is not None and req.kind in GENERATION_KINDS:
                thread = threading.Thread(target=self._serve, args=(req, False), daemon=True,
                                          name=f"minecart-request-{req.id}")
                with self._lock:
                    self._generation_threads.add(thread)
                thread.start()
                continue
            self._serve(req, True)
        try:
            self._drop_model()
        except Exception:  # noqa: BLE001 - shutting down: queued clients must still be answered
            pass
        # Anything still queued after shutdown is cancelled, so no client waits forever.
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Request):
                item.emit("cancelled", finish_reason="cancelled")

    def _serve(self, req: _Request, serial: bool) -> None:
        """Run one request to its terminal event: on the worker thread (serial), or on a thread of
        its own for a generation the scheduler batches."""
        if serial:
            with self._lock:
                self._current = req
        try:
            if not req.pick_up():
                req.emit("cancelled", finish_reason="cancelled")  # no-op if already ended
                return
            req.emit("started", data={"queue_wait_s": (req.picked_up or 0.0) - req.submitted})
            self._handler(req.kind)(req)
        except GenerationCancelled:
            req.emit("cancelled", finish_reason="cancelled")
        except Exception as exc:  # noqa: BLE001 - engine errors go to the client, the thread lives on
            if req.cancel_event.is_set() and req.kind == "load":
                req.emit("cancelled", finish_reason="cancelled")
            else:
                req.emit("error", text=_error_text(exc), error=exc)
        except BaseException as exc:  # noqa: BLE001 - even SystemExit from a model must not kill us
            req.emit("error", text=_error_text(exc), error=exc)
        finally:
            if not req.finished:  # a handler that forgot its terminal event
                req.emit("done")
            with self._lock:
                if serial:
                    self._current = None
                self._live.pop(req.id, None)
                self._generation_threads.discard(threading.current_thread())
            if req.ended_as in ("error", "cancelled"):
                return_freed_memory()

    def _clear_sessions(self) -> None:
        while self._sessions:
            _close_session(self._sessions.popitem()[1])

    def _drop_model(self) -> None:
        self._stop_scheduler()
        self._clear_sessions()
        model, self._model = self._model, None
        self._model_info = None
        self._load_args = None
        if model is not None:
            model.close()
        self.state_version += 1

    def _do_load(self, req: _Request) -> None:
        a = req.args
        if self._model is not None and self._loader is _default_loader:
            # A broken or unsupported file must not cost the user the model that works: check the
            # header and tensor table (no weights read) before the old model is freed. (Local import:
            # the runtime imports without the whole engine, see _default_loader.)
            from .model import check_model_file

            check_model_file(a["path"])
        # Free the old model first: two models rarely fit in the same VRAM.
        self._drop_model()
        model = self._loader(
            a["path"],
            devices=a["devices"],
            placement=a["placement"],
            progress=_progress_emitter(req),
            cancel=req.cancel_event,
            **_load_options(a),
        )
        if not req.cancel_event.is_set():
            # The tokenizer and template are built lazily (a 248k-token BPE takes seconds); build them
            # now, under the load's progress, not inside the first chat's time to first token.
            req.emit("progress", fraction=1.0, text="building the tokenizer")
            _ = model.tokenizer, model.chat_template
        if req.cancel_event.is_set():
            model.close()
            req.emit("cancelled", finish_reason="cancelled")
            return
        self._install(model, a)
        req.emit("done", data={"model": self._model_info})

    def _stop_scheduler(self) -> None:
        """End the batched generations (each ends "cancelled") before the model or its sessions go."""
        sched, self._scheduler = self._scheduler, None
        if sched is None:
            return
        with self._lock:
            generations = [r for r in self._live.values() if r.kind in GENERATION_KINDS]
        for r in generations:  # so that each ends "cancelled", not as if it had finished
            r.cancel()
        sched.close()
        with self._lock:
            threads = list(self._generation_threads)
        for t in threads:
            t.join(10)
        if sched.prefix_cache is not None:
            sched.prefix_cache.clear()

    def _start_scheduler(self, model: RuntimeModel) -> None:
        if self.parallel > 1:
            # local import: the runtime imports without the whole engine (tests, the app)
            from .model import Model

            if isinstance(model, Model):
                self._scheduler = Scheduler(model, parallel=self.parallel, max_queue=self.max_queue,
                                            prefix_cache=PrefixCache())

    def _install(self, model: RuntimeModel, load_args: dict[str, Any]) -> None:
        self._stop_scheduler()
        self._start_scheduler(model)
        self._model = model
        self._load_args = dict(load_args)
        self._clear_sessions()
        self._model_info = _describe(model, load_args)
        self.metrics.set_devices(self._model_info.devices)
        self.state_version += 1

    def _do_parallel(self, req: _Request) -> None:
        n, q = req.args["parallel"], req.args["max_queue"]
        if (n, q) != (self.parallel, self.max_queue):
            while True:  # the batched generations running now finish first (new ones queue behind this)
                with self._lock:
                    running = [t for t in self._generation_threads if t.is_alive()]
                if not running:
                    break
                if req.cancel_event.is_set():
                    raise GenerationCancelled("the change of parallelism was cancelled")
                running[0].join(0.05)
            self._stop_scheduler()
            with self._lock:
                self.parallel, self.max_queue = n, q
            if self._model is not None:
                self._clear_sessions()  # sessions of the old scheduler, or of the model alone
                self._start_scheduler(self._model)
        req.emit("done", data={"parallel": self.parallel, "max_queue": self.max_queue})

    def _do_unload(self, req: _Request) -> None:
        self._drop_model()
        req.emit("done")

    def _do_forget(self, req: _Request) -> None:
        _close_session(self._sessions.pop(req.args["conversation_id"], None))
        req.emit("done")

    def _do_replace(self, req: _Request) -> None:
        model = self._require_model()
        placement = req.args["placement"]
        self._stop_scheduler()  # the batched generations run on the old placement
        self._clear_sessions()  # their state lives on the old devices
        model.reload_placement(placement, progress=_progress_emitter(req), cancel=req.cancel_event)
        self._install(model, dict(self._load_args or {}, placement=placement))
        req.emit("done", data={"model": self._model_info})

    def _require_model(self) -> RuntimeModel:
        if self._model is None:
            raise RequestError("no model is loaded; load a GGUF file first")
        return self._model

    def _session(self, model: RuntimeModel, conversation_id: Any) -> RuntimeSession | None:
        """The session of a conversation (LRU), or a fresh one for a one-off request. When the runtime
        batches, a one-off request, or one whose conversation's session another generation is using,
        gets None: the scheduler then starts it from its prefix cache."""
        sched = self._scheduler
        if conversation_id is None:
            return model.new_session() if sched is None else None
        evicted = []
        with self._lock:
            session = self._sessions.get(conversation_id)
            if session is not None and id(session) in self._busy_sessions:
                return None
            if session is None:
                session = sched.new_session() if sched is not None else model.new_session()
                self._sessions[conversation_id] = session
                idle = [k for k, s in self._sessions.items() if id(s) not in self._busy_sessions
                        and s is not session]
                while len(self._sessions) > self.max_sessions and idle:
                    evicted.append(self._sessions.pop(idle.pop(0)))
            else:
                self._sessions.move_to_end(conversation_id)
            if sched is not None:
                self._busy_sessions.add(id(session))
        for old in evicted:
            _close_session(old)
        return session

    def _do_chat(self, req: _Request) -> None:
        model = self._require_model()
        a = req.args
        messages, tools = a["messages"], a["tools"]
        if has_images(messages) and model.vision is None:
            raise RequestError(
                "this model cannot read pictures (it has no vision encoder); remove the image or "
                "load a vision model together with its mmproj file"
            )
        rendered = render_prompt(model, messages, tools=tools, enable_thinking=a["enable_thinking"],
                                 mode=a["chat_template"],
                                 find_turn_boundary=a.get("conversation_id") is not None)
        if rendered.messages is not None:
            # pictures (or no template): the model lays the messages out and renders the tools
            prompt: PromptInput = rendered.messages
            extras: dict[str, Any] = {"tools": tools} if tools else {}
        else:
            if not rendered.ids:
                raise RequestError("the messages hold no text to continue")
            prompt, extras = rendered.ids, {}
            if rendered.turn_boundary:
                # the engine checkpoints the session at the end of the user's turn, after the
                # prompt's checks (length, context) and chunked like every prefill
                extras["turn_boundary"] = rendered.turn_boundary
        params = (a["params"] or SamplingParams()).with_max_tokens(templated=rendered.source == "chat")
        self._generate(req, model, prompt, params, a["enable_thinking"], rendered.opens_thinking,
                       extras, prompt_kind=rendered.source)

    def _do_completion(self, req: _Request) -> None:
        model = self._require_model()
        rendered = render_prompt(model, req.args["prompt"])
        if not rendered.ids:
            raise RequestError("the prompt is empty after tokenization")
        params = (req.args["params"] or SamplingParams()).with_max_tokens(templated=False)
        self._generate(req, model, rendered.ids, params, False, False, {}, prompt_kind="text")

    def _generate(self, req: _Request, model: RuntimeModel, prompt: PromptInput,
                  params: SamplingParams, enable_thinking: bool, opens_thinking: bool,
                  extras: dict[str, Any], prompt_kind: str) -> None:
        a = req.args
        conversation_id = a.get("conversation_id")
        session = self._session(model, conversation_id)
        started = req.picked_up or time.time()  # prefill time includes rendering and tokenizing
        stops = StopStrings(a.get("stop") or [])
        splitter = ThinkingSplitter(inside=opens_thinking)
        first_token_at: float | None = None
        last: GenerationEvent | None = None
        finish_reason: str | None = None
        ok = False
        sched = self._scheduler
        if sched is not None:
            assert session is None or isinstance(session, Session)  # made by sched.new_session
            stream = sched.generate(prompt, params, session=session, cancel=req.cancel_event,
                                    enable_thinking=enable_thinking, **extras)
        else:
            stream = model.generate(prompt, params, session=session, cancel=req.cancel_event,
                                    enable_thinking=enable_thinking, **extras)
        try:
            for ev in stream:
                last = ev
                if first_token_at is None:
                    first_token_at = time.time()
                if req.cancel_event.is_set():
                    break  # the engine may yield one more token before it notices
                thinking, answer = splitter.feed(ev.text)
                if ev.finish_reason:  # nothing follows a finish: release what the splitter held back
                    more_thinking, more_answer = splitter.flush()
                    thinking, answer = thinking + more_thinking, answer + more_answer
                answer, hit = stops.feed(answer)
                if hit:
                    finish_reason = "stop"
                elif ev.finish_reason:
                    answer += stops.flush()
                if thinking or answer or ev.token is not None:
                    req.emit("token", text=answer, thinking=thinking, generation=ev)
                if ev.generation_tps:
                    self.metrics.record_live_decode_rate(float(ev.generation_tps))
                if finish_reason or ev.finish_reason:
                    finish_reason = finish_reason or ev.finish_reason
                    break
            ok = True
        except GenerationCancelled:
            ok = True
        finally:
            # Closing the generator lets the engine finish its bookkeeping (the session records
            # which tokens its cache holds) when we stop early: cancel, stop string, finish.
            stream.close()  # type: ignore[attr-defined]  # generate is a generator function
            with self._lock:
                self._busy_sessions.discard(id(session))
                mine = session is not None and self._sessions.get(conversation_id) is session
            if conversation_id is None:
                _close_session(session)  # a one-off request's session is not kept
            elif not ok and not req.cancel_event.is_set() and mine:
                # A failed step may leave the session's cache half-written: do not reuse it.
                with self._lock:
                    dropped = self._sessions.pop(conversation_id, None)
                _close_session(dropped)
        cancelled = req.cancel_event.is_set() and finish_reason is None
        if not cancelled and finish_reason is None:  # the stream ended without a finish reason
            thinking, answer = splitter.flush()
            answer = stops.feed(answer)[0] + stops.flush()
            if thinking or answer:
                req.emit("token", text=answer, thinking=thinking)
        usage = _usage(last)
        finish = "cancelled" if cancelled else (finish_reason or "stop")
        timing = self._timing(req, started, first_token_at, time.time(), usage, finish)
        data = {"timing": timing, "prompt": prompt_kind}
        if cancelled:
            req.emit("cancelled", finish_reason="cancelled", usage=usage, generation=last, data=data)
        else:
            req.emit("done", finish_reason=finish, usage=usage, generation=last, data=data)

    def _timing(self, req: _Request, started: float, first_at: float | None, ended: float,
                usage: Usage, finish: str) -> RequestTiming:
        prefill_s = (first_at - started) if first_at else None
        decode_s = (ended - first_at) if first_at else None
        prefill_tps = usage.prompt_tokens_per_s
        computed = usage.prompt_tokens - usage.cached_tokens
        if prefill_tps is None and prefill_s and computed > 0:
            prefill_tps = computed / prefill_s
        decode_tps = usage.decode_tokens_per_s
        if decode_tps is None and decode_s and usage.completion_tokens > 1:
            decode_tps = (usage.completion_tokens - 1) / decode_s
        timing = RequestTiming(
            request_id=req.id,
            kind=req.kind,
            submitted=req.submitted,
            queue_wait_s=started - req.submitted,
            prefill_s=prefill_s,
            time_to_first_token_s=(first_at - req.submitted) if first_at else None,
            decode_s=decode_s,
            prompt_tokens=usage.prompt_tokens,
            generated_tokens=usage.completion_tokens,
            prefill_tokens_per_s=prefill_tps,
            decode_tokens_per_s=decode_tps,
            finish_reason=finish,
        )
        self.metrics.record_request(timing)
        return timing


# ---------------------------------------------------------------------------------------------------
# Helpers


def _progress_emitter(req: _Request) -> Progress:
    def progress(fraction: float, message: str = "") -> None:
        req.emit("progress", fraction=float(fraction), text=str(message))

    return progress


def _usage(last: GenerationEvent | None) -> Usage:
    if last is None:
        return Usage()
    return Usage(
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.generated_tokens,
        prompt_tokens_per_s=last.prompt_tps,
        decode_tokens_per_s=last.generation_tps,
        cached_tokens=last.cached_tokens,
        image_tokens=last.image_tokens,
    )


def _close_session(session: RuntimeSession | None) -> None:
    """Free a session's device memory now rather than whenever the garbage collector runs."""
    if session is None:
        return
    try:
        session.close()
    except Exception:  # noqa: BLE001 - a failed free must not take the request down with it
        pass


_LIBC: Any = None  # glibc, once loaded by return_freed_memory (None elsewhere: nothing to do)


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim) after a request failed or
    was cancelled. Such a request (a prompt past the context, a cancelled long prefill) frees
    hundreds of MB that malloc keeps for reuse, so the process's memory only grew: measured on the
    2-core machine, 1.5 MB prompts past the context took it 251 -> 402 -> 444 -> 474 MB over three
    requests, and 270 -> 313 MB, then flat, with a trim after each. A no-op where there is no glibc."""
    global _LIBC
    if _LIBC is None:
        if not sys.platform.startswith("linux"):
            _LIBC = False
            return
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):  # musl or another libc: no malloc_trim
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def _load_options(args: dict[str, Any]) -> dict[str, Any]:
    """The load's options that were given (mmproj, max_image_tokens, kv_type, experts, context,
    cpu_weights), for the loader."""
    return {k: args[k] for k in ("mmproj", "max_image_tokens", "kv_type", "experts", "context", "cpu_weights")
            if args.get(k) is not None}


def valid_unicode(text: str) -> str:
    """`text` with lone surrogates replaced by U+FFFD. They reach us from JSON ("\\udc80" is valid JSON)
    and from undecodable command-line bytes (Python's surrogateescape); the tokenizer refuses them."""
    return _LONE_SURROGATE.sub("\ufffd", text)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # a Python str never holds a valid surrogate pair


def _with_valid_text(message: Any) -> Any:
    """A copy of one chat message whose text (string content or text parts) is valid Unicode."""
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": valid_unicode(content)}
    if isinstance(content, list):
        parts = [{**p, "text": valid_unicode(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str)
                 else p for p in content]
        return {**message, "content": parts}
    return message


def _describe(model: RuntimeModel, load_args: dict[str, Any]) -> ModelInfo:
    config = model.config
    path = str(load_args.get("path", ""))
    devices = tuple(dict.fromkeys(model.device_plan.values()))
    return ModelInfo(
        path=path,
        name=str(config.name or Path(path).stem),
        architecture=str(config.architecture),
        context_length=int(config.context_length or 0),
        devices=devices,
        placement=model.placement if model.placement is not None else load_args.get("placement"),
        has_vision=model.vision is not None,
        base_model=bool(model.is_base_model),
        context_limit=context_limit(model),
    )


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip()
    if isinstance(exc, MinecartError):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
