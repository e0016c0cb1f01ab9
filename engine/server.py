"""OpenAI-compatible HTTP API (FastAPI + uvicorn) over a Runtime.

Endpoints: `GET /v1/models`, `POST /v1/chat/completions` (streaming SSE or one JSON body), `POST
/v1/completions`, `POST /v1/responses` and `GET /v1/responses/{id}` (OpenAI's Responses API, run as the
chat request it stands for: engine/openai_responses.py), `GET /health`, `GET /metrics` (JSON snapshot of engine metrics; the Prometheus text
format with `?format=prometheus` or an `Accept: text/plain` / OpenMetrics header, engine/prometheus.py).
A runtime that batches (Runtime(parallel=N)) refuses a generation past its queue with 429 and a
Retry-After header.

Chat requests take messages with text and image parts, `tools` + `tool_choice` (rendered by the model's
chat template; Qwen's `<tool_call>` output comes back as `tool_calls`; "required" or a named function
makes the answer calls, drawn in the template's format: engine/tool_call_grammar.py), the usual sampling fields
(temperature, top_p, max_tokens / max_completion_tokens, stop, seed, presence/frequency penalty) and, as
extras, top_k, min_p and repetition_penalty. Thinking comes back as `reasoning_content`; it is turned off
with `chat_template_kwargs: {"enable_thinking": false}`, `"enable_thinking": false`, or a `/no_think` in
the last user or system message (`/think` turns it back on; both tags are removed from the text).
`response_format` {"type": "json_object"} or {"type": "json_schema", ...} makes the answer JSON (of the
schema), drawing only tokens that keep it so (engine/json_output.py; on both completion routes).
`logprobs` (chat: true with `top_logprobs` 0-20; completions: 0-5) returns each generated token's
log-probability under the model's own logits (before temperature, penalties or a format) with its
bytes, and the row's most likely alternatives; the reasoning's tokens are included. `logit_bias` (token id
strings to -100..100) is added to the logits before the penalties. Completions take `echo` (the prompt
comes back before the answer, with each prompt token's log-probability given the ones before it when
`logprobs` is set; `max_tokens` 0 scores the prompt alone, as evaluation harnesses ask).
`chat_template_mode` (an extra: "auto", "on", "off") chooses between the chat template and the plain
text of the messages; "auto" (default) sends a pretrained base model plain text to continue.
`conversation_id` (an extra) keeps a chat in its own engine session; without it, requests share one
session, whose common-prefix reuse makes a client that resends the whole history cheap anyway (with
serve --parallel, the runtime's prefix cache does that for all of them).

Request bodies are pydantic models with strict types (ChatRequest, CompletionRequest), parsed and
validated by FastAPI. Every caller mistake gets a 4xx with an OpenAI-style error body (`{"error":
{"message", "type", "param", "code"}}`): 400 for a malformed body (its place named as a JSON path), 404
`model_not_found` for a `model` other than the loaded one (its id, file name or stem; leaving `model`
out is fine), 413/415 for a body too large or not declared as JSON. max_tokens beyond the context limit (the
planned context, `serve --context`) is capped to it; a prompt beyond it is a 400
`context_length_exceeded` naming the limit and how to raise it. A 500 is answered without dropping the kept-alive connection, and no response carries a
traceback or the model's file path. With an API key, /v1, /metrics and /openapi.json need it; /health
stays open. A client that disconnects cancels its generation.

This module does no inference itself and never touches the model: everything goes through the Runtime.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import (
    ContextFullError,
    GenerationCancelled,
    ImageError,
    MinecartError,
    RequestError,
    TemplateError,
)
from .generation import GenerationEvent, TokenChoice, TokenLogprobs
from .json_output import JsonFormat, SchemaError, json_object_format, json_schema_format
from .openai_responses import (
    STORE_RESPONSES,
    RequestShapeError,
    ResponseEvents,
    ResponsesRequest,
    ResponseStore,
    assistant_message,
    chat_body,
    created_now,
    new_id,
    output_items,
    response_object,
    responses_usage,
)
from .prometheus import CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE
from .prometheus import engine_text
from .prompt import PROMPT_MODES
from .runtime import ModelInfo, RequestHandle, Runtime, RuntimeEvent
from .scheduler import QueueFull
from .tool_call_grammar import tool_call_format

if TYPE_CHECKING:
    from .sampling import SamplingParams

log = logging.getLogger(__name__)
# One JSON line per request when it has been answered (a stream: when it ended): time, client, method,
# path (no query string: it may carry keys), status, duration. `minecart serve` prints them on stderr.
access_log = logging.getLogger("minecart.access")

# One engine session for requests without a conversation_id (prefix reuse across resent histories).
# A batching runtime (serve --parallel) gives them its prefix cache instead, which concurrent requests
# share and which resumes a hybrid model at any 128-token block, not only at the last turn boundary.
SHARED_CONVERSATION = "http:shared"
ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CALL_OPEN = "<tool_call>"
# How often a waiting non-streaming request checks whether its client is still there.
DISCONNECT_POLL_S = 0.25
# The largest request body read (bytes): a long chat with a few pictures fits many times over; past it
# the request is refused before anything is parsed or tokenized.
MAX_BODY_BYTES = 32 * 1024 * 1024
# Host names every server answers to: a browser page reaching a loopback server through a DNS name
# it controls (DNS rebinding) sends that name as Host, which is refused.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class APIError(Exception):
    """An error with an HTTP status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers  # e.g. Retry-After on a 429

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_from_exception(exc: BaseException) -> APIError:
    """Map an engine exception to an HTTP error: the caller's mistakes are 400, the rest 500; the
    message is the exception's own text (never a traceback)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFull):  # a RequestError, but the caller's only mistake is timing
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, ContextFullError):  # the prompt is beyond the loaded model's context limit
        return bad_request(str(exc), code="context_length_exceeded")
    if isinstance(exc, (RequestError, TemplateError, ImageError)):
        return bad_request(str(exc) or type(exc).__name__)
    if isinstance(exc, GenerationCancelled):
        return APIError(499, "the request was cancelled", type="cancelled", code="cancelled")
    if isinstance(exc, MinecartError):
        return APIError(500, str(exc), type="server_error", code=type(exc).__name__)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


# ---------------------------------------------------------------------------------------------------
# Request bodies: pydantic models with strict types (FastAPI parses and validates them; a mistake is a
# 400 through `validation_error`), then converted to what the runtime and the chat template take.

# Token ids a request may name: beyond int32 no vocabulary reaches (the engine checks the real size).
MAX_TOKEN_ID = 2**31 - 1
# JSON Schema type names a tool parameter may declare.
_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")

Finite = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    # Unknown fields are ignored: OpenAI clients send many (user, metadata, store, response_format).
    model_config = ConfigDict(strict=True, extra="ignore")


def _check_unicode(value: Any, where: str) -> None:
    """Every string inside `value` must be encodable text (no lone surrogates from '\\ud800'
    escapes): tool definitions and call arguments go into the prompt and back out as JSON."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{where} holds a lone surrogate (\\ud800-\\udfff) that is not text") from None
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: str | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL | str


