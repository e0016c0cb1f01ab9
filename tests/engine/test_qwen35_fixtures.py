"""The NumPy reference engine against the shared Qwen3.5 fixtures (transformers float32 references).

F16 GGUF vs `ref_hf` (exact weights) and Q8_0 GGUF vs `ref_hf_q8_0_dequant` (transformers on the
dequantized weights), all 7 sequences: residual stream after every layer, final hidden state, logits
(stored columns, or the stored top-16 for the Q8_0 reference), GDN and conv state after the prompt,
the 32-step greedy continuation (teacher-forced on the reference tokens, argmax checked where the
reference margin is not a near tie), and the same continuation whether the prompt is prefilled whole,
in 64-token chunks or token by token. Bound: relative error <= 1e-4 at every position.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from minecart.engine.config import GDN
from minecart.engine.model import load_model
from minecart.engine.sampling import greedy_params

SEQUENCES = ["single", "short", "len70", "len128", "len300", "chat", "random100"]
VARIANTS = {"f16": ("qwen35-tiny-dense-f16.gguf", "ref_hf"),
            "q8_0": ("qwen35-tiny-dense-q8_0.gguf", "ref_hf_q8_0_dequant")}
TOL = 1e-4
NEAR_TIE = 1e-3  # absolute logit margin below which argmax agreement is not required

MAX_ERRORS: dict[tuple[str, str], float] = {}  # (variant, sequence) -> worst relative error seen


def _rel_rows(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per-row ||got - ref|| / ||ref|| over the last axis."""
    got = got.reshape(-1, got.shape[-1]).astype(np.float64)
    ref = ref.reshape(-1, ref.shape[-1]).astype(np.float64)
    return np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)


def _check(variant, seq, what, got, ref, tol=TOL):
    err = _rel_rows(got, ref)
    worst = float(err.max())
    key = (variant, seq)
    MAX_ERRORS[key] = max(MAX_ERRORS.get(key, 0.0), worst)
    assert worst <= tol, f"{variant}/{seq} {what}: max relative error {worst:.3g} (row {int(err.argmax())})"


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, fixtures_dir):
    gguf_name, ref_dir = VARIANTS[request.param]
    # the exact (f32) KV cache: these compare with transformers at fp32 tolerances
    model = load_model(fixtures_dir / "dense" / gguf_name, devices=["cpu:0"], kv_type="f32")
    lm_head = model.weights["head"]["token_embd.weight"].dense()
    refs = {s: dict(np.load(fixtures_dir / "dense" / ref_dir / f"{s}.npz")) for s in SEQUENCES}
    yield request.param, model, lm_head, refs
    model.close()


@pytest.fixture(scope="module")
def columns(fixtures_dir):
    return np.load(fixtures_dir / "logit_columns.npy")


def test_sequences_json_matches_npz(fixtures_dir):
    seqs = {s["name"]: s["ids"] for s in json.loads((fixtures_dir / "sequences.json").read_text())["sequences"]}
    for name in SEQUENCES:
        ref = np.load(fixtures_dir / "dense" / "ref_hf" / f"{name}.npz")
        assert list(ref["tokens"]) == seqs[name]


@pytest.mark.parametrize("seq", SEQUENCES)
def test_prefill_matches_reference(variant, columns, seq):
    name, model, lm_head, refs = variant
    ref = refs[seq]
    hs = model.hidden_states(ref["tokens"])
    L = model.config.n_layers
    for i in range(L + 1):  # embeddings, then every layer's output
        _check(name, seq, f"hidden[{i}]", hs["layers"][i], ref["hidden"][i])
    _check(name, seq, "final hidden", hs["final"], ref["hidden"][L + 1])
    final = hs["final"].astype(np.float32)
    if "logits_cols" in ref:
        _check(name, seq, "logit columns", final @ lm_head[columns].T, ref["logits_cols"])
    # every reference: the logits of the reference's top-16 ids at every position
    top = np.einsum("th,tkh->tk", final, lm_head[ref["top_ids"]])
    _check(name, seq, "top-16 logits", top, ref["top_vals"])


def _gguf_value_head_to_hf(cfg) -> np.ndarray:
    """hf_index[j] = HF value head stored at GGUF value head j (tiled vs grouped order, doc 2.4 item 6)."""
    n_k, n_v = cfg.gdn_k_heads, cfg.gdn_v_heads
    r = n_v // n_k
    j = np.arange(n_v)
    return (j % n_k) * r + j // n_k


