"""Caller mistakes against the HTTP API: every one a 4xx with an OpenAI error body, never a 500, and
a 500 (a bug inside a route) never drops the kept-alive connection. Real uvicorn on loopback over the
fake model; token ids run through the real engine on the fixture GGUF.

The issue's cases failed before their fix (the remaining parameters guard answers that already
held): these bodies were 500 `internal error` (stream_options not an object,
tool_choice {"function": "g"}, token ids 2**63 or outside the vocabulary, JSON nested 100k deep, lone
surrogates in tools and tool-call arguments), invalid tool schemas and max_tokens 10**30 were accepted,
an unknown model was answered by the loaded one, /metrics and /openapi.json stayed open under
--api-key and /health and /metrics showed the model's file path, and after any 500 the next request
on the same connection failed.
"""

from __future__ import annotations

import json

import httpx
import pytest
from minecart.engine.runtime import Runtime
from minecart.engine.server import ServerThread, create_app

from tests.engine.fake_chat_model import FakeModel, fake_loader

TIMEOUT = 30.0
MODEL_PATH = "/models/secret-dir/fake-model.gguf"
USER = [{"role": "user", "content": "hi"}]


def _tool(name="get_weather", description="Weather", parameters=None) -> dict:
    params = parameters if parameters is not None else {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": params}}


@pytest.fixture(scope="module")
def fake():
    model = FakeModel()
    rt = Runtime(loader=fake_loader(model), sample_memory_s=0)
    rt.load(MODEL_PATH).result(TIMEOUT)
    server = ServerThread(create_app(rt)).start()
    yield server, rt
    server.stop()
    rt.close()


def _post(server, body, path="/v1/chat/completions", **kw):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=TIMEOUT,
                      headers={"content-type": "application/json"}, **kw)


def _assert_openai_400(r, fragment: str, status: int = 400):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert fragment in err["message"], err["message"]
    assert "Traceback" not in r.text


# Raw bodies: JSON escapes the json module would not write (lone surrogates) and deep nesting.
LONE = "\\ud800"
TOOLS_SURROGATE = {
    "name": '{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":'
            '{"name":"f' + LONE + '"}}]}',
    "description": '{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function",'
                   '"function":{"name":"f","description":"d' + LONE + '"}}]}',
    "parameters": '{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function",'
                  '"function":{"name":"f","parameters":{"type":"object","properties":{"a' + LONE
                  + '":{"type":"string"}}}}}]}',
    "arguments": '{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":null,'
                 '"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":'
                 '"{\\"a\\": \\"' + "\\\\ud800" + '\\"}"}}]}]}',
    "arguments object": '{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":'
                        'null,"tool_calls":[{"type":"function","function":{"name":"f","arguments":'
                        '{"a":"' + LONE + '"}}}]}]}',
}


@pytest.mark.parametrize("where", list(TOOLS_SURROGATE))
def test_lone_surrogates_in_tools_are_400(fake, where):
    server, _ = fake
    _assert_openai_400(_post(server, TOOLS_SURROGATE[where]), "surrogate")


@pytest.mark.parametrize("body, fragment", [
    ({"messages": USER, "stream": True, "stream_options": "yes"}, "stream_options"),
    ({"messages": USER, "stream_options": [1]}, "stream_options"),
    ({"messages": USER, "tools": [_tool()], "tool_choice": {"function": "g"}}, "tool_choice"),
    ({"messages": USER, "tools": [_tool()], "tool_choice": {"type": "function",
                                                             "function": {"name": "g"}}}, "'g'"),
    ({"messages": USER, "tools": [_tool(parameters={"type": "array"})]}, "type 'object'"),
    ({"messages": USER, "tools": [_tool(parameters={"type": "object", "properties": []})]},
     "properties"),
    ({"messages": USER, "tools": [_tool(parameters={"type": "object", "properties": {
        "a": {"type": "strin"}}})]}, "'type' must be one of"),
    ({"messages": USER, "tools": [_tool(parameters={"type": "object", "required": "a"})]},
     "required"),
    ({"messages": USER, "tools": [_tool(name="has space")]}, "tool name"),
    ({"messages": USER, "tools": [_tool(name="")]}, "tool name"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]},
     "tools[0].function.parameters"),
    ({"messages": USER, "temperature": float("nan")}, "'temperature'"),
    ({"messages": USER, "seed": -1}, "'seed'"),
    ({"messages": USER, "max_tokens": 2.5}, "'max_tokens'"),
    ({"messages": USER, "max_tokens": True}, "'max_tokens'"),
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs needs logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "'top_logprobs'"),
    ({"messages": USER, "logprobs": "yes"}, "'logprobs'"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}},
     "refers to itself"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": list(range(2000))}}}},
     "more than 1024 values"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"type": "integer", "multipleOf": 3}}}}}}, "'multipleOf'"),
    ({"messages": USER, "response_format": {"type": "json_object", "json_schema": 5}}, "response_format"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "[1]"}}]}]}, "must be a JSON object"),
    ({"messages": USER, "chat_template_mode": "sideways"}, "chat_template_mode"),
    ([1, 2], "JSON object"),
])
def test_caller_mistakes_in_chat_are_400(fake, body, fragment):
    server, _ = fake
    _assert_openai_400(_post(server, json.dumps(body)), fragment)


