"""The weight prefetch branch of captured decode steps (engine/backends/cupy_backend.py _WeightPrefetch,
kernels/elementwise.cu l2_prefetch): it asks the L2 cache for weight bytes and must change nothing else.

- l2_prefetch leaves the array as it was, clips to the array's size and launches nothing for 0 bytes;
- a captured step with the branch gives the same logits, bit for bit, as one captured without it,
  token after token, single sequences and batched ones; and the graph holds the branch's kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu._compare import FIXTURES

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu


def test_l2_prefetch_touches_nothing(monkeypatch):
    from minecart.kernels import ops

    a = cp.random.RandomState(3).randint(0, 256, size=(3 << 20) + 77, dtype=cp.int32).astype(cp.uint8)
    before = a.copy()
    for n in (1, 128, 1000, a.nbytes, 10 * a.nbytes):
        ops.l2_prefetch(a, n)
    cp.cuda.runtime.deviceSynchronize()
    assert bool((a == before).all())
    asked: list[str] = []
    real = ops.get_kernel
    monkeypatch.setattr(ops, "get_kernel", lambda mod, name: asked.append(name) or real(mod, name))
    ops.l2_prefetch(a, 0)
    ops.l2_prefetch(a[:0], 4096)
    assert asked == []


def _greedy_logits(model, prompt, steps: int, share: float) -> list[np.ndarray]:
    be = model.backends["global"]
    be.l2_prefetch_share = share
    be._graphs.clear()
    s = model.new_session(len(prompt) + steps + 8)
    logits = s.prefill(prompt)
    out = []
    for _ in range(steps):
        logits = s.step(int(np.argmax(logits)))
        out.append(np.array(logits))
    s.close()
    return out


def _model(path):
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.model import load_model

    be = CupyBackend("cuda:0", path="dp4a")
    return load_model(path, backend=be), be


def test_decode_with_the_prefetch_branch_equals_without(fixtures_dir):
    model, be = _model(fixtures_dir / FIXTURES["q8_0"])
    prompt = [5, 17, 300, 42, 9, 1000, 77]
    off = _greedy_logits(model, prompt, 12, 0.0)
    assert be._prefetch is None
    graphed = model.executor.graphed_stage_steps
    on = _greedy_logits(model, prompt, 12, 0.5)
    assert be._prefetch is not None and be._prefetch.budget > 0
    assert model.executor.graphed_stage_steps - graphed >= 10  # the steps ran through graphs
    for i, (a, b) in enumerate(zip(off, on, strict=True)):
        assert np.array_equal(a, b), f"step {i}"


def test_the_captured_step_holds_the_prefetch_kernels(fixtures_dir, monkeypatch):
    from minecart.kernels import ops

    model, be = _model(fixtures_dir / FIXTURES["q8_0"])
    be.l2_prefetch_share = 0.5
    sizes: list[int] = []
    real = ops.l2_prefetch
    monkeypatch.setattr(ops, "l2_prefetch", lambda a, n: sizes.append(int(n)) or real(a, n))
    s = model.new_session(64)
    logits = s.prefill([5, 17, 300])
    assert sizes == []  # prefill (eager): no prefetch
    for _ in range(3):  # eager, capture, replay
        logits = s.step(int(np.argmax(logits)))
    # the capture prefetched the quants and the scales of every matmul of the step: at least two a layer
    assert sizes and all(n > 0 for n in sizes)
    assert len(sizes) >= 2 * model.config.n_layers
    s.close()


def _batched(model, prompts, tokens) -> list[np.ndarray]:
    sessions = [model.new_session(capacity=64) for _ in prompts]
    for s, p in zip(sessions, prompts, strict=True):
        s.prefill(p)
    pos = [int(s.position) for s in sessions]
    rows = []
    for k in range(len(tokens)):
        out = model.executor.forward_batch([[int(t)] for t in tokens[k]], [s.states for s in sessions],
                                           [np.array([p]) for p in pos])
        rows.append(np.array(out))
        pos = [p + 1 for p in pos]
    for s in sessions:
        s.close()
    return rows


def test_batched_decode_with_the_prefetch_branch_equals_without(fixtures_dir):
    model, be = _model(fixtures_dir / FIXTURES["q8_0"])
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(1, 1000, 4 + b)] for b in range(4)]
    tokens = rng.integers(1, 1000, (8, 4))
    results = []
    for share in (0.0, 0.5):
        be.l2_prefetch_share = share
        be._batch_graphs.clear()
        before = model.executor.batch_graph_steps
        results.append(_batched(model, prompts, tokens))
        assert model.executor.batch_graph_steps - before >= 6  # captured and replayed
    for i, (a, b) in enumerate(zip(*results, strict=True)):
        assert np.array_equal(a, b), f"step {i}"
