"""Hostile requests against a local server: one request must not take it down, and a web page the user
visits must not drive it. Real engine on the fixture GGUF, real uvicorn on loopback.

Each test failed before its fix: a chat with a conversation id ran the turn-boundary checkpoint as one
unchunked prefill before the context check (a 1 MB body: 6.9 GB and a 500 after 70 s; 50 MB: the kernel
killed the server), and any body was parsed as JSON whatever its Content-Type, with no Origin or Host
check (a cross-site text/plain POST from a page ran a generation; DNS rebinding worked).
"""

from __future__ import annotations

import dataclasses
import time

import httpx
import numpy as np
import pytest
from minecart.engine.errors import RequestError
from minecart.engine.runtime import Runtime
from minecart.engine.sampling import greedy_params
from minecart.engine.server import ServerThread, create_app
from minecart.engine.session import PREFILL_CHUNK

TIMEOUT = 120


@pytest.fixture(scope="module")
def dense_path(fixtures_dir):
    return fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf"


@pytest.fixture(scope="module")
def runtime_and_model(dense_path):
    from minecart.engine import load_model

    made = []

    def loader(*_a, **_k):
        made.append(load_model(dense_path, devices=["cpu:0"]))
        return made[-1]

    rt = Runtime(loader=loader, sample_memory_s=0)
    rt.load(str(dense_path)).result(TIMEOUT)
    yield rt, made[-1]
    rt.close()


@pytest.fixture(scope="module")
def server(runtime_and_model):
    rt, _ = runtime_and_model
    srv = ServerThread(create_app(rt, allowed_origins=["http://localhost:3000"])).start()
    yield srv
    srv.stop()


class _ForwardSizes:
    """Records the token count of every run of a model's first stage, i.e. how many tokens go through
    the layers at once (the executor's stage runner, restored on exit)."""

    def __init__(self, model):
        self.executor = model.executor
        self.sizes: list[int] = []

    def __enter__(self):
        original = self.executor.run_stage

        def spy(stage, x, *args, **kwargs):
            if stage is self.executor.stages[0]:
                self.sizes.append(len(x))
            return original(stage, x, *args, **kwargs)

        self.executor.run_stage = spy
        return self

    def __exit__(self, *exc):
        del self.executor.run_stage


def _with_context(model, n: int) -> None:
    model.config = dataclasses.replace(model.config, context_length=n)


def test_a_conversation_prompt_beyond_the_context_runs_no_token(runtime_and_model):
    rt, model = runtime_and_model
    saved = model.config
    try:
        _with_context(model, 64)
        with _ForwardSizes(model) as spy:
            t0 = time.perf_counter()
            final = rt.chat([{"role": "user", "content": "word " * 5000}], greedy_params(max_tokens=4),
                            conversation_id="hostile-1").wait(TIMEOUT)
            seconds = time.perf_counter() - t0
        assert final.kind == "error" and "context length" in final.text, final.text
        assert spy.sizes == [], "the turn boundary was prefilled before the length check"
        assert seconds < 20
    finally:
        model.config = saved


def test_a_long_conversation_prompt_is_prefilled_in_chunks_and_can_be_cancelled(runtime_and_model):
    rt, model = runtime_and_model
    n_words = 3 * PREFILL_CHUNK
    with _ForwardSizes(model) as spy:
        final = rt.chat([{"role": "user", "content": "word " * n_words}], greedy_params(max_tokens=2),
                        conversation_id="hostile-2").wait(TIMEOUT)
    assert final.kind == "done", final.text
    assert final.usage.prompt_tokens > 2 * PREFILL_CHUNK
    assert spy.sizes and max(spy.sizes) <= PREFILL_CHUNK, spy.sizes  # was one run of the whole turn
    # a cancel lands between chunks of the turn-boundary prefill, not after it
    with _ForwardSizes(model) as spy:
        handle = rt.chat([{"role": "user", "content": "other " * n_words}], greedy_params(max_tokens=2),
                         conversation_id="hostile-3")
        while not spy.sizes:
            time.sleep(0.001)
        handle.cancel()
        final = handle.wait(TIMEOUT)
    assert final.kind == "cancelled", final.kind
    assert sum(spy.sizes) < final.usage.prompt_tokens or final.usage.prompt_tokens == 0


def test_every_session_prefill_is_chunked(runtime_and_model):
    _, model = runtime_and_model
    session = model.new_session()
    try:
        with _ForwardSizes(model) as spy:
            session.prefill(list(range(100, 100 + 2 * PREFILL_CHUNK + 7)))
        assert spy.sizes == [PREFILL_CHUNK, PREFILL_CHUNK, 7]
        with pytest.raises(ValueError):
            session.prefill([1, 2], chunk=0)
    finally:
        session.close()


def test_a_cross_site_text_plain_post_is_refused(server):
    body = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
    url = server.url + "/v1/chat/completions"
    # what a web page's <form> or fetch(no-cors) sends: no preflight, text/plain
    r = httpx.post(url, content=body, headers={"content-type": "text/plain",
                                               "origin": "http://evil.example"}, timeout=TIMEOUT)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    # the same body without an Origin (curl) but not declared as JSON: 415, nothing runs
    r = httpx.post(url, content=body, headers={"content-type": "text/plain"}, timeout=TIMEOUT)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    r = httpx.post(url, content=body, timeout=TIMEOUT)
    assert r.status_code == 415
    # declared as JSON from a program: served
    r = httpx.post(url, content=body, headers={"content-type": "application/json; charset=utf-8"},
                   timeout=TIMEOUT)
    assert r.status_code == 200, r.text


