"""tools/bench_generate.py on the CPU (NumPy backend) with the tiny fixture: every loop it times, on
the model alone and through a Scheduler whose lone generation launches its own steps or, with
--batched-steps, sends every step through the scheduler's thread."""

from __future__ import annotations

import pytest

from tools import bench_generate


@pytest.fixture
def fixture_file(fixtures_dir):
    return fixtures_dir / "dense/qwen35-tiny-dense-q8_0.gguf"


@pytest.mark.parametrize("scheduler", [[], ["--scheduler", "2"], ["--scheduler", "2", "--batched-steps"]])
def test_every_loop_is_timed(fixture_file, capsys, scheduler):
    assert bench_generate.main([str(fixture_file), "--device", "cpu:0", "--tokens", "6", "--prompt", "12",
                                "--repeat", "1", "--consumer-us", "0", *scheduler]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  generate")]
    assert [ln.split(",")[1].strip() for ln in lines] == ["greedy"] * 2 + ["sampled"] * 2 + ["app default"] * 2
    assert all("(6 tokens, 0 steps chained)" in ln for ln in lines)  # no graphs on a CPU


@pytest.mark.parametrize("unchained", [[], ["--unchained-passes"]])
def test_concurrent_generations_are_timed(fixture_file, capsys, unchained):
    """--concurrent: three generations at once for each sampler; their rows are chained passes (the
    scheduler draws each token, the app default's with its penalties) unless --unchained-passes."""
    assert bench_generate.main([str(fixture_file), "--device", "cpu:0", "--tokens", "8", "--prompt", "12",
                                "--repeat", "1", "--concurrent", "3", *unchained]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("run 1: 3 at once")]
    assert [ln.split(",")[1].split(":")[0].strip() for ln in lines] == ["greedy", "sampled", "app default"]
    chained = [int(ln.split("(")[1].split()[0]) for ln in lines]
    assert all(float(ln.split(": ")[2].split()[0]) > 0 for ln in lines)
    if unchained:
        assert chained == [0, 0, 0]
    else:
        assert all(c > 0 for c in chained)


def test_a_stubbed_step_measures_the_hosts_share(fixture_file, capsys):
    """--stub-step-ms: the steps are waits returning random logits; each sampler's rate is printed as a
    share of concurrent / step time, which the host's time between steps keeps below 1."""
    assert bench_generate.main([str(fixture_file), "--device", "cpu:0", "--tokens", "40", "--prompt", "12",
                                "--repeat", "1", "--concurrent", "3", "--stub-step-ms", "5"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("run 1: 3 at once")]
    assert len(lines) == 3
    for ln in lines:
        share = float(ln.split("passes, ")[1].split()[0])
        assert 0.05 < share < 1.0, ln
        assert "of the 600 with no host time" in ln
