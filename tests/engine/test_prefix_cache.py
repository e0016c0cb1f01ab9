"""The prefix cache across requests, through the scheduler, on the Qwen3.5 fixture (a hybrid model:
its Gated DeltaNet state cannot be rewound, so a hit resumes from a block-boundary snapshot).

A 512-token system prompt shared by 5 requests is prefilled once; every answer equals generating it
alone without any cache; cached_tokens reports the hits; a prompt that leaves a cached one inside a
block resumes from the boundary before; the memory budget evicts least recently used starts."""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine.model import load_model
from minecart.engine.prefix_cache import PrefixCache
from minecart.engine.sampling import greedy_params
from minecart.engine.scheduler import Scheduler

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(fixtures_dir):
    m = load_model(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", devices=["cpu:0"])
    yield m
    m.close()


@pytest.fixture(scope="module")
def texts(fixtures_dir):
    seqs = {s: [int(t) for t in np.load(fixtures_dir / "dense" / "ref_hf" / f"{s}.npz")["tokens"]]
            for s in ("len300", "len128", "len70", "random100", "short")}
    system = (seqs["len300"] + seqs["len128"] + seqs["len70"] + seqs["random100"])[:512]
    tails = [seqs["random100"][i * 15 : i * 15 + 20] for i in range(5)]
    return system, tails


def _alone(model, ids):
    return [e.token for e in model.generate(ids, greedy_params(max_tokens=MAX_TOKENS))]


def test_shared_system_prompt_prefilled_once(model, texts):
    system, tails = texts
    cache = PrefixCache(block=128)
    sched = Scheduler(model, parallel=2, prefix_cache=cache)
    try:
        for i, tail in enumerate(tails):
            events = list(sched.generate(system + tail, greedy_params(max_tokens=MAX_TOKENS)))
            assert [e.token for e in events] == _alone(model, system + tail), f"request {i}"
            assert events[-1].prompt_tokens == 532
            assert events[-1].cached_tokens == (0 if i == 0 else 512), f"request {i}"
            assert events[-1].prompt_tps is not None and events[-1].prompt_tps > 0
        m = sched.metrics()
        # every prompt token the model ran: the system prompt once, each request's own tail
        assert m["prefill_tokens"] == 512 + 5 * 20
        c = cache.metrics()
        assert c["cache_hits"] == 4 and c["cache_hit_tokens"] == 4 * 512
        assert c["cache_hit_rate"] == pytest.approx(4 * 512 / (5 * 532))
        assert c["cache_entries"] == 4  # boundaries 128, 256, 384, 512
    finally:
        sched.close()
        cache.clear()


def test_divergence_inside_a_block_resumes_from_the_boundary_before(model, texts):
    system, tails = texts
    cache = PrefixCache(block=128)
    sched = Scheduler(model, parallel=2, prefix_cache=cache)
    try:
        first = system[:300] + tails[0]
        second = system[:300] + tails[1]  # shares 300 tokens: boundaries 128 and 256 match
        list(sched.generate(first, greedy_params(max_tokens=MAX_TOKENS)))
        events = list(sched.generate(second, greedy_params(max_tokens=MAX_TOKENS)))
        assert events[-1].cached_tokens == 256
        assert [e.token for e in events] == _alone(model, second)
        # a prompt that is exactly a cached boundary needs no computation at all
        events = list(sched.generate(system[:256], greedy_params(max_tokens=MAX_TOKENS)))
        assert events[-1].cached_tokens == 256
        assert [e.token for e in events] == _alone(model, system[:256])
    finally:
        sched.close()
        cache.clear()


def test_budget_evicts_least_recently_used(model, texts):
    system, tails = texts
    probe = PrefixCache(block=64)
    sched = Scheduler(model, parallel=1, prefix_cache=probe)
    try:
        list(sched.generate(system[:64] + tails[0], greedy_params(max_tokens=1)))
        one_start = probe.nbytes  # a node and its holder
        assert one_start > 0
        cache = PrefixCache(block=64, budget_bytes=int(2.5 * one_start))
        sched.prefix_cache = cache
        starts = [tails[k] * 4 for k in range(3)]  # three different 80-token prompts
        for ids in starts:
            list(sched.generate(ids, greedy_params(max_tokens=1)))
        m = cache.metrics()
        assert m["cache_evictions"] == 1 and m["cache_entries"] == 2
        assert cache.nbytes <= cache.budget_bytes
        # the first start was evicted (a miss), the last one is still there (a hit)
        assert list(sched.generate(starts[2], greedy_params(max_tokens=1)))[-1].cached_tokens == 64
        assert list(sched.generate(starts[0], greedy_params(max_tokens=1)))[-1].cached_tokens == 0
    finally:
        sched.close()
        probe.clear()


def test_a_snapshot_restores_the_same_state_twice(model):
    """Session.restore must not hand the snapshot's own arrays to the state it updates in place
    (the NumPy backend wraps host arrays): the cache restores one snapshot for many requests."""
    s = model.new_session()
    s.prefill(list(range(100, 140)))
    snap = s.snapshot()
    first = s.step(5).copy()
    s.step(6)
    s.restore(snap)
    assert np.array_equal(s.step(5), first)
    s.step(7)
    s.restore(snap)
    assert np.array_equal(s.step(5), first)
    s.close()