@pytest.mark.parametrize("seq", SEQUENCES)
def test_recurrent_state_after_prompt(variant, seq):
    name, model, _, refs = variant
    ref = refs[seq]
    cfg = model.config
    session = model.new_session()
    session.prefill(ref["tokens"])
    hf_of = _gguf_value_head_to_hf(cfg)
    key_ch = 2 * cfg.gdn_k_heads * cfg.gdn_key_dim
    dv = cfg.gdn_value_dim
    # conv channels in GGUF order -> the HF channel each one holds (V channels move with their head)
    v_channel_hf = key_ch + (hf_of[:, None] * dv + np.arange(dv)[None, :]).reshape(-1)
    channel_hf = np.concatenate([np.arange(key_ch), v_channel_hf])
    gdn_layers = [i for i, kind in enumerate(cfg.layer_types) if kind == GDN]
    assert len(gdn_layers) == ref["gdn_state"].shape[0]
    for n, i in enumerate(gdn_layers):
        ssm = np.asarray(session.states[i].recurrent["ssm"])  # (n_v, dk, dv), GGUF head order
        ref_ssm = ref["gdn_state"][n][hf_of]
        _check(name, seq, f"gdn_state layer {i}", ssm.reshape(1, -1), ref_ssm.reshape(1, -1))
        conv = np.asarray(session.states[i].recurrent["conv"])  # (K-1, C): last K-1 raw inputs
        ref_conv = ref["conv_state"][n][channel_hf, 1:].T  # oldest first, drop the K-th oldest
        if len(ref["tokens"]) >= cfg.conv_kernel - 1:
            _check(name, seq, f"conv_state layer {i}", conv.reshape(1, -1), ref_conv.reshape(1, -1))
        else:
            np.testing.assert_allclose(conv, ref_conv, rtol=TOL, atol=1e-6)
    session.close()


@pytest.mark.parametrize("seq", SEQUENCES)
def test_greedy_continuation_teacher_forced(variant, columns, seq):
    """Feed the reference's greedy tokens one at a time (the recurrent decode path); every step's
    logits must match and its argmax must be the next reference token unless that is a near tie."""
    name, model, _, refs = variant
    ref = refs[seq]
    session = model.new_session()
    logits = session.prefill(ref["tokens"])
    gen = ref["gen_tokens"]
    assert int(np.argmax(logits)) == gen[0] or ref["argmax_margin"][-1] < NEAR_TIE
    rows = []
    for k, token in enumerate(gen):
        logits = session.step(int(token))
        rows.append(logits)
        if k + 1 < len(gen) and ref["gen_argmax_margin"][k] >= NEAR_TIE:
            assert int(np.argmax(logits)) == gen[k + 1], f"{name}/{seq}: greedy step {k + 1} differs"
    rows = np.stack(rows)
    if "gen_logits_cols" in ref:
        _check(name, seq, "decode logit columns", rows[:, columns], ref["gen_logits_cols"])
    top = np.take_along_axis(rows, ref["gen_top_ids"], axis=1)
    _check(name, seq, "decode top-16 logits", top, ref["gen_top_vals"])
    # the full rows are right too: their log-sum-exp matches the reference's
    lse = np.log(np.exp(rows.astype(np.float64) - rows.max(1, keepdims=True)).sum(1)) + rows.max(1)
    np.testing.assert_allclose(lse, ref["gen_lse"], rtol=TOL)
    session.close()


@pytest.mark.parametrize("seq", ["short", "len70", "len128", "chat"])
def test_generate_same_for_whole_chunked_and_stepwise_prefill(variant, seq):
    name, model, _, refs = variant
    ref = refs[seq]
    prompt = [int(t) for t in ref["tokens"]]
    results = []
    for chunk in (len(prompt), 64, 1):  # whole, in 64-token chunks, token by token
        session = model.new_session()
        session.prefill(prompt, chunk=chunk)
        events = list(model.generate(prompt, greedy_params(max_tokens=32), session=session))
        assert events[-1].finish_reason == "length"
        assert events[-1].cached_tokens == len(prompt)  # the prompt was already in the session
        results.append([e.token for e in events])
        session.close()
    assert results[0] == results[1] == results[2]
    if ref["gen_argmax_margin"].min() >= NEAR_TIE and ref["argmax_margin"][-1] >= NEAR_TIE:
        assert results[0] == list(ref["gen_tokens"])


