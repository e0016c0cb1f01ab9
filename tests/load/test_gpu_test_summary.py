"""tools/gpu_test_summary.py: what a `pytest -v -s` run got through, file by file, from logs written by a
real pytest (a run of two small files here, one cut off by `timeout`) and from the log's own format."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from tools import gpu_test_summary

CUT_LOG = textwrap.dedent("""\
    collecting ... collected 6 items

    tests/gpu/test_a.py::test_one PASSED
    tests/gpu/test_a.py::test_two[fma] graph vs eager: max rel err 0.00e+00
    PASSED
    tests/gpu/test_a.py::test_two[dp4a] FAILED
    tests/gpu/test_a.py::test_skip SKIPPED (no second GPU)
    tests/gpu/test_b.py::test_long B=1 top 0: 2738.9 tok/s
    B=4 top 0: 4550.7 tok/s
    """)


def test_a_cut_off_run_names_the_test_it_stopped_in_and_the_files_not_reached(tmp_path, capsys):
    log = tmp_path / "gpu_tests.log"
    log.write_text(CUT_LOG)
    files = ["tests/gpu/test_a.py", "tests/gpu/test_b.py", "tests/gpu/test_c.py"]
    assert gpu_test_summary.main([str(log), *files]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "tests/gpu/test_a.py: 2 passed, 1 failed, 1 skipped",
        "tests/gpu/test_b.py: 0 passed; cut off in test_long",
        "tests/gpu/test_c.py: not reached",
        "to run again: tests/gpu/test_a.py tests/gpu/test_b.py tests/gpu/test_c.py",
    ]


def test_a_finished_run_with_its_short_summary(tmp_path, capsys):
    # -rfE's summary at the end names failed tests after "FAILED": not a test starting again
    log = tmp_path / "gpu_tests.log"
    log.write_text("tests/gpu/test_a.py::test_one PASSED [ 50%]\n"
                   "tests/gpu/test_a.py::test_two PASSED [100%]\n"
                   "=========================== short test summary info ============================\n"
                   "========================= 2 passed in 3.10s =========================\n")
    assert gpu_test_summary.main([str(log), "tests/gpu/test_a.py"]) == 0
    assert capsys.readouterr().out == "tests/gpu/test_a.py: 2 passed\n"
    results = gpu_test_summary.summarize(log.read_text() + "FAILED tests/gpu/test_a.py::test_two - boom\n",
                                         ["tests/gpu/test_a.py"])
    assert results[0].counts == {"PASSED": 2} and results[0].cut_off is None


def test_a_real_pytest_log_cut_off_by_its_time_limit(tmp_path):
    started = tmp_path / "started"
    (tmp_path / "test_quick.py").write_text(
        "import pytest\n"
        "def test_ok():\n    print('some output')\n"
        "@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_param(n):\n    assert n == 1\n"
        "def test_skipped():\n    pytest.skip('why')\n")
    (tmp_path / "test_slow.py").write_text(f"import pathlib, time\ndef test_sleeps():\n    print('started')\n"
                                           f"    pathlib.Path({str(started)!r}).touch()\n    time.sleep(120)\n")
    (tmp_path / "test_after.py").write_text("def test_never():\n    pass\n")
    files = ["tests/test_quick.py", "tests/test_slow.py", "tests/test_after.py"]
    # the node ids start with tests/ as in the runner's logs: run from a folder above a tests/ link
    root = tmp_path / "root"
    root.mkdir()
    (root / "tests").symlink_to(tmp_path)
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-s", "-p", "no:cacheprovider", "-c",
                                 "/dev/null", "--rootdir", str(root), *files], cwd=root, stdout=out,
                                stderr=subprocess.STDOUT)
        try:  # the time limit: stopped once the slow test has started, as `timeout` stops a device run
            deadline = time.monotonic() + 120
            while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert started.exists(), log.read_text()
        finally:
            proc.kill()
            proc.wait()
    results = {r.path: r for r in gpu_test_summary.summarize(log.read_text(), files)}
    assert results["tests/test_quick.py"].counts == {"PASSED": 2, "FAILED": 1, "SKIPPED": 1}
    assert results["tests/test_slow.py"].counts == {}
    assert results["tests/test_slow.py"].cut_off == "test_sleeps"
    assert not results["tests/test_after.py"].ran
