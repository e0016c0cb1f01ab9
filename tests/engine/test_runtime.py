"""Runtime: one worker thread owns the model; requests queue up, events stream back, cancel works.

Uses the fake model in fake_chat_model.py (scripted replies, records threads and sessions); an end-to-end
test on the fixture GGUF runs the real engine through the same runtime.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from minecart.engine.chat_template import prompt_opens_thinking
from minecart.engine.errors import GGUFError, RequestError
from minecart.engine.runtime import Runtime, ThinkingSplitter
from minecart.engine.sampling import greedy_params

from tests.engine.fake_chat_model import FakeModel, fake_loader

TIMEOUT = 10.0


_made: list[Runtime] = []


@pytest.fixture(autouse=True)
def _close_runtimes():
    """Every runtime a test makes with make_runtime is closed after it, pass or fail."""
    yield
    while _made:
        _made.pop().close()


def make_runtime(model=None, **loader_kwargs):
    loader = fake_loader(model, **loader_kwargs)
    rt = Runtime(loader=loader, sample_memory_s=0)
    _made.append(rt)
    return rt, loader


def loaded_runtime(model=None):
    rt, loader = make_runtime(model)
    rt.load("fake.gguf", devices=["cpu"]).result(TIMEOUT)
    return rt, loader.made[-1]


def collect(handle):
    events = list(handle.events(TIMEOUT))
    answer = "".join(e.text for e in events if e.kind == "token")
    thinking = "".join(e.thinking for e in events if e.kind == "token")
    return events, thinking, answer


def test_load_reports_progress_then_done():
    rt, loader = make_runtime(progress_steps=5)
    events = list(rt.load("some/model.gguf", devices=["cpu"]).events(TIMEOUT))
    kinds = [e.kind for e in events]
    assert kinds[0] == "started" and kinds[-1] == "done"
    fractions = [e.fraction for e in events if e.kind == "progress"]
    assert fractions == [0.2, 0.4, 0.6, 0.8, 1.0, 1.0]  # the last: building the tokenizer
    assert [e.text for e in events if e.kind == "progress"][0] == "layer 0"
    info = events[-1].data["model"]
    assert info.name == "fake-chat" and info.devices == ("cpu",)
    assert rt.model_info is info and rt.loaded


def test_chat_streams_thinking_and_answer_with_usage():
    rt, model = loaded_runtime()
    handle = rt.chat([{"role": "user", "content": "hi"}], greedy_params(), enable_thinking=True)
    events, thinking, answer = collect(handle)
    assert thinking == "I should echo.\n"
    prompt = model.prompts[-1]
    assert answer == f"echo[{len(prompt)}]"
    final = events[-1]
    assert final.kind == "done" and final.finish_reason == "stop"
    assert final.usage.prompt_tokens == len(prompt)
    assert final.usage.completion_tokens == len(model.reply(prompt, True))
    timing = final.data["timing"]
    assert timing.generated_tokens == final.usage.completion_tokens
    assert timing.queue_wait_s >= 0 and timing.prefill_s >= 0
    assert rt.metrics.requests()[-1] == timing
    # generation happened on the runtime's thread, never the caller's
    assert threading.get_ident() not in model.generate_threads
    assert len(model.generate_threads) == 1


def test_no_think_gives_answer_only():
    rt, model = loaded_runtime()
    events, thinking, answer = collect(
        rt.chat([{"role": "user", "content": "hi"}], greedy_params(), enable_thinking=False)
    )
    assert thinking == ""
    assert answer == f"echo[{len(model.prompts[-1])}]"
    assert "<think>" not in model.prompts[-1]


def test_conversation_reuses_its_session_and_one_offs_do_not():
    rt, model = loaded_runtime()
    msgs = [{"role": "user", "content": "first question"}]
    rt.chat(msgs, greedy_params(), conversation_id="c1", enable_thinking=False).result(TIMEOUT)
    first_answer = model.reply(model.prompts[-1], False)
    msgs = msgs + [
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": "second"},
    ]
    made_before = model.sessions_made
    rt.chat(msgs, greedy_params(), conversation_id="c1", enable_thinking=False).result(TIMEOUT)
    assert model.sessions_made == made_before  # same session object came back
    # the fake session reports how many prompt tokens matched its cache
    rt.chat(msgs, greedy_params(), enable_thinking=False).result(TIMEOUT)
    assert model.sessions_made == made_before + 1
    rt.forget("c1").result(TIMEOUT)
    rt.chat(msgs, greedy_params(), conversation_id="c1", enable_thinking=False).result(TIMEOUT)
    assert model.sessions_made == made_before + 2


def test_session_prefix_is_reused_across_turns():
    rt, model = loaded_runtime()
    sessions = []
    original = model.new_session

    def tracking():
        s = original()
        sessions.append(s)
        return s

    model.new_session = tracking
    msgs = [{"role": "user", "content": "hello there"}]
    rt.chat(msgs, greedy_params(), conversation_id=7, enable_thinking=False).result(TIMEOUT)
    msgs += [{"role": "assistant", "content": model.reply(model.prompts[-1], False)}]
    msgs += [{"role": "user", "content": "more"}]
    rt.chat(msgs, greedy_params(), conversation_id=7, enable_thinking=False).result(TIMEOUT)
    (session,) = sessions
    assert session.reused[0] == 0
    # turn two starts with turn one's prompt + answer: all of it comes from the cache
    assert session.reused[1] > len(model.prompts[0])


def test_sessions_are_closed_when_evicted_forgotten_or_one_off():
    rt, loader = make_runtime()
    rt.max_sessions = 2
    rt.load("fake.gguf").result(TIMEOUT)
    model = loader.made[-1]
    sessions = []
    original = model.new_session
    model.new_session = lambda: sessions.append(original()) or sessions[-1]
    msgs = [{"role": "user", "content": "x"}]
    for conv in ("a", "b", "c"):  # "a" is evicted when "c" arrives
        rt.chat(msgs, greedy_params(), conversation_id=conv).result(TIMEOUT)
    assert [s.closed for s in sessions] == [True, False, False]
    rt.forget("b").result(TIMEOUT)
    assert sessions[1].closed and not sessions[2].closed
    rt.chat(msgs, greedy_params()).result(TIMEOUT)  # no conversation: its session is not kept
    assert sessions[3].closed and rt.status()["sessions"] == 1
    rt.unload().result(TIMEOUT)
    assert all(s.closed for s in sessions)


def test_cancel_while_generating_is_prompt_and_leaves_session_usable():
    model = FakeModel(reply=lambda p, t: "x" * 2000, delay_s=0.005)
    rt, model = loaded_runtime(model)
    handle = rt.chat([{"role": "user", "content": "go"}], greedy_params(max_tokens=5000),
                     conversation_id="c", enable_thinking=False)
    first = None
    for ev in handle.events(TIMEOUT):
        if ev.kind == "token":
            first = ev
            break
    assert first is not None
    t0 = time.monotonic()
    handle.cancel()
    final = handle.wait(TIMEOUT)
    assert final.kind == "cancelled"
    assert time.monotonic() - t0 < 2.0
    assert 0 < final.usage.completion_tokens < 2000
    assert rt.metrics.requests()[-1].finish_reason == "cancelled"
    # same conversation, next turn works
    model.reply = lambda p, t: "ok"
    final = rt.chat([{"role": "user", "content": "again"}], greedy_params(),
                    conversation_id="c", enable_thinking=False).result(TIMEOUT)
    assert final.kind == "done"
    assert model.active == 0


def test_cancel_by_id_and_of_a_queued_request():
    model = FakeModel(reply=lambda p, t: "y" * 500, delay_s=0.005)
    rt, model = loaded_runtime(model)
    busy = rt.chat([{"role": "user", "content": "a"}], greedy_params(max_tokens=1000), enable_thinking=False)
    queued = rt.chat([{"role": "user", "content": "b"}], greedy_params(), enable_thinking=False)
    assert rt.status()["queued"] >= 1
    assert busy.get(TIMEOUT).kind == "started"
    queued.cancel()
    # a queued request ends at once, while the generation ahead of it still runs
    assert queued.get(timeout=1.0).kind == "cancelled"
    assert not busy.done and model.active == 1
    assert rt.cancel(busy.id)
    assert busy.wait(TIMEOUT).kind == "cancelled"
    assert queued.poll() is None  # nothing after its terminal event, no "started"
    assert not rt.cancel(busy.id)  # already over


def test_engine_error_becomes_error_event_and_thread_survives():
    model = FakeModel(fail_after=3)
    rt, model = loaded_runtime(model)
    events, _, answer = collect(rt.chat([{"role": "user", "content": "x"}], greedy_params(), enable_thinking=False))
    assert events[-1].kind == "error"
    assert "fake engine failure" in events[-1].text
    assert isinstance(events[-1].error, ValueError)
    assert len(answer) == 3
    model.fail_after = None
    final = rt.chat([{"role": "user", "content": "x"}], greedy_params(), enable_thinking=False).result(TIMEOUT)
    assert final.kind == "done"
    assert rt.status()["alive"]


def test_errors_without_a_model_and_for_a_bad_file():
    rt, _ = make_runtime()
    final = rt.chat([{"role": "user", "content": "x"}], greedy_params()).wait(TIMEOUT)
    assert final.kind == "error" and isinstance(final.error, RequestError)
    assert "no model is loaded" in final.text
    with pytest.raises(GGUFError, match="missing.gguf"):
        rt.load("missing.gguf").result(TIMEOUT)
    assert not rt.loaded
    with pytest.raises(RequestError):
        rt.chat([], greedy_params())


def test_images_need_a_vision_model():
    rt, model = loaded_runtime()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    rt.chat(msgs, greedy_params()).result(TIMEOUT)
    assert model.prompts[-1].endswith("what is it?<image>\n<|assistant|><think>\n")
    model.vision = None
    final = rt.chat(msgs, greedy_params()).wait(TIMEOUT)
    assert final.kind == "error" and "cannot read pictures" in final.text


def test_load_can_be_cancelled():
    rt, loader = make_runtime(progress_steps=400, delay_s=0.005)
    handle = rt.load("slow.gguf")
    for ev in handle.events(TIMEOUT):
        if ev.kind == "progress":
            break
    handle.cancel()
    assert handle.wait(TIMEOUT).kind == "cancelled"
    assert not rt.loaded
    assert loader.made == []


def test_replace_applies_placement_and_drops_sessions():
    rt, model = loaded_runtime()
    rt.chat([{"role": "user", "content": "x"}], greedy_params(), conversation_id="c").result(TIMEOUT)
    assert rt.status()["sessions"] == 1
    version = rt.state_version
    final = rt.replace({"layers": "all on cpu"}).result(TIMEOUT)
    assert model.placement == {"layers": "all on cpu"}
    assert final.data["model"].placement == {"layers": "all on cpu"}
    assert rt.status()["sessions"] == 0
    assert rt.state_version > version
    rt.unload().result(TIMEOUT)
    assert not rt.loaded and model.closed


def test_stop_strings_cut_the_answer():
    model = FakeModel(reply=lambda p, t: "alpha beta STOP gamma delta")
    rt, model = loaded_runtime(model)
    events, _, answer = collect(
        rt.chat([{"role": "user", "content": "x"}], greedy_params(), stop=["STOP", "delta"],
                enable_thinking=False)
    )
    assert answer == "alpha beta "
    assert events[-1].kind == "done" and events[-1].finish_reason == "stop"
    assert events[-1].usage.completion_tokens == len("alpha beta STOP")


def test_max_tokens_gives_length_and_completion_takes_raw_text():
    rt, model = loaded_runtime()
    events, _, answer = collect(rt.complete("raw text", greedy_params(max_tokens=4)))
    assert model.prompts[-1] == "raw text"  # no template around a completion
    assert events[-1].finish_reason == "length"
    assert len(answer) == 4
    final = rt.complete([104, 105], greedy_params()).result(TIMEOUT)
    assert model.prompts[-1] == "hi" and final.kind == "done"


def test_many_clients_share_one_runtime_and_generations_are_serialized():
    model = FakeModel(delay_s=0.001)
    rt, model = loaded_runtime(model)
    results = {}
    errors = []

    def client(k):
        try:
            h = rt.chat([{"role": "user", "content": f"client {k}" + "!" * k}], greedy_params(),
                        conversation_id=k, enable_thinking=False)
            _, _, answer = collect(h)
            results[k] = answer
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors
    assert len(results) == 6
    assert model.max_active == 1
    assert len(model.generate_threads) == 1
    # each client got the answer to its own prompt
    for k, answer in results.items():
        prompt = next(p for p in model.prompts if f"client {k}" + "!" * k + "\n" in p)
        assert answer == f"echo[{len(prompt)}]"


def test_get_times_out_and_close_cancels_pending_work():
    model = FakeModel(reply=lambda p, t: "z" * 1000, delay_s=0.01)
    rt, model = loaded_runtime(model)
    handle = rt.chat([{"role": "user", "content": "x"}], greedy_params(max_tokens=2000), enable_thinking=False)
    queued = rt.chat([{"role": "user", "content": "y"}], greedy_params(), enable_thinking=False)
    with pytest.raises(TimeoutError):
        while True:  # the first events come quickly; a gap between tokens is 10 ms
            handle.get(timeout=0.001)
    rt.close()
    assert handle.wait(TIMEOUT).kind == "cancelled"
    assert queued.wait(TIMEOUT).kind == "cancelled"
    assert model.closed
    with pytest.raises(RuntimeError):
        rt.chat([{"role": "user", "content": "x"}], greedy_params())


# -- thinking split ----------------------------------------------------------------------------------


def split_all(chunks, inside):
    s = ThinkingSplitter(inside=inside)
    thinking, answer = "", ""
    for c in chunks:
        t, a = s.feed(c)
        thinking += t
        answer += a
    t, a = s.flush()
    return thinking + t, answer + a


@pytest.mark.parametrize(
    "text, inside, expected",
    [
        ("\nweigh options\n</think>\n\nThe answer.", True, ("weigh options\n", "The answer.")),
        ("<think>\nhmm</think>Yes", False, ("hmm", "Yes")),
        ("Plain answer mentioning </think> and <think>", False,
         ("", "Plain answer mentioning </think> and <think>")),
        ("unfinished thought <", True, ("unfinished thought <", "")),
        ("<thi", False, ("", "<thi")),
        ("</think>\n\nonly answer", True, ("", "only answer")),
    ],
)
def test_thinking_split_is_independent_of_chunking(text, inside, expected):
    assert split_all([text], inside) == expected
    rng = random.Random(len(text))
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 6))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)], strict=True)]
        assert split_all(chunks, inside) == expected, chunks
    assert split_all(list(text), inside) == expected  # one character per token


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<start_of_turn>model\n")


# -- end to end on the fixture GGUF (real engine, NumPy backend) ---------------------------------------


@pytest.fixture(scope="module")
def real_runtime(fixtures_dir):
    rt = Runtime(sample_memory_s=0)
    final = rt.load(fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf", devices=["cpu"]).result(120)
    assert final.data["model"].architecture == "qwen35"
    yield rt
    rt.close()


def test_real_model_chat_matches_reference_and_reuses_prefix(real_runtime, fixtures_dir):
    import json

    import numpy as np
    from minecart.engine.sampling import greedy_params

    rt = real_runtime
    seqs = json.loads((fixtures_dir / "sequences.json").read_text())
    ref = np.load(fixtures_dir / "dense" / "ref_hf_q8_0_dequant" / "chat.npz")
    n = 6
    handle = rt.chat(seqs["chat_messages"], greedy_params(max_tokens=n), conversation_id="ref")
    events = list(handle.events(120))
    final = events[-1]
    assert final.kind == "done", final.text
    # the template rendered to exactly the reference prompt, and greedy decoding follows it
    assert final.usage.prompt_tokens == len(ref["tokens"])
    tokens = [e.generation.token for e in events if e.kind == "token" and e.generation is not None]
    assert tokens == [int(t) for t in ref["gen_tokens"][:n]]
    assert final.finish_reason == "length" and final.usage.completion_tokens == n
    timing = final.data["timing"]
    assert timing.prefill_tokens_per_s > 0 and timing.decode_tokens_per_s > 0
    # next turn of the same conversation: everything up to this turn's answer comes from the session
    answer = "".join(e.text for e in events if e.kind == "token")
    messages = seqs["chat_messages"] + [{"role": "assistant", "content": answer},
                                        {"role": "user", "content": "Thanks!"}]
    final2 = rt.chat(messages, greedy_params(max_tokens=2), conversation_id="ref").result(120)
    assert final2.usage.cached_tokens >= len(ref["tokens"]) - 8
    assert final2.usage.prompt_tokens > len(ref["tokens"])


def test_real_model_cancel_then_continue(real_runtime):
    from minecart.engine.sampling import SamplingParams

    rt = real_runtime
    msgs = [{"role": "user", "content": "Count to a thousand."}]
    handle = rt.chat(msgs, SamplingParams(max_tokens=2000, seed=1), conversation_id="cancel")
    for ev in handle.events(120):
        if ev.kind == "token":
            break
    handle.cancel()
    final = handle.wait(60)
    assert final.kind == "cancelled"
    assert final.usage.completion_tokens < 2000
    again = rt.chat(msgs + [{"role": "user", "content": "again"}], SamplingParams(max_tokens=3, seed=1),
                    conversation_id="cancel").result(120)
    assert again.kind == "done" and again.usage.completion_tokens == 3


# ---------------------------------------------------------------------------------------------------
# Base models: plain-text completion by default, the template on request; default lengths


def test_base_model_chat_gets_the_plain_text_of_the_messages():
    model = FakeModel()
    model.is_base_model = True
    rt, model = loaded_runtime(model)
    msgs = [{"role": "system", "content": "Facts."}, {"role": "user", "content": "The capital of France is"}]
    final = rt.chat(msgs, greedy_params()).result(TIMEOUT)
    # no roles, no generation prompt: the text to continue, as the user wrote it
    assert model.prompts[-1] == "Facts.\n\nThe capital of France is"
    assert final.data["prompt"] == "text"
    forced = rt.chat(msgs, greedy_params(), chat_template="on").result(TIMEOUT)
    assert model.prompts[-1].startswith("<|system|>Facts.\n<|user|>The capital of France is\n<|assistant|>")
    assert forced.data["prompt"] == "chat"
    with pytest.raises(RequestError, match="must be one of auto, on, off"):
        rt.chat(msgs, greedy_params(), chat_template="always")


def test_chat_model_uses_its_template_and_a_chat_length_by_default():
    from minecart.engine.sampling import (
        DEFAULT_MAX_TOKENS_CHAT,
        DEFAULT_MAX_TOKENS_TEXT,
        SamplingParams,
    )

    seen: list[int | None] = []

    class Recording(FakeModel):
        def generate(self, prompt, params=None, *args, **kwargs):
            seen.append(params.max_tokens)
            return super().generate(prompt, params, *args, **kwargs)

    rt, model = loaded_runtime(Recording())
    final = rt.chat([{"role": "user", "content": "hi"}], SamplingParams()).result(TIMEOUT)
    assert final.data["prompt"] == "chat" and model.prompts[-1].startswith("<|user|>hi\n<|assistant|>")
    rt.complete("once upon a time", SamplingParams()).result(TIMEOUT)
    rt.complete("once upon a time", SamplingParams(max_tokens=7)).result(TIMEOUT)
    assert seen == [DEFAULT_MAX_TOKENS_CHAT, DEFAULT_MAX_TOKENS_TEXT, 7]


def test_conversation_turn_boundary_reaches_the_engine():
    rt, model = loaded_runtime()
    msgs = [{"role": "user", "content": "hi"}]
    rt.chat(msgs, greedy_params(), conversation_id="c", enable_thinking=False).result(TIMEOUT)
    # "<|user|>hi\n" is 11 bytes: the generation prompt starts there
    assert model.generate_extras[-1] == {"turn_boundary": 11}
    rt.chat(msgs, greedy_params(), enable_thinking=False).result(TIMEOUT)
    assert model.generate_extras[-1] == {}  # a one-off request has no session to checkpoint
