"""The generate loop and sessions.

Part 1 (nanochat style): a scripted fake model and a byte tokenizer, to test text streaming, UTF-8
hold-back, stop strings, end tokens, max tokens and cancellation without any real model.
Part 2: sessions on the real fixture model: prefix reuse across turns, regenerate from a snapshot,
edit-and-resend, truncate, fork, restore; every reused state checked against a fresh computation.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from minecart.engine.generation import GenerationEvent, StopStrings, TextStream, generate
from minecart.engine.model import load_model
from minecart.engine.sampling import (
    LaunchedStep,
    Sampler,
    SamplingParams,
    TopLogits,
    apply_penalties,
    draw_from_top,
    greedy_params,
    top_logits,
)
from minecart.engine.session import Session

EOS = 256


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is the end-of-turn token (decodes to nothing)."""

    eos_ids = (EOS,)

    def encode(self, text, add_special=False):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class ScriptedSession:
    """Emits the scripted tokens in order (one-hot logits), whatever it is fed."""

    def __init__(self, script, delay=0.0):
        self.script = list(script)
        self.delay = delay
        self.tokens: list[int] = []
        self.computed_tokens = 0
        self.checkpoints = 0
        self._i = 0

    def _logits(self):
        row = np.zeros(EOS + 1, np.float32)
        row[self.script[min(self._i, len(self.script) - 1)]] = 10.0
        self._i += 1
        return row

    def sync(self, ids, chunk=None, cancel=None):
        self.tokens = list(ids)
        self.computed_tokens = len(ids)
        return self._logits()

    def launch_step(self, token, top=0, pick=None):  # whole rows whatever `top` asks: a sampler takes either
        time.sleep(self.delay)
        self.tokens.append(token)
        return LaunchedStep.done(self._logits())

    def launch_next(self, prev, top, pick):  # no device to feed a pick to the next step
        return None

    def checkpoint(self):
        self.checkpoints += 1

    limit = 8192  # the context limit of a session (engine.session.Session.limit)


class ScriptedModel:
    """The part of engine.model.Model that generate uses, with a scripted session."""

    is_base_model = False
    vision = None
    placement = None  # no plan: the context limit is the trained context (engine.session.context_limit)

    def __init__(self, script, delay=0.0):
        self.tokenizer = ByteTokenizer()
        self.chat_template = None
        self.config = SimpleNamespace(context_length=0, vocab_size=256)  # the byte tokenizer's ids
        self.path = Path("scripted.gguf")
        self.session = ScriptedSession(script, delay)

    def new_session(self):
        return self.session


def _run(text, **params):
    model = ScriptedModel(list(text.encode("utf-8")) + [EOS])
    events = list(generate(model, [1, 2, 3], greedy_params(**params)))
    return events, model


def test_text_stream_and_end_token():
    events, model = _run("Hello, world")
    assert "".join(e.text for e in events) == "Hello, world"
    assert [e.finish_reason for e in events[:-1]] == [None] * 12
    last = events[-1]
    assert last.token == EOS and last.text == "" and last.finish_reason == "stop"
    assert last.generated_tokens == 13 and last.prompt_tokens == 3 and last.cached_tokens == 0
    assert isinstance(last, GenerationEvent) and last.elapsed > 0
    assert model.session.tokens == [1, 2, 3] + list(b"Hello, world")  # the end token is not fed
    assert model.session.checkpoints >= 2  # after the prompt and at the end


def test_utf8_is_held_until_complete():
    text = "héllo 😀 ok"
    events, _ = _run(text)
    assert "".join(e.text for e in events) == text
    assert not any("\ufffd" in e.text for e in events)
    assert sum(1 for e in events if e.text == "") >= 3  # continuation bytes emit nothing yet


def test_stop_string_cut_and_hold_back():
    events, _ = _run("abc STOP def", stop=["STOP"])
    assert "".join(e.text for e in events) == "abc "
    assert events[-1].finish_reason == "stop" and events[-1].token == ord("P")
    # the partial "S", "ST", "STO" were never shown before the match
    shown = ""
    for e in events[:-1]:
        shown += e.text
        assert "S" not in shown
    # a near miss is released
    events, _ = _run("a STOx STOP", stop=["STOP", "xyz"])
    assert "".join(e.text for e in events) == "a STOx "


