"""JSON output: the constraint behind the API's `response_format` (json_object, json_schema).

A JSON Schema (the subset below) is compiled once into a tree of nodes (`compile_schema`,
`any_object`); a generation then holds a matcher (engine/grammar.py ByteMatcher over a `JsonRecognizer`)
of the JSON texts the schema allows, and the sampler (engine/sampling.py) draws only tokens whose bytes
keep the output a prefix of such a text, then an end token once the value is complete. Every prefix the matcher accepts
can still be completed (no dead ends: object keys are matched against the names still allowed, a
closed object cannot take a comma when no name is left), so an answer stops only at the end of a
value or at max_tokens.

The recognizer keeps a set of states (a schema's `anyOf` and the numbers of an `enum` may leave
several readings open); a state is a stack of frames in a linked list of tuples, so a byte costs a few
tuple operations. Bytes at or above 0x80 are taken as they come inside strings (the tokens of one
character may split its UTF-8 bytes); control bytes are not allowed there, escapes are checked.

Schema keywords understood: type (one or a list), properties, required, additionalProperties (false,
true or a schema), items, minItems, maxItems, enum, const, anyOf, oneOf (as anyOf), allOf of one
schema, $ref to "#", "#/$defs/..." or "#/definitions/...", minLength and maxLength of strings (in
characters). Annotations are ignored (title, description, default, examples, format, $schema, $id,
$comment, deprecated, readOnly, writeOnly, strict, nullable). The names of an object without
additionalProperties are matched as they are written with no needless escape (json.dumps with
ensure_ascii=False: "é", not "\\u00e9"). Any other keyword (pattern, minimum,
multipleOf, ...) is refused with `SchemaError`: an answer that ignored it would not hold to the schema.

Limits that keep a random or looping model from running forever inside one token class: at most
MAX_WHITESPACE whitespace bytes in a row between JSON tokens, none before or after the value (it starts
at once, and the end token follows it), numbers of at most MAX_NUMBER bytes.

Thinking models: when the prompt leaves a `<think>` block open, the reasoning runs unconstrained (no
end token, so the model has to close the block) and the JSON starts after `</think>` (engine/grammar.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import RequestError
from .grammar import (
    ByteMatcher,
    TokenSource,
    TokenTable,
    prompt_bytes,
    prompt_opens_thinking,
    token_table,
)

MAX_WHITESPACE = 24  # whitespace bytes in a row between JSON tokens (an indented line fits)
MAX_NUMBER = 32  # bytes of one number
MAX_KEY = 256  # bytes of a free object key
MAX_SCHEMA_NODES = 2000
# readings of the answer so far that may be open at once: anyOf alternatives that begin alike multiply
# them as they nest ({"anyOf": [10 array schemas of the same]} four arrays deep: 10,000), so past this
# the generation stops with FormatTooAmbiguous instead of slowing every token down without bound
MAX_STATES = 256
MAX_ENUM = 1024

_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = frozenset(b'"\\/bfnrt')
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "format", "$schema", "$id",
                          "$comment", "deprecated", "readOnly", "writeOnly", "strict", "nullable"})
_KNOWN = frozenset({"type", "properties", "required", "additionalProperties", "items", "minItems",
                    "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
                    "minLength", "maxLength"}) | _ANNOTATIONS


class SchemaError(ValueError):
    """A schema this module cannot hold an answer to (the message says where and why)."""


class FormatTooAmbiguous(RequestError):
    """More than MAX_STATES readings of an answer so far were open at once (see MAX_STATES)."""


# ---------------------------------------------------------------------------------------------------
# Schema nodes (identity-hashed: states hold them)

@dataclass(eq=False)
class Node:
    pass


@dataclass(eq=False)
class AnyNode(Node):
    pass


@dataclass(eq=False)
class ObjectNode(Node):
    props: dict[str, Node] = field(default_factory=dict)
    required: frozenset[str] = frozenset()
    extra: Node | None = None  # the schema of other keys' values; None: no other keys
    # each property's name as it must be written: its JSON string body and the closing quote
    encoded: dict[str, bytes] = field(default_factory=dict)


@dataclass(eq=False)
class ArrayNode(Node):
    items: Node = field(default_factory=AnyNode)
    min_items: int = 0
    max_items: int | None = None


@dataclass(eq=False)
class StringNode(Node):
    min_len: int = 0
    max_len: int | None = None


@dataclass(eq=False)
class NumberNode(Node):
    integer: bool = False


@dataclass(eq=False)
class LiteralNode(Node):
    options: tuple[bytes, ...] = ()  # JSON texts (enum, const, true, false, null)


@dataclass(eq=False)
class UnionNode(Node):
    options: tuple[Node, ...] = ()


@dataclass(eq=False)
class RefNode(Node):
    """A $ref, resolved when first reached (a schema may refer to itself)."""

    table: dict[str, Node] = field(default_factory=dict)
    key: str = ""

    def resolve(self) -> Node:
        return self.table[self.key]


ANY = AnyNode()
ANY_OBJECT = ObjectNode(extra=ANY)
ANY_ARRAY = ArrayNode(items=ANY)
ANY_STRING = StringNode()
NUMBER = NumberNode()


def any_object() -> Node:
    """response_format json_object: any JSON object."""
    return ANY_OBJECT


def _literal(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _key_bytes(name: str) -> bytes:
    return _literal(name)[1:]  # the body and the closing quote


def compile_schema(schema: Any) -> Node:
    """The node tree of a JSON Schema (module docstring: the keywords understood); SchemaError names
    the first part it cannot hold an answer to."""
    if not isinstance(schema, dict):
        raise SchemaError("the schema must be a JSON object")
    defs: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        block = schema.get(key)
        if block is not None:
            if not isinstance(block, dict):
                raise SchemaError(f"'{key}' must map names to schemas")
            for name, sub in block.items():
                defs[f"#/{key}/{name}"] = sub
    defs["#"] = schema
    table: dict[str, Node] = {}
    count = [0]
    compiled: dict[str, bool] = {}
    pending: list[str] = []

    def ref(target: str, where: str) -> Node:
        if target not in defs:
            raise SchemaError(f"{where}: $ref {target[:80]!r} names no schema of this document "
                              "(only '#', '#/$defs/...' and '#/definitions/...' are followed)")
        if target not in compiled:
            compiled[target] = True
            pending.append(target)
        return RefNode(table, target)

    def node(s: Any, where: str, depth: int) -> Node:
        count[0] += 1
        if count[0] > MAX_SCHEMA_NODES:
            raise SchemaError(f"the schema has more than {MAX_SCHEMA_NODES} parts")
        if depth > 64:
            raise SchemaError(f"{where}: nested more than 64 levels deep")
        if s is True or s == {}:
            return ANY
        if not isinstance(s, dict):
            raise SchemaError(f"{where}: a schema must be an object (or true), got {json.dumps(s)[:60]}")
        unknown = sorted(k for k in s if k not in _KNOWN)
        if unknown:
            raise SchemaError(f"{where}: the keyword '{unknown[0]}' is not supported in an output schema "
                              "(supported: type, properties, required, additionalProperties, items, "
                              "minItems, maxItems, enum, const, anyOf, oneOf, allOf of one schema, $ref, "
                              "minLength, maxLength)")
        if "$ref" in s:
            target = s["$ref"]
            if not isinstance(target, str):
                raise SchemaError(f"{where}: $ref must be a string")
            rest = {k for k in s if k not in _ANNOTATIONS and k not in ("$ref", "$defs", "definitions")}
            if rest:
                raise SchemaError(f"{where}: $ref beside '{sorted(rest)[0]}' is not supported")
            return ref(target, where)
        if "allOf" in s:
            parts = s["allOf"]
            if not isinstance(parts, list) or len(parts) != 1:
                raise SchemaError(f"{where}: allOf is supported with exactly one schema")
            rest = {k for k in s if k not in _ANNOTATIONS and k not in ("allOf", "$defs", "definitions")}
            if rest:
                raise SchemaError(f"{where}: allOf beside '{sorted(rest)[0]}' is not supported")
            return node(parts[0], f"{where}.allOf[0]", depth + 1)
        for key in ("anyOf", "oneOf"):
            if key in s:
                parts = s[key]
                if not isinstance(parts, list) or not parts:
                    raise SchemaError(f"{where}: {key} must be a non-empty array of schemas")
                rest = {k for k in s if k not in _ANNOTATIONS and k not in (key, "$defs", "definitions")}
                if rest:
                    raise SchemaError(f"{where}: {key} beside '{sorted(rest)[0]}' is not supported "
                                      "(move it into each alternative)")
                return UnionNode(tuple(node(p, f"{where}.{key}[{i}]", depth + 1) for i, p in enumerate(parts)))
        if "const" in s or "enum" in s:
            values = [s["const"]] if "const" in s else s["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"{where}: enum must be a non-empty array")
            if len(values) > MAX_ENUM:
                raise SchemaError(f"{where}: enum has more than {MAX_ENUM} values")
            kinds = _types(s, where)
            if kinds is not None:
                values = [v for v in values if _json_type(v) in kinds
                          or (_json_type(v) == "integer" and "number" in kinds)]
                if not values:
                    raise SchemaError(f"{where}: no value of the enum has the schema's type")
            return LiteralNode(tuple(dict.fromkeys(_literal(v) for v in values)))
        kinds = _types(s, where)
        if kinds is None:
            kinds = _implied_types(s)
        options = [typed(k, s, where, depth) for k in kinds]
        return options[0] if len(options) == 1 else UnionNode(tuple(options))

    def typed(kind: str, s: dict, where: str, depth: int) -> Node:
        if kind == "object":
            props_raw = s.get("properties", {})
            if not isinstance(props_raw, dict):
                raise SchemaError(f"{where}: 'properties' must map names to schemas")
            props = {name: node(sub, f"{where}.properties.{name}", depth + 1) for name, sub in props_raw.items()}
            required = s.get("required", [])
            if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
                raise SchemaError(f"{where}: 'required' must be an array of property names")
            missing = [r for r in required if r not in props]
            extra_raw = s.get("additionalProperties", True)
            if extra_raw is False:
                extra: Node | None = None
                if missing:
                    raise SchemaError(f"{where}: '{missing[0]}' is required but not a property, and "
                                      "additionalProperties is false")
            else:
                extra = node(extra_raw, f"{where}.additionalProperties", depth + 1)
            if extra is None and not props and required:
                raise SchemaError(f"{where}: no object can hold this schema")
            return ObjectNode(props, frozenset(required), extra, {k: _key_bytes(k) for k in props})
        if kind == "array":
            items = node(s.get("items", True), f"{where}.items", depth + 1)
            lo, hi = _bound(s, "minItems", where, 0), _bound(s, "maxItems", where, None)
            if hi is not None and lo > hi:
                raise SchemaError(f"{where}: minItems is above maxItems")
            return ArrayNode(items, lo, hi)
        if kind == "string":
            lo, hi = _bound(s, "minLength", where, 0), _bound(s, "maxLength", where, None)
            if hi is not None and lo > hi:
                raise SchemaError(f"{where}: minLength is above maxLength")
            return StringNode(lo, hi) if lo or hi is not None else ANY_STRING
        if kind == "integer":
            return NumberNode(integer=True)
        if kind == "number":
            return NUMBER
        if kind == "boolean":
            return LiteralNode((b"true", b"false"))
        return LiteralNode((b"null",))

    root = node(schema, "$", 0)
    while pending:
        target = pending.pop()
        table[target] = root if target == "#" else node(defs[target], target, 1)
    for start in [root, *table.values()]:
        _check_left_recursion(start)
    return root


def _check_left_recursion(start: Node) -> None:
    """Refuse a schema that reaches itself through $ref and anyOf without a byte in between
    ({"anyOf": [{"$ref": "#"}, ...]} at the root): its first byte could never be decided."""
    stack: list[tuple[Node, frozenset[int]]] = [(start, frozenset())]
    while stack:
        n, path = stack.pop()
        if id(n) in path:
            raise SchemaError("the schema refers to itself through $ref / anyOf before any value starts")
        path = path | {id(n)}
        if isinstance(n, RefNode):
            stack.append((n.resolve(), path))
        elif isinstance(n, UnionNode):
            stack.extend((o, path) for o in n.options)


def _types(s: dict, where: str) -> list[str] | None:
    kind = s.get("type")
    if kind is None:
        return None
    kinds = kind if isinstance(kind, list) else [kind]
    valid = ("object", "array", "string", "number", "integer", "boolean", "null")
    if not kinds or not all(isinstance(k, str) and k in valid for k in kinds):
        raise SchemaError(f"{where}: 'type' must be one of {', '.join(valid)} (or an array of them), "
                          f"got {json.dumps(kind)[:60]}")
    if "integer" in kinds and "number" in kinds:
        kinds = [k for k in kinds if k != "integer"]
    return list(dict.fromkeys(kinds))


def _implied_types(s: dict) -> list[str]:
    """The types a schema without 'type' allows: those its keywords imply, else all."""
    if any(k in s for k in ("properties", "required", "additionalProperties")):
        return ["object"]
    if any(k in s for k in ("items", "minItems", "maxItems")):
        return ["array"]
    if any(k in s for k in ("minLength", "maxLength")):
        return ["string"]
    return ["object", "array", "string", "number", "boolean", "null"]


def _bound(s: dict, key: str, where: str, default: int | None) -> Any:
    v = s.get(key, default)
    if v is default:
        return v
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise SchemaError(f"{where}: {key} must be an integer >= 0")
    return v


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


# ---------------------------------------------------------------------------------------------------
# The recognizer. A stack is None (the value is complete) or (frame, stack below). Frames:
#   ("V", node)                      a value of node comes next (whitespace first allowed)
#   ("L", options, pos)              inside literals: options (bytes) still possible, pos bytes matched
#   ("S", node, chars, esc)          inside a string (esc: _string_byte)
#   ("N", integer, phase, length)    inside a number
#   ("O", node, seen, phase, key)    object: phase 0 after '{', 1 after a value, 2 after ',', 3 after a key
#   ("K", node, seen, acc, esc)      inside a key (acc: its raw bytes so far)
#   ("A", node, count, phase)        array: phase 0 after '[', 1 after a value, 2 after ','
# A state is (stack, whitespace run).

Stack = Any  # tuple[frame, Stack] | None
State = tuple[Any, int]

_N_SIGN, _N_ZERO, _N_INT, _N_FRAC0, _N_FRAC, _N_EXP0, _N_EXPSIGN, _N_EXP = range(8)
_N_ACCEPT = frozenset({_N_ZERO, _N_INT, _N_FRAC, _N_EXP})


def _done(rest: Stack) -> Stack:
    """The stack once the value on top of `rest` is complete."""
    if rest is None:
        return None
    frame, below = rest
    if frame[0] == "O":
        return (("O", frame[1], frame[2], 1, ""), below)
    if frame[0] == "A":
        return (("A", frame[1], frame[2] + 1, 1), below)
    raise AssertionError(f"a value completed inside {frame[0]}")


def _start(node: Node, rest: Stack, b: int, out: list[Stack]) -> None:
    """The stacks after byte b starts a value of node (none if it cannot)."""
    while isinstance(node, RefNode):
        node = node.resolve()
    if isinstance(node, UnionNode):
        for option in node.options:
            _start(option, rest, b, out)
        return
    if isinstance(node, AnyNode):
        for option in (ANY_OBJECT, ANY_ARRAY, ANY_STRING, NUMBER, _ANY_LITERALS):
            _start(option, rest, b, out)
        return
    if isinstance(node, ObjectNode):
        if b == 0x7B:  # {
            out.append((("O", node, frozenset(), 0, ""), rest))
    elif isinstance(node, ArrayNode):
        if b == 0x5B:  # [
            out.append((("A", node, 0, 0), rest))
    elif isinstance(node, StringNode):
        if b == 0x22:
            out.append((("S", node, 0, 0), rest))
    elif isinstance(node, NumberNode):
        if b == 0x2D:  # -
            out.append((("N", node.integer, _N_SIGN, 1), rest))
        elif b == 0x30:
            out.append((("N", node.integer, _N_ZERO, 1), rest))
        elif b in _DIGITS:
            out.append((("N", node.integer, _N_INT, 1), rest))
    elif isinstance(node, LiteralNode):
        _literal_step(node.options, 0, rest, b, out)


_ANY_LITERALS = LiteralNode((b"true", b"false", b"null"))


def _literal_step(options: Sequence[bytes], pos: int, rest: Stack, b: int, out: list[Stack]) -> None:
    longer = tuple(o for o in options if len(o) > pos + 1 and o[pos] == b)
    if any(len(o) == pos + 1 and o[pos] == b for o in options):
        out.append(_done(rest))
    if longer:
        out.append((("L", longer, pos + 1), rest))


def _number_next(integer: bool, phase: int, b: int) -> int:
    """The number's phase after byte b, or -1 when b does not continue it."""
    digit = b in _DIGITS
    if phase == _N_SIGN:
        return _N_ZERO if b == 0x30 else (_N_INT if digit else -1)
    if phase in (_N_ZERO, _N_INT):
        if digit:
            return _N_INT if phase == _N_INT else -1
        if integer:
            return -1
        return _N_FRAC0 if b == 0x2E else (_N_EXP0 if b in (0x65, 0x45) else -1)
    if phase in (_N_FRAC0, _N_FRAC):
        if digit:
            return _N_FRAC
        return _N_EXP0 if phase == _N_FRAC and b in (0x65, 0x45) else -1
    if phase == _N_EXP0:
        return _N_EXPSIGN if b in (0x2B, 0x2D) else (_N_EXP if digit else -1)
    return _N_EXP if digit else -1  # _N_EXPSIGN, _N_EXP


