"""tools/bench_batch_churn.py on the CPU (NumPy backend) with the tiny fixture: members replaced on
schedule, the rate counted over the steps only, the lines it prints."""

from __future__ import annotations

import pytest
from minecart.engine import load_model

from tools import bench_batch_churn as churn


@pytest.fixture
def fixture_file(fixtures_dir):
    return fixtures_dir / "dense/qwen35-tiny-dense-q8_0.gguf"


def test_members_are_replaced_on_schedule(fixture_file):
    model = load_model(fixture_file, devices=["cpu:0"])
    try:
        r = churn.run(model, batch=3, every=4, steps=9, prompt=6, capacity=64, seed=1)
        steady = churn.run(model, batch=3, every=0, steps=5, prompt=6, capacity=64, seed=1)
    finally:
        model.close()
    assert r["replaced"] == 2 and steady["replaced"] == 0  # steps 4 and 8
    for res, steps in ((r, 9), (steady, 5)):
        assert res["steps"] == steps and res["graphed"] == 0  # no graphs on a CPU
        assert abs(res["tok_s"] - 3 * steps / (res["step_ms"] * steps / 1e3)) < 1e-6 * res["tok_s"]


def test_main_prints_a_line_per_schedule(fixture_file, capsys):
    assert churn.main([str(fixture_file), "--device", "cpu:0", "--batch", "2", "--steps", "4", "--every", "0,2",
                       "--prompt", "4", "--capacity", "32"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("batch 2")]
    assert len(lines) == 2 and "(0 in all)" in lines[0] and "every 2 steps (1 in all)" in lines[1]
    assert all("0/4 steps replayed a batch graph" in ln for ln in lines)
