"""engine/cpu_pointwise.py: the compiled RMS norm, gated activations and RoPE against their NumPy twins
on fresh random inputs, and the NumPy backend choosing between them."""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import cpu_pointwise as pw
from minecart.engine.backends.numpy_backend import NumpyBackend

pytestmark = pytest.mark.skipif(not pw.available(), reason="numba is not installed")


def _rng(request) -> np.random.Generator:
    """A fresh seed per run, printed so that a failure can be replayed."""
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    print(f"\n{request.node.name}: seed {seed}")
    return np.random.default_rng(seed)


def _close(got: np.ndarray, want: np.ndarray) -> None:
    """Equal to float32 rounding: within 2 units in the last place of the larger magnitude."""
    assert got.dtype == np.float32 and want.dtype == np.float32 and got.shape == want.shape
    tol = 2 * np.spacing(np.maximum(np.abs(want), np.abs(got)))
    assert np.all(np.abs(got.astype(np.float64) - want) <= tol), float(np.max(np.abs(got - want)))


@pytest.mark.parametrize("shape", [(1, 640), (8, 640), (3, 4, 256), (5, 7)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_matches_its_twin(request, shape, weighted):
    rng = _rng(request)
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 30)).astype(np.float32)
    w = (1 + rng.standard_normal(shape[-1])).astype(np.float32) if weighted else None
    eps = float(rng.choice([1e-6, 1e-5]))
    got = pw.rms_norm(x, w, eps)
    _close(got, pw.rms_norm_twin(x, w, eps))
    # and the definition, spelled out for one row
    row = x.reshape(-1, shape[-1])[-1].astype(np.float64)
    want = row / np.sqrt(np.mean(row * row) + eps) * (1 if w is None else w)
    np.testing.assert_allclose(got.reshape(-1, shape[-1])[-1], want, rtol=1e-6, atol=1e-6)


def test_rms_norm_refuses_a_weight_of_another_length():
    with pytest.raises(ValueError, match="weight"):
        pw.rms_norm(np.ones((2, 8), np.float32), np.ones(4, np.float32), 1e-6)


@pytest.mark.parametrize("shape", [(1, 2048), (8, 2048), (3, 5, 7)])
@pytest.mark.parametrize("which", ["geglu", "swiglu"])
def test_gated_activations_are_their_twins_bit_for_bit(request, shape, which):
    rng = _rng(request)
    gate = (rng.standard_normal(shape) * rng.uniform(0.1, 40)).astype(np.float32)
    gate.reshape(-1)[:4] = [0.0, -0.0, 1e-30, -90.0]  # zeros, a subnormal-sized value, a saturated tanh
    up = rng.standard_normal(shape).astype(np.float32)
    got = getattr(pw, which)(gate, up)
    want = getattr(pw, f"{which}_twin")(gate, up)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.int32), want.view(np.int32))
    g = gate.astype(np.float64)[-1]  # and the definitions, spelled out for one row
    act = g / (1 + np.exp(-g)) if which == "swiglu" else \
        0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
    want_row = act * up[-1]
    # (1 + tanh(x) loses the far negative tail's relative precision: an absolute bound there)
    np.testing.assert_allclose(got[-1], want_row, rtol=1e-6, atol=1e-7 * np.max(np.abs(want_row)))


def test_gated_activations_refuse_shapes_that_differ():
    with pytest.raises(ValueError, match="differ"):
        pw.geglu(np.ones((2, 4), np.float32), np.ones((2, 5), np.float32))


