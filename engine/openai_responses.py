"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) in terms of the chat route.

A Responses request is turned into the chat completion body it stands for (`chat_body`): `instructions`
become the system message, `input` items become messages (input_text / input_image parts, the assistant's
output_text, function_call items as the assistant's tool calls, function_call_output items as tool
messages), function tools, `tool_choice`, `text.format` (response_format), `reasoning.effort`
("none" / "minimal" turn thinking off), `max_output_tokens`. engine/server.py then validates that body
as a chat request and runs it; the answer comes back as output items: a reasoning item (the thinking,
as reasoning_text), a message with one output_text part, function_call items. Streams are the Responses
events (response.created ... response.completed), built by `ResponseEvents`.

`previous_response_id` continues a stored response: with `store` (the default, as OpenAI), a response's
conversation (its input, the instructions left out as OpenAI does, and its output) is kept in memory,
the last STORE_RESPONSES of them, and `GET /v1/responses/{id}` returns a kept response. Only function
tools exist here (no web or file search): any other tool type is a 400.

This module knows the Responses shapes only; it runs nothing (engine/server.py does).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

STORE_RESPONSES = 256  # responses kept for previous_response_id / GET
STORE_MAX_CHARS = 8 << 20  # a conversation longer than this (pictures included) is not kept


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class InputText(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputImage(_Strict):
    type: Literal["input_image"]
    image_url: str | None = None
    detail: str | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


def _part_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind in ("input_text", "output_text", "text"):
        return "text"
    return {"input_image": "image", "refusal": "refusal"}.get(str(kind))


ContentPart = Annotated[Annotated[InputText, Tag("text")] | Annotated[InputImage, Tag("image")]
                        | Annotated[Refusal, Tag("refusal")], Discriminator(_part_tag)]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1)
    arguments: str = "{}"


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[InputText]


class ReasoningItem(_Strict):
    type: Literal["reasoning"]


def _item_tag(value: Any) -> str | None:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return str(kind) if kind in ("message", "function_call", "function_call_output", "reasoning") else None


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_tag)]


