"""response_format over HTTP: the official `openai` client's structured-output helper (a pydantic model
turned into a strict json_schema) and plain json_object / json_schema requests against a real server
on 127.0.0.1 running the Qwen3.5 fixture model, one request at a time and batched (Runtime(parallel));
the answers are checked by pydantic and `jsonschema`, not by the code under test."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
from minecart.engine.runtime import Runtime
from minecart.engine.server import ServerThread, create_app

MODEL = "qwen35-tiny-dense-q8_0"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "Describe one animal as JSON."}]


class Animal(pydantic.BaseModel):
    kind: Literal["cat", "dog", "bird"]
    legs: Literal[0, 2, 4]
    tame: bool
    rating: Literal[1, 2, 3] | None


SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["kind", "ok", "tags"],
    "additionalProperties": False,
}


def _serve(fixtures_dir, parallel: int):
    rt = Runtime(sample_memory_s=0, parallel=parallel)
    rt.load(fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf", devices=["cpu"]).result(120)
    server = ServerThread(create_app(rt)).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)
    return rt, server, client


@pytest.fixture(scope="module", params=[1, 3], ids=["one-at-a-time", "batched"])
def served(request, fixtures_dir):
    rt, server, client = _serve(fixtures_dir, request.param)
    yield client, request.param
    server.stop()
    rt.close()


def test_openai_parse_helper_gets_its_model(served):
    client, _ = served
    for seed, temperature in ((0, 0.0), (1, 1.0), (2, 0.7)):
        resp = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Animal, seed=seed,
                                             temperature=temperature, max_tokens=300, extra_body=NO_THINK)
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Animal)  # parsed and validated by the client's pydantic


def test_json_schema_streamed_and_batched(served):
    client, parallel = served
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}

    def one(seed: int) -> str:
        parts = []
        for chunk in client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, seed=seed,
                                                    temperature=1.0, max_tokens=300, stream=True,
                                                    extra_body=NO_THINK):
            for ch in chunk.choices:
                parts.append(ch.delta.content or "")
        return "".join(parts)

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        texts = list(pool.map(one, range(4)))
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_completions_route(served):
    client, _ = served
    resp = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                          temperature=1.0, seed=5, max_tokens=60, extra_body=NO_THINK)
    text = resp.choices[0].message.content or ""
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # the tiny model may run out of tokens inside the object: what came is still its start
        assert text.lstrip().startswith("{")
    done = client.completions.create(model=MODEL, prompt="An animal as JSON:", max_tokens=300, temperature=0,
                                     extra_body={"response_format": {"type": "json_schema",
                                                                     "json_schema": {"name": "a", "schema": SCHEMA}}})
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)


@pytest.mark.parametrize("extra, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "^a"}}}}}},
     "keyword 'pattern' is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "needs json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "cannot be combined with tools"),
])
def test_bad_formats_are_400s_naming_the_problem(served, extra, fragment):
    client, _ = served
    with pytest.raises(openai.BadRequestError, match=fragment):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=extra)
    # the server is still fine
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body=NO_THINK)
    assert ok.choices[0].finish_reason == "length"


def test_a_schema_too_ambiguous_to_follow_is_a_clear_400(served, fixtures_dir):
    """Ten array alternatives that begin alike, nested: the readings multiply by ten an array deep. A
    logit bias on "[" makes the model nest them; past MAX_STATES readings the answer stops with a 400
    that says why, and the server goes on."""
    from minecart.engine.gguf_file import GGUFFile
    from minecart.engine.tokenizer import Tokenizer

    client, _ = served
    bracket = Tokenizer.from_gguf(GGUFFile(fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf")).encode("[")
    assert len(bracket) == 1
    nested = {"$defs": {"u": {"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/u"}} for _ in range(10)]
                              + [{"type": "integer"}]}}, "$ref": "#/$defs/u"}
    with pytest.raises(openai.BadRequestError, match="too ambiguous"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, extra_body=NO_THINK,
                                       logit_bias={str(bracket[0]): 100},
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "n", "schema": nested}})
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body=NO_THINK)
    assert ok.choices[0].finish_reason == "length"
