"""HTTP API fuzzing: request bodies generated with hypothesis against the real app (uvicorn on
loopback) over the fake model, all on one kept-alive connection. Every answer must be below 500 and
the connection must never drop (a reset fails the request that follows it).

Bodies mix plausible OpenAI fields with arbitrary JSON in any field: wrong types, huge and negative
integers, NaN and infinities, lone surrogates (sent as \\ud800 escapes), nested arrays and objects,
non-object bodies. The bounded run (150 requests, derandomized so CI is deterministic, about 12 s) is
part of every test run; a longer one on demand: `MINECART_FUZZ_REQUESTS=20000 python -m pytest -q -s
tests/fuzz/test_fuzz_api.py` (about 15 requests a second, most of it generating them). Past finds are kept in
tests/data/fuzz_corpus/api/ and replayed with their expected status.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from minecart.engine.runtime import Runtime
from minecart.engine.server import ServerThread, create_app

from tests.engine.fake_chat_model import FakeModel, fake_loader

CORPUS = Path(__file__).resolve().parents[1] / "data" / "fuzz_corpus" / "api"
REQUESTS = int(os.environ.get("MINECART_FUZZ_REQUESTS", "150"))
TIMEOUT = 30.0

# any text, lone surrogates included (json.dumps escapes them as \udXXX)
text = st.text(st.characters(exclude_categories=()), max_size=12)
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | text)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(text, inner, max_size=4), max_leaves=12)


def maybe(valid):
    """Mostly a plausible value, sometimes anything at all."""
    return st.one_of(*[valid] * 7, json_values)


parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": maybe(text)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries(
        {"url": maybe(st.sampled_from(["data:image/png;base64,iVBORw0KGgo=", "data:,", "/etc/passwd",
                                       "https://example.com/a.png"]))})}),
    json_values)
tool_calls = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": maybe(text), "arguments": maybe(st.sampled_from(['{"a": 1}', "[1]", "{", "", '{"a": "\\ud800"}'])
                                             | st.dictionaries(text, json_values, max_size=3))})}),
    max_size=2)
messages = st.lists(st.fixed_dictionaries(
    {"role": maybe(st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"]))},
    optional={"content": maybe(text | st.lists(parts, max_size=3) | st.none()), "tool_calls": maybe(tool_calls),
              "tool_call_id": maybe(text), "name": maybe(text), "reasoning_content": maybe(text)}),
    max_size=4)
schemas = st.recursive(st.fixed_dictionaries({"type": maybe(st.sampled_from(
    ["object", "string", "integer", "array", "strin"]))}),
    lambda inner: st.fixed_dictionaries({"type": st.just("object"),
                                         "properties": st.dictionaries(text, inner, max_size=3)},
                                        optional={"required": maybe(st.lists(text, max_size=2))}),
    max_leaves=5)
tools = st.lists(st.fixed_dictionaries({"type": maybe(st.just("function")), "function": maybe(st.fixed_dictionaries(
    {"name": maybe(st.sampled_from(["get_weather", "f", "has space", ""]) | text)},
    optional={"description": maybe(text), "parameters": maybe(schemas)}))}), max_size=3)
numbers = st.one_of(*[st.floats(0, 1)] * 4, st.integers(-3, 3), st.floats(-3, 3),
                    st.sampled_from([0, 1, 2**63, 10**30, -(2**63)]))
common = {
    "model": maybe(st.sampled_from(["fake-model", "fake-model.gguf", "gpt-4"])),
    "temperature": maybe(numbers), "top_p": maybe(numbers), "top_k": maybe(numbers),
    "min_p": maybe(numbers), "repetition_penalty": maybe(numbers), "presence_penalty": maybe(numbers),
    "frequency_penalty": maybe(numbers), "seed": maybe(numbers), "n": maybe(numbers),
    "max_tokens": maybe(st.integers(-2, 8) | st.sampled_from([10**30, 2**63])),
    "max_completion_tokens": maybe(st.integers(-2, 8)),
    "stop": maybe(text | st.lists(text, max_size=20)), "stream": maybe(st.booleans()),
    "stream_options": maybe(st.fixed_dictionaries({"include_usage": maybe(st.booleans())})),
    "logprobs": maybe(st.booleans() | st.integers(-1, 6)), "top_logprobs": maybe(st.integers(-1, 21)),
    "conversation_id": maybe(text | st.integers()),
    "logit_bias": maybe(st.dictionaries(st.sampled_from(["0", "5", "-1", "abc", "248320", "99999999999", ""]),
                                        numbers, max_size=3)),
    "response_format": maybe(st.fixed_dictionaries({"type": maybe(st.sampled_from(
        ["text", "json_object", "json_schema", "xml"]))}, optional={"json_schema": maybe(st.fixed_dictionaries(
            {}, optional={"name": maybe(text), "schema": maybe(schemas), "strict": maybe(st.booleans())}))})),
}
chat_bodies = st.fixed_dictionaries({"messages": maybe(messages)}, optional={
    **common, "tools": maybe(tools), "chat_template_kwargs": maybe(st.fixed_dictionaries(
        {"enable_thinking": maybe(st.booleans())})),
    "tool_choice": maybe(st.sampled_from(["none", "auto", "required", {"function": "g"},
                                          {"type": "function", "function": {"name": "get_weather"}}])),
    "enable_thinking": maybe(st.booleans()), "reasoning_effort": maybe(st.sampled_from(["none", "high"])),
    "chat_template_mode": maybe(st.sampled_from(["auto", "on", "off", "sideways"]))})
completion_bodies = st.fixed_dictionaries({"prompt": maybe(
    text | st.lists(st.integers(-5, 300) | st.sampled_from([2**31, 2**63, 10**30]), max_size=5))},
    optional={**common, "echo": maybe(st.booleans()), "suffix": maybe(text)})
# bodies a careful client sends: they must be served (200), streaming or not, with tools or not
plain_tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.from_regex(r"[a-z_]{1,12}", fullmatch=True)},
    optional={"description": text, "parameters": st.just(
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})})})
served_options = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "seed": st.integers(0, 2**64 - 1),
                  "max_tokens": st.integers(1, 8) | st.just(10**30), "stream": st.booleans(),
                  "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
                  "stop": st.lists(text, max_size=3), "model": st.sampled_from(["fake-model", "fake-model.gguf"])}
served_chats = st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": text}), min_size=1, max_size=3)},
    optional={**served_options, "tools": st.lists(plain_tool, max_size=2),
              "chat_template_kwargs": st.fixed_dictionaries({"enable_thinking": st.booleans()})})
served_completions = st.fixed_dictionaries({"prompt": text.filter(bool) | st.lists(
    st.integers(0, 255), min_size=1, max_size=5)}, optional=served_options)
# the Responses API: its input items, tools and formats, well-formed or not
input_parts = st.lists(st.fixed_dictionaries({"type": maybe(st.sampled_from(
    ["input_text", "output_text", "input_image", "refusal", "audio"]))}, optional={
    "text": maybe(text), "image_url": maybe(st.sampled_from(["data:image/png;base64,iVBORw0KGgo=", "http://x/y"])),
    "refusal": maybe(text)}), max_size=3)
input_items = st.lists(st.one_of(
    st.fixed_dictionaries({"role": maybe(st.sampled_from(["user", "system", "developer", "assistant", "tool"]))},
                          optional={"type": maybe(st.just("message")), "content": maybe(text | input_parts)}),
    st.fixed_dictionaries({"type": st.just("function_call")}, optional={
        "call_id": maybe(text), "name": maybe(text), "arguments": maybe(text | st.just('{"city": "x"}'))}),
    st.fixed_dictionaries({"type": st.just("function_call_output")}, optional={
        "call_id": maybe(text), "output": maybe(text | input_parts)}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "web_search_call", "nope"])})), max_size=4)
responses_bodies = st.fixed_dictionaries({"input": maybe(text | input_items)}, optional={
    "model": maybe(st.sampled_from(["fake-model", "gpt-5"])), "instructions": maybe(text),
    "tools": maybe(st.lists(st.fixed_dictionaries({"type": maybe(st.sampled_from(["function", "web_search"]))},
                                                  optional={"name": maybe(text), "parameters": maybe(schemas)}),
                            max_size=2)),
    "tool_choice": maybe(st.sampled_from(["none", "auto", "required", {"type": "function", "name": "f"}, 3])),
    "temperature": maybe(numbers), "max_output_tokens": maybe(st.integers(-2, 8)), "stream": maybe(st.booleans()),
    "store": maybe(st.booleans()), "previous_response_id": maybe(text),
    "text": maybe(st.fixed_dictionaries({"format": maybe(st.fixed_dictionaries({"type": maybe(st.sampled_from(
        ["text", "json_object", "json_schema", "xml"]))}, optional={"name": maybe(text),
                                                                    "schema": maybe(schemas)}))})),
    "reasoning": maybe(st.fixed_dictionaries({"effort": maybe(st.sampled_from(["none", "high", 5]))}))})
requests = st.one_of(
    st.tuples(st.just("/v1/responses"), responses_bodies),
    st.tuples(st.just("/v1/chat/completions"), served_chats),
    st.tuples(st.just("/v1/completions"), served_completions),
    st.tuples(st.just("/v1/chat/completions"), chat_bodies),
    st.tuples(st.just("/v1/chat/completions"), chat_bodies),
    st.tuples(st.just("/v1/completions"), completion_bodies),
    st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses"]), json_values))


@pytest.fixture(scope="module")
def client():
    model = FakeModel()
    rt = Runtime(loader=fake_loader(model), sample_memory_s=0)
    rt.load("/models/fake-model.gguf").result(TIMEOUT)
    server = ServerThread(create_app(rt)).start()
    # one connection for every request: a 500 that reset it would fail the next request
    with httpx.Client(base_url=server.url, timeout=TIMEOUT,
                      limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)) as c:
        yield c
    server.stop()
    rt.close()


def _send(client: httpx.Client, path: str, raw: str) -> httpx.Response:
    return client.post(path, content=raw.encode("utf-8", "surrogatepass"),
                       headers={"content-type": "application/json"})


def test_generated_requests_never_get_a_5xx_or_a_dropped_connection(client):
    statuses: Counter[int] = Counter()

    @settings(max_examples=REQUESTS, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(requests)
    def one(request):
        path, body = request
        raw = json.dumps(body)  # NaN/Infinity as JSON's extension, surrogates as \\udXXX escapes
        r = _send(client, path, raw)
        statuses[r.status_code] += 1
        assert r.status_code < 500, f"{path} {raw[:400]} -> {r.status_code} {r.text[:400]}"
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text

    one()
    print(f"API fuzz, {REQUESTS} requests: {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) == REQUESTS
    assert statuses[200] and statuses[400]  # both the served and the refused paths were reached
    assert client.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize("entry", sorted(CORPUS.glob("*.json")), ids=lambda p: p.stem)
def test_corpus_of_past_finds_replays(client, entry):
    case = json.loads(entry.read_text())
    raw = case["body"]
    if "nest_depth" in case:
        raw += "[" * case["nest_depth"] + "]" * case["nest_depth"] + case["body_end"]
    r = _send(client, case["path"], raw)
    assert r.status_code == case["status"], r.text[:400]
    assert client.get("/health").status_code == 200  # and the connection is still usable