def _part_tag(value: Any) -> str | None:
    # pydantic asks for the tag of raw JSON (a dict) and of a part already validated (its model)
    if isinstance(value, dict):
        kind = value.get("type")
    else:
        kind = value.type if isinstance(value, (TextPart, ImagePart)) else None
    return {"text": "text part", "image_url": "image_url part"}.get(str(kind))


# Tags that are never keys of a body, so an error's location reads as a path through the body.
ContentPart = Annotated[Annotated[TextPart, Tag("text part")] | Annotated[ImagePart, Tag("image_url part")],
                        Discriminator(_part_tag)]


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"

    @model_validator(mode="after")
    def _text_only(self) -> FunctionCall:
        _check_unicode([self.name, self.arguments], "the tool call")
        return self


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None
    tool_call_id: str | int | None = None
    name: str | None = None


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _valid(self) -> FunctionDef:
        _check_unicode([self.name, self.description, self.parameters], "the tool definition")
        if not _TOOL_NAME.match(self.name):
            raise ValueError(f"tool name {self.name[:80]!r} must be 1 to 64 letters, digits, '_', '-', "
                             "'.' or ':'")
        if self.parameters is not None:
            _check_schema(self.parameters, f"tool '{self.name}' parameters")
        return self


def _check_schema(schema: dict, where: str, depth: int = 0) -> None:
    """The JSON Schema shape a template and a client rely on: an object schema whose properties are
    schemas with known type names. Not a full JSON Schema validator."""
    if depth > 32:
        raise ValueError(f"{where} is nested more than 32 levels deep")
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not all(isinstance(k, str) and k in _JSON_TYPES for k in kinds):
        raise ValueError(f"{where}: 'type' must be one of {', '.join(sorted(_JSON_TYPES))}, got {kind!r:.60}")
    if depth == 0 and kinds and kinds != ["object"]:
        raise ValueError(f"{where} must be a JSON Schema of type 'object', got {kind!r:.60}")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
            raise ValueError(f"{where}: 'properties' must map names to schemas")
        for name, sub in props.items():
            _check_schema(sub, f"{where}.{name}", depth + 1)
    required = schema.get("required")
    if required is not None and (not isinstance(required, list)
                                 or not all(isinstance(r, str) for r in required)):
        raise ValueError(f"{where}: 'required' must be an array of property names")
    items = schema.get("items")
    if items is not None:
        if not isinstance(items, dict):
            raise ValueError(f"{where}: 'items' must be a schema")
        _check_schema(items, f"{where}[]", depth + 1)


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(_Strict):
    """Fields both completion routes take (OpenAI's names, plus extras top_k, min_p,
    repetition_penalty and conversation_id)."""

    model: str | None = None
    temperature: Finite | None = Field(None, ge=0, le=2)
    top_p: Finite | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: Finite | None = Field(None, ge=0, lt=1)
    repetition_penalty: Finite | None = Field(None, gt=0)
    presence_penalty: Finite | None = Field(None, ge=-2, le=2)
    frequency_penalty: Finite | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, lt=2**64)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = Field(None, max_length=16)
    n: Literal[1] | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, Finite] | None = Field(None, max_length=300)
    conversation_id: str | int | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    reasoning_effort: str | None = None
    chat_template_mode: str = "auto"


class CompletionRequest(_Common):
    prompt: (str | list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]]
             | list[str] | list[list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]]])
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0: only the prompt's log-probabilities (with echo)
    suffix: Literal[""] | None = None


# What each top-level field must be, in the words of the error message.
_FIELD_RULES = {
    "messages": "a non-empty array of messages",
    "model": "a string (the id /v1/models lists)",
    "temperature": "a number in [0, 2]", "top_p": "a number in (0, 1]",
    "top_k": "an integer >= 0 (0 or -1 = off)", "min_p": "a number in [0, 1)",
    "repetition_penalty": "a number > 0",
    "presence_penalty": "a number in [-2, 2]", "frequency_penalty": "a number in [-2, 2]",
    "seed": "an integer in [0, 2**64)",
    "max_tokens": "an integer >= 1", "max_completion_tokens": "an integer >= 1",
    "stop": "a string or an array of at most 16 strings",
    "n": "1 (only n=1 is supported)", "stream": "true or false",
    "stream_options": "an object such as {\"include_usage\": true}",
    "logprobs": "true or false (chat), an integer in [0, 5] (completions)",
    "top_logprobs": "an integer in [0, 20] (with logprobs: true)",
    "logit_bias": "an object of at most 300 token ids (strings) to numbers in [-100, 100]",
    "echo": "true or false", "suffix": "empty (suffix is not supported)",
    "conversation_id": "a string or an integer",
    "response_format": "{\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                       "\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
    "tools": "an array of {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": {...}}}",
    "tool_choice": "'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
    "parallel_tool_calls": "true or false",
    "chat_template_kwargs": "an object", "enable_thinking": "true or false",
    "reasoning_effort": "a string", "chat_template_mode": "a string",
    "prompt": "a non-empty string, or an array of token ids in [0, 2**31) (batches are not supported)",
}


