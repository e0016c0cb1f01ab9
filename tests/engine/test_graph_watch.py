"""engine/backends/graph_watch.py: the check a replayed decode graph makes before each launch says
"changed" after every kind of reallocation reachable from the states it baked in, and "unchanged" while
a decode only appends (stand-in device arrays from tools/bench_graph_watch.py; the CuPy backend's
own reader, cupy.ndarray and its caches, in tests/gpu/test_batching_gpu.py)."""

from __future__ import annotations

import pytest
from minecart.engine.backends.base import LayerState
from minecart.engine.backends.graph_watch import StateReader

from tools.bench_graph_watch import READER, StandInArray, StandInKVCache, layer_states


class _Q3Cache:
    """A cache read field by field (as the CuPy backend reads its q3 cache): sizes, a length that
    changes every step, arrays, and one array set only by the first append."""

    k_ref = None

    def __init__(self):
        self.capacity = 16
        self.length = 3
        self.k_codes = StandInArray((16, 4, 96))
        self.v_codes = StandInArray((16, 4, 64))


def _sequences(n: int = 3) -> list[list[LayerState]]:
    seqs = [layer_states(n_layers=8, every=4, capacity=16) for _ in range(n)]
    seqs[1][2].kv = _Q3Cache()  # a layer whose cache is read by vars()
    return seqs


def _reference(obj, depth: int = 0) -> list[int]:
    """Every stand-in array's address reachable from obj, the plain recursive way (depth-limited as
    the reader is: containers opened above depth 4, caches at depth 4)."""
    if isinstance(obj, StandInArray):
        return [obj.data.ptr]
    if isinstance(obj, StandInKVCache):
        return [a.data.ptr for a in (obj.k, obj.v) if a is not None] if depth <= 4 else []
    if depth >= 4:
        return []
    if isinstance(obj, (list, tuple)):
        items = list(obj)
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif hasattr(obj, "__dict__"):
        items = list(vars(obj).values())
    else:
        return []
    return [p for item in items for p in _reference(item, depth + 1)]


def _watch(seqs):
    return [st for seq in seqs for st in seq]  # what the executor hands a batched graph step


def test_records_every_array_and_stays_valid_while_decoding():
    seqs = _sequences()
    watched = READER.watch(_watch(seqs))
    assert sorted(watched.pointers) == sorted(_reference(_watch(seqs))) and len(watched.pointers) == 3 * 16 + 2
    assert watched.unchanged(_watch(seqs))
    for _ in range(5):  # a replayed step: lengths move, nothing is reallocated
        for st in _watch(seqs):
            if st.kv is not None:
                st.kv.length += 1
    assert watched.unchanged(_watch(seqs))
    st = seqs[0][0]
    seqs[0][0] = LayerState(kv=st.kv, recurrent=dict(st.recurrent))  # new holders of the same arrays
    assert watched.unchanged(_watch(seqs))


def _grow(seqs):
    seqs[2][3].kv.reserve(seqs[2][3].kv.capacity + 1)


def _free(seqs):
    seqs[0][7].kv.k = seqs[0][7].kv.v = None  # CupyBackend.free


MUTATIONS = {
    "an array attribute replaced": lambda s: setattr(s[1][3].kv, "v", StandInArray((16, 4, 256))),
    "a dict entry replaced (a restore)": lambda s: s[2][5].recurrent.update(ssm=s[2][5].recurrent["ssm"].copy()),
    "a whole layer state replaced": lambda s: s[0].__setitem__(1, layer_states(2, 4)[1]),
    "a recurrent dict replaced": lambda s: setattr(s[1][0], "recurrent", {"conv": StandInArray((3, 8)),
                                                                         "ssm": s[1][0].recurrent["ssm"]}),
    "a cache grown": _grow,
    "a cache freed": _free,
    "a cache replaced": lambda s: setattr(s[2][7], "kv", StandInKVCache(4, 256, 256, 16)),
    "a cache where there was none": lambda s: setattr(s[0][0], "kv", StandInKVCache(4, 256, 256, 16)),
    "a cache removed": lambda s: setattr(s[0][3], "kv", None),
    "a dict entry added": lambda s: s[0][0].recurrent.update(extra=StandInArray((2,))),
    "a dict entry removed": lambda s: s[0][0].recurrent.pop("conv"),
    "a dict key renamed": lambda s: s[0][0].recurrent.update(other=s[0][0].recurrent.pop("conv")),
    "an array where there was a leaf": lambda s: setattr(s[1][2].kv, "k_ref", StandInArray((4, 256))),
    "a field-read cache's array replaced": lambda s: setattr(s[1][2].kv, "k_codes", StandInArray((16, 4, 96))),
    "a field-read cache's new field": lambda s: setattr(s[1][2].kv, "k_scales", StandInArray((16, 4, 4))),
    "a sequence's layer dropped": lambda s: s[2].pop(),
    "a layer state appended": lambda s: s[1].append(LayerState()),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_every_reallocation_invalidates(name):
    seqs = _sequences()
    before = sorted(_reference(_watch(seqs)))
    watched = READER.watch(_watch(seqs))
    MUTATIONS[name](seqs)
    assert not watched.unchanged(_watch(seqs)), name
    if name not in ("a dict key renamed", "a layer state appended"):  # these two keep the addresses, not
        assert sorted(_reference(_watch(seqs))) != before  # the structure the capture recorded


def test_same_address_other_type_invalidates():
    """An object at an array's place that is not the backend's array type, even at the same address."""

    class Other:
        __slots__ = ("data",)

    seqs = _sequences()
    watched = READER.watch(_watch(seqs))
    st = seqs[0][0]
    fake = Other()
    fake.data = st.recurrent["conv"].data
    st.recurrent["conv"] = fake
    assert not watched.unchanged(_watch(seqs))


def test_a_batch_is_a_few_steps_per_level_whatever_its_size():
    """The check's Python-level work (steps) does not grow with the number of sequences: only the C
    loops inside each step do."""
    sizes = {}
    for b in (1, 8, 32):
        watched = READER.watch(_watch([layer_states() for _ in range(b)]))
        assert len(watched.pointers) == 64 * b
        sizes[b] = [len(steps) for _, steps in watched.levels]
    assert sizes[1] == sizes[8] == sizes[32] and sum(sizes[32]) <= 8


def test_depth_limit_checks_types_below_it():
    """Past the depth the reader opens, a container's type is still checked (a container turned array is
    seen), and an array's address inside it is not recorded."""
    deep = [[[[{"a": StandInArray((1,))}]]]]  # the dict at depth 4: not opened
    reader = StateReader(StandInArray, {})
    watched = reader.watch(deep)
    assert watched.pointers == [] and watched.unchanged(deep)
    deep[0][0][0][0]["a"] = StandInArray((1,))
    assert watched.unchanged(deep)
    deep[0][0][0][0] = StandInArray((1,))
    assert not watched.unchanged(deep)
