"""The context limit: the planned context is what a loaded model holds (engine/session.py).

One number, context_limit(model): the placement's context capped at the trained context (the trained
context without a plan). Sessions are allocated for it up front (the plan's KV bytes are what the
caches hold, for every KV type), never hold more tokens than it (ContextFullError before any token
runs), generation refuses a prompt at exactly limit + 1 tokens of prompt and answer, and the runtime,
the HTTP server (a 400 that names the limit and how to raise it) and the CLI (--context) all use it.
"""

from __future__ import annotations

import dataclasses
import json

import httpx
import numpy as np
import pytest
from minecart.engine import kvquant as kq
from minecart.engine.backends.numpy_backend import NumpyBackend
from minecart.engine.errors import ContextFullError, PlacementError
from minecart.engine.generation import generate
from minecart.engine.model import load_model
from minecart.engine.placement import Placement
from minecart.engine.runtime import Runtime
from minecart.engine.sampling import greedy_params
from minecart.engine.server import ServerThread, create_app
from minecart.engine.session import DEFAULT_CAPACITY, context_limit, initial_capacity

FIXTURE = ("dense", "qwen35-tiny-dense-q8_0.gguf")
TRAINED = 262144  # the fixture's qwen35.context_length
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def path(fixtures_dir):
    return fixtures_dir.joinpath(*FIXTURE)


@pytest.fixture(scope="module")
def model40(path):
    """The fixture loaded with a 40-token context limit (the backend= path builds the plan)."""
    m = load_model(path, backend=NumpyBackend(), mmproj=False, context=40)
    yield m
    m.close()


def _caches(session):
    return [st.kv for st in session.states if st.kv is not None]


# -- the one number --------------------------------------------------------------------------------


def test_the_limit_is_the_planned_context_capped_at_the_trained_one(path, model40):
    assert isinstance(model40.placement, Placement) and model40.placement.context == 40
    assert context_limit(model40) == 40 == initial_capacity(model40)
    saved = model40.config
    try:
        model40.placement = model40.placement.with_settings(context=TRAINED * 2)
        assert context_limit(model40) == TRAINED  # past the trained context the output is garbage
        model40.config = dataclasses.replace(model40.config, context_length=0)
        assert context_limit(model40) == TRAINED * 2  # unknown trained context: the plan alone
    finally:
        model40.config = saved
        model40.placement = model40.placement.with_settings(context=40)
    plain = load_model(path, backend=NumpyBackend(), mmproj=False)  # no plan at all
    try:
        assert plain.placement is None
        assert context_limit(plain) == TRAINED
        assert initial_capacity(plain) == DEFAULT_CAPACITY  # grows (up to the limit) as it fills
        s = plain.new_session()
        assert s.limit == TRAINED and all(c.capacity == DEFAULT_CAPACITY for c in _caches(s))
        s.close()
    finally:
        plain.close()


@pytest.mark.parametrize("kv_type", kq.KV_TYPES)
def test_the_loader_plans_the_context_and_kv_cache_it_runs(path, kv_type):
    m = load_model(path, devices=["cpu:0"], mmproj=False, context=96, kv_type=kv_type)
    try:
        assert isinstance(m.placement, Placement) and m.placement.context == 96
        assert m.placement.kv_type == kv_type == m.kv_type  # the plan prices the cache that runs
        assert context_limit(m) == 96
        s = m.new_session()
        assert sum(c.nbytes for c in _caches(s)) == m.placement.bytes_per_device()["cpu:0"].kv_cache
        s.close()
    finally:
        m.close()


def test_the_loader_defaults_to_the_plan_default_context(path):
    m = load_model(path, devices=["cpu:0"], mmproj=False)
    try:
        assert context_limit(m) == 4096  # the plan's default context
    finally:
        m.close()
    with pytest.raises(PlacementError, match="at least 1 token"):
        load_model(path, devices=["cpu:0"], mmproj=False, context=0)


# -- allocation: the plan's bytes, up front, never grown -------------------------------------------


