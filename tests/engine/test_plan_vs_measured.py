"""tools/plan_vs_measured.py: the speed model beside a split benchmark's JSON (the plan is the one the
engine ran for each rig row; logical devices on one GPU get the no-overlap prefill prediction)."""

from __future__ import annotations

import json

from minecart.engine import gpu_profiles
from minecart.engine.placement import DeviceSpec, costs_for_shape, plan_auto, predict_speed
from minecart.engine.rig import Rig

from tools import plan_vs_measured as pvm

REPORT = {"prompt_tokens": 2048, "chunk": 512, "decode_tokens": 32, "physical_gpus": 1,
          "rows": [{"config": "1 device", "devices": "cuda:0", "prefill_tokens_per_s": 4000.0,
                    "decode_tokens_per_s": 280.0},
                   {"config": "2 devices", "devices": "cuda:0,cuda:1", "prefill_tokens_per_s": 3900.0,
                    "decode_tokens_per_s": 270.0},
                   {"config": "2 devices @gen1x1", "devices": "cuda:0@gen1x1,cuda:1@gen1x1",
                    "prefill_tokens_per_s": 3500.0, "decode_tokens_per_s": 228.8}]}


def test_rows_compare_with_the_plan_the_engine_ran(tmp_path, capsys):
    rows = pvm.compare(REPORT, "qwen3.5-9b", "q8_0", "H200", "f32")
    assert [r["shared_gpu"] for r in rows] == [False, True, True]
    for r, src in zip(rows, REPORT["rows"], strict=True):
        assert r["decode_ratio"] == src["decode_tokens_per_s"] / r["decode_predicted"]
        assert r["prefill_ratio"] == src["prefill_tokens_per_s"] / r["prefill_predicted"]
    # the split row's prediction is the speed model on the engine's own plan for that rig
    specs = Rig.parse("cuda:0@gen1x1,cuda:1@gen1x1").device_specs()
    plan = plan_auto(costs_for_shape("qwen3.5-9b", "Q8_0"), devices=specs).with_settings(
        context=2048 + 68, chunk=512, kv_type="f32")
    assert plan.devices_used() == ["cuda:0", "cuda:1"]
    speed = gpu_profiles.card("H200").speed
    p = predict_speed(plan, [DeviceSpec(d.name, d.free_bytes, speed=speed, link=d.link) for d in specs],
                      prompt=2048, logits_over_link=False)
    assert rows[2]["decode_predicted"] == p.decode_at_context_tokens_per_s
    assert rows[2]["prefill_predicted"] == p.prefill_one_gpu_tokens_per_s <= p.prefill_tokens_per_s
    assert rows[2]["decode_predicted"] < rows[1]["decode_predicted"]  # the riser costs time
    path = tmp_path / "split.json"
    path.write_text(json.dumps(REPORT))
    assert pvm.main(["report", str(path), "--shape", "qwen3.5-9b"]) == 0
    out = capsys.readouterr()
    assert "| 2 devices @gen1x1 (one GPU) |" in out.out and "largest miss" in out.err


def _measured(plan, rig, shared, gpus):
    resident = {d: b.resident for d, b in plan.bytes_per_device().items()}
    return {"config": "x", "rig": "x", "shared_gpu": shared, "plan": plan, "rig_obj": rig, "load_s": 1.0,
            "prefill_s": 1.0, "decode_s": 1.0, "prompt": 512, "decode": 32, "gpus": gpus, "resident": resident}


def test_run_and_load_peaks_are_predicted_apart():
    """The load's peak (context + the pool's high-water mark while weights upload) against context +
    Placement.load_peak (devices on one GPU loaded in order, the earlier ones' weights staying); the
    run's peak against the estimate without the load's excess (`staging`)."""
    from minecart.engine.placement import Placement

    costs = costs_for_shape("qwen3.5-9b", "Q4_K", 8)
    ctx = 500 << 20
    one = Placement.single(costs, "cuda:0", context=2048, chunk=64, kv_type="f16")
    rig = Rig.parse("cuda:0")
    b = one.with_settings(cuda_context_bytes=ctx).bytes_per_device()["cuda:0"]
    gpu = {"logical": ["cuda:0"], "peak_used": b.total, "samples": {}, "context": ctx, "outside_eager": 0,
           "outside_graphs": 0, "layers": 8, "load_pool_peak": one.load_peak("cuda:0")}
    r = pvm.predict_row(_measured(one, rig, False, {"cuda:0": gpu}), "H200")
    g = r["gpus"]["cuda:0"]
    assert b.staging > 0  # a short context and chunk: the embedding's repack is the device's peak
    assert g["load_predicted"] == ctx + one.load_peak("cuda:0") and g["load_ratio"] == 1.0
    assert g["run_predicted"] == b.total - b.staging and g["predicted_peak"] == b.total
    assert g["run_ratio"] == b.total / (b.total - b.staging)
    # two logical devices on one GPU: the second loads beside the first one's weights
    two = Placement.from_layer_counts(costs, [("cuda:0", 4), ("cuda:1", 4)], context=2048, chunk=64, kv_type="f16")
    rig2 = Rig.parse("cuda:0,cuda:1", physical_gpus=1)
    per = two.bytes_per_device()
    want = max(two.load_peak("cuda:0"), per["cuda:0"].weights + two.load_peak("cuda:1"))
    gpu2 = dict(gpu, logical=["cuda:0", "cuda:1"], load_pool_peak=want)
    r = pvm.predict_row(_measured(two, rig2, True, {"cuda:0": gpu2}), "H200")
    assert r["gpus"]["cuda:0"]["load_predicted"] == ctx + want
    assert "load peak" in pvm.run_table([dict(r, shape="9b")])


def test_cpu_smoke_run_with_a_link(tmp_path, capsys):
    """`run --cpu` end to end on the tiny shape, the split rows behind a simulated Gen1 x1 riser."""
    out = tmp_path / "rows.json"
    assert pvm.main(["run", "--cpu", "--shapes", "tiny-dense", "--quant", "q8_0", "--layers", "0", "--context", "256",
                     "--prompt", "32", "--decode", "4", "--chunk", "16", "--dir", str(tmp_path), "--link", "gen1x1",
                     "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in rows] == ["1 device", "2 devices @gen1x1", "3 devices 8:8:6 @gen1x1"]
    assert all(abs(d["resident_ratio"] - 1) < 1e-9 for r in rows for d in r["devices"].values())
    assert "| tiny-dense | 2 devices @gen1x1 |" in capsys.readouterr().out