def test_held_text_released_at_the_end():
    events, _ = _run("tail ST", stop=["STOP"])
    assert "".join(e.text for e in events) == "tail ST"
    assert events[-1].finish_reason == "stop" and events[-1].token == EOS


def test_max_tokens_and_stop_token_ids():
    events, _ = _run("abcdefgh", max_tokens=5)
    assert len(events) == 5 and events[-1].finish_reason == "length"
    assert "".join(e.text for e in events) == "abcde"
    events, _ = _run("abcdefgh", stop_token_ids=[ord("d")])
    assert "".join(e.text for e in events) == "abc" and events[-1].token == ord("d")
    events, _ = _run("abc", max_tokens=0)
    assert len(events) == 1 and events[0].finish_reason == "length" and events[0].token is None


def test_cancel_takes_effect_within_one_token():
    model = ScriptedModel([ord("x")] * 10_000)
    cancel = threading.Event()
    events = []
    for ev in generate(model, [1], greedy_params(max_tokens=10_000), cancel=cancel):
        events.append(ev)
        if len(events) == 5:
            cancel.set()
    assert len(events) == 6
    assert events[-1].finish_reason == "cancelled" and events[-1].token is None
    assert events[-1].generated_tokens == 5


class LaunchLog(ScriptedSession):
    """A scripted session whose launched steps finish only when their result is taken, logging both."""

    def __init__(self, script, log):
        super().__init__(script)
        self.log = log

    def launch_step(self, token, top=0, pick=None):
        self.tokens.append(token)
        n = len(self.tokens)
        self.log.append(("launch", n))

        def finish():
            self.log.append(("result", n))
            return self._logits()

        return LaunchedStep(finish)


def test_the_next_step_runs_while_the_consumer_has_the_token():
    """generate launches the step of a token before handing the token's event out and takes its
    result after: the device computes while the consumer shows or sends the token. The steps are the
    ones stepping afterwards would run (no step for the last token), and a cancel settles the launched
    step before the loop ends."""
    log = []
    model = ScriptedModel([ord("a")] * 5 + [EOS])
    model.session = LaunchLog([ord("a")] * 5 + [EOS], log)
    for ev in generate(model, [1], greedy_params()):
        log.append(("event", ev.generated_tokens))
    prompt = 1  # the session holds the prompt token first
    want = []
    for i in range(1, 6):
        want += [("launch", prompt + i), ("event", i), ("result", prompt + i)]
    assert log == want + [("event", 6)]  # the end token is not stepped
    assert model.session.tokens == [1] + [ord("a")] * 5

    log.clear()
    cancel = threading.Event()
    model.session = LaunchLog([ord("b")] * 100, log)
    for ev in generate(model, [1], greedy_params(max_tokens=100), cancel=cancel):
        log.append(("event", ev.finish_reason))
        if len(model.session.tokens) == 3:
            cancel.set()
    assert log[-3:] == [("event", None), ("result", 3), ("event", "cancelled")]


