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
