"""Several sequences in one forward pass: what a layer sees instead of one sequence's LayerState.

A batch stacks the rows of B sequences into one hidden state (N, H), sequence b owning rows
`bounds[b]:bounds[b + 1]` (one row while it decodes, a chunk of its prompt while it prefills). Every
row-wise step of a layer (norms, projections, the FFN) runs once on all N rows, so a matmul sees a
(N, H) matrix where one sequence alone would give a (1, H) vector. Only the mixer (attention over the
sequence's own KV cache, the Gated DeltaNet conv and recurrent state) runs per sequence, on its own
`LayerState` and positions: `per_sequence` does that split and stacks the results again. A decode step
(`SequenceRows.decoding`: one row per sequence) instead hands all rows and all states to one batched
mixer op of the backend, which runs every sequence's mixer in one launch per kernel.

What this is not: a scheduler (engine/scheduler.py decides which sequences run together) or a second
forward pass (engine/execution.py's Executor builds a `SequenceRows` per layer and runs its one loop).
Like every model file it never imports numpy or cupy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..backends.base import Array, Backend, LayerState


@dataclass(frozen=True)
class SequenceRows:
    """One layer's view of a batch: each sequence's state, its rows of the stacked hidden state and
    its positions (a host int array (T_b,), or (3, T_b) for M-RoPE)."""

    states: tuple[LayerState, ...]
    bounds: tuple[int, ...]  # B + 1 row offsets, bounds[0] == 0
    positions: tuple[Any, ...]

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.states) + 1 or len(self.positions) != len(self.states):
            raise ValueError(f"a batch of {len(self.states)} sequences needs {len(self.states) + 1} row "
                             f"bounds and {len(self.states)} position arrays")

    @property
    def size(self) -> int:
        return len(self.states)

    @property
    def decoding(self) -> bool:
        """Every sequence has exactly one row (a decode step): row b is sequence b's token, so a
        batched mixer op (Backend.gdn_decode_batch, gated_attention_batch) takes the rows as they are."""
        return self.bounds == tuple(range(len(self.states) + 1))


def per_sequence(be: Backend, state: LayerState | SequenceRows, positions: Any, inputs: Sequence[Array],
                 mixer: Callable[..., Array]) -> Array:
    """mixer(layer_state, positions, *rows) for each sequence's rows of `inputs` (arrays (N, ...)),
    stacked again into one (N, ...) array. A single LayerState is the batch of one: mixer runs once on
    the whole inputs, as before."""
    if isinstance(state, LayerState):
        return mixer(state, positions, *inputs)
    out = None
    for b, st in enumerate(state.states):
        start, stop = state.bounds[b], state.bounds[b + 1]
        y = mixer(st, state.positions[b], *(x[start:stop] for x in inputs))
        if out is None:
            out = be.zeros((state.bounds[-1],) + tuple(y.shape[1:]))
        out[start:stop] = y
    assert out is not None  # a SequenceRows holds at least one sequence
    return out
