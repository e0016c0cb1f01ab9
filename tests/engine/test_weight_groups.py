"""Weights laid out once at load: the projections one matmul_many call reads (ArchSpec.fused_groups) are
loaded as one array per group (Backend.load_fused), each weight a row view of it, and nothing is
concatenated later. Checked on the NumPy backend, which groups like the CUDA backend, against a load
with every weight apart (the mixin's reference load_fused)."""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import load_model
from minecart.engine.backends.base import FusedOpsMixin
from minecart.engine.backends.numpy_backend import NumpyBackend, NumpyWeight
from minecart.engine.errors import DeviceError, GenerationCancelled
from minecart.engine.gguf_file import GGUFFile
from minecart.engine.models import spec_for
from minecart.engine.rig import Rig, RigBackend, RigDevice, allocated_bytes

PROMPT = [3, 17, 101, 5, 9, 250, 42, 7]


@pytest.fixture(scope="module")
def path(fixtures_dir):
    return fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf"


class ApartBackend(NumpyBackend):
    """Every weight its own array: the reference semantics of load_fused (base.FusedOpsMixin)."""

    def load_fused(self, infos):
        return FusedOpsMixin.load_fused(self, infos)


class RecordingBackend(NumpyBackend):
    def __init__(self):
        super().__init__()
        self.groups: list[tuple[str, ...]] = []
        self.live: set[int] = set()

    def load_weight(self, info, *, role="matmul"):
        wt = super().load_weight(info, role=role)
        self.live.add(id(wt))
        return wt

    def load_fused(self, infos):
        self.groups.append(tuple(i.name for i in infos))
        ws = super().load_fused(infos)
        self.live.update(id(w) for w in ws)
        return ws

    def free(self, obj):
        self.live.discard(id(obj))


def _groups(model) -> list[tuple[str, ...]]:
    spec = spec_for(model.config.architecture)
    return [g for part in model._roles.values() for g in spec.fused_members(part)]


def test_every_group_is_one_array_with_the_weights_as_row_views(path):
    with load_model(path, backend=NumpyBackend()) as model:
        groups = _groups(model)
        kinds = {g[0].split(".", 2)[2] for g in groups}
        # GDN input projections, attention q/k/v, FFN gate/up: every group the dense model has
        assert kinds == {"attn_qkv.weight", "attn_q.weight", "ffn_gate.weight"}
        assert len(groups) == 2 * model.config.n_layers  # a mixer group and the FFN group per layer
        flat = {n: w for ws in model.weights.values() for n, w in ws.items()}
        for g in groups:
            ws = [flat[n] for n in g]
            assert all(isinstance(w, NumpyWeight) for w in ws)
            base = ws[0].dense().base
            assert base is not None and base.shape == (sum(w.shape[0] for w in ws), ws[0].shape[1])
            r0 = 0
            for w in ws:  # member i is rows [r0, r0 + rows) of the one array, in the group's order
                d = w.dense()
                assert d.base is base and d.flags.c_contiguous
                assert d.__array_interface__["data"][0] == base[r0:].__array_interface__["data"][0]
                r0 += w.shape[0]
            assert r0 == base.shape[0]


def test_grouped_load_runs_exactly_like_weights_apart(path):
    with load_model(path, backend=NumpyBackend()) as grouped, load_model(path, backend=ApartBackend()) as apart:
        flat_g = {n: w for ws in grouped.weights.values() for n, w in ws.items()}
        flat_a = {n: w for ws in apart.weights.values() for n, w in ws.items()}
        assert flat_g.keys() == flat_a.keys()
        for g in _groups(grouped):
            assert not np.shares_memory(flat_a[g[0]].dense(), flat_a[g[1]].dense())  # apart: own arrays
            assert flat_g[g[0]].dense().base is flat_g[g[1]].dense().base is not None
            for n in g:
                np.testing.assert_array_equal(flat_g[n].dense(), flat_a[n].dense())
        np.testing.assert_array_equal(grouped.logits(PROMPT), apart.logits(PROMPT))


def test_loader_asks_for_the_spec_groups_and_nothing_else(path):
    be = RecordingBackend()
    with load_model(path, backend=be) as model:
        assert be.groups == _groups(model)
        spec = spec_for(model.config.architecture)
        assert spec.fused_groups  # qwen35 declares them (the one list the loader reads)
        for g in be.groups:
            i = g[0].split(".")[1]
            declared = [d for d in spec.fused_groups if f"blk.{i}.{d[0]}" == g[0]]
            assert len(declared) == 1 and g == tuple(f"blk.{i}.{t}" for t in declared[0])


def test_fused_members_keeps_declared_order_and_skips_lone_or_non_matmul_members():
    spec = spec_for("qwen35")
    roles = {"blk.2.ffn_up.weight": "matmul", "blk.2.ffn_gate.weight": "matmul",
             "blk.2.attn_q.weight": "matmul", "blk.2.attn_k.weight": "vector",
             "blk.2.ffn_down.weight": "matmul", "output.weight": "matmul"}
    assert spec.fused_members(roles) == [("blk.2.ffn_gate.weight", "blk.2.ffn_up.weight")]
    assert spec_for("gemma3").fused_members(roles) == []  # gemma3 declares no groups


def test_cancel_inside_a_group_frees_everything(path):
    import threading

    be = RecordingBackend()
    cancel = threading.Event()

    def progress(frac, msg):
        if "ffn_up" in msg:  # right after the first FFN group was loaded
            cancel.set()

    with pytest.raises(GenerationCancelled):
        load_model(path, backend=be, progress=progress, cancel=cancel)
    assert be.groups and be.live == set()


def test_rig_charges_a_group_once(path):
    rig = Rig([RigDevice("cpu:0", "cpu:0")])
    with load_model(path, devices=rig) as model:
        be = model.backends["layer.0"]
        assert isinstance(be, RigBackend)
        held = [model.weights[p] for p in model.weights]
        assert be.used_bytes == allocated_bytes(held)  # each group's array counted once


def test_rig_cap_hit_inside_a_group_frees_the_group(path):
    gf = GGUFFile(path)
    try:
        infos = [gf.tensor(n) for n in ("blk.0.attn_qkv.weight", "blk.0.attn_gate.weight",
                                        "blk.0.ssm_beta.weight", "blk.0.ssm_alpha.weight")]
        sizes = [4 * int(np.prod(i.shape)) for i in infos]
        be = RigBackend(NumpyBackend(), RigDevice("cpu:0", "cpu:0", memory_cap=sizes[0] + sizes[1] // 2))
        with pytest.raises(DeviceError, match="attn_gate"):
            be.load_fused(infos)
        assert be.used_bytes == 0 and be._held == {}
        ok = RigBackend(NumpyBackend(), RigDevice("cpu:0", "cpu:0", memory_cap=sum(sizes)))
        ws = ok.load_fused(infos)
        assert ok.used_bytes == sum(sizes) == allocated_bytes(ws)
    finally:
        gf.close()
