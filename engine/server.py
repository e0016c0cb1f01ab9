"""OpenAI-compatible HTTP API (FastAPI + uvicorn) over a Runtime.

Endpoints: `GET /v1/models`, `POST /v1/chat/completions` (streaming SSE or one JSON body), `POST
/v1/completions`, `GET /health`, `GET /metrics` (JSON snapshot of engine metrics).

Chat requests take messages with text and image parts, `tools` + `tool_choice` (rendered by the model's
chat template; Qwen's `<tool_call>` output comes back as `tool_calls`), the usual sampling fields
(temperature, top_p, max_tokens / max_completion_tokens, stop, seed, presence/frequency penalty) and, as
extras, top_k, min_p and repetition_penalty. Thinking comes back as `reasoning_content`; it is turned off
with `chat_template_kwargs: {"enable_thinking": false}`, `"enable_thinking": false`, or a `/no_think` in
the last user or system message (`/think` turns it back on; both tags are removed from the text).
`chat_template_mode` (an extra: "auto", "on", "off") chooses between the chat template and the plain
text of the messages; "auto" (default) sends a pretrained base model plain text to continue.
`conversation_id` (an extra) keeps a chat in its own engine session; without it, requests share one
session, whose common-prefix reuse makes a client that resends the whole history cheap anyway.

Malformed requests get 400 with an OpenAI-style error body (`{"error": {"message", "type", "param",
"code"}}`); no response ever carries a traceback. A client that disconnects cancels its generation.

This module does no inference itself and never touches the model: everything goes through the Runtime.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import socket
import threading
import time
import uuid
from dataclasses import fields as dataclass_fields
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import (
    GenerationCancelled,
    ImageError,
    MinecartError,
    RequestError,
    TemplateError,
)
from .prompt import PROMPT_MODES
from .runtime import RequestHandle, Runtime, RuntimeEvent

# One engine session for requests without a conversation_id (prefix reuse across resent histories).
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
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

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
    if isinstance(exc, (RequestError, TemplateError, ImageError)):
        return bad_request(str(exc) or type(exc).__name__)
    if isinstance(exc, GenerationCancelled):
        return APIError(499, "the request was cancelled", type="cancelled", code="cancelled")
    if isinstance(exc, MinecartError):
        return APIError(500, str(exc), type="server_error", code=type(exc).__name__)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


# ---------------------------------------------------------------------------------------------------
# Request parsing


def _get(body: dict, key: str, types, default=None, *, check=None, what: str = ""):
    value = body.get(key, default)
    if value is None:
        return default
    # bool is an int subclass; a JSON true is never a valid number here.
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad_request(f"'{key}' must be {what or _type_names(types)}, got a boolean", key)
    if not isinstance(value, types):
        raise bad_request(f"'{key}' must be {what or _type_names(types)}, got {type(value).__name__}", key)
    if check is not None and not check(value):
        raise bad_request(f"'{key}' must be {what}, got {value!r}", key)
    return value


def _type_names(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
             list: "an array", dict: "an object"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def sampling_params(body: dict, *, default_max_tokens: int | None = None):
    """SamplingParams from the OpenAI fields (+ extras top_k, min_p, repetition_penalty)."""
    from .sampling import SamplingParams

    num = (int, float)
    kwargs: dict[str, Any] = {}
    t = _get(body, "temperature", num, check=lambda v: 0 <= v <= 2, what="a number in [0, 2]")
    if t is not None:
        kwargs["temperature"] = float(t)
    p = _get(body, "top_p", num, check=lambda v: 0 < v <= 1, what="a number in (0, 1]")
    if p is not None:
        kwargs["top_p"] = float(p)
    k = _get(body, "top_k", int, check=lambda v: v >= -1, what="an integer >= 0 (0 or -1 = off)")
    if k is not None:
        kwargs["top_k"] = max(0, int(k))
    mp = _get(body, "min_p", num, check=lambda v: 0 <= v < 1, what="a number in [0, 1)")
    if mp is not None:
        kwargs["min_p"] = float(mp)
    rp = _get(body, "repetition_penalty", num, check=lambda v: v > 0, what="a number > 0")
    if rp is not None:
        kwargs["repetition_penalty"] = float(rp)
    for key in ("presence_penalty", "frequency_penalty"):
        v = _get(body, key, num, check=lambda v: -2 <= v <= 2, what="a number in [-2, 2]")
        if v is not None:
            kwargs[key] = float(v)
    seed = _get(body, "seed", int)
    if seed is not None:
        kwargs["seed"] = int(seed)
    max_tokens = _get(body, "max_completion_tokens", int, check=lambda v: v >= 1,
                      what="an integer >= 1")
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, check=lambda v: v >= 1, what="an integer >= 1")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None:
        kwargs["max_tokens"] = int(max_tokens)
    known = {f.name for f in dataclass_fields(SamplingParams)}
    try:
        return SamplingParams(**{k: v for k, v in kwargs.items() if k in known})
    except (TypeError, ValueError) as exc:
        raise bad_request(f"invalid sampling parameters: {exc}") from exc


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
        return [s for s in stop if s]
    raise bad_request("'stop' must be a string or an array of at most 16 strings", "stop")


def _check_common(body: dict) -> None:
    n = _get(body, "n", int, 1)
    if n != 1:
        raise bad_request("only n=1 is supported", "n")
    _get(body, "stream", bool, False)
    if body.get("logprobs") or body.get("top_logprobs"):
        raise bad_request("logprobs are not supported", "logprobs")


def parse_messages(raw) -> list[dict]:
    """Validate OpenAI chat messages and convert them to what the chat template expects."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", where)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}",
                              f"{where}.role")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
        content = m.get("content")
        if content is None:
            if role != "assistant" or not m.get("tool_calls"):
                raise bad_request(f"{where}.content is missing", f"{where}.content")
            msg["content"] = ""
        elif isinstance(content, str):
            msg["content"] = content
        elif isinstance(content, list):
            msg["content"] = [_parse_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
        else:
            raise bad_request(f"{where}.content must be a string or an array of parts",
                              f"{where}.content")
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _parse_tool_calls(m["tool_calls"], where)
        if isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(m["tool_call_id"])
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _parse_part(part, where: str) -> dict:
    if not isinstance(part, dict):
        raise bad_request(f"{where} must be an object", where)
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.text must be a string", f"{where}.text")
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str) or not url:
            raise bad_request(f"{where}.image_url.url must be a string (a data: URL)",
                              f"{where}.image_url")
        # Only inline pictures: the server neither fetches from the web nor reads the host's files
        # on a client's say-so (a path would let any client probe the machine's disk).
        if not url.startswith("data:"):
            raise bad_request(f"{where}: send the picture inline as a data: URL (base64); the server "
                              "does not fetch URLs or read file paths", f"{where}.image_url")
        return {"type": "image_url", "image_url": {"url": url}}
    raise bad_request(f"{where}.type must be 'text' or 'image_url'; got {kind!r}", f"{where}.type")


