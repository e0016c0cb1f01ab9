"""Log-probabilities of generated tokens (SamplingParams.logprobs, the API's logprobs / top_logprobs)
against transformers' own numbers for the fixture model's greedy continuation (`gen_lse`,
`gen_top_ids`, `gen_top_vals` in the fixtures' reference files), through the engine and over HTTP with
the official `openai` client."""

from __future__ import annotations

import math
import re

import numpy as np
import openai
import pytest
from minecart.engine.generation import generate
from minecart.engine.runtime import Runtime
from minecart.engine.sampling import Sampler, SamplingParams, greedy_params, log_softmax_at
from minecart.engine.server import ServerThread, create_app

# the engine's decode logits hold to transformers' within 1e-4 of the row's size (tests/engine/
# test_qwen35_fixtures.py), and these rows reach ~18: a log-probability (logit - log-sum-exp) within 1e-3
TOL = 1e-3


def _reference(fixtures_dir, name="short"):
    """The prompt, the greedy continuation, and for the row each continuation token was drawn from its
    log-sum-exp, 16 largest ids and their logits: the prompt's last row for the first, then the rows
    after feeding each token (`gen_*[k]` is the row after gen_tokens[k], which gives gen_tokens[k + 1])."""
    ref = np.load(fixtures_dir / "dense" / "ref_hf" / f"{name}.npz")
    lse = np.concatenate([ref["logits_lse"][-1:], ref["gen_lse"][:-1]])
    top_ids = np.concatenate([ref["top_ids"][-1:], ref["gen_top_ids"][:-1]])
    top_vals = np.concatenate([ref["top_vals"][-1:], ref["gen_top_vals"][:-1]])
    return ref["tokens"].tolist(), ref["gen_tokens"].tolist(), lse, top_ids, top_vals


def test_log_softmax_at_matches_an_exact_sum():
    rng = np.random.default_rng(0)
    row = (rng.standard_normal(5000) * 7).astype(np.float32)
    row[[3, 9]] = row.max()  # a tie at the top: the lower id first
    lse = max(row.tolist()) + math.log(math.fsum(math.exp(v - max(row.tolist())) for v in row.tolist()))
    lp, alts = log_softmax_at(row, 17, 4)
    assert lp == pytest.approx(float(row[17]) - lse, abs=1e-6)  # float32 exponentials, float64 sum
    assert [t for t, _ in alts][:2] == [3, 9]
    assert all(a[1] >= b[1] for a, b in zip(alts, alts[1:], strict=False))
    assert math.fsum(math.exp(v) for _, v in log_softmax_at(row, 0, 20)[1]) < 1.0


def test_logprobs_make_the_sampler_read_whole_rows():
    s = Sampler(SamplingParams(temperature=0.0, top_k=0, logprobs=3))
    assert s.candidates == 0 and not s.chains
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


@pytest.fixture(scope="module")
def f16_model(fixtures_dir):
    from minecart.engine.model import load_model

    # the exact (f32) KV cache, as tests/engine/test_qwen35_fixtures.py compares with transformers
    return load_model(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", devices=["cpu:0"], kv_type="f32")


@pytest.mark.parametrize("name", ["short", "len70"])
def test_greedy_logprobs_are_transformers(f16_model, fixtures_dir, name):
    prompt, gen, lse, top_ids, top_vals = _reference(fixtures_dir, name)
    n = 8
    events = list(generate(f16_model, prompt, greedy_params(max_tokens=n, logprobs=5)))
    assert [e.token for e in events] == gen[:n]
    for k, ev in enumerate(events):
        assert ev.logprobs is not None
        want = top_vals[k] - lse[k]  # transformers' log-softmax of its 16 largest logits, descending
        assert ev.logprobs.chosen.token == gen[k]
        assert ev.logprobs.chosen.logprob == pytest.approx(float(want[0]), abs=TOL)
        got_ids = [c.token for c in ev.logprobs.top]
        got = np.array([c.logprob for c in ev.logprobs.top])
        assert got_ids[0] == top_ids[k][0]
        assert np.abs(got - want[:5]).max() < TOL
        # below the top the order may swap where two logits lie within the tolerance
        close = np.abs(np.diff(top_vals[k][:6])) < 2 * TOL
        assert got_ids == top_ids[k][:5].tolist() or close.any()
        assert ev.logprobs.chosen.data == f16_model.tokenizer.token_bytes(gen[k])


@pytest.fixture(scope="module")
def f16_api(fixtures_dir):
    """The official client on a real server running the f16 fixture on the CPU, and the model's id."""
    rt = Runtime(sample_memory_s=0)
    rt.load(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", devices=["cpu"], kv_type="f32").result(120)
    with ServerThread(create_app(rt)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)
        yield client, client.models.list().data[0].id
    rt.close()


def test_logprobs_over_http(f16_api, fixtures_dir):
    prompt, gen, lse, top_ids, top_vals = _reference(fixtures_dir, "short")
    client, model = f16_api
    # legacy completions: token pieces, their logprobs, the alternatives by piece, text offsets
    done = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, logprobs=3)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == 4 and "".join(lp.tokens) == done.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for k in range(4):
        assert lp.token_logprobs[k] == pytest.approx(float(top_vals[k][0] - lse[k]), abs=TOL)
        assert len(lp.top_logprobs[k]) <= 3
        assert max(lp.top_logprobs[k].values()) == pytest.approx(lp.token_logprobs[k], abs=1e-6)
    # chat, plain and streamed: one entry per generated token, bytes that make up its text
    kwargs = dict(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
                  logprobs=True, top_logprobs=2, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    full = client.chat.completions.create(**kwargs)
    entries = full.choices[0].logprobs.content
    assert len(entries) == full.usage.completion_tokens == 6
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace") == full.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
               and e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-6) for e in entries)
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            if ch.logprobs is not None and ch.logprobs.content:
                streamed.extend(ch.logprobs.content)
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    # without logprobs there are none
    plain = client.chat.completions.create(**{**kwargs, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_logit_bias_moves_the_greedy_pick(f16_model, fixtures_dir):
    """A bias of -100 on transformers' argmax gives its runner-up; +100 forces any token."""
    prompt, gen, lse, top_ids, top_vals = _reference(fixtures_dir, "short")
    assert top_vals[0][1] - top_vals[0][2] > 10 * TOL  # the runner-up is clear of the third
    banned = list(generate(f16_model, prompt, greedy_params(max_tokens=1, logit_bias=((gen[0], -100.0),),
                                                            logprobs=1)))
    assert banned[0].token == top_ids[0][1]
    # the log-probabilities stay the model's own (before the bias)
    assert banned[0].logprobs.chosen.logprob == pytest.approx(float(top_vals[0][1] - lse[0]), abs=TOL)
    forced = list(generate(f16_model, prompt, greedy_params(max_tokens=3, logit_bias=((1234, 100.0),))))
    assert [e.token for e in forced] == [1234] * 3
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((5, 101.0),))


def test_logit_bias_over_http(f16_api, fixtures_dir):
    prompt, gen, lse, top_ids, top_vals = _reference(fixtures_dir, "short")
    client, model = f16_api
    done = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                     logit_bias={str(gen[0]): -100}, logprobs=1)
    assert done.choices[0].logprobs.token_logprobs[0] == pytest.approx(float(top_vals[0][1] - lse[0]),
                                                                      abs=TOL)
    for bias, fragment in (({"abc": 1}, "logit_bias"), ({"5": 101}, "[-100, 100]"),
                           ({"999999999": 1}, "outside the vocabulary"),
                           ({str(i): 1 for i in range(301)}, "logit_bias")):
        with pytest.raises(openai.BadRequestError, match=re.escape(fragment)):
            client.completions.create(model=model, prompt="x", max_tokens=1, logit_bias=bias)


