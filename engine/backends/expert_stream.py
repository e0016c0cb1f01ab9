"""Routed experts in host RAM, streamed to one GPU for prefill (issue 15, the Fermi lesson).

A layer whose experts live in host RAM runs a long prefill chunk's MoE block on its GPU anyway: the
layer's expert tensors are copied from page-locked host memory into one of two GPU staging buffers
on a copy stream of their own, and the GPU's `moe` runs on views of that buffer. Two buffers, so the
copy of the next host-held layer's experts (issued when a layer's MoE starts) runs while this layer
computes. Events order the two streams: a buffer is refilled only after the MoE that read it has run,
and an MoE reads a buffer only after its copy has landed.

At load, each host-held layer's expert tensors are written once into one page-locked host buffer in
the layout the GPU kernels read (kernels/layout.py `relayout`, the function ops.upload_weight's
layout follows; types without a GPU kernel are decoded to F32 as CupyBackend.load_weight does), so a
layer is one host-to-device copy and nothing is re-laid out on the GPU. The router is small and stays
resident on the GPU (engine/experts.py loads it there: decode routes on the GPU too).

A simulated link (engine/rig.py) is honoured like the rig's own copies: a copy of N bytes is done no
earlier than latency + N / bandwidth after it could start, copies queueing one behind the other.

What this is not: the decision to stream (engine/experts.py decides per chunk), or decode (one token
reads 8 of 256 experts: the CPU runs them, engine/cpu_experts.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import cupy as cp
import numpy as np
from minecart.kernels import kquant_layout, ops
from minecart.kernels.layout import relayout

from .. import quants
from .cupy_backend import CupyBackend, CupyWeight

_ALIGN = 256  # byte alignment of each array inside a layer's buffer


@dataclass(frozen=True)
class _Piece:
    """One array of a staged tensor: `nbytes` at `offset` in the layer's buffer, seen as `shape` of
    `dtype`."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # logical: (E, R, K) for experts
    type_name: str  # as the GPU holds it
    rows: int  # R (rows per expert)
    cols: int  # K
    experts: int
    wq: _Piece
    wd: _Piece | None


class _HostLayer:
    """A layer's expert tensors in one page-locked host buffer, in the GPU's layout."""

    def __init__(self, key: int, tensors: list[_Tensor], host: np.ndarray, router: CupyWeight):
        self.key = key
        self.tensors = tensors
        self.host = host
        self.nbytes = int(host.nbytes)
        self.router = router


class _Slot:
    """One GPU staging buffer and what it holds: `key` (a layer, or None), `ready` (recorded on the
    copy stream when its copy landed), `free` (recorded on the compute stream after the MoE that read
    it), `deadline` (perf_counter time the simulated link finishes the copy). A layer still in a
    buffer from the chunk before is used again without a copy."""

    def __init__(self) -> None:
        self.buf: Any = None
        self.key: int | None = None
        self.ready: Any = None
        self.free: Any = None
        self.deadline = 0.0
        self.acquired = True  # False from a copy's start until an MoE takes the buffer
        self.busy = False  # an MoE holds it (acquire .. release): never refilled meanwhile
        self.stamp = 0  # when it was last filled or taken (the other one is refilled first)