class ChainModel:
    """A model under a real Session whose logits after token t are 10 - j / 8 at ids (7 t + 3 + 13 j) %
    256 for j < 64 (far below elsewhere): the greedy pick is (7 t + 3) % 256. The launches are a
    device's: launch_decode's and launch_next's steps finish only when waited for, a step launched with
    a PickSpec draws its pick as the device does (draw_from_top), after the spec's penalties over the
    whole row when it has a history (the device's table: the history and the token the step embeds), and
    a launch_next step knows its token only as that pick of the step launched before it."""

    is_base_model = False
    vision = None
    placement = None
    chat_template = None

    def __init__(self, chain=True):
        self.tokenizer = ByteTokenizer()
        self.config = SimpleNamespace(context_length=0, vocab_size=EOS + 1)
        self.path = Path("chain.gguf")
        self.chain = chain
        self.launched: list[int] = []  # the token of each launch, as the device would see it
        self.fed: int | None = None  # the device's pick of the last launch (None: launched without one)
        self.chained = 0
        self.waits: list[int] = []  # the token of each step whose result was taken
        self.penalized = 0  # steps that applied a PickSpec's penalties

    @staticmethod
    def pick(t):
        return (7 * t + 3) % 256

    @staticmethod
    def top(token):
        return np.array([10.0 - j / 8 for j in range(64)], np.float32), \
            np.array([(7 * token + 3 + 13 * j) % 256 for j in range(64)], np.int32)

    def _row(self, token, top, pick=None, fed=None):
        vals, ids = self.top(token)
        row = np.full((1, EOS + 1), -30.0, np.float32)
        row[0, ids] = vals
        if pick is not None and pick.history is not None and not self.chain:
            pick = None  # a device without the penalty table: raw top logits, the host penalizes them
        if top and pick is not None and pick.history is not None:
            h = pick.history
            prm = SamplingParams(repetition_penalty=pick.repetition, presence_penalty=pick.presence,
                                 frequency_penalty=pick.frequency)
            generated = list(h.generated) + ([] if fed is None else [fed])
            vals, ids = top_logits(apply_penalties(row[0], prm, h.prompt_ids, generated), top)
            picks = np.array([draw_from_top(vals[0], ids[0], pick)])
            self.fed = int(picks[0])
            self.penalized += 1
            return TopLogits(vals, ids, picks=picks, penalized=True)
        if top:
            picks = None if pick is None else np.array([draw_from_top(vals[:top], ids[:top], pick)])
            self.fed = None if picks is None else int(picks[0])
            return TopLogits(vals[None, :top], ids[None, :top], picks=picks)
        return row

    def new_state(self, capacity=None):
        return []

    def new_session(self, capacity=None):
        return Session(self, capacity=64)

    def _free_states(self, states):
        pass

    def forward(self, ids, states, positions, **kw):
        return self._row(ids[-1], kw.get("top", 0))

    def _launch(self, token, top, pick, fed=None):
        self.launched.append(token)
        row = self._row(token, top, pick, fed)  # what the device computes, the pick it feeds on included

        def finish():
            self.waits.append(token)
            return row

        return LaunchedStep(finish)

    def launch_decode(self, token, states, positions, top=0, pick=None):
        return self._launch(token, top, pick)

    def launch_next(self, states, positions, top, pick):
        if not self.chain or self.fed is None:
            return None
        self.chained += 1
        return self._launch(self.fed, top, pick, fed=self.fed)


def test_greedy_steps_are_chained_and_the_session_fills_in_their_tokens():
    """Picking greedily, generate launches the step of the next pick behind the step of this token
    (Session.launch_next), before the host has that pick: the tokens are the ones stepping one at a
    time gives, the session's history holds each pick once its step before is waited for, and the last
    token (max_tokens) gets no step of its own."""
    want = [5]
    for _ in range(12):
        want.append(ChainModel.pick(want[-1]))
    runs = {}
    for chain in (True, False):
        model = ChainModel(chain)
        session = model.new_session()
        events = list(generate(model, [5], greedy_params(max_tokens=12), session=session))
        runs[chain] = (model, session, [e.token for e in events])
    (on, s_on, got_on), (off, s_off, got_off) = runs[True], runs[False]
    assert got_on == got_off == want[1:]
    assert s_on.tokens == s_off.tokens == want[:12]  # the 12th token is not stepped
    assert on.launched == off.launched == want[1:12] and on.waits == want[1:12]  # the prompt: forward
    assert on.chained == 10 and off.chained == 0  # every step but the first
    s_on.close()
    s_off.close()
    # an end token seen while its own step runs already: that step is waited for before generate ends
    model = ChainModel(True)
    session = model.new_session()
    events = list(generate(model, [5], greedy_params(max_tokens=12, stop_token_ids=[want[6]]), session=session))
    assert events[-1].finish_reason == "stop" and events[-1].token == want[6]
    assert session.tokens == want[:7] and model.waits == want[1:7]  # one step past the answer
    session.close()


