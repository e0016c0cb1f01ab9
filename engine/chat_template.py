"""Chat templates: a list of messages -> the prompt text a model was trained on.

A GGUF carries its model's Jinja template (`tokenizer.chat_template`). Templates are untrusted code, so
they run in jinja2's `ImmutableSandboxedEnvironment`, configured the way Hugging Face transformers
renders them (`trim_blocks`, `lstrip_blocks`, loop controls, a `tojson` that does not HTML-escape,
`raise_exception`, `strftime_now`), so a template renders here exactly as it does there. A file without
a template gets a built-in one chosen by architecture (`engine/templates/*.jinja`).

A template is also bounded in what it may cost: it renders on a thread of its own within a time budget
(RENDER_BUDGET_S; past it the render is stopped and the request gets a TemplateError, the caller's thread
is free again at once), and no string, list or output it builds may pass MAX_OUTPUT_CHARS (`'x' * 10**9`,
a doubling loop, `center(10**9)` and huge format widths are refused before they allocate). A MemoryError
or RecursionError inside a template is a TemplateError like any other failure of the template.

Also here: `split_thinking`, which separates `<think>...</think>` reasoning from the answer in model
output, complete or still streaming. This module does not tokenize (tokenizer.py) and does not decide
sampling settings.
"""

from __future__ import annotations

import copy
import ctypes
import json
import re
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING, Any

import jinja2

from .errors import TemplateError

if TYPE_CHECKING:
    from .gguf_file import GGUFFile

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# GGUF general.architecture -> built-in template used when the file has none
BUILTIN_BY_ARCHITECTURE = {
    "qwen35": "chatml_qwen35",
    "qwen35moe": "chatml_qwen35",
    "gemma": "gemma3",
    "gemma2": "gemma3",
    "gemma3": "gemma3",
}
DEFAULT_BUILTIN = "chatml"

# Message keys under which clients send reasoning; templates read `reasoning_content`.
_REASONING_ALIASES = ("reasoning_content", "reasoning", "thinking")


# How long one render may take. A real template renders a long chat in milliseconds; a hostile one
# (nested range(100000) loops) would run for hours.
RENDER_BUDGET_S = 1.0
# The longest string (or list) a template may build and the most text it may output: far beyond any
# context window (a million tokens is a few MB of text), far below what would hurt the machine.
MAX_OUTPUT_CHARS = 64 * 1024 * 1024
# Integers a template may build (no chat template needs more than a few digits).
MAX_INT_BITS = 1 << 16
# A format width or precision with this many digits (100 million and up) builds a string past the cap.
_HUGE_FORMAT_WIDTH = re.compile(r"[%:{][^%:{}]*?\d{8,}")


class TemplateRaised(jinja2.TemplateError):
    """Raised by a template's own `raise_exception(...)`: the template rejects the conversation."""


class _RenderTimeout(BaseException):
    """Injected into a render thread past its budget (BaseException: nothing on the way catches it)."""


def _too_big(size: int, what: str) -> None:
    if size > MAX_OUTPUT_CHARS:
        raise jinja2.exceptions.SecurityError(
            f"{what} would be {size:,} long, more than the {MAX_OUTPUT_CHARS:,} a template may build")


def _int_too_big(bits: int) -> None:
    # Big-integer arithmetic runs in C holding the GIL, where no time budget can stop it.
    if bits > MAX_INT_BITS:
        raise jinja2.exceptions.SecurityError(
            f"an integer of {bits:,} bits, more than the {MAX_INT_BITS:,} a template may build")


def _check_format(fmt: Any) -> None:
    if isinstance(fmt, str) and _HUGE_FORMAT_WIDTH.search(fmt):
        raise jinja2.exceptions.SecurityError("a format width or precision of 100 million or more")


def _guarded_binop(op: str, left: Any, right: Any) -> None:
    """Refuse the arithmetic a template could use to build a huge value in one step."""
    seqs = (str, list, tuple)
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, seqs) and isinstance(n, int):
                _too_big(len(seq) * max(n, 0), "a repeated string or list")
        if isinstance(left, int) and isinstance(right, int):
            _int_too_big(left.bit_length() + right.bit_length())
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0:
            _int_too_big(max(left.bit_length(), 1) * right)
    elif op == "+":
        if isinstance(left, seqs) and isinstance(right, seqs):
            _too_big(len(left) + len(right), "a concatenation")
    elif op == "%":
        _check_format(left)