def _reference_rows(fixtures_dir, name: str, extra: int):
    """The prompt `tokens + gen_tokens[:extra]` and, for each row r of it (the row that predicts token
    r + 1), transformers' log-sum-exp, 16 largest ids and logits, and the logits at logit_columns."""
    ref = np.load(fixtures_dir / "dense" / "ref_hf" / f"{name}.npz")
    cols = np.load(fixtures_dir / "logit_columns.npy").tolist()
    ids = ref["tokens"].tolist() + ref["gen_tokens"][:extra].tolist()
    lse = np.concatenate([ref["logits_lse"], ref["gen_lse"][:extra]])
    top_ids = np.concatenate([ref["top_ids"], ref["gen_top_ids"][:extra]])
    top_vals = np.concatenate([ref["top_vals"], ref["gen_top_vals"][:extra]])
    col_vals = np.concatenate([ref["logits_cols"], ref["gen_logits_cols"][:extra]])
    return ids, lse, top_ids, top_vals, {t: i for i, t in enumerate(cols)}, col_vals


@pytest.mark.parametrize("name", ["short", "len70"])
def test_prompt_logprobs_are_transformers(f16_model, fixtures_dir, name):
    ids, lse, top_ids, top_vals, col_of, col_vals = _reference_rows(fixtures_dir, name, 4)
    events = list(generate(f16_model, ids, greedy_params(max_tokens=0, prompt_logprobs=3)))
    assert len(events) == 1 and events[0].finish_reason == "length"
    scored = events[0].prompt_logprobs
    assert scored is not None and len(scored) == len(ids)
    assert scored[0].chosen.token == ids[0] and scored[0].chosen.logprob is None and scored[0].top == ()
    checked = 0
    for k in range(1, len(ids)):
        r = k - 1  # the row that predicts ids[k]
        entry = scored[k]
        assert entry.chosen.token == ids[k] and entry.chosen.data == f16_model.tokenizer.token_bytes(ids[k])
        want_top = top_vals[r][:3] - lse[r]
        assert np.abs(np.array([c.logprob for c in entry.top]) - want_top).max() < TOL
        if ids[k] in col_of:
            want = col_vals[r][col_of[ids[k]]] - lse[r]
        elif ids[k] == top_ids[r][0]:
            want = top_vals[r][0] - lse[r]
        else:
            continue
        assert entry.chosen.logprob == pytest.approx(float(want), abs=TOL)
        checked += 1
    assert checked >= 5  # the continuation's 4 tokens at least, and the prompt tokens among the columns


def test_echo_over_http(f16_api, fixtures_dir):
    ids, lse, top_ids, top_vals, col_of, col_vals = _reference_rows(fixtures_dir, "short", 2)
    client, model = f16_api
    tok_text = client.completions.create(model=model, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    lp = tok_text.choices[0].logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == tok_text.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for k in (len(ids) - 2, len(ids) - 1):  # the two continuation tokens: transformers' argmax rows
        assert lp.token_logprobs[k] == pytest.approx(float(top_vals[k - 1][0] - lse[k - 1]), abs=TOL)
        assert len(lp.top_logprobs[k]) <= 2
    assert tok_text.usage.completion_tokens == 0
    # echo with a continuation, streamed: the prompt comes first, then the new tokens with theirs
    chunks = list(client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0, echo=True,
                                            logprobs=1, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert text.startswith(tok_text.choices[0].text) and len(tokens) == len(ids) + 3
    assert "".join(tokens) == text
    with pytest.raises(openai.BadRequestError, match="max_tokens 0"):
        client.completions.create(model=model, prompt="x", max_tokens=0)