def validation_error(errors: Sequence[Any], body: Any) -> APIError:
    """One 400 from pydantic's errors: the most specific one, its place written as a JSON path
    (messages[0].content[1].type) and, for a top-level field, what the field must be."""
    if not errors:
        return bad_request("invalid request")
    best = max(errors, key=lambda e: len(_json_path(e.get("loc", ()), body)[1]))
    kind = best.get("type", "")
    if kind == "json_invalid":
        detail = (best.get("ctx") or {}).get("error", "")
        return bad_request(f"the request body is not valid JSON ({detail})")
    path, parts = _json_path(best.get("loc", ()), body)
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        path += ".type"
        parts.append("type")
    if not parts:
        return bad_request("the request body must be a JSON object")
    shown = repr(best.get("input"))
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    field = parts[0]
    if field in _FIELD_RULES and (len(parts) == 1 or field not in ("messages", "tools")):
        # a field that is one value: what it must be says more than where inside it went wrong
        value = body.get(field) if isinstance(body, dict) else None
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        return bad_request(f"'{field}' must be {_FIELD_RULES[field]}, got {shown}", field)
    message = str(best.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind in ("union_tag_invalid", "union_tag_not_found"):  # the one tagged union: content parts
        message = "a content part's type must be 'text' or 'image_url'"
    return bad_request(f"{path}: {message} (got {shown})", path)


def _json_path(loc: Sequence[Any], body: Any) -> tuple[str, list[Any]]:
    """pydantic's loc ("body", "messages", 0, "content", "list[...]", 0, "text", "type") as the path
    through the request body (messages[0].content[0].type): union branch names and tagged-union tags
    are never keys of the body, so they are left out by walking the body alongside."""
    loc = list(loc)[1:] if loc and loc[0] == "body" else list(loc)
    parts: list[Any] = []
    node: Any = body
    for i, seg in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(seg, int) and isinstance(node, list) and 0 <= seg < len(node):
            parts.append(seg)
            node = node[seg]
        elif isinstance(seg, str) and isinstance(node, dict) and seg in node:
            parts.append(seg)
            node = node[seg]
        elif last and isinstance(seg, str) and isinstance(node, dict) and "[" not in seg:
            parts.append(seg)  # a missing field
    path = ""
    for p in parts:
        path += f"[{p}]" if isinstance(p, int) else (f".{p}" if path else p)
    return path, parts


def sampling_params(req: _Common, *, default_max_tokens: int | None, context_length: int | None):
    """SamplingParams from a validated request; max_tokens beyond the context is capped to it."""
    from .sampling import SamplingParams

    kwargs: dict[str, Any] = {}
    for key in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty"):
        value = getattr(req, key)
        if value is not None:
            kwargs[key] = float(value)
    if req.top_k is not None:
        kwargs["top_k"] = max(0, req.top_k)
    if req.seed is not None:
        kwargs["seed"] = req.seed
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = asked if asked is not None else default_max_tokens
    if isinstance(req, CompletionRequest) and req.echo:
        kwargs["prompt_logprobs"] = req.logprobs or 0  # the echoed prompt's tokens and their logprobs
    elif asked == 0:
        raise bad_request("max_tokens 0 asks for nothing: it is for echo (the prompt's log-probabilities)",
                          "max_tokens")
    if max_tokens is not None:
        kwargs["max_tokens"] = min(max_tokens, context_length) if context_length else max_tokens
    kwargs["answer_format"] = json_format(req)
    kwargs["logprobs"] = logprobs_asked(req)
    if req.logit_bias:
        try:
            kwargs["logit_bias"] = tuple((int(k), float(v)) for k, v in req.logit_bias.items())
        except ValueError:
            raise bad_request("logit_bias must map token ids (as strings of digits) to numbers in [-100, 100]",
                              "logit_bias") from None
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as exc:
        raise bad_request(f"invalid sampling parameters: {exc}") from exc


def logprobs_asked(req: _Common) -> int | None:
    """How many alternatives each token's log-probabilities list (None: no log-probabilities): chat's
    logprobs + top_logprobs, or the legacy completions' logprobs integer."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    if isinstance(req, CompletionRequest):
        return req.logprobs
    return None


def _logprob_entry(c: TokenChoice) -> dict[str, Any]:
    return {"token": c.data.decode("utf-8", errors="replace"), "logprob": c.logprob, "bytes": list(c.data)}


def chat_logprobs(events: Sequence[GenerationEvent]) -> list[dict[str, Any]]:
    """OpenAI chat `logprobs.content` entries of the tokens behind events (one per generated token
    that is not an end token; the reasoning's tokens included)."""
    out = []
    for ev in events:
        lp = ev.logprobs
        if lp is not None:
            out.append(dict(_logprob_entry(lp.chosen), top_logprobs=[_logprob_entry(c) for c in lp.top]))
    return out


def completion_logprobs(events: Sequence[GenerationEvent], offset: int = 0,
                        prompt: Sequence[TokenLogprobs] = ()) -> dict[str, Any]:
    """The legacy completions `logprobs` object of an echoed prompt's tokens and then the tokens behind
    events; text offsets count characters from `offset`. The prompt's first token has none (null)."""
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float | None] | None] = []
    offsets: list[int] = []
    entries = list(prompt) + [ev.logprobs for ev in events if ev.logprobs is not None]
    for lp in entries:
        piece = lp.chosen.data.decode("utf-8", errors="replace")
        tokens.append(piece)
        lps.append(lp.chosen.logprob)
        first = lp.chosen.logprob is None
        tops.append(None if first else {c.data.decode("utf-8", errors="replace"): c.logprob for c in lp.top})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def echoed_prompt(events: Sequence[GenerationEvent | None]) -> tuple[TokenLogprobs, ...]:
    """The prompt's scored tokens (GenerationEvent.prompt_logprobs, on a generation's first event)."""
    for ev in events:
        if ev is not None and ev.prompt_logprobs is not None:
            return ev.prompt_logprobs
    return ()


def prompt_text(prompt: Sequence[TokenLogprobs]) -> str:
    return b"".join(lp.chosen.data for lp in prompt).decode("utf-8", errors="replace")


