"""The compiled CPU kernels come from numba's disk cache in a second process, not compiled again. A
kernel whose closure holds an object that pickles differently in every process (a numba intrinsic
carries a UUID of its own) misses its cache in every process: the tile region of a prompt of several
tokens on stored weights was compiled again at every start (about 2 s at the first prompt) and its
cache gained an entry each time. Two fresh interpreters share one cache folder here; the second must
load every kernel the first compiled, and the folder must not grow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from minecart.engine import cpu_experts as C

pytestmark = pytest.mark.skipif(not C.HAVE_NUMBA, reason="numba is not installed")

# one token and four: the one-row region (_DENSE) and the tile region (_TILE), for a 32-value type and a
# K-quant; prints each kernel's cache hits and misses in this process
_RUN = r"""
import json, sys
import numpy as np
from minecart.engine import cpu_experts as C
from minecart.engine import quants as Q
from tests.engine.test_cpu_experts import random_stack

rng = np.random.default_rng(0)
stats = {}
for t in (Q.Q8_0, Q.Q4_K):
    w = random_stack(rng, t, 1, 8, 256)
    for T in (1, 4):
        C.dense_matmul(w, rng.standard_normal((T, 256)).astype(np.float32), threads=1)
    for name, table in (("dense", C._DENSE), ("tile", C._TILE)):
        s = table[t].stats
        stats[f"{name} {t}"] = [sum(s.cache_hits.values()), sum(s.cache_misses.values())]
json.dump(stats, sys.stdout)
"""


def _run(cache: Path) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _RUN], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600, check=True)
    return json.loads(out.stdout)


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.rglob("*.nbc"))


def test_a_second_process_loads_the_kernels_from_the_disk_cache(tmp_path):
    first = _run(tmp_path)
    assert all(misses >= 1 for _, misses in first.values()), first  # compiled (and stored) in the first
    stored = _entries(tmp_path)
    assert any("tile_kernel" in n for n in stored), stored
    second = _run(tmp_path)
    assert all(hits >= 1 and misses == 0 for hits, misses in second.values()), second
    assert _entries(tmp_path) == stored  # nothing compiled again, nothing added


def test_no_cached_kernel_closes_over_an_object():
    """Every disk-cached kernel the engine's CPU modules hold (module globals, and the tables of kernels by
    type they keep) closes over plain values only (type codes, sizes, flags), whose pickles are the
    same in every process; anything else (an intrinsic, a dispatcher, an array) would make its cache key
    change from process to process, as above. Not covered: engine/expert_pool.py, whose token shares
    close over their job runs' dispatchers (compiled apart, without reference counting) and whose
    worker loop is not disk-cached at all; both compile in each process that serves host experts."""
    from minecart.engine import cpu_attention, cpu_gdn, cpu_matmul, cpu_pointwise, sampling
    from numba.core.dispatcher import Dispatcher

    def dispatchers(value):
        if isinstance(value, Dispatcher):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from dispatchers(v)

    plain = (int, float, str, bool, tuple, type(None))
    cached = {id(d): d for m in (C, cpu_attention, cpu_gdn, cpu_matmul, cpu_pointwise, sampling)
              for v in list(vars(m).values()) for d in dispatchers(v)
              if d.py_func.__closure__ and d.stats.cache_path is not None}
    assert len(cached) >= len(C._TILE) + len(C._DENSE)
    for d in cached.values():
        held = {type(c.cell_contents).__name__ for c in d.py_func.__closure__ if not isinstance(c.cell_contents, plain)}
        assert not held, f"{d.py_func.__qualname__} closes over {held}"

