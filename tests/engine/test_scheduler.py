"""The continuous-batching scheduler on the real Qwen3.5 fixture model: concurrent greedy generations
give exactly the tokens of one-at-a-time generation, while their decode steps really share passes;
prompts prefill in chunks between decode steps; cancel, the parallel limit, the queue limit and
shutdown behave."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
from minecart.engine.errors import GenerationCancelled
from minecart.engine.model import load_model
from minecart.engine.sampling import (
    GREEDY_PICK,
    LaunchedStep,
    PenaltyHistory,
    Sampler,
    SamplingParams,
    greedy_params,
    top_logits,
)
from minecart.engine.scheduler import QueueFull, Scheduler

SEQUENCES = ["single", "short", "len70", "len128", "chat", "random100", "len300"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def fixture(fixtures_dir):
    model = load_model(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", devices=["cpu:0"])
    prompts = {s: [int(t) for t in np.load(fixtures_dir / "dense" / "ref_hf" / f"{s}.npz")["tokens"]]
               for s in SEQUENCES}
    expected = {}
    for name, ids in prompts.items():  # one at a time, the ordinary path
        events = list(model.generate(ids, greedy_params(max_tokens=MAX_TOKENS)))
        expected[name] = ([e.token for e in events], events[-1].finish_reason)
    yield model, prompts, expected
    model.close()


def _run_all(sched: Scheduler, prompts: dict, names: list[str], cancels=None, stagger_s: float = 0.0,
             max_tokens: dict[int, int] | None = None):
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def worker(i: int, name: str) -> None:
        try:
            cancel = cancels[i] if cancels else None
            n = (max_tokens or {}).get(i, MAX_TOKENS)
            results[i] = list(sched.generate(prompts[name], greedy_params(max_tokens=n), cancel=cancel))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = []
    for i, name in enumerate(names):
        t = threading.Thread(target=worker, args=(i, name))
        t.start()
        threads.append(t)
        time.sleep(stagger_s)
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a generation hung"
    assert not errors, errors
    return results


def test_concurrent_generations_equal_one_at_a_time(fixture):
    model, prompts, expected = fixture
    sched = Scheduler(model, parallel=4, max_queue=8, chunk=32)
    try:
        names = ["short", "len70", "chat", "random100", "len128", "single"]  # 6 > parallel: 2 queue
        results = _run_all(sched, prompts, names)
        for i, name in enumerate(names):
            events = results[i]
            assert ([e.token for e in events], events[-1].finish_reason) == expected[name], name
            assert events[-1].prompt_tokens == len(prompts[name])
        m = sched.metrics()
        assert m["batch_size_max"] >= 3  # decode steps really were shared
        assert m["batch_size_mean"] > 1.5
        assert m["decode_tokens"] >= len(names) * (MAX_TOKENS - 1)
        assert m["running"] == 0 and m["queue_depth"] == 0 and m["finished"] == len(names)
        assert m["chained_passes"] > 0  # rows whose token the scheduler drew without waiting for the caller
    finally:
        sched.close()


def test_chained_passes_draw_what_each_sampler_draws(fixture):
    """Batched generations whose samplers chain hand in their next pass before they picked its token;
    the scheduler draws it from the pass before (_Pass.pick_token). Seeded sampled generations, a greedy
    one, penalized ones (drawn with their penalties over the history up to the pass: strong enough to
    change the tokens), and one whose penalties need whole rows (read through its steps' fetch while its
    batch mates take top logits) give the tokens each gives alone, through the model's own generate."""
    model, prompts, _ = fixture
    cases = [("chat", SamplingParams(temperature=4.0, top_k=20, seed=7, max_tokens=MAX_TOKENS)),
             ("len70", SamplingParams(temperature=1.2, top_k=40, min_p=0.02, seed=3, max_tokens=MAX_TOKENS)),
             ("short", greedy_params(max_tokens=MAX_TOKENS)),
             ("random100", SamplingParams(temperature=0.8, top_k=20, repetition_penalty=0.9, seed=5,
                                          max_tokens=MAX_TOKENS)),
             ("len128", greedy_params(repetition_penalty=3.0, presence_penalty=2.0, max_tokens=MAX_TOKENS)),
             ("single", SamplingParams(temperature=0.9, top_k=30, top_p=0.9, frequency_penalty=2.5, seed=11,
                                       max_tokens=MAX_TOKENS))]
    alone = {name: [e.token for e in model.generate(prompts[name], prm)] for name, prm in cases}
    plain = [e.token for e in model.generate(prompts["len128"], greedy_params(max_tokens=MAX_TOKENS))]
    assert alone["len128"] != plain  # the penalties decide tokens here
    # the first three together (top logits of 20, 40 and 1 in one step); the greedy one with the one
    # that needs whole rows; the penalized ones with a sampled one
    for group in (cases[:3], cases[2:4], [cases[0], *cases[4:]]):
        sched = Scheduler(model, parallel=4, max_queue=4, chunk=32)
        try:
            results = _generate_at_once(sched, prompts, group)
            for name, _ in group:
                assert results[name] == alone[name], name
            m = sched.metrics()
            assert m["batch_size_max"] >= 2 and m["chained_passes"] >= MAX_TOKENS - 3
        finally:
            sched.close()


