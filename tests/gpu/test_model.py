"""Whole-model checks of the CuPy backend against the NumPy reference backend.

- logits on the shared fixtures (Q8_0 and F16 tiny qwen35): relative error, top-1 agreement, KL;
- greedy continuation of 64 tokens;
- the same greedy continuation after one-pass, 64-chunk, 512-chunk and token-by-token prefill
  (fixture and a synthetic model with the real head sizes, `small-dense`).
The fp32 FMA path must match the reference to ~1e-4; the DP4A path rounds activations to int8 per 32
values (as llama.cpp's MMQ/MMVQ kernels do), so it is held to looser, reported bounds.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.gpu._compare import FIXTURES, graph_vs_eager, greedy, worst_over_sequences

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

def _models(path, gpu_path):
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.backends.numpy_backend import NumpyBackend
    from minecart.engine.model import load_model

    return (load_model(path, backend=NumpyBackend()),
            load_model(path, backend=CupyBackend("cuda:0", path=gpu_path)))


@pytest.mark.parametrize("quant", ["q8_0", "f16"])
@pytest.mark.parametrize("gpu_path", ["fma", "dp4a"])
def test_fixture_logits(fixtures_dir, quant, gpu_path):
    seqs = json.loads((fixtures_dir / "sequences.json").read_text())["sequences"]
    m_np, m_gp = _models(fixtures_dir / FIXTURES[quant], gpu_path)
    worst = worst_over_sequences(m_np, m_gp, seqs, f"{quant} {gpu_path}")
    if gpu_path == "fma" or quant == "f16":  # F16 weights have no DP4A kernel: fp32 path either way
        assert worst["max_rel"] < 1e-4 and worst["top1"] == 1.0
    else:
        assert worst["top1"] >= 0.9 and worst["kl_mean"] < 1e-2


@pytest.mark.parametrize("gpu_path", ["fma", "dp4a"])
def test_fixture_greedy_64(fixtures_dir, gpu_path):
    seqs = {s["name"]: s for s in json.loads((fixtures_dir / "sequences.json").read_text())["sequences"]}
    m_np, m_gp = _models(fixtures_dir / FIXTURES["q8_0"], gpu_path)
    prompt = seqs["short"]["ids"]
    a, b = greedy(m_np, prompt, 64), greedy(m_gp, prompt, 64)
    agree = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), 64)
    print(f"greedy 64 ({gpu_path}): identical prefix {agree} tokens")
    if gpu_path == "fma":
        assert a == b
    else:
        assert agree >= 16


def _chunk_variants(model, prompt, n):
    runs = {}
    for name, chunk in (("one-pass", None), ("64-chunk", 64), ("512-chunk", 512), ("token-by-token", 1)):
        runs[name] = greedy(model, prompt, n, chunk=chunk)
    return runs


@pytest.mark.parametrize("gpu_path", ["fma", "dp4a"])
def test_chunked_prefill_same_greedy_fixture(fixtures_dir, gpu_path):
    seqs = {s["name"]: s for s in json.loads((fixtures_dir / "sequences.json").read_text())["sequences"]}
    _, m_gp = _models(fixtures_dir / FIXTURES["q8_0"], gpu_path)
    runs = _chunk_variants(m_gp, seqs["len300"]["ids"], 24)
    print(runs)
    first = runs["one-pass"]
    for name, toks in runs.items():
        assert toks == first, name


def test_chunked_prefill_same_greedy_synth(tmp_path):
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.model import load_model
    from minecart.engine.synth import write_synthetic

    path = tmp_path / "small.gguf"
    write_synthetic(path, "small-dense", "q8_0", seed=3)
    m = load_model(path, backend=CupyBackend("cuda:0", path="fma"))
    prompt = list(np.random.default_rng(0).integers(0, 200, 600))
    runs = _chunk_variants(m, prompt, 16)
    print(runs)
    for name, toks in runs.items():
        assert toks == runs["one-pass"], name


@pytest.mark.parametrize("gpu_path", ["fma", "dp4a"])
def test_graph_decode_matches_eager(fixtures_dir, gpu_path):
    """The replayed CUDA-graph decode gives the eager step's logits, also across KV-cache growth
    (the graph is re-captured when a cache is reallocated) and after a truncate."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.model import load_model

    seqs = {s["name"]: s for s in json.loads((fixtures_dir / "sequences.json").read_text())["sequences"]}
    prompt = seqs["len70"]["ids"]
    graph_be = CupyBackend("cuda:0", path=gpu_path)
    eager_be = CupyBackend("cuda:0", path=gpu_path)
    eager_be.use_graphs = False
    mg = load_model(fixtures_dir / FIXTURES["q8_0"], backend=graph_be)
    me = load_model(fixtures_dir / FIXTURES["q8_0"], backend=eager_be)
    sg, se = mg.new_session(len(prompt) + 4), me.new_session(len(prompt) + 4)  # caches must grow
    worst = graph_vs_eager(sg, se, prompt, 40, truncate_at=20)
    print(f"\ngraph vs eager decode ({gpu_path}): max rel err {worst:.2e}")
    assert graph_be._graphs, "decode never used a CUDA graph"


