"""Weights held as stored on the CPU: engine/cpu_experts.py dense_matmul and NumpyBackend(int_weights).

- The kernel against its NumPy twin, bit for bit, on fresh random blocks of every type the integer
  kernels take (row counts with tails, 1 to 70 activation rows), and the twin against gguf's own
  dequantization times float64 products within the int8 rounding bound of test_cpu_experts.
- The backend: such weights hold the file's bytes and nothing else (no float32 copy, before or after
  a matmul); decode rows and prefill chunks of any length run on the kernels; other types stay
  float32; the tied LM head stays as stored.
- The tiny Qwen3.5 Q8_0 fixture decoded token by token on stored weights, against transformers run on
  the decoded Q8_0 weights (`ref_hf_q8_0_dequant`), held to llama.cpp's own error on the same file
  (`llamacpp_q8_0`: llama.cpp also multiplies int8 activation blocks).
- Placement: a plan over GPUs and the CPU (weights priced as stored) makes the CPU hold them as
  stored; a plan on the CPU alone keeps the float32 reference.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from minecart.engine import cpu_experts as C
from minecart.engine import quants as Q
from minecart.engine.backends.numpy_backend import NumpyBackend, NumpyWeight
from minecart.engine.model import load_model, open_model_file
from minecart.engine.placement import Placement, model_costs

from tests.engine.test_cpu_experts import (
    SUPER_BLOCK_TYPES,
    TYPES,
    _bounds,
    _gguf_dense,
    _offsets,
    random_stack,
)

pytestmark = pytest.mark.skipif(not C.numba_available(), reason="numba is not installed")


def _n_in(t: int) -> int:
    return 512 if t in SUPER_BLOCK_TYPES else 544  # two super-blocks; 17 blocks (8 + 8 + 1)


@pytest.mark.parametrize("t", TYPES, ids=Q.type_name)
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 70])
def test_dense_kernel_equals_twin(t, rows):
    rng = np.random.default_rng([t, rows, 1])
    w = random_stack(rng, t, 1, 37, _n_in(t))  # 37 rows: 9 groups of 4 and a tail of 1
    x = rng.standard_normal((rows, w.n_in)).astype(np.float32) * rng.uniform(0.1, 10, (rows, 1)).astype(np.float32)
    got = C.dense_matmul(w, x, threads=2)
    twin = C.dense_matmul(w, x, fast=False)
    assert got.shape == (rows, 37) and got.dtype == np.float32
    np.testing.assert_array_equal(got, twin)


@pytest.mark.parametrize("t", TYPES, ids=Q.type_name)
def test_dense_twin_within_int8_bound_of_gguf(t):
    rng = np.random.default_rng([t, 2])
    w = random_stack(rng, t, 1, 21, _n_in(t))
    x = rng.standard_normal((5, w.n_in)).astype(np.float32)
    dense = _gguf_dense(w)[0]
    exact = x.astype(np.float64) @ dense.T
    got = C.dense_matmul(w, x, fast=False)
    xa = C.quantize_rows(x, fast=False)
    # the per-row bound of one expert with its activation row, as test_cpu_experts derives it
    bound = np.stack([_bounds(dense[None], _offsets(w)[0][None], x[r : r + 1], C.QuantizedRows(
        xa.q[r : r + 1], xa.d[r : r + 1], xa.s[r : r + 1]))[0] for r in range(5)])
    assert np.all(np.abs(got - exact) <= bound.reshape(exact.shape))
    assert np.abs(got - exact).max() > 0  # the int8 path does round: the bound is what is tested


def test_dense_refuses_bad_shapes():
    rng = np.random.default_rng(3)
    two = random_stack(rng, Q.Q8_0, 2, 8, 96)
    with pytest.raises(ValueError, match="one-matrix stack"):
        C.dense_matmul(two, np.zeros((1, 96), np.float32))
    one = random_stack(rng, Q.Q8_0, 1, 8, 96)
    with pytest.raises(ValueError, match=r"\(T, 96\)"):
        C.dense_matmul(one, np.zeros((1, 64), np.float32))
    assert C.dense_matmul(one, np.zeros((0, 96), np.float32)).shape == (0, 8)


class _Info:
    """A tensor as the GGUF reader gives it: name, type, logical shape (n_out, n_in), raw blocks."""

    def __init__(self, name: str, t: int, raw: np.ndarray, shape: tuple[int, ...]):
        self.name, self.ggml_type, self.raw, self.shape = name, t, raw, shape
        self.type_name = Q.type_name(t)
        self.n_bytes = int(raw.nbytes)


def _info(rng, t: int, n_out: int, n_in: int, name: str = "w") -> _Info:
    w = random_stack(rng, t, 1, n_out, n_in)
    return _Info(name, t, np.array(w.raw[0]), (n_out, n_in))


def test_backend_holds_stored_bytes_and_multiplies_on_the_kernels():
    rng = np.random.default_rng(4)
    info = _info(rng, Q.Q4_K, 40, 512)
    ref_be, be = NumpyBackend(), NumpyBackend(int_weights=True, expert_threads=2)
    ref_w, w = ref_be.load_weight(info), be.load_weight(info)
    assert isinstance(w, NumpyWeight) and w.stored is not None and w.nbytes == info.n_bytes
    assert ref_w.stored is None and ref_w.nbytes == 40 * 512 * 4
    for rows in (1, 8, 65, 300):  # decode rows and prefill chunks: the kernels, whatever the count
        x = rng.standard_normal((rows, 512)).astype(np.float32)
        np.testing.assert_array_equal(be.matmul(x, w), C.dense_matmul(w.stored, x))
    x3 = rng.standard_normal((2, 3, 512)).astype(np.float32)  # any leading shape: rows of the last axis
    np.testing.assert_array_equal(be.matmul(x3, w), C.dense_matmul(w.stored, x3.reshape(6, 512)).reshape(2, 3, 40))
    assert w.nbytes == info.n_bytes  # no float32 copy, before or after
    # types the kernels do not take stay float32; so does everything on the reference backend
    f16 = _Info("f", Q.F16, rng.standard_normal((8, 64)).astype(np.float16).view(np.uint8), (8, 64))
    assert be.load_weight(f16).stored is None
    # fused groups of stored weights load one by one, each as stored
    a, b = be.load_fused([_info(rng, Q.Q8_0, 16, 96, "a"), _info(rng, Q.Q8_0, 24, 96, "b")])
    assert a.stored is not None and b.stored is not None and a.shape == (16, 96) and b.shape == (24, 96)


def test_hold_weights_follows_the_layout():
    be = NumpyBackend()
    be.hold_weights("stored")
    assert be.int_weights
    be.hold_weights("numpy")
    assert not be.int_weights


def _q8(fixtures_dir):
    return fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf"


def _top_errors(rows: np.ndarray, ref: dict, what: str) -> np.ndarray:
    """|rows - ref| on the reference's top-16 ids of each position."""
    return np.abs(np.take_along_axis(rows, ref[f"{what}top_ids"], axis=1) - ref[f"{what}top_vals"])