def test_a_row_that_takes_its_whole_logits_does_not_make_the_others_whole(fixture, monkeypatch):
    """A generation whose sampler takes whole rows (top-k off: every prompt's last chunk, and here every
    step) shares steps with top-k generations: those steps return top logits, as many as the most any
    row asks, and that row reads its own whole row through the step's fetch (before, one such row made
    the step copy every row whole, a (rows, vocab) copy each time a request joined a running batch).
    Every generation gives the tokens it gives alone."""
    model, prompts, _ = fixture
    cases = [("chat", SamplingParams(temperature=1.5, top_k=0, seed=4, max_tokens=MAX_TOKENS)),  # whole rows
             ("len70", SamplingParams(temperature=1.2, top_k=20, seed=6, max_tokens=MAX_TOKENS)),
             ("short", greedy_params(max_tokens=MAX_TOKENS))]
    alone = {name: [e.token for e in model.generate(prompts[name], prm)] for name, prm in cases}
    launches: list[tuple[int, int]] = []  # (decode rows, top)
    real = model.executor.launch_batch

    def launch_batch(ids, states, positions, top=0):
        launches.append((sum(len(i) == 1 for i in ids), top))
        return real(ids, states, positions, top=top)

    monkeypatch.setattr(model.executor, "launch_batch", launch_batch)
    sched = Scheduler(model, parallel=3, max_queue=3, chunk=32)
    try:
        results = _generate_at_once(sched, prompts, cases)
    finally:
        sched.close()
    for name, _ in cases:
        assert results[name] == alone[name], name
    # steps that decode two or more of them (at most one is the whole-row one's): top logits, as many
    # as len70's 20 (its steps' top); before, every one of them returned whole rows
    shared = [top for decodes, top in launches if decodes > 1]
    assert len(shared) >= MAX_TOKENS - 3, launches
    assert set(shared) <= {1, 20} and shared.count(20) >= MAX_TOKENS - 3, launches


def test_a_whole_row_that_cannot_be_read_fails_its_generation_only(fixture, monkeypatch):
    """Steps whose top logits come without their whole rows (an executor that keeps none): the generation
    that needs its whole row gets the error; the scheduler's thread lives on, its batch mates get their
    tokens, and a generation after them runs."""
    from minecart.engine.sampling import LaunchedStep, TopLogits

    model, prompts, expected = fixture
    real = model.executor.launch_batch

    def launch_batch(ids, states, positions, top=0):
        launched = real(ids, states, positions, top=top)

        def result():
            out = launched.result()
            return replace(out, fetch=None) if isinstance(out, TopLogits) else out

        return LaunchedStep(result)

    monkeypatch.setattr(model.executor, "launch_batch", launch_batch)
    sched = Scheduler(model, parallel=2, max_queue=2, chunk=32)
    errors: list[BaseException] = []
    got: dict[str, list] = {}

    def run(name: str, prm: SamplingParams) -> None:
        try:
            got[name] = [e.token for e in sched.generate(prompts[name], prm)]
        except RuntimeError as exc:
            errors.append(exc)

    try:
        # "short" decodes (top 1) while "len70" prefills in 32-token chunks and ends its prompt (whole
        # row) in a step with short's decode row
        first = threading.Thread(target=run, args=("short", greedy_params(max_tokens=40)))
        second = threading.Thread(target=run, args=("len70", SamplingParams(temperature=1.0, top_k=0, seed=1,
                                                                             max_tokens=MAX_TOKENS)))
        first.start()
        second.start()
        for th in (first, second):
            th.join(60)
            assert not th.is_alive(), "a generation hung"
        assert [str(e) for e in errors] == ["these top logits were returned without their whole rows"]
        assert got["short"][:MAX_TOKENS] == expected["short"][0][:MAX_TOKENS]
        assert sched._thread.is_alive()
        run("chat", greedy_params(max_tokens=MAX_TOKENS))
        assert got["chat"] == expected["chat"][0]
    finally:
        sched.close()


