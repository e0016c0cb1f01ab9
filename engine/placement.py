"""Placement: which device runs each part of a model, and how many bytes each device needs.

Plain data, no Qt, no numpy. A model is split into ordered *parts*: "global" (token embedding), "layer.0"
... "layer.{n-1}", and "head" (output norm + LM head). A `Placement` assigns every part to a device name
("cuda:N" or "cpu:N") and estimates, per device, the bytes of

- weights: exact, from the GGUF tensor infos (quantized blocks as stored; a tied embedding used by
  "global" and "head" on two devices is counted on both, once if they share a device);
- KV cache: attention layers, K and V at the chosen context and KV type (f32, f16, q8, q3 = 3-bit);
- recurrent state: Gated DeltaNet conv state and delta-rule state, fp32, independent of context;
- activations and scratch ("scratch"): the peak live activations of the widest part on the device at the
  chosen prefill chunk, counted the way the CUDA backend allocates them (each architecture's spec says
  how: engine/models/<arch>.py SPEC.layer_costs;
  fused attention is assumed, so no T x context score matrix is counted), plus on a "cuda:*" device
  holding stored (quantized) weights the part of the load-time peak that the run's own arrays do not
  cover (staging: the raw copy of a Q8_0/Q4_0 matrix being re-laid out, and the one tensor that sits
  beside its group while a weight group is laid out as one array, CupyBackend.load_fused).
  DeviceBytes.staging says how much of the scratch that is;
- overhead: on a "cuda:*" device, the CUDA context (CUDA_CONTEXT_BYTES, a guess until measured; the
  CUDA backend measures it per device: CupyBackend.context_bytes), the loaded kernel modules
  (KERNEL_MODULES_BYTES) and the captured decode graphs (GRAPH_BYTES_PER_LAYER per layer held):
  device memory outside CuPy's pool. DeviceBytes.modules / .graphs say how much of it those two are.

What "measured" means for the estimate (engine/multidevice.py `_memory_report`, tools/plan_vs_measured.py):
per device, the CUDA context (device memory in use right after the context was made, before any array),
plus the highest total_bytes of CuPy's memory pool on that device, sampled after prefill and after
decode (the pool keeps freed blocks for reuse, so its total is the high-water mark of what the run held
from the device, holes included), plus the device memory held outside the pool beyond the context at
the end (kernel modules, CUDA-graph executables, the driver's page rounding).

What this module is not: it does not load weights or run anything (engine/multidevice.py executes a
Placement), and it does not know about GPUs beyond their names and free bytes (callers pass DeviceSpec).

Typical use:

    costs = model_costs(config, gguf_file)                      # or plan_auto(config, gguf_file, ...)
    plan = plan_auto(config, gguf_file, [DeviceSpec("cuda:0", 8 * GiB), DeviceSpec("cuda:1", 4 * GiB)],
                     context=32768, chunk=512, kv_type="f16")
    for issue in validate(plan, devices): print(issue)         # messages a person can act on
    plan.move_boundary(0, 20)                                   # cuda:1 now starts at part 20
    text = plan.to_json(); plan2 = Placement.from_json(text)

Sizes of the named Qwen3.5 shapes can be computed without the file: `config_and_tensors_for_shape()`.
What a part holds and costs comes from the architecture's spec (engine/models/spec.py); this module
only adds it up per device.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from . import kvquant
from . import quants as Q
from .backends.base import ARENA_ALIGN, DRIVER_PAGE, arena_aligned, whole_pages
from .devices import format_bytes
from .errors import PlacementError
from .models import qwen35
from .models.spec import ArchSpec, ModelConfig, spec_for
from .quant_mix import matrix_types, parse_quant
from .sampling import SamplingParams

if TYPE_CHECKING:
    from pathlib import Path

    from .gguf_file import TensorInfo

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# What one CUDA context costs on the device before any allocation (driver state, loaded modules).
# Measured on an H200 with CUDA 13 / CuPy 14: 527 MiB for the context, plus ~22 MiB once minecart's
# kernels are loaded. Contexts grow with the number of SMs, so the 10-36 SM mining cards take less
# (300-400 MiB is the usual range on Pascal/Turing); 400 MiB is used until measured on such a card.
CUDA_CONTEXT_BYTES = 400 * MiB

# Device memory outside CuPy's pool beyond the CUDA context, per "cuda:*" device: the compiled kernel
# modules once loaded (minecart's and CuPy's own; RawModule code is not pool memory), and the captured
# decode graphs' executables, counted per layer the device holds. On the H200 (2026-11-30 run,
# docs/BENCHMARKS.md) everything outside the pool beyond the 527 MiB context was ~15 MiB with 8 layers,
# ~55 MiB with 16 and ~95 MiB with 32 (9B, Q8_0): about 22 MiB of modules (measured when loaded)
# plus ~2.3 MiB per layer. tools/plan_vs_measured.py measures both terms apart (modules: outside the
# pool after an eager decode step; graphs: what capturing the decode graphs adds); its 2026-12-01 run
# (9B Q4_K, 8 layers, more kernel modules than before) measured 28.7 MB of modules and 0.24 MB of
# graph per layer: the module term follows it, the per-layer term keeps the older, larger figure
# until a full-depth run measures it (a plan that overestimates stays safe).
# The full-depth runs of 2026-12-02 (tools/plan_vs_measured.py --full, 9B and 27B Q4_K) measured what
# capturing adds at 0 (9B, 32 layers) and 48-81 KB a layer (27B, 64 layers): the per-layer term is now
# that, rounded up.
KERNEL_MODULES_BYTES = 28 * MiB
GRAPH_BYTES_PER_LAYER = 128 * KiB
# The CUDA driver rounds each allocation up: above 1 MiB to whole 2 MiB pages, from 512 KiB to a whole
# 1 MiB, smaller ones share pages (measured on the H200, 2026-12-02: 300 allocations each of 0.25 / 0.68
# / 1.5 / 3.0 / 5.0 / 28 MiB took 0.003 / 0.32 / 0.50 / 1.0 / 1.0 / 0 MiB more of the device than CuPy's
# pool counted). CuPy's pool asks the driver for each array apart, so weights allocated array by array
# lost up to 2 MiB per array: the 27B shape's 868 resident arrays 541 MiB (outside the pool after an
# eager step: 600 MiB beyond the modules), the 9B's, whose dimensions are powers of two, 115 MiB
# (measured 116). The CUDA backend therefore lays each part's weights out in one allocation of whole
# pages (its weight arena, CupyBackend.part_arena), every array at an ARENA_ALIGN_BYTES offset:
# DeviceBytes.rounding is what those arenas hold beyond the weights (`_arena_padding`, less than one
# page per part), inside CuPy's pool. KV caches, states and scratch are allocated array by array as
# before; their rounding is not priced (a few arrays per layer, sized by the context: mostly whole pages).
DRIVER_PAGE_BYTES = DRIVER_PAGE  # 2 MiB
DRIVER_SMALL_BYTES = 512 * KiB  # allocations up to this share the driver's pages
ARENA_ALIGN_BYTES = ARENA_ALIGN

# The Gated DeltaNet prefill's chunked kernels (kernels/gdn_chunk.py): runs of at least this many tokens
# take them, in segments of at most GDN_SEGMENT_TOKENS tokens, chunks of GDN_CHUNK_TOKENS.
GDN_CHUNKED_MIN_TOKENS = 256
GDN_SEGMENT_TOKENS = 2048
GDN_CHUNK_TOKENS = 64

# GGML types the CUDA backend re-lays out at load (int8/int4 quants + fp16 scales, kernels/ops.py
# upload_weight): the raw blocks are copied to the device first, so for a moment the tensor is there
# twice (raw, then scales + quants); the backend then hands the freed raw copy back to the device
# (CupyBackend._return_load_blocks).
STAGED_TYPES = ("Q8_0", "Q4_0", "Q5_0", "IQ4_NL")  # = kernels/layout.py SPLIT_SCALES
# K-quants are repacked on the device at load (kernels/ops.py _upload_kquant, kernels/kquant_layout.py):
# chunks of at most KQUANT_REPACK_CHUNK raw bytes are copied up and repacked by whole-array CuPy
# operations into the final arrays. Beside the final arrays the pool then holds the raw chunk and the
# repack's temporaries (its own outputs included) at their peak: KQUANT_REPACK_FACTOR x the chunk,
# measured by running kquant_layout.repack over whole chunks with NumPy under tracemalloc (2048 rows of
# 4096 values: Q4_K peak 4.56x the chunk, Q5_K 3.92x, Q6_K 4.34x, plus the chunk itself). On the H200
# (tests/gpu/test_load_memory.py, 2026-12-01) Q4_K and Q5_K fell within 10% of that; Q6_K's repack held
# 6.49 chunks (CuPy keeps more of its temporaries alive at once), so Q6_K is priced as measured. The backend frees them after each
# weight, so they are a transient of the load (priced by _load_peak), not a hole.
KQUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # = kernels/kquant_layout.py KQUANT_TYPES
KQUANT_REPACK_CHUNK = 64 * 1024 * 1024  # = kernels/ops.py _KQ_CHUNK_BYTES
KQUANT_REPACK_FACTOR = {"Q4_K": 5.6, "Q5_K": 4.95, "Q6_K": 6.5}
# The requantized prefill (kernels/ops.py, path "dp4a_rq"): a prefill matmul of REQUANT_MIN_T tokens or
# more on one of these types may hold a window of its rows in Q8_0's layout (17/16 bytes a value, at most
# REQUANT_SCRATCH_BYTES) beside its input and output.
REQUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q4_K", "Q5_K", "Q6_K")  # = ops.REQUANT_TYPES
REQUANT_MIN_T = 256  # = kernels/ops.py REQUANT_MIN_T (its default)
REQUANT_SCRATCH_BYTES = 64 << 20  # = kernels/ops.py REQUANT_SCRATCH_BYTES

# Bytes per stored KV value, exactly what the backends' caches allocate (engine/kvquant.py): f16; q8_0 =
# llama.cpp's Q8_0 blocks (32 int8 + an fp16 scale); q3 = the Walsh-Hadamard + Lloyd-Max cache
# (docs/kv-cache.md): K 3-bit and V 2-bit codes with an fp16 scale per 64 values, priced at the K/V
# average (11/32 bytes per value). Head dims are whole blocks and K and V rows equally long, so the
# per-value price is exact.
KV_BYTES_PER_VALUE = kvquant.KV_BYTES_PER_VALUE  # per stored value of each KV cache type
# the engine's KV cache default (engine/kvquant.py): f16, llama.cpp's default too
DEFAULT_KV_TYPE = kvquant.DEFAULT_KV_TYPE

# How a backend holds weights: "stored" = GGUF blocks as in the file (CUDA backend); "numpy" = the
# reference backend (float32, embedding rows read from the file, float32 copy of a tied LM head).
WEIGHT_LAYOUTS = ("stored", "numpy")
CPU_WEIGHTS = ("float32", "stored")  # load_model(cpu_weights=): "numpy" / "stored" layout on the CPU alone

GLOBAL = "global"
HEAD = "head"
FORMAT = "minecart.placement"
FORMAT_VERSION = 1


def layer_part(i: int) -> str:
    return f"layer.{i}"


# ------------------------------------------------------------------------------------------------
# Devices


@dataclass(frozen=True)
class Link:
    """A host<->device link: one-way bandwidth in bytes/s and a fixed cost per copy in seconds."""

    bandwidth: float
    latency: float = 20e-6
    name: str = ""

    def seconds(self, n_bytes: int) -> float:
        return self.latency + n_bytes / self.bandwidth


# What a card's link is taken to be when nobody said (a desktop slot: PCIe Gen3 x16).
DEFAULT_LINK = Link(15.75e9, 10e-6, "PCIe Gen3 x16")


@dataclass(frozen=True)
class DeviceSpeed:
    """What the speed prediction needs of a device: memory bandwidth (bytes/s), the int8 dot-product
    rate (DP4A, ops/s; 0 = none, as on the NumPy backend) and the fp32 FMA rate (flop/s). `source`
    says where the numbers come from (a profile in resources/gpu_profiles.json, a probe)."""

    name: str
    bandwidth: float
    int8_ops: float
    fp32_flops: float
    source: str = ""


@dataclass(frozen=True)
class DeviceSpec:
    """A device a placement may use: its name ("cuda:0", "cpu:0"), how many bytes are free on it, and
    optionally its speed and its link to the host (for plan_auto's speed-aware search and
    predict_speed; without them the split follows free memory alone)."""

    name: str
    free_bytes: int
    label: str = ""  # for people: "GTX 1070 (riser 3)"
    speed: DeviceSpeed | None = None
    link: Link | None = None

    @property
    def is_cuda(self) -> bool:
        return self.name.startswith("cuda:")


_DEVICE_RE = re.compile(r"^(cuda|cpu):\d+$")


def check_device_name(name: str) -> str:
    if not _DEVICE_RE.match(name):
        raise PlacementError(f"device name '{name}' is not understood; use 'cuda:N' or 'cpu:N' (N = 0, 1, ...)")
    return name


def device_overhead(name: str, cuda_context_bytes: int = CUDA_CONTEXT_BYTES) -> int:
    """The fixed device memory of using a device at all: on a GPU its CUDA context and the loaded kernel
    modules (the decode graphs, which grow with the layers held, are added per device by the estimate)."""
    return cuda_context_bytes + KERNEL_MODULES_BYTES if name.startswith("cuda:") else 0


# ------------------------------------------------------------------------------------------------
# Costs of the parts of one model


@dataclass(frozen=True)
class PartCost:
    """What one part needs wherever it runs.

    tensors: (GGUF name, stored bytes) of every tensor the part reads. A tied embedding appears in both
             "global" and "head"; bytes_per_device counts it once per device.
    kv_values_per_token: K and V values the part caches per token (attention layers), n_kv * (d_k + d_v).
    state_bytes: fixed per-sequence recurrent state (GDN conv + delta-rule state, fp32).
    act_values_per_token: peak live float32 activations per token while the part runs (outside the
             chunked GDN kernels).
    act_values_fixed: activations independent of the chunk (e.g. logits rows of the LM head), floats.
    mixer_values_per_token / segment_values_per_token: a GDN layer's live activations per token while
             its chunked prefill kernels run, and their scratch per token of one segment (at most
             GDN_SEGMENT_TOKENS tokens; only runs of GDN_CHUNKED_MIN_TOKENS or more take them).
    fused_bytes: stored bytes of the weights loaded as one array per group (`fused`).
    fused: the weight groups the loader lays out as one array each (the architecture spec's
             fused_groups, ArchSpec.fused_members; on the CUDA backend, members of one GGML type and
             row length), GGUF names in load order.
    staged: tensors uploaded through a raw staging copy on the CUDA backend (STAGED_TYPES matrices),
             in load order like `tensors`.
    repacked: (GGUF name, GGML type) of the K-quant tensors the CUDA backend repacks at upload
             (KQUANT_TYPES), whose temporaries are part of the load's peak.
    matmuls: (GGUF name, GGML type as held, bytes as held, weight values) of every tensor the part
             multiplies activations by (what a token reads; the speed prediction's input). The
             embedding lookup reads one row and is left out.
    experts: names of the routed-expert tensors (a token reads expert_fraction of them); they may
             sit on another device than the rest of the layer (Placement.experts).
    """

    name: str
    kind: str  # "embedding", "gdn", "attention", "sliding", "head"
    tensors: tuple[tuple[str, int], ...]
    kv_values_per_token: int = 0
    state_bytes: int = 0
    act_values_per_token: int = 0
    act_values_fixed: int = 0
    mixer_values_per_token: int = 0
    segment_values_per_token: int = 0
    fused_bytes: int = 0
    fused: tuple[tuple[str, ...], ...] = ()
    staged: tuple[str, ...] = ()
    repacked: tuple[tuple[str, str], ...] = ()
    matmuls: tuple[tuple[str, str, int, int], ...] = ()
    experts: tuple[str, ...] = ()
    expert_fraction: float = 0.0

    @property
    def weight_bytes(self) -> int:
        return sum(b for _, b in self.tensors)

    @property
    def expert_bytes(self) -> int:
        names = set(self.experts)
        return sum(b for n, b in self.tensors if n in names)

    @property
    def requant_scratch_bytes(self) -> int:
        """At most what the requantized prefill's scratch holds while one of this layer's matmuls runs: the
        cap, or all its dense REQUANT_TYPES matrices in Q8_0's layout if less (the LM head's prefill
        matmul is one row, the experts take their own kernels)."""
        if self.kind == "head":
            return 0
        experts = set(self.experts)
        values = sum(v for n, kind, _, v in self.matmuls if kind in REQUANT_TYPES and n not in experts)
        return min(REQUANT_SCRATCH_BYTES, values * 17 // 16)

    def activation_bytes(self, chunk: int) -> int:
        """Peak live activation bytes while this part runs a prefill chunk of `chunk` tokens."""
        vals = self.act_values_per_token * chunk + self.act_values_fixed
        if self.segment_values_per_token and chunk >= GDN_CHUNKED_MIN_TOKENS:
            seg = min(chunk, GDN_SEGMENT_TOKENS)
            seg = -(-seg // GDN_CHUNK_TOKENS) * GDN_CHUNK_TOKENS
            vals = max(vals, self.mixer_values_per_token * chunk + self.segment_values_per_token * seg)
        return 4 * vals + (self.requant_scratch_bytes if chunk >= REQUANT_MIN_T else 0)

    def kv_bytes(self, context: int, kv_type: str) -> int:
        return int(round(self.kv_values_per_token * context * _kv_bytes_per_value(kv_type)))


@dataclass(frozen=True)
class ModelCosts:
    """The per-part costs of one model file (or one model shape), in part order."""

    name: str
    architecture: str
    n_layers: int
    hidden: int
    vocab: int
    layer_kinds: tuple[str, ...]
    parts: tuple[PartCost, ...]
    source: str = ""  # path of the GGUF file, or "shape:<name>"
    layout: str = "stored"  # how the weights are held (WEIGHT_LAYOUTS)
    context_length: int = 0  # the model's trained context (0 = unknown)

    @property
    def part_names(self) -> list[str]:
        return [p.name for p in self.parts]

    def part(self, name: str) -> PartCost:
        for p in self.parts:
            if p.name == name:
                return p
        raise PlacementError(f"'{name}' is not a part of {self.name}; parts are global, layer.0-"
                             f"layer.{self.n_layers - 1} and head")

    @property
    def weight_bytes(self) -> int:
        """Whole-model weight bytes, each tensor once (at its largest form)."""
        return sum(_union_bytes(self.parts).values())

    def to_dict(self) -> dict:
        d = asdict(self)
        d["parts"] = [dict(asdict(p), tensors=[list(t) for t in p.tensors],
                           matmuls=[list(t) for t in p.matmuls]) for p in self.parts]
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> ModelCosts:
        parts = tuple(
            PartCost(**dict(p, tensors=tuple((str(n), int(b)) for n, b in p["tensors"]),
                            staged=tuple(str(n) for n in p.get("staged", ())),
                            repacked=tuple((str(n), str(t)) for n, t in p.get("repacked", ())),
                            fused=tuple(tuple(str(n) for n in g) for g in p.get("fused", ())),
                            matmuls=tuple((str(n), str(t), int(b), int(v)) for n, t, b, v in p.get("matmuls", ())),
                            experts=tuple(str(n) for n in p.get("experts", ()))))
            for p in d["parts"]
        )
        return cls(name=d["name"], architecture=d["architecture"], n_layers=int(d["n_layers"]),
                   hidden=int(d["hidden"]), vocab=int(d["vocab"]), layer_kinds=tuple(d["layer_kinds"]),
                   parts=parts, source=d.get("source", ""), layout=d.get("layout", "stored"),
                   context_length=int(d.get("context_length", 0)))


def _union_bytes(parts: Iterable[PartCost]) -> dict[str, int]:
    """Tensor -> bytes over several parts; a tensor two parts share (the tied embedding) counts once,
    at the larger of its two forms (the reference backend's LM head copy is float32)."""
    out: dict[str, int] = {}
    for p in parts:
        for name, b in p.tensors:
            out[name] = max(out.get(name, 0), b)
    return out


def _saved_kv_type(kv_type: str) -> str:
    """A saved placement's KV type; files written before the types took llama.cpp's names said "q8"."""
    return "q8_0" if kv_type == "q8" else kv_type


def _kv_bytes_per_value(kv_type: str) -> float:
    if kv_type not in KV_BYTES_PER_VALUE:
        raise PlacementError(f"KV cache type '{kv_type}' is not known; use one of "
                             f"{', '.join(KV_BYTES_PER_VALUE)}")
    return KV_BYTES_PER_VALUE[kv_type]


_BLK_RE = re.compile(r"^blk\.(\d+)\.")


class TensorTable(Protocol):
    """What model_costs reads of a model: an opened GGUFFile (engine/gguf_file.py), or a released
    shape without its file (_PaperModel, whose tensors are TensorSpecs)."""

    @property
    def tensors(self) -> Mapping[str, TensorInfo | TensorSpec]: ...

    @property
    def path(self) -> str | Path: ...


def _roles(config: ModelConfig, tensors: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """part -> {tensor: role}: what the loader reads (the architecture's spec; MTP blocks and other
    towers' tensors are not part of it)."""
    roles = spec_for(config.architecture).tensor_roles(config, available=set(tensors))
    for part in roles.values():
        for name in part:
            if name not in tensors:
                raise PlacementError(f"{config.name} has no tensor {name}, which {config.architecture} "
                                     "reads; the file is incomplete: re-convert it")
    return roles


def _shape_of(info) -> tuple[int, ...]:
    return tuple(int(s) for s in info.shape)


def _tensor_bytes(info, role: str, part: str, layout: str) -> int:
    """Bytes a backend holds for one tensor. "stored": the GGUF blocks as they are (the CUDA backend).
    "numpy": the reference backend, which decodes weights to float32 at load, reads embedding rows
    from the memory-mapped file, and keeps one float32 copy of a tied table used as the LM head."""
    if layout == "stored":
        return int(info.n_bytes)
    if layout != "numpy":
        raise PlacementError(f"weight layout '{layout}' is not known; use one of {', '.join(WEIGHT_LAYOUTS)}")
    if role == "embedding" and part == GLOBAL:
        return 0
    n = 1
    for d in _shape_of(info):
        n *= d
    return 4 * n


def _fused_groups(spec: ArchSpec, roles: Mapping[str, str],
                  tensors: Mapping[str, TensorInfo | TensorSpec]) -> tuple[tuple[str, ...], ...]:
    """The weight groups of one part that the CUDA backend lays out as one array each
    (CupyBackend.load_fused): the spec's groups (ArchSpec.fused_members, what the loader asks for)
    whose members share one GGML type and row length; the others load as separate weights."""
    out = []
    for members in spec.fused_members(roles):
        kinds = {(tensors[n].type_name, _shape_of(tensors[n])[-1:]) for n in members}
        if len(kinds) == 1:
            out.append(members)
    return tuple(out)


def model_costs(config: ModelConfig, gguf_file: TensorTable, *, logits_rows: int = 1,
                layout: str = "stored") -> ModelCosts:
    """Per-part costs from the tensor infos of an opened GGUF (or of a TensorTable: `.tensors`, a
    mapping of name -> TensorInfo or TensorSpec, and `.path`).

    logits_rows: rows of fp32 logits the LM head holds at once (1 when generating: prefill asks for the
    last row only; when a caller asks for every position's logits, as Model.logits does, the head runs
    in blocks of engine/model.py HEAD_ROWS = 256 rows, so min(chunk, 256): 248K vocab x 256 rows is
    254 MB on the head's device).
    layout: how the backend holds weights (WEIGHT_LAYOUTS): "stored" for the CUDA backend (quantized
    blocks as in the file), "numpy" for the float32 reference backend.
    """
    tensors = gguf_file.tensors
    spec = spec_for(config.architecture)
    roles = _roles(config, tensors)
    parts: list[PartCost] = []

    def sized(part: str) -> tuple[tuple[str, int], ...]:
        return tuple((n, _tensor_bytes(tensors[n], role, part, layout)) for n, role in roles.get(part, {}).items())

    def stored_matrices(part: str) -> list[tuple[str, str]]:
        """(name, GGML type) of the part's matrices as the CUDA backend uploads them (layout "stored")."""
        if layout != "stored":
            return []
        return [(n, tensors[n].type_name) for n, role in roles.get(part, {}).items()
                if role != "vector"]

    def staged(part: str) -> tuple[str, ...]:
        return tuple(n for n, kind in stored_matrices(part) if kind in STAGED_TYPES)

    def repacked(part: str) -> tuple[tuple[str, str], ...]:
        return tuple((n, kind) for n, kind in stored_matrices(part) if kind in KQUANT_TYPES)

    def fused(part: str) -> tuple[tuple[str, ...], ...]:
        return _fused_groups(spec, roles.get(part, {}), tensors) if layout == "stored" else ()

    def matmuls(part: str, sizes: tuple[tuple[str, int], ...]) -> tuple[tuple[str, str, int, int], ...]:
        held = dict(sizes)
        out = []
        for n, role in roles.get(part, {}).items():
            if role == "vector" or part == GLOBAL:
                continue
            values = 1
            for dim in _shape_of(tensors[n]):
                values *= dim
            kind = tensors[n].type_name if layout == "stored" else "F32"
            out.append((n, kind, held[n], values))
        return tuple(out)

    def experts(part: str) -> tuple[str, ...]:
        return tuple(n for n, role in roles.get(part, {}).items() if role == "experts")

    fraction = config.n_experts_used / config.n_experts if config.n_experts else 0.0

    parts.append(PartCost(GLOBAL, "embedding", sized(GLOBAL), act_values_per_token=config.hidden,
                          staged=staged(GLOBAL), repacked=repacked(GLOBAL)))
    for i, kind in enumerate(config.layer_types):
        c = spec.layer_costs(config, kind)
        sizes = sized(layer_part(i))
        groups = fused(layer_part(i))
        held = dict(sizes)
        parts.append(PartCost(layer_part(i), kind, sizes,
                              kv_values_per_token=c.kv_values_per_token, state_bytes=c.state_bytes,
                              act_values_per_token=c.act_values_per_token,
                              mixer_values_per_token=c.mixer_values_per_token,
                              segment_values_per_token=c.segment_values_per_token,
                              fused_bytes=sum(held[n] for g in groups for n in g), fused=groups,
                              staged=staged(layer_part(i)), repacked=repacked(layer_part(i)), matmuls=matmuls(layer_part(i), sizes),
                              experts=experts(layer_part(i)), expert_fraction=fraction))
    head = sized(HEAD)
    parts.append(PartCost(HEAD, "head", head, act_values_per_token=2 * config.hidden,
                          act_values_fixed=logits_rows * config.vocab_size, staged=staged(HEAD),
                          repacked=repacked(HEAD),
                          matmuls=matmuls(HEAD, head)))
    return ModelCosts(name=config.name, architecture=config.architecture, n_layers=config.n_layers,
                      hidden=config.hidden, vocab=config.vocab_size, layer_kinds=tuple(config.layer_types),
                      parts=tuple(parts), source=str(gguf_file.path), layout=layout,
                      context_length=int(config.context_length or 0))


# ------------------------------------------------------------------------------------------------
# Model shapes without a file


@dataclass(frozen=True)
class TensorSpec:
    """A tensor that exists only on paper: name, logical row-major shape, GGML type, stored bytes."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    n_bytes: int


def config_and_tensors_for_shape(name: str, quant: str = "Q8_0", n_layers: int | None = None
                                 ) -> tuple[ModelConfig, dict[str, TensorSpec]]:
    """ModelConfig and the tensor list (with stored bytes) of a named Qwen3.5 shape, no file needed.

    name: one of engine/models/qwen35.py SHAPES ("qwen3.5-9b", "qwen3.5-27b", ...); quant: the matrices'
    GGML type or a llama-quantize mix ("q4_k_m"), as `minecart synth` writes them (engine/quant_mix.py;
    the tensors the spec stores as F32 stay F32, as the converter writes them); n_layers: keep only the
    first n layers (the pattern stays "every 4th is attention"). The MTP block is left out (it is not
    loaded), though a mix counts it as llama-quantize does. costs_for_shape turns the result into
    ModelCosts (for plan_auto or Placement).
    """
    if name not in qwen35.SHAPES:
        raise PlacementError(f"unknown model shape '{name}'; known: {', '.join(qwen35.SHAPES)}")
    shape = qwen35.SHAPES[name].truncated(n_layers)
    whole = shape.config(name)  # with the MTP block: the file's matrices, in file order
    types = matrix_types([(t_name, t.shape(whole)[-1]) for t_name, t in qwen35.SPEC.plan(whole) if not t.f32],
                         shape.n_layers + shape.n_mtp, parse_quant(quant))
    config = shape.truncated(mtp=False).config(name)
    specs: dict[str, TensorSpec] = {}
    for tname, t in qwen35.SPEC.plan(config):
        dims = t.shape(config)
        type_id = Q.F32 if t.f32 else types[tname]
        n_bytes = math.prod(dims[:-1]) * Q.bytes_per_row(type_id, dims[-1])
        specs[tname] = TensorSpec(tname, dims, Q.type_name(type_id), n_bytes)
    return config, specs


@dataclass(frozen=True)
class _PaperModel:
    tensors: dict[str, TensorSpec]
    path: str


def costs_for_shape(name: str, quant: str = "Q8_0", n_layers: int | None = None) -> ModelCosts:
    """ModelCosts of a released shape without its file (see config_and_tensors_for_shape)."""
    config, specs = config_and_tensors_for_shape(name, quant, n_layers)
    return model_costs(config, _PaperModel(specs, f"shape:{name}:{quant}"))


# ------------------------------------------------------------------------------------------------
# The placement itself


@dataclass(frozen=True)
class DeviceBytes:
    """Estimated bytes one device needs for a placement.

    activations is the device's whole scratch: the peak live activations plus `staging`, which is given
    separately for the record (part of activations, not added on top): the part of the load-time peak
    that the run's own arrays do not cover. overhead likewise includes `modules` (the loaded kernel
    modules), `graphs` (the captured decode graphs) and `rounding` (the weight arenas' bytes beyond
    the weights: each part's arrays are one allocation of whole driver pages, `_arena_padding`)
    beside the CUDA context."""

    device: str
    weights: int = 0
    kv_cache: int = 0
    recurrent: int = 0
    activations: int = 0
    overhead: int = 0
    staging: int = 0
    modules: int = 0
    graphs: int = 0
    rounding: int = 0
    # part of activations too: the two GPU buffers that host-held routed experts are streamed into
    # for prefill (engine/experts.py), each as large as the largest such layer's experts
    expert_staging: int = 0
    # host RAM: the page-locked copy, in the GPU's layout, of the routed experts this host holds for
    # GPU layers (prefill streams from it, engine/backends/expert_stream.py), beside the mapped file
    # pages the CPU's decode reads (`weights`): the experts are in host RAM twice
    pinned: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.recurrent + self.activations + self.overhead + self.pinned

    @property
    def resident(self) -> int:
        """What stays allocated between requests: weights, KV cache and recurrent state."""
        return self.weights + self.kv_cache + self.recurrent


def _load_peak(parts: Sequence[PartCost], elsewhere: Collection[str] = ()) -> int:
    """Most bytes the CUDA backend's pool holds while these parts' weights load, in load order (parts in
    order, tensors in role order, a group when its first member comes, a tensor already on the device
    not loaded again). Each part's weight arena (its tensors' bytes and `_arena_padding`) is allocated
    before its first upload, and every upload writes its final arrays into it, so from a part's first
    step on the pool holds the whole part. Derivations (kernels/ops.py upload_weight,
    CupyBackend.load_fused; the backend hands the pool's unused blocks back to the device after each
    weight, so nothing a weight's upload freed is still held when the next one starts):
    - a STAGED_TYPES matrix of b bytes is uploaded raw and re-laid out into quants + scales (b
      together) before the raw copy is freed: b beside the weights so far;
    - a K-quant matrix (KQUANT_TYPES) is repacked chunk by chunk into its final arrays: beside them,
      KQUANT_REPACK_FACTOR x one chunk (at most KQUANT_REPACK_CHUNK, at most the tensor);
    - a weight group (its arrays in the arena) is laid out tensor by tensor, each member uploaded into
      arrays of its own, copied into the group's and freed: beside the arena, the largest member with
      its own upload's transient."""
    seen: set[str] = set(elsewhere)  # tensors loaded onto another device (routed experts apart)
    loaded = peak = 0
    for p in parts:
        besides = []
        held: set[str] = set()
        for names, total, beside in _load_steps(p):
            if not seen.isdisjoint(names):  # some already loaded (a shared or moved tensor): the rest
                sizes = dict(p.tensors)
                rest = [n for n in names if n not in seen]
                total = sum(sizes[n] for n in rest)
                beside = (max((sizes[n] + _upload_transient(p, n) for n in rest), default=0) if len(rest) > 1
                          else sum(_upload_transient(p, n) for n in rest))
                names = tuple(rest)
            seen.update(names)
            held.update(names)
            loaded += total
            besides.append(beside)
        loaded += _arena_padding(p, frozenset(held))
        peak = max([peak, loaded] + [loaded + b for b in besides])
    return max(peak, loaded)


def _upload_transient(p: PartCost, name: str) -> int:
    """Bytes the upload of one of p's tensors holds beside its final arrays at its peak."""
    b = dict(p.tensors)[name]
    if name in p.staged:
        return b
    kind = dict(p.repacked).get(name)
    if kind is not None:
        return int(KQUANT_REPACK_FACTOR.get(kind, max(KQUANT_REPACK_FACTOR.values())) * min(b, KQUANT_REPACK_CHUNK))
    return 0


def driver_rounding(n: int) -> int:
    """Bytes the CUDA driver adds to one device allocation of n bytes (DRIVER_PAGE_BYTES above)."""
    if n <= DRIVER_SMALL_BYTES:
        return 0
    if n <= MiB:
        return MiB - n
    return whole_pages(n) - n


# weight formats whose u16 scale per 32 values the CUDA backend keeps in an array of its own beside the
# quants (kernels/layout.py array_bytes); the rest are one array
_SCALED_TYPES = frozenset(STAGED_TYPES + KQUANT_TYPES)


@functools.lru_cache(maxsize=8192)
def _arena_padding(p: PartCost, keep: frozenset[str]) -> int:
    """Bytes of the weight arena the CUDA backend allocates for the tensors of `p` named in `keep`
    (CupyBackend.part_arena: one allocation of whole DRIVER_PAGE_BYTES pages, which the driver does not
    round further) beyond their stored bytes: each device array's alignment to ARENA_ALIGN_BYTES and
    the last page's unused rest. The arrays: per tensor the quants and, for _SCALED_TYPES matrices,
    the scales (2 bytes per 32 values); a weight group's arrays are its members' together, which
    the arena is sized for member by member. 0 when nothing is loaded (no arena)."""
    held = [(n, b) for n, b in p.tensors if n in keep]
    if not held:
        return 0
    values = {name: (kind, v) for name, kind, _, v in p.matmuls}
    arrays = 0
    for n, b in held:
        kind, v = values.get(n, ("", 0))
        scales = 2 * (v // 32) if kind in _SCALED_TYPES else 0
        arrays += arena_aligned(b - scales) + arena_aligned(scales)
    return whole_pages(arrays) - sum(b for _, b in held)


@functools.lru_cache(maxsize=8192)
def _load_steps(p: PartCost) -> tuple[tuple[tuple[str, ...], int, int], ...]:
    """A part's loads in order, as _load_peak prices them: (tensor names, their bytes, bytes beside
    them at that moment), one step per tensor and one per weight group (at its first member)."""
    sizes = dict(p.tensors)
    groups = {g[0]: g for g in p.fused}
    grouped = {n for g in p.fused for n in g}
    out = []
    for name, b in p.tensors:
        if name in groups:
            g = groups[name]
            out.append((g, sum(sizes[n] for n in g), max(sizes[n] + _upload_transient(p, n) for n in g)))
        elif name not in grouped:
            out.append(((name,), b, _upload_transient(p, name)))
    return tuple(out)


@dataclass(frozen=True)
class Segment:
    """A run of consecutive parts on one device: parts[start:stop]."""

    device: str
    start: int
    stop: int


@dataclass(init=False)
class Placement:
    """Ordered assignment of a model's parts to devices, with the settings the byte estimate depends on.

    assignment[i] is the device of costs.parts[i]. Edit through move_part / move_boundary /
    assign_range so the checks run; read through devices_used(), segments(), bytes_per_device().

    experts: where MoE layers' routed experts sit when apart from their layer, "layer.N" -> device
    ("cpu:0" = host RAM, the usual way to fit a MoE model on small cards); a layer not named keeps
    them with the layer. `experts_device=` (constructor, and the property) is the shorthand for
    every MoE layer's experts on one device; given, it replaces `experts`.
    """

    costs: ModelCosts
    assignment: list[str]
    context: int = 4096
    chunk: int = 512
    kv_type: str = DEFAULT_KV_TYPE
    n_sequences: int = 1  # sequences held at once (each has its own KV cache and recurrent state)
    cuda_context_bytes: int = CUDA_CONTEXT_BYTES
    extra: dict = field(default_factory=dict)  # free-form, kept through JSON (e.g. the app's notes)
    experts: dict[str, str] = field(default_factory=dict)  # "layer.N" -> its routed experts' device

    def __init__(self, costs: ModelCosts, assignment: list[str], context: int = 4096, chunk: int = 512,
                 kv_type: str = DEFAULT_KV_TYPE, n_sequences: int = 1,
                 cuda_context_bytes: int = CUDA_CONTEXT_BYTES, extra: dict | None = None,
                 experts: Mapping[str, str] | None = None, experts_device: str = ""):
        self.costs = costs
        self.assignment = assignment
        self.context = context
        self.chunk = chunk
        self.kv_type = kv_type
        self.n_sequences = n_sequences
        self.cuda_context_bytes = cuda_context_bytes
        self.extra = {} if extra is None else extra
        self.experts = dict(experts or {})
        if experts_device:
            self.experts_device = experts_device
        self.__post_init__()

    def __post_init__(self):
        if len(self.assignment) != len(self.costs.parts):
            raise PlacementError(f"the placement names {len(self.assignment)} devices for "
                                 f"{len(self.costs.parts)} parts of {self.costs.name}")
        for d in self.assignment:
            check_device_name(d)
        _kv_bytes_per_value(self.kv_type)
        moe = {p.name for p in self.costs.parts if p.experts}
        for part, dev in self.experts.items():
            if part not in moe:
                raise PlacementError(f"'{part}' has no routed experts in {self.costs.name}; only its MoE "
                                     f"layers' experts can sit apart")
            check_device_name(dev)
        if self.context < 1 or self.chunk < 1:
            raise PlacementError("context and chunk must be at least 1 token")

    # ---- routed experts apart from their layer -----------------------------------------------------
    @property
    def experts_device(self) -> str:
        """The device the experts map sends routed experts to ("" = none; the first in layer order
        when it names several). A layer that sits on that device itself keeps them beside it."""
        return next((self.experts[p.name] for p in self.costs.parts if p.name in self.experts), "")

    @experts_device.setter
    def experts_device(self, device: str) -> None:
        """Every MoE layer's routed experts on `device` ("" = each back with its layer)."""
        if device:
            check_device_name(device)
        self.experts = {p.name: device for p in self.costs.parts if p.experts} if device else {}

    def experts_of(self, part: str | int) -> str:
        """The device of a layer's routed experts (the layer's own unless they sit apart)."""
        name = self.parts[self._index(part)]
        return self.experts.get(name) or self.device_of(name)

    def experts_apart(self) -> dict[str, str]:
        """"layer.N" -> device, for the MoE layers whose routed experts sit on another device than
        the layer (the per-layer map the app and `minecart plan` show)."""
        return {p.name: self.experts[p.name] for p in self.expert_parts()}

    def _all_experts_on(self) -> str:
        """The device the experts map sends every MoE layer's routed experts to, or "" when it does
        not send them all to one device."""
        moe = [p.name for p in self.costs.parts if p.experts]
        devs = {self.experts.get(p, "") for p in moe}
        return devs.pop() if moe and len(devs) == 1 else ""

    def streamed_parts(self, device: str) -> list[PartCost]:
        """The layers on GPU `device` whose routed experts are in host RAM: a prefill chunk streams
        them into the GPU's two staging buffers (engine/experts.py)."""
        if not device.startswith("cuda:"):
            return []
        return [p for p in self.expert_parts()
                if self.device_of(p.name) == device and self.experts[p.name].startswith("cpu:")]

    def expert_staging_bytes(self, device: str) -> int:
        """The staging buffers' bytes on `device`: two, each the largest streamed layer's experts."""
        return 2 * max((p.expert_bytes for p in self.streamed_parts(device)), default=0)

    def pinned_expert_bytes(self, device: str) -> int:
        """Host `device`'s page-locked copy of the routed experts it holds for layers on a GPU (what
        their prefill streams from): every such layer's experts once more."""
        if not _is_cpu(device):
            return 0
        return sum(p.expert_bytes for p in self.expert_parts()
                   if self.experts[p.name] == device and self.device_of(p.name).startswith("cuda:"))

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def single(cls, costs: ModelCosts, device: str = "cpu:0", **settings) -> Placement:
        """Everything on one device."""
        return cls(costs, [device] * len(costs.parts), **settings)

    @classmethod
    def from_layer_counts(cls, costs: ModelCosts, counts: Mapping[str, int] | Sequence[tuple[str, int]],
                          **settings) -> Placement:
        """Contiguous split by layer counts in device order, e.g. [("cuda:0", 20), ("cuda:1", 12)]: the
        embedding goes with the first device, the LM head with the last."""
        items = list(counts.items()) if isinstance(counts, Mapping) else list(counts)
        if sum(n for _, n in items) != costs.n_layers:
            raise PlacementError(f"layer counts add up to {sum(n for _, n in items)}, but "
                                 f"{costs.name} has {costs.n_layers} layers")
        assignment = [items[0][0]]
        for dev, n in items:
            assignment += [dev] * n
        assignment.append(items[-1][0])
        return cls(costs, assignment, **settings)

    # ---- reading ------------------------------------------------------------------------------------
    @property
    def parts(self) -> list[str]:
        return self.costs.part_names

    def device_of(self, part: str | int) -> str:
        return self.assignment[self._index(part)]

    def devices_used(self) -> list[str]:
        """Devices in the order the hidden state first reaches them."""
        seen: list[str] = []
        for d in self.assignment:
            if d not in seen:
                seen.append(d)
        return seen

    def segments(self) -> list[Segment]:
        """Maximal runs of consecutive parts on one device, in order (one per device when contiguous)."""
        out: list[Segment] = []
        start = 0
        for i in range(1, len(self.assignment) + 1):
            if i == len(self.assignment) or self.assignment[i] != self.assignment[start]:
                out.append(Segment(self.assignment[start], start, i))
                start = i
        return out

    def parts_on(self, device: str) -> list[str]:
        return [p for p, d in zip(self.parts, self.assignment, strict=True) if d == device]

    def is_contiguous(self) -> bool:
        return len(self.segments()) == len(self.devices_used())

    def crossings(self) -> int:
        """Hidden-state hops from one device to another per forward pass."""
        return len(self.segments()) - 1

    def devices_holding(self) -> list[str]:
        """devices_used() plus the devices holding routed experts apart and nothing else."""
        used = self.devices_used()
        for p in self.expert_parts():
            if self.experts[p.name] not in used:
                used.append(self.experts[p.name])
        return used

    def expert_parts(self) -> list[PartCost]:
        """The MoE layers whose routed experts sit apart from the layer, in layer order."""
        return [p for p in self.costs.parts
                if p.experts and self.experts.get(p.name, self.device_of(p.name)) != self.device_of(p.name)]

    def bytes_per_device(self) -> dict[str, DeviceBytes]:
        """Estimated bytes per device holding anything, in devices_holding() order."""
        out: dict[str, DeviceBytes] = {}
        per_value = _kv_bytes_per_value(self.kv_type)
        apart = self.expert_parts()
        moved = {n for p in apart for n in p.experts}
        for dev in self.devices_holding():
            on_dev = [p for p, d in zip(self.costs.parts, self.assignment, strict=True) if d == dev]
            tensors = {n: b for n, b in _union_bytes(on_dev).items() if n not in moved}
            tensors.update((n, b) for p in apart if self.experts[p.name] == dev
                           for n, b in p.tensors if n in moved)
            kv = state = act = 0
            for p in on_dev:
                kv += p.kv_values_per_token
                state += p.state_bytes
                act = max(act, p.activation_bytes(self.chunk))
            # Two buffers of the incoming hidden state (the bridge's landing buffer and the one in use)
            # plus the widest part's live activations.
            act += 2 * self.chunk * self.costs.hidden * 4
            expert_staging = self.expert_staging_bytes(dev)
            act += expert_staging
            kv_bytes = int(round(kv * self.context * per_value)) * self.n_sequences
            cuda = dev.startswith("cuda:")
            weights = sum(tensors.values())
            if _is_cpu(dev) and self.costs.layout == "stored":
                # the CPU keeps the integer kernels' types as stored and decodes the others to float32
                weights += sum(4 * values - b for p in on_dev for name, kind, b, values in p.matmuls
                               if name in tensors and kind not in CPU_INT_DECODE_EFFICIENCY and kind != "F32")
            if cuda:
                # a captured decode graph keeps the recurrent state of the sequence it was captured for
                # until a graph for the next sequence replaces it (CupyBackend._DecodeGraph.states)
                act += state
            staging = modules = graphs = rounding = 0
            if cuda and self.costs.layout == "stored":
                counted: set[str] = set()
                for p in on_dev + [q for q in apart if self.experts[q.name] == dev]:
                    keep = frozenset(n for n, _ in p.tensors if n in tensors and n not in counted)
                    rounding += _arena_padding(p, keep)
                    counted |= keep
                # the arenas' padding is in the pool while loading and after: in the load peak and in
                # `rounding`, so the run's peak beside the load's has it too
                run_peak = weights + kv_bytes + state * self.n_sequences + act + rounding
                staging = max(0, _load_peak(on_dev, moved) - run_peak)
            if cuda:
                modules = KERNEL_MODULES_BYTES
                graphs = GRAPH_BYTES_PER_LAYER * sum(1 for p in on_dev if p.name.startswith("layer."))
            out[dev] = DeviceBytes(
                device=dev,
                weights=weights,
                kv_cache=kv_bytes,
                recurrent=state * self.n_sequences,
                activations=act + staging,
                overhead=device_overhead(dev, self.cuda_context_bytes) + graphs + rounding,
                staging=staging,
                modules=modules,
                graphs=graphs,
                rounding=rounding,
                expert_staging=expert_staging,
                pinned=self.pinned_expert_bytes(dev),
            )
        return out

    def load_peak(self, device: str) -> int:
        """Bytes CUDA's memory pool holds at the peak of loading `device`'s weights (the weights loaded
        so far and the upload in progress: _load_peak), what bytes_per_device's `staging` compares
        with the run; 0 where weights are float32 arrays (layout "numpy") or nothing is held."""
        if self.costs.layout != "stored":
            return 0
        moved = {n for p in self.expert_parts() for n in p.experts}
        on_dev = [p for p, d in zip(self.costs.parts, self.assignment, strict=True) if d == device]
        return _load_peak(on_dev, moved)

    def describe(self, indices: Iterable[int]) -> str:
        """People's words for a set of part indices: "the embedding, layers 0-11 and the LM head"."""
        idx = sorted(set(indices))
        words: list[str] = []
        layers = [i - 1 for i in idx if 0 < i <= self.costs.n_layers]
        if 0 in idx:
            words.append("the embedding")
        if layers:
            runs = _runs(layers)
            txt = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
            words.append(("layer " if len(layers) == 1 else "layers ") + txt)
        if len(self.assignment) - 1 in idx:
            words.append("the LM head")
        if not words:
            return "nothing"
        return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]

    def summary(self) -> str:
        """One line per segment: device, parts, estimated bytes."""
        per = self.bytes_per_device()
        lines = []
        for seg in self.segments():
            b = per[seg.device]
            lines.append(f"{seg.device}: {self.describe(range(seg.start, seg.stop))} "
                         f"(device total {format_bytes(b.total)})")
        return "\n".join(lines)

    # ---- editing --------------------------------------------------------------------------------------
    def move_part(self, part: str | int, device: str) -> None:
        """Put one part (e.g. "layer.7") on `device`. May leave a device non-contiguous (validate warns)."""
        self.assignment[self._index(part)] = check_device_name(device)

    def assign_range(self, start: int, stop: int, device: str) -> None:
        """Put parts[start:stop] on `device`."""
        if not (0 <= start <= stop <= len(self.assignment)):
            raise PlacementError(f"part range {start}-{stop} is outside 0-{len(self.assignment)}")
        check_device_name(device)
        for i in range(start, stop):
            self.assignment[i] = device

    def move_boundary(self, boundary: int, first_part: int) -> None:
        """Move the boundary between segment `boundary` and segment `boundary + 1` so that the later
        segment starts at part index `first_part` (parts between change device). A segment cannot be
        emptied this way: remove a device with assign_range instead."""
        segs = self.segments()
        if not 0 <= boundary < len(segs) - 1:
            raise PlacementError(f"boundary {boundary} does not exist; this placement has "
                                 f"{len(segs) - 1} boundaries (0-{len(segs) - 2})")
        left, right = segs[boundary], segs[boundary + 1]
        if not left.start < first_part < right.stop:
            raise PlacementError(
                f"the boundary between {left.device} and {right.device} can move to a part index in "
                f"{left.start + 1}-{right.stop - 1}, not {first_part} (each side keeps at least one part)")
        for i in range(left.start, right.stop):
            self.assignment[i] = left.device if i < first_part else right.device

    def with_settings(self, **settings) -> Placement:
        """A copy with other estimate settings (context, chunk, kv_type, n_sequences, ...)."""
        return replace(self, assignment=list(self.assignment), **settings)

    def copy(self) -> Placement:
        return self.with_settings()

    # ---- JSON -----------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "model": self.costs.to_dict(),
            "assignment": {p: d for p, d in zip(self.parts, self.assignment, strict=True)},
            "settings": {"context": self.context, "chunk": self.chunk, "kv_type": self.kv_type,
                         "n_sequences": self.n_sequences, "cuda_context_bytes": self.cuda_context_bytes,
                         # experts: the per-layer map, which wins when both are there; experts_device:
                         # what files before the map held (every MoE layer's experts on one device),
                         # written when that says the same, for older minecarts
                         "experts_device": self._all_experts_on(),
                         "experts": {p.name: self.experts[p.name] for p in self.costs.parts
                                     if p.name in self.experts}},
            "extra": self.extra,
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Mapping, costs: ModelCosts | None = None) -> Placement:
        """Rebuild a placement. Pass `costs` (from the model file now on disk) to re-price a saved
        assignment; a saved placement whose parts do not match the model raises PlacementError."""
        if d.get("format") != FORMAT:
            raise PlacementError(f"not a minecart placement (format '{d.get('format')}'); expected '{FORMAT}'")
        if int(d.get("version", 0)) > FORMAT_VERSION:
            raise PlacementError(f"placement format version {d.get('version')} is newer than this minecart "
                                 f"understands ({FORMAT_VERSION}); update minecart or plan again")
        saved = ModelCosts.from_dict(d["model"])
        costs = costs or saved
        assignment = d["assignment"]
        if set(assignment) != set(costs.part_names):
            raise PlacementError(
                f"the saved placement was made for {saved.name} ({saved.n_layers} layers), which does not "
                f"match {costs.name} ({costs.n_layers} layers); plan again for this model")
        s = d.get("settings", {})
        return cls(costs, [assignment[p] for p in costs.part_names], context=int(s.get("context", 4096)),
                   chunk=int(s.get("chunk", 512)), kv_type=_saved_kv_type(s.get("kv_type", "f32")),
                   n_sequences=int(s.get("n_sequences", 1)),
                   cuda_context_bytes=int(s.get("cuda_context_bytes", CUDA_CONTEXT_BYTES)),
                   extra=dict(d.get("extra", {})),
                   experts={str(k): str(v) for k, v in s.get("experts", {}).items()} if "experts" in s else None,
                   experts_device="" if "experts" in s else str(s.get("experts_device", "")))

    @classmethod
    def from_json(cls, text: str, costs: ModelCosts | None = None) -> Placement:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlacementError(f"the saved placement is not valid JSON ({exc}); delete it and plan again") from exc
        return cls.from_dict(d, costs)

    # ---- helpers ----------------------------------------------------------------------------------------
    def _index(self, part: str | int) -> int:
        if isinstance(part, int):
            if not 0 <= part < len(self.assignment):
                raise PlacementError(f"part index {part} is outside 0-{len(self.assignment) - 1}")
            return part
        try:
            return self.parts.index(part)
        except ValueError:
            raise PlacementError(f"'{part}' is not a part of {self.costs.name}; parts are global, "
                                 f"layer.0-layer.{self.costs.n_layers - 1} and head") from None


def _runs(values: Sequence[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs


# ------------------------------------------------------------------------------------------------
# Automatic planning and validation


def plan_auto(config: ModelConfig | ModelCosts, gguf_file=None, devices: Sequence[DeviceSpec] = (), *,
              context: int = 4096, chunk: int = 512, kv_type: str = DEFAULT_KV_TYPE, reserve: int = 256 * MiB,
              n_sequences: int = 1, cuda_context_bytes: int = CUDA_CONTEXT_BYTES,
              logits_rows: int = 1) -> Placement:
    """Split the model over `devices`, keeping parts contiguous.

    When any device carries its speed (DeviceSpec.speed: a card profile or probe), the plan is the
    fastest one that fits (predict_speed; then the longest context; plan_candidates), whatever the
    order the devices are given in. Otherwise, or when no candidate fits, the model is split in
    proportion to the devices' usable memory, in the given order.

    Usable memory of a device = free_bytes - reserve - CUDA context - its scratch (activations).
    In the proportional split devices are filled in the given order (the card on the fastest link first).
    A device whose share rounds to no part is left out. When the model does not fit at all the plan is
    still made (proportional), and validate() says how much is missing where.
    `config` may instead be a ModelCosts (then gguf_file is ignored).
    """
    if not devices:
        raise PlacementError("no devices to place the model on; pass at least one DeviceSpec")
    names = [check_device_name(d.name) for d in devices]
    if len(set(names)) != len(names):
        raise PlacementError(f"a device is listed twice in {names}")
    costs = config if isinstance(config, ModelCosts) else model_costs(config, gguf_file, logits_rows=logits_rows)
    if any(d.speed is not None for d in devices):
        best = plan_candidates(costs, devices, context=context, chunk=chunk, kv_type=kv_type, reserve=reserve,
                               n_sequences=n_sequences, cuda_context_bytes=cuda_context_bytes)[0]
        if best.fits:
            return best.plan
    probe = Placement.single(costs, names[0], context=context, chunk=chunk, kv_type=kv_type,
                             n_sequences=n_sequences, cuda_context_bytes=cuda_context_bytes)
    item = _split_items(costs, context, kv_type, n_sequences)
    # Live scratch is priced at the widest part of the whole model so the budgets do not depend on the
    # split (the rest of load-time staging is settled by _relieve below).
    whole = probe.bytes_per_device()[names[0]]
    scratch = whole.activations - whole.staging
    usable = [max(0, d.free_bytes - reserve - device_overhead(d.name, cuda_context_bytes) - scratch)
              for d in devices]
    total_usable = sum(usable)
    if total_usable <= 0:
        assignment = [names[0]] * len(item)
    else:
        assignment = _proportional_split(item, names, usable)
    plan = Placement(costs, assignment, context=context, chunk=chunk, kv_type=kv_type,
                     n_sequences=n_sequences, cuda_context_bytes=cuda_context_bytes)
    if total_usable > 0:
        _relieve(plan, {d.name: d.free_bytes - reserve for d in devices})
    return plan


EXPERTS_ON_HELP = ("where an MoE model's routed experts live: 'host' (every MoE layer's experts in host "
                   "RAM: prefill streams them to the GPU, the CPU runs them for decode), N (the first N "
                   "MoE layers keep theirs on the GPU, the rest in host RAM), 'auto' (fill the GPUs with "
                   "whole layers' experts after everything else and the KV cache; the rest in host RAM), "
                   "or a device such as cpu:0; default: with their layers")


def check_experts_on(text: str) -> str:
    """`text` as a valid --experts-on value ("host", "auto", a count of layers or a device name),
    else PlacementError naming the choices."""
    t = text.strip().lower()
    if t in ("host", "auto") or t.isdigit():
        return t
    try:
        return check_device_name(t)
    except PlacementError:
        raise PlacementError(f"--experts-on '{text}' is not understood; use host, auto, a number of MoE "
                             f"layers that keep their experts on the GPU (e.g. 20), or a device such as "
                             f"cpu:0") from None


# Prefill runs of a model whose routed experts are streamed from host RAM to a GPU are at least this many
# tokens: every run copies all host-held layers' experts over the link once (35B-A3B, 29 layers in host
# RAM: 12.2 GB, ~0.51 s at the H200's 23.9 GB/s), so 512-token runs prefill at ~1,000 tokens/s there and
# 2,048-token runs at ~4,000 (docs/BENCHMARKS.md v12). The plan prices the longer run's activations
# (35B-A3B: 1.6 -> 1.9 GiB of 'other' on the GPU) and, with experts "auto", fills the GPU after them.
STREAMED_EXPERTS_CHUNK = 2048


def streams_experts(device_plan: Mapping[str, str]) -> bool:
    """Whether a part -> device plan keeps some layer's routed experts ("layer.N.experts") in host RAM
    while the layer runs on a GPU: its prefill then streams them (engine/experts.py)."""
    return any(part.endswith(".experts") and _is_cpu(dev) and not _is_cpu(device_plan.get(part[: -len(".experts")], "cpu"))
               for part, dev in device_plan.items())


def experts_map(experts_on: str, moe_layers: Sequence[str], host: str = "cpu:0") -> dict[str, str]:
    """The per-layer experts map ("layer.N" -> device) of an --experts-on value other than "auto":
    "host" = every MoE layer's experts on `host`; a device = every MoE layer's there; "N" = the first
    N MoE layers (in layer order) keep theirs with the layer, the rest go to `host`."""
    t = check_experts_on(experts_on)
    if t == "auto":
        raise PlacementError("--experts-on auto needs the devices' free memory: use fill_experts")
    if t.isdigit():
        return {p: host for p in list(moe_layers)[int(t):]}
    return {p: host if t == "host" else t for p in moe_layers}


def fill_experts(plan: Placement, devices: Sequence[DeviceSpec], *, host: str = "cpu:0",
                 reserve: int = 256 * MiB) -> dict[str, str]:
    """--experts-on auto: every MoE layer's routed experts start in host RAM (`host`); then, in layer
    order, each layer's experts come back to its GPU while that GPU's whole estimate (the non-expert
    parts, the KV cache at the plan's context, scratch, the staging buffers that stay) plus `reserve`
    still fits its free memory. Returns the experts map; the plan is not changed."""
    by_name = {d.name: d for d in devices}
    moe = [p.name for p in plan.costs.parts if p.experts]
    trial = plan.with_settings(experts={p: host for p in moe})
    for part in moe:
        dev = trial.device_of(part)
        if dev not in by_name or dev == host:
            continue
        kept = trial.with_settings(experts={p: d for p, d in trial.experts.items() if p != part})
        if kept.bytes_per_device()[dev].total + reserve <= by_name[dev].free_bytes:
            trial = kept
    return dict(trial.experts)


def experts_auto_choices(candidates: Sequence[PlanChoice], devices: Sequence[DeviceSpec], *, host: str,
                         reserve: int = 256 * MiB) -> list[PlanChoice]:
    """--experts-on auto over the speed-aware search: each of plan_candidates' splits made with every
    routed expert in host RAM (its experts_device `host`), its GPUs filled back (fill_experts); fitting
    plans first, then the fastest decode, then the longest context. Every split, not only the best with
    all the experts on the host: the host holds its experts twice (the file's pages and the pinned
    copy), so on a small host only a split that keeps some on the GPUs fits at all."""
    filled = [plan_choice(c.plan.with_settings(experts=fill_experts(c.plan, devices, host=host, reserve=reserve)),
                          devices, reserve=reserve) for c in candidates]
    filled.sort(key=lambda c: (not c.fits, -c.speed.decode_tokens_per_s, -c.max_context))
    return filled


def experts_auto_plans(costs: ModelCosts, devices: Sequence[DeviceSpec], *, host: str, reserve: int = 256 * MiB,
                       **settings: Any) -> list[PlanChoice]:
    """experts_auto_choices of plan_candidates' splits made for it (settings: plan_candidates'), in the
    longer prefill runs the engine streams host-RAM experts in (STREAMED_EXPERTS_CHUNK)."""
    settings["chunk"] = max(settings.get("chunk", Placement.chunk), STREAMED_EXPERTS_CHUNK)
    return experts_auto_choices(plan_candidates(costs, devices, reserve=reserve, experts_device=host, **settings),
                                devices, host=host, reserve=reserve)


def faster_with_experts_apart(plan: Placement, costs: ModelCosts, devices: Sequence[DeviceSpec],
                              **settings: Any) -> Placement:
    """`plan` (a split of whole layers), or, for an MoE model that has GPUs and host RAM among
    `devices`, the experts-in-host-RAM plan (experts_auto_plans: the layers on the GPUs, the routed
    experts that do not fit there in host RAM) when that one is valid and predicted to decode faster,
    or when `plan` itself is not valid (a 35B-A3B Q4_K on a P104-100: 56.0 tokens/s predicted against
    5.7 with 25 of its 40 layers on the CPU). The first plan of the app and of a model loaded over a
    GPU and the CPU without a plan. settings: plan_candidates' (context, kv_type, ...; absent ones
    are `plan`'s)."""
    settings.setdefault("context", plan.context)
    settings.setdefault("chunk", plan.chunk)
    settings.setdefault("kv_type", plan.kv_type)
    settings.setdefault("n_sequences", plan.n_sequences)
    settings.setdefault("cuda_context_bytes", plan.cuda_context_bytes)
    if plan.experts or not any(p.experts for p in costs.parts) or not any(d.is_cuda for d in devices):
        return plan
    host = next((d.name for d in devices if not d.is_cuda), None)
    if host is None:
        return plan

    def valid(p: Placement) -> bool:
        return not any(i.severity == "error" for i in validate(p, devices))

    apart = next((c for c in experts_auto_plans(costs, devices, host=host, **settings) if valid(c.plan)), None)
    if apart is None or not apart.plan.experts:
        return plan
    if valid(plan) and apart.speed.decode_tokens_per_s <= predict_speed(plan, devices).decode_tokens_per_s:
        return plan
    return apart.plan


def plan_choice(plan: Placement, devices: Sequence[DeviceSpec], *, reserve: int = 256 * MiB) -> PlanChoice:
    """A plan priced the way plan_candidates prices its candidates."""
    return PlanChoice(plan, fits(plan, devices, reserve=reserve), predict_speed(plan, devices),
                      max_context(plan, devices, reserve=reserve))


def _split_items(costs: ModelCosts, context: int, kv_type: str, n_sequences: int,
                 moved: Collection[str] = ()) -> list[int]:
    """Per part, the bytes the automatic splits share out: its weights (less the routed experts
    `moved` apart), KV cache, recurrent state and, with stored weights (a CUDA device), its decode
    graph's share, and for the LM head the raw staging copy of its largest STAGED_TYPES matrix: the
    head loads last on its device, so nothing loaded after it fills that hole."""
    per_value = _kv_bytes_per_value(kv_type)
    stored = costs.layout == "stored"
    out = []
    for p in costs.parts:
        b = sum(n_b for n, n_b in p.tensors if n not in moved)
        b += int(round(p.kv_values_per_token * context * per_value)) * n_sequences + p.state_bytes * n_sequences
        if stored and p.name.startswith("layer."):
            b += GRAPH_BYTES_PER_LAYER
        if stored and p.name == HEAD:
            b += max((n_b for n, n_b in p.tensors if n in set(p.staged)), default=0)
        out.append(b)
    return out


def _relieve(plan: Placement, room: Mapping[str, int], max_moves: int = 64) -> None:
    """Move single parts across boundaries, in place, while a device's estimate exceeds its room and the
    neighbour taking the part still fits afterwards (the proportional split prices load-time staging
    and other per-device terms only roughly). Keeps the placement contiguous."""
    for _ in range(max_moves):
        segs = plan.segments()
        per = plan.bytes_per_device()
        moved = False
        for k, seg in enumerate(segs):
            if per[seg.device].total <= room.get(seg.device, 0) or seg.stop - seg.start < 2:
                continue
            for j, first in ((k + 1, seg.stop - 1), (k - 1, seg.start)):
                if not 0 <= j < len(segs):
                    continue
                trial = plan.copy()
                trial.assignment[first] = segs[j].device
                after = trial.bytes_per_device()
                if after[segs[j].device].total <= room.get(segs[j].device, 0):
                    plan.assignment[:] = trial.assignment
                    moved = True
                    break
            if moved:
                break
        if not moved:
            return


def _proportional_split(item: Sequence[int], names: Sequence[str], usable: Sequence[int]) -> list[str]:
    """Contiguous split of `item` costs over devices, each boundary where the running total of cost
    is nearest the running total of the devices' shares, then moved back where a device would overflow
    its usable bytes (when the model fits at all)."""
    total = sum(item)
    n_dev = len(names)
    fits = total <= sum(usable)
    prefix = [0]
    for c in item:
        prefix.append(prefix[-1] + c)
    bounds = [0]  # part index where device k starts
    share_sum = 0
    for k in range(n_dev - 1):
        share_sum += usable[k]
        target = total * share_sum / sum(usable)
        lo = bounds[-1]
        best = min(range(lo, len(item) + 1), key=lambda j: (abs(prefix[j] - target), j))
        if fits:
            # never more than this device holds, never so little that the rest cannot fit
            while best > lo and prefix[best] - prefix[lo] > usable[k]:
                best -= 1
            rest_cap = sum(usable[k + 1:])
            while best < len(item) and prefix[-1] - prefix[best] > rest_cap and \
                    prefix[best + 1] - prefix[lo] <= usable[k]:
                best += 1
        bounds.append(best)
    bounds.append(len(item))
    assignment: list[str] = []
    for k in range(n_dev):
        assignment += [names[k]] * (bounds[k + 1] - bounds[k])
    return assignment


@dataclass(frozen=True)
class PlanIssue:
    """One finding of validate(): severity "error" (will not run) or "warning" (runs, but slower)."""

    severity: str
    message: str
    device: str = ""

    def __str__(self) -> str:
        return f"{self.severity}: {self.message}"


def validate(plan: Placement, devices: Sequence[DeviceSpec], *, reserve: int = 0) -> list[PlanIssue]:
    """Check a placement against the devices present. Errors first; empty list = good to go."""
    by_name = {d.name: d for d in devices}
    errors: list[PlanIssue] = []
    warnings: list[PlanIssue] = []
    present = ", ".join(by_name) or "none"
    per = plan.bytes_per_device()
    for dev in plan.devices_holding():
        idx = [i for i, d in enumerate(plan.assignment) if d == dev]
        what = plan.describe(idx) if idx else "the routed experts"
        if dev not in by_name:
            errors.append(PlanIssue("error", f"{what} {'is' if len(idx) == 1 else 'are'} placed on {dev}, "
                                    f"which is not present (devices: {present}); move them to a present device",
                                    dev))
            continue
        need = per[dev].total + reserve
        free = by_name[dev].free_bytes
        if need > free:
            short = need - free
            others = [d for d in devices if d.name != dev]
            room = {d.name: d.free_bytes - (per[d.name].total if d.name in per else
                                             device_overhead(d.name, plan.cuda_context_bytes)) - reserve
                    for d in others}
            hint = ""
            best = max(room, key=lambda n: room[n]) if room else None
            if best is not None and room[best] > 0:
                hint = f"; {best} has {format_bytes(room[best])} to spare"
            kv = per[dev].kv_cache
            kv_hint = ""
            if kv > short and plan.kv_type in ("f32", "f16"):
                kv_hint = f", or use a smaller KV cache (context {plan.context}, {plan.kv_type} now)"
            errors.append(PlanIssue(
                "error",
                f"{what} {'needs' if len(idx) == 1 else 'need'} {format_bytes(short)} more than {dev} has free "
                f"({format_bytes(need)} needed: weights {format_bytes(per[dev].weights)}, KV cache "
                f"{format_bytes(kv)}, state {format_bytes(per[dev].recurrent)}, scratch "
                f"{format_bytes(per[dev].activations)}, overhead {format_bytes(per[dev].overhead)}; "
                f"{format_bytes(free)} free); move some of them to another device{hint}{kv_hint}",
                dev))
    if not errors:
        for dev in plan.devices_used():
            segs = [s for s in plan.segments() if s.device == dev]
            if len(segs) > 1:
                pieces = " and ".join(plan.describe(range(s.start, s.stop)) for s in segs)
                warnings.append(PlanIssue(
                    "warning", f"{dev} holds {pieces} in {len(segs)} separate runs: each extra run adds two "
                    f"transfers over the PCIe link per step; make its parts contiguous", dev))
    tied_devices = {plan.assignment[0], plan.assignment[-1]}
    emb = dict(plan.costs.parts[0].tensors)
    if len(tied_devices) == 2 and any(n in emb for n, _ in plan.costs.parts[-1].tensors):
        warnings.append(PlanIssue(
            "warning", f"the embedding ({plan.assignment[0]}) and the LM head ({plan.assignment[-1]}) share "
            f"the tied embedding table, which is therefore stored on both devices "
            f"({format_bytes(sum(emb.values()))} each); put them on one device to save it"))
    return errors + warnings


def check(plan: Placement, devices: Sequence[DeviceSpec], **kwargs) -> None:
    """Raise PlacementError listing every error validate() finds (warnings pass)."""
    errors = [i for i in validate(plan, devices, **kwargs) if i.severity == "error"]
    if errors:
        raise PlacementError("the placement does not fit: " + "; ".join(i.message for i in errors))


# ------------------------------------------------------------------------------------------------
# Predicted speed of a plan, and the speed-aware automatic split

# How much of a card's int8 dot-product rate a prefill of 4096 tokens reaches, end to end (attention and
# the Gated DeltaNet scan included). Same source: 9B Q8_0 4,967 tokens/s x 13.84 G int8 ops per token =
# 68.7 TOPS of the 133.7 measured (0.51); 9B Q4_K 4,025 tokens/s (0.42). Float matrices run on fp32 FMA
# at the same fraction. The K-quants' figure refitted on two shapes (v19, tools/plan_vs_measured.py
# --full, 1,024-token prompts, one device): 9B 4,100 and 27B 1,057 tokens/s against 4,007 and 1,145
# at 0.42; the geometric mean of the two ratios (0.972) gives 0.41.
PREFILL_EFFICIENCY = {"Q8_0": 0.51, "Q4_0": 0.51, "F16": 0.51, "BF16": 0.51, "F32": 0.51}
PREFILL_EFFICIENCY_OTHER = 0.41
# Routed experts in prefill run below the dense matmuls: 35B-A3B Q4_K prefills 4,096 tokens at 7,438.6
# tokens/s (v10, moe_gemm_dp4a: one grouped GEMM per projection over all experts), which the rest of
# the model's prediction matches with the experts' operations at 0.46 of the K-quant figure.
EXPERT_PREFILL_EFFICIENCY = PREFILL_EFFICIENCY_OTHER * 0.46
FLOAT_TYPES = ("F16", "BF16", "F32")
PREFILL_PROMPT = 4096  # the prompt length prefill is predicted for (the context, when shorter)
# The speed of a device nobody described: a GTX 1070 class card (256 GB/s, 6.5 TFLOP/s fp32, DP4A at
# 4x that: the sm_61 rate; NVIDIA's GTX 1070 specifications).
UNKNOWN_GPU = DeviceSpeed("unknown GPU (priced as a GTX 1070)", 256e9, 26.0e12, 6.5e12,
                          "assumed: no card named")
# The CPU: the NumPy reference backend (float32 weights, BLAS, no int8 path), as measured on one core of
# this project's 2-core CI machine (docs/demo-check.md): decode reads 1.07 GB a token at 5.1-6.6 tokens/s
# (6 GB/s: 12e9 at the 0.50 decode efficiency), a 300-token prefill of its ~100 M float32 layer weights
# runs 116-122 tokens/s (24 GFLOP/s: 47e9 at the 0.51 prefill efficiency). Desktops with more cores and
# channels are faster; nothing here measures them yet.
CPU_SPEED = DeviceSpeed("CPU (NumPy backend)", 12e9, 0.0, 47e9, "measured: docs/demo-check.md, one core")
SAME_SPEED = 0.03  # plans within 3% of the fastest count as equally fast (then the longest context wins)

# ---- decode: one token -----------------------------------------------------------------------------
# A decode step is a chain of kernels that run one after another (one CUDA graph per stage), so its time
# is the sum of each kernel's time plus the host's time around the graphs. Per kernel: its bytes at the
# card's bandwidth times an efficiency, plus a fixed latency (launch, ramp-up, tail, a single block's
# serial work) that does not shrink with bandwidth. Calibrated on the lent H200 (spec 4.8 TB/s, copy
# 3.89 TB/s measured), 9B shape, 2026-12-01:
# - Nsight Compute profile of one 9B Q4_K step (.lead/profile_v11.txt, docs/BENCHMARKS.md): 275 kernels,
#   2.80 ms under ncu; the same step replayed as a graph takes 2.39 ms of GPU time, so each ncu time
#   below is scaled by 2.39 / 2.80 = 0.854 (ncu's per-kernel cache flushes and serialization);
# - `minecart bench` v10 at an empty context: 9B Q8_0 279.2 tokens/s (3.582 ms), Q4_K 376.2 (2.658 ms);
#   at 16K context (f16 cache): 271.3 and 339.9; 35B-A3B Q4_K 323.1 (3.095 ms);
# - tools/plan_vs_measured.py v10 (9B Q4_K cut to 8 layers, ~1K context): 1.35x the old bytes-only
#   prediction (1 device; 2 and 3 logical devices 1.35 / 1.33: the extra stages cost almost nothing).
NCU_TO_GRAPH = 2.39 / 2.80
# Host time per decoded token outside the GPU: Python around the graph launch, the logits' copy and the
# sampler. The profile's replay loop: 2.65 ms wall for 2.39 ms GPU (0.26 ms); the 8-layer run implies
# ~0.17 ms (its 0.866 ms a token less its kernels). 0.20 ms sits between the two: each within 4%.
HOST_SECONDS_PER_TOKEN = 0.20e-3
# What the head's device sends the sampler each token: the default settings' top-k logits, values and
# ids (engine/sampling.py TopLogits: 8 bytes each, a few microseconds even behind a Gen1 x1 riser),
# not the vocabulary's row (1 MB for Qwen3.5: 4 ms over Gen1 x1), which only top-k off or penalties
# that can raise a logit still need.
SAMPLED_LOGITS = SamplingParams().top_k
# Each further stage of a split decode: one more graph launch and event, issued while the previous
# stage runs (engine/execution.py), so only what the crossing itself costs (its link's latency and
# bytes, priced with the links) adds to the token: the 8-layer rows lost 0-1.5% with 2-3 stages.
HOST_SECONDS_PER_STAGE = 0.0
# GEMVs: t = latency + bytes / (bandwidth x efficiency), one term per launch (a weight group of fused
# projections is one launch). Q8_0-style formats (gemv_dp4a; Q4_0 and the other 32-value block formats
# share its layout): 4096x4096 Q8_0 (17.8 MB) 4.88 us and 12288x4096 (53.5 MB) 14.33 us in isolation give
# a ~0.15 us latency; in the whole step the 129 GEMVs take 3.582 - 0.20 (host) - 0.81 (small kernels,
# below) = 2.57 ms for 8.43 GB: 3.30 TB/s = 0.69 of spec. K-quants (gemv_kq over the repacked layout):
# the profile's 129 gemv_kq take 1850 x 0.854 = 1.58 ms for 4.46 GB; their 4096-row shapes are
# latency-bound (9.4 MB in ~5.2 us: 47% of copy) while the wide ones reach 81-109% of copy, which
# a 3 us latency per launch and 0.78 of spec reproduce (129 x 3 us + 4.46 GB / 3.74 TB/s = 1.58 ms).
# Q4_K since its streaming GEMV (gemv_kq_stream, 2026-12-02; bench_gemv: 4096x4096 4.6 us, 24576x4096
# 17.2 us, the step's 129 GEMVs 1.451 ms): the same 0.78 of spec with a 2.1 us latency (129 x 2.1 us +
# 1.193 ms = 1.464 ms). Q8_0-style formats since their streaming GEMV (v19, bench_gemv --multi, the
# step's 129 GEMVs 2.286-2.310 ms for 8.43 GB: 0.77 of spec with the 0.15 us latency).
GEMV_EFFICIENCY = {"Q8_0": 0.77, "Q4_0": 0.77, "Q4_1": 0.77, "Q5_0": 0.77, "Q5_1": 0.77, "IQ4_NL": 0.77,
                   "F16": 0.77, "BF16": 0.77, "F32": 0.77}
GEMV_EFFICIENCY_OTHER = 0.78  # K-quants, IQ4_XS: the repacked layout's kernels
GEMV_LATENCY = {k: 0.15e-6 for k in GEMV_EFFICIENCY} | {"Q4_K": 2.1e-6}
GEMV_LATENCY_OTHER = 3.0e-6
# The small kernels of a layer, latency in seconds at the profile's figures (ncu mean x 0.854), the
# bytes they move priced apart (SMALL_KERNEL_EFFICIENCY): rms_norm_q8 (the norm and the activations'
# q8_1 quantization) 6.85 us -> 5.85 us, two per layer and one before the head; swiglu_q8 3.10 -> 2.65
# us per dense FFN; gdn_decode 10.52 -> 8.98 us, of which its 2.2 MB recurrent state read and written
# back is 1.83 us at 0.5 of 4.8 TB/s: 7.15 us of latency; flash_decode 7.83 -> 6.69 us at an empty
# context (its KV read priced by KV_DECODE_EFFICIENCY), attn_merge_gate 5.51 -> 4.71, attn_prep 5.30 ->
# 4.53; embed_rows 4.70 -> 4.01. A GDN layer: 23.3 us; an attention layer: 30.3 us. The norm since it is
# spread over the card (v18): 1.46 us a launch inside the 9B decode graph (tools/profile_decode.py
# --ablate: 0.095 ms for 65 launches). gdn_decode since its block-per-head form (v30): 9.6 -> 6.8 us a
# launch with its states evicted first (tools/bench_gdn_decode.py), so 8.98 -> 6.36 us at the profile's
# figures, of which the state traffic is still 1.83 us: 4.53 us of latency.
NORM_SECONDS = 1.46e-6
SWIGLU_SECONDS = 3.10e-6 * NCU_TO_GRAPH
MIXER_SECONDS = {"gdn": 4.53e-6,
                 "attention": (7.83e-6 + 5.51e-6 + 5.30e-6) * NCU_TO_GRAPH,
                 "sliding": (7.83e-6 + 5.51e-6 + 5.30e-6) * NCU_TO_GRAPH}
EMBED_SECONDS = 4.70e-6 * NCU_TO_GRAPH
SMALL_KERNEL_EFFICIENCY = 0.50  # recurrent state traffic (gdn_decode), of spec bandwidth
# A layer's routed experts in decode (moe.cu's decode block: moe_gate_up_q8 with the SwiGLU, then
# moe_down_sum with the weighted sum): 2 launches at ~2.5 us each, and the used experts' bytes.
# 35B-A3B Q4_K decodes 432.9 tokens/s (2.310 ms; `minecart bench`, 2026-12-02, logits kept on the
# card); the rest of the model predicts 1.876 ms and the 40 MoE layers' launches 0.20 ms, which leaves
# 0.234 ms for the 8 of 256 experts' 566 MB of Q4_K a token: 0.50 of spec bandwidth. (v10, before the
# decode block: 323.1 tokens/s with 4 launches at ~4 us and 0.28.) Refitted with the spread norm (v19):
# 472.1 tokens/s (2.118 ms), the rest of the model 1.720 ms, 0.398 ms for the 566 MB: 0.30 of spec (the
# 0.50 had absorbed the old norm price, fitted on the 9B's 4096-wide rows, where the 35B's are 2048).
# Refitted with the parallel routing in moe_dec_gate_up (v22): 518.0 tokens/s (mean of 512.4 and 523.5;
# 1.931 ms), 0.211 ms for the 566 MB: 0.55 of spec. What the routing removed was latency (warp 0's
# serial loads and argmaxes), so this constant is a fit of the H200's step, not a bandwidth share.
MOE_DECODE_SECONDS = 2 * 2.5e-6
EXPERT_DECODE_EFFICIENCY = 0.55
# Attention's read of the KV cache in decode, of spec bandwidth, by cache type: flash_decode at 16K
# context beyond 1,000 keys (n_kv 4, D 256; tools/bench_decode_attention.py, docs/BENCHMARKS.md v20): f16
# 37.79 - 12.28 us for 63.0 MB (2.47 TB/s: 0.51), q8_0 44.97 - 13.14 us for 33.5 MB (1.05 TB/s: 0.22);
# f32 65 us for 134 MB beyond 6.7 us (v10, the kernel before: 0.48); q3 not measured since its rewrite
# (the earlier fused figure, 0.17).
KV_DECODE_EFFICIENCY = {"f32": 0.48, "f16": 0.51, "q8_0": 0.22, "q3": 0.17}
# The CPU (NumPy backend) reads its float32 weights with BLAS: bytes only, at CPU_DECODE_EFFICIENCY;
# routed experts held in host RAM run on the integer kernels of engine/cpu_experts.py for each token,
# priced by their active bytes against CPU_SPEED's bandwidth:
# - a GPU layer's experts in host RAM (decode, and the tokens of a prefill chunk that is not streamed)
#   are served by the expert pool's threads (engine/expert_pool.py; one kernel in the GPU's decode graph
#   posts the call) at POOL_EXPERT_DECODE_EFFICIENCY, plus HOST_EXPERT_LAYER_SECONDS for each layer's
#   round trip. Measured on the H200's 16-core host (2026-12-03, docs/BENCHMARKS.md v24; 35B-A3B Q4_K,
#   30 of 40 layers' experts in host RAM, 16 threads, `minecart bench` 90.4 / 87.0 tokens/s with the
#   threads taking from each other's runs): the pool's own clock served a token's 424.8 MB of active
#   experts in 8.31 / 8.42 ms (50.8 GB/s: 4.23 x CPU_SPEED's one-core 12 GB/s), and the GPU's stamps of
#   its calls put the round trip beside the experts at 0.10 ms a token posting the rows, 0.05 reading
#   them back and 0.13-0.14 between the pool's answer and the GPU seeing it: 0.0095 ms a layer. (Before:
#   0.063 ms a layer, which held the pool's barrier waits, and 0.20 ms with a host function: v23.)
# - a CPU layer's own experts (a model on the CPU) run on the one-call kernel at
#   CPU_EXPERT_DECODE_EFFICIENCY: measured on the same host (2026-12-02 04:10, docs/BENCHMARKS.md v13)
#   at ~33.7 GB/s, 2.81 x 12 GB/s. (v12, before the GPU routed and the kernels' fixed cost was cut:
#   0.74; before that a guess, 0.036.) Both scale with the threads a machine gives.
CPU_DECODE_EFFICIENCY = 0.50
# Beside a GPU (a plan that prices weights as stored), the CPU's layers keep the integer kernels' types as
# the file stores them and decode on engine/cpu_experts.py's dense_matmul: their bytes at these
# efficiencies; other types are float32 copies (4 bytes a value) at CPU_DECODE_EFFICIENCY. Measured on
# the 2-core CI machine with one thread (2026-12-05, docs/BENCHMARKS.md v36, after the one-row kernels
# began to prefetch): `tests/load/bench_batch_decode.py --weights stored` on 0.8B-shaped synth files
# decoded 21.4 tokens/s on Q8_0 (799 MB of matrices) and 17.6 on Q4_K (423 MB); less CPU_LAYER_SECONDS
# that is 21.5 and 9.0 GB/s. The other types from the kernel alone on 24 3584 x 1024 matrices in turn:
# Q6_K 13.0, Q4_0 10.3, Q5_0 8.4, Q5_K 8.6, Q4_1 7.8, Q5_1 6.6, IQ4_NL 8.6, IQ4_XS 9.2 GB/s (Q8_0 and Q4_K
# there: 17.1 and 9.1). v35's rates, before the prefetch, were 0.50-0.73x these.
CPU_INT_DECODE_EFFICIENCY = {"Q8_0": 1.79, "Q4_K": 0.75, "Q6_K": 1.08, "Q4_0": 0.86, "Q5_0": 0.70, "Q5_K": 0.72,
                             "Q4_1": 0.65, "Q5_1": 0.55, "IQ4_NL": 0.72, "IQ4_XS": 0.77}
CPU_EXPERT_DECODE_EFFICIENCY = 2.81
POOL_EXPERT_DECODE_EFFICIENCY = 4.23
HOST_EXPERT_LAYER_SECONDS = 0.0095e-3
# ... plus a fixed time per layer and token: the NumPy backend's ~25 array operations of a layer, each
# with its Python and dispatch overhead whatever the model's size. Measured on the 2-core CI machine
# (2026-12-01, `minecart bench --shape tiny-dense --quant q8_0 --device cpu:0`): 269.2 tokens/s =
# 3.71 ms a token, of which the 8.7 MB head's read is ~0.35 ms: 0.42 ms for each of its 8 layers.
# Without it a tiny model's layers looked faster on the CPU than on any GPU.
CPU_LAYER_SECONDS = 0.40e-3


@dataclass(frozen=True)
class SpeedPrediction:
    """Predicted tokens/s of a plan. decode: one token after an empty context; decode_at_context: one
    token with the whole planned context in the KV cache; prefill: a prompt of `prompt` tokens, chunks
    pipelined over the devices; prefill_one_gpu: the same when the devices are logical ones sharing a
    GPU (engine/rig.py), whose compute cannot overlap (their links still do). per_device / links:
    seconds per decoded token spent on each device and on the links."""

    decode_tokens_per_s: float
    decode_at_context_tokens_per_s: float
    prefill_tokens_per_s: float
    prefill_one_gpu_tokens_per_s: float
    prompt: int
    per_device: dict[str, float]
    links: float


def _is_cpu(name: str) -> bool:
    return name.startswith("cpu:")


def _speed_of(spec: DeviceSpec | None, name: str) -> DeviceSpeed:
    if spec is not None and spec.speed is not None:
        return spec.speed
    return CPU_SPEED if _is_cpu(name) else UNKNOWN_GPU


def link_of(spec: DeviceSpec | None) -> Link:
    """The link a device is priced behind: its own, else DEFAULT_LINK."""
    return spec.link if spec is not None and spec.link is not None else DEFAULT_LINK


def _gemv_launches(p: PartCost, skip: Collection[str]) -> list[tuple[str, int]]:
    """(GGML type, bytes) of each GEMV launch a decode token makes in `p`, the tensors in `skip` left
    out: a weight group (PartCost.fused) is one launch over all its members' bytes."""
    held = {name: (kind, b) for name, kind, b, _ in p.matmuls if name not in skip}
    out = []
    for g in p.fused:
        members = [n for n in g if n in held]
        if members:
            out.append((held[members[0]][0], sum(held[n][1] for n in members)))
            for n in members:
                del held[n]
    out += list(held.values())
    return out


def _cpu_matmul_seconds(p: PartCost, skip: Collection[str], bw: float) -> float:
    """Seconds of one decode token's matmuls of `p` on the CPU (the tensors in `skip` left out): as
    stored on the integer kernels (CPU_INT_DECODE_EFFICIENCY), else float32 bytes (layout "numpy", or a
    type those kernels do not take) at CPU_DECODE_EFFICIENCY."""
    t = 0.0
    for name, kind, b, values in p.matmuls:
        if name in skip:
            continue
        eff = CPU_INT_DECODE_EFFICIENCY.get(kind)
        t += b / (bw * eff) if eff is not None else 4 * values / (bw * CPU_DECODE_EFFICIENCY)
    return t


def _decode_seconds(parts: Sequence[PartCost], speed: DeviceSpeed, context: int, kv_type: str,
                    experts_here: bool | None, cpu: bool = False) -> float:
    """Seconds one decoded token spends on a device holding `parts` (the kernel chain of the comments
    above; `cpu`: the NumPy backend, bytes only). experts_here: None = the parts' own experts are here;
    True = only experts (the experts' device); False = the parts without their experts."""
    t = 0.0
    bw = speed.bandwidth
    kv_per_value = _kv_bytes_per_value(kv_type)
    for p in parts:
        experts = set(p.experts)
        if experts_here is not False and experts:
            used = _expert_bytes_per_token(p)
            t += host_expert_seconds(used, speed, pool=experts_here is True) if cpu else \
                used / (bw * EXPERT_DECODE_EFFICIENCY)
            if not cpu:
                t += MOE_DECODE_SECONDS
            elif experts_here is True:  # a GPU layer's experts in host RAM: its round trip
                t += HOST_EXPERT_LAYER_SECONDS
        if experts_here is True:
            continue
        if cpu:
            t += _cpu_matmul_seconds(p, experts, bw)
        else:
            for kind, b in _gemv_launches(p, experts):
                t += GEMV_LATENCY.get(kind, GEMV_LATENCY_OTHER) + b / (bw * GEMV_EFFICIENCY.get(kind, GEMV_EFFICIENCY_OTHER))
        # the KV rows attention reads and the recurrent state read and written back
        kv = p.kv_values_per_token * context * kv_per_value
        state = 2 * p.state_bytes
        if cpu:
            t += (kv + state) / (bw * CPU_DECODE_EFFICIENCY)
            t += CPU_LAYER_SECONDS if p.kind not in ("embedding", "head") else 0.0
            continue
        t += kv / (bw * KV_DECODE_EFFICIENCY.get(_saved_kv_type(kv_type), KV_DECODE_EFFICIENCY["q3"]))
        t += state / (bw * SMALL_KERNEL_EFFICIENCY)
        if p.kind == "embedding":
            t += EMBED_SECONDS
        elif p.kind == "head":
            t += NORM_SECONDS
        else:
            ffns = sum(1 for name, *_ in p.matmuls if "ffn_down" in name and name not in experts)
            t += 2 * NORM_SECONDS + ffns * SWIGLU_SECONDS + MIXER_SECONDS.get(p.kind, MIXER_SECONDS["attention"])
    return t


# A floor per layer and prefill chunk, whatever its size: the ~20 kernel launches of a layer's prefill
# step (about twice a fused decode step's 9-10, docs/kernels.md), each a few microseconds at least.
# Without it a small model's predicted prefill ran into millions of tokens/s.
PREFILL_LAYER_SECONDS = 50e-6


def _prefill_seconds(parts: Sequence[PartCost], speed: DeviceSpeed, tokens: int,
                     experts_here: bool | None) -> float:
    """Seconds a device spends on `tokens` prompt tokens: the matmuls' operations at its int8 (or fp32)
    rate, or reading the weights once, whichever is longer, plus each layer's launch floor (not for
    routed experts priced on their own). The LM head runs for the last row only."""
    ops_t = read_t = 0.0
    layers = 0
    for p in parts:
        if p.kind == "head":
            continue
        if p.kind != "embedding" and experts_here is not True:
            layers += 1
        experts = set(p.experts)
        for name, kind, held, values in p.matmuls:
            is_expert = name in experts
            if experts_here is True and not is_expert or experts_here is False and is_expert:
                continue
            frac = p.expert_fraction if is_expert else 1.0
            rate = speed.fp32_flops if kind in FLOAT_TYPES or speed.int8_ops <= 0 else speed.int8_ops
            eff = EXPERT_PREFILL_EFFICIENCY if is_expert else PREFILL_EFFICIENCY.get(kind, PREFILL_EFFICIENCY_OTHER)
            ops_t += 2.0 * values * frac * tokens / (rate * eff)
            read_t += held / speed.bandwidth
    return max(ops_t, read_t) + layers * PREFILL_LAYER_SECONDS


def _expert_bytes_per_token(part: PartCost) -> float:
    """Bytes of `part`'s routed experts one token reads (its used fraction of the stacks)."""
    experts = set(part.experts)
    return sum(held for name, _, held, _ in part.matmuls if name in experts) * part.expert_fraction


def host_expert_seconds(used_bytes: float, cpu: DeviceSpeed = CPU_SPEED, pool: bool = True) -> float:
    """Seconds the CPU's integer expert kernels (engine/cpu_experts.py) spend on one token's routed
    experts of `used_bytes` in host RAM: a decode token's, and each token of a GPU's prefill chunk that
    is not streamed (those run one after another on the same kernels, engine/experts.py). pool: a GPU
    layer's experts, served by the expert pool (POOL_EXPERT_DECODE_EFFICIENCY of the CPU's bandwidth);
    False: a CPU layer's own, on the one-call kernel (CPU_EXPERT_DECODE_EFFICIENCY)."""
    return used_bytes / (cpu.bandwidth * (POOL_EXPERT_DECODE_EFFICIENCY if pool else CPU_EXPERT_DECODE_EFFICIENCY))


def stream_min_tokens(part: PartCost, link: Link, cpu: DeviceSpeed = CPU_SPEED) -> int:
    """The fewest tokens of a prefill chunk for which copying `part`'s routed experts over `link`
    to its GPU is quicker than running the chunk's tokens through them on the CPU's integer kernels,
    one after another (host_expert_seconds a token)."""
    return stream_min_tokens_for(part.expert_bytes, host_expert_seconds(_expert_bytes_per_token(part), cpu),
                                 link)


def _plan_stream_min_tokens(plan: Placement, part: PartCost, by_name: Mapping[str, DeviceSpec]) -> int:
    """stream_min_tokens of a GPU layer whose experts `plan` keeps in host RAM, with the GPU's link and
    the experts' device's speed as `devices` describe them."""
    edev = plan.experts[part.name]
    return stream_min_tokens(part, link_of(by_name.get(plan.device_of(part.name))),
                             _speed_of(by_name.get(edev), edev))


def expert_stream_min_tokens(plan: Placement, device: str, devices: Sequence[DeviceSpec]) -> int | None:
    """The fewest tokens of a prefill run from which GPU `device` streams every layer's host-RAM experts
    (the largest of its layers' stream_min_tokens, as predict_speed decides them); None when it holds no
    such layer."""
    by_name = {d.name: d for d in devices}
    return max((_plan_stream_min_tokens(plan, p, by_name) for p in plan.streamed_parts(device)), default=None)


def stream_min_tokens_for(expert_bytes: int, cpu_seconds_per_token: float, link: Link) -> int:
    """The same from the numbers: a layer's expert bytes (as the GPU holds them) and the seconds the
    CPU spends per token on that layer's experts. Copy seconds / CPU seconds per token, rounded up."""
    if cpu_seconds_per_token <= 0:
        return 1 << 30  # nothing to gain: never stream
    return max(1, math.ceil(link.seconds(expert_bytes) / cpu_seconds_per_token))


def predict_speed(plan: Placement, devices: Sequence[DeviceSpec] = (), *, prompt: int | None = None,
                  logits_over_link: bool = True, sampled_logits: int = SAMPLED_LOGITS) -> SpeedPrediction:
    """Predicted decode and prefill tokens/s of `plan` on `devices` (their speed and link; a device
    without them is priced as UNKNOWN_GPU / CPU_SPEED behind DEFAULT_LINK).

    Model: a decoded token is a chain of kernels on each device (the comments above the constants):
    each GEMV launch its bytes at the card's bandwidth times GEMV_EFFICIENCY plus a fixed latency, each
    layer's small kernels their latency plus the KV rows and recurrent state they move, the routed
    experts' used fraction; plus the host's time per token; devices run one after another; each crossing copies the hidden state (fp32) device -> host -> device over both
    cards' links, and the head's device sends the sampler its `sampled_logits` largest logits (values
    and ids; 0: the whole row) over its link. Prefill runs chunks of plan.chunk tokens through the
    devices as a pipeline (the slowest stage sets the pace once full). logits_over_link=False leaves
    that copy out (engine/rig.py's emulated links do not charge it in graph decode; a real riser does).
    """
    by_name = {d.name: d for d in devices}
    kv_type = plan.kv_type
    hidden_bytes = 4 * plan.costs.hidden
    prompt = min(plan.context, PREFILL_PROMPT) if prompt is None else max(1, prompt)
    chunk = min(plan.chunk, prompt)
    apart_parts = plan.expert_parts()
    segs = plan.segments()
    decode0: dict[str, float] = {}
    decode_ctx = 0.0
    stages: list[float] = []  # seconds per prefill chunk of each pipeline stage: the cards, and the crossings between them
    compute: list[float] = []  # ... of the cards alone
    # A GPU layer's host-held experts are streamed to the GPU for a prefill chunk long enough
    # (stream_min_tokens): the GPU computes them while the link copies the next layer's.
    streamed: list[PartCost] = []
    stream_gpu: dict[str, float] = {}  # GPU -> seconds a chunk computes its streamed experts
    stream_copy: dict[str, float] = {}  # GPU -> seconds its link copies them, per chunk
    for p in apart_parts:
        gdev, edev = plan.device_of(p.name), plan.experts[p.name]
        gspec = by_name.get(gdev)
        if not (gdev.startswith("cuda:") and edev.startswith("cpu:")) or \
                chunk < _plan_stream_min_tokens(plan, p, by_name):
            continue
        streamed.append(p)
        stream_gpu[gdev] = stream_gpu.get(gdev, 0.0) + _prefill_seconds([p], _speed_of(gspec, gdev), chunk, True)
        stream_copy[gdev] = stream_copy.get(gdev, 0.0) + link_of(gspec).seconds(p.expert_bytes)
    for k, seg in enumerate(segs):
        spec = by_name.get(seg.device)
        speed = _speed_of(spec, seg.device)
        parts = plan.costs.parts[seg.start:seg.stop]
        # a layer whose experts sit apart is priced without them here (they are priced where they are)
        groups = [(g, mode) for g, mode in (([p for p in parts if p not in apart_parts], None),
                                            ([p for p in parts if p in apart_parts], False)) if g]
        decode0[seg.device] = decode0.get(seg.device, 0.0) + sum(
            _decode_seconds(g, speed, 0, kv_type, mode, _is_cpu(seg.device)) for g, mode in groups)
        decode_ctx += sum(_decode_seconds(g, speed, plan.context, kv_type, mode, _is_cpu(seg.device))
                          for g, mode in groups)
        stage = sum(_prefill_seconds(g, speed, chunk, mode) for g, mode in groups)
        if seg.device in stream_gpu:  # once per GPU: its streamed experts, the copies overlapping
            stage = max(stage + stream_gpu.pop(seg.device), stream_copy[seg.device])
        compute.append(stage)
        stages.append(stage)
        if k < len(segs) - 1:
            # the chunk's hidden state crosses to the next card (down this card's link, up the next
            # one's) on the bridge's own thread while both cards compute other chunks: a pipeline
            # stage of its own (engine/execution.py HostBridge)
            nxt = by_name.get(segs[k + 1].device)
            stages.append(link_of(spec).seconds(chunk * hidden_bytes) + link_of(nxt).seconds(chunk * hidden_bytes))
    for dev in dict.fromkeys(plan.experts[p.name] for p in apart_parts):
        spec = by_name.get(dev)
        speed = _speed_of(spec, dev)
        experts = [p for p in apart_parts if plan.experts[p.name] == dev]
        t = _decode_seconds(experts, speed, 0, kv_type, True, _is_cpu(dev))
        decode0[dev] = decode0.get(dev, 0.0) + t
        decode_ctx += t
        # each layer's FFN input goes to the experts' device and its output comes back, over the
        # layer's card's link and (for a GPU holding the experts) that card's link too
        def hop(p: PartCost, n_bytes: int, dev: str = dev, spec: DeviceSpec | None = spec) -> float:
            there = 0.0 if _is_cpu(dev) else link_of(spec).seconds(n_bytes)
            return 2 * (link_of(by_name.get(plan.device_of(p.name))).seconds(n_bytes) + there)

        hops_s = sum(hop(p, hidden_bytes) for p in experts)
        decode0[dev] += hops_s
        decode_ctx += hops_s
        on_dev = [p for p in experts if p not in streamed]  # the rest prefill where they are
        if on_dev:
            # a GPU layer's experts in host RAM run a chunk's tokens one after another on the integer
            # kernels, in one round trip; elsewhere (another GPU, or beside CPU layers) as a prefill
            one_by_one = [p for p in on_dev if _is_cpu(dev) and plan.device_of(p.name).startswith("cuda:")]
            rest = [p for p in on_dev if p not in one_by_one]
            compute.append(sum(chunk * host_expert_seconds(_expert_bytes_per_token(p), speed)
                               + HOST_EXPERT_LAYER_SECONDS for p in one_by_one)
                           + (_prefill_seconds(rest, speed, chunk, True) if rest else 0.0))
            stages.append(compute[-1] + sum(hop(p, chunk * hidden_bytes) for p in on_dev))
    links = 0.0
    for a, b in zip(segs, segs[1:], strict=False):
        links += link_of(by_name.get(a.device)).seconds(hidden_bytes) + link_of(by_name.get(b.device)).seconds(hidden_bytes)
    if logits_over_link:  # to the sampler: its top logits, or the whole row
        n_bytes = 8 * sampled_logits if sampled_logits else 4 * plan.costs.vocab
        links += link_of(by_name.get(segs[-1].device)).seconds(n_bytes)
    # the host's time around the graphs: once a token, and a launch for each further stage
    host = HOST_SECONDS_PER_TOKEN + HOST_SECONDS_PER_STAGE * (len(segs) - 1)
    t0 = sum(decode0.values()) + links + host
    t_ctx = decode_ctx + links + host
    n_chunks = -(-prompt // chunk)
    t_prefill = sum(stages) + (n_chunks - 1) * max(stages)
    t_one_gpu = max(t_prefill, n_chunks * sum(compute))
    return SpeedPrediction(decode_tokens_per_s=1.0 / t0, decode_at_context_tokens_per_s=1.0 / t_ctx,
                           prefill_tokens_per_s=prompt / t_prefill,
                           prefill_one_gpu_tokens_per_s=prompt / t_one_gpu, prompt=prompt,
                           per_device=decode0, links=links)


def fits(plan: Placement, devices: Sequence[DeviceSpec], *, reserve: int = 256 * MiB) -> bool:
    """Every device the plan uses is present and has its estimate plus `reserve` free."""
    by_name = {d.name: d for d in devices}
    for dev, b in plan.bytes_per_device().items():
        if dev not in by_name or b.total + reserve > by_name[dev].free_bytes:
            return False
    return True


def max_context(plan: Placement, devices: Sequence[DeviceSpec], *, reserve: int = 256 * MiB) -> int:
    """The longest context this assignment fits at its KV type (0 = not even one token), capped at the
    model's trained context when known. The estimate grows with the context: linearly (the KV
    cache) except where the load-time staging peak covers the growth, so a straight-line guess
    from two contexts is checked (two estimates when it holds) and otherwise bisected."""
    cap = plan.costs.context_length or 1 << 24
    by_name = {d.name: d for d in devices}
    lo_c, hi_c = 1024, 2048
    a = plan.with_settings(context=lo_c).bytes_per_device()
    b = plan.with_settings(context=hi_c).bytes_per_device()
    guess = cap
    for dev in a:
        if dev not in by_name:
            return 0
        slope = (b[dev].total - a[dev].total) / (hi_c - lo_c)
        if slope > 0:
            room = by_name[dev].free_bytes - reserve - (a[dev].total - slope * lo_c)
            guess = min(guess, max(0, int(room // slope)))

    def ok(c: int) -> bool:
        return c >= 1 and fits(plan.with_settings(context=c), devices, reserve=reserve)

    guess = max(0, min(guess, cap))
    if ok(guess) and (guess == cap or not ok(guess + 1)):
        return guess
    lo, hi = (guess, cap + 1) if ok(guess) else (0, guess)  # ok(lo) or lo == 0; not ok(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _fill_split(item: Sequence[int], names: Sequence[str], usable: Sequence[int]) -> list[str]:
    """Contiguous split that fills each device in turn to its usable bytes (the last takes the rest);
    devices left without a part are not used."""
    assignment: list[str] = []
    k, used = 0, 0
    for c in item:
        while k < len(names) - 1 and used + c > usable[k]:
            k, used = k + 1, 0
        assignment.append(names[k])
        used += c
    return assignment


def _orders(devices: Sequence[DeviceSpec]) -> list[tuple[DeviceSpec, ...]]:
    """Device orders to try: every order of up to five devices; beyond that the given order and the
    orders by speed, by memory and by both (permutations of eight cards would be 40,320 plans)."""
    import itertools

    if len(devices) <= 5:
        return list(itertools.permutations(devices))

    def bw(d: DeviceSpec) -> float:
        return _speed_of(d, d.name).bandwidth

    keys = (lambda d: -bw(d), lambda d: -d.free_bytes, lambda d: -bw(d) * d.free_bytes)
    return [tuple(devices)] + [tuple(sorted(devices, key=k)) for k in keys]


@dataclass(frozen=True)
class PlanChoice:
    """A plan plan_auto considered: the placement, whether it fits, its predicted speed and the longest
    context its assignment fits."""

    plan: Placement
    fits: bool
    speed: SpeedPrediction
    max_context: int


def plan_candidates(costs: ModelCosts, devices: Sequence[DeviceSpec], *, context: int, chunk: int = 512,
                    kv_type: str = DEFAULT_KV_TYPE, reserve: int = 256 * MiB, n_sequences: int = 1,
                    cuda_context_bytes: int = CUDA_CONTEXT_BYTES, experts_device: str = "",
                    experts: Mapping[str, str] | None = None) -> list[PlanChoice]:
    """Every distinct contiguous plan of the speed-aware search, best first: fitting plans before the
    rest, then the fastest decode (plans within SAME_SPEED of each other count as equal), then the
    longest context that fits, then the fastest prefill. Candidates: for each device order, the
    proportional split (free memory) and the fill-in-turn split, over all devices and over each
    leading subset of the order. experts_device / experts: routed experts apart from their layers,
    every MoE layer's on one device / a per-layer map (Placement.experts)."""
    def placement(assignment: list[str]) -> Placement:
        return Placement(costs, assignment, context=context, chunk=chunk, kv_type=kv_type,
                         n_sequences=n_sequences, cuda_context_bytes=cuda_context_bytes,
                         experts=experts, experts_device=experts_device)

    probe = placement([devices[0].name] * len(costs.parts))
    moved = {n for p in probe.expert_parts() for n in p.experts}
    item = _split_items(costs, context, kv_type, n_sequences, moved)
    whole = probe.bytes_per_device()[devices[0].name]
    scratch = whole.activations - whole.staging
    seen: set[tuple[str, ...]] = set()
    out: list[PlanChoice] = []
    for order in _orders(devices):
        for n_use in range(1, len(order) + 1):
            use = order[:n_use]
            names = [d.name for d in use]
            usable = [max(0, d.free_bytes - reserve - device_overhead(d.name, cuda_context_bytes) - scratch)
                      for d in use]
            splits = [_fill_split(item, names, usable)]
            if n_use > 1 and sum(usable) > 0:
                splits.append(_proportional_split(item, names, usable))
            for assignment in splits:
                key = tuple(assignment)
                if key in seen:
                    continue
                seen.add(key)
                plan = placement(assignment)
                if sum(usable) > 0:
                    _relieve(plan, {d.name: d.free_bytes - reserve for d in use})
                out.append(PlanChoice(plan, fits(plan, devices, reserve=reserve), predict_speed(plan, devices),
                                      max_context(plan, devices, reserve=reserve)))
    fastest = max((c.speed.decode_tokens_per_s for c in out if c.fits), default=0.0)

    def rank(c: PlanChoice) -> tuple:
        same = c.fits and c.speed.decode_tokens_per_s >= (1 - SAME_SPEED) * fastest
        return (not c.fits, not same, -c.max_context if same else -c.speed.decode_tokens_per_s,
                -c.speed.decode_tokens_per_s, -c.speed.prefill_tokens_per_s)

    out.sort(key=rank)
    return out