def test_dns_rebinding_host_names_are_refused(server):
    url = server.url + "/v1/models"
    r = httpx.get(url, headers={"host": f"attacker.example:{server.port}"}, timeout=TIMEOUT)
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "127.0.0.1"):
        r = httpx.get(url, headers={"host": host}, timeout=TIMEOUT)
        assert r.status_code == 200, (host, r.text)


def test_an_allowed_origin_gets_cors_and_its_preflight(server):
    url = server.url + "/v1/chat/completions"
    r = httpx.options(url, headers={"origin": "http://localhost:3000",
                                    "access-control-request-method": "POST"}, timeout=TIMEOUT)
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                   headers={"origin": "http://localhost:3000"}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = httpx.options(url, headers={"origin": "http://evil.example"}, timeout=TIMEOUT)
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_a_body_past_the_limit_is_413_before_parsing(runtime_and_model):
    rt, _ = runtime_and_model
    with ServerThread(create_app(rt, max_body_bytes=4096)) as srv:
        big = b'{"messages":[{"role":"user","content":"' + b"x" * 10_000 + b'"}]}'
        r = httpx.post(srv.url + "/v1/chat/completions", content=big,
                       headers={"content-type": "application/json"}, timeout=TIMEOUT)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunked():  # no Content-Length: the limit holds while reading
            for _ in range(10):
                yield b"x" * 1000

        r = httpx.post(srv.url + "/v1/completions", content=chunked(),
                       headers={"content-type": "application/json"}, timeout=TIMEOUT)
        assert r.status_code == 413
        r = httpx.get(srv.url + "/health", timeout=TIMEOUT)
        assert r.status_code == 200


def test_generate_checks_the_context_before_the_turn_boundary(runtime_and_model):
    from minecart.engine.generation import generate

    _, model = runtime_and_model
    saved = model.config
    session = model.new_session()
    try:
        _with_context(model, 32)
        with _ForwardSizes(model) as spy, pytest.raises(RequestError, match="context length"):
            list(generate(model, list(range(100, 200)), greedy_params(max_tokens=2), session=session,
                          turn_boundary=90))
        assert spy.sizes == []
        assert np.asarray(session.tokens).size == 0
    finally:
        model.config = saved
        session.close()


def test_a_failed_or_cancelled_request_returns_the_freed_heap(runtime_and_model, monkeypatch):
    """The heap a failed request freed goes back to the system (runtime.return_freed_memory, glibc's
    malloc_trim): memory stayed at its high-water mark after every failure before."""
    from minecart.engine import runtime as runtime_mod

    rt, model = runtime_and_model
    trims: list[int] = []
    monkeypatch.setattr(runtime_mod, "return_freed_memory", lambda: trims.append(1))
    saved = model.config
    try:
        _with_context(model, 64)
        final = rt.chat([{"role": "user", "content": "word " * 500}], greedy_params(max_tokens=2),
                        conversation_id="trim").wait(TIMEOUT)
    finally:
        model.config = saved
    assert final.kind == "error" and trims == [1]
    final = rt.chat([{"role": "user", "content": "hi"}], greedy_params(max_tokens=2),
                    conversation_id="trim").wait(TIMEOUT)
    assert final.kind == "done" and trims == [1]  # a request that went well keeps the heap as is


def test_return_freed_memory_runs_here():
    from minecart.engine.runtime import return_freed_memory

    return_freed_memory()  # loads glibc's malloc_trim on Linux, a no-op elsewhere; never raises
    return_freed_memory()


def test_token_ids_outside_the_vocabulary_without_a_tokenizer_are_a_400(tmp_path_factory):
    """A file with no tokenizer (a synthesized model) takes prompts as token ids; an id past its
    embedding used to reach the lookup and come back as a 500."""
    from tests._moe import tiny_moe_file

    path = tiny_moe_file(tmp_path_factory, "separate")
    rt = Runtime(sample_memory_s=0)
    try:
        rt.load(str(path), devices=["cpu:0"]).result(TIMEOUT)
        final = rt.complete([1, 2, 10**6], greedy_params(max_tokens=2)).wait(TIMEOUT)
        assert final.kind == "error" and "outside the vocabulary (0..639)" in final.text
        with ServerThread(create_app(rt)) as srv:
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 700], "max_tokens": 2},
                           timeout=TIMEOUT)
            assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2},
                           timeout=TIMEOUT)
            assert r.status_code == 200, r.text
    finally:
        rt.close()


def test_every_request_leaves_one_structured_access_line(server, caplog):
    import json as _json
    import logging

    with caplog.at_level(logging.INFO, logger="minecart.access"):
        httpx.get(server.url + "/v1/models", timeout=TIMEOUT)
        httpx.post(server.url + "/v1/chat/completions", content=b"{}", timeout=TIMEOUT,
                   headers={"content-type": "text/plain", "origin": "http://evil.example"})
        r = httpx.post(server.url + "/v1/chat/completions?key=secret", timeout=TIMEOUT,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                             "stream": True})
        assert r.status_code == 200
        deadline = time.monotonic() + 5
        while len([x for x in caplog.records if x.name == "minecart.access"]) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    lines = [_json.loads(x.getMessage()) for x in caplog.records if x.name == "minecart.access"]
    assert [(x["method"], x["path"], x["status"]) for x in lines] == [
        ("GET", "/v1/models", 200), ("POST", "/v1/chat/completions", 403),
        ("POST", "/v1/chat/completions", 200)]
    assert all(x["duration_ms"] >= 0 and x["client"].startswith("127.0.0.1:") for x in lines)
    assert "secret" not in "".join(x.getMessage() for x in caplog.records)  # no query strings