def test_the_scheduler_draws_each_chained_token_before_its_generation_wakes(fixture, monkeypatch):
    """A pass with a pick has its token drawn on the scheduler's thread when its step ends, before the
    pass is finished (so the generations' threads, woken then, do not hold up the draws of the next
    step): every first draw of _Pass.pick_token runs there and finds the pass not yet finished."""
    from minecart.engine import scheduler as sched_module

    model, prompts, _ = fixture
    draws: list[tuple[str, bool]] = []
    real = sched_module._Pass.pick_token

    def pick_token(self):
        if self._picked is None:
            draws.append((threading.current_thread().name, self.finished.is_set()))
        return real(self)

    monkeypatch.setattr(sched_module._Pass, "pick_token", pick_token)
    cases = [("chat", SamplingParams(temperature=2.0, top_k=20, seed=1, max_tokens=MAX_TOKENS)),
             ("len70", SamplingParams(temperature=0.9, top_k=8, top_p=0.9, seed=2, max_tokens=MAX_TOKENS)),
             ("short", greedy_params(max_tokens=MAX_TOKENS))]
    sched = Scheduler(model, parallel=3, max_queue=3, chunk=32)
    try:
        _generate_at_once(sched, prompts, cases)
        scheduler_thread = sched._thread.name
    finally:
        sched.close()
    assert len(draws) >= 3 * (MAX_TOKENS - 3)
    assert {d for d in draws} == {(scheduler_thread, False)}


def test_a_steps_callers_wake_while_the_next_step_runs(fixture, monkeypatch):
    """When every running generation's next pass is ready (chained on the one that just ran), the
    scheduler launches the next step before it wakes the callers of the last one, so their threads work
    while the device computes. Steps here are launched as on a GPU (the launch returns at once, result()
    waits out 30 ms): nearly every token reaches its caller while a step is in flight, and the tokens
    are greedy's alone."""
    model, prompts, expected = fixture
    names = ["chat", "len70", "short"]
    counts = {"launched": 0, "taken": 0}
    real = model.executor.launch_batch

    def launch_batch(ids, states, positions, top=0):
        out = real(ids, states, positions, top=top).result()
        counts["launched"] += 1
        end = time.perf_counter() + 0.03

        def result():
            time.sleep(max(0.0, end - time.perf_counter()))
            counts["taken"] += 1
            return out

        return LaunchedStep(result)

    monkeypatch.setattr(model.executor, "launch_batch", launch_batch)
    in_flight: dict[str, list[bool]] = {n: [] for n in names}
    sched = Scheduler(model, parallel=3, max_queue=3, chunk=32)
    try:
        tokens = _generate_at_once(sched, prompts, [(n, greedy_params(max_tokens=MAX_TOKENS)) for n in names],
                                   on_event=lambda n: in_flight[n].append(counts["launched"] > counts["taken"]))
    finally:
        sched.close()
    for name in names:
        assert tokens[name] == expected[name][0], name
    # the middle tokens (all three decoding, each chained): woken while the next step runs (woken after
    # their step's result, with nothing in flight, they would all be False)
    middle = [f for n in names for f in in_flight[n][3:-3]]
    assert len(middle) == 3 * (MAX_TOKENS - 6) and sum(middle) >= 0.75 * len(middle), in_flight


