"""Forced tool calls (engine/tool_call_grammar.py): every text the recognizer completes is read back by
the server's own parser into calls whose arguments `jsonschema` accepts against the tool's parameters,
no state reached is a dead end, and the fixture model, told a call is required, makes one through the
engine and over HTTP with the official client (and without the requirement, does not)."""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest
from minecart.engine.runtime import Runtime
from minecart.engine.server import ServerThread, create_app, parse_tool_calls
from minecart.engine.tool_call_grammar import MAX_CALLS, ToolCallRecognizer, compile_tools

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}, "exact": {"type": "boolean"},
                                         "where": {"type": "object", "properties": {"lat": {"type": "number"}},
                                                   "required": ["lat"], "additionalProperties": False}},
        "required": ["zone", "where"]}}},
    {"type": "function", "function": {"name": "get", "parameters": {"type": "object", "properties": {}}}},
]


def _allowed(rec, states):
    return [b for b in range(256) if rec.advance(states, bytes((b,)))]


def _check_calls(text: str, tools) -> list[dict]:
    """The server's parser on a completed text: every call named, its arguments valid for the tool."""
    content, calls = parse_tool_calls(text, tools)
    assert calls and content == "", (text, content)
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    for call in calls:
        assert call["function"]["name"] in schemas
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    return calls


def test_random_walks_end_in_calls_the_parser_reads_back():
    rec = ToolCallRecognizer(compile_tools(TOOLS))
    rng = random.Random(3)
    done = 0
    names = set()
    for _ in range(60):
        states, data = rec.initial(), b""
        for _ in range(600):
            nxt = _allowed(rec, states)
            end = rec.accepts_end(states)
            assert nxt or end, data  # no dead end
            if end and (not nxt or rng.random() < 0.6):
                break
            weights = [30.0 if b in b"<\n" else 1.0 if 0x20 <= b < 0x7F else 0.05 for b in nxt]
            b = rng.choices(nxt, weights)[0]
            data += bytes((b,))
            states = rec.advance(states, bytes((b,)))
        if rec.accepts_end(states):
            done += 1
            calls = _check_calls(data.decode("utf-8"), TOOLS)
            names.update(c["function"]["name"] for c in calls)
    # (a raw text value ends only once a walk spells "\n</parameter>\n": get_weather's city seldom does;
    # the texts below complete it)
    assert done >= 30 and {"get_time", "get"} <= names


@pytest.mark.parametrize("text, ok", [
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", True),
    ("\n\n<tool_call>\n<function=get>\n</function>\n</tool_call>", True),
    ("<tool_call>\n<function=get_time>\n<parameter=where>\n{\"lat\": -1.5}\n</parameter>\n<parameter=zone>\nUTC\n"
     "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get>\n</function>\n</tool_call>", True),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nA\nB </function> x\n</parameter>\n</function>\n</tool_call>",
     False),  # a closing tag inside a value: the parser would cut the call there
    ("<tool_call>\n<function=get_weather>\n</function>\n</tool_call>", False),  # city is required
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\n3.5\n</parameter>\n<parameter=city>\nX\n</parameter>\n"
     "</function>\n</tool_call>", False),  # days is an integer
    ("<tool_call>\n<function=get_weather>\n<parameter=unit>\nK\n</parameter>\n", False),  # not in the enum
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n<parameter=city>\nY\n</parameter>\n",
     False),  # twice
    ("<tool_call>\n<function=get_wind>\n", False),
    ("Sure! <tool_call>", False),  # a call is required: nothing before it
    ("\n\n\n<tool_call>", False),
])
def test_texts_against_the_recognizer(text, ok):
    rec = ToolCallRecognizer(compile_tools(TOOLS))
    states = rec.advance(rec.initial(), text.encode())
    assert (bool(states) and rec.accepts_end(states)) == ok
    if ok:
        _check_calls(text, TOOLS)


def test_at_most_max_calls_and_names_the_format_cannot_write():
    rec = ToolCallRecognizer(compile_tools(TOOLS))
    one = "<tool_call>\n<function=get>\n</function>\n</tool_call>"
    states = rec.advance(rec.initial(), "\n".join([one] * MAX_CALLS).encode())
    assert rec.accepts_end(states) and _allowed(rec, states) == []
    odd = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a>b": {"type": "string"}, "ok": {"type": "string"}},
        "required": ["a>b"]}}}]
    (spec,) = compile_tools(odd)
    assert [p.name for p in spec.params] == ["ok"] and spec.required == frozenset()


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# tools whose values are bounded (enums, booleans, integers): a random-weight model's raw text seldom
# spells its own end, so the fixture's calls finish within max_tokens only with these
BOUNDED = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                         "days": {"type": "integer"}, "metric": {"type": "boolean"}},
        "required": ["city", "metric"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
]


@pytest.fixture(scope="module")
def api(fixtures_dir):
    rt = Runtime(sample_memory_s=0)
    rt.load(fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf", devices=["cpu"]).result(120)
    with ServerThread(create_app(rt)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)
        yield client, client.models.list().data[0].id
    rt.close()


@pytest.mark.parametrize("choice, parallel", [("required", False), ({"type": "function", "function": {"name": "get_time"}},
                                                                    None)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fixture_model_makes_the_call_it_is_told_to(api, choice, parallel, temperature):
    """One call: parallel_tool_calls false, or a named function."""
    client, model = api
    kwargs = dict(model=model, messages=ASK, tools=BOUNDED, max_tokens=400, temperature=temperature, seed=1,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    resp = client.chat.completions.create(tool_choice=choice, **kwargs, **extra)
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls", msg.content
    assert len(msg.tool_calls) == 1 and (msg.content or "") == ""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED}
    call = msg.tool_calls[0]
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    # without the requirement the random model does not call anything (so the check above can fail)
    free = client.chat.completions.create(tool_choice="auto", **{**kwargs, "max_tokens": 60})
    assert not free.choices[0].message.tool_calls


def test_fixture_model_parallel_calls(api):
    """tool_choice required with parallel calls allowed: the random model goes on calling (up to
    MAX_CALLS) until max_tokens; every call it finished is read back and valid."""
    client, model = api
    resp = client.chat.completions.create(model=model, messages=ASK, tools=BOUNDED, tool_choice="required",
                                          max_tokens=400, temperature=0,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    calls = resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "length" and len(calls) > 2
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED}
    for call in calls[:-1]:  # the last one was cut off by max_tokens
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_responses_api_required_tool(api):
    client, model = api
    tools = [{"type": "function", **BOUNDED[0]["function"]}]
    resp = client.responses.create(model=model, input="Weather in Paris?", tools=tools, tool_choice="required",
                                   parallel_tool_calls=False, reasoning={"effort": "none"}, temperature=0,
                                   max_output_tokens=400)
    assert resp.status == "completed"
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and resp.parallel_tool_calls is False
    jsonschema.validate(json.loads(calls[0].arguments), BOUNDED[0]["function"]["parameters"])