def json_format(req: _Common) -> JsonFormat | None:
    """The answer's format from response_format: none for "text", any JSON object for "json_object",
    the schema's JSON for "json_schema" (engine/json_output.py: the keywords it holds answers to; any
    other is a 400 naming it). With tools offered the answer could not be a tool call, so the two are
    refused together."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if isinstance(req, ChatRequest) and req.tools and req.tool_choice != "none":
        raise bad_request("response_format json_object / json_schema cannot be combined with tools (the "
                          "answer could not be a tool call); send one or the other", "response_format")
    if fmt.type == "json_object":
        return json_object_format()
    spec = fmt.json_schema
    if spec is None or spec.schema_ is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema (a JSON Schema "
                          "object)", "response_format")
    try:
        return json_schema_format(spec.schema_, spec.name)
    except SchemaError as exc:
        raise bad_request(f"response_format.json_schema.schema: {exc}", "response_format") from exc


def stop_strings(req: _Common) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else [s for s in req.stop if s]


def parse_messages(messages: Sequence[ChatMessage]) -> list[dict]:
    """Validated chat messages as the chat template takes them (developer -> system, tool-call
    arguments as objects, pictures only as data: URLs)."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        if m.content is None:
            if m.role != "assistant" or not m.tool_calls:
                raise bad_request(f"{where}.content is missing", f"{where}.content")
            msg["content"] = ""
        elif isinstance(m.content, str):
            msg["content"] = m.content
        else:
            msg["content"] = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(m.content)]
        if m.role == "assistant" and m.tool_calls is not None:
            msg["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        if m.role == "tool" and m.tool_call_id is not None:
            msg["tool_call_id"] = str(m.tool_call_id)
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def _part(part: TextPart | ImagePart, where: str) -> dict:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    url = part.image_url.url if isinstance(part.image_url, ImageURL) else part.image_url
    # Only inline pictures: the server neither fetches from the web nor reads the host's files on a
    # client's say-so (a path would let any client probe the machine's disk).
    if not url.startswith("data:"):
        raise bad_request(f"{where}: send the picture inline as a data: URL (base64); the server "
                          "does not fetch URLs or read file paths", f"{where}.image_url")
    return {"type": "image_url", "image_url": {"url": url}}


def _call(call: ToolCall, where: str) -> dict:
    args = call.function.arguments
    if isinstance(args, str):  # OpenAI sends arguments as a JSON string; templates want a mapping
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError) as exc:
            raise bad_request(f"{where}.function.arguments is not valid JSON ({exc})",
                              f"{where}.function.arguments") from exc
        if not isinstance(args, dict):
            raise bad_request(f"{where}.function.arguments must be a JSON object",
                              f"{where}.function.arguments")
        try:
            _check_unicode(args, f"{where}.function.arguments")
        except ValueError as exc:
            raise bad_request(str(exc), f"{where}.function.arguments") from exc
    return {"id": call.id or _call_id(), "type": "function",
            "function": {"name": call.function.name, "arguments": args}}


def parse_tools(req: ChatRequest) -> list[dict] | None:
    """The tools to offer: none for tool_choice 'none', only the named one for a named choice."""
    if req.tools is None or req.tool_choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not chosen:
            raise bad_request(f"tool_choice names '{choice.function.name}', which is not in 'tools'",
                              "tool_choice")
        return chosen  # only that tool is offered, and start_chat's answer format calls it
    return tools or None


_THINK_TAGS = re.compile(r"(?<!\S)/(no_think|think)(?!\S)")


def thinking_switch(req: ChatRequest, messages: list[dict]) -> bool:
    """Whether to think: chat_template_kwargs.enable_thinking or a top-level enable_thinking when
    given; else the last /think or /no_think tag in the system and user messages (default: think).
    The tags are removed from the messages either way."""
    explicit = (req.chat_template_kwargs or {}).get("enable_thinking", req.enable_thinking)
    if explicit is None and req.reasoning_effort in ("none", "minimal"):
        explicit = False  # OpenAI's way of asking for no reasoning
    if explicit is not None and not isinstance(explicit, bool):
        raise bad_request("enable_thinking must be true or false", "chat_template_kwargs")
    last_tag = None
    for m in messages:
        if m["role"] in ("user", "system"):
            tag = _strip_think_tags(m)
            last_tag = tag or last_tag
    if explicit is not None:
        return explicit
    return last_tag != "no_think"


def _strip_think_tags(m: dict) -> str | None:
    """Remove /think and /no_think from a message; return the last one found (or None)."""
    found = None

    def strip(text: str) -> str:
        nonlocal found
        tags = _THINK_TAGS.findall(text)
        if tags:
            found = tags[-1]
            text = _THINK_TAGS.sub("", text).strip()
        return text

    c = m.get("content")
    if isinstance(c, str):
        m["content"] = strip(c)
    elif isinstance(c, list):
        for p in c:
            if p.get("type") == "text":
                p["text"] = strip(p["text"])
    return found


# ---------------------------------------------------------------------------------------------------
# Tool-call output (Qwen formats)

_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def parse_tool_calls(text: str, tools: list[dict] | None) -> tuple[str, list[dict]]:
    """Split model output into (content before the first `<tool_call>`, tool calls).

    Qwen3.5/3.6 write `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n...
    </function>\\n</tool_call>`; Qwen3 wrote JSON: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
    </tool_call>`. Both are understood. A parameter value is kept as a string when the tool's schema
    says string, else read as JSON when it parses. Unparseable blocks stay in the content."""
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return text, []
    content = text[:start].rstrip()
    schemas = {t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties") or {}
               for t in tools or []}
    calls = []
    leftovers = []
    for block in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text[start:], re.S):
        call = _parse_one_call(block.strip(), schemas)
        if call is None:
            leftovers.append(block)
        else:
            calls.append(call)
    if not calls:
        return text, []
    if leftovers:
        content = (content + "\n" + "\n".join(leftovers)).strip()
    return content, calls


def _parse_one_call(block: str, schemas: dict) -> dict | None:
    if block.startswith("{"):
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        return _tool_call(obj["name"], args)
    m = _XML_FUNCTION.search(block)
    if m is None:
        return None
    name = m.group(1).strip()
    props = schemas.get(name, {})
    args = {}
    for pname, raw in _XML_PARAMETER.findall(m.group(2)):
        pname = pname.strip()
        kind = (props.get(pname) or {}).get("type")
        if kind == "string":
            args[pname] = raw
            continue
        try:
            args[pname] = json.loads(raw)
        except json.JSONDecodeError:
            args[pname] = raw
    return _tool_call(name, args)


