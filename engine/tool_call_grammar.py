"""Forced tool calls: `tool_choice` "required" or a named function, in Qwen3.5's call format.

With tools offered and a call required, the answer (after the reasoning, when the prompt opened a
`<think>` block) must be one or more calls as the chat template teaches them:

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

NAME is one of the offered tools; ARG one of that tool's parameters, each at most once, the required ones
all before `</function>`. A string parameter's VALUE is raw text (any UTF-8 without control bytes
other than tab and line breaks, until the closing `\\n</parameter>\\n`, and no closing tag of a parameter,
function or call inside, where the server's parser would end it), one of its values when the schema
gives an enum of strings; any other typed parameter's VALUE is JSON of its schema (engine/json_output.py:
an integer is digits, an object an object with its properties), so the server's parser
(engine/server.py parse_tool_calls) reads back arguments that hold to the tool's schema. A parameter
schema the JSON matcher cannot hold (a keyword it refuses) takes raw text instead of failing the request.
Up to MAX_CALLS calls, one after another (one with `parallel_tool_calls: false` or a named function), then
the end token.

The format is known by the prompt: the Qwen3.5 template's tool instructions show `<function=`. A model
whose template writes calls some other way runs unconstrained (the template's own instructions, as before).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .grammar import ByteMatcher, TokenSource, prompt_bytes, prompt_opens_thinking, token_table
from .json_output import Node, SchemaError, State, compile_schema, utf8_step
from .json_output import accepts_end as json_accepts_end
from .json_output import advance as json_advance
from .json_output import initial_states as json_initial

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
CALL_START = b"<tool_call>\n<function="
PARAM_OPEN = b"<parameter="
PARAM_CLOSE = b"\n</parameter>\n"
CALL_END = b"</function>\n</tool_call>"
FORMAT_MARK = b"<function="  # in the prompt: the template teaches this format
MAX_CALLS = 8
MAX_LEAD = 2  # line breaks before the first call


@dataclass(frozen=True, eq=False)
class Param:
    name: str
    enc: bytes  # the name and ">\n", as written after "<parameter="
    json: Node | None = None  # a JSON value of this schema; None: raw text
    options: tuple[bytes, ...] | None = None  # a string enum's values, raw


@dataclass(frozen=True, eq=False)
class ToolSpec:
    name: str
    enc: bytes  # the name and ">\n", as written after "<function="
    params: tuple[Param, ...]
    required: frozenset[str]


def _param(name: str, schema: Any) -> Param:
    enc = name.encode("utf-8") + b">\n"
    if not isinstance(schema, dict):
        return Param(name, enc)
    kind = schema.get("type")
    enum = schema.get("enum")
    if kind == "string" or (kind is None and isinstance(enum, list) and enum
                            and all(isinstance(v, str) for v in enum)):
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            return Param(name, enc, options=tuple(dict.fromkeys(v.encode("utf-8") for v in enum)))
        return Param(name, enc)
    if kind is None and enum is None and "const" not in schema:
        return Param(name, enc)  # no type: the parser reads JSON when it parses, else text
    try:
        return Param(name, enc, json=compile_schema(schema))
    except SchemaError:
        return Param(name, enc)  # a schema the matcher cannot hold: raw text, as without the format


def compile_tools(tools: Sequence[Mapping[str, Any]]) -> tuple[ToolSpec, ...]:
    """The callable tools of chat-format tool definitions ({"type": "function", "function": {...}})."""
    out = []
    for tool in tools:
        fn = tool.get("function") or {}
        params_schema = fn.get("parameters") or {}
        # a name holding ">" or a line break cannot be written in this format (the parser's pattern)
        props = {str(k): v for k, v in (params_schema.get("properties") or {}).items()
                 if ">" not in str(k) and "\n" not in str(k) and str(k)}
        required = [r for r in params_schema.get("required") or [] if r in props]
        params = tuple(_param(k, v) for k, v in props.items())
        out.append(ToolSpec(str(fn["name"]), str(fn["name"]).encode("utf-8") + b">\n", params,
                            frozenset(required)))
    return tuple(out)


# States (tuples; `calls` counts the calls written):
#   ("lead", n)                               before the first call: n line breaks so far
#   ("lits", ((literal, then), ...), pos)     inside literals (pos bytes matched), each with its next state
#   ("fname", acc, calls)                     a function name so far
#   ("params", tool, seen, calls)             after a function's name line or a parameter
#   ("pname", tool, seen, acc, calls)         a parameter name so far
#   ("text", tool, seen, tail, utf8, calls)   a raw value: its last bytes (_closing_check), UTF-8 state
#   ("json", tool, seen, states, tail, calls) a JSON value: its recognizer's states, its last bytes
#   ("after", calls)                          after "</tool_call>": the end, or another call


# A value may not hold a closing tag the parser would end its parameter, function or call at
# (engine/server.py _XML_PARAMETER, _XML_FUNCTION and the call's own pattern take the first one).
_CLOSING = (b"</parameter>", b"</function>", b"</tool_call>")
_TAIL = max(len(c) for c in _CLOSING) + 1


def _closing_check(tail: bytes, b: int) -> tuple[bytes, str]:
    """A value's last bytes after byte b, and "end" when they close it (a line break, then
    "</parameter>"), "bad" when they hold a closing tag anywhere else, else "ok"."""
    tail = (tail + bytes((b,)))[-_TAIL:]
    if tail.endswith(b"\n</parameter>"):
        return tail, "end"
    if any(tail.endswith(c) for c in _CLOSING):
        return tail, "bad"
    return tail, "ok"


def _names(acc: bytes, encs: Sequence[bytes]) -> tuple[list[int], bool]:
    """Which of the written names (each with its closing ">\n") `acc` completes, by index, and whether it
    is still the start of another."""
    return [i for i, e in enumerate(encs) if e == acc], any(e != acc and e.startswith(acc) for e in encs)


class ToolCallRecognizer:
    """The calls of `tools` in the format above, at most `max_calls` of them, for engine/grammar.py
    ByteMatcher."""

    def __init__(self, tools: Sequence[ToolSpec], max_calls: int = MAX_CALLS):
        self.tools = tuple(tools)
        self.max_calls = max_calls

    def initial(self) -> frozenset[Any]:
        return frozenset({("lead", 0)})

    def accepts_end(self, states: frozenset[Any]) -> bool:
        return any(s[0] == "after" for s in states)

    def advance(self, states: frozenset[Any], data: bytes) -> frozenset[Any]:
        cur = states
        for b in data:
            out: list[Any] = []
            for s in cur:
                self._step(s, b, out)
            if not out:
                return frozenset()
            cur = frozenset(out)
        return cur

    def _params_options(self, tool: int, seen: frozenset[str], calls: int) -> tuple[tuple[bytes, Any], ...]:
        spec = self.tools[tool]
        options: list[tuple[bytes, Any]] = []
        if any(p.name not in seen for p in spec.params):
            options.append((PARAM_OPEN, ("pname", tool, seen, b"", calls)))
        if spec.required <= seen:
            options.append((CALL_END, ("after", calls + 1)))
        return tuple(options)

    def _lits(self, options: tuple[tuple[bytes, Any], ...], pos: int, b: int, out: list[Any]) -> None:
        keep = []
        for lit, then in options:
            if lit[pos] != b:
                continue
            if pos + 1 == len(lit):
                out.append(then)
            else:
                keep.append((lit, then))
        if keep:
            out.append(("lits", tuple(keep), pos + 1))

    def _value(self, tool: int, p: Param, seen: frozenset[str], calls: int) -> Any:
        seen = seen | {p.name}
        if p.options is not None:
            back = ("params", tool, seen, calls)
            return ("lits", tuple((v + PARAM_CLOSE, back) for v in p.options), 0)
        if p.json is not None:
            return ("json", tool, seen, json_initial(p.json), b"", calls)
        return ("text", tool, seen, b"", 0, calls)

    def _step(self, s: Any, b: int, out: list[Any]) -> None:
        kind = s[0]
        if kind == "lead":
            if b == 0x0A and s[1] < MAX_LEAD:
                out.append(("lead", s[1] + 1))
            else:
                self._lits(((CALL_START, ("fname", b"", 0)),), 0, b, out)
        elif kind == "lits":
            self._lits(s[1], s[2], b, out)
        elif kind == "fname":
            acc, calls = s[1] + bytes((b,)), s[2]
            full, partial = _names(acc, [spec.enc for spec in self.tools])
            out.extend(("params", i, frozenset(), calls) for i in full)
            if partial:
                out.append(("fname", acc, calls))
        elif kind == "params":
            self._lits(self._params_options(s[1], s[2], s[3]), 0, b, out)
        elif kind == "pname":
            tool, seen, acc, calls = s[1], s[2], s[3] + bytes((b,)), s[4]
            left = [p for p in self.tools[tool].params if p.name not in seen]
            full, partial = _names(acc, [p.enc for p in left])
            out.extend(self._value(tool, left[i], seen, calls) for i in full)
            if partial:
                out.append(("pname", tool, seen, acc, calls))
        elif kind == "text":
            tool, seen, tail, u8, calls = s[1], s[2], s[3], s[4], s[5]
            u8 = utf8_step(u8, b)
            if u8 < 0 or (b < 0x20 and b not in (0x09, 0x0A, 0x0D)):
                return
            tail, verdict = _closing_check(tail, b)
            if verdict == "end":  # the closing line break after "</parameter>" comes next
                out.append(("lits", ((b"\n", ("params", tool, seen, calls)),), 0))
            elif verdict == "ok":
                out.append(("text", tool, seen, tail, u8, calls))
        elif kind == "json":
            tool, seen, states, tail, calls = s[1], s[2], s[3], s[4], s[5]
            nxt: frozenset[State] = json_advance(states, bytes((b,)))
            after, verdict = _closing_check(tail, b)
            if nxt and verdict == "ok":
                out.append(("json", tool, seen, nxt, after, calls))
            if b == PARAM_CLOSE[0] and json_accepts_end(states):
                out.append(("lits", ((PARAM_CLOSE, ("params", tool, seen, calls)),), 1))
        elif kind == "after" and s[1] < self.max_calls:
            self._lits(((b"\n" + CALL_START, ("fname", b"", s[1])),), 0, b, out)


@dataclass(frozen=True, eq=False)
class ToolCallFormat:
    """A required call among `tools` (what SamplingParams.answer_format carries)."""

    tools: tuple[ToolSpec, ...]
    max_calls: int = MAX_CALLS
    label: str = "tool_choice"

    def matcher(self, tokens: TokenSource, end_ids: Iterable[int], prompt_ids: Sequence[int]) -> ByteMatcher | None:
        text = prompt_bytes(tokens, prompt_ids)
        if FORMAT_MARK not in text:
            return None  # the template teaches another call format: left to the model
        literals = {t: name.encode() for name in (TOOL_OPEN, TOOL_CLOSE) if (t := tokens.id_of(name)) is not None}
        return ByteMatcher(ToolCallRecognizer(self.tools, self.max_calls), token_table(tokens), end_ids,
                           prompt_opens_thinking(text[-256:]), tokens.token_bytes, literals)


def tool_call_format(tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> ToolCallFormat:
    """Calls among `tools`: up to MAX_CALLS, or one when `parallel` is false."""
    return ToolCallFormat(compile_tools(tools), MAX_CALLS if parallel else 1)
