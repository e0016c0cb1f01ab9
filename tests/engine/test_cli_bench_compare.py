"""`minecart bench --quant a,b,c` and `--compare-gguf FILE [--peer-bench LLAMA_BENCH]` on the CPU backend
with the fixture model and a fake llama-bench (a script that records its arguments and prints
llama-bench-shaped JSON): the command line, the peer command, the parsing and the ratios. The contexts
are shrunk here (16/40-token prompts, decode at 0/20) so the CPU run takes seconds; the GPU numbers
come from tools/gpu_runner.sh."""

from __future__ import annotations

import io
import json
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from minecart.engine.cli import bench_compare as bc
from minecart.engine.cli import main
from minecart.engine.errors import MinecartError

FIXTURE = "dense/qwen35-tiny-dense-q8_0.gguf"

FAKE_PEER = r'''
import json, sys
argv = sys.argv[1:]
open(__file__ + ".argv", "w").write(json.dumps(argv))
if "FAIL" in __file__:
    print("ggml_cuda_init: failed to initialize CUDA", file=sys.stderr)
    sys.exit(3)
opt = {argv[i]: argv[i + 1] for i in range(0, len(argv) - 1, 2)}
ints = lambda s: [int(x) for x in s.split(",")]
rows = []
print("llama_model_loader: loaded meta data", file=sys.stderr)
for d in ints(opt["-d"]):
    for p in ints(opt["-p"]):  # prompt tests run at every depth; only depth 0 is ours to compare
        rows.append({"build_commit": "abc1234", "backends": "CUDA", "gpu_info": "Fake GPU", "n_prompt": p,
                     "n_gen": 0, "n_depth": d, "avg_ts": 1000.0 * p / (1 + d), "stddev_ts": 1.0})
    for n in ints(opt["-n"]):
        rows.append({"build_commit": "abc1234", "backends": "CUDA", "gpu_info": "Fake GPU", "n_prompt": 0,
                     "n_gen": n, "n_depth": d, "avg_ts": 100.0 / (1 + d / 20), "stddev_ts": 0.5})
print(json.dumps(rows, indent=2))
'''


def _fake_peer(tmp_path: Path, name: str = "llama-bench") -> Path:
    exe = tmp_path / name
    exe.write_text(f"#!{sys.executable}\n" + FAKE_PEER)
    exe.chmod(0o755)
    return exe


@pytest.fixture
def small_contexts(monkeypatch):
    monkeypatch.setattr(bc, "PEER_PREFILL", (16, 40))
    monkeypatch.setattr(bc, "PEER_DECODE_CTX", (0, 20))
    monkeypatch.setattr(bc, "PEER_DECODE_TOKENS", 2)


def test_peer_command_is_the_peer_tables_contexts():
    assert bc.peer_command("/opt/llama-bench", "m.gguf") == [
        "/opt/llama-bench", "-m", "m.gguf", "-p", "512,4096", "-n", "64", "-d", "0,4096,16384",
        "-fa", "1", "-ngl", "99", "-o", "json"]


def test_peer_sees_only_our_gpu():
    assert bc.peer_env("cuda:1", {"PATH": "/bin"}) == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "1"}
    assert bc.peer_env("cuda:1", {"CUDA_VISIBLE_DEVICES": "4,6"})["CUDA_VISIBLE_DEVICES"] == "6"
    assert "CUDA_VISIBLE_DEVICES" not in bc.peer_env("cpu:0", {})
    with pytest.raises(MinecartError, match="cuda:2 is not among CUDA_VISIBLE_DEVICES=4,6"):
        bc.peer_env("cuda:2", {"CUDA_VISIBLE_DEVICES": "4,6"})


