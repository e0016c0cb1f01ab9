"""Routed experts in host RAM streamed to the GPU for prefill (engine/experts.py,
engine/backends/expert_stream.py), on the synthesized tiny-moe files (separate F16 experts, fused Q8_0
experts): the staging buffers hold exactly the bytes ops.upload_weight makes; a streamed prefill gives
the NumPy model's logits and greedy tokens as closely as the all-GPU model does (decode runs the
experts on the CPU); a cancelled or failed prefill leaves no copy in flight; a simulated link paces
the copies.

Prints per file and path: the logit error against NumPy and against the all-GPU model, the greedy
agreement, and the streamed layers / bytes.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tests._moe import tiny_moe_file
from tests.gpu._compare import greedy

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

STREAM_FROM = 8  # tokens: the tiny layers' real threshold is in the thousands (its CPU is quick)


@pytest.fixture(scope="module", params=["separate", "fused"])
def moe_file(request, tmp_path_factory):
    return tiny_moe_file(tmp_path_factory, request.param), request.param


def _prompt(n=96, seed=5):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 600, n)]


def _numpy(path):
    from minecart.engine.backends.numpy_backend import NumpyBackend
    from minecart.engine.model import load_model

    return load_model(path, backend=NumpyBackend(int_experts=False))


def _streamed(path, gpu_path=None, **kwargs):
    """The model with its layers on cuda:0 and its experts in host RAM, streaming chunks of
    STREAM_FROM tokens or more; returns (model, proxy)."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.experts import ExpertsApart
    from minecart.engine.model import load_model

    if "devices" in kwargs:
        model = load_model(path, experts="host", **kwargs)
    else:
        model = load_model(path, backend=CupyBackend("cuda:0", path=gpu_path), experts="host")
    proxy = model.backends["layer.0"]
    assert isinstance(proxy, ExpertsApart) and proxy.stream is not None
    proxy.min_stream_tokens = STREAM_FROM
    # the tests choose their chunks: no floor on a prefill run's length (the runtime's is
    # placement.STREAMED_EXPERTS_CHUNK, checked on the CPU by test_prefill_runs_are_at_least_min_chunk)
    model.executor.min_chunk = 0
    return model, proxy


def test_the_staging_buffer_holds_the_uploaded_bytes(moe_file):
    """Every staged expert tensor and router equals what CupyBackend.load_weight puts on the GPU,
    byte for byte (the host layout is the device layout, whatever upload_weight does)."""
    from minecart.engine.backends.cupy_backend import CupyBackend

    path, layout = moe_file
    model, proxy = _streamed(path)
    gpu = CupyBackend("cuda:0", probe=False)
    st = proxy.stream
    n = model.config.n_layers
    for i in range(n):
        staged = st.acquire(i)
        try:
            for name, w in model.weights[f"layer.{i}.experts"].items():
                got = staged["router"] if w.role != "experts" else staged[name]
                want = gpu.load_weight(w.info, role=w.role)
                assert (got.type_name, tuple(got.shape)) == (want.type_name, tuple(want.shape)), name
                assert got.q.wq.shape == want.q.wq.shape and got.q.wq.dtype == want.q.wq.dtype, name
                assert bool(cp.array_equal(got.q.wq.view(cp.uint8), want.q.wq.view(cp.uint8))), name
                assert (got.q.wd is None) == (want.q.wd is None), name
                if want.q.wd is not None:
                    assert bool(cp.array_equal(got.q.wd, want.q.wd)), name
                gpu.free(want)
        finally:
            st.release(i)
    cp.cuda.Device(0).synchronize()
    print(f"\n{layout}: {n} layers staged, {st.layer_bytes(0)} bytes a layer, staging "
          f"{st.staging_bytes} bytes")
    assert st.streamed_layers >= 2 and st.staging_bytes >= 2 * st.layer_bytes(0)
    model.close()


