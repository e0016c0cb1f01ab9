"""`minecart bench` on the CPU backend with the fixture: the table/JSON plumbing and the two
per-token quantities its ceilings use (weight bytes read per decode token, int8 ops per prompt token).
The GPU numbers themselves come from tools/gpu_runner.sh (docs/BENCHMARKS.md)."""

from __future__ import annotations

import io
import json
import re
import tempfile
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
    # the CPU's own ceilings, measured in the run: memory copy bandwidth and the fp32 FMA rate
    assert set(res["ceilings"]) == {"copy_gbs", "fma_tflops"}
    assert all(v > 0 for v in res["ceilings"].values())
    assert all(0 < r["ratio"] and r["ceiling_tokens_per_s"] > 0 for r in res["prefill"] + res["decode"])
    table = format_table(res)
    assert "prefill 40" in table and "decode @ 20" in table
    assert "copy" in table and "GFLOP/s" in table or "TFLOP/s" in table


def test_table_without_ceilings_says_so_and_shows_no_zero_ratios():
    res = {"model": "m.gguf", "backend": "B", "ceilings": {}, "weight_bytes_per_token": 19_658_656,
           "int8_ops_per_token": 512, "kernels": {},
           "prefill": [{"tokens": 16, "seconds": 0.01, "tokens_per_s": 1600.0}],
           "decode": [{"context": 0, "tokens": 2, "tokens_per_s": 400.0}]}
    table = format_table(res)
    assert "none measured" in table and "19.66 MB" in table
    assert "0%" not in table
    assert table.splitlines()[-1].split() == ["decode", "@", "0", "400.0", "-", "-"]


def test_progress_lines_are_words_not_dicts(fixtures_dir, capsys):
    assert main(["bench", str(fixtures_dir / FIXTURE), "--device", "cpu:0", "--prefill", "8",
                 "--decode-ctx", "0", "--decode-tokens", "2"]) == 0
    captured = capsys.readouterr()
    assert "{" not in captured.err and "{" not in captured.out, captured.err


def test_bench_checks_the_device_before_synthesizing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    work = tmp_path / "work"
    assert main(["bench", "--shape", "tiny-dense", "--device", "cuda:99", "--workdir", str(work)]) == 1
    err = capsys.readouterr().err
    assert "cuda:99" in err and "--device cpu:0" in err  # bench's own flag
    assert not work.exists()  # nothing written, not even the folder
    assert main(["bench", "--shape", "tiny-dense", "--device", "cuda:99"]) == 1
    assert list((tmp_path / "tmp").iterdir()) == []


def test_bench_deletes_what_it_synthesized_pass_or_fail(tmp_path, monkeypatch, capsys):
    from minecart.engine.cli import bench_cmd

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args = ["bench", "--shape", "tiny-dense", "--device", "cpu:0", "--prefill", "8", "--decode-ctx", "0",
            "--decode-tokens", "1"]
    assert main(args) == 0
    assert list(tmp_path.iterdir()) == []  # the temporary folder and its file are gone

    def broken(*a, **k):
        raise ValueError("bench failed midway")

    monkeypatch.setattr(bench_cmd, "bench", broken)
    assert main(args) == 70
    assert list(tmp_path.iterdir()) == []

    work = tmp_path / "kept"
    assert main([*args, "--workdir", str(work)]) == 70  # still failing: the file is kept for reuse
    assert [p.name for p in work.iterdir()] == ["tiny-dense-q8_0.gguf"]


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