def _step(state: State, b: int, out: list[State]) -> None:
    """Every state after byte b (appended to out)."""
    stack, ws = state
    if stack is None:
        return  # the value is complete: only the end token
    frame, rest = stack
    kind = frame[0]
    if kind == "S":
        node, chars, esc = frame[1], frame[2], frame[3]
        nesc, add = _string_byte(esc, b)
        if nesc == _CLOSE:
            if chars >= node.min_len:
                out.append((_done(rest), 0))
        elif nesc != _BAD and (node.max_len is None or chars + add <= node.max_len):
            out.append(((("S", node, chars + add, nesc), rest), 0))
        return
    if kind == "N":
        integer, phase, length = frame[1], frame[2], frame[3]
        nxt = _number_next(integer, phase, b)
        if nxt >= 0:
            # the last byte a number may take must end it where it could end (every open phase
            # needs one more byte at most)
            if length + 1 < MAX_NUMBER or (length + 1 == MAX_NUMBER and nxt in _N_ACCEPT):
                out.append(((("N", integer, nxt, length + 1), rest), 0))
        elif phase in _N_ACCEPT:
            _step((_done(rest), 0), b, out)  # the number ended: b belongs to what holds it
        return
    if kind == "L":
        found: list[Stack] = []
        _literal_step(frame[1], frame[2], rest, b, found)
        out.extend((s, 0) for s in found)
        return
    if kind == "K":
        _key_step(frame, rest, b, out)
        return
    if b in _WS:
        if ws < MAX_WHITESPACE and not (kind == "V" and rest is None):  # none before the value either
            out.append((stack, ws + 1))
        return
    if kind == "V":
        found = []
        _start(frame[1], rest, b, found)
        out.extend((s, 0) for s in found)
        return
    if kind == "O":
        node, seen, phase = frame[1], frame[2], frame[3]
        if phase == 3:
            if b == 0x3A:  # :
                key = frame[4]
                value = node.props.get(key, node.extra)
                assert value is not None
                out.append(((("V", value), (("O", node, seen, 4, ""), rest)), 0))
            return
        if b == 0x7D and phase in (0, 1) and node.required <= seen:  # }
            out.append((_done(rest), 0))
        elif b == 0x2C and phase == 1 and _key_left(node, seen):  # ,
            out.append(((("O", node, seen, 2, ""), rest), 0))
        elif b == 0x22 and phase in (0, 2) and _key_left(node, seen):
            out.append(((("K", node, seen, b"", 0), rest), 0))
        return
    if kind == "A":
        node, count, phase = frame[1], frame[2], frame[3]
        if phase == 1:
            if b == 0x2C and (node.max_items is None or count < node.max_items):
                out.append(((("A", node, count, 2), rest), 0))
            elif b == 0x5D and count >= node.min_items:
                out.append((_done(rest), 0))
            return
        if b == 0x5D:
            if phase == 0 and node.min_items == 0:
                out.append((_done(rest), 0))
            return
        if node.max_items is None or count < node.max_items:
            found = []
            _start(node.items, (("A", node, count, 4), rest), b, found)
            out.extend((s, 0) for s in found)