def test_a_new_staging_buffer_is_filled_after_the_compute_streams_work(moe_file):
    """The first copy into a staging buffer waits for the compute stream: its allocation's fill is
    queued there (and its pool may hand over memory that queued work still reads). Held busy for
    0.2 s, the compute stream would otherwise zero the buffer after the copy landed (seen on a GPU
    shared with another process: a streamed prefill's logits off by 60%, then an illegal address)."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.kernels import link

    path, _layout = moe_file
    model, proxy = _streamed(path)
    gpu = CupyBackend("cuda:0", probe=False)
    st = proxy.stream
    for key in (0, 1):  # both buffers are new
        experts = {n: w for n, w in model.weights[f"layer.{key}.experts"].items() if w.role == "experts"}
        want = {n: gpu.load_weight(w.info, role=w.role) for n, w in experts.items()}
        assert all(bool(cp.any(w.q.wq.view(cp.uint8))) for w in want.values())  # zeros would be told apart
        cp.cuda.Device(0).synchronize()
        link.hold(cp.cuda.get_current_stream(), 0.2)
        staged = st.acquire(key)
        try:
            for n, w in want.items():
                assert bool(cp.array_equal(staged[n].q.wq.view(cp.uint8), w.q.wq.view(cp.uint8))), \
                    f"layer {key}: {n}'s staged bytes differ from the uploaded ones"
        finally:
            st.release(key)
            for w in want.values():
                gpu.free(w)
    model.close()


@pytest.mark.parametrize("gpu_path", ["fma", None])
def test_streamed_prefill_matches_numpy_and_the_all_gpu_model(moe_file, gpu_path):
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.kvquant import compare_logits, sequence_logits
    from minecart.engine.model import load_model

    path, layout = moe_file
    ids = _prompt()
    ref_model = _numpy(path)
    ref = sequence_logits(ref_model, ids, "f32")
    gpu_model = load_model(path, backend=CupyBackend("cuda:0", path=gpu_path))
    all_gpu = sequence_logits(gpu_model, ids, "f32")
    model, proxy = _streamed(path, gpu_path)
    n = model.config.n_layers
    got = sequence_logits(model, ids, "f32")
    assert np.all(np.isfinite(got))
    assert proxy.streamed_moe_calls == n and proxy.host_moe_calls == 0  # one 96-token pass: all streamed
    assert proxy.stream.streamed_layers >= n and proxy.stream.orphans() == 0
    r = compare_logits(ref, got)
    g = compare_logits(all_gpu, got)
    a = greedy(ref_model, _prompt(40, seed=7), 32)
    b = greedy(model, _prompt(40, seed=7), 32)
    agree = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), 32)
    print(f"\nMoE {layout} streamed, path={gpu_path or 'default'}: vs NumPy rel err max "
          f"{r['rel_err_max']:.2e}, top-1 {r['top1_agree']:.3f}, KL mean {r['kl_mean']:.2e}; vs all-GPU "
          f"rel err max {g['rel_err_max']:.2e}; greedy identical prefix {agree}/32; streamed MoE calls "
          f"{proxy.streamed_moe_calls}, host MoE calls {proxy.host_moe_calls}, "
          f"{proxy.stream.streamed_bytes} bytes streamed")
    assert proxy.host_moe_calls > 0  # decode ran the experts on the CPU
    if gpu_path == "fma":
        assert r["rel_err_max"] < 1e-3 and r["top1_agree"] == 1.0 and agree >= 8
        assert g["rel_err_max"] < 1e-4 and g["top1_agree"] == 1.0  # the same kernels on the same bytes
    else:
        assert r["top1_agree"] >= 0.9 and r["kl_mean"] < 1e-2 and agree >= 4
        assert g["top1_agree"] >= 0.97
    model.close()
    gpu_model.close()


def test_chunked_streamed_prefill_matches_one_pass(moe_file):
    """Chunks of 16 tokens re-stream the layers chunk after chunk (two buffers, eight layers): the
    logits of the last token equal a one-pass prefill's."""
    path, layout = moe_file
    ids = _prompt(64, seed=3)
    model, proxy = _streamed(path, "fma")
    n = model.config.n_layers
    s = model.new_session(len(ids) + 1)
    one = s.prefill(ids)
    s.close()
    before = proxy.stream.streamed_layers
    s = model.new_session(len(ids) + 1)
    chunked = s.prefill(ids, chunk=16)
    s.close()
    copies = proxy.stream.streamed_layers - before
    print(f"\n{layout}: 4 chunks of 16 tokens streamed {copies} layer copies")
    assert copies >= 4 * (n - 2)  # two layers may still sit in the buffers from the chunk before
    np.testing.assert_allclose(chunked, one, rtol=1e-3, atol=1e-3 * float(np.max(np.abs(one))))
    model.close()


