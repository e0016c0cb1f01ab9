"""`minecart bench --devices`: the split benchmark runs on CPU devices and compares with one device."""

import json
import subprocess
import sys

from minecart.engine.cli.bench_cmd import split_configs


def test_split_configs_cover_each_device_count_with_and_without_link():
    cfg = split_configs(["cuda:0", "cuda:1", "cuda:2"], "gen1x1")
    assert [c[0] for c in cfg] == ["1 device", "2 devices", "2 devices @gen1x1", "3 devices",
                                   "3 devices @gen1x1"]
    assert cfg[2][1] == "cuda:0@gen1x1,cuda:1@gen1x1"


def test_bench_devices_on_cpu(fixtures_dir):
    model = fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf"
    out = subprocess.run(
        [sys.executable, "-m", "minecart.engine.cli", "bench", str(model), "--devices", "cpu:0,cpu:1",
         "--link", "2000MB/s", "--split-prompt", "64", "--chunk", "32", "--decode-tokens", "2", "--json"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    rows = res["rows"]
    assert [r["config"] for r in rows] == ["1 device", "2 devices", "2 devices @2000MB/s"]
    assert rows[0]["prefill_vs_1"] == 1.0
    assert all(r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 for r in rows)
    assert rows[1]["link_bytes"] > 0  # the hidden state crossed devices
    assert rows[0]["link_bytes"] == 0
