"""Decode steps that return only the largest logits (sampling.TopLogits) on the real Qwen3.5 fixture
model (CPU backend): a step's top logits are the top of the row the same step returns whole, and
generations, alone and through the batching scheduler, pick exactly the tokens they pick from whole
rows (greedy and seeded sampling)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from minecart.engine.model import load_model
from minecart.engine.sampling import Sampler, SamplingParams, TopLogits, greedy_params, top_logits
from minecart.engine.scheduler import Scheduler

SEQUENCES = ["short", "len70", "chat", "random100"]
SAMPLED = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=3, max_tokens=10)
# the app's chat defaults: a repetition penalty (the candidates decide the pick, or the row is fetched)
PENALIZED = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.05, seed=4,
                           max_tokens=10)
PARAMS = [greedy_params(max_tokens=10), SAMPLED, PENALIZED]
IDS = ["greedy", "sampled", "penalized"]


@pytest.fixture(scope="module")
def fixture(fixtures_dir):
    model = load_model(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", devices=["cpu:0"])
    prompts = {s: [int(t) for t in np.load(fixtures_dir / "dense" / "ref_hf" / f"{s}.npz")["tokens"]]
               for s in SEQUENCES}
    yield model, prompts
    model.close()


def test_step_top_is_the_top_of_the_row(fixture):
    model, prompts = fixture
    ids = prompts["len70"]
    a, b = model.new_session(), model.new_session()
    try:
        a.prefill(ids)
        b.prefill(ids)
        for token in (11, 500, 7):
            row = b.step(token)
            top = a.step(token, top=20)
            assert isinstance(top, TopLogits) and top.values.shape == (1, 20)
            vals, want = top_logits(row, 20)
            np.testing.assert_array_equal(top.ids, want)
            np.testing.assert_array_equal(top.values, vals)
            assert a.last_logits is None  # only whole rows are kept for snapshots and sync
        assert a.position == b.position and a.tokens == b.tokens
        whole = a.step(3)  # top=0: the whole row again
        assert isinstance(whole, np.ndarray) and whole.shape == (model.config.vocab_size,)
        np.testing.assert_array_equal(whole, b.step(3))
    finally:
        a.close()
        b.close()


def _tokens(events) -> list:
    return [e.token for e in events]


@pytest.mark.parametrize("params", PARAMS, ids=IDS)
def test_generation_picks_the_tokens_of_whole_rows(fixture, params, monkeypatch):
    model, prompts = fixture
    got = {n: _tokens(model.generate(prompts[n], params)) for n in SEQUENCES}
    with monkeypatch.context() as m:
        m.setattr(Sampler, "candidates", property(lambda self: 0))
        want = {n: _tokens(model.generate(prompts[n], params)) for n in SEQUENCES}
    assert got == want
    assert all(len(t) == 10 for t in got.values())


def _scheduled(model, prompts, params) -> tuple[dict, list[int]]:
    """Every prompt generated at once through a scheduler -> (tokens per prompt, the `top` of each
    batched step)."""
    sched = Scheduler(model, parallel=len(SEQUENCES), max_queue=4, chunk=64)
    tops: list[int] = []
    inner = model.executor.launch_batch

    def spy(ids, states, positions, top=0):
        tops.append(top)
        return inner(ids, states, positions, top=top)

    model.executor.launch_batch = spy
    results: dict = {}
    try:
        def run(name):
            results[name] = _tokens(sched.generate(prompts[name], params))

        threads = [threading.Thread(target=run, args=(n,)) for n in SEQUENCES]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
            assert not t.is_alive(), "a generation hung"
    finally:
        del model.executor.launch_batch
        sched.close()
    return results, tops


@pytest.mark.parametrize("params", PARAMS, ids=IDS)
def test_batched_generation_picks_the_tokens_of_whole_rows(fixture, params, monkeypatch):
    model, prompts = fixture
    got, tops = _scheduled(model, prompts, params)
    assert max(tops) == Sampler(params).candidates > 0  # decode steps asked for the top logits only
    assert 0 in tops  # and the steps that end a prompt for whole rows
    with monkeypatch.context() as m:
        m.setattr(Sampler, "candidates", property(lambda self: 0))
        want, tops_whole = _scheduled(model, prompts, params)
    assert 0 in tops_whole and set(tops_whole) <= {0, 1}  # whole rows; 1: a step that ends no row's pass
    assert got == want
