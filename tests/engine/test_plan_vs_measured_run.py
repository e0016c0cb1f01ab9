"""tools/plan_vs_measured.py run: the whole flow on CPU devices (synthesize, plan, load, prefill, decode,
table, JSON), and the GPU comparison arithmetic on made-up measurements (one GPU per device, and
logical devices sharing one GPU)."""

from __future__ import annotations

import json

import pytest
from minecart.engine.placement import KERNEL_MODULES_BYTES, GiB, MiB, Placement, costs_for_shape
from minecart.engine.rig import Rig

from tools import plan_vs_measured as pvm


def test_cpu_run_compares_resident_bytes_exactly(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert pvm.main(["run", "--cpu", "--shapes", "tiny-dense", "--quant", "q8_0", "--layers", "0",
                     "--context", "256", "--prompt", "64", "--decode", "4", "--chunk", "32",
                     "--dir", str(tmp_path), "--json", str(out)]) == 0
    text = capsys.readouterr()
    assert "| tiny-dense | 1 device | cpu:0 resident |" in text.out and "largest memory miss" in text.err
    rows = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in rows] == ["1 device", "2 devices", "3 devices 8:8:6"]
    for r in rows:
        assert r["gpus"] == {}
        for d in r["devices"].values():  # the NumPy backend holds exactly what the plan prices
            assert d["measured_resident"] == d["predicted_resident"] > 0
        assert r["prefill"] > 0 and r["decode"] > 0 and r["prefill_predicted"] > 0
    assert len(rows[1]["devices"]) == 2  # the caps force a split
    # the synthesized file is kept and reused
    assert (tmp_path / "tiny-dense-q8_0-allL.gguf").exists()


def test_row_caps_follow_the_single_device_estimate():
    rows = pvm.row_specs(10 * GiB)
    assert rows[0].rig == "cuda:0"
    rig = Rig.parse(rows[2].rig)
    caps = [d.memory_cap for d in rig.devices]
    assert caps[0] == caps[1] and caps[2] is not None and abs(caps[2] / caps[0] - 0.75) < 0.01
    assert abs(sum(caps) - 1.21 * 10 * GiB) < 3 * MiB


def _measured(plan, rig, gpus, resident, shared):
    return {"config": "x", "rig": "x", "shared_gpu": shared, "plan": plan, "rig_obj": rig, "load_s": 1.0,
            "prefill_s": 1.0, "decode_s": 1.0, "prompt": 2048, "decode": 64, "gpus": gpus, "resident": resident}


def test_gpu_peak_prediction_per_device_and_per_shared_gpu():
    costs = costs_for_shape("qwen3.5-9b", "Q4_K", n_layers=8)
    ctx = 500 * MiB
    one = Placement.single(costs, "cuda:0", context=32768, kv_type="f16")
    b = one.with_settings(cuda_context_bytes=ctx).bytes_per_device()["cuda:0"]
    gpus = {"cuda:0": {"logical": ["cuda:0"], "peak_used": int(b.total * 1.02), "samples": {}, "context": ctx,
                       "outside_eager": 20 * MiB, "outside_graphs": 40 * MiB, "layers": 8,
                       "load_pool_peak": one.load_peak("cuda:0")}}
    r = pvm.predict_row(_measured(one, Rig.parse("cuda:0"), gpus, {"cuda:0": b.resident}, False), "H200")
    g = r["gpus"]["cuda:0"]
    assert g["predicted_peak"] == b.total and abs(g["ratio"] - 1.02) < 1e-6
    assert g["modules_predicted"] == KERNEL_MODULES_BYTES and g["graphs_measured"] == 20 * MiB
    assert g["graph_bytes_per_layer_measured"] == 20 * MiB / 8
    assert r["devices"]["cuda:0"]["resident_ratio"] == 1.0
    assert r["decode_ratio"] == 64 / r["decode_predicted"]
    # two logical devices on one GPU: resident bytes, graphs and the arenas' padding add up, the widest
    # scratch and one context count once
    two = Placement.from_layer_counts(costs, [("cuda:0", 4), ("cuda:1", 4)], context=32768, kv_type="f16")
    per = two.with_settings(cuda_context_bytes=ctx).bytes_per_device()
    want = (sum(x.total - x.overhead - x.activations for x in per.values()) + max(x.activations for x in per.values())
            + ctx + KERNEL_MODULES_BYTES + sum(x.graphs + x.rounding for x in per.values()))
    assert all(x.rounding > 0 for x in per.values())  # the padding of the weight arenas (one per part)
    # the run's peak: the same without the load's excess (`staging`, part of activations)
    run = want - max(x.activations for x in per.values()) + max(x.activations - x.staging for x in per.values())
    load = max(two.load_peak("cuda:0"), per["cuda:0"].weights + two.load_peak("cuda:1"))
    gpus = {"cuda:0": dict(gpus["cuda:0"], logical=["cuda:0", "cuda:1"], peak_used=run, load_pool_peak=load)}
    r = pvm.predict_row(_measured(two, Rig.parse("cuda:0=6GiB,cuda:1=6GiB"), gpus,
                                  {d: x.resident for d, x in per.items()}, True), "H200")
    assert r["gpus"]["cuda:0"]["predicted_peak"] == want and r["gpus"]["cuda:0"]["run_predicted"] == run
    assert r["gpus"]["cuda:0"]["run_ratio"] == 1.0 and r["gpus"]["cuda:0"]["load_ratio"] == 1.0
    assert pvm.worst_misses([r])[0] == pytest.approx(0.0)
    assert "cuda:1 resident" in pvm.run_table([dict(r, shape="9b")])