def test_parse_peer_json_keeps_empty_context_prompts_and_every_decode_depth():
    rows = [{"n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 9000.0, "build_commit": "c0ffee"},
            {"n_prompt": 512, "n_gen": 0, "n_depth": 4096, "avg_ts": 7000.0},
            {"n_prompt": 4096, "n_gen": 0, "n_depth": 0, "avg_ts": 9500.0},
            {"n_prompt": 0, "n_gen": 64, "n_depth": 0, "avg_ts": 219.0},
            {"n_prompt": 0, "n_gen": 64, "n_depth": 4096, "avg_ts": 213.0},
            {"n_prompt": 0, "n_gen": 64, "n_depth": 16384, "avg_ts": 204.0}]
    peer = bc.parse_peer_json("ggml_cuda_init: found 1 CUDA device\n" + json.dumps(rows))
    assert peer.prefill == {512: 9000.0, 4096: 9500.0}
    assert peer.decode == {0: 219.0, 4096: 213.0, 16384: 204.0}
    assert peer.label == "c0ffee"
    with pytest.raises(MinecartError, match="no result for decode @ 16384"):
        bc.parse_peer_json(json.dumps(rows[:-1]))
    with pytest.raises(MinecartError, match="no readable JSON"):
        bc.parse_peer_json("[not json")
    with pytest.raises(MinecartError, match="lacks a field"):
        bc.parse_peer_json(json.dumps([{"n_prompt": 512}]))


def test_compare_rows_ratios():
    res = {"prefill": [{"tokens": 512, "tokens_per_s": 5000.0, "ceiling_tokens_per_s": 10000.0, "ratio": 0.5}],
           "decode": [{"context": 0, "tokens": 64, "tokens_per_s": 300.0, "ceiling_tokens_per_s": 400.0,
                       "ratio": 0.75},
                      {"context": 16384, "tokens": 64, "tokens_per_s": 270.0}]}
    peer = bc.PeerResult("x", {512: 10000.0}, {0: 200.0})
    rows = bc.compare_rows(res, peer)
    assert [r["test"] for r in rows] == ["prompt 512", "decode 64 @ 0", "decode 64 @ 16384"]
    assert rows[0]["vs_peer"] == 0.5 and rows[0]["peer_ratio"] == 1.0
    assert rows[1]["vs_peer"] == 1.5 and rows[1]["peer_ratio"] == 0.5
    assert rows[2]["peer_tokens_per_s"] is None and rows[2]["vs_peer"] is None  # missing: "-" not 0
    table = bc.format_compare({"model": "m", "backend": "B"}, rows, peer)
    assert table.splitlines()[-2].split()[-3:] == ["-", "-", "-"]
    assert "decode @ 16384 / decode @ 0: 90%" in table


def test_compare_gguf_with_a_fake_llama_bench(fixtures_dir, tmp_path, small_contexts):
    gguf = fixtures_dir / FIXTURE
    peer = _fake_peer(tmp_path)
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["bench", "--compare-gguf", str(gguf), "--peer-bench", str(peer), "--device", "cpu:0", "--json"])
    assert rc == 0
    # the peer ran on the same file at the same contexts, with the flags of the peer table
    assert json.loads(Path(str(peer) + ".argv").read_text()) == [
        "-m", str(gguf), "-p", "16,40", "-n", "2", "-d", "0,20", "-fa", "1", "-ngl", "99", "-o", "json"]
    res = json.loads(buf.getvalue())
    assert [r["tokens"] for r in res["prefill"]] == [16, 40]
    assert [r["context"] for r in res["decode"]] == [0, 20]
    rows = res["compare"]["rows"]
    assert [r["test"] for r in rows] == ["prompt 16", "prompt 40", "decode 2 @ 0", "decode 2 @ 20"]
    want_peer = [16000.0, 40000.0, 100.0, 50.0]  # the fake's avg_ts at depth 0 (prompts), 0 and 20 (decode)
    for r, theirs in zip(rows, want_peer, strict=True):
        assert r["peer_tokens_per_s"] == theirs
        assert r["tokens_per_s"] > 0 and r["vs_peer"] == pytest.approx(r["tokens_per_s"] / theirs)
        assert r["ratio"] > 0 and r["peer_ratio"] == pytest.approx(theirs / r["ceiling_tokens_per_s"])
    assert res["compare"]["peer"]["label"] == "abc1234 CUDA Fake GPU"
    # the table form
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["bench", "--compare-gguf", str(gguf), "--peer-bench", str(peer), "--device", "cpu:0"]) == 0
    table = buf.getvalue()
    assert "peer: llama-bench (abc1234 CUDA Fake GPU)" in table
    assert "vs peer" in table and "decode 2 @ 20" in table
    line = next(x for x in table.splitlines() if x.startswith("prompt 40"))
    assert line.split()[-3] == "40,000.0"