def test_a_whole_row_a_pick_read_stays_after_the_next_step(fixture, monkeypatch):
    """Batched penalized picks whose candidates do not decide: the scheduler's draw reads the whole row
    before the next step, and the request's own pick reads it again after that step was launched, when
    a device no longer keeps it (a graph's fetch refuses then: CupyBackend). The row stays with the
    step's top logits, so the second read needs no fetch, and the tokens are those of whole rows.
    (Stubbed steps: every row is the same made-up logits, its 64 largest all prompt tokens that a 4.0
    repetition penalty drops below a token outside them.)"""
    from minecart.engine.sampling import TopLogits

    model, _, _ = fixture
    V = model.config.vocab_size
    row = np.full(V, -5.0, np.float32)
    row[1000:1064] = np.linspace(10.3, 10.0, 64, dtype=np.float32)
    row[5000] = 9.9  # the only one of the rest above the penalized candidates, until it is seen
    prompts = {"a": list(range(1000, 1064)) + [7, 8], "b": list(range(1063, 999, -1)) + [9]}
    params = greedy_params(repetition_penalty=4.0, max_tokens=MAX_TOKENS)
    launches, reads = [0], []

    def launch_batch(ids, states, positions, top=0):
        launches[0] += 1
        mine, B = launches[0], len(ids)
        if not top:
            return LaunchedStep.done(np.tile(row, (B, 1)))
        vals, tops = top_logits(row, top)

        def fetch(r: int) -> np.ndarray:
            if launches[0] != mine:
                raise RuntimeError("the device holds a later step's logits now")
            reads.append(r)
            return row

        return LaunchedStep.done(TopLogits(np.repeat(vals, B, 0), np.repeat(tops, B, 0), fetch=fetch))

    def at_once() -> dict[str, list]:
        sched = Scheduler(model, parallel=2, max_queue=2, chunk=128)
        try:
            return _generate_at_once(sched, prompts, [(name, params) for name in prompts])
        finally:
            sched.close()

    monkeypatch.setattr(model.executor, "launch_batch", launch_batch)
    monkeypatch.setattr(Scheduler, "alone", lambda self: False)  # a generation left alone: stubbed steps too
    got = at_once()
    assert len(reads) >= MAX_TOKENS, reads  # most picks read their rows
    monkeypatch.setattr(Sampler, "candidates", property(lambda self: 0))
    want = at_once()
    assert got == want and all(len(t) == MAX_TOKENS for t in got.values())
    assert got["a"][:2] == [5000, 1000]  # the token outside the candidates, then the penalized best


def _generate_at_once(sched: Scheduler, prompts: dict, cases: list,
                      on_event: Callable[[str], None] | None = None) -> dict[str, list]:
    """The tokens of each (prompt name, SamplingParams) generated at once through sched; on_event(name)
    is called on the generation's thread as each of its events arrives."""
    results: dict[str, list] = {}
    errors: list[BaseException] = []

    def worker(name: str, prm: SamplingParams) -> None:
        try:
            got = []
            for e in sched.generate(prompts[name], prm):
                got.append(e.token)
                if on_event is not None:
                    on_event(name)
            results[name] = got
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=c) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a generation hung"
    assert not errors, errors
    return results


def test_a_step_after_a_batched_pass_is_never_the_devices_chained_step(fixture, monkeypatch):
    """After a pass through the scheduler, the next step never goes to the model's own launch_next (on a
    GPU that one would embed the device's last pick of a step the model launched itself, not this
    pass's token). Batched, with a pick (penalized or not), it is a pass chained on that one; once the
    generation runs alone, nothing: the caller takes the pass's result and launches its pick, which a
    lone generation launches on the model itself, and the launch_next after that is the model's own
    again. The tokens are greedy's."""
    model, prompts, _ = fixture
    ids = prompts["short"]
    want = [e.token for e in model.generate(ids, greedy_params(max_tokens=5))]
    sched = Scheduler(model, parallel=2, max_queue=2, chunk=32)
    own_launch_next = []
    monkeypatch.setattr(model, "launch_next", lambda *a, **k: own_launch_next.append(a) or None)
    alone = [False]
    monkeypatch.setattr(sched, "alone", lambda: alone[0])
    try:
        s = sched.new_session()
        tok = int(np.argmax(s.sync(ids)))
        launched = s.launch_step(tok, top=1, pick=GREEDY_PICK)  # a batched pass, with a pick
        ahead = s.launch_next(launched, top=1, pick=GREEDY_PICK)
        assert ahead is not None and not own_launch_next  # chained on the pass, through the scheduler
        got = [tok, int(launched.result().ids[0, 0]), int(ahead.result().ids[0, 0])]
        assert got == want[:3] and s.tokens[-2:] == want[1:3]
        launched = s.launch_step(got[-1], top=1, pick=GREEDY_PICK)  # batched again
        alone[0] = True  # the others left
        assert s.launch_next(launched, top=1, pick=GREEDY_PICK) is None and not own_launch_next
        got.append(int(launched.result().ids[0, 0]))
        launched = s.launch_step(got[-1], top=1, pick=GREEDY_PICK)  # the model's own step now
        assert s.launch_next(launched, top=1, pick=GREEDY_PICK) is None and len(own_launch_next) == 1
        got.append(int(launched.result().ids[0, 0]))
        assert got == want[:5]
        alone[0] = False
        history = PenaltyHistory(ids, [], model.config.vocab_size)
        penalized = replace(GREEDY_PICK, top_k=1, repetition=1.1, history=history)
        launched = s.launch_step(got[-1], top=1, pick=penalized)  # batched, with penalties
        ahead = s.launch_next(launched, top=1, pick=penalized)
        assert ahead is not None and len(own_launch_next) == 1  # chained through the scheduler too
        launched.result()
        ahead.result()
        s.close()
    finally:
        sched.close()