def _tool_call(name: str, args) -> dict:
    return {"id": _call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallHold:
    """While streaming with tools: passes content through until `<tool_call>` starts, then keeps
    everything from there (to be parsed at the end) and holds back a possible partial tag."""

    def __init__(self, active: bool):
        self.active = active
        self.buffer = ""  # text not yet shown (a partial tag, or everything from <tool_call>)
        self.in_call = False

    def feed(self, text: str) -> str:
        if not self.active:
            return text
        if self.in_call:
            self.buffer += text
            return ""
        text = self.buffer + text
        i = text.find(TOOL_CALL_OPEN)
        if i >= 0:
            self.in_call = True
            self.buffer = text[i:]
            return text[:i].rstrip()  # the blank line before a call is not part of the answer
        keep = 0
        for n in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
            if text.endswith(TOOL_CALL_OPEN[:n]):
                keep = n
                break
        shown = text[: len(text) - keep]
        # Trailing whitespace waits too: it is dropped if a call follows, shown if more text does.
        visible = shown.rstrip()
        self.buffer = shown[len(visible) :] + text[len(text) - keep :]
        return visible


# ---------------------------------------------------------------------------------------------------
# The app


def _usage_dict(event: RuntimeEvent | None) -> dict:
    u = event.usage if event is not None else None
    if u is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    out = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
           "total_tokens": u.total_tokens,
           "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
    return out


def _timings(event: RuntimeEvent | None) -> dict | None:
    timing = (event.data or {}).get("timing") if event is not None else None
    return timing.to_dict() if timing is not None else None


class _EventPump:
    """Moves one request's runtime events onto the event loop: a small thread blocks on the handle so
    the loop never does."""

    def __init__(self, handle: RequestHandle, loop: asyncio.AbstractEventLoop):
        self.handle = handle
        self.queue: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name=f"minecart-http-{handle.id}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for ev in self.handle.events():
                self._loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:  # the loop closed (server shutting down)
            self.handle.cancel()

    async def next(self, timeout: float | None = None) -> RuntimeEvent | None:
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None


def _host_name(host_header: str) -> str:
    """The name part of a Host header ("[::1]:8080" -> "::1", "localhost:80" -> "localhost")."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class BrowserGuard:
    """Who may talk to the server from a browser, checked before a route runs.

    A web page the user visits can send requests to a local server: a "simple" cross-site POST
    (Content-Type text/plain, no preflight) or, through DNS rebinding, a same-origin request under a
    name the page controls. So: a request carrying an `Origin` header is served only when that origin
    is allowed (`allowed_origins`; "*" allows any); the `Host` header must name an allowed host
    (loopback names, the address the server listens on, `allowed_hosts`; "*" allows any, the default
    when listening on every interface); and request bodies must be declared as JSON (checked by the
    routes). Programs (curl, OpenAI clients) send no Origin and are unaffected."""

    def __init__(self, allowed_origins=(), allowed_hosts=(), listen_host: str | None = None):
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}
        hosts = {h.lower() for h in allowed_hosts} | set(LOOPBACK_HOSTS)
        if listen_host:
            if listen_host in ("0.0.0.0", "::", ""):
                hosts.add("*")
            else:
                hosts.add(listen_host.strip("[]").lower())
        self.hosts = hosts

    def refusal(self, headers) -> APIError | None:
        origin = headers.get("origin")
        if origin is not None and "*" not in self.origins and origin.rstrip("/").lower() not in self.origins:
            return APIError(403, f"requests from the web page at {origin} are not allowed; start the "
                            "server with --allow-origin ORIGIN to let that page use it",
                            type="permission_error", code="origin_not_allowed")
        host = _host_name(headers.get("host", ""))
        if "*" not in self.hosts and host not in self.hosts:
            return APIError(403, f"host name '{host}' is not one this server answers to (a browser "
                            "page may be reaching it through DNS rebinding); use "
                            "http://127.0.0.1:PORT, or start the server with --allow-host NAME",
                            type="permission_error", code="host_not_allowed")
        return None


# Paths that need the API key when one is set (/health stays open for monitors; it shows no path).
KEYED_PREFIXES = ("/v1", "/metrics", "/openapi.json")


class _Gatekeeper:
    """ASGI middleware in front of every route: the BrowserGuard's checks, an allowed page's CORS
    preflight and headers, the API key, a JSON content type and the body size limit on POSTs (read
    here, before FastAPI parses anything), and a 500 for an exception a route lets out, answered here
    so the kept-alive connection survives it (Starlette's own handler re-raises to the server, which
    then drops the connection). Plain ASGI rather than Starlette's BaseHTTPMiddleware, which hides a
    client's disconnect from the routes (a request whose client went away must cancel its
    generation)."""

    def __init__(self, app, guard: BrowserGuard, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.guard = guard
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 0  # 0: the client went away before any answer started

        async def logged_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self._handle(scope, receive, logged_send)
        finally:
            if access_log.isEnabledFor(logging.INFO):
                client = scope.get("client") or ("", 0)
                access_log.info(json.dumps({
                    "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "client": f"{client[0]}:{client[1]}", "method": scope["method"],
                    "path": scope["path"], "status": status,
                    "duration_ms": round((time.perf_counter() - t0) * 1000, 1)}))

    async def _handle(self, scope, receive, send):
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refused = self.guard.refusal(headers) or self._key_refusal(scope["path"], headers)
        origin = headers.get("origin")
        if refused is None and scope["method"] == "POST":
            refused, receive = await self._read_body(headers, receive)
        if refused is not None:
            await JSONResponse(refused.body(), status_code=refused.status)(scope, receive, send)
            return
        if origin is None:
            await self._run_app(scope, receive, send)
            return
        cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if scope["method"] == "OPTIONS":  # an allowed page's preflight
            await Response(status_code=204, headers={
                **cors, "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": "authorization, content-type",
                "Access-Control-Max-Age": "600"})(scope, receive, send)
            return
        extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in cors.items()]

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) + extra)
            await send(message)

        await self._run_app(scope, receive, send_with_cors)

    async def _run_app(self, scope, receive, send) -> None:
        started = False

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            log.exception("request %s %s failed", scope.get("method"), scope.get("path"))
            if started:  # a stream already under way: all that is left is to end it
                return
            err = error_from_exception(exc)
            await JSONResponse(err.body(), status_code=err.status, headers=err.headers)(scope, receive,
                                                                                         send)

    async def _read_body(self, headers: dict, receive):
        """(a refusal or None, a receive that replays the body read here). The body must be declared
        as JSON (also what keeps a web page's "simple" text/plain POST from running anything) and
        stay within max_body_bytes, checked while reading, before anything is parsed."""
        media_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            return APIError(415, "send the request body as JSON with 'Content-Type: application/json'"
                            f" (got {media_type or 'no content type'!r})",
                            code="unsupported_media_type"), receive
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return _too_large(self.max_body_bytes), receive
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away mid-body
                return APIError(499, "client disconnected"), receive
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return _too_large(self.max_body_bytes), receive
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        return None, replay

    def _key_refusal(self, path: str, headers: dict) -> APIError | None:
        if self.api_key is None or not path.startswith(KEYED_PREFIXES):
            return None
        given = headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if hmac.compare_digest(token.encode(), self.api_key):
            return None
        return APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                        type="authentication_error", code="invalid_api_key")


def create_app(runtime: Runtime, *, model_name: str | None = None, default_max_tokens: int | None = None,
               api_key: str | None = None, allowed_origins=(), allowed_hosts=(),
               listen_host: str | None = "127.0.0.1", max_body_bytes: int = MAX_BODY_BYTES):
    """The FastAPI app. `model_name` overrides the id /v1/models reports (default: the file's stem);
    `api_key`, when set, is required as `Authorization: Bearer KEY` on every /v1 route.
    allowed_origins / allowed_hosts / listen_host: see BrowserGuard; max_body_bytes: the largest
    request body read (413 past it)."""
    app = FastAPI(title="minecart", description="OpenAI-compatible API of the minecart engine",
                  docs_url=None, redoc_url=None)
    app.state.runtime = runtime
    guard = BrowserGuard(allowed_origins, allowed_hosts, listen_host)

    def error_response(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    app.add_middleware(_Gatekeeper, guard=guard, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        return error_response(validation_error(exc.errors(), exc.body))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):
            # FastAPI's words for a body json.loads could not descend into
            message = "the request body is nested too deeply to parse; send at most a few levels"
        return error_response(APIError(exc.status_code, message, type=kind))

    @app.exception_handler(MinecartError)
    async def _engine_error(request, exc: MinecartError):
        return error_response(error_from_exception(exc))

    def loaded_info() -> ModelInfo:
        info = runtime.model_info
        if info is None:
            raise APIError(503, "no model is loaded; start the server with a model or load one in the "
                           "app", type="server_error", code="model_not_loaded")
        return info

    def current_model_id() -> str:
        info = loaded_info()
        if model_name:
            return model_name
        return Path(info.path).stem or info.name

    def check_model(requested: str | None) -> str:
        """The served model's id; 404 for a request naming another model (as OpenAI answers).
        The id, the file name and the file's stem all name the loaded model."""
        model_id = current_model_id()
        if requested is None or requested == model_id:
            return model_id
        name = Path(loaded_info().path).name
        if requested in (name, Path(name).stem):
            return model_id
        raise APIError(404, f"model '{requested[:200]}' is not loaded; this server runs '{model_id}' "
                       "(GET /v1/models lists it)", type="not_found_error", param="model",
                       code="model_not_found")

    def public_status() -> dict:
        """runtime.status() without the model's file path (a client learns the model id only)."""
        status = runtime.status()
        if status.get("model"):
            status["model"] = {k: v for k, v in status["model"].items() if k != "path"}
        return status

    @app.get("/health")
    async def health():
        status = public_status()
        return {"status": "ok" if status["alive"] else "error", "model_loaded": runtime.loaded,
                "busy": status["busy"], "queued": status["queued"],
                "model": status["model"]}

    @app.get("/metrics")
    async def metrics(request: Request, since: float | None = None, format: str | None = None):
        snap = runtime.metrics.snapshot(since=since)
        status = public_status()
        accept = request.headers.get("accept", "")
        if format == "prometheus" or (format is None and "application/json" not in accept and (
                "text/plain" in accept or "openmetrics" in accept)):
            return Response(engine_text(status, snap, runtime.batching_metrics()),
                            media_type=PROMETHEUS_CONTENT_TYPE)
        if format not in (None, "json"):
            raise bad_request(f"'format' must be 'json' or 'prometheus', got {format[:40]!r}", "format")
        snap["runtime"] = status
        batching = runtime.batching_metrics()
        if batching is not None:
            snap["batching"] = batching
        return snap

    def model_card() -> dict:
        info = loaded_info()
        return {"id": current_model_id(), "object": "model", "created": int(time.time()),
                "owned_by": "minecart", "architecture": info.architecture,
                "context_length": info.context_length, "context_limit": info.context_limit}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()] if runtime.loaded else []}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        card = model_card()
        if model_id != card["id"]:
            raise APIError(404, f"model '{model_id}' is not loaded; this server runs '{card['id']}'",
                           type="not_found_error", param="model", code="model_not_found")
        return card

    async def run_request(request: Request, handle: RequestHandle, on_event, *, stream: bool):
        """Drive one runtime request: yields what `on_event` returns; cancels on disconnect."""
        pump = _EventPump(handle, asyncio.get_running_loop())
        loop = asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_POLL_S
        try:
            while True:
                ev = await pump.next(None if stream else DISCONNECT_POLL_S)
                # A streaming response learns of a disconnect from Starlette (its task is cancelled);
                # a plain one has to ask, also while tokens keep arriving.
                if not stream and loop.time() >= next_check:
                    next_check = loop.time() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        handle.cancel()
                        return
                if ev is None:
                    continue
                out = on_event(ev)
                if out is not None:
                    yield out
                if ev.terminal:
                    return
        finally:
            # Normal end: a no-op. Disconnect: the streaming task is cancelled here, so is the engine.
            if not handle.done:
                handle.cancel()

    def start_chat(req: ChatRequest) -> tuple[RequestHandle, list[dict] | None, SamplingParams]:
        """Submit a validated chat request to the runtime: its handle, the tools offered, the params."""
        messages = parse_messages(req.messages)
        tools = parse_tools(req)
        enable_thinking = thinking_switch(req, messages)
        params = sampling_params(req, default_max_tokens=default_max_tokens,
                                 context_length=loaded_info().context_limit)
        stops = stop_strings(req)
        conversation = req.conversation_id if req.conversation_id is not None else (
            SHARED_CONVERSATION if runtime.parallel == 1 else None)
        # an extra: "on" / "off" / "auto" (default: plain text for a pretrained base model)
        template_mode = req.chat_template_mode
        if template_mode not in PROMPT_MODES:
            raise bad_request(f"'chat_template_mode' must be one of {', '.join(PROMPT_MODES)}, got "
                              f"{template_mode[:40]!r}", "chat_template_mode")
        if tools and (req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice)):
            # a call is required: the answer is drawn in the template's call format, among these tools
            # (one call for a named function or parallel_tool_calls false)
            parallel = req.parallel_tool_calls is not False and not isinstance(req.tool_choice, NamedToolChoice)
            params = replace(params, answer_format=tool_call_format(tools, parallel))
        handle = runtime.chat(messages, params, enable_thinking=enable_thinking,
                              conversation_id=conversation, tools=tools, stop=stops,
                              chat_template=template_mode)
        return handle, tools, params

    async def run_to_end(request: Request, handle: RequestHandle, collect: Collected) -> RuntimeEvent | None:
        """A non-streamed request run to its terminal event (None: the client went away); an engine
        error is raised as its HTTP error."""
        final = None
        async for ev in run_request(request, handle, collect, stream=False):
            final = ev
        if final is not None and final.kind == "error":
            raise error_from_exception(final.error or MinecartError(final.text))
        return final

    def client_gone() -> JSONResponse:
        return JSONResponse(APIError(499, "client disconnected").body(), status_code=499)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        model_id = check_model(req.model)
        stream = bool(req.stream)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        handle, tools, params = start_chat(req)
        completion_id = "chatcmpl-" + uuid.uuid4().hex
        created = int(time.time())

        with_logprobs = params.logprobs is not None
        if stream:
            return StreamingResponse(
                _chat_stream(request, handle, completion_id, created, model_id, tools, include_usage,
                             with_logprobs),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        got = Collected()
        final = await run_to_end(request, handle, got)
        if final is None:
            return client_gone()
        content, calls = got.content_and_calls(tools)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        reasoning = got.reasoning
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        finish = final.finish_reason or "stop"
        if calls and finish == "stop":
            finish = "tool_calls"
        return {"id": completion_id, "object": "chat.completion", "created": created, "model": model_id,
                "choices": [{"index": 0, "message": message, "finish_reason": finish,
                             "logprobs": ({"content": chat_logprobs(got.generated), "refusal": None}
                                          if with_logprobs else None)}],
                "usage": _usage_dict(final), "timings": _timings(final)}

    async def _chat_stream(request, handle, completion_id, created, model_id, tools, include_usage,
                           with_logprobs: bool):
        hold = ToolCallHold(active=bool(tools))
        pending: list[dict[str, Any]] = []  # log-probabilities of tokens whose text no chunk carried yet

        def chunk(delta: dict, finish=None, usage=None) -> str:
            lps = None
            if with_logprobs and pending and delta:
                lps = {"content": list(pending), "refusal": None}
                pending.clear()
            obj = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                   "model": model_id,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lps}]}
            if usage is not None:
                obj["usage"] = usage
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        def on_event(ev: RuntimeEvent):
            if ev.kind == "token" and with_logprobs and ev.generation is not None:
                pending.extend(chat_logprobs([ev.generation]))
            if ev.kind == "token":
                out = []
                if ev.thinking:
                    out.append(chunk({"reasoning_content": ev.thinking}))
                text = hold.feed(ev.text)
                if text:
                    out.append(chunk({"content": text}))
                return "".join(out) or None
            if ev.kind == "error":
                err = error_from_exception(ev.error or MinecartError(ev.text))
                return f"data: {json.dumps(err.body())}\n\n"
            if ev.terminal:
                out = []
                finish = ev.finish_reason or "stop"
                if hold.buffer:
                    content, calls = parse_tool_calls(hold.buffer, tools)
                    if calls:
                        for k, call in enumerate(calls):
                            out.append(chunk({"tool_calls": [dict(call, index=k)]}))
                        if finish == "stop":
                            finish = "tool_calls"
                    elif content:
                        out.append(chunk({"content": content}))
                if pending:  # tokens that showed no text (a stop string's, the held tool call's)
                    out.append(chunk({"content": ""}))
                out.append(chunk({}, finish=finish))
                if include_usage:
                    obj = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                           "model": model_id, "choices": [], "usage": _usage_dict(ev)}
                    out.append(f"data: {json.dumps(obj)}\n\n")
                out.append("data: [DONE]\n\n")
                return "".join(out)
            return None

        yield chunk({"role": "assistant", "content": ""})
        async for piece in run_request(request, handle, on_event, stream=True):
            yield piece

    stored = ResponseStore()

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request):
        model_id = check_model(req.model)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            found = stored.get(req.previous_response_id)
            if found is None:
                raise APIError(404, f"previous_response_id '{req.previous_response_id[:80]}' is not known: this "
                               f"server keeps its last {STORE_RESPONSES} stored responses in memory",
                               type="not_found_error", param="previous_response_id", code="response_not_found")
            history = copy.deepcopy(found[1])
        try:
            body = chat_body(req, history)
        except RequestShapeError as exc:
            raise bad_request(str(exc), exc.param) from exc
        try:
            chat = ChatRequest.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc.errors(), body) from exc
        conversation = body["messages"][1:] if req.instructions else body["messages"]
        handle, tools, params = start_chat(chat)
        resp_id, created = new_id("resp"), created_now()

        def keep(response: dict[str, Any], reasoning: str, content: str, calls: list[dict[str, Any]]) -> None:
            if req.store is not False:
                stored.put(response, conversation + [assistant_message(reasoning, content, calls)])

        if req.stream:
            events = ResponseEvents(resp_id, created, model_id, req)
            hold = ToolCallHold(active=bool(tools))
            thinking_only = [0]  # tokens that only thought

            def on_event(ev: RuntimeEvent):
                if ev.kind == "token":
                    out = events.reasoning_delta(ev.thinking) if ev.thinking else ""
                    if ev.thinking and not ev.text and ev.generation is not None:
                        thinking_only[0] += 1
                    text = hold.feed(ev.text)
                    return out + (events.text_delta(text) if text else "") or None
                if ev.kind == "error":
                    err = error_from_exception(ev.error or MinecartError(ev.text))
                    return events.error(err.message, err.code or err.type)
                if ev.terminal:
                    out = ""
                    calls: list[dict[str, Any]] = []
                    if hold.buffer:
                        content, calls = parse_tool_calls(hold.buffer, tools)
                        if content and not calls:
                            out += events.text_delta(content)
                    tail, final = events.finish(calls, ev.finish_reason,
                                                responses_usage(_usage_dict(ev), thinking_only[0]))
                    keep(final, events.reasoning, events.text, calls)
                    return out + tail
                return None

            async def gen():
                yield events.start()
                async for piece in run_request(request, handle, on_event, stream=True):
                    yield piece

            return StreamingResponse(gen(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        got = Collected()
        final = await run_to_end(request, handle, got)
        if final is None:
            return client_gone()
        content, calls = got.content_and_calls(tools)
        reasoning = got.reasoning
        finish = final.finish_reason or "stop"
        response = response_object(resp_id, created, model_id, req,
                                   output_items(reasoning, content, calls, finish != "length"), finish,
                                   responses_usage(_usage_dict(final), got.thinking_only))
        keep(response, reasoning, content, calls)
        return response

    @app.get("/v1/responses/{resp_id}")
    async def get_response(resp_id: str):
        found = stored.get(resp_id)
        if found is None:
            raise APIError(404, f"response '{resp_id[:80]}' is not known: this server keeps its last "
                           f"{STORE_RESPONSES} stored responses in memory", type="not_found_error",
                           code="response_not_found")
        return found[0]

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        model_id = check_model(req.model)
        prompt: Any = req.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if not prompt or (isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt)):
            raise bad_request(f"'prompt' must be {_FIELD_RULES['prompt']}", "prompt")
        params = sampling_params(req, default_max_tokens=default_max_tokens or 16,
                                 context_length=loaded_info().context_limit)
        stops = stop_strings(req)
        conversation = req.conversation_id
        handle = runtime.complete(prompt, params, conversation_id=conversation, stop=stops)
        completion_id = "cmpl-" + uuid.uuid4().hex
        created = int(time.time())

        with_logprobs = params.logprobs is not None
        echo = bool(req.echo)
        offset = 0  # characters of text sent so far (the legacy logprobs' text_offset)

        def obj(text: str, finish=None, usage=None, generated: Sequence[GenerationEvent] = (),
                prompt: Sequence[TokenLogprobs] = ()) -> dict:
            lps = completion_logprobs(generated, offset, prompt) if with_logprobs and (generated or prompt) \
                else None
            out = {"id": completion_id, "object": "text_completion", "created": created,
                   "model": model_id,
                   "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": lps}]}
            if usage is not None:
                out["usage"] = usage
            return out

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def echo_chunk(ev: RuntimeEvent) -> str:
                """The echoed prompt, as the first chunk, once its scores came (the first event's)."""
                nonlocal offset, echo
                prompt = echoed_prompt([ev.generation])
                if not echo or not prompt:
                    return ""
                echo = False
                text = prompt_text(prompt)
                piece = obj(text, prompt=prompt)
                offset += len(text)
                return f"data: {json.dumps(piece, ensure_ascii=False)}\n\n"

            def on_event(ev: RuntimeEvent):
                nonlocal offset
                head = echo_chunk(ev)
                if ev.kind == "token":
                    text = ev.thinking + ev.text
                    gen = [ev.generation] if with_logprobs and ev.generation is not None \
                        and ev.generation.logprobs is not None else []
                    if not text and not gen:
                        return head or None
                    piece = obj(text, generated=gen)
                    offset += len(text)
                    return head + f"data: {json.dumps(piece, ensure_ascii=False)}\n\n"
                if ev.kind == "error":
                    err = error_from_exception(ev.error or MinecartError(ev.text))
                    return f"data: {json.dumps(err.body())}\n\n"
                if ev.terminal:
                    usage = _usage_dict(ev) if include_usage else None
                    last = obj("", finish=ev.finish_reason or "stop", usage=usage)
                    return head + f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n"
                return None

            async def gen():
                async for piece in run_request(request, handle, on_event, stream=True):
                    yield piece

            return StreamingResponse(gen(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        got = Collected()
        final = await run_to_end(request, handle, got)
        if final is None:
            return client_gone()
        prompt = echoed_prompt([*got.generated, final.generation]) if echo else ()
        out = obj(prompt_text(prompt) + got.all_text, finish=final.finish_reason or "stop",
                  usage=_usage_dict(final), generated=got.generated, prompt=prompt)
        out["timings"] = _timings(final)
        return out

    return app


class Collected:
    """A non-streamed generation's token events, gathered for its one response (run_to_end's collector)."""

    def __init__(self) -> None:
        self.answer: list[str] = []
        self.thinking: list[str] = []
        self.generated: list[GenerationEvent] = []
        self.thinking_only = 0  # generated tokens that brought reasoning and no answer text

    def __call__(self, ev: RuntimeEvent) -> RuntimeEvent | None:
        if ev.kind == "token":
            self.answer.append(ev.text)
            self.thinking.append(ev.thinking)
            if ev.generation is not None:
                self.generated.append(ev.generation)
                self.thinking_only += bool(ev.thinking and not ev.text)
        return ev if ev.terminal else None

    @property
    def reasoning(self) -> str:
        return "".join(self.thinking)

    @property
    def all_text(self) -> str:
        """Reasoning and answer as they came (a completion shows both)."""
        return "".join(t + a for t, a in zip(self.thinking, self.answer, strict=True))

    def content_and_calls(self, tools: list[dict] | None) -> tuple[str, list[dict]]:
        text = "".join(self.answer)
        return parse_tool_calls(text, tools) if tools else (text, [])


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit // (1024 * 1024)} MiB; send less (a long "
                    "prompt beyond the model's context would be refused anyway)", code="request_too_large")


# ---------------------------------------------------------------------------------------------------
# Running it


class ServerThread:
    """uvicorn serving `app` on a background thread (tests, the desktop app's "serve" switch).
    Port 0 picks a free port; `url` is known once `start()` returns."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host = host
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="minecart-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        self.server.run(sockets=[self._sock])

    def start(self, timeout: float = 10.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(runtime: Runtime, host: str = "127.0.0.1", port: int = 8080, *, model_name: str | None = None,
          log_level: str = "info") -> None:
    """Serve the API in the foreground until Ctrl+C."""
    import uvicorn

    app = create_app(runtime, model_name=model_name, listen_host=host)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3)