def test_model_logits_full_rows(variant, columns):
    """Model.logits returns full (T, vocab) rows from fresh state; check them against the stored
    columns / top-16 and the log-sum-exp of the full row."""
    name, model, _, refs = variant
    ref = refs["short"]
    logits = model.logits(ref["tokens"])
    assert logits.dtype == np.float32 and logits.shape == (len(ref["tokens"]), model.config.vocab_size)
    if "logits_cols" in ref:
        _check(name, "short", "Model.logits columns", logits[:, columns], ref["logits_cols"])
    _check(name, "short", "Model.logits top-16", np.take_along_axis(logits, ref["top_ids"], 1), ref["top_vals"])
    lse = np.log(np.exp(logits.astype(np.float64) - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    np.testing.assert_allclose(lse, ref["logits_lse"], rtol=TOL)
    np.testing.assert_array_equal(model.logits(ref["tokens"]), logits)  # fresh state every call


# ---- M-RoPE with distinct (t, h, w) positions: the vision fixture's language model ----------------


@pytest.fixture(scope="module")
def vl_model(fixtures_dir):
    path = fixtures_dir / "vision" / "qwen35-tiny-vl-f16.gguf"
    if not path.is_file():
        pytest.skip("vision fixture not present")
    model = load_model(path, devices=["cpu:0"], kv_type="f32")
    yield model, model.weights["head"]["token_embd.weight"].dense()
    model.close()


@pytest.mark.parametrize("chat", ["chat_image", "chat_two_images"])
def test_image_embeddings_and_mrope_positions(vl_model, fixtures_dir, columns, chat):
    """transformers' image embeddings inserted at the <|image_pad|> rows, its (3, T) positions: every
    layer, the logits, the next position and the teacher-forced greedy continuation must match."""
    model, lm_head = vl_model
    ref = dict(np.load(fixtures_dir / "vision" / "ref_hf" / f"{chat}.npz"))
    rows = np.flatnonzero(ref["mm_token_type_ids"])
    override = (rows, ref["image_embeds"])
    pos = ref["position_ids"]
    assert len(set(pos[1, rows])) > 1  # the components really differ
    hs = model.hidden_states(ref["tokens"], positions=pos, embed_override=override)
    L = model.config.n_layers
    for i in range(L + 1):
        _check("vl", chat, f"hidden[{i}]", hs["layers"][i], ref["hidden"][i])
    _check("vl", chat, "logit columns", hs["final"] @ lm_head[columns].T, ref["logits_cols"])

    session = model.new_session()
    logits = session.prefill(ref["tokens"], chunk=64, positions=pos, embed_override=override)
    assert session.position == int(ref["next_position"])
    assert int(np.argmax(logits)) == ref["gen_tokens"][0]
    steps = []
    for token in ref["gen_tokens"]:
        steps.append(session.step(int(token)))
    assert session.position == int(ref["gen_position_ids"][0, -1]) + 1
    _check("vl", chat, "decode logit columns", np.stack(steps)[:, columns], ref["gen_logits_cols"])

    # truncate back to the prompt: no snapshot, so it re-prefills from the stored image rows and
    # (t, h, w) positions; then the same prompt is fully reused, a different image is not
    n = len(ref["tokens"])
    session.truncate(n)
    _check("vl", chat, "logits after truncate", session.last_logits[None, :], logits[None, :])
    assert session.position == int(ref["next_position"])
    session.sync(ref["tokens"], positions=pos, embed_override=override)
    assert session.computed_tokens == 0
    other = (rows, ref["image_embeds"][::-1].copy())
    changed = session.sync(ref["tokens"], positions=pos, embed_override=other)
    assert session.computed_tokens == n  # no snapshot before the image: GDN state restarts from zero
    assert np.abs(changed - logits).max() > 1e-3
    session.close()


def test_report_max_errors():
    """Prints the worst relative error per fixture and sequence (run with -s to see it)."""
    for (variant, seq), err in sorted(MAX_ERRORS.items()):
        print(f"max relative error {variant:5s} {seq:10s} {err:.3g}")
    assert all(e <= TOL for e in MAX_ERRORS.values())
