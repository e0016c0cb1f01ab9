"""Weights laid out once at load on the CUDA backend (CupyBackend.load_fused): each ArchSpec fused group
is one device array per QWeight field, each member's QWeight a row view of it; the first prefill and
decode steps move no weight and allocate no weight memory; the results equal weights loaded apart.
Models: synthetic Qwen3.5-0.8B-shaped files (4 layers, vocabulary 640) in Q4_K and Q8_0."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from minecart.engine import load_model
from minecart.engine.backends.base import FusedOpsMixin
from minecart.engine.models import spec_for

cp = pytest.importorskip("cupy")

from .test_kernels import make_tensor, nerr  # noqa: E402  (after the skip: it imports cupy)

pytestmark = pytest.mark.gpu

SMALL_BUFFERS = 4 << 20  # see test_first_steps_allocate_no_weight_memory_and_match_weights_apart
PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, 640, size=40)]


@pytest.fixture(scope="module", params=["q4_k", "q8_0"])
def path(request, tmp_path_factory):
    from minecart.engine.synth import SHAPES, write_synthetic

    p = tmp_path_factory.mktemp("groups") / f"s08-{request.param}.gguf"
    write_synthetic(p, replace(SHAPES["qwen3.5-0.8b"], vocab_size=640), request.param, seed=3, n_layers=4,
                    mtp=False)
    return p


def _apart_backend():
    from minecart.engine.backends.cupy_backend import CupyBackend

    class Apart(CupyBackend):
        def load_fused(self, infos):
            return FusedOpsMixin.load_fused(self, infos)

    return Apart("cuda:0")


def _pointers(model) -> dict:
    from minecart.engine.backends.cupy_backend import CupyWeight

    return {n: (w.q.wq.data.ptr, None if w.q.wd is None else w.q.wd.data.ptr, id(w.group and w.group.q))
            for ws in model.weights.values() for n, w in ws.items() if isinstance(w, CupyWeight)}


def test_groups_are_one_array_with_row_views(path):
    from minecart.engine.backends.cupy_backend import CupyBackend, CupyWeight

    with load_model(path, backend=CupyBackend("cuda:0")) as model:
        spec = spec_for(model.config.architecture)
        groups = [g for part in model._roles.values() for g in spec.fused_members(part)]
        assert len(groups) == 2 * model.config.n_layers
        flat = {n: w for ws in model.weights.values() for n, w in ws.items()}
        for g in groups:
            ws = [flat[n] for n in g]
            assert all(isinstance(w, CupyWeight) for w in ws)
            rec = ws[0].group
            assert rec is not None and rec.q is not None, f"{g} was not laid out as one array"
            assert [w.group for w in ws] == [rec] * len(ws) and [w.index for w in ws] == list(range(len(ws)))
            big = rec.q
            assert big.rows == sum(w.q.rows for w in ws) == rec.ranges[-1][1]
            for w, (a, b) in zip(ws, rec.ranges, strict=True):
                assert w.q.rows == b - a
                assert w.q.wq.data.ptr == big.wq.data.ptr + a * big.wq.strides[0]
                if big.wd is not None:
                    assert w.q.wd.data.ptr == big.wd.data.ptr + a * big.wd.strides[0]


def test_first_steps_allocate_no_weight_memory_and_match_weights_apart(path):
    from minecart.engine.backends.cupy_backend import CupyBackend

    pool = cp.get_default_memory_pool()
    be = CupyBackend("cuda:0")
    with load_model(path, backend=be) as model:
        before = _pointers(model)
        flat = {n: w for ws in model.weights.values() for n, w in ws.items()}
        spec = spec_for(model.config.architecture)
        # half the smallest group (>= 2.9 MB here): any weight-sized allocation exceeds it
        bound = min(sum(flat[n].nbytes for n in g) for part in model._roles.values()
                    for g in spec.fused_members(part)) // 2
        cp.cuda.Device(0).synchronize()
        loaded = pool.used_bytes()
        states = model.new_state(64)
        n = len(PROMPT)
        model.forward(PROMPT, states, np.arange(n))  # the first prefill
        model.executor.use_graphs = be.use_graphs = False
        cp.cuda.Device(0).synchronize()
        used = pool.used_bytes()
        model.forward([7], states, np.array([n]))  # the first decode step, eager
        cp.cuda.Device(0).synchronize()
        step = pool.used_bytes() - used
        assert step < bound, f"the first decode step kept {step} bytes"
        model.executor.use_graphs = be.use_graphs = True
        for t in range(3):  # captured and replayed decode steps
            model.forward([11 + t], states, np.array([n + 1 + t]))
        assert _pointers(model) == before  # no weight moved, no group rebuilt
        model._free_states(states)
        be.release_cached()
        cp.cuda.Device(0).synchronize()
        # nothing group-sized appeared after the load: what may stay is the steps' own small buffers,
        # about the same for every format (H200: 3.2 MB with the q8_0 fixture, 3.36 MB with q4_k), under
        # SMALL_BUFFERS; a group rebuilt or copied would add at least 2 * bound on top
        assert pool.used_bytes() - loaded < SMALL_BUFFERS + bound
        grouped = model.logits(PROMPT)
    with load_model(path, backend=_apart_backend()) as apart:
        assert all(g == id(None) for _, _, g in _pointers(apart).values())
        ref = apart.logits(PROMPT)
    assert np.all(np.isfinite(grouped))
    assert nerr(grouped, ref) < 1e-4


def test_mixed_formats_load_as_runs_of_one_type_and_freeing_a_member_keeps_the_others(poison):
    from minecart.engine.backends.cupy_backend import CupyBackend

    gb = CupyBackend("cuda:0")
    gb.use_graphs = False
    rng = np.random.default_rng(9)
    K = 512
    x = rng.standard_normal((2, K)).astype(np.float32)
    gx = gb.asarray(x)
    mixed = [make_tensor(rng, t, (R, K), 0.05, name=f"m{i}") for i, (t, R) in
             enumerate((("Q8_0", 96), ("Q4_K", 64), ("Q8_0", 32)))]
    ws = gb.load_fused(mixed)
    assert all(w.group is None for w in ws)  # no two neighbours of one type: each apart
    ref = [gb.to_numpy(gb.matmul(gx, gb.load_weight(i))) for i in mixed]
    poison()
    for y, r in zip(gb.matmul_many(gx, ws), ref, strict=True):
        np.testing.assert_array_equal(gb.to_numpy(y), r)
    # a llama-quantize mix's Gated DeltaNet group: Q6_K attn_qkv, then Q4_K attn_gate, ssm_beta, ssm_alpha
    runs = [make_tensor(rng, t, (R, K), 0.05, name=f"r{i}") for i, (t, R) in
            enumerate((("Q6_K", 96), ("Q4_K", 64), ("Q4_K", 32), ("Q4_K", 32), ("Q8_0", 64), ("Q8_0", 32)))]
    ws = gb.load_fused(runs)
    assert ws[0].group is None
    assert ws[1].group is not None and [w.group for w in ws[1:4]] == [ws[1].group] * 3
    assert [w.index for w in ws[1:4]] == [0, 1, 2] and ws[1].group.q.rows == 128
    assert ws[4].group is not None and ws[5].group is ws[4].group and ws[4].group is not ws[1].group
    for T in (1, 2, 40):  # the GEMV, the batched-decode tile and the prefill GEMM
        xt = gb.asarray(rng.standard_normal((T, K)).astype(np.float32))
        ref = [gb.to_numpy(gb.matmul(xt, gb.load_weight(i))) for i in runs]
        poison()
        outs = gb.matmul_many(xt, ws)
        assert len(outs) == len(runs)
        for y, r in zip(outs, ref, strict=True):
            assert y.shape == r.shape and nerr(gb.to_numpy(y), r) < 1e-5
    same = [make_tensor(rng, "Q4_K", (R, K), 0.05, name=f"s{i}") for i, R in enumerate((256, 33, 7))]
    ws = gb.load_fused(same)
    rec = ws[0].group
    assert rec is not None and rec.q is not None
    ref = [gb.to_numpy(gb.matmul(gx, gb.load_weight(i))) for i in same]
    gb.free(ws[1])
    assert rec.q is None and ws[1].group is None
    poison()
    outs = gb.matmul_many(gx, [ws[0], ws[2]])  # the group is gone: separate matmuls on the row views
    for y, r in zip(outs, (ref[0], ref[2]), strict=True):
        np.testing.assert_allclose(gb.to_numpy(y), r, rtol=1e-6, atol=1e-6 * np.abs(r).max())


def test_a_q4_k_m_file_groups_each_run_of_one_type(tmp_path):
    """A `minecart synth --quant q4_k_m` file (llama-quantize's mix): where a group mixes types, each run
    of neighbours of one type is one array; the model's logits and decode steps equal weights apart."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.synth import SHAPES, write_synthetic

    p = tmp_path / "s08-q4_k_m.gguf"
    write_synthetic(p, replace(SHAPES["qwen3.5-0.8b"], vocab_size=640), "q4_k_m", seed=3, n_layers=4, mtp=False)
    with load_model(p, backend=CupyBackend("cuda:0")) as model:
        flat = {n: w for ws in model.weights.values() for n, w in ws.items()}
        # 4 attn_v-like tensors: more_bits raises the 3rd (layer 2's attn_qkv) and the 4th (layer 3's attn_v)
        assert flat["blk.2.attn_qkv.weight"].type_name == "Q6_K" and flat["blk.2.attn_qkv.weight"].group is None
        gdn = [flat[f"blk.2.{t}.weight"] for t in ("attn_gate", "ssm_beta", "ssm_alpha")]
        assert gdn[0].group is not None and [w.group for w in gdn] == [gdn[0].group] * 3
        q, k, v = (flat[f"blk.3.attn_{t}.weight"] for t in "qkv")
        assert v.type_name == "Q6_K" and v.group is None and q.group is not None and k.group is q.group
        assert flat["blk.0.attn_qkv.weight"].group is flat["blk.0.ssm_alpha.weight"].group is not None
        grouped = model.logits(PROMPT)
        states = model.new_state(64)
        n = len(PROMPT)
        model.forward(PROMPT, states, np.arange(n))
        steps = [model.forward([11 + t], states, np.array([n + t])) for t in range(3)]
        model._free_states(states)
    with load_model(p, backend=_apart_backend()) as apart:
        ref = apart.logits(PROMPT)
        states = apart.new_state(64)
        apart.forward(PROMPT, states, np.arange(n))
        ref_steps = [apart.forward([11 + t], states, np.array([n + t])) for t in range(3)]
        apart._free_states(states)
    assert np.all(np.isfinite(grouped)) and nerr(grouped, ref) < 1e-4
    for a, b in zip(steps, ref_steps, strict=True):
        assert nerr(np.asarray(a), np.asarray(b)) < 1e-4