def test_fixture_decodes_on_stored_weights_as_llama_cpp_does(fixtures_dir):
    """Every prompt token and the 32 reference continuation tokens of five sequences fed one at a time
    (the decode path: each matmul on the integer kernel), per-position top-16 logits against
    transformers on the decoded Q8_0 weights. Bound: llama.cpp's own error on the same file and
    positions (its CPU path multiplies int8 activation blocks too), over all five sequences: at most
    1.6x its mean and 2x its largest deviation, and its argmax agreement less 5 points. (Per sequence
    the largest deviations scatter: 0.4x to 3.5x llama.cpp's on these 10- to 104-token prompts, where
    the means stay within 0.96x-1.6x.) Each prompt prefilled as one chunk (its matmuls on the tile)
    gives its last position's logits within the same largest deviation."""
    be = NumpyBackend(int_weights=True, expert_threads=2)
    model = load_model(_q8(fixtures_dir), backend=be, kv_type="f32")
    ours, theirs, agree, peer_agree, prefilled = [], [], [], [], []
    try:
        head = model.weights["head"]["token_embd.weight"]
        assert head.stored is not None and head.nbytes == head.info.n_bytes  # the tied head as stored
        for seq in ["single", "short", "len70", "chat", "random100"]:
            ref = dict(np.load(fixtures_dir / "dense" / "ref_hf_q8_0_dequant" / f"{seq}.npz"))
            peer = dict(np.load(fixtures_dir / "dense" / "llamacpp_q8_0" / f"{seq}.npz"))
            session = model.new_session()
            rows = np.stack([session.step(int(t)) for t in ref["tokens"]])
            gen = np.stack([session.step(int(t)) for t in ref["gen_tokens"]])
            session.close()
            whole = model.new_session()  # the prompt as one prefill chunk: the tile kernel
            last = whole.prefill([int(t) for t in ref["tokens"]])
            whole.close()
            prefilled.append(np.abs(np.take(last, ref["top_ids"][-1]) - ref["top_vals"][-1]))
            ours += [_top_errors(rows, ref, ""), _top_errors(gen, ref, "gen_")]
            theirs += [np.abs(peer["top_vals"] - ref["top_vals"]), np.abs(peer["gen_top_vals"] - ref["gen_top_vals"])]
            agree.append(rows.argmax(1) == ref["top_ids"][:, 0])
            peer_agree.append(peer["top_ids"][:, 0] == ref["top_ids"][:, 0])
    finally:
        model.close()
    o, t = np.concatenate(ours), np.concatenate(theirs)
    assert o.mean() <= 1.6 * t.mean(), (o.mean(), t.mean())
    assert o.max() <= 2.0 * t.max(), (o.max(), t.max())
    assert o.max() > 1e-3  # int8 activations: not the float32 reference's numbers (1e-5 off)
    assert np.concatenate(prefilled).max() <= 2.0 * t.max()  # each prompt's last logits, prefilled whole
    assert np.concatenate(agree).mean() >= np.concatenate(peer_agree).mean() - 0.05


