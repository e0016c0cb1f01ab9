"""Each part's weights in one device allocation (CupyBackend.part_arena, WeightArena): whole 2 MiB pages
from CuPy's pool, every array of the part a 256-byte aligned view into it, so the CUDA driver rounds one
allocation per part instead of one per array (placement.py `_arena_padding`).

Checked on the device: the pool holds exactly the arenas after a load and the driver adds nothing to
them (device memory in use grows by the pool's growth), which is what the planner prices (weights +
`rounding`); every array of a part lives in its arena; freeing a part (a re-plan that moves it to the
host, a closed model) gives its arena back; the logits are bit for bit those of weights allocated array
by array (the same bytes); the load's peak is the planner's `load_peak`.
Models: a synthesized 4-layer file of the 27B shape's widths (5120 x 17408 matrices, vocabulary 640) in
Q4_K, and the shared tiny Q8_0 fixture."""

from __future__ import annotations

import contextlib
import gc
from dataclasses import replace

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

MiB = 1 << 20
PAGE = 2 * MiB
PROMPT = [int(t) for t in np.random.default_rng(17).integers(0, 640, size=24)]


@pytest.fixture(scope="module", params=["wide-q4_k", "tiny-q8_0"])
def path(request, tmp_path_factory, fixtures_dir):
    if request.param == "tiny-q8_0":
        return fixtures_dir / "dense/qwen35-tiny-dense-q8_0.gguf"
    from minecart.engine.synth import SHAPES, write_synthetic

    p = tmp_path_factory.mktemp("arenas") / "wide-q4_k.gguf"
    write_synthetic(p, replace(SHAPES["qwen3.5-27b"], vocab_size=640), "q4_k", seed=5, n_layers=4, mtp=False)
    return p


def _backend():
    from minecart.engine.backends.cupy_backend import CupyBackend

    return CupyBackend("cuda:0", path="dp4a")  # no probe: its arrays would be counted


def _apart_backend():
    """Weights allocated array by array, as before the arenas (the comparison of the logits)."""
    from minecart.engine.backends.cupy_backend import CupyBackend

    class Apart(CupyBackend):
        def part_arena(self, tensors):
            return contextlib.nullcontext()

    return Apart("cuda:0", path="dp4a")


def _arrays(ws: dict) -> list:
    """Every device array a part's weights hold (a weight's quants and scales, a vector)."""
    from minecart.engine.backends.cupy_backend import CupyWeight

    out = []
    for w in ws.values():
        if isinstance(w, CupyWeight):
            out += [a for a in (w.q.wq, w.q.wd) if a is not None]
        else:
            out.append(w)
    return out


def _own(model) -> dict:
    """part -> the weights only that part holds (a tied embedding table used as the LM head lives in
    the embedding's arena, loaded once)."""
    count: dict[int, int] = {}
    for ws in model.weights.values():
        for w in ws.values():
            count[id(w)] = count.get(id(w), 0) + 1
    return {p: {n: w for n, w in ws.items() if count[id(w)] == 1} for p, ws in model.weights.items()}


def _arena_of(ws: dict):
    """The one allocation (a CuPy Memory) every array of a part lives in; fails if there are several."""
    mems = {id(a.data.mem): a.data.mem for a in _arrays(ws)}
    assert len(mems) == 1, f"the part's arrays live in {len(mems)} allocations"
    return next(iter(mems.values()))


def _settle(pool):
    gc.collect()  # a model dropped in a reference cycle gives its arenas back now, not later
    cp.cuda.Device(0).synchronize()
    pool.free_all_blocks()
    free, total = cp.cuda.runtime.memGetInfo()
    return int(total - free), int(pool.total_bytes()), int(pool.used_bytes())


def _plan(model):
    from minecart.engine.placement import Placement, model_costs

    return Placement.single(model_costs(model.config, model.gguf), "cuda:0")


def test_a_parts_arrays_share_one_allocation_of_whole_pages(path):
    from minecart.engine import load_model

    with load_model(path, backend=_backend()) as model:
        seen = set()
        for part, ws in _own(model).items():
            if not ws:
                continue  # nothing of its own to load (the tied LM head beside the embedding)
            mem = _arena_of(ws)
            assert id(mem) not in seen, f"{part} shares its arena with another part"
            seen.add(id(mem))
            arrays = _arrays(ws)
            held = sum(a.nbytes for a in {a.data.ptr: a for a in arrays}.values())
            assert mem.size % PAGE == 0, part
            # the part's arrays (a group's members are row views of its arrays: counted once)
            assert held <= mem.size < held + PAGE + 256 * len(arrays), part
            for a in arrays:
                assert mem.ptr <= a.data.ptr and a.data.ptr + a.nbytes <= mem.ptr + mem.size, part
                # each array the arena made (a group member's rows are a view of its group's arrays)
                made = a if a.base is None else a.base
                assert made.base is None and made.data.ptr % 256 == 0, part


