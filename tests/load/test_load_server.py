"""A bounded load test of the HTTP API over a batching runtime, on loopback, in the normal test run.

8 client threads (MINECART_LOAD_CLIENTS) talk to a real uvicorn server (127.0.0.1, a free port) over
Runtime(parallel=8) with the Qwen3.5 fixture model for LOAD_SECONDS (default 20;
MINECART_LOAD_SECONDS overrides it): streamed
chats read to the end, streams dropped after a few chunks (the disconnect must cancel the generation),
plain completions, and bad requests (broken JSON, wrong types, an unknown model, empty messages);
half the chats share a long system prompt (the prefix cache's hits).
Every client request has a deadline. Passes when: no 5xx and no error inside a stream, no request
over its deadline, every well-formed request answered with a finish reason, every bad one a 4xx, no
generation left running afterwards, and the process's resident memory grew by less than 5% between
the end of the warm-up (the first quarter) and the end.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from minecart.engine.runtime import Runtime
from minecart.engine.server import ServerThread, create_app

LOAD_SECONDS = float(os.environ.get("MINECART_LOAD_SECONDS", "20"))
CLIENTS = int(os.environ.get("MINECART_LOAD_CLIENTS", "8"))  # e.g. 32 for the full-scale run
PARALLEL = min(8, CLIENTS)  # generations batched at once; the other clients wait in the queue
DEADLINE_S = 30.0  # a request not answered by then is a hang


def _rss_bytes() -> int:
    statm = Path("/proc/self/statm")
    if not statm.exists():
        pytest.skip("resident memory is read from /proc (Linux)")
    return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def served(fixtures_dir):
    rt = Runtime(sample_memory_s=0, parallel=PARALLEL, max_queue=CLIENTS)
    rt.load(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", devices=["cpu:0"]).result(60)
    server = ServerThread(create_app(rt)).start()
    yield server, rt
    server.stop()
    rt.close()


WORDS = "minecart rail ore lantern tunnel pickaxe shaft copper silver wagon".split()
BAD_BODIES = [
    ("broken json", b'{"messages": [', "application/json"),
    ("wrong type", json.dumps({"messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": "many"}).encode(), "application/json"),
    ("unknown model", json.dumps({"model": "no-such-model", "messages": [
        {"role": "user", "content": "hi"}]}).encode(), "application/json"),
    ("no messages", json.dumps({"messages": []}).encode(), "application/json"),
    ("not json", b"hello", "text/plain"),
]


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.failures: list[str] = []

    def add(self, what: str, failure: str | None = None) -> None:
        with self.lock:
            self.counts[what] += 1
            if failure:
                self.failures.append(f"{what}: {failure}")


# half the chats share a long system prompt: the runtime's prefix cache serves its start to them
LONG_SYSTEM = "You are the mine's assistant. " + " ".join(WORDS[i % len(WORDS)] for i in range(150))


def _chat_body(rng: random.Random, stream: bool) -> dict:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
    system = LONG_SYSTEM if rng.random() < 0.5 else "You answer briefly."
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": text}],
            "max_tokens": rng.randint(2, 24), "stream": stream, "temperature": rng.choice([0, 0.7]),
            "chat_template_kwargs": {"enable_thinking": False}}


def _stream(client: httpx.Client, body: dict, drop_after: int | None, tally: Tally) -> None:
    what = "dropped stream" if drop_after is not None else "stream"
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            tally.add(what, f"HTTP {r.status_code}")
            return
        finish = None
        n = 0
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                tally.add(what, f"error in stream: {chunk['error']}")
                return
            n += 1
            if drop_after is not None and n >= drop_after:
                tally.add(what)
                return  # closing the response disconnects mid-stream
            finish = chunk["choices"][0].get("finish_reason") or finish
        tally.add(what, None if finish in ("stop", "length") else f"no finish reason ({n} chunks)")


def _client(url: str, seed: int, stop_at: float, tally: Tally) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=DEADLINE_S) as client:
        while time.monotonic() < stop_at:
            roll = rng.random()
            try:
                if roll < 0.5:
                    _stream(client, _chat_body(rng, True), None, tally)
                elif roll < 0.7:
                    _stream(client, _chat_body(rng, True), rng.randint(1, 3), tally)
                elif roll < 0.85:
                    r = client.post("/v1/completions", json={
                        "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))),
                        "max_tokens": rng.randint(1, 16), "temperature": 0})
                    ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
                    tally.add("completion", None if ok else f"HTTP {r.status_code}: {r.text[:200]}")
                else:
                    name, raw, ctype = rng.choice(BAD_BODIES)
                    r = client.post("/v1/chat/completions", content=raw, headers={"Content-Type": ctype})
                    ok = 400 <= r.status_code < 500
                    tally.add("bad request", None if ok else f"{name}: HTTP {r.status_code}")
            except httpx.TimeoutException as exc:
                tally.add("hang", repr(exc))
            except httpx.HTTPError as exc:
                tally.add("transport error", repr(exc))


def test_eight_clients_with_disconnects_and_bad_requests(served):
    server, rt = served
    tally = Tally()
    start = time.monotonic()
    stop_at = start + LOAD_SECONDS
    threads = [threading.Thread(target=_client, args=(server.url, i, stop_at, tally), daemon=True)
               for i in range(CLIENTS)]
    for t in threads:
        t.start()
    samples: list[int] = []

    def sample() -> None:
        while time.monotonic() < stop_at:
            samples.append(_rss_bytes())
            time.sleep(1.0)

    threading.Thread(target=sample, daemon=True).start()
    time.sleep(LOAD_SECONDS / 4)  # warm-up: sessions, caches, allocator pools
    rss_warm = _rss_bytes()
    for t in threads:
        t.join(LOAD_SECONDS + 2 * DEADLINE_S)
        assert not t.is_alive(), "a client thread hung"
    # every generation ends: the dropped streams were cancelled, nothing keeps running
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (rt.batching_metrics() or {}).get("running", 0):
        time.sleep(0.05)
    rss_end = _rss_bytes()
    m = rt.batching_metrics()
    print(f"\nload: {dict(tally.counts)}; batch mean {m['batch_size_mean']:.2f}, max "
          f"{m['batch_size_max']}; cache entries {m['cache_entries']}, {m['cache_bytes'] // 2**20} MiB; "
          f"decode tokens {m['decode_tokens']}; RSS {rss_warm / 2**20:.0f} -> "
          f"{rss_end / 2**20:.0f} MiB; samples {[round(x / 2**20) for x in samples]}")
    assert not tally.failures, tally.failures[:10]
    assert tally.counts["stream"] >= CLIENTS and tally.counts["dropped stream"] >= 1
    assert tally.counts["bad request"] >= 1 and tally.counts["completion"] >= 1
    assert m["running"] == 0 and m["queue_depth"] == 0
    assert m["batch_size_max"] >= 2  # the clients really shared decode steps
    assert m["cache_hits"] >= 1  # the long system prompt came from the prefix cache
    assert rss_end < 1.05 * rss_warm, f"RSS grew from {rss_warm} to {rss_end} bytes"
    assert rt.status()["alive"]