class ExpertStream:
    """Stages host-held layers' experts on `gpu` (a CupyBackend). `alloc(nbytes)` makes a device
    uint8 buffer (through the device's backend, so a rig's memory cap counts the staging buffers);
    `link_seconds(n)` is the simulated link's time for n bytes (None: a real link, nothing
    simulated)."""

    def __init__(self, gpu: CupyBackend, alloc: Callable[[int], Any], free: Callable[[Any], None],
                 link_seconds: Callable[[int], float] | None = None):
        self.gpu = gpu
        self._alloc = alloc
        self._free = free
        self._link_seconds = link_seconds
        self._layers: dict[int, _HostLayer] = {}
        self._layouts: dict[tuple[str, int], Any] = {}  # (type, K) -> host re-layout, None = via the GPU
        self._slots = [_Slot(), _Slot()]
        self._clock = 0
        self._link_free = 0.0
        with cp.cuda.Device(gpu.index):
            self._copy = cp.cuda.Stream(non_blocking=True)  # never waits for the legacy default stream
        self.streamed_bytes = 0  # bytes copied host -> GPU so far
        self.streamed_layers = 0  # layer copies so far
        self.wait_seconds = 0.0  # host time spent waiting for the simulated link

    # ---- load time ------------------------------------------------------------------------------------
    def add_layer(self, key: int, weights: Mapping[str, Any], router: Any) -> None:
        """Copy a layer's expert tensors (host weights with the GGUF `.info`) into page-locked memory
        in the GPU's layout; `router` is its router, already on the GPU (its owner frees it)."""
        arrays: list[tuple[str, tuple[int, ...], str, int, int, int, np.ndarray, np.ndarray | None]] = []
        for name, w in weights.items():
            info = w.info
            shape = tuple(int(s) for s in info.shape)
            if len(shape) != 3:
                raise ValueError(f"'{name}' is not an expert tensor (E, R, K): shape {shape}")
            E, R, K = shape
            type_name = ops.kept_type(info.type_name, K)  # as CupyBackend.load_weight keeps it
            raw = np.asarray(info.raw) if type_name == info.type_name else \
                np.ascontiguousarray(quants.dequantize(info), dtype=np.float32)
            wq, wd = self._device_layout(raw, type_name, E, R, K)
            arrays.append((name, shape, type_name, R, K, E, wq, wd))
        offset = 0
        pieces: list[tuple[_Piece, _Piece | None]] = []
        for *_, wq, wd in arrays:
            pq = _Piece(offset, int(wq.nbytes), tuple(wq.shape), str(wq.dtype))
            offset = _aligned(offset + pq.nbytes)
            pd = None
            if wd is not None:
                pd = _Piece(offset, int(wd.nbytes), tuple(wd.shape), str(wd.dtype))
                offset = _aligned(offset + pd.nbytes)
            pieces.append((pq, pd))
        host = self.gpu.pinned_empty((max(offset, 1),), "uint8")
        tensors = []
        for (name, shape, type_name, R, K, E, wq, wd), (pq, pd) in zip(arrays, pieces, strict=True):
            host[pq.offset:pq.offset + pq.nbytes] = wq.reshape(-1).view(np.uint8)
            if wd is not None and pd is not None:
                host[pd.offset:pd.offset + pd.nbytes] = wd.reshape(-1).view(np.uint8)
            tensors.append(_Tensor(name, shape, type_name, R, K, E, pq, pd))
        self._layers[key] = _HostLayer(key, tensors, host, router)

    def _device_layout(self, raw: np.ndarray, type_name: str, E: int, R: int, K: int
                       ) -> tuple[np.ndarray, np.ndarray | None]:
        """(wq, wd) on the host, byte for byte what ops.upload_weight makes on the GPU. The host
        re-layouts (kernels/layout.py, kernels/kquant_layout.py) are checked once per (type, row
        length) against upload_weight on the layer's first expert; when none matches (a layout the
        host does not know), the tensor goes through upload_weight and comes back."""
        key = (type_name, K)
        if key not in self._layouts:
            self._layouts[key] = self._calibrate(raw, type_name, E, R, K)
        fn = self._layouts[key]
        if fn is not None:
            return fn(raw, E * R)
        with cp.cuda.Device(self.gpu.index):
            q = ops.upload_weight(raw, type_name, (E, R, K))
            return cp.asnumpy(q.wq), None if q.wd is None else cp.asnumpy(q.wd)

    def _calibrate(self, raw: np.ndarray, type_name: str, E: int, R: int, K: int) -> Any:
        """The host re-layout that gives upload_weight's bytes for the first expert of `raw`, or None."""
        flat = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        sample = flat[: flat.size // E]  # the first expert's R rows
        with cp.cuda.Device(self.gpu.index):
            q = ops.upload_weight(sample, type_name, (R, K))
            want = (cp.asnumpy(q.wq), None if q.wd is None else cp.asnumpy(q.wd))
        for fn in _host_layouts(type_name, K):
            if all(_same(a, b) for a, b in zip(fn(sample, R), want, strict=True)):
                return fn
        return None

    def has(self, key: int) -> bool:
        return key in self._layers

    def layer_bytes(self, key: int) -> int:
        return self._layers[key].nbytes

    def active_bytes(self, key: int, k: int) -> float:
        """Expert weight bytes one token reads in layer `key` when it uses k experts."""
        layer = self._layers[key]
        e = layer.tensors[0].experts
        return layer.nbytes * min(max(k, 1), e) / e

    @property
    def staging_bytes(self) -> int:
        """Bytes of the two staging buffers once both exist (2 x the largest layer)."""
        return sum(0 if s.buf is None else int(s.buf.nbytes) for s in self._slots)

    # ---- prefill --------------------------------------------------------------------------------------
    def prefetch(self, key: int) -> None:
        """Start copying layer `key`'s experts into a staging buffer (nothing when one holds them or is
        receiving them). Takes the buffer not read last; its copy waits for the MoE that read it."""
        if any(s.key == key for s in self._slots):
            return
        layer = self._layers[key]
        idle = [s for s in self._slots if not s.busy]
        if not idle:
            raise RuntimeError("both expert staging buffers are in use; release one before prefetching")
        slot = min(idle, key=lambda s: s.stamp)  # the one filled or read longest ago
        fresh = slot.buf is None or slot.buf.nbytes < layer.nbytes
        if fresh:
            if slot.buf is not None:
                if slot.free is not None:
                    slot.free.synchronize()  # its last reader has run before the buffer is dropped
                if slot.ready is not None:
                    slot.ready.synchronize()  # and its last copy has landed (an orphaned prefetch's)
                self._free(slot.buf)
            slot.buf = None
            slot.buf = self._alloc(max(s.nbytes for s in self._layers.values()))
        with cp.cuda.Device(self.gpu.index):
            if fresh:
                # the new buffer is the compute stream's: its pool may hand over memory that work queued
                # there still reads, and the allocation's own fill is queued there too. The copy stream
                # waits for both (else a busy GPU lets the copy land first and the fill zero it).
                allocated = cp.cuda.Event(block=False, disable_timing=True)
                allocated.record(cp.cuda.get_current_stream())
                self._copy.wait_event(allocated)
            elif slot.free is not None:
                self._copy.wait_event(slot.free)
            cp.cuda.runtime.memcpyAsync(slot.buf.data.ptr, layer.host.ctypes.data, layer.nbytes,
                                        cp.cuda.runtime.memcpyHostToDevice, self._copy.ptr)
            slot.ready = cp.cuda.Event(block=False, disable_timing=True)
            slot.ready.record(self._copy)
        slot.key = key
        slot.acquired = False
        self._clock += 1
        slot.stamp = self._clock
        now = time.perf_counter()
        if self._link_seconds is not None:
            self._link_free = max(self._link_free, now) + self._link_seconds(layer.nbytes)
            slot.deadline = self._link_free
        else:
            slot.deadline = now
        self.streamed_bytes += layer.nbytes
        self.streamed_layers += 1

    def acquire(self, key: int) -> dict[str, CupyWeight]:
        """Layer `key`'s expert tensors as GPU weights over its staging buffer (copied now if no
        prefetch started it), plus its router under the name "router". The compute stream waits for
        the copy; the host waits only for a simulated link."""
        self.prefetch(key)
        slot = next(s for s in self._slots if s.key == key)
        slot.acquired = slot.busy = True
        self._clock += 1
        slot.stamp = self._clock
        layer = self._layers[key]
        with cp.cuda.Device(self.gpu.index):
            cp.cuda.get_current_stream().wait_event(slot.ready)
        left = slot.deadline - time.perf_counter()
        if left > 0:
            self.wait_seconds += left
            time.sleep(left)
        out: dict[str, CupyWeight] = {"router": layer.router}
        for t in layer.tensors:
            wq = _view(slot.buf, t.wq)
            wd = None if t.wd is None else _view(slot.buf, t.wd)
            q = ops.QWeight(t.type_name, t.rows, t.cols, t.experts, wq, wd)
            out[t.name] = CupyWeight(t.name, t.shape, t.type_name, q, "experts")
        return out

    def release(self, key: int) -> None:
        """The MoE that read layer `key`'s buffer has been queued: the buffer is free once it runs."""
        slot = next((s for s in self._slots if s.key == key), None)
        if slot is None:
            return
        with cp.cuda.Device(self.gpu.index):
            slot.free = cp.cuda.Event(block=False, disable_timing=True)
            slot.free.record(cp.cuda.get_current_stream())
        slot.busy = False

    def in_flight(self) -> int:
        """Copies issued and not landed yet."""
        return sum(1 for s in self._slots if s.ready is not None and not s.ready.done)

    def orphans(self) -> int:
        """Copies issued that no MoE has taken yet (a prefetch whose layer never ran)."""
        return sum(1 for s in self._slots if s.key is not None and not s.acquired)

    def settle(self) -> None:
        """Wait for every copy in flight and forget the buffers no MoE took (a failed prefill leaves no
        copy behind)."""
        self._copy.synchronize()
        for s in self._slots:
            if not s.acquired:
                s.key = None
                s.acquired = True

    def close(self) -> None:
        self.settle()
        for s in self._slots:
            if s.buf is not None:
                self._free(s.buf)
            s.buf = None
            s.key = None
        self._layers.clear()


def make_stream(gpu: Any, device: Any, link_seconds: Callable[[int], float] | None) -> ExpertStream | None:
    """An ExpertStream for `gpu` when it is a CupyBackend (else None). `device`: the backend the
    device's parts run on (`gpu` itself, or a rig's proxy of it, which then counts the staging
    buffers against its memory cap)."""
    if not isinstance(gpu, CupyBackend):
        return None
    return ExpertStream(gpu, lambda n: device.zeros((n,), "uint8"), device.free, link_seconds)


def _host_layouts(type_name: str, K: int) -> list[Callable[[np.ndarray, int], tuple[Any, Any]]]:
    """Candidate host re-layouts of (raw, rows) for a type: the scale split / rows as stored, and for
    the K-quants their repack."""
    out: list[Callable[[np.ndarray, int], tuple[Any, Any]]] = [
        lambda raw, rows: relayout(np, raw, type_name, rows, K)]
    if type_name in kquant_layout.KQUANT_TYPES and K % 256 == 0:
        out.append(lambda raw, rows: kquant_layout.repack(raw, type_name, K, np))
    return out


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a.view(np.uint8), b.view(np.uint8)))


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _view(buf: Any, piece: _Piece) -> Any:
    return buf[piece.offset:piece.offset + piece.nbytes].view(piece.dtype).reshape(piece.shape)