@pytest.mark.fresh_process
def test_device_memory_after_the_load_is_the_plans(path):
    """After warming up (CuPy's and minecart's kernel modules load during the first upload), a load
    grows the pool by the arenas (the planner's weights + rounding, within 1%) and the device's memory
    in use by the same: the driver rounds nothing more. The load's high-water mark is the planner's
    `load_peak` within the tolerance of the K-quant repack's measured factor."""
    from minecart.engine import load_model

    pool = cp.get_default_memory_pool()
    warm = _backend()
    load_model(path, backend=warm).close()  # kernel modules loaded, outside the pool, before the baseline
    warm.release_cached()  # its graphs and the kernels' per-thread activation caches
    del warm  # gone before the baseline
    be = _backend()  # a fresh backend: nothing of the warm-up's can be freed during the measured load
    used0, total0, _ = _settle(pool)
    with load_model(path, backend=be) as model:
        used1, total1, _ = _settle(pool)
        # every arena, a tied table's (in the embedding's part, used by the head too) included
        arenas = {id(a.data.mem): a.data.mem for ws in model.weights.values() for a in _arrays(ws)}
        grown = total1 - total0
        print(f"{path.name}: pool grew {grown / MiB:.2f} MiB, {len(arenas)} arenas "
              f"{sum(m.size for m in arenas.values()) / MiB:.2f} MiB, pool used {(_settle(pool)[2]) / MiB:.2f} MiB")
        # the arenas, nothing else kept (in a process of its own: see fresh_process in conftest.py)
        assert 0 <= grown - sum(m.size for m in arenas.values()) < MiB
        b = _plan(model).bytes_per_device()["cuda:0"]
        planned = b.weights + b.rounding
        print(f"{path.name}: pool grew {grown / MiB:.2f} MiB, planned {planned / MiB:.2f} MiB (rounding "
              f"{b.rounding / MiB:.2f}); device {(used1 - used0) / MiB:.2f} MiB; load peak "
              f"{(be.load_memory_peak() - total0) / MiB:.2f} MiB, planned {_plan(model).load_peak('cuda:0') / MiB:.2f}")
        assert abs(grown - planned) <= 0.01 * planned + PAGE
        assert abs((used1 - used0) - grown) <= PAGE  # whole pages: nothing rounded beyond the pool
        peak = be.load_memory_peak() - total0
        assert 0.8 * _plan(model).load_peak("cuda:0") <= peak <= 1.1 * _plan(model).load_peak("cuda:0")


@pytest.mark.fresh_process
def test_moving_a_part_away_gives_its_arena_back_and_the_logits_stay(path):
    """A re-plan that moves a layer to the host frees that layer's arena (the pool's used bytes drop by
    exactly its size: no view kept alive); moving it back makes a new one and the logits are the
    first load's, bit for bit. Closing the model gives every arena back."""
    from minecart.engine import load_model

    pool = cp.get_default_memory_pool()
    be = _backend()
    _, _, used0 = _settle(pool)
    model = load_model(path, backend=be)
    try:
        ref = model.logits(PROMPT)
        plan = dict(model.device_plan)
        part = "layer.1"
        size = _arena_of(model.weights[part]).size
        be.release_cached()
        _, _, used1 = _settle(pool)
        model.reload_placement({**plan, part: "cpu:0"})
        be.release_cached()
        _, _, used2 = _settle(pool)
        # the whole arena came back (a view kept alive anywhere would keep all of it); the old
        # executor's own small buffers may come back with it
        assert size <= used1 - used2 < size + 8 * MiB
        model.reload_placement(plan)
        assert _arena_of(model.weights[part]).size == size
        np.testing.assert_array_equal(model.logits(PROMPT), ref)
    finally:
        model.close()
    be.release_cached()
    _, _, used3 = _settle(pool)
    assert used3 - used0 < MiB  # the backend's own small buffers at most


def test_logits_equal_weights_allocated_array_by_array(path):
    from minecart.engine import load_model

    with load_model(path, backend=_backend()) as model:
        got = model.logits(PROMPT)
    with load_model(path, backend=_apart_backend()) as apart:
        assert all(len({id(a.data.mem) for a in _arrays(ws)}) > 1 for p, ws in apart.weights.items()
                   if len(_arrays(ws)) > 1)  # really apart
        want = apart.logits(PROMPT)
    assert np.all(np.isfinite(got))
    np.testing.assert_array_equal(got, want)
