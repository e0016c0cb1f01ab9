"""engine/cpu_gdn.py: the compiled delta-rule step of a CPU decode against its NumPy twin and against a
float64 loop written from the formula, on fresh random inputs (grouped key heads, dk != dv, several
tokens, strong and weak decay); bad shapes; the backend's routing both ways."""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import cpu_attention, cpu_gdn, cpu_matmul
from minecart.engine.backends.numpy_backend import NumpyBackend

needs_numba = pytest.mark.skipif(not cpu_gdn.available(), reason="numba is not installed")


def _inputs(rng, T, n_k, n_v, dk, dv):
    q = rng.standard_normal((T, n_k, dk)).astype(np.float32) / np.sqrt(dk)
    k = rng.standard_normal((T, n_k, dk)).astype(np.float32) / np.sqrt(dk)
    v = rng.standard_normal((T, n_v, dv)).astype(np.float32)
    g = -rng.exponential(0.5, (T, n_v)).astype(np.float32)  # log-decay <= 0
    beta = rng.random((T, n_v)).astype(np.float32)
    state = rng.standard_normal((n_v, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, state


def _formula(q, k, v, g, beta, state):
    """The recurrence element by element in float64, one head and token at a time."""
    T, n_v, dv = v.shape
    n_k = q.shape[1]
    S = state.astype(np.float64)
    out = np.zeros((T, n_v, dv))
    for t in range(T):
        for h in range(n_v):
            kk, qq = k[t, h % n_k].astype(np.float64), q[t, h % n_k].astype(np.float64)
            S[h] *= np.exp(np.float64(g[t, h]))
            delta = np.float64(beta[t, h]) * (v[t, h].astype(np.float64) - kk @ S[h])
            S[h] += np.outer(kk, delta)
            out[t, h] = qq @ S[h]
    return out, S


def _close(got, ref):
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * scale)


@needs_numba
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("T,n_k,n_v,dk,dv", [(1, 16, 16, 128, 128), (1, 2, 4, 16, 24), (3, 1, 3, 8, 5),
                                            (5, 4, 8, 32, 16)])
def test_kernel_matches_its_twin_and_the_formula(seed, T, n_k, n_v, dk, dv):
    rng = np.random.default_rng(seed)
    q, k, v, g, beta, state = _inputs(rng, T, n_k, n_v, dk, dv)
    s_kernel, s_twin = state.copy(), state.copy()
    got = cpu_gdn.gdn_step(q, k, v, g, beta, s_kernel)
    twin = cpu_gdn.gdn_step_twin(q, k, v, g, beta, s_twin)
    ref, S = _formula(q, k, v, g, beta, state)
    assert got.dtype == np.float32 and got.shape == (T, n_v, dv) and s_kernel.dtype == np.float32
    _close(got, twin)
    _close(s_kernel, s_twin)
    _close(got, ref)
    _close(s_kernel, S)
    assert not np.array_equal(s_kernel, state)  # the state was written in place


@needs_numba
def test_bad_shapes_are_refused():
    rng = np.random.default_rng(4)
    q, k, v, g, beta, state = _inputs(rng, 1, 3, 4, 8, 8)  # 4 value heads do not share 3 key heads
    with pytest.raises(ValueError, match="multiple of n_k"):
        cpu_gdn.gdn_step(q, k, v, g, beta, state)
    q, k, v, g, beta, state = _inputs(rng, 1, 2, 4, 8, 8)
    with pytest.raises(ValueError, match="state"):
        cpu_gdn.gdn_step(q, k, v, g, beta, state[:, :, :4])
    with pytest.raises(ValueError, match="float32"):
        cpu_gdn.gdn_step(q, k, v, g, beta, state.astype(np.float64))


@needs_numba
def test_the_backend_runs_the_kernel_or_the_twin(monkeypatch):
    rng = np.random.default_rng(5)
    q, k, v, g, beta, state = _inputs(rng, 1, 2, 4, 16, 16)
    twin_state = state.copy()
    twin = NumpyBackend(gdn_kernel=False)
    monkeypatch.setattr(cpu_gdn, "gdn_step", lambda *a: pytest.fail("the kernel ran with gdn_kernel=False"))
    want = twin.gdn_step(q, k, v, g, beta, twin_state)
    monkeypatch.undo()
    monkeypatch.setattr(cpu_gdn, "gdn_step_twin", lambda *a: pytest.fail("the twin ran with the kernel on"))
    got = NumpyBackend().gdn_step(q, k, v, g, beta, state)
    _close(got, want)
    _close(state, twin_state)


@pytest.mark.parametrize("which", ["qwen", "gemma"])
def test_a_load_with_progress_compiles_the_host_kernels(which, fixtures_dir, tmp_path, monkeypatch):
    """A person waits for a load that reports progress: the CPU's kernels are compiled then, not in a
    first token: the few-rows matmul of a batched step, the decode attention, and the recurrence of a
    model with Gated DeltaNet layers (Gemma 3 has none)."""
    from minecart.engine.model import load_model

    from tests._gemma3 import tiny_gemma3_file

    calls = []
    monkeypatch.setattr(cpu_gdn, "compile_kernel", lambda: calls.append("gdn"))
    monkeypatch.setattr(cpu_matmul, "compile_kernel", lambda threads: calls.append("rows"))
    monkeypatch.setattr(cpu_attention, "compile_kernel", lambda: calls.append("attention"))
    path = (fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf" if which == "qwen"
            else tiny_gemma3_file(tmp_path / "gemma.gguf"))
    with load_model(path, devices=["cpu:0"], mmproj=False):
        assert calls == []  # no one waits: nothing compiled ahead
    with load_model(path, devices=["cpu:0"], mmproj=False, progress=lambda f, m: None):
        want = (["rows"] if cpu_matmul.available() else []) + (
            ["gdn"] if which == "qwen" and cpu_gdn.available() else []) + (
            ["attention"] if cpu_attention.available() else [])
        assert calls == want


@needs_numba
def test_compile_kernel_compiles_the_signature_a_decode_token_uses(fixtures_dir):
    """The warm-up at load compiles what a real step then calls: a decode token through the backend adds
    no second compiled signature (so no compile waits inside it); the same for the few-rows matmul."""
    from minecart.engine.model import load_model

    cpu_gdn.compile_kernel()
    cpu_matmul.compile_kernel(NumpyBackend().expert_thread_count())
    cpu_attention.compile_kernel()
    with load_model(fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf", devices=["cpu:0"], mmproj=False) as m:
        sessions = [m.new_session(capacity=32) for _ in range(2)]
        for s in sessions:
            s.prefill([1, 2, 3])
        m.executor.forward_batch([[4], [5]], [s.states for s in sessions], [np.array([3]), np.array([3])])
        for s in sessions:
            s.close()
    assert len(cpu_gdn._compiled[0].signatures) == 1
    assert len(cpu_attention._compiled[0].signatures) == 2  # the float32 and float16 caches, no third
    assert cpu_matmul._compiled and all(len(k.signatures) == 1 for k in cpu_matmul._compiled.values())


def test_a_kernel_that_does_not_compile_is_switched_off_not_fatal(fixtures_dir, monkeypatch, caplog):
    """numba installed but failing to compile (a broken LLVM, say): the load still succeeds, says so in the
    log, and the backend runs the NumPy twins, whose logits a load without the kernels gives too."""
    from minecart.engine.model import load_model

    def broken(*_a):
        raise RuntimeError("LLVM is broken")

    path = fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf"
    monkeypatch.setattr(cpu_gdn, "compile_kernel", broken)
    monkeypatch.setattr(cpu_matmul, "compile_kernel", broken)
    monkeypatch.setattr(cpu_attention, "compile_kernel", broken)
    monkeypatch.setattr(cpu_gdn, "available", lambda: True)
    monkeypatch.setattr(cpu_matmul, "available", lambda: True)
    monkeypatch.setattr(cpu_attention, "available", lambda: True)
    with caplog.at_level("WARNING"), load_model(path, devices=["cpu:0"], mmproj=False,
                                                progress=lambda f, m: None) as m:
        backends = {id(b): b for b in m.backends.values()}.values()
        assert all(not b.rows_kernel and not b.gdn_kernel and not b.attention_kernel for b in backends)
        s = m.new_session(capacity=16)
        s.prefill([1, 2, 3, 4])
        got = s.prefill([5])  # one token: the decode form of the recurrence
    assert "did not compile" in caplog.text and "LLVM is broken" in caplog.text
    monkeypatch.undo()
    with load_model(path, devices=["cpu:0"], mmproj=False, backend=NumpyBackend(gdn_kernel=False,
                                                                               rows_kernel=False,
                                                                               attention_kernel=False)) as m:
        s = m.new_session(capacity=16)
        s.prefill([1, 2, 3, 4])
        want = s.prefill([5])
    np.testing.assert_array_equal(got, want)
