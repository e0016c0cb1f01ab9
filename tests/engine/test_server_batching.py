"""The HTTP API over a batching runtime (Runtime(parallel=N)) on the real Qwen3.5 fixture model:
concurrent streams all finish, a request past the queue gets 429 with Retry-After, and /metrics
speaks the Prometheus text format on request while plain clients keep their JSON."""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest
from minecart.engine.runtime import Runtime
from minecart.engine.server import ServerThread, create_app

TIMEOUT = 30.0
# one sample line of the text format: name, optional {labels}, a float (integers, NaN, +Inf allowed)
SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_][a-zA-Z0-9_]*="[^"]*"'
                    r'(,[a-zA-Z_][a-zA-Z0-9_]*="[^"]*")*\})? (-?[0-9.eE+-]+|NaN|[+-]Inf)$')


@pytest.fixture(scope="module")
def served(fixtures_dir):
    rt = Runtime(sample_memory_s=0, parallel=2, max_queue=1)
    rt.load(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", devices=["cpu:0"]).result(60)
    server = ServerThread(create_app(rt)).start()
    yield server, rt
    server.stop()
    rt.close()


def _chat(max_tokens: int, stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": "Tell me about minecarts."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "chat_template_kwargs": {"enable_thinking": False}}


def test_concurrent_streams_finish_and_past_the_queue_is_429(served):
    server, rt = served
    held: list[httpx.Response] = []
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        # parallel 2 + queue 1: three long streams take every place
        for _ in range(3):
            r = client.send(client.build_request("POST", "/v1/chat/completions", json=_chat(2000, True)),
                            stream=True)
            assert r.status_code == 200
            held.append(r)
        refused = client.post("/v1/chat/completions", json=_chat(4, False))
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "queue_full"
        for r in held:  # disconnecting cancels them and frees the places
            r.close()
        ok = None
        for _ in range(50):
            ok = client.post("/v1/chat/completions", json=_chat(4, False))
            if ok.status_code != 429:
                break
            threading.Event().wait(0.1)
        assert ok is not None and ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["finish_reason"] in ("length", "stop")

        results: dict[int, list[str]] = {}

        def stream(i: int) -> None:
            with client.stream("POST", "/v1/chat/completions", json=_chat(6, True)) as r:
                assert r.status_code == 200
                results[i] = [line for line in r.iter_lines() if line.startswith("data: ")]

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert len(results) == 2
        for lines in results.values():
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(x[6:]) for x in lines[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert rt.batching_metrics()["rejected"] == 0  # refused by the runtime before the scheduler


def test_metrics_in_prometheus_text_and_json(served):
    server, _ = served
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        client.post("/v1/completions", json={"prompt": "Minecarts", "max_tokens": 3, "temperature": 0})
        for how in ({"params": {"format": "prometheus"}},
                    {"headers": {"Accept": "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"}}):
            r = client.get("/metrics", **how)
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/plain")
            lines = r.text.strip().splitlines()
            values = {}
            for line in lines:
                if line.startswith("#"):
                    assert re.match(r"^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* \S", line), line
                    continue
                assert SAMPLE.match(line), line
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
            for name in ("minecart_queue_depth", "minecart_batch_size", "minecart_requests_running",
                         "minecart_decode_tokens_per_second", "minecart_prefix_cache_hit_rate",
                         "minecart_decode_tokens_total"):
                assert name in values, name
            assert values["minecart_parallel_slots"] == 2
            assert values["minecart_decode_tokens_total"] >= 2
        plain = client.get("/metrics")  # today's clients: JSON, now with the batching counters
        assert plain.headers["content-type"].startswith("application/json")
        body = plain.json()
        assert "decode_tps" in body and body["batching"]["parallel"] == 2
        assert client.get("/metrics", params={"format": "xml"}).status_code == 400


def test_repeated_long_system_prompt_reports_cached_tokens(served):
    server, _ = served
    system = "You are the mine's assistant. " + " ".join(["rail ore lantern tunnel"] * 60)
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        usages = []
        for question in ("Where is the ore?", "How deep is the shaft?"):
            body = {"messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": question}],
                    "max_tokens": 3, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
    assert usages[0]["prompt_tokens"] > 200
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= 128  # the system prompt's blocks


def test_shutdown_ends_running_and_queued_streams(fixtures_dir):
    """Closing the runtime (what `serve` does on Ctrl+C after uvicorn's grace period) ends every
    stream, running or queued, with a finish instead of leaving clients hanging."""
    rt = Runtime(sample_memory_s=0, parallel=2, max_queue=2)
    rt.load(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", devices=["cpu:0"]).result(60)
    server = ServerThread(create_app(rt)).start()
    finishes: dict[int, list] = {}
    try:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
            def stream(i: int) -> None:
                with client.stream("POST", "/v1/chat/completions", json=_chat(5000, True)) as r:
                    finishes[i] = [json.loads(x[6:])["choices"][0].get("finish_reason")
                                   for x in r.iter_lines() if x.startswith("data: {")]

            threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]  # 2 run, 1 waits
            for t in threads:
                t.start()
            deadline = threading.Event()
            for _ in range(100):
                if rt.status()["busy"] and rt.status()["queued"] >= 1:
                    break
                deadline.wait(0.05)
            rt.close()
            for t in threads:
                t.join(TIMEOUT)
                assert not t.is_alive(), "a stream hung after shutdown"
    finally:
        server.stop()
    assert sorted(finishes) == [0, 1, 2]
    for reasons in finishes.values():
        assert [r for r in reasons if r] == ["cancelled"]  # one finish each, the last chunk
        assert reasons[-1] == "cancelled"
