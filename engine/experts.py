"""Routed experts that live apart from their layer: the layer on one device, its experts on another.

A mixture-of-experts model is mostly experts (Qwen3.6-35B-A3B: ~95% of the bytes), and a token reads
only a few of them. When the GPUs run out of memory, the experts can stay in host RAM: the layer's
attention / Gated DeltaNet, norms and shared expert run on the GPU, and each MoE block's routing and
routed experts run on the CPU backend next to their weights (the NumPy backend, which uses the integer
kernels of engine/cpu_experts.py for a decode token). Only the hidden state crosses the link: one
(T, hidden) row block there and back per MoE layer, not the expert weights.

`ExpertsApart` is the device backend of such a device: a thin proxy that passes every op to the real
backend except `moe` on expert weights held by the experts' backend, which it runs there. Every part
on that device shares the one proxy (the executor runs a device's parts through one backend). A
captured CUDA graph cannot contain a host round trip, so the proxy's `graph_step` declines: decode on
that device runs eagerly.

What this is not: the placement of experts (engine/placement.py prices and plans parts; load_model's
`experts` option puts them), or streaming experts to the GPU for prefill (not built).
"""

from __future__ import annotations

from typing import Any

from .backends.base import Backend


class ExpertsApart:
    """`inner` runs everything except the routed experts whose weights `experts` holds."""

    def __init__(self, inner: Backend, experts: Backend):
        self._inner = inner
        self.experts = experts
        self._held: set[int] = set()  # id() of the expert weights loaded on `experts`
        self.device = inner.device
        self.name = inner.name
        self.host_moe_calls = 0

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)

    def __repr__(self) -> str:
        return f"ExpertsApart({self._inner!r}, experts on {self.experts.device})"

    @property
    def inner(self) -> Backend:
        return self._inner

    def hold(self, weights: dict) -> None:
        """Note the weights of a "layer.<i>.experts" part, loaded on the experts' backend."""
        self._held.update(id(w) for w in weights.values())

    def release(self, weights: dict) -> None:
        self._held.difference_update(id(w) for w in weights.values())

    def moe(self, x, router, gate_exps, up_exps, down_exps, k: int):
        if id(gate_exps) not in self._held:  # this layer's experts sit on this device
            return self._inner.moe(x, router, gate_exps, up_exps, down_exps, k)
        self.host_moe_calls += 1
        xe = self.experts.asarray(self._inner.to_numpy(x))
        y = self.experts.moe(xe, router, gate_exps, up_exps, down_exps, k)
        return self._inner.asarray(self.experts.to_numpy(y))

    def graph_step(self, key, run, ids, positions, *, owner, watch=None, host_in=None, host_out=None,
                   after=None, wait: bool = True) -> Any:
        """None: a step with a host round trip per MoE layer cannot be captured; it runs eagerly."""
        if self._held:
            return None
        return self._inner.graph_step(key, run, ids, positions, owner=owner, watch=watch,
                                      host_in=host_in, host_out=host_out, after=after, wait=wait)
