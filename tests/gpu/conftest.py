"""GPU tests: skipped unless CuPy imports and a CUDA device answers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_CHILD = "MINECART_TEST_FRESH_PROCESS"


def _gpu_count() -> int:
    try:
        import cupy as cp

        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


HAVE_GPU = _gpu_count() > 0


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


def pytest_pyfunc_call(pyfuncitem):
    """A test marked `fresh_process` measures CuPy's memory pool, so it runs again in a pytest process of
    its own: in a shared one, free pages inside chunks that earlier tests' arrays keep (free_all_blocks
    returns only whole free chunks) are reused by the measured load and hide its growth. The parent's
    result is the child's; the child's output is printed here."""
    if pyfuncitem.get_closest_marker("fresh_process") is None or os.environ.get(_CHILD) == pyfuncitem.nodeid:
        return None
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-rfEs", "-p", "no:cacheprovider", pyfuncitem.nodeid],
        cwd=str(pyfuncitem.config.rootpath), env={**os.environ, _CHILD: pyfuncitem.nodeid},
        capture_output=True, text=True, timeout=600)
    print(r.stdout[-6000:], r.stderr[-2000:], sep="\n")
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    if r.returncode != 0 or not last.startswith("1 passed"):
        pytest.fail(f"in a fresh process (exit {r.returncode}): {last}\n{r.stdout[-3000:]}", pytrace=False)
    return True


@pytest.fixture
def poison():
    """Fill CuPy's memory pool with NaN so that outputs a kernel forgets to write show up as NaN."""
    import cupy as cp

    def _poison(n_bytes: int = 256 << 20):
        a = cp.full(n_bytes // 4, cp.nan, dtype=cp.float32)
        del a  # the block returns to the pool still holding NaN; the next allocations reuse it

    _poison()
    return _poison


@pytest.fixture
def launches(monkeypatch):
    """The kernel names ops.matmul asks for, in order."""
    from minecart.kernels import ops

    names: list[str] = []
    real = ops._mm_kernel

    def record(w, name):
        names.append(name)
        return real(w, name)

    monkeypatch.setattr(ops, "_mm_kernel", record)
    return names
