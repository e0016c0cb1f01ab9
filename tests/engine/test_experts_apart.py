"""Routed experts apart from their layer (engine/experts.py): the tiny MoE model with every layer on one
device and its routers + experts on another gives the same logits and greedy tokens as the model on
one device, the experts' weights live on their device only, and a placement change keeps them there.
(On a GPU rig the layer device is a CUDA card and the experts device the host: tests/gpu.)"""

from __future__ import annotations

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