def _parse_tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be an array", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}.tool_calls[{j}].function.name is missing",
                              f"{where}.tool_calls[{j}]")
        args = fn.get("arguments", {})
        if isinstance(args, str):  # OpenAI sends arguments as a JSON string; templates want a mapping
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                raise bad_request(f"{where}.tool_calls[{j}].function.arguments is not valid JSON "
                                  f"({exc})", f"{where}.tool_calls[{j}]") from exc
        if not isinstance(args, dict):
            raise bad_request(f"{where}.tool_calls[{j}].function.arguments must be a JSON object",
                              f"{where}.tool_calls[{j}]")
        out.append({"id": call.get("id") or _call_id(), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def parse_tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                              "\"parameters\": {...}}}}", f"tools[{i}]")
    choice = body.get("tool_choice", "auto")
    if choice == "none":
        return None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise bad_request(f"tool_choice names '{name}', which is not in 'tools'", "tool_choice")
        return chosen  # the template cannot force a call; offering only that tool comes closest
    if choice not in ("auto", "required"):
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or a function object",
                          "tool_choice")
    return tools or None


_THINK_TAGS = re.compile(r"(?<!\S)/(no_think|think)(?!\S)")


def thinking_switch(body: dict, messages: list[dict]) -> bool:
    """Whether to think: chat_template_kwargs.enable_thinking or a top-level enable_thinking when
    given; else the last /think or /no_think tag in the system and user messages (default: think).
    The tags are removed from the messages either way."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    explicit = (kwargs or {}).get("enable_thinking", body.get("enable_thinking"))
    if explicit is None and body.get("reasoning_effort") in ("none", "minimal"):
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


class _Gatekeeper:
    """ASGI middleware in front of every route: the BrowserGuard's checks, an allowed page's CORS
    preflight and headers, and the API key on /v1 routes. Plain ASGI rather than Starlette's
    BaseHTTPMiddleware, which hides a client's disconnect from the routes (a request whose client
    went away must cancel its generation)."""

    def __init__(self, app, guard: BrowserGuard, api_key: str | None):
        self.app = app
        self.guard = guard
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refused = self.guard.refusal(headers) or self._key_refusal(scope["path"], headers)
        origin = headers.get("origin")
        if refused is not None:
            await JSONResponse(refused.body(), status_code=refused.status)(scope, receive, send)
            return
        if origin is None:
            await self.app(scope, receive, send)
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

        await self.app(scope, receive, send_with_cors)

    def _key_refusal(self, path: str, headers: dict) -> APIError | None:
        if self.api_key is None or not path.startswith("/v1"):
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
        return JSONResponse(err.body(), status_code=err.status)

    app.add_middleware(_Gatekeeper, guard=guard, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        return error_response(bad_request(f"invalid request: {exc.errors()}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def _any_error(request, exc):
        return error_response(error_from_exception(exc))

    def current_model_id() -> str:
        info = runtime.model_info
        if info is None:
            raise APIError(503, "no model is loaded; start the server with a model or load one in the "
                           "app", type="server_error", code="model_not_loaded")
        if model_name:
            return model_name
        from pathlib import Path

        return Path(info.path).stem or info.name

    async def json_body(request: Request) -> dict:
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            # also what keeps a web page's "simple" text/plain POST from running anything
            raise APIError(415, "send the request body as JSON with 'Content-Type: application/json'"
                           f" (got {media_type or 'no content type'!r})", code="unsupported_media_type")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise _too_large(max_body_bytes)
        chunks: list[bytes] = []
        size = 0
        async for piece in request.stream():
            size += len(piece)
            if size > max_body_bytes:
                raise _too_large(max_body_bytes)
            chunks.append(piece)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"the request body is not valid JSON ({exc})") from exc
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        return body

    @app.get("/health")
    async def health():
        status = runtime.status()
        return {"status": "ok" if status["alive"] else "error", "model_loaded": runtime.loaded,
                "busy": status["busy"], "queued": status["queued"],
                "model": status["model"]}

    @app.get("/metrics")
    async def metrics(since: float | None = None):
        snap = runtime.metrics.snapshot(since=since)
        snap["runtime"] = runtime.status()
        return snap

    def model_card() -> dict:
        info = runtime.model_info
        return {"id": current_model_id(), "object": "model", "created": int(time.time()),
                "owned_by": "minecart", "architecture": info.architecture,
                "context_length": info.context_length}

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

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await json_body(request)
        _check_common(body)
        messages = parse_messages(body.get("messages"))
        tools = parse_tools(body)
        enable_thinking = thinking_switch(body, messages)
        params = sampling_params(body, default_max_tokens=default_max_tokens)
        stops = stop_strings(body)
        conversation = _get(body, "conversation_id", (str, int), SHARED_CONVERSATION)
        # an extra: "on" / "off" / "auto" (default: plain text for a pretrained base model)
        template_mode = _get(body, "chat_template_mode", str, "auto", check=lambda v: v in PROMPT_MODES,
                             what="one of " + ", ".join(PROMPT_MODES))
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        model_id = current_model_id()
        handle = runtime.chat(messages, params, enable_thinking=enable_thinking,
                              conversation_id=conversation, tools=tools, stop=stops,
                              chat_template=template_mode)
        completion_id = "chatcmpl-" + uuid.uuid4().hex
        created = int(time.time())

        if stream:
            return StreamingResponse(
                _chat_stream(request, handle, completion_id, created, model_id, tools, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        answer: list[str] = []
        thinking: list[str] = []

        def collect(ev):
            if ev.kind == "token":
                answer.append(ev.text)
                thinking.append(ev.thinking)
            return ev if ev.terminal else None

        final = None
        async for ev in run_request(request, handle, collect, stream=False):
            final = ev
        if final is None:  # client went away
            return JSONResponse(APIError(499, "client disconnected").body(), status_code=499)
        if final.kind == "error":
            raise error_from_exception(final.error or MinecartError(final.text))
        content, calls = parse_tool_calls("".join(answer), tools) if tools else ("".join(answer), [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        reasoning = "".join(thinking)
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        finish = final.finish_reason or "stop"
        if calls and finish == "stop":
            finish = "tool_calls"
        return {"id": completion_id, "object": "chat.completion", "created": created, "model": model_id,
                "choices": [{"index": 0, "message": message, "finish_reason": finish,
                             "logprobs": None}],
                "usage": _usage_dict(final), "timings": _timings(final)}

    async def _chat_stream(request, handle, completion_id, created, model_id, tools, include_usage):
        hold = ToolCallHold(active=bool(tools))

        def chunk(delta: dict, finish=None, usage=None) -> str:
            obj = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                   "model": model_id,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
            if usage is not None:
                obj["usage"] = usage
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        def on_event(ev: RuntimeEvent):
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

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await json_body(request)
        _check_common(body)
        if body.get("echo"):
            raise bad_request("echo is not supported", "echo")
        if body.get("suffix"):
            raise bad_request("suffix is not supported", "suffix")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                     for t in prompt):
                raise bad_request("'prompt' must be a string, or an array of token ids", "prompt")
        elif not isinstance(prompt, str) or not prompt:
            raise bad_request("'prompt' must be a non-empty string (batches are not supported)",
                              "prompt")
        params = sampling_params(body, default_max_tokens=default_max_tokens or 16)
        stops = stop_strings(body)
        conversation = _get(body, "conversation_id", (str, int), None)
        model_id = current_model_id()
        handle = runtime.complete(prompt, params, conversation_id=conversation, stop=stops)
        completion_id = "cmpl-" + uuid.uuid4().hex
        created = int(time.time())

        def obj(text: str, finish=None, usage=None) -> dict:
            out = {"id": completion_id, "object": "text_completion", "created": created,
                   "model": model_id,
                   "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
            if usage is not None:
                out["usage"] = usage
            return out

        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

            def on_event(ev: RuntimeEvent):
                if ev.kind == "token":
                    text = ev.thinking + ev.text
                    return f"data: {json.dumps(obj(text), ensure_ascii=False)}\n\n" if text else None
                if ev.kind == "error":
                    err = error_from_exception(ev.error or MinecartError(ev.text))
                    return f"data: {json.dumps(err.body())}\n\n"
                if ev.terminal:
                    usage = _usage_dict(ev) if include_usage else None
                    last = obj("", finish=ev.finish_reason or "stop", usage=usage)
                    return f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n"
                return None

            async def gen():
                async for piece in run_request(request, handle, on_event, stream=True):
                    yield piece

            return StreamingResponse(gen(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        parts: list[str] = []

        def collect(ev):
            if ev.kind == "token":
                parts.append(ev.thinking + ev.text)
            return ev if ev.terminal else None

        final = None
        async for ev in run_request(request, handle, collect, stream=False):
            final = ev
        if final is None:
            return JSONResponse(APIError(499, "client disconnected").body(), status_code=499)
        if final.kind == "error":
            raise error_from_exception(final.error or MinecartError(final.text))
        out = obj("".join(parts), finish=final.finish_reason or "stop", usage=_usage_dict(final))
        out["timings"] = _timings(final)
        return out

    return app


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