@pytest.mark.parametrize("top", [1, 20, 0])
def test_launched_steps_are_the_waited_steps(fixtures_dir, top):
    """A decode step launched without a host wait (Session.launch_step: the graph replays while the host
    hands out the previous token) gives the same logits, bit for bit, as the step waited for at once,
    and really returns before the device is done: its result is not on the host yet."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.model import load_model
    from minecart.engine.sampling import TopLogits

    seqs = {s["name"]: s for s in json.loads((fixtures_dir / "sequences.json").read_text())["sequences"]}
    prompt = seqs["len70"]["ids"]
    model = load_model(fixtures_dir / FIXTURES["q8_0"], backend=CupyBackend("cuda:0", path="dp4a"))
    a, b = model.new_session(len(prompt) + 64), model.new_session(len(prompt) + 64)
    a.prefill(prompt)
    b.prefill(prompt)
    token, pending = int(prompt[-1]), 0
    for _ in range(24):
        want = a.step(token, top=top)
        launched = b.launch_step(token, top=top)
        pending += not launched.waited
        got = launched.result()
        if isinstance(want, TopLogits):
            assert isinstance(got, TopLogits)
            np.testing.assert_array_equal(got.values, want.values)
            np.testing.assert_array_equal(got.ids, want.ids)
            token = int(want.ids[0, 0])
        else:
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(b.last_logits, a.last_logits)
            token = int(np.argmax(want))
    assert a.tokens == b.tokens and a.position == b.position
    assert pending >= 20, f"only {pending} of 24 launched steps came back before their result was taken"
    b.close()
    a.close()


def test_chained_steps_are_the_greedy_steps(fixtures_dir):
    """Steps launched behind each other with the pick fed on the device (Session.launch_next: the host
    never sees a token before the next step starts) give the greedy continuation of steps taken one at
    a time, bit for bit, through a KV cache that must grow on the way (a step that cannot be chained
    then runs with its token from the host, and chaining picks up again), and a greedy generate gives
    the same tokens."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.model import load_model
    from minecart.engine.sampling import GREEDY_PICK, TopLogits, greedy_params

    seqs = {s["name"]: s for s in json.loads((fixtures_dir / "sequences.json").read_text())["sequences"]}
    prompt = seqs["len70"]["ids"]
    model = load_model(fixtures_dir / FIXTURES["q8_0"], backend=CupyBackend("cuda:0", path="dp4a"))
    a, b = model.new_session(len(prompt) + 4), model.new_session(len(prompt) + 4)  # caches must grow
    first = int(np.argmax(a.prefill(prompt)))
    b.prefill(prompt)
    n = 48
    want, token = [], first
    for _ in range(n):
        top = a.step(token, top=1)
        want.append((float(top.values[0, 0]), int(top.ids[0, 0])))
        token = int(top.ids[0, 0])
    got, chained = [], 0
    launched = b.launch_step(first, top=1, pick=GREEDY_PICK)
    for i in range(n):
        ahead = b.launch_next(launched, top=1, pick=GREEDY_PICK) if i + 1 < n else None
        chained += ahead is not None
        out = launched.result()
        assert isinstance(out, TopLogits)
        got.append((float(out.values[0, 0]), int(out.ids[0, 0])))
        if i + 1 < n:
            launched = ahead if ahead is not None else b.launch_step(int(out.ids[0, 0]), top=1, pick=GREEDY_PICK)
    assert got == want
    assert b.tokens == a.tokens and b.position == a.position
    assert 40 <= chained < n - 1, f"{chained} of {n - 1} steps chained"  # growth steps are not
    c = model.new_session()  # the capacity generate gives its own session: no growth on the way
    c.prefill(prompt)
    alone, token = [first], first
    for _ in range(n - 1):
        token = int(c.step(token, top=1).ids[0, 0])
        alone.append(token)
    events = list(model.generate(prompt, greedy_params(max_tokens=n)))
    assert [e.token for e in events] == alone
    c.close()
    b.close()
    a.close()


def _host_picks(model, prompt, prm, n: int) -> list[int]:
    """n tokens of a seeded generation picked on the host from steps taken one at a time (Session.step's
    top logits, a Sampler without the vocabulary, so penalties too are applied on the host)."""
    from minecart.engine.sampling import Sampler

    c = model.new_session()
    sampler = Sampler(prm, prompt)
    token = sampler(c.prefill(prompt))
    picks = [token]
    for _ in range(n - 1):
        token = sampler(c.step(token, top=sampler.candidates))
        picks.append(token)
    c.close()
    return picks


