"""engine/threads.expert_threads: the CPU expert kernels' thread count follows --threads N when the
user gives it, else the machine's default; the NumPy backend takes it from there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from minecart.engine import threads
from minecart.engine.backends.numpy_backend import NumpyBackend
from minecart.engine.threads import (
    THREAD_ENV_VARS,
    configure_threads,
    default_threads,
    expert_threads,
    usable_cores,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def process_threads(monkeypatch):
    """configure_threads on the process's own environment, undone after the test (the variables and
    the kept flag)."""
    for key in THREAD_ENV_VARS:
        monkeypatch.setenv(key, os.environ.get(key, "1"))  # recorded, so restored afterwards
    monkeypatch.setattr(threads, "_flag_threads", None)
    return configure_threads


def test_without_the_flag_the_machine_default(process_threads):
    process_threads(None)
    assert expert_threads() == default_threads(usable_cores())
    assert [expert_threads(cores=n) for n in (2, 6, 16, 64)] == [1, 3, 8, 8]
    assert NumpyBackend().expert_thread_count() == default_threads(usable_cores())


def test_the_flag_sets_the_expert_threads(process_threads):
    choice = process_threads(12)
    assert choice.threads == 12 and os.environ["OPENBLAS_NUM_THREADS"] == "12"
    assert expert_threads() == 12 and expert_threads(cores=2) == 12  # the flag wins over the default
    assert NumpyBackend().expert_thread_count() == 12
    assert NumpyBackend(expert_threads=3).expert_thread_count() == 3  # an explicit count still wins
    configure_threads(5, env={})  # another environment (tests, tools): not the process's flag
    assert expert_threads() == 12
    with pytest.raises(ValueError, match="at least 1"):
        configure_threads(0)
    assert expert_threads() == 12
    process_threads(None)  # the process configured again without the flag
    assert expert_threads() == default_threads(usable_cores())


def test_cli_threads_flag_reaches_the_backend(fixtures_dir):
    script = ("import sys\n"
              "from minecart.engine.cli import main\n"
              "from minecart.engine.backends.numpy_backend import NumpyBackend\n"
              "main(sys.argv[1:])\n"
              "print(NumpyBackend().expert_thread_count())\n")
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV_VARS}
    vocab = str(fixtures_dir / "qwen35-vocab.gguf")  # refused after parsing: quick
    for extra, expected in (([], default_threads(usable_cores())), (["--threads", "7"], 7)):
        r = subprocess.run([sys.executable, "-c", script, "run", vocab, "-p", "x", *extra],
                           capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
        assert r.stdout.split() == [str(expected)], r.stderr


def test_host_experts_of_a_gpu_take_every_core(monkeypatch):
    """Routed experts in host RAM serving a GPU's layers run on every usable core (the GPU waits for
    them and the engine's thread sleeps); a CPU-only model keeps the BLAS rule; --threads wins."""
    from minecart.engine import threads
    from minecart.engine.backends.numpy_backend import NumpyBackend
    from minecart.engine.experts import ExpertsApart

    monkeypatch.setattr(threads, "_flag_threads", None)
    monkeypatch.setattr(threads, "usable_cores", lambda: 16)

    class PinnedInner(NumpyBackend):  # stands in for a GPU backend: it pins host memory
        pins_host_memory = True

    host = NumpyBackend()
    ExpertsApart(PinnedInner(), host)
    assert host.expert_thread_count() == 16
    cpu_only = NumpyBackend()
    ExpertsApart(NumpyBackend("cpu:1"), cpu_only)
    assert cpu_only.expert_thread_count() == threads.default_threads(16) == 8
    monkeypatch.setattr(threads, "_flag_threads", 6)
    flagged = NumpyBackend()
    ExpertsApart(PinnedInner(), flagged)
    assert flagged.expert_thread_count() == 6