def _key_left(node: ObjectNode, seen: frozenset[str]) -> bool:
    return node.extra is not None or any(k not in seen for k in node.props)


def _key_step(frame: tuple, rest: Stack, b: int, out: list[State]) -> None:
    node, seen, acc, esc = frame[1], frame[2], frame[3], frame[4]
    acc2 = acc + bytes((b,))
    if node.extra is None:  # a closed object: the key is one of the names not written yet
        for name, enc in node.encoded.items():
            if name in seen or not enc.startswith(acc2):
                continue
            if len(enc) == len(acc2):
                out.append(((("O", node, seen | {name}, 3, name), rest), 0))
            else:
                out.append(((("K", node, seen, acc2, 0), rest), 0))
                return  # one state for every name this prefix may still become
        return
    nesc, _ = _string_byte(esc, b)
    if nesc == _CLOSE:
        try:
            name = json.loads(b'"' + acc + b'"')
        except ValueError:
            return
        if name not in seen:
            out.append(((("O", node, seen | {name}, 3, name), rest), 0))
    elif nesc != _BAD and not (esc == 0 and len(acc2) > MAX_KEY):  # past the cap: the closing quote only
        out.append(((("K", node, seen, acc2, nesc), rest), 0))


# Inside a string. esc: 0 between characters, -1 after a backslash, 1..4 hex digits of \u left, or
# _U8 + 8 * (UTF-8 continuation bytes left) + the index of the range the next one must lie in (RFC 3629:
# no overlong forms, no surrogates, nothing above U+10FFFF)
_CLOSE, _BAD, _U8 = -9, -2, 16
_U8_RANGES = ((0x80, 0xBF), (0xA0, 0xBF), (0x80, 0x9F), (0x90, 0xBF), (0x80, 0x8F))