def test_a_generation_running_alone_launches_its_own_steps(fixture):
    """A generation with no other admitted launches its decode steps itself (Scheduler.alone: on a GPU
    they are chained on the device), with the tokens of the model's own generate; once a second one
    runs, the decode steps are the scheduler's batched steps again, and both keep their tokens."""
    model, prompts, expected = fixture
    sched = Scheduler(model, parallel=4, max_queue=4, chunk=32)
    try:
        events = list(sched.generate(prompts["len70"], greedy_params(max_tokens=MAX_TOKENS)))
        assert ([e.token for e in events], events[-1].finish_reason) == expected["len70"]
        m = sched.metrics()
        n = sum(e.token is not None for e in events)
        assert m["alone_steps"] == m["decode_tokens"] == n - 1  # the first token is the prompt's
        assert not sched.alone()  # nothing running
        results = _run_all(sched, prompts, ["chat", "short"])
        for i, name in enumerate(["chat", "short"]):
            assert ([e.token for e in results[i]], results[i][-1].finish_reason) == expected[name], name
        m2 = sched.metrics()
        assert m2["batch_size_max"] >= 2  # the two shared steps
        assert m2["decode_tokens"] - m["decode_tokens"] >= 2 * (MAX_TOKENS - 1)
    finally:
        sched.close()


def test_prompt_prefills_in_chunks_between_decode_steps(fixture):
    """A 300-token prompt arriving while three sequences decode is prefilled 32 tokens per step, in
    the same passes as their decode rows (and still gives its own one-at-a-time tokens)."""
    model, prompts, expected = fixture
    sched = Scheduler(model, parallel=4, chunk=32)
    seen: list[tuple[int, int]] = []  # (decode tokens so far, prefill tokens so far) per step
    original = sched._count

    def spy(decoded: int, prefilled: int, sequences: int) -> None:
        original(decoded, prefilled, sequences)
        seen.append((decoded, prefilled))

    sched._count = spy  # type: ignore[method-assign]
    try:
        # the three short prompts decode 60 tokens: they are still running when the long one prefills
        results = _run_all(sched, prompts, ["short", "len70", "chat", "len300"], stagger_s=0.02,
                           max_tokens={0: 60, 1: 60, 2: 60})
        assert [e.token for e in results[3]] == expected["len300"][0]
        long_chunks = [(d, p) for d, p in seen if p == 32]
        assert len(long_chunks) >= 300 // 32 - 1  # the long prompt went in 32-token pieces
        assert any(d >= 2 for d, p in long_chunks)  # ... sharing steps with decoding sequences
    finally:
        sched.close()


def test_cancel_leaves_the_others_exact(fixture):
    model, prompts, expected = fixture
    sched = Scheduler(model, parallel=4, chunk=64)
    try:
        cancels = [threading.Event() for _ in range(3)]
        names = ["short", "len70", "chat"]
        cancels[1].set()  # cancelled before it ever runs (while queued or at its first check)
        results = _run_all(sched, prompts, names, cancels=cancels)
        assert results[1][-1].finish_reason == "cancelled"
        for i in (0, 2):
            assert [e.token for e in results[i]] == expected[names[i]][0]
        # cancel mid-generation: the stream ends with "cancelled" within a token
        cancel = threading.Event()
        got = []
        for ev in sched.generate(prompts["len128"], greedy_params(max_tokens=200), cancel=cancel):
            got.append(ev)
            if len(got) == 3:
                cancel.set()
        assert got[-1].finish_reason == "cancelled" and len(got) <= 5
        assert sched.metrics()["running"] == 0
    finally:
        sched.close()


