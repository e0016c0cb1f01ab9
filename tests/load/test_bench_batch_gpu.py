"""tools/bench_batch_gpu.py on the CPU (NumPy backend) with a tiny synthesized model: synthesis and reuse
of the file, the decode rates per batch size with their ratios, the time to first token alone and while
others decode through the scheduler, the table and the JSON, and the time budget."""

from __future__ import annotations

import json

from tools import bench_batch_gpu as bench

ARGS = ["--device", "cpu:0", "--shape", "tiny-dense", "--quant", "q8_0", "--steps", "3", "--context", "8",
        "--repeat", "1", "--chunk", "16"]


def test_cpu_run_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "res.json"
    assert bench.main([*ARGS, "--dir", str(tmp_path), "--batches", "1,2,4", "--ttft-prompt", "40",
                       "--others", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| concurrent | step returns | tok/s |" in text and "time to first token, 40-token prompt" in text
    assert "| 4 | top 20 logits |" in text and "| 4 | whole rows |" in text
    res = json.loads(out.read_text())
    assert [(r["batch"], r["top"]) for r in res["decode"]] == [(1, 0), (2, 0), (4, 0), (1, 20), (2, 20), (4, 20)]
    for r in res["decode"]:
        assert r["tok_s"] > 0 and r["steps"] == 3 and r["graphed_steps"] == 0  # no graphs on a CPU
        assert abs(r["tok_s"] - r["batch"] * r["steps"] / r["seconds"]) < 1e-6 * r["tok_s"]
    assert res["decode"][0]["ratio"] == 1.0 and res["decode"][3]["ratio"] == 1.0  # each top against its B=1
    t = res["ttft"]
    assert t["alone_s"] > 0 and t["busy_s"] > 0 and abs(t["ratio"] - t["busy_s"] / t["alone_s"]) < 1e-9
    assert t["others_decoding_at_start"] == 2
    assert set(res["met"]) == {"ttft"} and res["skipped"] == []
    assert (tmp_path / "tiny-dense-q8_0.gguf").exists()  # kept for the next run


def test_budget_skips_what_does_not_fit(tmp_path, capsys):
    out = tmp_path / "res.json"
    assert bench.main([*ARGS, "--dir", str(tmp_path), "--batches", "1,8", "--ttft-prompt", "40",
                       "--budget", "0", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["decode"] == [] and res["ttft"] is None
    assert res["skipped"] == ["decode B=1 top 0 round 1", "decode B=8 top 0 round 1", "decode B=1 top 20 round 1",
                              "decode B=8 top 20 round 1", "time to first token"]
    assert "skipped (time budget)" in capsys.readouterr().out


def test_ratio_targets_are_judged(tmp_path):
    out = tmp_path / "res.json"
    assert bench.main([*ARGS, "--dir", str(tmp_path), "--batches", "1,8", "--tops", "1", "--ttft-prompt", "0",
                       "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    r8 = res["decode"][1]
    assert res["met"] == {"8/1 top 1": r8["ratio"] >= bench.TARGETS["8"]} and res["ttft"] is None