def test_sampled_steps_are_chained_with_the_samplers_own_draws():
    """Sampling with top-k (no penalties) chains too: each step is launched with the PickSpec of the
    pick it makes (its uniform number drawn ahead in the sampler's own stream), the device's picks are
    fed on, and a seeded generation gives the tokens of the same generation with every pick made on
    the host."""
    params = SamplingParams(temperature=1.0, top_k=8, top_p=0.95, min_p=0.01, seed=7, max_tokens=30)
    runs = {}
    for chain in (True, False):
        model = ChainModel(chain)
        session = model.new_session()
        events = list(generate(model, [5], params, session=session))
        runs[chain] = (model, session, [e.token for e in events])
        session.close()
    (on, s_on, got_on), (off, s_off, got_off) = runs[True], runs[False]
    assert got_on == got_off and len(got_on) == 30
    assert len({t for t in got_on}) > 1 and got_on != [ChainModel.pick(t) for t in [5] + got_on[:-1]]
    assert s_on.tokens == s_off.tokens
    assert on.chained == 28 and off.chained == 0
    for seed in (8, 9):  # another seed draws other tokens: the picks are draws
        other = list(generate(ChainModel(True), [5], SamplingParams(**{**params.__dict__, "seed": seed})))
        if [e.token for e in other] != got_on:
            break
    else:
        raise AssertionError("three seeds drew the same 30 tokens")


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=8, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.4,
                   frequency_penalty=0.3, seed=5, max_tokens=40),
    greedy_params(repetition_penalty=2.0, frequency_penalty=1.0, max_tokens=40),
])
def test_penalized_steps_are_chained_with_the_penalties_on_the_device(params):
    """With penalties the device applies them (PickSpec.history): each step penalizes its row with the
    sampler's history and the token it embeds, draws its pick, and the next step is chained on it; the
    tokens are those of the same seed with every pick made on the host from raw top logits (which
    penalizes them itself). The penalties change the answer (the unpenalized greedy text is the
    chain 5 -> (7 t + 3) % 256), and a sampler without a vocabulary (no device table) does not chain."""
    runs = {}
    prompt = [*range(100, 180), 5, 38]  # many ids the chain's picks come back to
    for chain in (True, False):
        model = ChainModel(chain)
        session = model.new_session()
        events = list(generate(model, prompt, params, session=session))
        runs[chain] = (model, [e.token for e in events])
        session.close()
    (on, got_on), (off, got_off) = runs[True], runs[False]
    assert got_on == got_off and len(got_on) == 40
    assert on.chained == 38 and on.penalized == 39 and off.chained == off.penalized == 0
    assert got_on != [ChainModel.pick(t) for t in [38] + got_on[:-1]]  # the penalties decided picks
    assert Sampler(params, prompt, vocab=EOS + 1).chains and not Sampler(params, prompt).chains


def test_cancel_from_another_thread():
    model = ScriptedModel([ord("y")] * 100_000, delay=0.002)
    cancel = threading.Event()
    timer = threading.Timer(0.2, cancel.set)
    timer.start()
    t0 = time.perf_counter()
    events = list(generate(model, [1], greedy_params(max_tokens=100_000), cancel=cancel))
    assert time.perf_counter() - t0 < 5.0
    assert events[-1].finish_reason == "cancelled"
    assert 10 < len(events) < 100_000
    cancel2 = threading.Event()
    cancel2.set()
    events = list(generate(ScriptedModel([1]), [1], greedy_params(), cancel=cancel2))
    assert [e.finish_reason for e in events] == ["cancelled"]


def test_stop_strings_helper_multiple():
    s = StopStrings(["</a>", "##"])
    assert s.feed("x</") == ("x", False)
    assert s.feed("b>#") == ("</b>", False)
    assert s.feed("#rest") == ("", True)


