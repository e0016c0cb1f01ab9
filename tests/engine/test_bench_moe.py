"""`minecart bench` prices a MoE decode token by the experts it runs, not by every expert stored."""

from __future__ import annotations

import re

from minecart.engine.cli.bench_cmd import weight_bytes_per_token
from minecart.engine.gguf_file import GGUFFile
from minecart.engine.model import load_model

from tests._moe import tiny_moe_file


def test_moe_weight_bytes_count_only_the_used_experts(tmp_path_factory):
    path = tiny_moe_file(tmp_path_factory, "separate")
    gf = GGUFFile(path)
    with load_model(path, devices=["cpu:0"]) as model:
        cfg = model.config
        assert (cfg.n_experts, cfg.n_experts_used) == (8, 2)
        stored = active = 0
        for name, info in gf.tensors.items():
            m = re.match(r"blk\.(\d+)\.", name)
            if (m and int(m.group(1)) >= cfg.n_layers) or name == "token_embd.weight":
                continue  # MTP block and the untied embedding table: not read per decode token
            stored += info.n_bytes
            active += info.n_bytes * 2 // 8 if "_exps." in name else info.n_bytes
        assert weight_bytes_per_token(model) == active
        assert active < stored  # the experts are most of this model: 6 of 8 are not read


def test_bench_reports_host_experts(capsys):
    """--experts-on host: the report says where the experts are and what decode's CPU experts read per
    second beside the CPU's copy bandwidth (on a CPU 'GPU' nothing is streamed: the GPU rig's
    streamed bytes/s come from tests/gpu/test_experts_stream.py and the lead's benchmark)."""
    import json

    from minecart.engine.cli import main

    rc = main(["bench", "--shape", "tiny-moe", "--quant", "q8_0", "--device", "cpu:1", "--prefill", "64",
               "--decode-ctx", "0", "--decode-tokens", "4", "--experts-on", "host", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    h = res["host_experts"]
    assert h["layers"] == 8 and h["stream_min_tokens"] is None and h["prefill"] == []
    assert h["expert_bytes_per_token"] > 0 and h["cpu_copy_gbs"] > 0
    (d,) = h["decode"]
    want = h["expert_bytes_per_token"] * res["decode"][0]["tokens_per_s"] / 1e9
    assert d["cpu_expert_gbs"] == want and d["vs_cpu_copy"] == want / h["cpu_copy_gbs"]
