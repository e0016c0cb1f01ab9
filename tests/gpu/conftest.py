"""GPU tests: skipped unless CuPy imports and a CUDA device answers."""

from __future__ import annotations

import pytest


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
