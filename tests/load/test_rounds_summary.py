"""tools/rounds_summary.py: the best time per measured line and tree of gpu_runner.sh's matmuls and steps
logs, on lines bench_gemv wrote on an H100 (docs/BENCHMARKS.md v45) and in the runner's log format."""

from __future__ import annotations

from tools import rounds_summary

LOG = """\
tree t1: .gpu/old
== round 1 tree this: bench_gemv --multi --types Q4_K --tokens 8
round 1 tree this | Q4_K: GEMV time of a 9B decode step of  8 sequences (auto) 2.695 ms, 0.337 ms per sequence
round 1 tree this | Q8_0: GEMM time of a 9B prefill of 4096 tokens (dp4a2) 634.6 ms, 89.3 TOPS = 66% of DP4A
== round 1 tree t1: bench_gemv --multi --types Q4_K --tokens 8
round 1 tree t1 | Q4_K: GEMV time of a 9B decode step of  8 sequences (auto) 2.718 ms, 0.340 ms per sequence
round 1 tree t1 | Q8_0: GEMM time of a 9B prefill of 4096 tokens (dp4a2) 655.6 ms, 86.4 TOPS = 64% of DP4A
round 2 tree this | Q4_K: GEMV time of a 9B decode step of  8 sequences (auto) 2.696 ms, 0.337 ms per sequence
round 2 tree t1 | Q4_K: GEMV time of a 9B decode step of  8 sequences (auto) 2.708 ms, 0.339 ms per sequence
"""


def test_best_of_the_rounds_per_tree_against_t1():
    rows, ok = rounds_summary.summarize(LOG.splitlines())
    assert ok
    assert rows == [
        "Q4_K: GEMV time of a 9B decode step of 8 sequences (auto) | this  best 2.695 ms  vs t1 0.995",
        "Q4_K: GEMV time of a 9B decode step of 8 sequences (auto) | t1    best 2.708 ms",
        "Q8_0: GEMM time of a 9B prefill of 4096 tokens (dp4a2) | this  best 634.600 ms  vs t1 0.968",
        "Q8_0: GEMM time of a 9B prefill of 4096 tokens (dp4a2) | t1    best 655.600 ms",
    ]


def test_a_failed_run_or_an_empty_log_fails(tmp_path, capsys):
    rows, ok = rounds_summary.summarize((LOG + "round 2 tree t1 | rc 124\n").splitlines())
    assert not ok and len(rows) == 4
    assert rounds_summary.summarize(["tree t1: .gpu/old", "budget spent"]) == ([], False)
    log = tmp_path / "matmuls.log"
    log.write_text(LOG)
    assert rounds_summary.main([str(log)]) == 0
    assert "vs t1 0.968" in capsys.readouterr().out
