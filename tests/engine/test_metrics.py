"""Metrics: ring buffers keep the newest points under concurrent writers; snapshots are JSON-ready."""

from __future__ import annotations

import json
import threading
import time

import pytest
from minecart.engine.metrics import Metrics, RequestTiming, RingBuffer, process_rss_bytes


def timing(i, prefill=100.0, decode=20.0, reason="stop"):
    return RequestTiming(
        request_id=i, kind="chat", submitted=time.time(), queue_wait_s=0.01, prefill_s=0.2,
        time_to_first_token_s=0.21, decode_s=1.0, prompt_tokens=20 + i, generated_tokens=21,
        prefill_tokens_per_s=prefill, decode_tokens_per_s=decode, finish_reason=reason,
    )


def test_ring_buffer_keeps_the_newest_points_in_order():
    buf = RingBuffer(capacity=5)
    for k in range(12):
        buf.append(k * 1.5, t=1000.0 + k)
    t, v = buf.snapshot()
    assert v == [10.5, 12.0, 13.5, 15.0, 16.5]
    assert t == [1007.0, 1008.0, 1009.0, 1010.0, 1011.0]
    assert len(buf) == 5 and buf.version == 12
    assert buf.last() == (1011.0, 16.5)
    t, v = buf.snapshot(since=1009.0)
    assert t == [1010.0, 1011.0]
    with pytest.raises(ValueError):
        RingBuffer(0)


def test_concurrent_writers_and_readers():
    buf = RingBuffer(capacity=10_000)
    stop = threading.Event()
    seen_lengths = []

    def reader():
        while not stop.is_set():
            t, v = buf.snapshot()
            assert len(t) == len(v)
            seen_lengths.append(len(v))

    def writer(w):
        for k in range(2000):
            buf.append(w * 10_000 + k)

    r = threading.Thread(target=reader)
    r.start()
    writers = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    r.join()
    _, v = buf.snapshot()
    assert len(v) == 8000 and buf.version == 8000
    for w in range(4):  # each writer's points stay in its own order
        mine = [x for x in v if w * 10_000 <= x < (w + 1) * 10_000]
        assert mine == sorted(mine) and len(mine) == 2000
    assert seen_lengths


def test_request_timings_feed_rate_series_and_snapshot():
    m = Metrics(capacity=3, request_capacity=2)
    m.record_request(timing(1, prefill=111.0, decode=11.0))
    m.record_request(timing(2, prefill=222.0, decode=22.0))
    m.record_request(timing(3, prefill=333.0, decode=None, reason="cancelled"))
    assert [r.request_id for r in m.requests()] == [2, 3]
    snap = m.snapshot()
    json.dumps(snap)  # JSON-ready for /metrics
    assert snap["prefill_tps"]["v"] == [111.0, 222.0, 333.0]
    assert snap["decode_tps"]["v"] == [11.0, 22.0]  # no decode rate for the cancelled one
    assert snap["requests"][-1]["finish_reason"] == "cancelled"
    assert snap["requests"][-1]["prompt_tokens"] == 23


def test_live_decode_rate_is_rate_limited():
    m = Metrics()
    for k in range(50):
        m.record_live_decode_rate(10.0 + k)
    assert len(m.decode_tps_live) == 1  # 50 calls within microseconds: one point
    m.record_live_decode_rate(99.0, force=True)
    assert m.decode_tps_live.last()[1] == 99.0


def test_memory_sampling_reads_process_rss_for_the_cpu():
    rss = process_rss_bytes()
    assert rss is not None and rss > 10 * 2**20  # a Python process with numpy is > 10 MiB
    m = Metrics()
    m.set_devices(["cpu:0"])
    m.sample_memory()
    m.record_memory("cuda:3", 5e9, 8e9)
    snap = m.snapshot()
    assert set(snap["memory"]) == {"cpu", "cuda:3"}
    assert snap["memory"]["cpu"]["used_bytes"][0] > 10 * 2**20
    assert snap["memory"]["cuda:3"] == {"t": snap["memory"]["cuda:3"]["t"], "used_bytes": [5e9],
                                        "total_bytes": 8e9}


def test_sampler_thread_appends_and_stops():
    m = Metrics()
    m.start_sampler(0.01)
    m.start_sampler(0.01)  # idempotent
    deadline = time.time() + 5
    while (m.memory("cpu") is None or len(m.memory("cpu")) < 3) and time.time() < deadline:
        time.sleep(0.01)
    m.stop_sampler()
    n = len(m.memory("cpu"))
    assert n >= 3
    time.sleep(0.05)
    assert len(m.memory("cpu")) == n  # stopped