class FunctionTool(_Strict):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str = Field("response", min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ReasoningConfig(_Strict):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    max_output_tokens: int | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    metadata: dict[str, Any] | None = None


class RequestShapeError(ValueError):
    """A Responses request that has no chat equivalent; `param` names its place."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion body a Responses request stands for, after the conversation `history` (the
    messages of the response it continues, or none)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    messages.extend(history)
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _content(item.content, where)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            messages.append({"role": "tool", "content": output, "tool_call_id": item.call_id})
        # reasoning items: Qwen's template drops past thinking anyway
    if not messages:
        raise RequestShapeError("the request has no input: give 'input' (a string or items)", "input")
    body: dict[str, Any] = {"messages": messages, "stream": False}
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.type != "function":
                raise RequestShapeError(f"tools[{i}] is a '{tool.type[:40]}' tool; this server runs function "
                                        "tools only", f"tools[{i}].type")
            if tool.name is None:
                raise RequestShapeError(f"tools[{i}] has no name", f"tools[{i}].name")
            fn = {"name": tool.name, "description": tool.description, "parameters": tool.parameters,
                  "strict": tool.strict}
            tools.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
        body["tools"] = tools
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None:
        rf: dict[str, Any] = {"type": fmt.type}
        if fmt.type == "json_schema":
            rf["json_schema"] = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
        body["response_format"] = rf
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    for key in ("temperature", "top_p", "top_k", "min_p", "seed", "chat_template_kwargs", "enable_thinking",
                "parallel_tool_calls"):
        value = getattr(req, key)
        if value is not None:
            body[key] = value
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    return body


def _content(content: str | list[Any], where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, InputText):
            parts.append({"type": "text", "text": part.text})
        elif isinstance(part, Refusal):
            parts.append({"type": "text", "text": part.refusal})
        else:
            if not part.image_url:
                raise RequestShapeError(f"{where}.content[{j}]: send the picture as image_url (a data: URL); "
                                        "file ids are not stored here", f"{where}.content[{j}].image_url")
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
    return parts


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _message_item(item_id: str, status: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": parts}


def output_items(reasoning: str, content: str, calls: list[dict[str, Any]], finished: bool,
                 ids: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The output items of an answer: its thinking, its text (when any, or when nothing else came) and
    its tool calls (chat `tool_calls` entries, arguments a JSON string). `ids`: the items' ids, as a
    stream announced them."""
    ids = ids if ids is not None else {}
    status = "completed" if finished else "incomplete"
    out: list[dict[str, Any]] = []
    if reasoning:
        out.append({"type": "reasoning", "id": ids.setdefault("reasoning", new_id("rs")), "summary": [],
                    "content": [{"type": "reasoning_text", "text": reasoning}], "status": status})
    if content or not calls:
        out.append(_message_item(ids.setdefault("message", new_id("msg")), status, [_text_part(content)]))
    for k, call in enumerate(calls):
        fn = call["function"]
        out.append({"type": "function_call", "id": ids.setdefault(f"call{k}", new_id("fc")),
                    "call_id": call["id"], "name": fn["name"], "arguments": fn["arguments"], "status": "completed"})
    return out


def response_object(resp_id: str, created: int, model_id: str, req: ResponsesRequest,
                    output: list[dict[str, Any]], finish: str | None, usage: dict[str, Any] | None,
                    status: str | None = None) -> dict[str, Any]:
    """The Response a request got (status from the finish: "completed", or "incomplete" at
    max_output_tokens; `status` overrides, e.g. "in_progress" while streaming)."""
    if status is None:
        status = "incomplete" if finish == "length" else "completed"
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    return {
        "id": resp_id, "object": "response", "created_at": created, "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model_id,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": req.store is not False, "temperature": req.temperature, "top_p": req.top_p,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
                        else req.tool_choice.model_dump()) or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "truncation": "disabled", "usage": usage, "metadata": req.metadata or {}, "user": None,
    }


def responses_usage(chat_usage: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    """The Responses usage object from the chat route's usage."""
    prompt = int(chat_usage.get("prompt_tokens", 0))
    completion = int(chat_usage.get("completion_tokens", 0))
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + completion}


