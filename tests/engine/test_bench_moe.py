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


def test_bench_shows_the_expert_pools_steps_per_token(tmp_path_factory):
    """A layer device that pins host memory (as a GPU does; here a NumPy backend told so) runs its
    host-RAM experts in the expert pool: each decode row carries the pool's own account of the timed
    steps, one call per MoE layer and token, and the table prints it."""
    import pytest
    from minecart.engine import cpu_experts
    from minecart.engine.cli.bench_cmd import bench, format_table
    from minecart.engine.experts import ExpertsApart

    if not cpu_experts.HAVE_NUMBA:
        pytest.skip("numba is not installed")
    path = tiny_moe_file(tmp_path_factory, "fused")  # Q8_0 experts: the integer kernels take them
    with load_model(path, devices=["cpu:0"], experts="cpu:1") as model:
        proxy = model.backends["layer.0"]
        assert isinstance(proxy, ExpertsApart)
        proxy.inner.pins_host_memory = True
        n_moe = sum(1 for p in model.device_plan if p.endswith(".experts"))
        res = bench(model, prefill=(16,), decode_ctx=(0,), decode_tokens=3)
        assert proxy.expert_pool is not None
    (row,) = res["decode"]
    assert row["pool_requests_per_token"] == n_moe
    ms = row["pool_ms_per_token"]
    assert ms["gate_up"] >= ms["gate_up_own"] > 0 and ms["down"] >= ms["down_own"] > 0
    served = sum(ms[k] for k in ("setup", "gate_up", "swiglu", "down", "tail"))
    assert served + ms["wait"] <= 1e3 / row["tokens_per_s"] * 1.05  # within the timed steps
    (h,) = res["host_experts"]["decode"]
    assert h["pool_ms_per_token"] == ms
    assert f"expert pool, ms a token over {n_moe} calls: serving {served:.2f}" in format_table(res)
