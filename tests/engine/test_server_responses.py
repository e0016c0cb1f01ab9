"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}) with the official `openai`
client against a real server on 127.0.0.1: over the fake model (what reaches the template, the output
items, streaming events, stored conversations, tool calls, errors) and once over the real fixture model
(a JSON answer through text.format)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from minecart.engine.runtime import Runtime
from minecart.engine.server import ServerThread, create_app

from tests.engine.fake_chat_model import default_reply
from tests.engine.test_server import QWEN_CALL

TIMEOUT = 20.0
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"]}}


@pytest.fixture
def served(fake_server):  # tests/engine/conftest.py
    server, _, model = fake_server
    model.reply, model.delay_s, model.fail_after = default_reply, 0.0, None
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
    return server, model, client


def test_plain_response_with_reasoning_and_usage(served):
    server, model, client = served
    resp = client.responses.create(model="fake-model", instructions="Be brief.", input="Hello!")
    prompt = model.prompts[-1]
    assert prompt.startswith("<|system|>Be brief.\n<|user|>Hello!\n") and prompt.endswith("<think>\n")
    assert resp.status == "completed" and resp.id.startswith("resp_")
    kinds = [item.type for item in resp.output]
    assert kinds == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "I should echo.\n"
    assert resp.output_text == f"echo[{len(prompt)}]"  # the SDK's own join of the output_text parts
    assert resp.usage.input_tokens == len(prompt)
    assert resp.usage.output_tokens == len(default_reply(prompt, True))
    assert 0 < resp.usage.output_tokens_details.reasoning_tokens < resp.usage.output_tokens
    # kept: GET returns it, and a follow-up continues the conversation without the instructions
    assert client.responses.retrieve(resp.id).output_text == resp.output_text
    nxt = client.responses.create(model="fake-model", input="And again? /no_think", previous_response_id=resp.id)
    prompt2 = model.prompts[-1]
    assert "Be brief." not in prompt2  # instructions do not carry over (as OpenAI's)
    assert prompt2.startswith(f"<|user|>Hello!\n<|assistant|>{resp.output_text}\n<|user|>And again?")
    assert nxt.output_text == f"echo[{len(prompt2)}]" and [i.type for i in nxt.output] == ["message"]


def test_streamed_events_build_the_same_response(served):
    server, model, client = served
    kinds, text, reasoning = [], "", ""
    final = None
    for event in client.responses.create(model="fake-model", input=[{"role": "user", "content": "stream please"}],
                                         stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.reasoning_text.delta":
            reasoning += event.delta
        elif event.type == "response.completed":
            final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    prompt = model.prompts[-1]
    assert text == f"echo[{len(prompt)}]" and reasoning == "I should echo.\n"
    assert final is not None and final.output_text == text and final.output[0].content[0].text == reasoning
    # the SDK's stream helper accumulates the same events into its own final response
    with client.responses.stream(model="fake-model", input="stream please") as stream:
        helper = stream.get_final_response()
    assert helper.output_text == f"echo[{len(model.prompts[-1])}]"
    assert [i.type for i in helper.output] == ["reasoning", "message"]


@pytest.mark.parametrize("stream", [False, True])
def test_function_calls_and_their_outputs(served, stream):
    server, model, client = served
    model.reply = lambda p, t: QWEN_CALL
    first = client.responses.create(model="fake-model", input="Weather in Paris? /no_think", tools=[WEATHER],
                                    stream=False)
    calls = [i for i in first.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3}
    assert "tools: get_weather" in model.prompts[-1]
    # the client runs the tool and sends its output back, continuing the stored response
    model.reply = default_reply
    follow = dict(model="fake-model", previous_response_id=first.id, tools=[WEATHER],
                  input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    if stream:
        events = list(client.responses.create(stream=True, **follow))
        out = events[-1].response
    else:
        out = client.responses.create(**follow)
    prompt = model.prompts[-1]
    assert "<|tool|>sunny, 21 C" in prompt and "<|user|>Weather in Paris?" in prompt
    assert out.output_text.startswith("echo[")
    # the whole conversation sent at once (no stored state) renders the same prompt
    model.reply = default_reply
    again = client.responses.create(model="fake-model", tools=[WEATHER], store=False, input=[
        {"role": "user", "content": "Weather in Paris? /no_think"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert model.prompts[-1].endswith(prompt[prompt.index("<|tool|>"):])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(again.id)  # store=False keeps nothing


def test_json_format_and_max_output_tokens(served):
    server, model, client = served
    resp = client.responses.create(model="fake-model", input="hi", max_output_tokens=3)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3


@pytest.mark.parametrize("body, status, fragment", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "function tools only"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "not known"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, 400,
     "data: URL"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image",
                                                                "image_url": "https://x/y.png"}]}]}, 400, "data: URL"),
    ({"input": []}, 400, "no input"),
    ({"input": 5}, 400, "input"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "string",
                                                                                        "pattern": "^a"}}}},
     400, "'pattern' is not supported"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, 400,
     "must be a JSON object"),
    ({"input": "x", "model": "gpt-5"}, 404, "not loaded"),
])
def test_bad_requests_name_the_problem(served, body, status, fragment):
    server, model, client = served
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=TIMEOUT)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]
    assert client.responses.create(model="fake-model", input="still fine").status == "completed"


def test_fixture_model_answers_a_json_format(fixtures_dir):
    rt = Runtime(sample_memory_s=0)
    try:
        rt.load(fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf", devices=["cpu"]).result(120)
        with ServerThread(create_app(rt)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)
            schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
                      "required": ["kind", "ok"], "additionalProperties": False}
            resp = client.responses.create(
                input="An animal as JSON", reasoning={"effort": "none"}, temperature=0, max_output_tokens=200,
                text={"format": {"type": "json_schema", "name": "animal", "schema": schema, "strict": True}})
            assert resp.status == "completed" and [i.type for i in resp.output] == ["message"]
            answer = json.loads(resp.output_text)
            assert set(answer) == {"kind", "ok"} and answer["kind"] in ("cat", "dog")
    finally:
        rt.close()
