"""The batched decode mixers (CupyBackend.gdn_decode_batch / gated_attention_batch: kernels/fused.cu
gdn_decode_batch and attn_merge_gate_batch, attn_prep.cu attn_prep_batch, attention.cu flash_decode_batch)
against the NumPy reference (base.FusedOpsMixin's per-row loop on NumpyBackend) and against the
single-sequence CUDA ops row by row, on fresh random inputs:

- GDN: odd and real (9B) head shapes, B = 2, 5, 8, three consecutive tokens (the states carry over),
  the q8_1 side output against quantize_q8_1 of the output;
- attention: sequences of different lengths in one batch (a first token, a short one and one across
  many flash_decode slices), every KV type the fused step writes (f32, f16, q8_0), text and M-RoPE
  positions, caches that grow during the steps; the stored K/V rows against the per-row op's;
- the same ops captured in the batch CUDA graph (CupyBackend.graph_step with a tuple of owners) against
  the eager ops: bit-identical (the same kernels, slices sized for the caches' capacities both ways);
- the fixture model through Executor.forward_batch (graphed and eager, every KV type): each sequence's
  logits and greedy tokens as when it runs alone, the batched kernels actually launched.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from minecart.engine.backends.base import LayerState
from minecart.engine.backends.numpy_backend import NumpyBackend

cp = pytest.importorskip("cupy")

from .test_batching_gpu import _batched  # noqa: E402
from .test_fused import GDN_SHAPES, _check_q8, _gdn_inputs, _published  # noqa: E402  (needs cupy)
from .test_kernels import nerr  # noqa: E402

pytestmark = pytest.mark.gpu

ATTN_KV_TOL = {"f32": 2e-5, "f16": 2e-3, "q8_0": 1e-2}  # as tests/gpu/test_fused.py (typed caches round)


@pytest.fixture(scope="module")
def nb():
    return NumpyBackend()


def _cupy(path: str = "dp4a", graphs: bool = False):
    from minecart.engine.backends.cupy_backend import CupyBackend

    be = CupyBackend("cuda:0", path=path)
    be.use_graphs = graphs
    return be


@pytest.fixture(scope="module", params=["dp4a", "fma"])
def gb(request):
    return _cupy(request.param)


class _Launches:
    """Counts get_kernel look-ups of kernels/fused.py (each is one launch) by kernel name."""

    def __init__(self, monkeypatch):
        from minecart.kernels import fused

        self.counts: Counter = Counter()
        real = fused.get_kernel

        def counting(module, name):
            self.counts[name.split("<")[0]] += 1
            return real(module, name)

        monkeypatch.setattr(fused, "get_kernel", counting)


# ---- Gated DeltaNet ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("B", [2, 5, 8])
@pytest.mark.parametrize("shape", GDN_SHAPES, ids=lambda s: "nk{}-nv{}-dk{}-dv{}-kw{}".format(*s))
def test_gdn_decode_batch(nb, gb, poison, monkeypatch, shape, B):
    n_k, n_v, dk, dv, kw = shape
    rng = np.random.default_rng(sum(shape) * 10 + B)
    C = 2 * n_k * dk + n_v * dv
    conv = [rng.standard_normal((kw - 1, C)).astype(np.float32) for _ in range(B)]
    ssm = [(rng.standard_normal((n_v, dk, dv)) * 0.1).astype(np.float32) for _ in range(B)]
    g_conv, g_ssm = [gb.asarray(a) for a in conv], [gb.asarray(a) for a in ssm]
    one_conv, one_ssm = [gb.asarray(a) for a in conv], [gb.asarray(a) for a in ssm]  # the per-row twin
    _, wts = _gdn_inputs(rng, n_k, n_v, dk, dv, kw, 1)
    g_wts = [gb.asarray(v) for v in wts.values()]
    dims = dict(n_k=n_k, n_v=n_v, dk=dk, dv=dv, eps=1e-6)
    launches = _Launches(monkeypatch)
    worst = worst_one = 0.0
    for step in range(3):
        acts, _ = _gdn_inputs(rng, n_k, n_v, dk, dv, kw, B)
        mixed, z, b, alpha = acts.values()
        ref = nb.gdn_decode_batch(mixed, z, b, alpha, conv, ssm, *wts.values(), **dims)
        g_acts = [gb.asarray(a) for a in (mixed, z, b, alpha)]
        one = np.concatenate([gb.to_numpy(gb.gdn_decode(*(a[i:i + 1] for a in g_acts), one_conv[i], one_ssm[i],
                                                        *g_wts, **dims)) for i in range(B)])
        poison()
        launches.counts.clear()
        y = gb.gdn_decode_batch(*g_acts, g_conv, g_ssm, *g_wts, **dims)
        assert launches.counts == Counter({"gdn_decode_batch": 1}), dict(launches.counts)
        q8 = _published(y)
        got = gb.to_numpy(y)
        assert got.shape == (B, n_v * dv)
        for i in range(B):
            err = nerr(got[i], ref[i])
            worst = max(worst, err)
            assert err < 2e-5, f"step {step} sequence {i}: error {err:.2e} against NumPy"
            worst_one = max(worst_one, nerr(got[i], one[i]))
            np.testing.assert_array_equal(gb.to_numpy(g_conv[i]), conv[i])  # data movement: exact
            np.testing.assert_array_equal(gb.to_numpy(g_conv[i]), gb.to_numpy(one_conv[i]))
            assert nerr(gb.to_numpy(g_ssm[i]), ssm[i]) < 2e-5
        if gb.gemv_path == "dp4a" and dv % 32 == 0:
            assert q8 is not None
            _check_q8(y, q8)
    print(f"\ngdn_decode_batch {shape} B={B} ({gb.gemv_path}): max nerr vs NumPy {worst:.2e}, "
          f"vs the single op per row {worst_one:.2e}")
    assert worst_one < 1e-6  # the same device code per sequence (bit-identical expected)


# ---- gated attention ----------------------------------------------------------------------------------------

ATTN_SHAPES = [  # nh, n_kv, d, rope dims, M-RoPE sections
    (4, 1, 64, 16, ()),
    (6, 2, 128, 64, ()),
    (16, 4, 256, 64, ()),  # Qwen3.5 9B
    (8, 2, 128, 64, (11, 11, 10)),
]
LENGTHS = (0, 37, 300, 5)  # a first token, short, across ~10 flash_decode slices, short again


def _prefill(be, cache, rng, n, nh, n_kv, d, kw):
    """n tokens into a cache through the backend's composed (prefill) gated attention."""
    if n:
        pos = np.stack([np.arange(n)] * 3) if kw.get("sections") else np.arange(n)
        be.gated_attention(be.asarray(rng.standard_normal((n, nh, 2, d)).astype(np.float32)),
                           be.asarray(rng.standard_normal((n, n_kv, d)).astype(np.float32)),
                           be.asarray(rng.standard_normal((n, n_kv, d)).astype(np.float32)),
                           cache, be.asarray(np.ones(d, np.float32)), be.asarray(np.ones(d, np.float32)),
                           pos, **kw)