def test_queue_limit_raises_queue_full_with_retry_after(fixture):
    model, prompts, _ = fixture
    sched = Scheduler(model, parallel=1, max_queue=1)
    try:
        first = sched.generate(prompts["short"], greedy_params(max_tokens=50))
        next(first)  # admitted and generating (paused between tokens)
        queued = sched.generate(prompts["short"], greedy_params(max_tokens=2))
        started = threading.Event()
        waited: list = []

        def drain() -> None:
            started.set()
            waited.extend(queued)

        t = threading.Thread(target=drain)
        t.start()
        started.wait()
        deadline = time.time() + 5
        while sched.metrics()["queue_depth"] < 1 and time.time() < deadline:
            time.sleep(0.01)
        with pytest.raises(QueueFull) as info:
            sched.generate(prompts["short"], greedy_params(max_tokens=2))
        assert info.value.retry_after >= 1
        assert sched.metrics()["rejected"] == 1
        first.close()  # the first request ends: the queued one runs
        t.join(30)
        assert waited and waited[-1].finish_reason == "length"
    finally:
        sched.close()


def test_close_ends_waiting_and_running_generations(fixture):
    model, prompts, _ = fixture
    sched = Scheduler(model, parallel=1, max_queue=4)
    running = sched.generate(prompts["short"], greedy_params(max_tokens=100))
    next(running)
    queued = sched.generate(prompts["short"], greedy_params(max_tokens=5))
    out: list = []
    t = threading.Thread(target=lambda: out.extend(queued))
    t.start()
    time.sleep(0.1)
    sched.close()
    t.join(10)
    assert not t.is_alive() and out[-1].finish_reason == "cancelled"
    with pytest.raises(GenerationCancelled):
        list(running)
    running.close()


# ---- through the Runtime (parallel > 1): what the server and the app use ------------------------------