def test_placement_layout_picks_how_the_cpu_holds_weights(fixtures_dir):
    path = _q8(fixtures_dir)
    plain = load_model(path, devices=["cpu:0"])  # the CPU alone: float32, the reference
    try:
        assert plain.placement.costs.layout == "numpy"
        w = plain.weights["layer.0"]
        assert all(x.stored is None for x in w.values() if isinstance(x, NumpyWeight))
    finally:
        plain.close()
    gf, config = open_model_file(path)
    costs = model_costs(config, gf, layout="stored")  # as a plan beside a GPU prices it
    plan = Placement(costs, ["cpu:0"] * len(costs.parts))
    model = load_model(path, placement=plan)
    try:
        held = [x for x in model.weights["layer.0"].values() if isinstance(x, NumpyWeight)]
        assert held and all(x.stored is not None and x.nbytes == x.info.n_bytes for x in held
                            if x.type_name == "Q8_0")
        out = model.new_session().prefill([1, 2, 3])
        assert np.isfinite(out).all()
    finally:
        model.close()
        gc.collect()


def test_planner_prices_the_cpu_as_it_holds_and_reads_weights(fixtures_dir):
    """Beside a GPU (layout "stored") the CPU's Q8_0 matrices are priced at their file bytes and read at
    CPU_INT_DECODE_EFFICIENCY; an F16 file's matrices, which the CPU decodes to float32, at 4 bytes a
    value (what the backend holds once the head ran) and CPU_DECODE_EFFICIENCY."""
    from minecart.engine.placement import (
        CPU_DECODE_EFFICIENCY,
        CPU_INT_DECODE_EFFICIENCY,
        DeviceSpec,
        predict_speed,
    )

    def plan(name):
        gf, config = open_model_file(fixtures_dir / "dense" / name)
        costs = model_costs(config, gf, layout="stored")
        return costs, Placement.single(costs, "cpu:0"), Placement.single(costs, "cuda:0")

    costs, cpu, gpu = plan("qwen35-tiny-dense-q8_0.gguf")
    assert cpu.bytes_per_device()["cpu:0"].weights == gpu.bytes_per_device()["cuda:0"].weights
    costs16, cpu16, gpu16 = plan("qwen35-tiny-dense-f16.gguf")
    f16 = sum(b for p in costs16.parts for _, kind, b, _ in p.matmuls if kind == "F16")
    assert f16 > 0
    assert cpu16.bytes_per_device()["cpu:0"].weights == gpu16.bytes_per_device()["cuda:0"].weights + f16
    model = load_model(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", placement=cpu16)
    try:
        model.new_session().prefill([1, 2])  # the tied head decodes its float32 copy here
        held = {id(w): w.nbytes for ws in model.weights.values() for w in ws.values()
                if isinstance(w, NumpyWeight) and w._data is not None}
        held.update({id(w): w.nbytes for ws in model.weights.values() for w in ws.values()
                     if isinstance(w, np.ndarray)})
        assert sum(held.values()) == cpu16.bytes_per_device()["cpu:0"].weights
    finally:
        model.close()
    # decode: the Q8_0 matrices at the integer kernels' rate, the same file's float32 copies slower
    spec = [DeviceSpec("cpu:0", 1 << 36)]
    stored = predict_speed(cpu, spec).decode_tokens_per_s
    gf, config = open_model_file(fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf")
    as_f32 = predict_speed(Placement.single(model_costs(config, gf, layout="numpy"), "cpu:0"), spec)
    assert CPU_INT_DECODE_EFFICIENCY["Q8_0"] * 4 / 1.0625 > CPU_DECODE_EFFICIENCY
    assert stored > as_f32.decode_tokens_per_s


def test_cpu_weights_option_on_the_cpu_alone(fixtures_dir):
    """load_model(cpu_weights="stored") on the CPU alone: a plan priced as stored, the weights held so;
    an unknown value is refused before anything loads."""
    path = _q8(fixtures_dir)
    with pytest.raises(ValueError, match="cpu_weights 'int8' is not known"):
        load_model(path, devices=["cpu:0"], cpu_weights="int8")
    model = load_model(path, devices=["cpu:0"], cpu_weights="stored")
    try:
        assert model.placement.costs.layout == "stored"
        held = [w for w in model.weights["layer.3"].values() if isinstance(w, NumpyWeight) and w.type_name == "Q8_0"]
        assert held and all(w.stored is not None for w in held)
    finally:
        model.close()


def test_cli_run_with_stored_cpu_weights(fixtures_dir):
    """`minecart run --cpu-weights stored`: the fixture's greedy answer to the "short" sequence is
    " Sunt" on the float32 reference, transformers and llama.cpp alike (large logit margins); int8
    activations keep it."""
    from tests.engine.test_cli_run import minecart

    r = minecart("run", str(_q8(fixtures_dir)), "-p", "The quick brown fox jumps over the lazy dog.", "--raw",
                 "--temp", "0", "--max-tokens", "4", "--devices", "cpu", "--cpu-weights", "stored")
    assert r.returncode == 0, r.stderr
    assert r.stdout == " Sunt" * 4 + "\n"
    r = minecart("run", str(_q8(fixtures_dir)), "-p", "x", "--cpu-weights", "int8")
    assert r.returncode == 2 and "invalid choice: 'int8'" in r.stderr


def test_float32_copies_that_do_not_fit_in_ram_load_as_stored(fixtures_dir, monkeypatch, caplog):
    """On the CPU alone with no choice made, a model whose float32 copies would not fit in the RAM
    available loads as stored (with a warning that names the flag) instead of swapping or failing;
    `cpu_weights="float32"` keeps the reference whatever the RAM. `minecart plan` prices what the load
    will hold."""
    import logging

    from minecart.engine import devices
    from minecart.engine.execution import costs_for_devices

    path = _q8(fixtures_dir)
    gf, config = open_model_file(path)
    f32 = model_costs(config, gf, layout="numpy").weight_bytes
    assert costs_for_devices(config, gf, ["cpu:0"]).layout == "numpy"  # this machine has the RAM
    monkeypatch.setattr(devices, "ram_bytes", lambda: (f32, f32 // 2))  # half of what they need
    with caplog.at_level(logging.WARNING, logger="minecart.engine.execution"):
        assert costs_for_devices(config, gf, ["cpu:0"]).layout == "stored"
    assert "would not fit in the RAM available" in caplog.text and "--cpu-weights stored" in caplog.text
    assert costs_for_devices(config, gf, ["cpu:0"], cpu_weights="float32").layout == "numpy"
    assert costs_for_devices(config, gf, ["cpu:0", "cuda:0"]).layout == "stored"
    model = load_model(path, devices=["cpu:0"])
    try:
        assert model.placement.costs.layout == "stored"
        assert all(w.stored is not None for w in model.weights["layer.0"].values()
                   if isinstance(w, NumpyWeight) and w.type_name == "Q8_0")
    finally:
        model.close()


def test_planner_knows_every_type_the_cpu_holds_as_stored():
    """The planner's CPU rates name exactly the integer kernels' types (a type the kernels gain or lose
    would otherwise be priced in the wrong form, memory included)."""
    from minecart.engine.placement import CPU_INT_DECODE_EFFICIENCY

    assert set(CPU_INT_DECODE_EFFICIENCY) == {Q.type_name(t) for t in C.KERNEL_TYPES}