def _cache_rows(be, cache, L: int):
    """(K, V) rows [0, L) of a cache as stored, on the host."""
    return be.to_numpy(cache.k[:L]), be.to_numpy(cache.v[:L])


def _widen(rows: np.ndarray, kv: str, d: int) -> np.ndarray:
    """Stored rows (L, n_kv, ...) as float32 values (L, n_kv, d): q8_0 blocks are fp16 scale + 32 int8."""
    if kv == "q8_0":
        blocks = np.ascontiguousarray(rows).reshape(rows.shape[0], rows.shape[1], d // 32, 34)
        scale = blocks[..., :2].copy().view(np.float16).astype(np.float32)
        quants = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
        return (quants * scale).reshape(rows.shape[0], rows.shape[1], d)
    return rows.astype(np.float32)


@pytest.mark.parametrize("kv", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=lambda s: "nh{}-kv{}-d{}-rot{}-{}".format(*s[:4], len(s[4])))
def test_gated_attention_batch(nb, gb, poison, monkeypatch, shape, kv):
    nh, n_kv, d, n_rot, sections = shape
    B = len(LENGTHS)
    rng = np.random.default_rng(nh * d + n_rot + len(kv))
    kw = dict(n_rot=n_rot, base=10000.0, sections=sections, scale=1.0 / math.sqrt(d), eps=1e-6)
    qn = (1 + 0.2 * rng.standard_normal(d)).astype(np.float32)
    kn = (1 + 0.2 * rng.standard_normal(d)).astype(np.float32)
    n_caches, g_caches, one_caches = [], [], []
    for i, n in enumerate(LENGTHS):
        seed = 1000 * i + n
        # capacity 8: the caches grow on the way (the long one during the prefill, the others later)
        for be, caches in ((nb, n_caches), (gb, g_caches), (gb, one_caches)):
            c = be.new_kv_cache(n_kv, d, d, 8, kv_type=kv)
            _prefill(be, c, np.random.default_rng(seed), n, nh, n_kv, d, kw)
            caches.append(c)
    launches = _Launches(monkeypatch)
    worst = worst_one = 0.0
    for step in range(12):
        qg = rng.standard_normal((B, nh, 2, d)).astype(np.float32)
        k = rng.standard_normal((B, n_kv, d)).astype(np.float32)
        v = rng.standard_normal((B, n_kv, d)).astype(np.float32)
        if sections:
            positions = [np.array([[p], [p + 3], [p * 2 % 7]]) for p in (n + step for n in LENGTHS)]
        else:
            positions = [np.array([n + step]) for n in LENGTHS]
        ref = nb.gated_attention_batch(qg, k, v, n_caches, qn, kn, positions, **kw)
        g = [gb.asarray(a) for a in (qg, k, v)]
        g_qn, g_kn = gb.asarray(qn), gb.asarray(kn)
        one = np.concatenate([gb.to_numpy(gb.gated_attention(*(a[i:i + 1] for a in g), one_caches[i], g_qn, g_kn,
                                                             positions[i], **kw)) for i in range(B)])
        poison()
        launches.counts.clear()
        y = gb.gated_attention_batch(*g, g_caches, g_qn, g_kn, positions, **kw)
        assert launches.counts == Counter({"attn_prep_batch": 1, "flash_decode_batch": 1,
                                           "attn_merge_gate_batch": 1}), dict(launches.counts)
        q8 = _published(y)
        got = gb.to_numpy(y)
        assert got.shape == (B, nh * d)
        for i in range(B):
            err = nerr(got[i], ref[i])
            worst = max(worst, err)
            assert err < ATTN_KV_TOL[kv], f"{kv} step {step} sequence {i} (length {LENGTHS[i]}): {err:.2e}"
            worst_one = max(worst_one, nerr(got[i], one[i]))
        if gb.gemv_path == "dp4a":
            assert q8 is not None
            _check_q8(y, q8)
    for i, n in enumerate(LENGTHS):
        L = n + 12
        assert g_caches[i].length == one_caches[i].length == n_caches[i].length == L
        gk, gv = _cache_rows(gb, g_caches[i], L)
        ok, ov = _cache_rows(gb, one_caches[i], L)
        np.testing.assert_array_equal(gv, ov)  # V rows are stored from the same fp32 values
        # K rows: the same norm + RoPE device code as the single op (a last-bit difference may round to
        # the neighbouring f16 / int8 step)
        err = nerr(_widen(gk, kv, d), _widen(ok, kv, d))
        assert err < {"f32": 1e-6, "f16": 1e-3, "q8_0": 1e-2}[kv], f"{kv} sequence {i}: K rows {err:.2e}"
    print(f"\ngated_attention_batch {shape} {kv} ({gb.gemv_path}): max nerr vs NumPy {worst:.2e}, "
          f"vs the single op per row {worst_one:.2e}")
    assert worst_one < 1e-5  # other context slices than the single op: fp32 rounding only


# ---- the batch CUDA graph ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv", ["f32", "f16", "q8_0"])
def test_batched_mixers_in_the_batch_graph_equal_eager(kv):
    """A step of one GDN and one attention layer for 4 sequences through graph_step (captured after the
    eager step that makes the pointer tables, replayed, re-captured when a cache grows) against the same
    steps run eagerly on twin states: bit-identical outputs and states."""
    n_k, n_v, dk, dv, kw_ = 2, 4, 128, 128, 4
    nh, n_kv, d = 8, 2, 128
    C = 2 * n_k * dk + n_v * dv
    B, steps = 4, 14
    rng = np.random.default_rng(3)
    lengths = (0, 6, 100, 7)  # capacity 8: two caches grow during the steps (those steps run eagerly)
    att = dict(n_rot=64, base=10000.0, scale=1.0 / math.sqrt(d), eps=1e-6)
    gdn_w = [(rng.standard_normal((C, kw_)) * 0.5).astype(np.float32), -np.exp(rng.standard_normal(n_v)),
             rng.standard_normal(n_v), 1 + 0.2 * rng.standard_normal(dv)]
    norms = [(1 + 0.2 * rng.standard_normal(d)).astype(np.float32) for _ in range(2)]
    conv0 = [rng.standard_normal((kw_ - 1, C)).astype(np.float32) for _ in range(B)]
    ssm0 = [(rng.standard_normal((n_v, dk, dv)) * 0.1).astype(np.float32) for _ in range(B)]

    def setup(be):
        owners = []
        for i in range(B):
            gdn = LayerState(recurrent={"conv": be.asarray(conv0[i]), "ssm": be.asarray(ssm0[i])})
            cache = be.new_kv_cache(n_kv, d, d, 8, kv_type=kv)
            _prefill(be, cache, np.random.default_rng(i), lengths[i], nh, n_kv, d, att)
            owners.append([gdn, LayerState(kv=cache)])
        ins = {"gdn": [be.zeros((B, C)), be.zeros((B, n_v * dv)), be.zeros((B, n_v)), be.zeros((B, n_v))],
               "att": [be.zeros((B, nh, 2, d)), be.zeros((B, n_kv, d)), be.zeros((B, n_kv, d))]}
        w = [be.asarray(np.asarray(a, np.float32)) for a in gdn_w]
        nw = [be.asarray(a) for a in norms]
        cur: dict = {}

        def run(ids):
            st = cur["owners"]
            y = be.gdn_decode_batch(*ins["gdn"], [s[0].recurrent["conv"] for s in st],
                                    [s[0].recurrent["ssm"] for s in st], *w, n_k=n_k, n_v=n_v, dk=dk, dv=dv,
                                    eps=1e-6)
            o = be.gated_attention_batch(*ins["att"], [s[1].kv for s in st], *nw, cur["pos"], **att)
            return be.to_numpy(cp.concatenate([y, o], axis=1))

        cur["owners"] = tuple(owners)
        return owners, ins, run, cur

    g_be, e_be = _cupy("dp4a", graphs=True), _cupy("dp4a", graphs=False)
    g_owners, g_ins, g_run, g_cur = setup(g_be)
    e_owners, e_ins, e_run, e_cur = setup(e_be)
    replayed = 0
    for step in range(steps):
        host = {"gdn": [rng.standard_normal(tuple(a.shape)).astype(np.float32) for a in g_ins["gdn"]],
                "att": [rng.standard_normal(tuple(a.shape)).astype(np.float32) for a in g_ins["att"]]}
        for ins in (g_ins, e_ins):
            for key in ins:
                for dst, src in zip(ins[key], host[key], strict=True):
                    dst[...] = cp.asarray(src)  # in place: a captured graph reads these addresses
        pos = tuple(np.array([n + step], dtype=np.int64) for n in lengths)
        g_cur["pos"] = e_cur["pos"] = pos
        ids = [1] * B
        out = g_be.graph_step(("batch", B), g_run, ids, pos, owner=tuple(g_owners),
                              watch=[s for seq in g_owners for s in seq])
        if out is None:
            out = g_run(ids)
        else:
            replayed += 1
        ref = e_run(ids)
        np.testing.assert_array_equal(np.asarray(out), ref, err_msg=f"step {step}")
        for gs, es in zip(g_owners, e_owners, strict=True):
            np.testing.assert_array_equal(g_be.to_numpy(gs[0].recurrent["ssm"]), e_be.to_numpy(es[0].recurrent["ssm"]))
            assert gs[1].kv.length == es[1].kv.length
    print(f"\nbatch graph {kv}: {replayed} of {steps} steps from a graph")
    assert replayed >= 4, "the batched mixers (almost) never ran from a captured graph"
    assert not g_be._batch_eager


# ---- the fixture model through forward_batch --------------------------------------------------------------------

@pytest.mark.parametrize("kv", ["f32", "f16", "q8_0"])
def test_fixture_model_batch_tokens_equal_each_alone(fixtures_dir, monkeypatch, kv):
    """Teacher-forced greedy decoding of 5 prompts of different lengths through forward_batch (graphed
    and eager) against each sequence alone (the single-token graph): the same argmax wherever alone's
    top-2 margin is clear, logits close; the batched kernels run in the eager batch."""
    from minecart.engine.model import load_model

    path = fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf"
    models = {}
    for name, graphs in (("graph", True), ("eager", False)):
        be = _cupy("fma", graphs=graphs)
        models[name] = load_model(path, backend=be, kv_type=kv)
    vocab = int(models["graph"].config.vocab_size)
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(1, vocab, n)] for n in (1, 9, 40, 3, 17)]
    steps = 12
    # greedy alone: each sequence's own argmax chain; then the batch is fed those same tokens
    greedy, ref_logits = [], []
    for p in prompts:
        s = models["eager"].new_session(capacity=16)
        logits = s.prefill(p)
        toks, rows = [], []
        for _ in range(steps):
            toks.append(int(np.argmax(logits)))
            logits = s.step(toks[-1])
            rows.append(logits)
        s.close()
        greedy.append(toks)
        ref_logits.append(np.stack(rows))
    tokens = np.array(greedy).T  # (steps, B)
    launches = _Launches(monkeypatch)
    got = {name: _batched(m, prompts, tokens, 16, {}) for name, m in models.items()}
    assert launches.counts["gdn_decode_batch"] > 0 and launches.counts["flash_decode_batch"] > 0
    gbe = next(iter(models["graph"].backends.values()))
    ex = models["graph"].executor
    assert ex.batch_graph_steps > 0, (
        f"no batch step ran from a graph; eager batch sizes {sorted(gbe._batch_eager)}, last capture error "
        f"'{gbe.batch_capture_error}', executor graphs {ex.use_graphs}, stages {len(ex.stages)}, backend "
        f"graphs {gbe.use_graphs} ('{gbe.graph_capture_error}'), batch graphs kept {list(gbe._batch_graphs)}")
    for b in range(len(prompts)):
        for name in got:
            rows = got[name][b]
            ref = ref_logits[b]
            err = float(np.max(np.abs(rows - ref)) / np.max(np.abs(ref)))
            assert err < 1e-3, f"{kv} {name} sequence {b}: logits {err:.2e} from alone"
            top2 = np.sort(ref, axis=1)[:, -2:]
            clear = (top2[:, 1] - top2[:, 0]) >= 1e-3
            assert np.array_equal(np.argmax(rows, axis=1)[clear], np.argmax(ref, axis=1)[clear]), \
                f"{kv} {name} sequence {b}: greedy tokens differ from alone"
        assert float(np.max(np.abs(got["graph"][b] - got["eager"][b]))) <= 1e-5 * float(np.max(np.abs(got["eager"][b])))
    for m in models.values():
        m.close()