@pytest.fixture(scope="module")
def batching_runtime(fixtures_dir):
    from minecart.engine.runtime import Runtime

    rt = Runtime(sample_memory_s=0, parallel=3, max_queue=2)
    rt.load(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", devices=["cpu:0"]).result(60)
    yield rt
    rt.close()


def _complete_concurrently(rt, prompts: dict, expected: dict, names: list[str]) -> dict:
    """Submit one greedy completion per name at once; each must give its one-at-a-time tokens, and the
    runtime's steps must have held 2 or more sequences -> its batching metrics."""
    handles = [rt.complete(prompts[n], greedy_params(max_tokens=MAX_TOKENS)) for n in names]
    for name, h in zip(names, handles, strict=True):
        tokens = [ev.generation.token for ev in h.events(30) if ev.kind == "token" and ev.generation]
        assert h.final is not None and h.final.kind == "done", h.final
        assert tokens == expected[name][0], name
    m = rt.batching_metrics()
    assert m is not None and m["batch_size_max"] >= 2, m
    return m


def test_runtime_runs_completions_concurrently_with_the_same_tokens(fixture, batching_runtime):
    _, prompts, expected = fixture
    rt = batching_runtime
    m = _complete_concurrently(rt, prompts, expected, ["short", "len70", "chat", "random100", "len128"])
    assert m["running"] == 0  # 5 = 3 running + 2 queued, all over
    assert rt.status()["parallel"] == 3


def test_runtime_refuses_past_the_queue_with_queue_full(fixture, batching_runtime):
    _, prompts, _ = fixture
    rt = batching_runtime
    handles = [rt.complete(prompts["short"], greedy_params(max_tokens=400)) for _ in range(5)]
    with pytest.raises(QueueFull) as info:
        rt.complete(prompts["short"], greedy_params(max_tokens=2))
    assert info.value.retry_after >= 1
    deadline = time.time() + 10
    while rt.status()["queued"] != 2 and time.time() < deadline:
        time.sleep(0.02)
    status = rt.status()
    assert status["busy"] and status["queued"] == 2  # 3 generating, 2 waiting for a slot
    for h in handles:
        h.cancel()
    for h in handles:
        assert h.wait(30).kind in ("cancelled", "done")
    # the slots are free again
    assert rt.complete(prompts["short"], greedy_params(max_tokens=2)).wait(30).kind == "done"


def test_runtime_conversation_reuses_its_session_and_one_offs_share_the_cache(fixture, batching_runtime):
    _, prompts, _ = fixture
    rt = batching_runtime
    long_prompt = prompts["len300"]
    first = rt.complete(long_prompt, greedy_params(max_tokens=2)).wait(30)
    again = rt.complete(long_prompt + [5, 6], greedy_params(max_tokens=2)).wait(30)
    assert first.kind == again.kind == "done"
    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens == 256  # the prefix cache's last 128-token boundary before 302
    conv = [rt.complete(long_prompt[:100], greedy_params(max_tokens=2), conversation_id="c").wait(30),
            rt.complete(long_prompt[:150], greedy_params(max_tokens=2), conversation_id="c").wait(30)]
    assert conv[1].usage.cached_tokens >= 100  # the conversation's own session kept its history


def test_runtime_changes_its_parallelism_with_the_model_loaded(fixture, fixtures_dir):
    """What the app's server switch does: a runtime loaded one-at-a-time starts batching when asked
    (the same tokens, passes really shared), a conversation keeps working across the change, and going
    back to one at a time lets the batched generation then running finish first, the model still
    loaded."""
    from minecart.engine.runtime import Runtime

    _, prompts, expected = fixture
    with Runtime(sample_memory_s=0) as rt:
        rt.load(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", devices=["cpu:0"]).result(60)
        assert rt.batching_metrics() is None and rt.status()["parallel"] == 1
        before = rt.complete(prompts["chat"], greedy_params(max_tokens=2), conversation_id="c").wait(30)
        assert before.kind == "done"
        with pytest.raises(ValueError, match="at least 1"):
            rt.set_parallel(0)
        changed = rt.set_parallel(3, max_queue=4).wait(30)
        assert changed.kind == "done" and changed.data == {"parallel": 3, "max_queue": 4}
        assert rt.status()["parallel"] == 3
        _complete_concurrently(rt, prompts, expected, ["short", "len70", "chat", "random100"])
        # the conversation goes on, now in a session of the scheduler's
        again = rt.complete(prompts["chat"] + [5, 6], greedy_params(max_tokens=2), conversation_id="c").wait(30)
        assert again.kind == "done"
        # back to one at a time while a batched generation runs: it finishes first, the model stays
        long = rt.complete(prompts["short"], greedy_params(max_tokens=200))
        deadline = time.time() + 10
        while not any(ev.kind == "token" for ev in [long.poll()] if ev) and time.time() < deadline:
            time.sleep(0.01)
        back = rt.set_parallel(1)
        assert back.wait(30).kind == "done"
        assert long.wait(0).kind == "done"  # already over when the change was: it finished first
        assert long.final is not None and long.final.usage.completion_tokens > 1
        assert rt.batching_metrics() is None and rt.loaded
        tokens = [ev.generation.token for ev in rt.complete(prompts["len70"], greedy_params(max_tokens=MAX_TOKENS))
                  .events(30) if ev.kind == "token" and ev.generation]
        assert tokens == expected["len70"][0]


def _capped_runtime(fixtures_dir, cap: str, parallel: int):
    from minecart.engine.rig import Rig
    from minecart.engine.runtime import Runtime

    rig = Rig.parse(f"cpu:0={cap}")
    rt = Runtime(sample_memory_s=0, parallel=parallel)
    loaded = rt.load(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", devices=rig, context=4096).wait(60)
    assert loaded.kind == "done", loaded.text
    return rt, rig


def test_a_request_waits_for_memory_instead_of_failing(fixture, fixtures_dir):
    """A card with room for two sessions' KV caches (a simulated 12 MiB cap, 4,096-token context) and
    3 requests at once: the third, started while the first two run, waits for one of them to end
    and then answers with the tokens it gives alone (it used to fail with out of memory)."""
    _, prompts, expected = fixture
    rt, rig = _capped_runtime(fixtures_dir, "12MiB", 3)
    with rt:
        running = [rt.complete(prompts[n], greedy_params(max_tokens=150)) for n in ("short", "single")]
        for h in running:  # both hold their sessions
            first = h.get(30)
            while first.kind != "token":
                first = h.get(30)
        third = rt.complete(prompts["len70"], greedy_params(max_tokens=MAX_TOKENS))
        tokens = [ev.generation.token for ev in third.events(60) if ev.kind == "token" and ev.generation]
        assert third.final is not None and third.final.kind == "done", third.final
        assert tokens == expected["len70"][0]
        assert all(h.wait(60).kind == "done" for h in running)
        m = rt.batching_metrics()
        assert m is not None and m["memory_waits"] >= 1, m
        assert rig.backend("cpu:0").peak_bytes <= 12 * 2**20


def test_a_request_that_cannot_fit_even_alone_says_what_to_lower(fixture, fixtures_dir):
    _, prompts, _ = fixture
    rt, rig = _capped_runtime(fixtures_dir, "12MiB", 2)
    with rt:
        loaded = rig.backend("cpu:0").used_bytes  # what the model itself holds
    rt, rig = _capped_runtime(fixtures_dir, f"{loaded + 2**20}B", 2)  # the model fits, a session does not
    with rt:
        used = rig.backend("cpu:0").used_bytes
        final = rt.complete(prompts["short"], greedy_params(max_tokens=4)).wait(30)
        assert final.kind == "error"
        assert "out of memory" in final.text and "Requests at once" in final.text, final.text
        # two at once that both find no room do not wait for each other: both are told, at once
        both = [rt.complete(prompts[n], greedy_params(max_tokens=4)) for n in ("short", "single")]
        assert [h.wait(30).kind for h in both] == ["error", "error"]
        assert rig.backend("cpu:0").used_bytes == used  # nothing of the failed session stayed charged
        assert rt.loaded  # the model and the runtime carry on


def test_a_stream_closed_unread_gives_its_place_up(fixture):
    model, prompts, _ = fixture
    sched = Scheduler(model, parallel=1, max_queue=2)
    try:
        first = sched.generate(prompts["short"], greedy_params(max_tokens=3))
        never_read = sched.generate(prompts["short"], greedy_params(max_tokens=3))
        dropped = sched.generate(prompts["short"], greedy_params(max_tokens=3))
        assert sched.metrics()["queue_depth"] == 3
        never_read.close()
        del dropped  # garbage: the place goes too
        assert sched.metrics()["queue_depth"] == 1
        assert list(first)[-1].finish_reason == "length"  # nobody queued ahead of it any more
    finally:
        sched.close()


def test_prompt_with_embedding_rows_prefills_through_the_scheduler(fixture):
    """Rows given as embeddings (pictures) with (3, T) positions run chunk by chunk through the
    scheduler alone (not stacked) and give the logits of the model's own session."""
    model, prompts, _ = fixture
    ids = prompts["len70"]
    rng = np.random.default_rng(5)
    rows = np.arange(10, 22)
    values = rng.standard_normal((len(rows), model.config.hidden)).astype(np.float32)
    pos = np.stack([np.arange(len(ids))] * 3)
    pos[1, 10:22] = 10 + np.arange(12) // 4  # distinct (h, w) inside the picture
    pos[2, 10:22] = 10 + np.arange(12) % 4
    alone = model.new_session()
    expected = alone.prefill(ids, positions=pos, embed_override=(rows, values))
    sched = Scheduler(model, parallel=2, chunk=16)
    try:
        session = sched.new_session()
        got = session.prefill(ids, positions=pos, embed_override=(rows, values))
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * float(np.abs(expected).max()))
        assert sched.metrics()["prefill_tokens"] == len(ids)
        step = session.step(5)  # the state the chunks left behind continues like the session's
        np.testing.assert_allclose(step, alone.step(5), rtol=0, atol=1e-4 * float(np.abs(step).max()))
        session.close()
    finally:
        alone.close()
        sched.close()


def test_runtime_unload_ends_batched_generations_cancelled(fixture, fixtures_dir):
    from minecart.engine.runtime import Runtime

    _, prompts, _ = fixture
    rt = Runtime(sample_memory_s=0, parallel=2, max_queue=2)
    try:
        rt.load(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", devices=["cpu:0"]).result(60)
        handles = [rt.complete(prompts["short"], greedy_params(max_tokens=5000)) for _ in range(3)]
        deadline = time.time() + 10
        while not rt.status()["busy"] and time.time() < deadline:
            time.sleep(0.02)
        assert rt.unload().wait(30).kind == "done"
        assert [h.wait(30).kind for h in handles] == ["cancelled"] * 3
        assert rt.batching_metrics() is None and not rt.loaded
    finally:
        rt.close()
