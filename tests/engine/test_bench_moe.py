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
