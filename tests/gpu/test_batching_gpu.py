"""Batched decode on the GPU (Executor.forward_batch on the CuPy backend) against each sequence alone,
and the batch's CUDA graph against the same batch run eagerly.

- small-dense (Qwen3.5 with real head dims: the fused gated-attention and Gated DeltaNet decode
  kernels, per sequence) and a tiny Gemma 3 (the composed attention over a sliding window);
- 3, 9 (above GEMV_MAX_T: the projections take the tiled GEMM) and 32 sequences;
- teacher-forced tokens, prompts of different lengths, caches that must grow during the batch (a
  captured step cannot reallocate: that step runs eagerly and the next re-captures), and a sequence
  leaving the batch half way (the batch's graph is captured again for the new set).
Graph against eager is the same kernels, so it is held to 1e-5 of the logits' range (as
tests/gpu/test_model.py holds the single-token graph); batched against alone runs other matmul kernels
(GEMV for B tokens, GEMM) and is held to the bounds of the GPU-vs-reference tests.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests._gemma3 import tiny_gemma3_file
from tests.gpu._compare import compare

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from minecart.engine.synth import write_synthetic

    d = tmp_path_factory.mktemp("batch")
    qwen = d / "small-dense-q4_k.gguf"
    write_synthetic(qwen, "small-dense", "q4_k", seed=5)
    return {"qwen": qwen, "gemma": tiny_gemma3_file(d / "gemma.gguf", seed=2)}


def _load(path, gpu_path: str, graphs: bool = True):
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.model import load_model

    be = CupyBackend("cuda:0", path=gpu_path)
    be.use_graphs = graphs
    return load_model(path, backend=be), be


def _work(model, batch: int, steps: int, seed: int):
    rng = np.random.default_rng(seed)
    vocab = int(model.config.vocab_size)
    prompts = [[int(t) for t in rng.integers(1, vocab, 5 + 3 * b)] for b in range(batch)]
    tokens = rng.integers(1, vocab, (steps, batch))
    return prompts, tokens


def _alone(model, prompts, tokens, capacity: int, stop: dict[int, int]) -> dict[int, np.ndarray]:
    """Each sequence on its own session (the single-token decode, graphed): logits per step."""
    out = {}
    for b, p in enumerate(prompts):
        s = model.new_session(capacity=capacity)
        s.prefill(p)
        out[b] = np.stack([s.step(int(tokens[k][b])) for k in range(stop.get(b, len(tokens)))])
        s.close()
    return out


def _batched(model, prompts, tokens, capacity: int, stop: dict[int, int]) -> dict[int, np.ndarray]:
    """All sequences through Executor.forward_batch, one step at a time; sequence b leaves the batch
    after stop[b] steps."""
    sessions = [model.new_session(capacity=capacity) for _ in prompts]
    for s, p in zip(sessions, prompts, strict=True):
        s.prefill(p)
    pos = [int(s.position) for s in sessions]
    rows: dict[int, list] = {b: [] for b in range(len(prompts))}
    for k in range(len(tokens)):
        live = [b for b in range(len(prompts)) if k < stop.get(b, len(tokens))]
        out = model.executor.forward_batch([[int(tokens[k][b])] for b in live],
                                           [sessions[b].states for b in live],
                                           [np.array([pos[b]]) for b in live])
        assert out.shape == (len(live), model.config.vocab_size)
        for i, b in enumerate(live):
            rows[b].append(out[i].copy())
            pos[b] += 1
    for s in sessions:
        s.close()
    return {b: np.stack(v) for b, v in rows.items()}


@pytest.mark.parametrize("which", ["qwen", "gemma"])
@pytest.mark.parametrize("gpu_path", ["fma", "dp4a"])
@pytest.mark.parametrize("batch", [3, 9, 32])
def test_batch_matches_alone_and_its_graph_matches_eager(files, which, gpu_path, batch):
    steps = 10
    mg, be_g = _load(files[which], gpu_path, graphs=True)
    me, _ = _load(files[which], gpu_path, graphs=False)
    prompts, tokens = _work(mg, batch, steps, seed=batch)
    capacity = max(len(p) for p in prompts) // 2 + 4  # every cache grows during the run
    stop = {1: steps // 2}  # sequence 1 leaves half way: the rest is a new batch
    alone = _alone(me, prompts, tokens, capacity, stop)
    graphed = _batched(mg, prompts, tokens, capacity, stop)
    eager = _batched(me, prompts, tokens, capacity, stop)
    assert me.executor.batch_graph_steps == 0
    assert mg.executor.batch_graph_steps > 0, "the batched decode never ran as a CUDA graph"
    worst_ge, worst = 0.0, {"max_rel": 0.0, "top1": 1.0, "kl_mean": 0.0, "kl_max": 0.0}
    for b in range(batch):
        assert np.isfinite(graphed[b]).all() and np.isfinite(eager[b]).all()
        ge = float(np.max(np.abs(graphed[b] - eager[b])) / np.max(np.abs(eager[b])))
        worst_ge = max(worst_ge, ge)
        r = compare(alone[b], eager[b])
        worst = {"max_rel": max(worst["max_rel"], r["max_rel"]), "top1": min(worst["top1"], r["top1"]),
                 "kl_mean": max(worst["kl_mean"], r["kl_mean"]), "kl_max": max(worst["kl_max"], r["kl_max"])}
    print(f"\n{which} {gpu_path} B={batch}: graph vs eager batch {worst_ge:.2e}; batch vs alone {worst}; "
          f"graphed steps {mg.executor.batch_graph_steps}, eager-only sizes {sorted(be_g._batch_eager)}")
    assert worst_ge <= 1e-5
    if gpu_path == "fma":
        assert worst["max_rel"] < 1e-3 and worst["top1"] == 1.0
    else:
        # DP4A: int8 activations, so batch and alone differ by rounding noise; measured 2026-12-01 (H200) with
        # the multi-token K-quant GEMV: max_rel 0.0039 / 0.0159 / 0.0215 at B = 3 / 9 / 32 (the max over
        # B sequences x 10 steps grows with B), top-1 1.0, KL mean <= 3.7e-4
        assert worst["max_rel"] < 3e-2 and worst["kl_mean"] < 1e-3
    mg.close()
    me.close()


def test_bench_tool_runs_on_the_gpu(tmp_path):
    """tools/bench_batch_gpu.py end to end on a small synthesized model (the real run uses the 9B)."""
    import json

    from tools import bench_batch_gpu

    out = tmp_path / "bench.json"
    assert bench_batch_gpu.main(["--shape", "small-dense", "--quant", "q4_k", "--dir", str(tmp_path),
                                 "--batches", "1,4,9", "--steps", "4", "--context", "16", "--repeat", "1",
                                 "--ttft-prompt", "64", "--chunk", "32", "--others", "2",
                                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    print(json.dumps(res["decode"], indent=1), res["ttft"])
    assert [(r["batch"], r["top"]) for r in res["decode"]] == [(1, 0), (4, 0), (9, 0), (1, 20), (4, 20), (9, 20)]
    assert all(r["tok_s"] > 0 for r in res["decode"]) and res["ttft"]["alone_s"] > 0
    assert res["decode"][2]["graphed_steps"] > 0 and res["decode"][5]["graphed_steps"] > 0


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0", "q3"])
def test_graph_pointer_check_sees_every_state_array(files, kv_type):
    """The pointers a replayed graph checks (cupy_backend._GRAPH_STATES, a graph_watch.StateReader over
    cupy.ndarray with the caches' k/v fast path) are every device array of the sequences' layer states,
    whatever the cache type; the check holds while nothing changed, and a restored recurrent array or a
    grown cache breaks it."""
    from minecart.engine.backends.cupy_backend import _GRAPH_STATES, CupyBackend
    from minecart.engine.model import load_model

    model = load_model(files["qwen"], backend=CupyBackend("cuda:0", path="dp4a"), kv_type=kv_type)
    sessions = [model.new_session(capacity=16) for _ in range(3)]
    for s in sessions:
        s.prefill([3, 4, 5])

    def arrays(obj, out):  # every cupy array reachable, the plain way
        if isinstance(obj, cp.ndarray):
            out.append(obj.data.ptr)
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                arrays(o, out)
        elif isinstance(obj, dict):
            for o in obj.values():
                arrays(o, out)
        elif hasattr(obj, "__dict__"):
            for o in vars(obj).values():
                arrays(o, out)
        return out

    watch = [st for s in sessions for st in s.states]
    watched = _GRAPH_STATES.watch(watch)
    got = watched.pointers
    assert got and sorted(got) == sorted(arrays(watch, []))
    kv = [st.kv for st in watch if st.kv is not None]
    assert kv and all(p in got for c in kv for p in (c.k.data.ptr, c.v.data.ptr))
    rec = [a for st in watch for a in st.recurrent.values()]
    assert rec and all(a.data.ptr in got for a in rec)
    assert watched.unchanged(watch) and watched.unchanged([st for s in sessions for st in s.states])
    st = next(st for st in watch if st.recurrent)
    name = next(iter(st.recurrent))
    st.recurrent[name] = st.recurrent[name].copy()  # what a snapshot restore does
    assert not watched.unchanged(watch)
    watched = _GRAPH_STATES.watch(watch)
    assert watched.unchanged(watch)
    sessions[0].prefill(list(range(6, 30)))  # past the capacity of 16: the caches grow
    assert not watched.unchanged(watch)


def _check_top(top, rows: np.ndarray, k: int) -> None:
    """TopLogits (n, k) from a step against the whole logit rows (n, vocab) of the same step run by the
    whole-row graph: each value is its id's logit, descending, and no logit outside is larger (all
    within 1e-5 of the row's range: the two graphs are separate runs of the same kernels)."""
    assert top.values.shape == top.ids.shape == (rows.shape[0], k)
    for r in range(rows.shape[0]):
        row = rows[r]
        tol = 1e-5 * float(np.max(np.abs(row)))
        vals, ids = top.values[r], np.asarray(top.ids[r], np.int64)
        assert len(set(ids.tolist())) == k and ids.min() >= 0 and ids.max() < row.size
        np.testing.assert_allclose(vals, row[ids], rtol=0, atol=tol)
        assert (np.diff(vals) <= 0).all()
        outside = np.delete(row, ids)
        assert outside.max() <= vals[-1] + tol


@pytest.mark.parametrize("k", [1, 20, 64])
def test_top_logits_steps_single_and_batched(files, k):
    """Decode steps that return their top-k logits (engine/sampling.py TopLogits; the scheduler's and
    generate's path) as CUDA graphs: one sequence (graph_step's single-token graph) and a batch of 9,
    each against the whole-row graphs of the same steps on twin sessions; the whole rows they fetch
    from the device (a penalized pick the top logits do not decide) equal those rows, and a fetch
    after the next replay is refused."""
    from minecart.engine.sampling import TopLogits

    model, be = _load(files["qwen"], "dp4a", graphs=True)
    prompts, tokens = _work(model, 9, 6, seed=k)
    ex = model.executor
    # one sequence: the top-k run first, then its twin with whole rows (a backend keeps the graphs of
    # one sequence at a time)
    runs, fetched = [], []
    for want in (k, 0):
        s = model.new_session(capacity=64)
        s.prefill(prompts[3])
        graphed0 = ex.graphed_stage_steps
        out = []
        for step in range(len(tokens)):
            out.append(s.step(int(tokens[step][0]), top=want))
            if want:  # the whole row stays readable on the device until the next step
                fetched.append(out[-1].whole_row())
                if step:  # a row read before the next step stays readable; one never read is refused
                    assert out[-2].whole_row() is fetched[-2]
                    with pytest.raises(RuntimeError, match="overwrote"):
                        dataclasses.replace(out[-2], read_rows={}).whole_row()
        runs.append(out)
        assert ex.graphed_stage_steps - graphed0 >= len(tokens) - 1, "single-token steps did not run as graphs"
        s.close()
    for top, row, got in zip(*runs, fetched, strict=True):
        assert isinstance(top, TopLogits)
        _check_top(top, row[None, :], k)
        np.testing.assert_allclose(got, row, rtol=0, atol=1e-5 * float(np.max(np.abs(row))))
    # a batch of 9, the same way (a batch is captured the second time in a row it decodes together)
    runs = []
    for want in (k, 0):
        sessions = [model.new_session(capacity=64) for _ in prompts]
        for s, p in zip(sessions, prompts, strict=True):
            s.prefill(p)
        pos = [int(s.position) for s in sessions]
        batch0 = ex.batch_graph_steps
        out = []
        for step in range(len(tokens)):
            out.append(ex.forward_batch([[int(t)] for t in tokens[step]], [s.states for s in sessions],
                                        [np.array([q + step]) for q in pos], top=want))
            if want:  # each sequence's row, as the scheduler hands it out
                fetched.append(np.stack([out[-1].row(b).whole_row() for b in range(len(prompts))]))
        assert ex.batch_graph_steps - batch0 >= len(tokens) - 1, "batched steps did not run as graphs"
        runs.append(out)
        for s in sessions:
            s.close()
    for top, rows, got in zip(*runs, fetched[len(tokens):], strict=True):
        assert isinstance(top, TopLogits) and isinstance(rows, np.ndarray)
        _check_top(top, rows, k)
        np.testing.assert_allclose(got, rows, rtol=0, atol=1e-5 * float(np.max(np.abs(rows))))
    model.close()


@pytest.mark.parametrize("which", ["qwen", "gemma"])
def test_a_batch_graph_serves_the_next_sequences(files, which):
    """A batch graph captured for some sequences is bound to others of the same layouts when they take
    their place (their states' addresses into its pointer tables: CupyBackend's _BatchGraph.bind), so
    a batch whose members changed replays at once: the new sequences' logits equal the same batch run
    eagerly, step for step, also after the first sequences' sessions were closed. Gemma 3's attention
    reads its caches per sequence (addresses baked into the graph): it is never bound to others and
    is captured again as before."""
    mg, be = _load(files[which], "dp4a", graphs=True)
    me, _ = _load(files[which], "dp4a", graphs=False)
    steps, batch = 5, 3
    first, tokens = _work(mg, batch, steps, seed=21)
    second, tokens2 = _work(mg, batch, steps, seed=22)
    capacity = 64  # one capacity for every sequence: one layout, no growth
    _batched(mg, first, tokens, capacity, {})  # captures the batch's graph (step 2), then replays
    graphed0 = mg.executor.batch_graph_steps
    assert graphed0 == steps - 1
    got = _batched(mg, second, tokens2, capacity, {})  # new sessions: the graph is bound to them
    want = _batched(me, second, tokens2, capacity, {})
    if which == "qwen":
        assert be.batch_rebinds == 1
        assert mg.executor.batch_graph_steps - graphed0 == steps  # every step, the first included
    else:
        assert be.batch_rebinds == 0
        assert mg.executor.batch_graph_steps - graphed0 == steps - 1  # the first step eager, then a capture
    for b in range(batch):
        err = float(np.max(np.abs(got[b] - want[b])) / np.max(np.abs(want[b])))
        assert err <= 1e-5, f"sequence {b}: {err:.2e}"
    # a third set joining while an earlier sequence is still open (a different set of the same size)
    keep = mg.new_session(capacity=capacity)
    keep.prefill(first[0])
    third_prompts = [first[0], second[1], second[2]]
    sessions = [keep] + [mg.new_session(capacity=capacity) for _ in range(2)]
    twins = [me.new_session(capacity=capacity) for _ in range(3)]
    for s, p in zip(sessions[1:], third_prompts[1:], strict=True):
        s.prefill(p)
    for s, p in zip(twins, third_prompts, strict=True):
        s.prefill(p)
    pos = [int(s.position) for s in sessions]
    for k in range(3):
        ids = [[int(tokens[k][b])] for b in range(3)]
        at = [np.array([p + k]) for p in pos]
        g = mg.executor.forward_batch(ids, [s.states for s in sessions], at)
        e = me.executor.forward_batch(ids, [s.states for s in twins], [a.copy() for a in at])
        assert float(np.max(np.abs(g - e)) / np.max(np.abs(e))) <= 1e-5
    if which == "qwen":
        assert be.batch_rebinds == 2
    # a graph kept for others holds no state of a sequence that ended (its recurrent arrays go with it)
    import gc
    import weakref

    gone = weakref.ref(sessions[1].states[0])
    for s in sessions + twins:
        s.close()
    fourth = [mg.new_session(capacity=capacity) for _ in range(3)]
    for s, p in zip(fourth, second, strict=True):
        s.prefill(p)
    mg.executor.forward_batch([[5]] * 3, [s.states for s in fourth], [np.array([s.position]) for s in fourth])
    del sessions, s
    gc.collect()
    assert gone() is None, "a batch graph keeps an ended sequence's states"
    for s in fourth:
        s.close()
    mg.close()
    me.close()