@pytest.mark.parametrize("kv_type", kq.KV_TYPES)
def test_a_session_allocates_the_planned_kv_bytes_up_front(path, capsys, kv_type):
    """`minecart plan --context N` prices the KV cache a session of a model loaded with context N
    allocates (no capacity given: the session sizes itself), and filling it to the limit grows nothing."""
    from minecart.engine.cli import main

    n = 48
    assert main(["plan", str(path), "--rig", "cpu:0=4GiB", "--kv-type", kv_type, "--json",
                 "--context", str(n)]) == 0
    report = json.loads(capsys.readouterr().out)
    model = load_model(path, backend=NumpyBackend(), mmproj=False, kv_type=kv_type, context=n)
    try:
        session = model.new_session()
        caches = _caches(session)
        assert caches and all(c.capacity == n for c in caches)
        allocated = sum(c.nbytes for c in caches)
        assert allocated == report["kv_bytes_per_token"] * n == report["devices"][0]["kv_cache_bytes"]
        assert report["context"] == n
        before = [c.nbytes for c in caches]
        session.prefill(list(range(100, 100 + n)), chunk=16)  # exactly the limit
        assert session.n_tokens == n and [c.nbytes for c in caches] == before
        assert all(c.capacity == n and c.length == n for c in caches)
        with pytest.raises(ContextFullError) as err:
            session.step(7)
        assert (err.value.needed, err.value.limit) == (n + 1, n)
        assert session.n_tokens == n and all(c.length == n for c in caches)  # nothing ran
        session.close()
    finally:
        model.close()


def test_a_session_never_holds_more_than_its_limit(model40):
    s = model40.new_session()
    assert s.limit == 40
    with pytest.raises(ContextFullError, match="holds at most 40"):
        s.prefill(list(range(100, 141)))  # 41 tokens: refused before any chunk runs
    assert s.n_tokens == 0 and all(c.length == 0 for c in _caches(s))
    s.prefill(list(range(100, 130)))
    with pytest.raises(ContextFullError):
        s.sync(list(range(100, 130)) + list(range(11)))  # 41 again, 11 of them new
    assert s.n_tokens == 30
    twin = s.fork()
    assert twin.limit == 40
    twin.close()
    s.close()
    # an explicit capacity beyond the model's limit is the caller's choice (a long-context benchmark)
    big = model40.new_session(capacity=64)
    assert big.limit == 64 and all(c.capacity == 64 for c in _caches(big))
    big.prefill(list(range(100, 164)))
    big.close()


# -- generation ------------------------------------------------------------------------------------


def test_generation_refuses_exactly_at_limit_plus_one(model40):
    # limit - 1 prompt tokens: room for exactly one answer token
    events = list(generate(model40, list(range(100, 139)), greedy_params(max_tokens=50)))
    assert events[-1].finish_reason == "length" and events[-1].generated_tokens == 1
    # limit prompt tokens: the first answer token would be token limit + 1
    with pytest.raises(ContextFullError) as err:
        list(generate(model40, list(range(100, 140)), greedy_params(max_tokens=50)))
    assert (err.value.needed, err.value.limit, err.value.trained) == (41, 40, TRAINED)
    text = str(err.value)
    assert "41" in text and "40" in text and "--context" in text and "262,144" in text


def test_a_conversation_stops_at_the_limit_and_then_is_refused(model40):
    s = model40.new_session()
    prompt = list(range(100, 130))
    events = list(generate(model40, prompt, greedy_params(max_tokens=100), session=s))
    answer = [e.token for e in events if e.token is not None]
    assert events[-1].finish_reason == "length" and len(prompt) + len(answer) == 40
    assert s.n_tokens <= 40
    with pytest.raises(ContextFullError):  # the next turn carries 40 tokens before a new one
        list(generate(model40, prompt + answer, greedy_params(max_tokens=4), session=s))
    assert s.n_tokens <= 40
    s.close()