def _utf8_lead(b: int) -> int:
    if 0xC2 <= b <= 0xDF:
        return _U8 + 8
    if 0xE0 <= b <= 0xEF:
        return _U8 + 16 + (1 if b == 0xE0 else 2 if b == 0xED else 0)
    if 0xF0 <= b <= 0xF4:
        return _U8 + 24 + (3 if b == 0xF0 else 4 if b == 0xF4 else 0)
    return _BAD


def utf8_step(state: int, b: int) -> int:
    """UTF-8 byte by byte (RFC 3629): the state after byte b (0 between characters), or -1 when b cannot
    come here. For text outside JSON strings (engine/tool_call_grammar.py)."""
    if state == 0:
        if b < 0x80:
            return 0
        lead = _utf8_lead(b)
        return lead if lead != _BAD else -1
    left, rng = divmod(state - _U8, 8)
    lo, hi = _U8_RANGES[rng]
    if not lo <= b <= hi:
        return -1
    return 0 if left == 1 else _U8 + 8 * (left - 1)


def _string_byte(esc: int, b: int) -> tuple[int, int]:
    """(esc after byte b, the characters b begins: 0 or 1); (_CLOSE, 0) for the closing quote, (_BAD, 0)
    when b cannot come here."""
    if esc == 0:
        if b == 0x22:
            return _CLOSE, 0
        if b == 0x5C:
            return -1, 1
        if b < 0x20:
            return _BAD, 0
        return (0, 1) if b < 0x80 else ((lead, 1) if (lead := _utf8_lead(b)) != _BAD else (_BAD, 0))
    if esc == -1:
        return (0, 0) if b in _SIMPLE_ESCAPES else ((4, 0) if b == 0x75 else (_BAD, 0))
    if esc >= _U8:
        left, rng = divmod(esc - _U8, 8)
        lo, hi = _U8_RANGES[rng]
        if not lo <= b <= hi:
            return _BAD, 0
        return (0 if left == 1 else _U8 + 8 * (left - 1)), 0
    return (esc - 1, 0) if b in _HEX else (_BAD, 0)


