"""Thread counts for the CPU engine: how many threads BLAS (NumPy's matmuls) and the CPU expert
kernels (numba, engine/cpu_experts.py) may use on this machine.

The NumPy backend's matrix products run in OpenBLAS (or MKL, or Accelerate), whose default is one
thread per core. On a small machine that is the wrong choice: a decode step is a row of small
matrix-vector products, and BLAS threads that wait for each other at every product, or for a core
another program holds, make decode several times slower (measured on a busy 2-core machine: 1.3
tokens/s with two BLAS threads, 12.3 with one; docs/first-run.md). So the engine picks:

- up to 4 usable cores: 1 thread;
- more: half the usable cores (the other half stays free for the tokenizer, the worker threads and
  whatever else runs), at most 8 (past that, small products gain nothing).

The choice goes into the environment variables the BLAS libraries read (OPENBLAS_NUM_THREADS,
OMP_NUM_THREADS, MKL_NUM_THREADS, VECLIB_MAXIMUM_THREADS), which they read once, when NumPy is first
imported: `configure_threads` must run before that (the CLI's main does it first thing). The user's
own setting of any of these variables is kept; an explicit count (the CLI's `--threads`) wins over
both.

The CPU expert kernels (a decode token's routed experts in host RAM) run on numba's threads, not
BLAS's: `expert_threads()` is `--threads N` when the user gave it (configure_threads keeps the
flag's value for the process), else default_threads for this machine. The NumPy backend asks it.

What this file is not: a thread pool. The engine's own threads (the runtime's worker, one per device in
a split) are one per job and need no tuning.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass

THREAD_ENV_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                   "VECLIB_MAXIMUM_THREADS")
MAX_DEFAULT_THREADS = 8

_flag_threads: int | None = None  # the process's --threads N, kept by configure_threads


@dataclass(frozen=True)
class ThreadChoice:
    """The BLAS thread count in force and where it came from."""

    threads: int | None  # None: the user's environment sets it (its own value, per library)
    source: str  # "flag", "environment" or "default"
    applies: bool  # False when NumPy was imported before the choice (it then has no effect)

    def describe(self) -> str:
        if self.source == "environment":
            how = "from the environment (" + ", ".join(
                f"{k}={os.environ[k]}" for k in THREAD_ENV_VARS if k in os.environ) + ")"
        else:
            how = f"{self.threads} ({'--threads' if self.source == 'flag' else 'chosen for this machine'})"
        return f"BLAS threads: {how}" + ("" if self.applies else "; NumPy was already loaded, so not applied")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one, else all)."""
    if hasattr(os, "sched_getaffinity"):  # Linux; not on Windows or macOS
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_threads(cores: int) -> int:
    """BLAS threads for a machine with `cores` usable cores (see the module docstring)."""
    if cores <= 4:
        return 1
    return min(MAX_DEFAULT_THREADS, cores // 2)


def configure_threads(requested: int | None = None, *, cores: int | None = None,
                      env: MutableMapping[str, str] | None = None) -> ThreadChoice:
    """Set the BLAS thread variables in `env` (default os.environ): `requested` (> 0) if given, else
    the user's own variables if any is set, else default_threads for this machine.

    With env None (the process's own environment) this also keeps `requested` as the process's
    thread flag, which expert_threads() returns; None there clears it."""
    global _flag_threads
    target = os.environ if env is None else env
    applies = "numpy" not in sys.modules
    if requested is not None and requested < 1:
        raise ValueError(f"the thread count must be at least 1, got {requested}")
    if env is None:
        _flag_threads = requested
    if requested is not None:
        for key in THREAD_ENV_VARS:
            target[key] = str(requested)
        return ThreadChoice(requested, "flag", applies)
    if any(key in target for key in THREAD_ENV_VARS):
        return ThreadChoice(None, "environment", applies)
    n = default_threads(usable_cores() if cores is None else cores)
    for key in THREAD_ENV_VARS:
        target[key] = str(n)
    return ThreadChoice(n, "default", applies)


def expert_threads(cores: int | None = None, *, beside_gpu: bool = False) -> int:
    """numba threads for the CPU expert kernels: the process's --threads N (see configure_threads)
    if given, else default_threads for `cores` (default: this process's usable cores).

    beside_gpu: the experts serve a GPU's layers (routed experts in host RAM, engine/experts.py): then
    every usable core. A token's experts are a memory-bound read that the GPU waits for, while the
    engine's own thread sleeps (measured on the H200's 16-core host: 16 threads 20.3 tokens/s, 8
    threads 14.9; docs/BENCHMARKS.md v12), where default_threads keeps cores free for a CPU-only model's
    BLAS and Python."""
    if _flag_threads is not None:
        return _flag_threads
    n = usable_cores() if cores is None else cores
    return max(1, n) if beside_gpu else default_threads(n)


def threads_from_argv(argv: Sequence[str]) -> int | None:
    """The value of `--threads N` / `--threads=N` in a command line, read before argparse runs
    (argparse imports the subcommands, and with them NumPy). None when absent or not a whole
    number; argparse reports a bad value later, with the subcommand's usage."""
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        value = None
        if arg == "--threads" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--threads="):
            value = arg.split("=", 1)[1]
        if value is not None:
            try:
                n = int(value)
            except ValueError:
                return None
            return n if n >= 1 else None
    return None