def test_at_the_trained_context_the_message_says_it_cannot_grow(path):
    m = load_model(path, backend=NumpyBackend(), mmproj=False, context=40)
    try:
        m.config = dataclasses.replace(m.config, context_length=40)
        with pytest.raises(ContextFullError, match="trained for") as err:
            list(generate(m, list(range(100, 140)), greedy_params(max_tokens=2)))
        assert "--context" not in str(err.value)
    finally:
        m.close()


# -- runtime, server, CLI --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime40(path):
    rt = Runtime(sample_memory_s=0)
    rt.load(path, devices=["cpu"], context=40).result(TIMEOUT)
    yield rt
    rt.close()


def test_the_runtime_reports_the_limit_and_refuses_beyond_it(runtime40):
    info = runtime40.model_info
    assert info is not None and info.context_limit == 40 and info.context_length == TRAINED
    assert info.to_dict()["context_limit"] == 40
    final = runtime40.complete(list(range(100, 140)), greedy_params(max_tokens=3),
                               conversation_id="long").wait(TIMEOUT)
    assert final.kind == "error" and isinstance(final.error, ContextFullError)
    assert final.error.limit == 40 and final.error.needed == 41
    final = runtime40.complete(list(range(100, 139)), greedy_params(max_tokens=3),
                               conversation_id="long").wait(TIMEOUT)
    assert final.kind == "done" and final.usage.completion_tokens == 1 and final.finish_reason == "length"


def test_the_server_answers_a_prompt_beyond_the_limit_with_a_400(runtime40):
    with ServerThread(create_app(runtime40)) as server:
        card = httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]
        assert card["context_limit"] == 40 and card["context_length"] == TRAINED
        r = httpx.post(server.url + "/v1/completions", timeout=TIMEOUT,
                       json={"prompt": list(range(100, 140)), "max_tokens": 3, "temperature": 0})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded"
        assert "holds at most 40" in err["message"] and "--context" in err["message"]
        r = httpx.post(server.url + "/v1/completions", timeout=TIMEOUT,
                       json={"prompt": list(range(100, 139)), "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1  # max_tokens is capped by the context


def test_the_cli_takes_a_context(path):
    from minecart.engine.cli import build_parser

    args = build_parser().parse_args(["serve", str(path), "--context", "8192"])
    assert args.context == 8192
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", str(path), "--context", "0"])
    from tests.engine.test_cli_run import minecart

    long = " ".join(["word"] * 80)
    r = minecart("run", str(path), "-p", long, "--raw", "--temp", "0", "--max-tokens", "3",
                 "--devices", "cpu", "--context", "32")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "holds at most 32" in r.stderr and "--context" in r.stderr
    r = minecart("run", str(path), "-p", "The quick brown fox jumps over the lazy dog.", "--raw",
                 "--temp", "0", "--max-tokens", "6", "--devices", "cpu", "--context", "12")
    assert r.returncode == 0, r.stderr
    assert r.stdout == " Sunt" * 2 + "\n"  # 10 prompt tokens + 2 answer tokens = the limit


def test_logits_are_not_limited(model40):
    """Model.logits is the fresh-sequence check of tests and benchmarks: it sizes its own state."""
    out = model40.logits(list(range(100, 164)))
    assert out.shape[0] == 64 and np.all(np.isfinite(out))


def test_batched_requests_are_checked_before_the_prefix_cache_prefills(model40):
    from minecart.engine.prefix_cache import PrefixCache
    from minecart.engine.scheduler import Scheduler

    sched = Scheduler(model40, parallel=2, prefix_cache=PrefixCache(block=8))
    try:
        with pytest.raises(ContextFullError) as err:
            list(sched.generate(list(range(100, 200)), greedy_params(max_tokens=2)))
        assert (err.value.needed, err.value.limit) == (101, 40)  # the whole prompt, not one block
        assert sched.prefix_cache.lookups == 0  # refused before the cache was asked
        events = list(sched.generate(list(range(100, 139)), greedy_params(max_tokens=9)))
        assert events[-1].finish_reason == "length" and events[-1].generated_tokens == 1
        s = sched.new_session()
        assert s.limit == 40  # the scheduler's view of the model has the model's limit
        s.close()
    finally:
        sched.close()