def test_compare_gguf_without_peer_prints_ours_and_the_ceilings(fixtures_dir, small_contexts, capsys):
    assert main(["bench", "--compare-gguf", str(fixtures_dir / FIXTURE), "--device", "cpu:0"]) == 0
    out = capsys.readouterr().out
    assert "minecart tok/s" in out and "ceiling" in out and "peer" not in out
    assert len([x for x in out.splitlines() if x.startswith(("prompt ", "decode 2 @"))]) == 4


def test_peer_failures_are_clear(fixtures_dir, tmp_path, small_contexts, capsys):
    gguf = str(fixtures_dir / FIXTURE)
    failing = _fake_peer(tmp_path, "FAIL-llama-bench")
    assert main(["bench", "--compare-gguf", gguf, "--peer-bench", str(failing), "--device", "cpu:0"]) == 1
    err = capsys.readouterr().err
    assert "llama-bench exited with status 3" in err and "failed to initialize CUDA" in err
    assert main(["bench", "--compare-gguf", gguf, "--peer-bench", str(tmp_path / "nope"), "--device", "cpu:0"]) == 1
    assert "no such executable" in capsys.readouterr().err
    assert main(["bench", "--compare-gguf", str(tmp_path / "missing.gguf"), "--device", "cpu:0"]) == 1
    assert "no such file" in capsys.readouterr().err
    assert main(["bench", gguf, "--peer-bench", str(failing), "--device", "cpu:0"]) == 1
    assert "--peer-bench goes with --compare-gguf" in capsys.readouterr().err
    assert main(["bench", gguf, "--compare-gguf", gguf, "--device", "cpu:0"]) == 1
    assert "leave out the model argument" in capsys.readouterr().err


def test_several_quant_types_in_one_run(tmp_path, monkeypatch, capsys):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args = ["bench", "--shape", "tiny-dense", "--quant", "q8_0,q4_k", "--device", "cpu:0", "--prefill", "8",
            "--decode-ctx", "0", "--decode-tokens", "1"]
    assert main([*args, "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [Path(r["model"]).name for r in runs] == ["tiny-dense-q8_0.gguf", "tiny-dense-q4_k.gguf"]
    assert all(r["prefill"][0]["tokens_per_s"] > 0 and r["decode"][0]["tokens_per_s"] > 0 for r in runs)
    assert runs[0]["weight_bytes_per_token"] > runs[1]["weight_bytes_per_token"]  # q4_k reads fewer bytes
    assert list(tmp_path.iterdir()) == []  # each synthesized file deleted after its run
    assert main(args) == 0
    out = capsys.readouterr().out
    summary = out[out.index("quant types compared"):].splitlines()
    assert summary[1].split() == ["file", "prefill", "8", "decode", "@", "0"]
    assert [x.split()[0] for x in summary[2:]] == ["tiny-dense-q8_0.gguf", "tiny-dense-q4_k.gguf"]


def test_quant_list_errors(fixtures_dir, capsys):
    assert main(["bench", "--shape", "tiny-dense", "--quant", "q8_0,q9_z", "--device", "cpu:0"]) == 1
    assert "unknown --quant q9_z" in capsys.readouterr().err
    assert main(["bench", str(fixtures_dir / FIXTURE), "--quant", "q8_0,q4_k", "--device", "cpu:0"]) == 1
    assert "several --quant types need --shape" in capsys.readouterr().err