def test_a_cancelled_prefill_leaves_no_copy_in_flight(moe_file):
    from minecart.engine.errors import GenerationCancelled

    path, _ = moe_file
    model, proxy = _streamed(path, "fma")
    n = model.config.n_layers
    cancel = threading.Event()
    run = proxy._streamed_moe

    def cancel_in_first_chunk(*args, **kwargs):
        out = run(*args, **kwargs)
        if proxy.streamed_moe_calls == n // 2:
            cancel.set()  # checked before the next chunk
        return out

    proxy._streamed_moe = cancel_in_first_chunk  # type: ignore[method-assign]
    s = model.new_session(80)
    with pytest.raises(GenerationCancelled):
        s.prefill(_prompt(64, seed=4), chunk=16, cancel=cancel)
    assert proxy.streamed_moe_calls == n  # the first chunk ran to its end, no later one started
    assert proxy.stream.orphans() == 0  # the last layer prefetched nothing
    s.close()
    model.close()


def test_a_failed_moe_settles_the_prefetched_copy(moe_file):
    path, _ = moe_file
    model, proxy = _streamed(path, "fma")
    gpu = proxy.inner
    real = gpu.moe
    calls = []

    def fail_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    gpu.moe = fail_third  # type: ignore[method-assign]
    try:
        s = model.new_session(40)
        with pytest.raises(RuntimeError, match="injected"):
            s.prefill(_prompt(32, seed=6))
        assert proxy.stream.in_flight() == 0 and proxy.stream.orphans() == 0  # no host wait needed
    finally:
        gpu.moe = real  # type: ignore[method-assign]
    model.close()


def test_the_real_link_is_measured_on_the_card(moe_file):
    """Without a simulated link the proxy prices streaming with the card's link as measured on it
    (CupyBackend.host_copy_rate, once): a rate a PCIe link can have, which one 64 MiB copy timed
    apart here agrees with."""
    from minecart.engine.backends.cupy_backend import CupyBackend

    path, _ = moe_file
    model, proxy = _streamed(path)
    gpu = proxy.inner
    assert isinstance(gpu, CupyBackend)
    rate, latency = gpu.host_copy_rate()
    assert proxy.link.name == "measured on the card"
    assert (proxy.link.bandwidth, proxy.link.latency) == (rate, latency)
    assert gpu.host_copy_rate() == (rate, latency)  # measured once
    assert 1e8 <= rate <= 2e11 and 1e-6 <= latency <= 1e-3
    n = 64 << 20
    host = gpu.pinned_empty((n,), "uint8")
    host[:] = 3
    dev = cp.empty(n, cp.uint8)
    walls = []
    for _ in range(3):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        dev.set(host)
        cp.cuda.Device().synchronize()
        walls.append(time.perf_counter() - t0)
    proxy.min_stream_tokens = None
    print(f"\nhost -> device: {rate / 1e9:.2f} GB/s + {latency * 1e6:.1f} us a copy measured; one 64 MiB copy "
          f"timed apart {n / min(walls) / 1e9:.2f} GB/s; threshold {proxy.stream_min_tokens(0, 2)} tokens "
          "without the test's override")
    assert 0.5 <= n / min(walls) / rate <= 2.0
    model.close()


def test_a_simulated_link_paces_the_copies(moe_file):
    """cuda:0 behind a 2 MB/s link (engine/rig.py): the streamed bytes take at least bytes / rate."""
    from minecart.engine.rig import Rig

    path, layout = moe_file
    rig = Rig.parse("cuda:0@2MB/s")
    model, proxy = _streamed(path, devices=rig)
    assert proxy.link.bandwidth == 2e6
    s = model.new_session(40)
    t0 = time.perf_counter()
    s.prefill(_prompt(32, seed=8))
    wall = time.perf_counter() - t0
    st = proxy.stream
    print(f"\n{layout} at 2 MB/s: {st.streamed_bytes} bytes streamed in {wall:.3f} s "
          f"({st.streamed_bytes / wall / 1e6:.2f} MB/s), {st.wait_seconds:.3f} s waiting for the link")
    assert st.streamed_layers == model.config.n_layers and st.wait_seconds > 0
    assert wall >= 0.95 * st.streamed_bytes / 2e6
    # the real threshold behind such a link: more tokens than the CPU needs for the whole chunk
    proxy.min_stream_tokens = None
    assert proxy.stream_min_tokens(0, model.config.n_experts_used) > 32
    s.close()
    model.close()
