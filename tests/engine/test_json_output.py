"""JSON output (engine/json_output.py): the byte recognizer against Python's json parser and the
`jsonschema` validator, its promise of no dead ends, the sampler's picks under it, and the fixture
model's answers through the engine."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from minecart.engine.grammar import ByteMatcher, TokenTable
from minecart.engine.json_output import (
    MAX_KEY,
    MAX_WHITESPACE,
    SchemaError,
    accepts_end,
    advance,
    any_object,
    compile_schema,
    initial_states,
    json_matcher,
    json_object_format,
    json_schema_format,
)
from minecart.engine.sampling import Sampler, SamplingParams, TopLogits, top_logits

from tests._json_schemas import ANSWER

# -- references -----------------------------------------------------------------------------------


def _no_constants(name):
    raise ValueError(f"{name} is not JSON")


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError("duplicate key")
    return dict(pairs)


def reference_parse(data: bytes):
    """(True, value) when data is one JSON text by RFC 8259 as Python's json reads it (strict UTF-8, no
    NaN / Infinity, no duplicate keys), with no whitespace run past the documented cap and none before
    or after the value; else (False, None)."""
    try:
        text = data.decode("utf-8")
        value = json.loads(text, parse_constant=_no_constants, object_pairs_hook=_no_duplicates)
    except ValueError:
        return False, None
    if re.search(rb"[ \t\n\r]{%d}" % (MAX_WHITESPACE + 1), data) or data != data.strip(b" \t\n\r"):
        return False, None  # the documented limits: whitespace runs, none around the value
    return True, value


def matches(root, data: bytes) -> bool:
    return accepts_end(advance(initial_states(root), data))


def allowed_bytes(states) -> list[int]:
    return [b for b in range(256) if advance(states, bytes((b,)))]


SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "age": {"type": "integer"},
            "height": {"type": "number"},
            "pet": {"enum": ["cat", "dog", 3, None]},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
            "alive": {"type": "boolean"},
        },
        "required": ["name", "age", "alive"],
        "additionalProperties": False,
    },
    "open": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "extra": {"type": ["string", "null"]}},
        "additionalProperties": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "open_required": {  # a required key among free ones: a random walk seldom writes it
        "type": "object",
        "properties": {"id": {"type": "integer"}},
        "required": ["id"],
    },
    "tree": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"v": {"const": 1}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                           "maxItems": 2}},
                "required": ["v", "kids"],
                "additionalProperties": False,
            }
        },
        "anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}],
    },
    "keys": {  # names that are prefixes of each other and need escapes
        "type": "object",
        "properties": {"a": {"type": "null"}, "ab": {"type": "null"}, 'q"\u00e9': {"type": "null"}},
        "additionalProperties": False,
    },
}


# -- the recognizer against the references ----------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6)
    | st.floats(allow_nan=False, allow_infinity=False, width=32) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


def dumps(value, style: int) -> bytes:
    if style == 0:
        return json.dumps(value).encode()
    if style == 1:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    return json.dumps(value, ensure_ascii=style == 2, indent=1).encode()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=json_values, style=st.integers(0, 3))
def test_any_json_text_is_accepted_and_every_prefix_too(value, style):
    data = dumps(value, style)
    ok, _ = reference_parse(data)
    assert ok
    root = compile_schema({})
    states = initial_states(root)
    for i in range(len(data)):  # every prefix of a valid text stays open
        states = advance(states, data[i:i + 1])
        assert states, (data, i)
    assert accepts_end(states)
    # json_object: the same text when it is an object, nothing else
    assert matches(any_object(), data) == isinstance(value, dict)


MUTATION_BYTES = b'{}[]",:\\ 0123456789.-+eEtrufalsn\x00\x1f\x7f\xc3\xa9\xe9\xed\xa0\x80'


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=json_values, style=st.integers(0, 3), edits=st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 10**6), st.integers(0, len(MUTATION_BYTES) - 1)),
    min_size=1, max_size=3))
def test_edited_texts_agree_with_the_json_parser(value, style, edits):
    data = bytearray(dumps(value, style))
    for kind, at, pick in edits:
        at = at % (len(data) + 1)
        b = MUTATION_BYTES[pick]
        if kind == 0:
            data.insert(at, b)
        elif kind == 1 and at < len(data):
            del data[at]
        elif at < len(data):
            data[at] = b
    data = bytes(data)
    ok, _ = reference_parse(data)
    assert matches(compile_schema({}), data) == ok, data


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_walks_never_dead_end_and_end_valid(name):
    """From the start, random allowed bytes: every state reached can go on or is complete (no dead
    ends), and every completed text is valid JSON of the schema by jsonschema."""
    schema = SCHEMAS[name]
    root = compile_schema(schema)
    rng = random.Random(7)
    completed = 0
    for _walk in range(40):
        states, data = initial_states(root), b""
        for _ in range(400):
            nxt = allowed_bytes(states)
            done = accepts_end(states)
            assert nxt or done, (name, data)
            if done and (not nxt or rng.random() < 0.5):
                break
            weights = [25.0 if b in b'"}]' else 3.0 if b == 0x2C else 1.0 if 0x20 <= b < 0x7F else 0.02
                       for b in nxt]
            b = rng.choices(nxt, weights)[0]
            data += bytes((b,))
            states = advance(states, bytes((b,)))
        if accepts_end(states):
            completed += 1
            ok, value = reference_parse(data)
            assert ok, data
            jsonschema.validate(value, schema)
    assert completed >= (0 if name == "open_required" else 20), completed


VALID = {
    "person": [{"name": "Al", "age": 3, "alive": True}, {"alive": False, "pet": None, "age": -0, "name": "é\"x",
                                                          "tags": ["a"], "height": 1.5e-3}],
    "open": [{}, {"id": 1}, {"id": 2, "extra": None, "zz": [True, False], "": []}],
    "open_required": [{"id": 1}, {"id": 1, "x": {"y": [None]}}],
    "tree": [None, {"v": 1, "kids": []}, {"v": 1, "kids": [{"v": 1, "kids": [{"v": 1, "kids": []}]}]}],
    "keys": [{}, {"a": None, "ab": None}, {'q"\u00e9': None, "a": None}],
}
INVALID = {
    "person": [{"name": "Al", "age": 3}, {"name": "", "age": 3, "alive": True},
               {"name": "Al", "age": 3.5, "alive": True}, {"name": "Al", "age": 3, "alive": True, "x": 1},
               {"name": "Al", "age": 3, "alive": True, "tags": []}, {"name": "Alphabets", "age": 1, "alive": True},
               {"name": "Al", "age": 3, "alive": True, "pet": "cow"}, [1]],
    "open": [{"id": "1"}, {"id": 1, "zz": [1]}, {"id": 1, "zz": [True, True, True]}, []],
    "open_required": [{}, {"x": 1}, {"id": None}],
    "tree": [{"v": 2, "kids": []}, {"v": 1}, {"v": 1, "kids": [None]}, 1],
    "keys": [{"b": None}, {"a": 1}],
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_instances_agree_with_jsonschema(name):
    root = compile_schema(SCHEMAS[name])
    for value in VALID[name]:
        jsonschema.validate(value, SCHEMAS[name])
        for style in range(4):
            # a closed object's names are matched as written without \u escapes (documented), so the
            # ASCII-only styles (0, 2) of a non-ASCII name are refused
            escaped = style in (0, 2) and name == "keys" and any(not k.isascii() for k in value)
            assert matches(root, dumps(value, style)) != escaped, (value, style)
    for value in INVALID[name]:
        assert not jsonschema.Draft202012Validator(SCHEMAS[name]).is_valid(value)
        assert not any(matches(root, dumps(value, style)) for style in range(4)), value


def test_pydantic_schemas_compile():
    pydantic = pytest.importorskip("pydantic")

    class Pet(pydantic.BaseModel):
        name: str
        kind: str = "cat"

    class Owner(pydantic.BaseModel):
        name: str
        pets: list[Pet]
        best: Pet | None = None
        age: int | None = None

    schema = Owner.model_json_schema()
    root = compile_schema(schema)
    good = Owner(name="A", pets=[Pet(name="b")], best=None, age=4).model_dump_json().encode()
    assert matches(root, good)
    assert not matches(root, b'{"name": "A", "pets": [{"kind": "dog"}]}')  # a pet without its name


@pytest.mark.parametrize("schema, fragment", [
    ({"type": "string", "pattern": "^a"}, "'pattern' is not supported"),
    ({"type": "integer", "minimum": 0}, "'minimum' is not supported"),
    ({"type": "thing"}, "'type' must be one of"),
    ({"$ref": "#/$defs/missing"}, "names no schema"),
    ({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, "refers to itself"),
    ({"type": "object", "required": ["x"], "additionalProperties": False}, "'x' is required"),
    ({"enum": []}, "non-empty"),
    ({"allOf": [{"type": "string"}, {"type": "null"}]}, "exactly one"),
    ("string", "must be a JSON object"),
])
def test_unsupported_schemas_are_refused_by_name(schema, fragment):
    with pytest.raises(SchemaError, match=re.escape(fragment)):
        compile_schema(schema)


def test_limits_leave_no_dead_end():
    root = compile_schema({"type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"],
                           "additionalProperties": False})
    # a number at its byte cap must already be one that can end there
    states = advance(initial_states(root), b'{"n":' + b"1" * 30)
    assert allowed_bytes(states) and 0x2E not in allowed_bytes(advance(states, b"1"))
    # free keys past their cap take only the closing quote
    assert not advance(initial_states(any_object()), b'{"' + b"k" * (MAX_KEY + 1))
    states = advance(initial_states(any_object()), b'{"' + b"k" * MAX_KEY)
    assert allowed_bytes(states) == [0x22]
    # whitespace past its cap
    assert not advance(initial_states(any_object()), b"{" + b" " * (MAX_WHITESPACE + 1))
    assert advance(initial_states(any_object()), b"{" + b" " * MAX_WHITESPACE + b"}")
    assert not advance(initial_states(any_object()), b" ")  # the value starts at once
    # nothing after the value, not even whitespace: the end token comes next
    assert allowed_bytes(advance(initial_states(any_object()), b"{}")) == []


# -- the sampler under a matcher --------------------------------------------------------------------


class ByteVocab:
    """A vocabulary of the 256 single bytes, some JSON-ish multi-byte tokens, a control token <ctl>
    and an end token (the last id)."""

    def __init__(self, rng: random.Random):
        words = [b'{"', b'":', b'",', b'"}', b"true", b"null", b"12", b"-0.5", b" {", b"}\n", b"ab", b'\\u00',
                 b"\xc3\xa9", b"\xc3", b"]]", b"[[", b'"name', b'"age"', b"  ", b"{ "]
        extra = [bytes(rng.choice(b'{}[]":, abc0123\\') for _ in range(rng.randint(2, 5))) for _ in range(60)]
        self.data = [bytes((b,)) for b in range(256)] + words + extra + [b"<ctl>", b"<end>"]
        self.end = len(self.data) - 1

    @property
    def vocab_size(self) -> int:
        return len(self.data)

    def token_bytes(self, token_id: int) -> bytes:
        return self.data[token_id]

    def text_token_bytes(self) -> list[bytes]:
        return [b"" if i >= self.end - 1 else d for i, d in enumerate(self.data)]


def matcher_for(vocab: ByteVocab, schema=None) -> ByteMatcher:
    root = any_object() if schema is None else compile_schema(schema)
    return json_matcher(root, TokenTable.build(vocab), [vocab.end])


def brute_allowed(m: ByteMatcher, n: int) -> np.ndarray:
    return np.array([m.allows(t) for t in range(n)])


def as_top(row: np.ndarray, k: int = 64) -> TopLogits:
    vals, ids = top_logits(row, k)
    return TopLogits(vals, ids, fetch=lambda r: row)


@pytest.mark.parametrize("seed", range(6))
def test_greedy_pick_is_the_largest_allowed_token(seed):
    rng = random.Random(seed)
    vocab = ByteVocab(rng)
    n = vocab.vocab_size
    nprng = np.random.default_rng(seed)
    m_row, m_top = matcher_for(vocab, SCHEMAS["person"]), matcher_for(vocab, SCHEMAS["person"])
    s_row = Sampler(SamplingParams(temperature=0.0, top_k=0, top_p=1.0), grammar=m_row)
    s_top = Sampler(SamplingParams(temperature=0.0, top_k=0, top_p=1.0), grammar=m_top)
    assert not s_row.chains and s_row.candidates == 64
    out = b""
    for _ in range(200):
        row = nprng.standard_normal(n).astype(np.float32)
        row[nprng.integers(0, n, 3)] = row.max()  # ties go to the lower id
        ok = brute_allowed(m_row, n)
        best = int(np.flatnonzero(ok)[np.argmax(row[ok])])  # first (lowest id) of the allowed maxima
        assert s_row(row) == best
        assert s_top(as_top(row)) == best  # from the step's top 64, or its whole row when none is allowed
        if best == vocab.end:
            break
        out += vocab.data[best]
    assert advance(initial_states(compile_schema(SCHEMAS["person"])), out)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (20, 0.9)])
def test_sampled_picks_draw_from_the_allowed_window(top_k, top_p):
    """A seeded pick from the step's top 64 equals the pick from its whole row, and is the draw
    from the allowed tokens of the first 64-rank run of the row that holds one (reference built from
    a brute-force mask)."""
    rng = random.Random(top_k)
    vocab = ByteVocab(rng)
    n = vocab.vocab_size
    nprng = np.random.default_rng(11)
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, seed=5)
    m1, m2, m3 = (matcher_for(vocab) for _ in range(3))
    s1, s2 = Sampler(params, grammar=m1), Sampler(params, grammar=m2)
    ref_rng = np.random.default_rng(5)
    for _ in range(150):
        row = (3 * nprng.standard_normal(n)).astype(np.float32)
        ok = brute_allowed(m3, n)
        order = np.argsort(-row, kind="stable")
        first = int(np.flatnonzero(ok[order])[0]) // 64
        window = order[first * 64:(first + 1) * 64]
        ids = window[ok[window]]
        if top_k:
            ids = ids[:top_k]
        # the reference draw: softmax(x / T) over those, top-p, then the inverse CDF at the seed's number
        p = np.exp((row[ids].astype(np.float64) - row[ids].max()) / 0.8)
        p /= p.sum()
        keep = min(len(p), int(np.searchsorted(np.cumsum(p), top_p, side="left")) + 1) if top_p < 1 else len(p)
        p = p[:keep] / p[:keep].sum()
        u = ref_rng.random()
        want = int(ids[min(int(np.searchsorted(np.cumsum(p), u, side="right")), keep - 1)])
        a, b = s1(row), s2(as_top(row))
        assert a == b == want
        if a == vocab.end:
            break
        m3.feed(a)
    assert not m1.thinking


def test_thinking_runs_free_until_it_closes(fixtures_dir):
    from minecart.engine.gguf_file import GGUFFile
    from minecart.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf"))
    end = tok.id_of("<|im_end|>")
    fmt = json_object_format()
    open_ids = tok.encode("<|im_start|>assistant\n<think>\n", add_special=False)
    closed_ids = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special=False)
    m = fmt.matcher(tok, [end], open_ids)
    assert m.thinking and m.allows(tok.encode("Hmm")[0]) and not m.allows(end)
    for t in tok.encode("Let me think.") + [tok.id_of("</think>")]:
        m.feed(t)
    assert not m.thinking
    assert not m.allows(tok.encode("Hmm")[0]) and m.allows(tok.encode("{")[0]) and not m.allows(end)
    # a prompt that closed its think block starts in JSON; control and user-defined tokens never enter
    m2 = fmt.matcher(tok, [end], closed_ids)
    assert not m2.thinking and not m2.allows(tok.id_of("<tool_call>"))
    for t in tok.encode('{"a": "<think>"}'):
        m2.feed(t)
    assert m2.complete and m2.allows(end) and not m2.allows(tok.id_of("</think>"))


# -- the fixture model through the engine ---------------------------------------------------------



@pytest.fixture(scope="module")
def tiny_model(fixtures_dir):
    from minecart.engine.model import load_model

    return load_model(fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf", devices=["cpu:0"])


def _answer(model, params, thinking=False):
    from minecart.engine.generation import generate

    msgs = [{"role": "user", "content": "Describe an animal as JSON."}]
    events = list(generate(model, msgs, params, enable_thinking=thinking))
    return "".join(e.text for e in events), events[-1].finish_reason


@pytest.mark.parametrize("params", [
    dict(temperature=0.0, top_k=0, top_p=1.0),
    dict(temperature=1.0, top_k=0, top_p=1.0, seed=1),
    dict(temperature=0.7, top_k=20, top_p=0.8, seed=2, presence_penalty=0.5),
])
def test_fixture_model_answers_in_the_schema(tiny_model, params):
    text, finish = _answer(tiny_model, SamplingParams(max_tokens=400, answer_format=json_schema_format(ANSWER),
                                                      **params))
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), ANSWER)
    # without the format the same model does not answer JSON at all (so the check above can fail)
    free, _ = _answer(tiny_model, SamplingParams(max_tokens=60, **params))
    with pytest.raises(ValueError):
        json.loads(free)


def test_fixture_model_json_object_stays_a_prefix_of_json(tiny_model):
    text, finish = _answer(tiny_model, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=4,
                                                      max_tokens=80, answer_format=json_object_format()))
    root = any_object()
    data = text.encode()
    assert advance(initial_states(root), data), data
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length"