def _guarded_str_join(seq: Any) -> str:
    parts = [str(x) for x in seq]
    _too_big(sum(map(len, parts)), "a '~' concatenation")
    return "".join(parts)


def _check_call(obj: Any, args: tuple, kwargs: dict) -> None:
    """Refuse str methods whose result could pass the cap (widths, joins, replacements)."""
    # the sandbox hands out str.format as a wrapper around the bound method
    owner = getattr(getattr(obj, "__wrapped__", obj), "__self__", None)
    if not isinstance(owner, str):
        return
    name = getattr(obj, "__name__", "")
    values = list(args) + list(kwargs.values())
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool):
            _too_big(v, f"str.{name}'s argument")
    if name == "join" and args:
        items = list(args[0]) if not isinstance(args[0], str) else list(args[0])
        _too_big(sum(len(x) for x in items if isinstance(x, str)) + len(owner) * len(items), "a join")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        hits = owner.count(args[0]) if args[0] else len(owner) + 1
        _too_big(len(owner) + hits * max(0, len(args[1]) - len(args[0])), "a replacement")
    elif name in ("format", "format_map"):
        _check_format(owner)


@lru_cache(maxsize=1)
def _environment():
    """The sandboxed Jinja environment shared by all templates (it holds no per-render state)."""
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks in HF);
        rendering only needs its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class GuardedNamespace(jinja2.utils.Namespace):
        """`namespace()` that refuses underscore names, so a template cannot plant dunder attributes."""

        def __init__(*args, **kwargs):  # noqa: N805 - mirrors jinja2.utils.Namespace's signature
            self, rest = args[0], args[1:]
            values = dict(*rest, **kwargs)
            for key in values:
                GuardedNamespace._check(key)
            jinja2.utils.Namespace.__init__(self, values)

        def __setitem__(self, key, value):
            GuardedNamespace._check(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _check(key):
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {key!r} is not allowed")

    def raise_exception(message):
        raise TemplateRaised(str(message))

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes <, >, & and ' for HTML; model templates want plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox, plus size checks on the operators and calls that could build a huge value."""

        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def call_binop(self, context, operator_name, left, right):
            _guarded_binop(operator_name, left, right)
            return super().call_binop(context, operator_name, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
            _check_call(__obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    env = BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
    )
    _bound_width_filters(env)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = GuardedNamespace
    return env


def _bound_width_filters(env) -> None:
    """Filters that take a width or a format: refuse sizes past the cap before they allocate."""
    center, indent, fmt, join = (env.filters[k] for k in ("center", "indent", "format", "join"))

    def bounded_center(value, width=80):
        _too_big(width if isinstance(width, int) else 0, "center's width")
        return center(value, width)

    def bounded_indent(s, width=4, first=False, blank=False):
        n = width if isinstance(width, int) else len(str(width))
        _too_big(len(str(s)) * (n + 1), "an indented text")
        return indent(s, width, first, blank)

    def bounded_format(value, *args, **kwargs):
        _check_format(value)
        for v in list(args) + list(kwargs.values()):
            if isinstance(v, int) and not isinstance(v, bool):
                _too_big(v, "a format argument")
        return fmt(value, *args, **kwargs)

    @jinja2.pass_eval_context
    def bounded_join(eval_ctx, value, d="", attribute=None):
        items = list(value)
        _too_big(sum(len(x) for x in items if isinstance(x, str)) + len(str(d)) * len(items), "a join")
        return join(eval_ctx, items, d, attribute)

    env.filters.update(center=bounded_center, indent=bounded_indent, format=bounded_format,
                       join=bounded_join)


def builtin_template_source(name: str) -> str:
    """Text of a built-in template from engine/templates/ (`chatml`, `chatml_qwen35`, `gemma3`)."""
    try:
        return resources.files("minecart.engine").joinpath("templates").joinpath(f"{name}.jinja").read_text("utf-8")
    except FileNotFoundError as exc:
        raise TemplateError(f"no built-in chat template named '{name}'") from exc


class ChatTemplate:
    """One compiled chat template. `render(messages)` gives the prompt text to tokenize with
    `Tokenizer.encode(text, add_special=True)`."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", *, origin: str = "<string>"):
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.origin = origin
        try:
            self._template = _environment().from_string(source)
            # '~' joins through the template's own str_join: bound it like the operators
            self._template.root_render_func.__globals__["str_join"] = _guarded_str_join
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(
                f"chat template ({origin}) has a syntax error at line {exc.lineno}: {exc.message}. "
                "Fix the template, or override it with a known-good one."
            ) from exc
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template ({origin}) cannot be compiled: {exc}") from exc

    @classmethod
    def builtin(cls, name: str, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        return cls(builtin_template_source(name), bos_token, eos_token, origin=f"built-in '{name}'")

    @classmethod
    def from_gguf(cls, gguf_file: GGUFFile, name: str | None = None) -> ChatTemplate:
        """The file's `tokenizer.chat_template` (or `tokenizer.chat_template.<name>`), else the
        built-in template for its architecture."""
        meta = gguf_file.metadata
        path = str(gguf_file.path)
        tokens = meta.get("tokenizer.ggml.tokens")
        tokens = tokens if isinstance(tokens, list) else []

        def token_text(key: str) -> str:
            # a damaged file's id or vocabulary only loses the bos/eos variables here; the
            # tokenizer reports the damage itself
            tid = meta.get(key)
            if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < len(tokens):
                return ""
            return str(tokens[tid])

        bos, eos = token_text("tokenizer.ggml.bos_token_id"), token_text("tokenizer.ggml.eos_token_id")
        key = "tokenizer.chat_template" + (f".{name}" if name else "")
        source = meta.get(key)
        if source:
            return cls(str(source), bos, eos, origin=f"{path}, key '{key}'")
        if name:
            raise TemplateError(f"{path}: no chat template named '{name}' (key '{key}' is absent).")
        arch = str(meta.get("general.architecture", ""))
        builtin = BUILTIN_BY_ARCHITECTURE.get(arch, DEFAULT_BUILTIN)
        return cls(builtin_template_source(builtin), bos, eos, origin=f"built-in '{builtin}' ({path} has none)")

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = True,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages` (dicts with `role` and `content`).

        content: a string, None, or a list of parts `{"type": "text", "text": ...}`, `{"type": "image"}`,
        `{"type": "image_url", ...}`. Assistant messages may carry `reasoning_content` (also accepted as
        `reasoning`/`thinking`) and `tool_calls` (OpenAI style; JSON-string arguments are parsed).
        enable_thinking=None leaves the template's own default (Qwen3.5 <= 2B: off). Extra keyword
        arguments become template variables (e.g. `preserve_thinking=True` for Qwen3.6,
        `add_vision_id=True`).
        """
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise TemplateError("tools must be a list of JSON-schema dicts ({'type': 'function', ...})")
        variables = dict(extra)
        variables.update(
            messages=normalize_messages(messages),
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        if enable_thinking is not None:
            variables["enable_thinking"] = bool(enable_thinking)
        return self._render_bounded(variables)

    def _render_bounded(self, variables: dict[str, Any]) -> str:
        """Render on a thread of its own; past RENDER_BUDGET_S the render is stopped (an exception
        injected into that thread) and the caller gets a TemplateError without waiting for it."""
        result: list[Any] = []
        done = threading.Event()

        def run() -> None:
            try:
                result.append(self._render(variables))
            except _RenderTimeout:
                pass
            except BaseException as exc:  # handed to the caller's thread
                result.append(exc)
            finally:
                done.set()

        worker = threading.Thread(target=run, name="minecart-template", daemon=True)
        started = time.perf_counter()
        worker.start()
        if not done.wait(RENDER_BUDGET_S):
            if worker.ident is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident),
                                                           ctypes.py_object(_RenderTimeout))
            done.wait(0.2)
            if not done.is_set() or not result:
                raise TemplateError(
                    f"chat template ({self.origin}) ran past its time budget of {RENDER_BUDGET_S:g} s "
                    f"(stopped after {time.perf_counter() - started:.1f} s); the template loops without "
                    "end or is far too slow: override it with a known-good one")
        out = result[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def _render(self, variables: dict[str, Any]) -> str:
        try:
            pieces: list[str] = []
            size = 0
            for piece in self._template.generate(**variables):
                size += len(piece)
                _too_big(size, "the rendered prompt")
                pieces.append(piece)
            return "".join(pieces)
        except jinja2.exceptions.SecurityError as exc:
            raise TemplateError(
                f"chat template ({self.origin}) tried an unsafe operation and was stopped: {exc}"
            ) from exc
        except TemplateRaised as exc:
            raise TemplateError(f"chat template ({self.origin}) refused the conversation: {exc}") from exc
        except jinja2.TemplateError as exc:  # undefined names and the like
            raise TemplateError(
                f"chat template ({self.origin}) failed while rendering: {type(exc).__name__}: {exc}"
            ) from exc
        except MemoryError as exc:
            raise TemplateError(f"chat template ({self.origin}) ran out of memory while rendering; "
                                "override it with a known-good one") from exc
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError,
                RecursionError, OverflowError) as exc:
            raise TemplateError(
                f"chat template ({self.origin}) failed while rendering: {type(exc).__name__}: {exc}"
            ) from exc


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Deep-copied messages in the shape HF-style templates read.

    - `reasoning`/`thinking` are also exposed as `reasoning_content`;
    - content parts of type `image_url`/`input_image` also get type `image` (`video_url` -> `video`),
      so templates that test `item.type == 'image'` see them;
    - tool-call arguments sent as a JSON string (OpenAI API) become a dict, as templates iterate them.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TemplateError("messages must be a list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise TemplateError(f"message {i} must be a dict with a 'role' (got {message!r:.80})")
        msg = copy.deepcopy(dict(message))
        if msg.get("reasoning_content") is None:
            for alias in _REASONING_ALIASES[1:]:
                if isinstance(msg.get(alias), str):
                    msg["reasoning_content"] = msg[alias]
                    break
        content = msg.get("content")
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict):
                    kind = part.get("type")
                    if kind in ("image_url", "input_image"):
                        part["type"] = "image"
                    elif kind == "video_url":
                        part["type"] = "video"
        calls = msg.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                if not isinstance(call, dict):
                    continue
                fn: dict[str, Any] = call["function"] if isinstance(call.get("function"), dict) else call
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        parsed = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        parsed = None
                    if isinstance(parsed, dict):
                        fn["arguments"] = parsed
        out.append(msg)
    return out


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open `<think>` block (Qwen3.5 with thinking on), so
    the model's output starts with reasoning rather than with `<think>`."""
    tail = prompt.rstrip()
    return tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)


def split_thinking(text: str, *, in_thinking: bool = False) -> tuple[str, str]:
    """Split model output into (reasoning, answer).

    in_thinking: the prompt already opened `<think>` (see `prompt_opens_thinking`), so text before
    any `</think>` is reasoning even without an opening tag. Works on partial (streaming) text: an
    unclosed block is all reasoning so far, and a tag cut in half at the end (`</thi`) is held back
    rather than shown. Whitespace around the reasoning and before the answer is stripped.
    """
    body = text
    lead = body.lstrip()
    if lead.startswith(THINK_OPEN):
        body = lead[len(THINK_OPEN):]
        in_thinking = True
    elif not in_thinking:
        # no reasoning unless a block opens at the very start (a partial '<thi' is held back too)
        if lead and THINK_OPEN.startswith(lead):
            return "", ""
        return "", text
    close = body.find(THINK_CLOSE)
    if close < 0:
        return _drop_partial_tag(body, THINK_CLOSE).strip(), ""
    return body[:close].strip(), body[close + len(THINK_CLOSE):].lstrip()


def _drop_partial_tag(text: str, tag: str) -> str:
    """`text` without a trailing prefix of `tag` (streaming may stop mid-tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return text[:-n]
    return text
