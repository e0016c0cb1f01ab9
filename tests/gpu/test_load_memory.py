"""What loading a weight takes from the device beside the weight, against the planner's load model.

engine/placement.py prices a K-quant upload's peak as KQUANT_REPACK_FACTOR x one repack chunk (at most
KQUANT_REPACK_CHUNK raw bytes) beside the final arrays, and a staged (Q8_0-style) upload's as its raw
copy; CupyBackend.load_weight hands those temporaries back to the device after each weight (so the
pool keeps no load-time blocks) and notes the pool's high-water mark (`load_memory_peak`).

Measured with CuPy's pool: after freeing its unused blocks, its total grows only by what an upload
allocates at once (freed blocks are reused before new ones are made), so total after - total before
- the final arrays = the upload's transient peak (pool rounding aside)."""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import quants as Q
from minecart.engine.gguf_file import TensorInfo
from minecart.engine.placement import KQUANT_REPACK_CHUNK, KQUANT_REPACK_FACTOR

cp = pytest.importorskip("cupy")

pytestmark = [pytest.mark.gpu, pytest.mark.fresh_process]  # pool measurements (conftest.py)

SUPER_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q8_0": 34 * 8}  # bytes per 256 values
TYPE_IDS = {"Q4_K": Q.Q4_K, "Q5_K": Q.Q5_K, "Q6_K": Q.Q6_K, "Q8_0": Q.Q8_0}


def raw_rows(type_name: str, rows: int, K: int, seed: int) -> np.ndarray:
    """Random bytes as a file's rows (the repack and the split are bit operations: any bytes do), with
    each block's fp16 scale bytes kept finite."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, K // 256 * SUPER_BYTES[type_name]), dtype=np.uint8)
    if type_name == "Q8_0":
        raw.reshape(rows, -1, 34)[:, :, 1] &= 0x3B  # fp16 d below 1.0: finite
    return raw


def _pool():
    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()
    return pool


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquant_repack_transient_is_what_the_planner_prices(type_name):
    from minecart.kernels import ops

    K = 4096
    rows = (KQUANT_REPACK_CHUNK // (K // 256 * SUPER_BYTES[type_name])) * 5 // 4  # more than one chunk
    raw = raw_rows(type_name, rows, K, 1)
    pool = _pool()
    base = pool.total_bytes()
    q = ops.upload_weight(raw, type_name, (rows, K))
    cp.cuda.Device().synchronize()
    final = q.wq.nbytes + q.wd.nbytes
    transient = pool.total_bytes() - base - final
    priced = KQUANT_REPACK_FACTOR[type_name] * min(raw.nbytes, KQUANT_REPACK_CHUNK)
    print(f"{type_name}: transient {transient / 2**20:.1f} MiB = {transient / KQUANT_REPACK_CHUNK:.2f} chunks; "
          f"priced {priced / 2**20:.1f} MiB")
    assert 0.7 * priced <= transient <= 1.1 * priced
    del q


@pytest.mark.parametrize("type_name", ["Q4_K", "Q8_0"])
def test_load_weight_leaves_no_pool_blocks_and_notes_its_peak(type_name):
    from minecart.engine.backends.cupy_backend import CupyBackend

    K, rows = 4096, 20000
    raw = raw_rows(type_name, rows, K, 2)
    info = TensorInfo("blk.0.ffn_up.weight", TYPE_IDS[type_name], type_name, (rows, K), raw, raw.nbytes)
    be = CupyBackend("cuda:0", probe=False)
    pool = _pool()
    base = pool.total_bytes()
    w = be.load_weight(info)
    cp.cuda.Device().synchronize()
    final = w.q.wq.nbytes + (0 if w.q.wd is None else w.q.wd.nbytes)
    held = pool.total_bytes() - base
    print(f"{type_name}: final {final / 2**20:.1f} MiB, pool grew {held / 2**20:.1f} MiB, load peak "
          f"{(be.load_memory_peak() - base) / 2**20:.1f} MiB above the start")
    assert held <= final + (2 << 20)  # the temporaries went back to the device
    # Q8_0: the raw copy staged for the split into scales + quants (the H200, 2026-12-01: 0.94 of the raw
    # bytes above the final arrays; the quants are carved from it, not copied)
    transient = 0.85 * raw.nbytes if type_name == "Q8_0" else 0.7 * KQUANT_REPACK_FACTOR[type_name] * min(
        raw.nbytes, KQUANT_REPACK_CHUNK)
    assert be.load_memory_peak() >= base + final + transient
    be.free(w)