@pytest.mark.parametrize("prompt, fragment", [
    ([2**63], "'prompt'"), ([-1], "'prompt'"), ([], "'prompt'"), ("", "'prompt'"), ([[1], [2]], "'prompt'"),
    ([1.5], "'prompt'"), ({"a": 1}, "'prompt'"),
])
def test_bad_completion_prompts_are_400(fake, prompt, fragment):
    server, _ = fake
    _assert_openai_400(_post(server, {"prompt": prompt}, "/v1/completions"), fragment)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_json_nested_100k_deep_is_400(fake, path):
    server, _ = fake
    deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    _assert_openai_400(_post(server, deep, path), "nested too deeply")


def test_max_tokens_beyond_the_context_is_capped(fake):
    server, rt = fake
    r = _post(server, {"messages": USER, "max_tokens": 10**30, "temperature": 0})
    assert r.status_code == 200, r.text
    r = _post(server, {"prompt": "abc", "max_tokens": 10**30}, "/v1/completions")
    assert r.status_code == 200, r.text


def test_an_unknown_model_is_404_and_the_loaded_one_is_served(fake):
    server, _ = fake
    r = _post(server, {"model": "gpt-4", "messages": USER})
    _assert_openai_400(r, "gpt-4", status=404)
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    r = _post(server, {"model": "gpt-4", "prompt": "x"}, "/v1/completions")
    assert r.status_code == 404
    for name in ("fake-model", "fake-model.gguf", None):
        body = {"messages": USER, "max_tokens": 2} | ({"model": name} if name else {})
        assert _post(server, body).status_code == 200, name


def test_no_response_reveals_the_model_file_path(fake):
    server, _ = fake
    for path in ("/health", "/metrics", "/v1/models", "/openapi.json"):
        r = httpx.get(server.url + path, timeout=TIMEOUT)
        assert r.status_code == 200 and "secret-dir" not in r.text, path


def test_with_an_api_key_metrics_and_openapi_need_it():
    model = FakeModel()
    rt = Runtime(loader=fake_loader(model), sample_memory_s=0)
    try:
        rt.load(MODEL_PATH).result(TIMEOUT)
        with ServerThread(create_app(rt, api_key="s3cret")) as server:
            for path in ("/metrics", "/openapi.json", "/v1/models"):
                r = httpx.get(server.url + path, timeout=TIMEOUT)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
                r = httpx.get(server.url + path, headers={"authorization": "Bearer s3cret"},
                              timeout=TIMEOUT)
                assert r.status_code == 200 and "secret-dir" not in r.text, path
            health = httpx.get(server.url + "/health", timeout=TIMEOUT)
            assert health.status_code == 200 and "secret-dir" not in health.text
    finally:
        rt.close()


def test_a_500_keeps_the_connection_alive(fake, monkeypatch):
    server, rt = fake

    def broken(*_a, **_k):
        raise RuntimeError("a bug inside the route")

    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        assert client.get("/health").status_code == 200  # the connection is open
        monkeypatch.setattr(rt, "chat", broken)
        r = client.post("/v1/chat/completions", json={"messages": USER})
        assert r.status_code == 500 and "a bug inside the route" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "server_error"
        monkeypatch.undo()
        # the same kept-alive connection answers the next request (it was reset before)
        assert client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}
                           ).status_code == 200
        assert client.get("/health").status_code == 200


def test_content_type_and_size_are_still_checked_before_parsing(fake):
    server, _ = fake
    r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps({"messages": USER}),
                   headers={"content-type": "text/plain"}, timeout=TIMEOUT)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def real(fixtures_dir):
    rt = Runtime(sample_memory_s=0)
    rt.load(fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf", devices=["cpu"]).result(120)
    server = ServerThread(create_app(rt)).start()
    yield server
    server.stop()
    rt.close()


def test_token_ids_outside_the_vocabulary_are_400(real):
    for prompt in ([10**6], [5, 248320], [2**31 - 1]):
        r = _post(real, {"prompt": prompt, "max_tokens": 2}, "/v1/completions")
        _assert_openai_400(r, "outside the vocabulary")
    r = _post(real, {"prompt": [5, 7], "max_tokens": 2, "temperature": 0}, "/v1/completions")
    assert r.status_code == 200, r.text
