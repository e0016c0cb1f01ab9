"""Routed experts apart from their layer (engine/experts.py): the tiny MoE model with every layer on one
device and its routers + experts on another gives the same logits and greedy tokens as the model on
one device, the experts' weights live on their device only, and a placement change keeps them there.
(On a GPU rig the layer device is a CUDA card and the experts device the host: tests/gpu.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
from minecart.engine.experts import ExpertsApart
from minecart.engine.model import load_model
from minecart.engine.sampling import greedy_params

from tests._moe import tiny_moe_file

PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, 640, size=37)]


@pytest.fixture(scope="module", params=["separate", "fused"])
def moe_path(request, tmp_path_factory):
    return tiny_moe_file(tmp_path_factory, request.param)


def _greedy(model, n=12):
    return [e.token for e in model.generate(PROMPT, greedy_params(max_tokens=n))]


def test_experts_on_another_device_give_the_same_model(moe_path):
    with load_model(moe_path, devices=["cpu:0"]) as ref:
        want_logits = ref.logits(PROMPT)
        want_tokens = _greedy(ref)
    with load_model(moe_path, devices=["cpu:0"], experts="cpu:1") as model:
        n = model.config.n_layers
        assert all(model.device_plan[f"layer.{i}.experts"] == "cpu:1" for i in range(n))
        be = model.backends["layer.0"]
        assert isinstance(be, ExpertsApart) and model.backends["global"] is be  # one proxy per device
        # the routers and experts are held by the experts' backend, not the layer's part
        assert not any("exps" in name or "gate_inp.weight" in name
                       for name in model.weights["layer.0"] if "shexp" not in name)
        assert any("exps" in name for name in model.weights["layer.0.experts"])
        np.testing.assert_array_equal(model.logits(PROMPT), want_logits)
        calls = be.host_moe_calls
        assert calls >= n  # every MoE layer's experts ran on the other device
        assert _greedy(model) == want_tokens
        assert be.graph_step(("stage", 0), None, [1], np.array([0]), owner=[]) is None


def test_placement_change_keeps_the_experts_where_they_are(moe_path):
    with load_model(moe_path, devices=["cpu:0"]) as ref:
        want = ref.logits(PROMPT)
    with load_model(moe_path, devices=["cpu:0"], experts="cpu:2") as model:
        held = model.weights["layer.1.experts"]
        plan = {p: "cpu:0" for p in model.device_plan if not p.endswith(".experts")}
        plan.update({f"layer.{i}": "cpu:1" for i in range(1, model.config.n_layers)})
        plan["head"] = "cpu:1"
        model.reload_placement(plan)
        assert model.weights["layer.1.experts"] is held and model.device_plan["layer.1.experts"] == "cpu:2"
        assert isinstance(model.backends["layer.1"], ExpertsApart)
        np.testing.assert_array_equal(model.logits(PROMPT), want)
        # experts moved back beside their layer (same device): no proxy there
        model.reload_placement({p: "cpu:2" for p in plan})
        assert not isinstance(model.backends["layer.1"], ExpertsApart)
        np.testing.assert_array_equal(model.logits(PROMPT), want)


def test_the_cli_puts_experts_in_host_ram(moe_path):
    from minecart.engine.cli import build_parser
    from minecart.engine.cli.run_cmd import start_runtime

    args = build_parser().parse_args(["run", str(moe_path), "--devices", "cpu:1", "--experts-on", "host",
                                      "-p", "x"])
    rt = start_runtime(args, quiet=True)
    try:
        final = rt.complete([1, 2, 3], greedy_params(max_tokens=3)).wait(60)
        assert final.kind == "done" and final.usage.completion_tokens == 3
        info = rt.model_info
        assert info is not None and "cpu:0" in info.devices and "cpu:1" in info.devices
    finally:
        rt.close()


def test_a_placement_with_an_experts_device_loads_them_there(moe_path):
    import dataclasses

    from minecart.engine.config import ModelConfig
    from minecart.engine.gguf_file import GGUFFile
    from minecart.engine.placement import Placement, model_costs

    with load_model(moe_path, devices=["cpu:0"]) as ref:
        want = ref.logits(PROMPT)
    with GGUFFile(moe_path) as gf:
        costs = model_costs(ModelConfig.from_gguf(gf), gf, layout="numpy")
    plan = dataclasses.replace(Placement.single(costs, "cpu:0"), experts_device="cpu:1")
    with load_model(moe_path, placement=plan, devices=["cpu:0", "cpu:1"]) as model:
        assert model.device_plan["layer.0.experts"] == "cpu:1"
        assert isinstance(model.backends["layer.0"], ExpertsApart)
        np.testing.assert_array_equal(model.logits(PROMPT), want)


# ---- streaming host-held experts to the GPU for prefill: the proxy's decisions, on the CPU ---------------


class _LoggedStream:
    """An ExpertStream stand-in: 'stages' a layer by handing back its host weights (so the numbers are
    the host's), and logs what the proxy asks of it."""

    def __init__(self):
        self.log: list = []
        self.layers: dict = {}
        self.staged: set = set()

    def add_layer(self, key, experts, router):
        self.layers[key] = {**experts, "router": router}

    def layer_bytes(self, key):
        return sum(w.info.n_bytes for n, w in self.layers[key].items() if n != "router")

    def active_bytes(self, key, k):
        return 1.0

    def prefetch(self, key):
        if key not in self.staged:
            self.log.append(("prefetch", key))
            self.staged.add(key)

    def acquire(self, key):
        self.prefetch(key)
        self.log.append(("acquire", key))
        return self.layers[key]

    def release(self, key):
        self.log.append(("release", key))

    def settle(self):
        self.log.append(("settle",))

    def close(self):
        self.log.append(("close",))


def _moe_args(model, i):
    w = model.weights[f"layer.{i}.experts"]
    p = f"blk.{i}."
    fused = w.get(p + "ffn_gate_up_exps.weight")
    return (w[p + "ffn_gate_inp.weight"], fused if fused is not None else w[p + "ffn_gate_exps.weight"],
            None if fused is not None else w[p + "ffn_up_exps.weight"], w[p + "ffn_down_exps.weight"])


def test_a_long_chunk_streams_each_layer_and_prefetches_the_next(moe_path):
    with load_model(moe_path, devices=["cpu:0"], experts="cpu:1") as model:
        host = model.backends["layer.0"]
        assert isinstance(host, ExpertsApart) and host.stream is None  # CPU layers: nothing to stream
        st = _LoggedStream()
        proxy = ExpertsApart(host.inner, host.experts, stream=st)
        n = model.config.n_layers
        for i in range(n):
            proxy.hold(model.weights[f"layer.{i}.experts"])
        assert sorted(st.layers) == list(range(n))
        proxy.min_stream_tokens = 4
        k = model.config.n_experts_used
        x = np.random.default_rng(1).standard_normal((9, model.config.hidden)).astype(np.float32)
        for i in range(n):
            got = proxy.moe(x, *_moe_args(model, i), k)
            np.testing.assert_array_equal(got, host.moe(x, *_moe_args(model, i), k))  # the same numbers
        want = [("prefetch", 0), ("acquire", 0)]
        for i in range(n):
            if i + 1 < n:
                want.append(("prefetch", i + 1))  # issued as layer i's MoE starts
            want += [("release", i)] + ([("acquire", i + 1)] if i + 1 < n else [])
        assert st.log == want  # nothing prefetched past the last layer: no copy left in flight
        assert proxy.streamed_moe_calls == n and proxy.host_moe_calls == 0
        # a short chunk (decode) runs on the host; so does every chunk with streaming off
        proxy.moe(x[:3], *_moe_args(model, 0), k)
        proxy.streaming = False
        proxy.moe(x, *_moe_args(model, 1), k)
        assert proxy.host_moe_calls == 2 and proxy.streamed_moe_calls == n
        # a failure inside the MoE settles the copies in flight and frees the buffer
        st.log.clear()
        proxy.streaming = True
        with pytest.raises(ValueError):
            proxy.moe(x[:, :5], *_moe_args(model, 2), k)
        assert ("settle",) in st.log and st.log[-1] == ("release", 2)


def test_the_stream_threshold_is_copy_time_over_cpu_time_per_token(moe_path):
    from minecart.engine.placement import (
        POOL_EXPERT_DECODE_EFFICIENCY,
        DeviceSpeed,
        Link,
        stream_min_tokens_for,
    )

    with load_model(moe_path, devices=["cpu:0"], experts="cpu:1") as model:
        host = model.backends["layer.0"]
        st = _LoggedStream()
        # the expert pool reads 5e5 bytes/s here: 1 active byte per token (the stand-in) is 2 us
        cpu = DeviceSpeed("test CPU", 5e5 / POOL_EXPERT_DECODE_EFFICIENCY, 0.0, 1e9)
        proxy = ExpertsApart(host.inner, host.experts, stream=st, link=Link(1e6, 0.0), cpu=cpu)
        proxy.hold(model.weights["layer.0.experts"])
        want = stream_min_tokens_for(st.layer_bytes(0), 2e-6, Link(1e6, 0.0))
        assert proxy.stream_min_tokens(0, 2) == want == -(-st.layer_bytes(0) // 2)


def test_once_the_pool_has_a_rate_the_threshold_takes_it(moe_path, monkeypatch):
    """The expert pool's own seconds a token (ExpertPool.seconds_per_token) replace the planner's
    figure in the threshold: a CPU 4x slower than that figure streams from a quarter of the tokens."""
    from minecart.engine.placement import Link, stream_min_tokens_for

    class Pool:
        rate: float | None = None

        def seconds_per_token(self):
            return self.rate

    pool = Pool()
    monkeypatch.setattr(ExpertsApart, "expert_pool", property(lambda self: pool))
    with load_model(moe_path, devices=["cpu:0"], experts="cpu:1") as model:
        host = model.backends["layer.0"]
        st = _LoggedStream()
        proxy = ExpertsApart(host.inner, host.experts, stream=st, link=Link(1e6, 0.0))
        proxy.hold(model.weights["layer.0.experts"])
        planned = proxy.stream_min_tokens(0, 2)  # no rate yet: the planner's
        per_token = st.layer_bytes(0) / 1e6 / planned
        pool.rate = 4 * per_token
        assert proxy.stream_min_tokens(0, 2) == stream_min_tokens_for(st.layer_bytes(0), 4 * per_token, proxy.link)
        assert proxy.stream_min_tokens(0, 2) == pytest.approx(planned / 4, abs=1)


def test_a_real_cards_threshold_takes_its_link_as_measured_on_it(moe_path, monkeypatch):
    """Without a simulated link the stream threshold takes the card's own link as measured on it
    (DeviceHooks.host_copy_rate), not a desktop slot's: a card on a Gen1 x1 riser streams a layer's
    experts ~60x slower than DEFAULT_LINK says. A rig's simulated link still wins."""
    from minecart.engine.backends.numpy_backend import NumpyBackend
    from minecart.engine.placement import DEFAULT_LINK, Link
    from minecart.engine.rig import Rig

    with load_model(moe_path, devices=["cpu:0"], experts="cpu:1") as model:
        assert model.backends["layer.0"].link == DEFAULT_LINK  # a host backend: no link to measure
    measured: list[str] = []

    def riser(self):
        measured.append(str(self.device))
        return 250e6, 20e-6

    monkeypatch.setattr(NumpyBackend, "host_copy_rate", riser)
    riser_link = Link(250e6, 20e-6, "measured on the card")
    for devices in (["cpu:0"], Rig.cpus(1, caps=[8 << 30])):  # a bare device; one under a rig's cap only
        measured.clear()
        with load_model(moe_path, devices=devices, experts="cpu:1") as model:
            proxy = model.backends["layer.0"]
            assert isinstance(proxy, ExpertsApart) and proxy.link == riser_link
            assert measured == ["cpu:0"]  # the layers' device, once
    with load_model(moe_path, devices=Rig.cpus(1, link="100MB/s"), experts="cpu:1") as model:
        assert model.backends["layer.0"].link.bandwidth == 1e8


def test_the_first_n_layers_keep_their_experts(moe_path):
    with load_model(moe_path, devices=["cpu:0"]) as ref:
        want = ref.logits(PROMPT)
    with load_model(moe_path, devices=["cpu:1"], experts="2") as model:
        n = model.config.n_layers
        assert [model.device_plan[f"layer.{i}.experts"] for i in range(n)] == ["cpu:1"] * 2 + ["cpu:0"] * (n - 2)
        assert model.placement.experts_apart() == {f"layer.{i}": "cpu:0" for i in range(2, n)}
        proxy = model.backends["layer.0"]
        assert isinstance(proxy, ExpertsApart)
        np.testing.assert_array_equal(model.logits(PROMPT), want)
        assert proxy.host_moe_calls == n - 2  # the two kept layers ran beside their layer


def test_auto_with_room_for_everything_keeps_the_experts_with_their_layers(moe_path):
    with load_model(moe_path, devices=["cpu:1"], experts="auto") as model:
        assert model.placement.experts_apart() == {}
        assert not isinstance(model.backends["layer.0"], ExpertsApart)


def test_a_bad_experts_value_is_refused(moe_path):
    from minecart.engine.errors import PlacementError

    with pytest.raises(PlacementError, match="--experts-on 'gpu' is not understood"):
        load_model(moe_path, devices=["cpu:0"], experts="gpu")


# ---- placement: per-layer experts, staging buffers, the stream threshold, --experts-on -------------------


def _costs35():
    from minecart.engine.placement import costs_for_shape

    return costs_for_shape("qwen3.6-35b-a3b", "Q4_K")


def test_experts_device_is_shorthand_for_every_moe_layer():
    from minecart.engine.placement import Placement

    costs = _costs35()
    plan = Placement.single(costs, "cuda:0", experts_device="cpu:0")
    assert plan.experts_apart() == {f"layer.{i}": "cpu:0" for i in range(40)}
    assert plan.experts_device == "cpu:0"
    plan.experts_device = ""
    assert plan.experts == {} and plan.experts_device == "" and plan.expert_parts() == []
    plan.experts = {"layer.39": "cpu:0"}
    assert plan.experts_device == "cpu:0" and [p.name for p in plan.expert_parts()] == ["layer.39"]
    assert plan.experts_of("layer.39") == "cpu:0" and plan.experts_of("layer.0") == "cuda:0"


def test_per_layer_experts_are_priced_where_they_sit_with_two_staging_buffers():
    from minecart.engine.placement import Placement

    costs = _costs35()
    whole = Placement.single(costs, "cuda:0").bytes_per_device()["cuda:0"]
    apart = {f"layer.{i}": "cpu:0" for i in range(10, 40)}
    plan = Placement.single(costs, "cuda:0", experts=apart)
    per = plan.bytes_per_device()
    moved = sum(costs.part(p).expert_bytes for p in apart)
    assert per["cuda:0"].weights == whole.weights - moved and per["cpu:0"].weights == moved
    layer = costs.part("layer.10").expert_bytes
    assert per["cuda:0"].expert_staging == plan.expert_staging_bytes("cuda:0") == 2 * layer
    # the run's scratch holds the staging buffers (beside the load's transient, `staging`, priced apart)
    assert (per["cuda:0"].activations - per["cuda:0"].staging) - (whole.activations - whole.staging) >= 2 * layer
    assert per["cpu:0"].expert_staging == 0
    # layers on the CPU with their experts on the CPU: nothing apart, nothing streamed
    cpu = Placement.single(costs, "cpu:0", experts_device="cpu:0")
    assert cpu.expert_parts() == [] and cpu.bytes_per_device()["cpu:0"].expert_staging == 0


def test_a_per_layer_map_survives_json_and_old_files_still_load():
    from minecart.engine.errors import PlacementError
    from minecart.engine.placement import Placement

    costs = _costs35()
    plan = Placement.single(costs, "cuda:0", experts={f"layer.{i}": "cpu:0" for i in range(5, 40)})
    d = json.loads(plan.to_json())
    assert d["settings"]["experts_device"] == ""  # not every layer's: an older reader keeps them all
    back = Placement.from_json(plan.to_json())
    assert back.experts_apart() == plan.experts_apart() and back.bytes_per_device() == plan.bytes_per_device()
    old = dict(d, settings={k: v for k, v in d["settings"].items() if k != "experts"})
    old["settings"]["experts_device"] = "cpu:0"  # a file from before the map: every layer's experts
    assert Placement.from_dict(old).experts_apart() == {f"layer.{i}": "cpu:0" for i in range(40)}
    every = Placement.single(costs, "cuda:0", experts_device="cpu:0")
    assert json.loads(every.to_json())["settings"]["experts_device"] == "cpu:0"
    with pytest.raises(PlacementError, match="'head' has no routed experts"):
        Placement.single(costs, "cuda:0", experts={"head": "cpu:0"})


def test_the_stream_threshold_falls_as_the_link_gets_faster():
    from minecart.engine.placement import (
        CPU_SPEED,
        HOST_EXPERT_LAYER_SECONDS,
        Link,
        _decode_seconds,
        host_expert_seconds,
        stream_min_tokens,
    )
    from minecart.engine.placement import stream_min_tokens_for as from_numbers
    from minecart.engine.rig import LINKS

    p = _costs35().part("layer.0")
    t = [stream_min_tokens(p, LINKS[name]) for name in ("gen1x1", "gen3x4", "gen4x16")]
    assert t[0] > t[1] > t[2] >= 1
    # the CPU's side is the integer kernels' time for a token's used experts (8 of 256: their bytes),
    # the price of the same layer's experts in a decoded token less its round trip
    used = p.expert_bytes * 8 / 256
    per_token = host_expert_seconds(used, CPU_SPEED)
    decode = _decode_seconds([p], CPU_SPEED, 0, "f16", True, True) - HOST_EXPERT_LAYER_SECONDS
    assert per_token == pytest.approx(decode, rel=0.02)
    # behind Gen1 x1 a layer's copy takes longer than a runtime chunk's 2,048 tokens on the CPU, so the
    # runtime computes them there; Gen3 x4 streams them
    assert t[0] > 2048 > t[1]
    copy = LINKS["gen3x4"].seconds(p.expert_bytes)
    assert (t[1] - 1) * per_token < copy <= t[1] * per_token  # the fewest tokens for which the copy wins
    assert from_numbers(10 ** 6, 1e-3, Link(1e9, 0.0)) == 1
    assert from_numbers(10 ** 9, 1e-3, Link(1e9, 0.0)) == 1000
    assert from_numbers(10 ** 9, 0.0, Link(1e9, 0.0)) > 10 ** 8  # nothing to gain: never


def test_streamed_prefill_is_predicted_link_bound():
    from minecart.engine.placement import SAMPLED_LOGITS, DeviceSpec, Placement, predict_speed
    from minecart.engine.rig import LINKS

    costs = _costs35()
    speeds = {}
    for link in ("gen1x1", "gen1x4", "gen4x16"):
        plan = Placement.single(costs, "cuda:0", experts_device="cpu:0", chunk=4096)
        devices = [DeviceSpec("cuda:0", 8 << 30, link=LINKS[link]), DeviceSpec("cpu:0", 64 << 30)]
        speeds[link] = predict_speed(plan, devices)
    # slow links bound the prefill; on a fast one the GPU's compute does (a GTX 1070-class card here)
    assert speeds["gen1x1"].prefill_tokens_per_s < speeds["gen1x4"].prefill_tokens_per_s \
        < speeds["gen4x16"].prefill_tokens_per_s
    # decode runs the experts on the CPU whatever the link: only each MoE layer's hidden row crosses it,
    # there and back, and the sampler's top logits (values and ids); that is all a slower link adds to a
    # token
    hidden = 4 * costs.hidden
    moe_layers = sum(1 for p in costs.parts if p.experts)
    slow, fast = LINKS["gen1x1"], LINKS["gen4x16"]
    sampled = 8 * SAMPLED_LOGITS
    extra = moe_layers * 2 * (slow.seconds(hidden) - fast.seconds(hidden)) + \
        slow.seconds(sampled) - fast.seconds(sampled)
    slower = 1 / speeds["gen1x1"].decode_tokens_per_s - 1 / speeds["gen4x16"].decode_tokens_per_s
    assert slower == pytest.approx(extra, rel=0.01)
    # Gen1 x1 bounds nothing here: copying a layer's experts over it takes longer than the CPU's integer
    # kernels take for the 4096 tokens, so the chunk stays on the CPU (one token after another); Gen1 x4
    # streams, bound by its link (40 layers x their expert bytes)
    from minecart.engine.placement import (
        HOST_EXPERT_LAYER_SECONDS,
        host_expert_seconds,
        stream_min_tokens,
    )

    moe = [p for p in costs.parts if p.experts]
    assert all(stream_min_tokens(p, LINKS["gen1x1"]) > 4096 > stream_min_tokens(p, LINKS["gen1x4"]) for p in moe)
    cpu_s = sum(4096 * host_expert_seconds(p.expert_bytes * 8 / 256) + HOST_EXPERT_LAYER_SECONDS for p in moe)
    # (one chunk: the GPU's own layers and the hidden rows' trips add to the CPU's time, ~21% here)
    assert 4096 / cpu_s * 0.75 <= speeds["gen1x1"].prefill_tokens_per_s <= 4096 / cpu_s
    link_s = sum(LINKS["gen1x4"].seconds(p.expert_bytes) for p in moe)
    assert 4096 / link_s * 0.95 <= speeds["gen1x4"].prefill_tokens_per_s <= 4096 / link_s


def test_experts_on_values():
    from minecart.engine.errors import PlacementError
    from minecart.engine.placement import check_experts_on, experts_map

    layers = [f"layer.{i}" for i in range(4)]
    assert experts_map("host", layers) == dict.fromkeys(layers, "cpu:0")
    assert experts_map("1", layers) == dict.fromkeys(layers[1:], "cpu:0")
    assert experts_map("9", layers) == {}
    assert experts_map("cpu:1", layers) == dict.fromkeys(layers, "cpu:1")
    assert check_experts_on(" Auto ") == "auto"
    with pytest.raises(PlacementError, match="auto needs"):
        experts_map("auto", layers)
    with pytest.raises(PlacementError, match="not understood"):
        check_experts_on("-3")


@pytest.mark.parametrize("gib,kept", [(200, 40), (8, None), (2, 0)])
def test_auto_fills_the_gpu_with_whole_layers_experts_first(gib, kept):
    from minecart.engine.placement import DeviceSpec, Placement, fill_experts, fits

    costs = _costs35()
    plan = Placement.single(costs, "cuda:0", context=8192)
    devices = [DeviceSpec("cuda:0", gib << 30), DeviceSpec("cpu:0", 64 << 30)]
    apart = fill_experts(plan, devices)
    n_kept = 40 - len(apart)
    assert sorted(apart) == sorted(f"layer.{i}" for i in range(n_kept, 40))  # the first layers keep theirs
    if kept is not None:
        assert n_kept == kept
    else:
        assert 0 < n_kept < 40
        filled = plan.with_settings(experts=apart)
        assert fits(filled, devices)
        one_more = plan.with_settings(experts={p: d for p, d in apart.items() if p != f"layer.{n_kept}"})
        assert not fits(one_more, devices)  # the next layer's experts would not fit


def test_streams_experts_rule():
    from minecart.engine.placement import streams_experts

    gpu_layers = {"global": "cuda:0", "layer.0": "cuda:0", "layer.1": "cuda:1", "head": "cuda:1"}
    assert not streams_experts(gpu_layers)
    assert streams_experts({**gpu_layers, "layer.1.experts": "cpu:0"})
    assert not streams_experts({**gpu_layers, "layer.1.experts": "cuda:0"})  # GPU to GPU: not streamed
    cpu_layers = {"global": "cpu:0", "layer.0": "cpu:0", "head": "cpu:0"}
    assert not streams_experts({**cpu_layers, "layer.0.experts": "cpu:1"})  # the layer is on the host too


def test_prefill_runs_are_at_least_min_chunk(moe_path):
    """Executor.min_chunk (set for streamed host-RAM experts) lengthens the prefill runs a caller asks
    for, and the logits are those of one run of that length."""
    with load_model(moe_path, devices=["cpu:0"], experts="cpu:1") as model:
        ex = model.executor
        assert ex.min_chunk == 0  # layers on the host: nothing is streamed
        runs = []
        real = ex._one_chunk

        def counting(c, states, hook):
            runs.append(len(c.ids))
            return real(c, states, hook)

        ex._one_chunk = counting
        s = model.new_session(64)
        want = s.prefill(PROMPT, chunk=16)
        assert runs == [16, 16, 5]
        s.close()
        ex.min_chunk = 32
        runs.clear()
        s = model.new_session(64)
        got = s.prefill(PROMPT, chunk=16)
        assert runs == [32, 5]
        s.close()
        s = model.new_session(64)
        np.testing.assert_allclose(got, s.prefill(PROMPT, chunk=32), rtol=0, atol=0)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
        s.close()


def test_a_simulated_link_charges_the_host_experts_round_trips(moe_path):
    """A rig device's link pays for each MoE layer's rows going to the host-RAM experts and back."""
    from minecart.engine.rig import Rig, RigBackend

    with load_model(moe_path, devices=Rig.cpus(1, link="100MB/s"), experts="cpu:1") as model:
        proxy = model.backends["layer.0"]
        assert isinstance(proxy, ExpertsApart) and isinstance(proxy.inner, RigBackend)
        rig = proxy.inner
        s = model.new_session(64)
        logits = s.prefill(PROMPT)
        before_bytes, before_s, calls = rig.transferred_bytes, rig.transfer_seconds, proxy.host_moe_calls
        s.step(int(np.argmax(logits)))
        s.close()
        n = proxy.host_moe_calls - calls
        row = 4 * model.config.hidden  # the experts' output coming back
        routed = row + 4 * 2 * model.config.n_experts_used  # going down: the row, its k ids and weights
        assert n == model.config.n_layers  # one round trip per MoE layer for the token
        logits_row = 4 * model.config.vocab_size  # the step's logits to the sampler cross it too
        assert rig.transferred_bytes - before_bytes == (routed + row) * n + logits_row
        assert rig.transfer_seconds - before_s == pytest.approx(n * (40e-6 + (routed + row) / 100e6)
                                                                + 20e-6 + logits_row / 100e6)


@pytest.fixture(scope="module")
def wide_moe_path(tmp_path_factory):
    """tiny-moe with 128 experts of 512 values a layer (Q8_0, 53 MB of routed experts): enough experts
    that moving them to host RAM outweighs the longer prefill runs' activations on the card."""
    from dataclasses import replace

    from minecart.engine.synth import SHAPES, write_synthetic

    path = tmp_path_factory.mktemp("wide-moe") / "wide-moe.gguf"
    write_synthetic(path, replace(SHAPES["tiny-moe"], vocab_size=640, n_experts=128, expert_ffn=512), "q8_0", seed=3)
    return path


def test_a_model_over_a_small_gpu_and_the_cpu_gets_its_experts_in_host_ram_by_itself(wide_moe_path, monkeypatch):
    """load_model over a GPU and the CPU with no plan and no --experts-on: an MoE model too big for the
    card runs its layers there and the routed experts that do not fit in host RAM when that is
    predicted to decode faster than a split of whole layers (placement.faster_with_experts_apart, the
    app's first plan too), and computes what the model alone computes. The "GPU" is a NumPy backend
    named cuda:0 with the memory, speed and link of a P104-100 (resources/gpu_profiles.json)."""
    from minecart.engine import execution
    from minecart.engine import model as model_mod
    from minecart.engine.backends.numpy_backend import NumpyBackend
    from minecart.engine.config import ModelConfig
    from minecart.engine.gguf_file import GGUFFile
    from minecart.engine.gpu_profiles import find
    from minecart.engine.placement import (
        STREAMED_EXPERTS_CHUNK,
        DeviceSpec,
        Placement,
        faster_with_experts_apart,
        model_costs,
        plan_auto,
        predict_speed,
    )
    from minecart.engine.rig import LINKS

    with GGUFFile(wide_moe_path) as gf:
        costs = model_costs(ModelConfig.from_gguf(gf), gf, layout="stored")
    experts = sum(b for p in costs.parts for n, b in p.tensors if "exps" in n)
    whole = Placement.single(costs, "cuda:0").with_settings(chunk=STREAMED_EXPERTS_CHUNK)
    prof = find("NVIDIA P104-100")
    assert prof is not None
    # a card that holds everything but half the routed experts (and the plans' 256 MiB reserve)
    free = whole.bytes_per_device()["cuda:0"].total + 256 * 2**20 - experts // 2
    gpu = DeviceSpec("cuda:0", free, "NVIDIA P104-100", speed=prof.speed, link=LINKS[prof.link])
    specs = [gpu, DeviceSpec("cpu:0", 64 << 30)]
    split = plan_auto(costs, devices=specs)
    assert "cpu:0" in split.devices_used() and not split.experts  # whole layers on the CPU
    chosen = faster_with_experts_apart(split, costs, specs)
    assert chosen.experts and set(chosen.experts.values()) == {"cpu:0"} and set(chosen.assignment) == {"cuda:0"}
    assert len(chosen.experts) < costs.n_layers  # the card keeps some layers' experts
    assert predict_speed(chosen, specs).decode_tokens_per_s > predict_speed(split, specs).decode_tokens_per_s

    def numpy_as(device):  # the card is a NumPy backend that answers to its name
        be = NumpyBackend(device="cpu:1" if device.startswith("cuda") else device)
        be.device = device
        return be

    monkeypatch.setattr(execution, "make_backend", numpy_as)
    monkeypatch.setattr(model_mod, "make_backend", numpy_as)
    with load_model(wide_moe_path, devices=["cpu:0"]) as ref:
        want = ref.logits(PROMPT)
    with load_model(wide_moe_path, devices=specs) as model:
        assert model.placement.experts == chosen.experts
        kept = [i for i in range(model.config.n_layers) if f"layer.{i}" not in chosen.experts]
        apart = [i for i in range(model.config.n_layers) if f"layer.{i}" in chosen.experts]
        assert apart and all(model.device_plan[f"layer.{i}.experts"] == "cpu:0" for i in apart)
        assert all(model.device_plan[f"layer.{i}"] == "cuda:0" for i in kept + apart)
        assert isinstance(model.backends[f"layer.{apart[0]}"], ExpertsApart)
        np.testing.assert_allclose(model.logits(PROMPT), want, rtol=0, atol=1e-4 * float(np.abs(want).max()))
    # an --experts-on the caller gives places the experts itself: the layers stay where plan_auto put them
    with load_model(wide_moe_path, devices=specs, experts="host") as model:
        assert all(model.device_plan[p] == split.device_of(p) for p in split.costs.part_names)