def assistant_message(reasoning: str, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer as a chat message, for a conversation a later response continues."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg


class ResponseStore:
    """The last STORE_RESPONSES responses and their conversations (thread-safe LRU)."""

    def __init__(self, capacity: int = STORE_RESPONSES, max_chars: int = STORE_MAX_CHARS):
        self.capacity = capacity
        self.max_chars = max_chars
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep a response and its conversation; False (not kept) when the conversation is too long."""
        if len(json.dumps(conversation, ensure_ascii=False)) > self.max_chars:
            return False
        with self._lock:
            self._items[response["id"]] = (response, conversation)
            self._items.move_to_end(response["id"])
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return True

    def get(self, resp_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        with self._lock:
            found = self._items.get(resp_id)
            if found is not None:
                self._items.move_to_end(resp_id)
            return found


class ResponseEvents:
    """The Server-Sent Events of one streamed response, in order, each numbered: created, in_progress,
    the reasoning item's deltas, the message's output_text deltas, the function calls, then completed
    (or incomplete). Item ids are fixed as they are announced, so the final response repeats them."""

    def __init__(self, resp_id: str, created: int, model_id: str, req: ResponsesRequest):
        self.resp_id, self.created, self.model_id, self.req = resp_id, created, model_id, req
        self.seq = 0
        self.ids: dict[str, str] = {}
        self.index = 0  # the next output item's index
        self.open: str | None = None  # "reasoning" or "message": the item receiving deltas
        self.reasoning = ""
        self.text = ""

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def start(self) -> str:
        shell = response_object(self.resp_id, self.created, self.model_id, self.req, [], None, None, "in_progress")
        return self._event("response.created", response=shell) + self._event("response.in_progress", response=shell)

    def _close_open(self) -> str:
        out = ""
        if self.open == "reasoning":
            rid = self.ids["reasoning"]
            out += self._event("response.reasoning_text.done", item_id=rid, output_index=self.index,
                               content_index=0, text=self.reasoning)
            item = output_items(self.reasoning, "", [], True, dict(self.ids))[0]
            out += self._event("response.output_item.done", output_index=self.index, item=item)
            self.index += 1
        elif self.open == "message":
            mid = self.ids["message"]
            part = _text_part(self.text)
            out += self._event("response.output_text.done", item_id=mid, output_index=self.index,
                               content_index=0, text=self.text)
            out += self._event("response.content_part.done", item_id=mid, output_index=self.index,
                               content_index=0, part=part)
            out += self._event("response.output_item.done", output_index=self.index,
                               item=_message_item(mid, "completed", [part]))
            self.index += 1
        self.open = None
        return out

    def _open_item(self, kind: str, item: dict[str, Any]) -> str:
        """Close the item receiving deltas and announce `item` (of `kind`) as the next one."""
        out = self._close_open() + self._event("response.output_item.added", output_index=self.index, item=item)
        self.open = kind
        return out

    def reasoning_delta(self, delta: str) -> str:
        out = ""
        if self.open != "reasoning":
            rid = self.ids.setdefault("reasoning", new_id("rs"))
            out += self._open_item("reasoning", {"type": "reasoning", "id": rid, "summary": [], "content": [],
                                                 "status": "in_progress"})
        self.reasoning += delta
        return out + self._event("response.reasoning_text.delta", item_id=self.ids["reasoning"],
                                 output_index=self.index, content_index=0, delta=delta)

    def text_delta(self, delta: str) -> str:
        out = ""
        if self.open != "message":
            mid = self.ids.setdefault("message", new_id("msg"))
            out += self._open_item("message", _message_item(mid, "in_progress", []))
            out += self._event("response.content_part.added", item_id=mid, output_index=self.index,
                               content_index=0, part=_text_part(""))
        self.text += delta
        return out + self._event("response.output_text.delta", item_id=self.ids["message"],
                                 output_index=self.index, content_index=0, delta=delta)

    def finish(self, calls: list[dict[str, Any]], finish: str | None, usage: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The closing events and the final response object."""
        out = ""
        if not self.text and not calls and self.open != "message":
            out += self.text_delta("")  # an answer with no text still has its message
        out += self._close_open()
        for k, call in enumerate(calls):
            fn = call["function"]
            fid = self.ids.setdefault(f"call{k}", new_id("fc"))
            item = {"type": "function_call", "id": fid, "call_id": call["id"], "name": fn["name"], "arguments": "",
                    "status": "in_progress"}
            out += self._event("response.output_item.added", output_index=self.index, item=item)
            out += self._event("response.function_call_arguments.delta", item_id=fid, output_index=self.index,
                               delta=fn["arguments"])
            out += self._event("response.function_call_arguments.done", item_id=fid, output_index=self.index,
                               arguments=fn["arguments"])
            out += self._event("response.output_item.done", output_index=self.index,
                               item=dict(item, arguments=fn["arguments"], status="completed"))
            self.index += 1
        items = output_items(self.reasoning, self.text, calls, finish != "length", self.ids)
        final = response_object(self.resp_id, self.created, self.model_id, self.req, items, finish, usage)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, response=final), final

    def error(self, message: str, code: str) -> str:
        failed = response_object(self.resp_id, self.created, self.model_id, self.req, [], None, None, "failed")
        failed["error"] = {"code": code, "message": message}
        return self._event("error", code=code, message=message, param=None) + \
            self._event("response.failed", response=failed)


def created_now() -> int:
    return int(time.time())
