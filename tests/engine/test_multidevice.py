"""Layer splits over several CPU devices: same logits as one device, pipelined chunks, rig emulation.

The NumPy backend is deterministic and a split runs the same ops in the same order, so split logits
must be bit-identical to single-device logits (whole prefill, chunked prefill, decode).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from minecart.engine.errors import DeviceError, GenerationCancelled
from minecart.engine.execution import HostBridge
from minecart.engine.model import load_model
from minecart.engine.multidevice import bench_split
from minecart.engine.placement import DeviceSpec, MiB, Placement, model_costs
from minecart.engine.rig import Link, Rig, RigDevice, allocated_bytes, parse_bytes, parse_link

Q8 = "dense/qwen35-tiny-dense-q8_0.gguf"
PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, 248_000, size=45)]


@pytest.fixture(scope="module")
def path(fixtures_dir):
    return fixtures_dir / Q8


@pytest.fixture(scope="module")
def costs(path):
    from minecart.engine.config import ModelConfig
    from minecart.engine.gguf_file import GGUFFile

    gf = GGUFFile(path)
    return model_costs(ModelConfig.from_gguf(gf), gf, layout="numpy")


@pytest.fixture(scope="module")
def single(path):
    model = load_model(path, devices=["cpu:0"])
    yield model
    model.close()


@pytest.fixture(scope="module")
def reference(single):
    """Single-device results: whole prefill logits, chunked prefill logits, 4 greedy decode rows."""
    whole = single.logits(PROMPT)
    states = single.new_state(64)
    chunked = single.forward(PROMPT, states, np.arange(len(PROMPT)), rows="all", chunk=8)
    decode, token = [], int(np.argmax(chunked[-1]))
    for k in range(4):
        row = single.forward([token], states, np.array([len(PROMPT) + k]))[-1]
        decode.append(row)
        token = int(np.argmax(row))
    return whole, chunked, np.stack(decode)


SPLITS = {
    "2 devices": [("cpu:0", 4), ("cpu:1", 4)],
    "3 devices": [("cpu:0", 2), ("cpu:1", 3), ("cpu:2", 3)],
    "3 devices, head apart": [("cpu:0", 5), ("cpu:1", 3), ("cpu:2", 0)],
}


def _plan(costs, name):
    counts = SPLITS[name]
    plan = Placement.from_layer_counts(costs, [(d, n) for d, n in counts if n])
    if name == "3 devices, head apart":
        plan.move_part("head", "cpu:2")
    return plan


@pytest.mark.parametrize("split", list(SPLITS))
def test_split_logits_identical_to_one_device(path, costs, reference, split):
    whole, chunked, decode = reference
    plan = _plan(costs, split)
    with load_model(path, placement=plan) as model:
        assert model.placement.devices_used() == plan.devices_used()
        assert model.executor.split and len(model.executor.workers) == len(plan.devices_used())
        np.testing.assert_array_equal(model.logits(PROMPT), whole)
        states = model.new_state(64)
        got = model.forward(PROMPT, states, np.arange(len(PROMPT)), rows="all", chunk=8)
        np.testing.assert_array_equal(got, chunked)  # 6 chunks in flight through the pipeline
        token = int(np.argmax(got[-1]))
        for k in range(4):
            row = model.forward([token], states, np.array([len(PROMPT) + k]))[-1]
            np.testing.assert_array_equal(row, decode[k])
            token = int(np.argmax(row))
        # the bridges really carried the hidden state (embedding output + per chunk + decode steps)
        assert sum(b.bytes_moved for b in model.executor.bridges) > 0


def test_single_chunk_on_the_workers_equals_inline(path, costs, reference):
    whole, _, _ = reference
    with load_model(path, placement=_plan(costs, "2 devices")) as model:
        model.executor.inline_single_chunk = False  # the embedding->head pass through the worker threads
        np.testing.assert_array_equal(model.logits(PROMPT), whole)


def test_whole_and_chunked_prefill_agree(reference):
    whole, chunked, _ = reference
    np.testing.assert_allclose(chunked, whole, atol=2e-4, rtol=0)


def test_non_contiguous_split_and_session_prefill(path, costs, single):
    plan = Placement.from_layer_counts(costs, [("cpu:0", 2), ("cpu:1", 2), ("cpu:2", 4)])
    plan.assign_range(5, 7, "cpu:0")  # parts 5-6 = layers 4-5: cpu:0 -> cpu:1 -> cpu:0 -> cpu:2
    assert not plan.is_contiguous() and plan.crossings() == 3
    ref = single.new_session()
    ref_logits = ref.prefill(PROMPT, chunk=10)
    with load_model(path, placement=plan) as model:
        assert [s.device for s in model.executor.stages] == ["cpu:0", "cpu:1", "cpu:0", "cpu:2"]
        sess = model.new_session()
        np.testing.assert_array_equal(sess.prefill(PROMPT, chunk=10), ref_logits)
        assert sess.tokens == PROMPT and sess.position == len(PROMPT)
        nxt = int(np.argmax(ref_logits))
        np.testing.assert_array_equal(sess.step(nxt), ref.step(nxt))


def test_auto_placement_from_device_names(path, single):
    with load_model(path, devices=["cpu:0", "cpu:1"]) as model:
        assert isinstance(model.placement, Placement)
        assert model.placement.is_contiguous()
        assert set(model.placement.bytes_per_device()) == set(model.placement.devices_used())
        np.testing.assert_array_equal(model.logits(PROMPT[:9]), single.logits(PROMPT[:9]))


def test_cancel_keeps_whole_chunks(path, costs, single):
    plan = Placement.from_layer_counts(costs, [("cpu:0", 4), ("cpu:1", 4)])
    with load_model(path, placement=plan) as model:
        cancel = threading.Event()
        calls = []
        be = model.executor.stages[0].backend
        real_embed = be.embed

        def embed_then_cancel(table, ids):  # cancel once the second chunk is embedded
            calls.append(len(ids))
            if len(calls) == 2:
                cancel.set()
            return real_embed(table, ids)

        be.embed = embed_then_cancel
        try:
            sess = model.new_session()
            with pytest.raises(GenerationCancelled) as info:
                sess.prefill(PROMPT, chunk=5, cancel=cancel)
        finally:
            del be.embed
        done = info.value.tokens_done
        assert done % 5 == 0 and 10 <= done < len(PROMPT)
        assert sess.tokens == PROMPT[:done]
        # the state is exactly that of `done` tokens: continuing gives the uncancelled result
        rest = sess.prefill(PROMPT[done:], chunk=5)
        ref = single.new_session()
        np.testing.assert_array_equal(rest, ref.prefill(PROMPT, chunk=5))


def test_an_error_on_a_worker_reaches_the_caller(path, costs):
    plan = Placement.from_layer_counts(costs, [("cpu:0", 4), ("cpu:1", 4)])
    with load_model(path, placement=plan) as model:
        be = model.executor.stages[1].backend

        def broken(*a, **k):
            raise RuntimeError("kernel exploded")

        be.matmul = broken
        try:
            with pytest.raises(RuntimeError, match="kernel exploded"):
                model.forward(PROMPT, model.new_state(64), np.arange(len(PROMPT)), rows="last", chunk=8)
        finally:
            del be.matmul
        assert model.logits(PROMPT[:3]).shape == (3, 248320)  # still usable


# ---- overlap --------------------------------------------------------------------------------------


class _SlowBackend:
    """A NumPy backend whose matmuls take at least `delay` seconds (a stand-in for a slow card)."""

    def __init__(self, device, delay):
        from minecart.engine.backends.numpy_backend import NumpyBackend

        self._inner = NumpyBackend(device)
        self.delay = delay

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def matmul(self, x, w):
        time.sleep(self.delay)
        return self._inner.matmul(x, w)

    # the fused ops run their matmuls inside the inner backend: charge each weight here as well
    def matmul_many(self, x, ws):
        time.sleep(self.delay * len(ws))
        return self._inner.matmul_many(x, ws)

    def matmul_add(self, x, w, residual):
        time.sleep(self.delay)
        return self._inner.matmul_add(x, w, residual)


def test_chunks_overlap_across_devices(path, costs):
    rig = Rig.cpus(2, link="gen1x1", backend_factory=lambda phys: _SlowBackend(phys, 0.002))
    plan = Placement.from_layer_counts(costs, [("cpu:0", 4), ("cpu:1", 4)])
    with load_model(path, placement=plan, devices=rig) as model:
        pipe = model.executor
        default = pipe.max_in_flight
        ids, pos = PROMPT[:40], np.arange(40)

        def run(in_flight):
            pipe.max_in_flight = in_flight
            t0 = time.perf_counter()
            out = model.forward(ids, model.new_state(64), pos, rows="last", chunk=5)
            return time.perf_counter() - t0, out

        run(default)
        sequential, a = run(1)  # one chunk at a time: devices take turns
        pipelined, b = run(default)
        np.testing.assert_array_equal(a, b)
        # 8 chunks, each ~4 layers x 7 matmuls x 2 ms per device: ~0.9 s in turns, ~0.5 s overlapped
        assert pipelined < 0.8 * sequential, (pipelined, sequential)


# ---- rig ------------------------------------------------------------------------------------------


def test_memory_estimate_matches_numpy_allocations(path, costs):
    """Placement estimate (numpy layout, f32 KV) vs the arrays the NumPy backends really hold."""
    plan = Placement.from_layer_counts(costs, [("cpu:0", 3), ("cpu:1", 3), ("cpu:2", 2)], context=300,
                                       kv_type="f32")
    with load_model(path, placement=plan, devices=Rig.cpus(3)) as model:
        model.logits(PROMPT[:4])  # the tied LM head decodes its float32 table on first use
        states = model.new_state(300)
        estimate = plan.bytes_per_device()
        for dev in plan.devices_used():
            parts = plan.parts_on(dev)
            held = allocated_bytes([model.weights[p] for p in parts])
            held += allocated_bytes([states[int(p.split(".")[1])] for p in parts if p.startswith("layer.")])
            assert held > 0
            assert abs(held - estimate[dev].resident) <= 0.05 * estimate[dev].resident, dev


def test_memory_cap_raises_a_clear_error(path, costs):
    plan = Placement.from_layer_counts(costs, [("cpu:0", 4), ("cpu:1", 4)])
    # what cpu:1 holds at load: layers 4-7 and the output norm (the tied table is decoded on first use)
    need = sum(p.weight_bytes for p in costs.parts if plan.device_of(p.name) == "cpu:1" and p.name != "head")
    rig = Rig.cpus(2, caps=[None, need // 2])
    with pytest.raises(DeviceError, match=r"cpu:1 is out of memory: .* cap are in use; move layers"):
        load_model(path, placement=plan, devices=rig)
    rig = Rig.cpus(2, caps=[None, need + MiB])
    with load_model(path, placement=plan, devices=rig) as model:
        used = rig.backend("cpu:1").used_bytes
        assert need <= used <= need + 1024
        assert rig.device_specs()[1].free_bytes == need + MiB - used
        # the LM head's float32 table (31.8 MB) appears on first use; re-measuring catches it
        model.logits(PROMPT[:2])
        with pytest.raises(DeviceError, match="more than its"):
            rig.backend("cpu:1").measure([model.weights[p] for p in plan.parts_on("cpu:1")])


def test_link_charges_transfers():
    rig = Rig([RigDevice("cpu:0", "cpu:0", None, Link(10e6, 1e-3))])
    be = rig.backend("cpu:0")
    host = np.arange(50_000, dtype=np.float32)  # 200 kB at 10 MB/s: 20 ms + 1 ms
    t0 = time.perf_counter()
    dev = be.asarray(host)
    back = be.to_numpy(dev)
    elapsed = time.perf_counter() - t0
    np.testing.assert_array_equal(back, host)
    assert elapsed >= 0.042
    assert be.transferred_bytes == 2 * host.nbytes
    assert abs(be.transfer_seconds - 0.042) < 1e-9


def test_host_bridge_copies_and_reuses_one_buffer():
    from minecart.engine.backends.numpy_backend import NumpyBackend

    bridge = HostBridge(NumpyBackend("cpu:0"), NumpyBackend("cpu:1"), rows=4, width=8)
    try:
        buf = bridge.buffer
        a = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
        y = bridge.move(a)
        z = bridge.move(a * 2)
        np.testing.assert_array_equal(y, a)  # not overwritten by the second hop
        np.testing.assert_array_equal(z, a * 2)
        assert bridge.buffer is buf and not np.shares_memory(y, buf)
        big = bridge.move(np.ones((9, 8), np.float32))  # grows when a larger chunk arrives
        assert big.shape == (9, 8) and bridge.buffer.size >= 72
    finally:
        bridge.close()


def test_rig_parse_and_logical_devices():
    rig = Rig.parse("cuda:0=4GiB@gen1x1, cuda:1=3500MiB@250MB/s+30us, cuda:2, cpu:0=8GiB", physical_gpus=2)
    assert [d.physical for d in rig.devices] == ["cuda:0", "cuda:1", "cuda:0", "cpu:0"]
    assert rig.devices[0].memory_cap == 4 << 30 and rig.devices[1].memory_cap == 3500 << 20
    assert rig.devices[1].link.bandwidth == 250e6 and abs(rig.devices[1].link.latency - 30e-6) < 1e-12
    assert rig.devices[2].memory_cap is None and rig.devices[2].link is None
    assert parse_link("gen1x1").bandwidth == 250e6 and parse_bytes("1.5GiB") == 3 << 29
    with pytest.raises(DeviceError, match="not understood"):
        Rig.parse("gpu0=4GiB")
    with pytest.raises(DeviceError, match="cannot run on"):
        RigDevice("cuda:1", "cpu:0")
    logical = Rig.logical("cuda:0", [4 << 30, 4 << 30, 8 << 30], link="gen1x1")
    assert logical.names == ["cuda:0", "cuda:1", "cuda:2"]
    assert {d.physical for d in logical.devices} == {"cuda:0"}
    specs = logical.device_specs()
    assert [s.free_bytes for s in specs] == [4 << 30, 4 << 30, 8 << 30]
    assert all(isinstance(s, DeviceSpec) for s in specs)


def test_allocated_bytes_skips_file_data(path):
    from minecart.engine.gguf_file import GGUFFile

    gf = GGUFFile(path)
    info = gf.tensors["token_embd.weight"]
    assert allocated_bytes(info) == 0 and allocated_bytes(info.raw) == 0
    a = np.zeros((10, 10), np.float32)
    assert allocated_bytes({"a": a, "view": a[2:], "again": [a]}) == 400


def test_bench_split_reports(path, costs):
    plan = Placement.from_layer_counts(costs, [("cpu:0", 4), ("cpu:1", 4)])
    with load_model(path, placement=plan, devices=Rig.cpus(2, link="gen1x1")) as model:
        result = bench_split(model, prompt_tokens=24, chunk=8, decode_tokens=3)
    assert result.devices == ["cpu:0", "cpu:1"]
    assert result.prefill_tokens_per_s > 0 and result.decode_tokens_per_s > 0
    assert result.link_bytes > 0
    text = "\n".join(result.lines())
    assert "cpu:0: the embedding and layers 0-3" in text and "overlap speedup" in text


# ---- decode steps through the stages' graph_step ----------------------------------------------------


class _Event:
    """Stands in for a CUDA event: the work behind it (writing a stage's output) happens only when
    something waits for it, so a caller that reads the buffer without waiting sees stale data."""

    def __init__(self, work):
        self._work = work

    def synchronize(self):
        work, self._work = self._work, None
        if work is not None:
            work()


class _GraphStepBackend:
    """A NumPy backend with the graph_step contract of the CuPy backend (engine/backends/cupy_backend.py)
    emulated eagerly: the input comes from host_in, the output goes to host_out; the first call for a
    key "captures" (counted), later calls "replay" while owner, buffers and watched states are
    unchanged; every `refuse_every`-th call returns None (a step that must run eagerly, `after` not
    waited for). `after` is waited for first (the GPU's ordering); with wait=False the output is
    written only once the returned event is waited for."""

    def __init__(self, device, refuse_every=0):
        from minecart.engine.backends.numpy_backend import NumpyBackend

        self._inner = NumpyBackend(device)
        self.refuse_every = refuse_every
        self.calls = self.captures = self.replays = 0
        self._graphs = {}

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def graph_step(self, key, run, ids, positions, *, owner, watch=None, host_in=None, host_out=None,
                   after=None, wait=True, link_seconds=(0.0, 0.0), chained=False, pick=None):
        self.calls += 1
        if len(ids) != 1 or chained or (self.refuse_every and self.calls % self.refuse_every == 0):
            return None  # chained: no device feeds this double's steps
        if after is not None:
            after.synchronize()
        sig = (id(owner), id(host_in), id(host_out), tuple(id(w) for w in (watch or [])))
        if self._graphs.get(key) == sig:
            self.replays += 1
        else:
            self.captures += 1
            self._graphs[key] = sig
        x = ids if host_in is None else np.array(host_in)
        y = run(x)
        if host_out is None:
            return np.array(y)
        if not wait:
            self.deferred += 1
            return _Event(lambda: host_out.__setitem__(Ellipsis, y))
        host_out[...] = y
        return True

    deferred = 0


@pytest.mark.parametrize("link", [None, "gen1x1"])
@pytest.mark.parametrize("refuse_every", [0, 3])
def test_decode_through_graph_steps_is_identical(path, costs, reference, refuse_every, link):
    _, chunked, decode = reference
    rig = Rig.cpus(3, link=link, backend_factory=lambda phys: _GraphStepBackend(phys, refuse_every))
    plan = _plan(costs, "3 devices")
    with load_model(path, placement=plan, devices=rig) as model:
        hidden = model.config.hidden
        states = model.new_state(64)
        got = model.forward(PROMPT, states, np.arange(len(PROMPT)), rows="all", chunk=8)
        np.testing.assert_array_equal(got, chunked)
        pipe = model.executor
        assert pipe.chain_graphs  # a simulated link passes its time on the streams (RigBackend.graph_step)
        before = [rig.backend(n).transferred_bytes for n in rig.names]
        token = int(np.argmax(got[-1]))
        for k in range(4):
            row = model.forward([token], states, np.array([len(PROMPT) + k]))[-1]
            np.testing.assert_array_equal(row, decode[k])
            token = int(np.argmax(row))
        inners = [rig.backend(n).inner for n in rig.names]
        assert all(b.calls == 4 for b in inners)
        if refuse_every:
            assert pipe.eager_stage_steps == 3 and pipe.graphed_stage_steps == 9
        else:
            assert pipe.eager_stage_steps == 0 and pipe.graphed_stage_steps == 12
            assert all(b.captures == 1 and b.replays == 3 for b in inners)
        # chained, with or without a link: the stages before the last hand their output on through an
        # event (the host does not wait for it; a host device's link waits for it before its time)
        deferred = sum(b.deferred for b in inners[:-1])
        assert deferred == pipe.graphed_stage_steps - sum(b.replays + b.captures for b in inners[-1:])
        if link is not None:
            # every hop is charged to both risers whether the stage was replayed or eager: the first
            # device sends one hidden state per token (the last one's logits are charged only when eager)
            sent = rig.backend("cpu:0").transferred_bytes - before[0]
            assert sent == 4 * hidden * 4
            middle = rig.backend("cpu:1").transferred_bytes - before[1]
            assert middle == 2 * 4 * hidden * 4
        assert all(b.step_buffer.shape == (1, hidden) for b in pipe.bridges)
        # graphs off: the same stages, every one eager, same logits
        pipe.use_graphs = False
        calls = [b.calls for b in inners]
        states2 = model.new_state(64)
        model.forward(PROMPT, states2, np.arange(len(PROMPT)), rows="last", chunk=8)
        row = model.forward([int(np.argmax(chunked[-1]))], states2, np.array([len(PROMPT)]))[-1]
        np.testing.assert_array_equal(row, decode[0])
        assert [b.calls for b in inners] == calls


def test_bench_split_reports_decode_modes_and_memory(path, costs):
    plan = Placement.from_layer_counts(costs, [("cpu:0", 4), ("cpu:1", 4)])
    rig = Rig.cpus(2, backend_factory=lambda phys: _GraphStepBackend(phys))
    with load_model(path, placement=plan, devices=rig) as model:
        result = bench_split(model, prompt_tokens=20, chunk=8, decode_tokens=3, sequential=False)
    assert result.sequential_prefill_seconds == 0 and result.overlap_speedup == 0
    assert result.decode_eager_tokens_per_s > 0 and result.graphed_stage_steps == 2 * (3 + 1)  # + capture
    assert result.eager_stage_steps == 0
    assert set(result.memory) == {"cpu:0", "cpu:1"}
    for m in result.memory.values():
        assert m["how"].startswith("resident") and 0.9 < m["ratio"] < 1.1, m
    text = "\n".join(result.lines())
    assert "graphs off" in text and "measured/estimate" in text


def test_reload_placement_moves_parts_and_keeps_the_logits(path, costs, reference):
    """A placement change on a loaded model (the app's Apply): only moved parts are reloaded, the tied
    embedding/head table is reused where it stays, and the new split gives the same logits."""
    whole = reference[0]
    with load_model(path, devices=["cpu:0"]) as model:
        kept = model.weights["layer.0"]
        model.reload_placement(_plan(costs, "3 devices, head apart"))
        assert model.executor.devices == ["cpu:0", "cpu:1", "cpu:2"]
        assert model.weights["layer.0"] is kept  # not moved, not reloaded
        np.testing.assert_array_equal(model.logits(PROMPT), whole)
        model.reload_placement({p: "cpu:0" for p in model.device_plan})
        assert not model.executor.split
        np.testing.assert_array_equal(model.logits(PROMPT), whole)


def test_automatic_plans_know_the_cards_speeds(monkeypatch, path):
    """Device names the listing reports get their profile's speed, so the automatic plan puts a 9B on
    the faster card even when it is listed second (it used to fill cards in order)."""
    from minecart.engine import devices as devices_mod
    from minecart.engine.devices import DeviceInfo
    from minecart.engine.execution import device_specs
    from minecart.engine.placement import costs_for_shape, plan_auto

    listed = [DeviceInfo(id="cuda:0", kind="cuda", name="NVIDIA P104-100", total_bytes=8 << 30,
                         used_bytes=0, free_bytes=8 << 30),
              DeviceInfo(id="cuda:1", kind="cuda", name="NVIDIA CMP 100-210", total_bytes=16 << 30,
                         used_bytes=0, free_bytes=16 << 30)]
    monkeypatch.setattr(devices_mod, "list_devices", lambda **_: listed)
    specs = device_specs(["cuda:0", "cuda:1"])
    assert [s.speed is not None for s in specs] == [True, True]
    assert specs[1].speed.bandwidth > specs[0].speed.bandwidth
    plan = plan_auto(costs_for_shape("qwen3.5-9b", "Q4_K"), devices=specs)
    assert plan.parts_on("cuda:1") and not any(p.startswith("layer.") for p in plan.parts_on("cuda:0"))