def test_text_stream_flush_incomplete():
    ts = TextStream(ByteTokenizer().decode)
    assert ts.add(0xE2) == "" and ts.add(0x82) == ""
    assert ts.flush() == "\ufffd"


# ---------------------------------------------------------------------------------------------------
# sessions on the real fixture model


@pytest.fixture(scope="module")
def model(fixtures_dir):
    m = load_model(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", devices=["cpu:0"])
    yield m
    m.close()


def _fresh_last_logits(model, ids):
    s = model.new_session()
    out = s.prefill(ids)
    s.close()
    return out


def _close(a, b, tol=1e-4):
    return np.linalg.norm(a - b) / np.linalg.norm(b) < tol


def _greedy(model, ids, session, n=6):
    events = list(model.generate(ids, greedy_params(max_tokens=n), session=session))
    return [e.token for e in events], events[-1]


def test_multi_turn_prefix_reuse_regenerate_and_edit(model):
    rng = np.random.default_rng(0)
    turn1 = [int(t) for t in rng.integers(0, 248000, 40)]
    session = model.new_session()
    out1, last = _greedy(model, turn1, session)
    assert last.cached_tokens == 0 and last.prompt_tokens == 40
    fed = session.tokens[:]  # prompt + the generated tokens that were fed back (all but the last)
    assert fed == turn1 + out1[:-1]

    # next turn: the whole history plus new user tokens -> only the new tokens are computed
    user2 = [int(t) for t in rng.integers(0, 248000, 12)]
    turn2 = fed + [out1[-1]] + user2
    out2, last = _greedy(model, turn2, session)
    assert last.cached_tokens == len(fed)
    # the session's state is the history's: its next step's row equals a fresh run of history + token
    # (its last_logits are None: the answer's steps returned only their largest logit, greedy)
    assert session.last_logits is None
    twin = session.fork()
    assert _close(twin.step(out2[-1]), _fresh_last_logits(model, session.tokens + [out2[-1]]))
    twin.close()
    fresh_session = model.new_session()
    assert _greedy(model, turn2, fresh_session)[0] == out2

    # regenerate: the same prompt again -> nothing recomputed (snapshot with logits), same tokens
    again, last = _greedy(model, turn2, session)
    assert last.cached_tokens == len(turn2) and again == out2

    # edit-and-resend the second user message: resumes from the end-of-turn-1 snapshot
    edited = fed + [out1[-1]] + user2[:5] + [7, 8, 9]
    out3, last = _greedy(model, edited, session)
    assert last.cached_tokens == len(fed)
    assert out3 == _greedy(model, edited, model.new_session())[0]


def test_truncate_fork_restore(model):
    rng = np.random.default_rng(1)
    ids = [int(t) for t in rng.integers(0, 248000, 50)]
    s = model.new_session()
    s.prefill(ids[:20])
    s.checkpoint()
    s.prefill(ids[20:])
    twin = s.fork()
    # truncate to a point after the snapshot: restore + re-prefill 10 known tokens
    s.truncate(30)
    assert s.tokens == ids[:30] and s.position == 30
    assert _close(s.step(5), _fresh_last_logits(model, ids[:30] + [5]))
    # truncate before any snapshot: recomputed from zero state
    s.truncate(7)
    assert _close(s.step(6), _fresh_last_logits(model, ids[:7] + [6]))
    # the fork was untouched by all of this
    assert twin.tokens == ids and _close(twin.step(4), _fresh_last_logits(model, ids + [4]))
    # a snapshot whose tokens are no longer a prefix cannot be restored
    snap = twin.snapshot()
    twin.truncate(10)
    twin.prefill([1, 2, 3])
    with pytest.raises(ValueError):
        twin.restore(snap)
    s.close()
    twin.close()


def test_logits_fresh_state_and_session_agree(model):
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    full = model.logits(ids)
    s = model.new_session()
    for t in ids:
        row = s.step(t)
    assert _close(row, full[-1])
    assert s.position == len(ids) and s.n_tokens == len(ids)
    s.close()


def test_a_launched_step_is_a_step_and_settles_before_the_session_is_used(model):
    """Session.launch_step appends the token at once and its result is step()'s; any other use of the
    session (a snapshot here) waits for a launched step first, and a second launch needs no result of
    the first (the NumPy backend computes at launch: the device path is tests/gpu/test_model.py)."""
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    a, b = model.new_session(), model.new_session()
    a.prefill(ids[:4])
    b.prefill(ids[:4])
    for t in ids[4:]:
        launched = b.launch_step(t, top=3)
        assert b.tokens[-1] == t and b.position == a.position + 1
        want = a.step(t, top=3)
        got = launched.result()
        np.testing.assert_array_equal(got.ids, want.ids)
        np.testing.assert_array_equal(got.values, want.values)
    b.launch_step(7)
    snap = b.snapshot()  # settles the launched step
    assert snap.n_tokens == len(ids) + 1 and b.last_logits is not None
    assert _close(b.last_logits, a.step(7))
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------------
# loading: progress, cancel, devices


def test_load_progress_and_cancel_leave_nothing_loaded(fixtures_dir):
    from minecart.engine.backends.numpy_backend import NumpyBackend
    from minecart.engine.errors import GenerationCancelled

    class CountingBackend(NumpyBackend):
        def __init__(self):
            super().__init__()
            self.live = set()

        def load_weight(self, info, *, role="matmul"):
            wt = super().load_weight(info, role=role)
            self.live.add(id(wt))
            return wt

        def free(self, obj):
            self.live.discard(id(obj))

    path = fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf"
    seen = []
    be = CountingBackend()
    m = load_model(path, backend=be, progress=lambda f, msg: seen.append((f, msg)))
    fractions = [f for f, _ in seen]
    assert fractions[0] == 0.0 and fractions[-1] == 1.0 and fractions == sorted(fractions)
    assert len(be.live) > 50
    m.close()
    assert not be.live

    cancel = threading.Event()
    be = CountingBackend()

    def progress(fraction, message):
        if fraction > 0.3:
            cancel.set()

    with pytest.raises(GenerationCancelled):
        load_model(path, backend=be, progress=progress, cancel=cancel)
    assert not be.live  # everything loaded before the cancel was released


def test_cuda_device_without_cupy_is_a_clear_error(fixtures_dir):
    from minecart.engine import execution as model_mod
    from minecart.engine.errors import DeviceError

    if model_mod._cupy_backend_module() is not None:
        pytest.skip("the CuPy backend imports here; tests/gpu covers it")
    with pytest.raises(DeviceError, match="cuda:0"):
        load_model(fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf", devices=["cuda:0"])
    assert model_mod.default_devices() == ["cpu:0"]


def test_chat_messages_end_to_end(model, fixtures_dir):
    """Messages -> the GGUF's chat template -> tokenizer -> the fixture's `chat` ids -> the reference
    greedy continuation, with text streamed through the real tokenizer."""
    import json

    if model.tokenizer is None or model.chat_template is None:
        pytest.skip("tokenizer / chat template modules not available")
    seqs = json.loads((fixtures_dir / "sequences.json").read_text())
    chat_ids = next(s["ids"] for s in seqs["sequences"] if s["name"] == "chat")
    ref = np.load(fixtures_dir / "dense" / "ref_hf" / "chat.npz")
    messages = seqs["chat_messages"]
    events = list(model.generate(messages, greedy_params(max_tokens=32)))
    assert events[-1].prompt_tokens == len(chat_ids)
    assert [e.token for e in events] == list(ref["gen_tokens"])
    assert "".join(e.text for e in events) == model.tokenizer.decode(list(ref["gen_tokens"]))
    # the same continuation cut by a stop string that the real tokenizer's text completes
    stop = model.tokenizer.decode(list(ref["gen_tokens"][:3]))
    events = list(model.generate(messages, greedy_params(max_tokens=32, stop=[stop])))
    assert events[-1].finish_reason == "stop" and len(events) == 3
    assert "".join(e.text for e in events) == ""