def advance(states: Iterable[State], data: bytes) -> frozenset[State]:
    """The states after `data` (empty: `data` leaves the schema's texts)."""
    cur = frozenset(states)
    for b in data:
        out: list[State] = []
        for s in cur:
            _step(s, b, out)
        if not out:
            return frozenset()
        cur = frozenset(out)
        if len(cur) > MAX_STATES:
            raise FormatTooAmbiguous(
                f"the answer's JSON schema is too ambiguous to follow: more than {MAX_STATES} readings of the "
                "answer so far are open at once (anyOf alternatives that begin alike, nested); make the "
                "alternatives differ in their first keys or types")
    return cur


def accepts_end(states: Iterable[State]) -> bool:
    """Whether a value is complete in one of the states (a number at the very end included)."""
    for stack, _ in states:
        if stack is None:
            return True
        frame, rest = stack
        if frame[0] == "N" and frame[2] in _N_ACCEPT and rest is None:
            return True
    return False


def initial_states(root: Node) -> frozenset[State]:
    return frozenset({((("V", root), None), 0)})


# ---------------------------------------------------------------------------------------------------
# Vocabulary and the matcher a sampler holds

class JsonRecognizer:
    """The recognizer of one schema's JSON texts, for engine/grammar.py ByteMatcher."""

    def __init__(self, root: Node):
        self.root = root

    def initial(self) -> frozenset[State]:
        return initial_states(self.root)

    def advance(self, states: frozenset[State], data: bytes) -> frozenset[State]:
        return advance(states, data)

    def accepts_end(self, states: frozenset[State]) -> bool:
        return accepts_end(states)


def json_matcher(root: Node, table: TokenTable, end_ids: Iterable[int], thinking: bool = False) -> ByteMatcher:
    """A matcher of root's JSON over a token table (tests; generations take JsonFormat.matcher)."""
    return ByteMatcher(JsonRecognizer(root), table, end_ids, thinking)


@dataclass(frozen=True, eq=False)
class JsonFormat:
    """A request's JSON output format (the compiled schema): what SamplingParams carries; a generation
    makes its own matcher from it (`matcher`)."""

    root: Node
    label: str = "json_object"

    def matcher(self, tokens: TokenSource, end_ids: Iterable[int], prompt_ids: Sequence[int]) -> ByteMatcher:
        thinking = prompt_opens_thinking(prompt_bytes(tokens, prompt_ids, last=32))
        return ByteMatcher(JsonRecognizer(self.root), token_table(tokens), end_ids, thinking, tokens.token_bytes)


def json_object_format() -> JsonFormat:
    return JsonFormat(any_object(), "json_object")


def json_schema_format(schema: Mapping[str, Any], name: str = "response") -> JsonFormat:
    return JsonFormat(compile_schema(dict(schema)), f"json_schema {name}")
