"""The device addresses a captured decode graph bakes in, and the check before each replay that they
still hold (cupy_backend's `_DecodeGraph` / `_BatchGraph`).

A graph records the address of every state array its step touches (KV caches, Gated DeltaNet conv and
recurrent states). Any reallocation reachable from those states (a cache that grew or was freed, a
restored recurrent array, a dict entry or a whole layer state replaced) must invalidate it: a stale
address is silent memory corruption. The check runs before every replay of a batched decode step
(32 sequences of a 32-layer model: ~1,000 layer states, ~2,000 arrays), so its host time adds to
every step's.

`StateReader.watch(root)` walks the states once, at capture, and compiles the walk into levels: the
type of every object met at each depth, in order, and a few steps per level, each over all the objects
of one shape (the dicts with the same keys, the objects with the same fields, the arrays): pick them,
check their lengths, read their children or their addresses. `WatchedPointers.unchanged(root)` runs
those steps as C loops (map over attrgetter/itemgetter), a handful per level whatever the number of
sequences, with no Python call or type dispatch per object. It reads the current states along the
recorded paths, and every object's type, every container's length and keys and every array's address
must be what they were: then a fresh walk would read exactly the recorded addresses. It keeps no
reference to any state (a graph kept but not replayed must not keep a replaced cache alive).

Objects are read by kind, decided once per type: an array (its address); a type the backend names,
by those attributes (a KV cache's k and v); a dataclass by its fields (a LayerState's kv and
recurrent: mypy rejects any other attribute set on it); a list or tuple by its items; a dict by its
keys; any other object with fields by vars(); anything else is a leaf whose type alone is checked
(None, ints, host arrays). What this module is not: the graphs themselves, or the array library (the
backend names its array type and its named types).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields, is_dataclass
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np

# Containers are opened at depths 0 to CONTAINER_DEPTH - 1 (the root at 0: watch list -> layer state ->
# its cache or recurrent dict -> their arrays, with a level to spare), objects of named arrays (a KV cache)
# one level deeper; the arrays met are read at any depth reached, and past those only types are checked.
CONTAINER_DEPTH = 4
_ARRAY, _NAMED, _ITEMS, _VALUES, _FIELDS, _LEAF = range(6)
_ADDRESS = attrgetter("data.ptr")  # an array's device address (cupy.ndarray.data is its MemoryPointer)

Pick = Callable[[Sequence[Any]], Sequence[Any]]


def _pick(idx: list[int]) -> Pick:
    """A getter of the nodes at positions idx of a level, as a sequence (a slice when they are
    consecutive: every node of the level, in the usual case)."""
    if idx == list(range(idx[0], idx[-1] + 1)):
        return itemgetter(slice(idx[0], idx[-1] + 1))
    return itemgetter(*idx)  # len(idx) > 1 here: a tuple


class _Step:
    """What the check does with one group of nodes of a level (all of one kind and shape): read(nodes,
    children) -> what must equal `expected` (the arrays' addresses, the containers' lengths), appending
    the group's children (column by column: every member's first name, then every member's second...).
    Capture runs the same method on the states it records, so the children come in the same order at
    capture and at every check."""

    def __init__(self, kind: int, pick: Pick, names: tuple, expected: list):
        self.kind = kind
        self.pick = pick
        self.names = names  # the attributes (named) or keys (dicts, fields) every member has
        self.expected = expected
        get = attrgetter if kind == _NAMED else itemgetter
        self.getters: list[Callable[[Any], Any]] = [get(n) for n in names]

    def read(self, nodes: Sequence[Any], children: list) -> list:
        members = self.pick(nodes)
        kind = self.kind
        if kind == _ARRAY:
            return list(map(_ADDRESS, members))
        if kind == _FIELDS:
            members = list(map(vars, members))
        elif kind == _ITEMS:
            children.extend(chain.from_iterable(members))
        for get in self.getters:
            children.extend(map(get, members))
        return [] if kind == _NAMED else list(map(len, members))


class WatchedPointers:
    """The compiled walk of one graph's states (StateReader.watch): `pointers` the device addresses
    recorded, `unchanged(root)` whether a walk of `root` now would meet the same objects' types,
    containers and addresses."""

    def __init__(self, levels: list[tuple[list[type], list[_Step]]], pointers: list[int]):
        self.levels = levels
        self.pointers = pointers

    def unchanged(self, root) -> bool:
        nodes: list = [root]
        try:
            for types, steps in self.levels:
                if list(map(type, nodes)) != types:
                    return False
                children: list = []
                for step in steps:
                    if step.read(nodes, children) != step.expected:
                        return False
                nodes = children
        except (KeyError, AttributeError):  # a key or an attribute that is gone
            return False
        return True


class StateReader:
    """How a backend's states hold device arrays: `array_type` (an instance has `.data.ptr`), and the
    types whose arrays are named attributes (read as those attributes only, not walked field by field:
    a KV cache's k and v); any other list, tuple, dict or object with fields is walked through."""

    def __init__(self, array_type: type, named: dict[type, tuple[str, ...]]):
        self.array_type = array_type
        self.named = named
        self._kinds: dict[type, tuple[int, tuple[str, ...]]] = {}

    def _kind(self, obj) -> tuple[int, tuple[str, ...]]:
        """(kind, attribute names of a named type) of obj's type, decided once per type."""
        t = type(obj)
        got = self._kinds.get(t)
        if got is not None:
            return got
        names: tuple[str, ...] = ()
        if isinstance(obj, self.array_type):
            kind = _ARRAY
        elif isinstance(obj, tuple(self.named)):
            kind = _NAMED
            names = next(n for c, n in self.named.items() if isinstance(obj, c))
        elif is_dataclass(obj) and not isinstance(obj, type):
            kind = _NAMED  # its fields (a LayerState's kv and recurrent)
            names = tuple(f.name for f in fields(obj))
        elif isinstance(obj, (list, tuple)):
            kind = _ITEMS
        elif isinstance(obj, dict):
            kind = _VALUES
        elif hasattr(obj, "__dict__") and not isinstance(obj, (np.ndarray, type)):
            kind = _FIELDS
        else:
            kind = _LEAF
        self._kinds[t] = (kind, names)
        return kind, names

    def watch(self, root) -> WatchedPointers:
        """Walk root's states (down to CONTAINER_DEPTH) and compile the walk (see the module docstring)."""
        levels: list[tuple[list[type], list[_Step]]] = []
        pointers: list[int] = []
        nodes: list = [root]
        depth = 0
        while nodes:
            groups: dict[tuple, list[int]] = {}
            for i, obj in enumerate(nodes):
                kind, names = self._kind(obj)
                if kind == _LEAF or (kind != _ARRAY and depth >= CONTAINER_DEPTH + (kind == _NAMED)):
                    continue  # past the depth only its type is checked
                if kind == _VALUES:
                    names = tuple(obj)
                elif kind == _FIELDS:
                    names = tuple(vars(obj))
                groups.setdefault((kind, names), []).append(i)
            steps = []
            children: list = []
            for (kind, names), idx in groups.items():
                step = _Step(kind, _pick(idx), names, [])
                step.expected = step.read(nodes, children)
                if kind == _ARRAY:
                    pointers.extend(step.expected)
                steps.append(step)
            levels.append((list(map(type, nodes)), steps))
            nodes = children
            depth += 1
        return WatchedPointers(levels, pointers)
