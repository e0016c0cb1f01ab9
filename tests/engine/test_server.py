"""The OpenAI-compatible HTTP API, exercised with the official `openai` client against a real uvicorn
server on 127.0.0.1 (a free port, in a thread) over a Runtime with the fake model; one end-to-end test
runs the fixture GGUF through the real engine."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from minecart.engine.runtime import Runtime
from minecart.engine.server import (
    ServerThread,
    ToolCallHold,
    create_app,
    parse_tool_calls,
)

from tests.engine.fake_chat_model import FakeModel, default_reply, fake_loader

TIMEOUT = 20.0
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture
def served(fake_server):
    server, rt, model = fake_server
    model.reply, model.delay_s, model.fail_after = default_reply, 0.0, None
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
    return server, rt, model, client


def wait_until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_models_health_metrics(served):
    server, rt, model, client = served
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert client.models.retrieve("fake-model").id == "fake-model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    health = httpx.get(server.url + "/health", timeout=TIMEOUT).json()
    assert health["status"] == "ok" and health["model_loaded"] and health["model"]["name"] == "fake-chat"
    client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "m"}])
    snap = httpx.get(server.url + "/metrics", timeout=TIMEOUT).json()
    assert snap["requests"] and snap["requests"][-1]["finish_reason"] == "stop"
    assert snap["requests"][-1]["generated_tokens"] > 0
    assert snap["runtime"]["alive"]


def test_chat_non_streaming_with_reasoning_and_usage(served):
    server, rt, model, client = served
    resp = client.chat.completions.create(
        model="fake-model", messages=[{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hello!"}],
        temperature=0.0, max_tokens=100,
    )
    prompt = model.prompts[-1]
    assert prompt.endswith("<think>\n") and "Be brief." in prompt
    msg = resp.choices[0].message
    assert msg.content == f"echo[{len(prompt)}]"
    assert msg.reasoning_content == "I should echo.\n"
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == len(default_reply(prompt, True))
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_streaming(served):
    server, rt, model, client = served
    stream = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "stream please"}], stream=True,
        stream_options={"include_usage": True},
    )
    content, reasoning, finishes, usage = [], [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                content.append(choice.delta.content)
            r = getattr(choice.delta, "reasoning_content", None)
            if r:
                reasoning.append(r)
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    prompt = model.prompts[-1]
    assert "".join(content) == f"echo[{len(prompt)}]"
    assert len(content) > 3  # really streamed, token by token
    assert "".join(reasoning) == "I should echo.\n"
    assert finishes == ["stop"]
    assert usage.completion_tokens == len(default_reply(prompt, True))


@pytest.mark.parametrize(
    "how",
    [{"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, {"tag": " /no_think"},
     {"extra_body": {"reasoning_effort": "none"}}],
)
def test_thinking_can_be_turned_off(served, how):
    server, rt, model, client = served
    text = "quick answer" + how.get("tag", "")
    resp = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": text}],
                                          extra_body=how.get("extra_body"))
    prompt = model.prompts[-1]
    assert "<think>" not in prompt and "/no_think" not in prompt and "quick answer" in prompt
    assert resp.choices[0].message.content == f"echo[{len(prompt)}]"
    assert getattr(resp.choices[0].message, "reasoning_content", None) is None


def test_sampling_extras_stop_and_max_tokens(served):
    server, rt, model, client = served
    model.reply = lambda p, t: ("hmm</think>" if t else "") + "one two three four"
    resp = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                          stop=[" three"], extra_body={"top_k": 5, "min_p": 0.1})
    assert resp.choices[0].message.content == "one two"
    assert resp.choices[0].finish_reason == "stop"
    resp = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x /no_think"}],
                                          max_tokens=3, seed=1, presence_penalty=0.5)
    assert resp.choices[0].message.content == "one"
    assert resp.choices[0].finish_reason == "length"


QWEN_CALL = ("Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
             "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls(served, stream):
    server, rt, model, client = served
    model.reply = lambda p, t: QWEN_CALL
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "And Paris? /no_think"},
    ]
    kwargs = dict(model="fake-model", messages=messages, tools=[WEATHER_TOOL], tool_choice="auto")
    if stream:
        content, calls, finish = "", [], None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                calls += ch.delta.tool_calls or []
                finish = ch.finish_reason or finish
    else:
        resp = client.chat.completions.create(**kwargs)
        content, calls = resp.choices[0].message.content, resp.choices[0].message.tool_calls
        finish = resp.choices[0].finish_reason
    assert "get_weather" in model.prompts[-1]  # tools reached the template
    assert content == "Let me check."
    assert finish == "tool_calls"
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert calls[0].id.startswith("call_")


def test_tool_choice_none_hides_tools(served):
    server, rt, model, client = served
    client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                   tools=[WEATHER_TOOL], tool_choice="none")
    assert "get_weather" not in model.prompts[-1]


def test_image_parts_pass_through(served):
    server, rt, model, client = served
    png = "data:image/png;base64,iVBORw0KGgo="
    resp = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": png}}]}])
    assert "What is this?<image>" in model.prompts[-1]  # the fake renders image parts as <image>
    assert resp.choices[0].message.content.startswith("echo[")


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"messages": []}, "'messages' must be a non-empty array"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "'temperature'"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 7}, "[0, 2]"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "'max_tokens'"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 3}, "n=1"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": 5}, "'stop'"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "content[0].type"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
        ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}, "data: URL"),
        ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "/etc/hostname"}}]}]}, "file paths"),
        ({"messages": [{"role": "user", "content": [
            {"type": "image", "path": "/etc/hostname"}]}]}, "content[0].type"),
    ],
)
def test_malformed_requests_get_400_with_openai_error_body(served, body, fragment):
    server, rt, model, client = served
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "fake-model", **body}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"] == "invalid_request_error"
    assert "Traceback" not in r.text


def test_malformed_json_and_official_client_error(served):
    server, rt, model, client = served
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"}, timeout=TIMEOUT)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}], top_p=0)
    assert "top_p" in str(info.value)
    r = httpx.get(server.url + "/v1/nothing-here", timeout=TIMEOUT)
    assert r.status_code == 404 and "error" in r.json()


def test_engine_error_is_a_clean_500(served):
    server, rt, model, client = served
    model.fail_after = 2
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}]}, timeout=TIMEOUT)
    assert r.status_code == 500
    assert "fake engine failure" in r.json()["error"]["message"] and "Traceback" not in r.text
    model.fail_after = None
    ok = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}])
    assert ok.choices[0].message.content


def test_completions_endpoint(served):
    server, rt, model, client = served
    model.reply = lambda p, t: " jumps over"
    resp = client.completions.create(model="fake-model", prompt="The quick fox", max_tokens=50)
    assert model.prompts[-1] == "The quick fox"  # raw text, no chat template
    assert resp.choices[0].text == " jumps over" and resp.usage.completion_tokens == 11
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="fake-model", prompt="The quick fox", max_tokens=4, stream=True))
    assert text == " jum"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ["a", "b"]}, timeout=TIMEOUT)
    assert r.status_code == 400


def test_concurrent_clients_each_get_their_own_answer(served):
    import threading

    server, rt, model, client = served
    model.delay_s = 0.001
    results, errors = {}, []

    def ask(k):
        try:
            text = f"question number {k}" + "?" * k
            chunks = client.chat.completions.create(
                model="fake-model", stream=True, messages=[{"role": "user", "content": text + " /no_think"}],
                extra_body={"conversation_id": f"client-{k}"})
            results[k] = (text, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors and len(results) == 4
    for text, answer in results.values():
        prompt = next(p for p in model.prompts if text + "\n" in p)
        assert answer == f"echo[{len(prompt)}]"
    assert model.max_active == 1  # the runtime ran them one at a time


def test_streaming_client_disconnect_cancels_generation(served):
    server, rt, model, client = served
    model.reply, model.delay_s = (lambda p, t: "z" * 5000), 0.002
    n_before = len(rt.metrics.requests())
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=TIMEOUT,
                      json={"messages": [{"role": "user", "content": "long"}], "stream": True,
                            "max_tokens": 6000, "chat_template_kwargs": {"enable_thinking": False}}) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data:") and '"content": "z' in line:
                got += 1
                if got >= 5:
                    break
    assert wait_until(lambda: len(rt.metrics.requests()) > n_before)
    last = rt.metrics.requests()[-1]
    assert last.finish_reason == "cancelled"
    assert last.generated_tokens < 5000
    assert wait_until(lambda: model.active == 0 and not rt.status()["busy"])


def test_non_streaming_client_disconnect_cancels_generation(served):
    server, rt, model, client = served
    model.reply, model.delay_s = (lambda p, t: "z" * 5000), 0.002
    n_before = len(rt.metrics.requests())
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", timeout=0.5,
                   json={"messages": [{"role": "user", "content": "long"}], "max_tokens": 6000})
    assert wait_until(lambda: len(rt.metrics.requests()) > n_before)
    assert rt.metrics.requests()[-1].finish_reason == "cancelled"


def test_api_key_is_required_when_set():
    model = FakeModel()
    rt = Runtime(loader=fake_loader(model), sample_memory_s=0)
    try:
        rt.load("k.gguf").result(TIMEOUT)
        with ServerThread(create_app(rt, api_key="s3cret")) as server:
            bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=TIMEOUT)
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
            good = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0, timeout=TIMEOUT)
            assert good.models.list().data[0].id == "k"
            assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200  # not under /v1
    finally:
        rt.close()


def test_no_model_loaded_is_503():
    rt = Runtime(loader=fake_loader(), sample_memory_s=0)
    try:
        with ServerThread(create_app(rt)) as server:
            r = httpx.post(server.url + "/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "x"}]}, timeout=TIMEOUT)
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_loaded"
            assert httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()["data"] == []
    finally:
        rt.close()


# -- tool-call parsing -------------------------------------------------------------------------------


def test_parse_tool_calls_xml_json_and_plain():
    content, calls = parse_tool_calls(QWEN_CALL, [WEATHER_TOOL])
    assert content == "Let me check."
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    # a string-typed parameter stays a string even when it looks like JSON
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>\n</tool_call>"
    assert json.loads(parse_tool_calls(text, [WEATHER_TOOL])[1][0]["function"]["arguments"]) == {"city": "42"}
    text = 'ok <tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls(text, None)
    assert content == "ok" and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": [1, 2]}
    assert parse_tool_calls("no calls here", None) == ("no calls here", [])
    assert parse_tool_calls("<tool_call>garbage</tool_call>", None)[1] == []


def test_tool_call_hold_is_independent_of_chunking():
    for size in (1, 2, 3, 5, 7, 50):
        hold = ToolCallHold(active=True)
        shown = "".join(hold.feed(QWEN_CALL[i : i + size]) for i in range(0, len(QWEN_CALL), size))
        assert shown == "Let me check."
        assert hold.buffer.startswith("<tool_call>") and hold.buffer.endswith("</tool_call>")
    hold = ToolCallHold(active=True)
    assert hold.feed("a <tool") == "a" and hold.feed("box>") == " <toolbox>"


# -- end to end: the fixture GGUF through the real engine --------------------------------------------


def test_real_model_over_http(fixtures_dir):
    seqs = json.loads((fixtures_dir / "sequences.json").read_text())
    rt = Runtime(sample_memory_s=0)
    try:
        rt.load(fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf", devices=["cpu"]).result(120)
        with ServerThread(create_app(rt)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120,
                                   max_retries=0)
            assert client.models.list().data[0].id == "qwen35-tiny-dense-q8_0"
            # raw completion of the "short" reference sequence: greedy continuation is known
            resp = client.completions.create(model="qwen35-tiny-dense-q8_0", prompt="The quick brown fox jumps over the lazy dog.",
                                             max_tokens=4, temperature=0)
            assert resp.choices[0].text == " Sunt" * 4
            assert resp.usage.prompt_tokens == 10 and resp.choices[0].finish_reason == "length"
            # chat: the reference conversation renders to the reference prompt (62 tokens)
            kwargs = dict(model="qwen35-tiny-dense-q8_0", messages=seqs["chat_messages"], max_tokens=5, temperature=0)
            full = client.chat.completions.create(**kwargs)
            assert full.usage.prompt_tokens == 62 and full.usage.completion_tokens == 5
            parts = []
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for ch in chunk.choices:
                    parts.append((ch.delta.content or "", getattr(ch.delta, "reasoning_content", None) or ""))
            assert "".join(p[0] for p in parts) == (full.choices[0].message.content or "")
            assert "".join(p[1] for p in parts) == (getattr(full.choices[0].message, "reasoning_content", None) or "")
            no_think = client.chat.completions.create(
                model="qwen35-tiny-dense-q8_0", messages=[{"role": "user", "content": "hi /no_think"}], max_tokens=3,
                temperature=0, seed=3)
            assert getattr(no_think.choices[0].message, "reasoning_content", None) is None
            # a text-only model refuses pictures with a 400, not garbage
            with pytest.raises(openai.BadRequestError, match="cannot read pictures"):
                client.chat.completions.create(model="qwen35-tiny-dense-q8_0", max_tokens=2, messages=[{"role": "user", "content": [
                    {"type": "text", "text": "what is it?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}])
    finally:
        rt.close()