@pytest.mark.parametrize("heads,d,n_rot", [(4, 256, 256), (8, 256, 64), (1, 64, 32), (2, 10, 6)])
@pytest.mark.parametrize("rows", [1, 9])
def test_rope_is_its_twin_bit_for_bit(request, heads, d, n_rot, rows):
    rng = _rng(request)
    x = rng.standard_normal((rows, heads, d)).astype(np.float32)
    positions = rng.integers(0, 40_000, rows)
    cos, sin = pw.rope_table(positions, n_rot, float(rng.choice([10_000.0, 1_000_000.0])),
                             scale=float(rng.choice([1.0, 8.0])))
    got = pw.rope(x, cos, sin, n_rot)
    assert np.array_equal(got.view(np.int32), pw.rope_twin(x, cos, sin, n_rot).view(np.int32))
    assert np.array_equal(got[..., n_rot:], x[..., n_rot:])  # the values past n_rot are copied
    # and the rotation spelled out for one head: pair i turned by position x base^(-2i / n_rot)
    base = 10_000.0
    cos, sin = pw.rope_table(positions, n_rot, base)
    got = pw.rope(x, cos, sin, n_rot)
    half = n_rot // 2
    theta = positions[-1] * base ** (-2.0 * np.arange(half) / n_rot)
    a, b = x[-1, 0, :half].astype(np.float64), x[-1, 0, half:n_rot].astype(np.float64)
    np.testing.assert_allclose(got[-1, 0, :half], a * np.cos(theta) - b * np.sin(theta), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[-1, 0, half:n_rot], a * np.sin(theta) + b * np.cos(theta), rtol=1e-5, atol=1e-5)


def test_rope_takes_m_rope_tables(request):
    """M-RoPE's per-pair position components (the vision model's prompts) through the same kernel."""
    rng = _rng(request)
    rows, n_rot = 6, 64
    x = rng.standard_normal((rows, 2, 128)).astype(np.float32)
    positions = rng.integers(0, 500, (3, rows))
    cos, sin = pw.rope_table(positions, n_rot, 10_000.0, sections=(11, 11, 10))
    assert not np.allclose(cos, pw.rope_table(positions[0], n_rot, 10_000.0)[0])  # components differ
    got = pw.rope(x, cos, sin, n_rot)
    assert np.array_equal(got.view(np.int32), pw.rope_twin(x, cos, sin, n_rot).view(np.int32))


def test_rope_refuses_a_table_of_another_shape():
    with pytest.raises(ValueError, match="table"):
        pw.rope(np.ones((2, 1, 8), np.float32), np.zeros((2, 3)), np.zeros((2, 3)), 8)


def test_the_backend_keeps_a_steps_rope_table(request):
    """Every layer of a step rotates by one table: made once per (positions, base), and a backend
    keeps only the last few."""
    rng = _rng(request)
    be = NumpyBackend()
    x = rng.standard_normal((2, 2, 16)).astype(np.float32)
    pos = np.array([5, 9])
    first = be.rope(x, pos, 16, 10_000.0)
    assert len(be._rope_tables) == 1
    np.testing.assert_array_equal(be.rope(x, pos.copy(), 16, 10_000.0), first)
    assert len(be._rope_tables) == 1  # the same positions and base: the same table
    other = be.rope(x, pos + 1, 16, 10_000.0)
    assert len(be._rope_tables) == 2 and not np.array_equal(other, first)
    for step in range(20):
        be.rope(x, pos + 2 + step, 16, 1_000_000.0)
    assert len(be._rope_tables) <= 8


def test_the_backend_runs_the_kernels_or_the_twins(request, monkeypatch):
    """pointwise_kernel on: the kernels run (counted); off, or for float64 input: the twins. The
    results agree to float32 rounding."""
    rng = _rng(request)
    x = rng.standard_normal((3, 2, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    calls: list[str] = []
    for name in ("rms_norm", "rope", "geglu", "swiglu"):
        real = getattr(pw, name)
        monkeypatch.setattr(pw, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    on, off = NumpyBackend(), NumpyBackend(pointwise_kernel=False)
    pos = np.array([3, 4, 5])
    kinds = ["rms_norm", "rope", "geglu", "swiglu"]
    a = (on.rms_norm(x, w, 1e-6), on.rope(x, pos, 32, 10_000.0), on.geglu(x, x), on.swiglu(x, x))
    assert calls == kinds
    b = (off.rms_norm(x, w, 1e-6), off.rope(x, pos, 32, 10_000.0), off.geglu(x, x), off.swiglu(x, x))
    on.rms_norm(x.astype(np.float64), w, 1e-6)
    on.geglu(x.astype(np.float64), x)
    assert calls == kinds  # the twins ran for `off` and for float64 input
    for got, want in zip(a, b, strict=True):
        _close(got, want)
