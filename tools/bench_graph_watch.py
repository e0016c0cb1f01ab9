"""Host time of the check a replayed decode graph makes before each launch (engine/backends/graph_watch.py:
do the states it baked in still have the same device arrays?), for batches of 1, 8 and 32 sequences of
the 9B shape (32 layers: 24 Gated DeltaNet, 8 attention), without a GPU.

    python tools/bench_graph_watch.py [--batches 1,8,32] [--layers 32] [--every 4] [--repeat 2000]

The states are the engine's own LayerState and GrowingKVCache (its growth, truncation, clone) holding
stand-in device arrays: objects with `.data.ptr` like cupy.ndarray's, read through the same
StateReader the CuPy backend builds (with the stand-in types in place of cupy.ndarray and its caches).
tests/engine/test_graph_watch.py builds its states with the stand-ins of this file. What this is not:
the GPU's time (tools/bench_batch_gpu.py), or a measurement of the capture.
"""

from __future__ import annotations

import argparse
import itertools
import time

from minecart.engine.backends.base import GrowingKVCache, LayerState
from minecart.engine.backends.graph_watch import StateReader

_ADDRESSES = itertools.count(0x7F0000000000, 0x200)


class StandInPointer:
    """cupy.cuda.MemoryPointer's `ptr`."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


class StandInArray:
    """A device array as graph_watch reads it (`.data.ptr`, a new address per array) and as
    GrowingKVCache copies it (slicing), holding no values."""

    __slots__ = ("data", "shape")

    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape
        self.data = StandInPointer(next(_ADDRESSES))

    def copy(self) -> StandInArray:
        return StandInArray(self.shape)

    def __getitem__(self, index) -> StandInArray:
        return self

    def __setitem__(self, index, value) -> None:
        pass


class StandInKVCache(GrowingKVCache):
    """CupyKVCache's layout (k (capacity, n_kv, d), v (capacity, n_kv, dv)) in stand-in arrays."""

    k: StandInArray
    v: StandInArray

    def _layout(self):
        return {"k": ((self.n_kv_heads, self.head_dim), None), "v": ((self.n_kv_heads, self.value_dim), None)}

    @staticmethod
    def _zeros(shape, dtype):
        return StandInArray(shape)

    def _write(self, k, v, start: int) -> None:
        pass


READER = StateReader(StandInArray, {StandInKVCache: ("k", "v")})


def layer_states(n_layers: int = 32, every: int = 4, capacity: int = 256) -> list[LayerState]:
    """One sequence's states, shaped as qwen35.new_layer_state makes them for the 9B: every `every`-th
    layer attention (a KV cache), the others Gated DeltaNet (conv (3, 8192), ssm (32, 128, 128))."""
    out = []
    for i in range(n_layers):
        if (i + 1) % every == 0:
            out.append(LayerState(kv=StandInKVCache(4, 256, 256, capacity)))
        else:
            out.append(LayerState(recurrent={"conv": StandInArray((3, 8192)),
                                             "ssm": StandInArray((32, 128, 128))}))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32", help="comma-separated numbers of sequences per step")
    ap.add_argument("--layers", type=int, default=32, help="layers of the model (the 9B: 32)")
    ap.add_argument("--every", type=int, default=4, help="every N-th layer is attention (the 9B: 4)")
    ap.add_argument("--repeat", type=int, default=2000, help="checks timed per batch size (best of 5 runs)")
    args = ap.parse_args(argv)
    print(f"{'sequences':>9} {'states':>7} {'arrays':>7} {'check us':>9} {'capture us':>11}")
    for b in (int(x) for x in args.batches.split(",")):
        owners = [layer_states(args.layers, args.every) for _ in range(b)]
        watch = [st for seq in owners for st in seq]  # what the executor hands a batched graph step
        t0 = time.perf_counter()
        watched = READER.watch(watch)
        capture = time.perf_counter() - t0
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(args.repeat):
                ok = watched.unchanged(watch)
            best = min(best, (time.perf_counter() - t0) / args.repeat)
            assert ok
        print(f"{b:>9} {b * args.layers:>7} {len(watched.pointers):>7} {best * 1e6:>9.1f} {capture * 1e6:>11.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
