"""`minecart bench` on the CPU backend with the fixture: the table/JSON plumbing and the two
per-token quantities its ceilings use (weight bytes read per decode token, int8 ops per prompt token).
The GPU numbers themselves come from tools/gpu_runner.sh (docs/BENCHMARKS.md)."""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stdout

import numpy as np
from minecart.engine.cli import main
from minecart.engine.cli.bench_cmd import (
    format_table,
    matrix_params_per_token,
    weight_bytes_per_token,
)
from minecart.engine.gguf_file import GGUFFile

FIXTURE = "dense/qwen35-tiny-dense-q8_0.gguf"


def test_bench_json_on_cpu(fixtures_dir):
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["bench", str(fixtures_dir / FIXTURE), "--device", "cpu:0", "--prefill", "16,40",
                   "--decode-ctx", "0,20", "--decode-tokens", "2", "--json"])
    assert rc == 0
    res = json.loads(buf.getvalue())
    assert [r["tokens"] for r in res["prefill"]] == [16, 40]
    assert [r["context"] for r in res["decode"]] == [0, 20]
    assert all(r["tokens_per_s"] > 0 for r in res["prefill"] + res["decode"])
    assert res["ceilings"] == {}  # the NumPy backend has no ceilings to measure
    table = format_table(res)
    assert "prefill 40" in table and "decode @ 20" in table


def test_bytes_and_ops_per_token(fixtures_dir):
    from minecart.engine.model import load_model

    path = fixtures_dir / FIXTURE
    gf = GGUFFile(path)
    model = load_model(path, devices=["cpu:0"])
    n_layers = model.config.n_layers
    expected_bytes = 0
    expected_params = 0
    for name, info in gf.tensors.items():
        m = re.match(r"blk\.(\d+)\.", name)
        if m and int(m.group(1)) >= n_layers:
            continue  # MTP block: not run per token
        if name == "token_embd.weight" and not model.config.tied_embeddings:
            continue
        expected_bytes += info.n_bytes
        if m and len(info.shape) == 2:
            expected_params += int(np.prod(info.shape))
    assert weight_bytes_per_token(model) == expected_bytes
    assert matrix_params_per_token(model) == expected_params > 0