@pytest.mark.parametrize("params, distinct", [
    (dict(temperature=40.0, top_k=40, top_p=0.97, min_p=0.005, repetition_penalty=1.3, presence_penalty=0.5,
          frequency_penalty=0.4), 10),
    (dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0), 3),  # greedy picks leave a used token
    (dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.05), 1),  # the app's default
])
def test_penalized_chained_steps_are_the_hosts_picks(fixtures_dir, params, distinct):
    """A seeded generate with penalties, whose steps apply them to their rows on the device (the
    sequence's penalty table, ops.penalize) before drawing their picks and are chained on them, gives
    the tokens the host picks from steps taken one at a time (raw top logits, penalized on the host),
    through a KV cache that must grow on the way (a step that runs without its graph leaves the table
    behind: the next launch rebuilds it from the sampler's lists)."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.generation import generate
    from minecart.engine.model import load_model
    from minecart.engine.sampling import SamplingParams

    seqs = {s["name"]: s for s in json.loads((fixtures_dir / "sequences.json").read_text())["sequences"]}
    prompt = seqs["len70"]["ids"]
    model = load_model(fixtures_dir / FIXTURES["q8_0"], backend=CupyBackend("cuda:0", path="dp4a"))
    n = 48
    prm = SamplingParams(**params, seed=12, max_tokens=n)
    alone = _host_picks(model, prompt, prm, n)  # the sampler without a vocabulary: every pick on the host
    ex = model.executor
    before, eager = ex.chained_steps, ex.eager_stage_steps
    s = model.new_session(len(prompt) + 4)  # caches must grow
    events = list(generate(model, prompt, prm, session=s))
    assert [e.token for e in events] == alone
    assert len(set(alone)) >= distinct  # the penalties (and the temperature) move the picks off one token
    assert ex.eager_stage_steps > eager  # growth steps ran without their graphs
    assert ex.chained_steps - before >= n - 12, f"{ex.chained_steps - before} of {n - 1} steps chained"
    s.close()


@pytest.mark.parametrize("params", [
    dict(temperature=0.7, top_k=20, top_p=0.8),  # Qwen3.5's recommendation (the tiny model: one token)
    dict(temperature=40.0, top_k=64, top_p=0.97, min_p=0.005),  # flat enough to draw many tokens
])
def test_sampled_chained_steps_are_the_hosts_draws(fixtures_dir, params):
    """A seeded sampled generate, whose steps draw their picks on the device and are chained on them
    (Sampler.pick_spec, ops.pick_top), gives the tokens of the same seed drawn on the host from steps
    taken one at a time (Session.step's top logits, Sampler): the device drew what the host would.
    (The tiny model's distribution is so peaked that only a high temperature draws more than one.)"""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.model import load_model
    from minecart.engine.sampling import SamplingParams

    seqs = {s["name"]: s for s in json.loads((fixtures_dir / "sequences.json").read_text())["sequences"]}
    prompt = seqs["len70"]["ids"]
    model = load_model(fixtures_dir / FIXTURES["q8_0"], backend=CupyBackend("cuda:0", path="dp4a"))
    n = 40
    prm = SamplingParams(**params, seed=11, max_tokens=n)
    alone = _host_picks(model, prompt, prm, n)
    before = model.executor.chained_steps
    events = list(model.generate(prompt, prm))
    assert [e.token for e in events] == alone
    if params["temperature"] > 1:
        assert len(set(alone)) > 10  # a draw over many tokens (the tiny model's greedy text repeats one)
    assert model.executor.chained_steps - before >= n - 5  # all but the first steps (graph captures)


def test_a_lone_scheduled_generation_chains_its_steps(fixtures_dir):
    """A generation running alone under the continuous-batching scheduler launches its own decode
    steps (Scheduler.alone), chained on the device like a generation outside it: the same tokens as
    the model's own generate for a greedy and a penalized sampled sampler, nearly every step chained."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.model import load_model
    from minecart.engine.sampling import SamplingParams, greedy_params
    from minecart.engine.scheduler import Scheduler

    seqs = {s["name"]: s for s in json.loads((fixtures_dir / "sequences.json").read_text())["sequences"]}
    prompt = seqs["len70"]["ids"]
    model = load_model(fixtures_dir / FIXTURES["q8_0"], backend=CupyBackend("cuda:0", path="dp4a"))
    n = 32
    sched = Scheduler(model, parallel=3)
    try:
        for prm in (greedy_params(max_tokens=n),
                    SamplingParams(temperature=40.0, top_k=40, top_p=0.97, repetition_penalty=1.3, seed=4,
                                   max_tokens=n)):
            want = [e.token for e in model.generate(prompt, prm)]
            before = model.executor.chained_steps
            got = [e.token for e in sched.generate(prompt, prm)]
            assert got == want
            assert model.executor.chained_steps - before >= n - 6
        assert sched.metrics()["alone_steps"] >= 2 * (n - 1) - 2
    finally:
        sched.close()
