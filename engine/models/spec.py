"""The architecture spec: what a GGUF file of one architecture holds, described once, as data.

What this is: `ModelConfig` (the hyper-parameters, one frozen dataclass for every architecture), the
layer kinds, and `ArchSpec`, the typed and frozen description that each model file fills in: how its
metadata becomes a ModelConfig, every tensor (GGUF name, shape as a function of the config,
Backend.load_weight role, how `minecart synth` fills it), which tensors a layer of each kind has, the
layouts a file may choose (fused gate/up experts, a shared expert or none, a separate or tied LM head),
which projections read one input (the loader lays each such group out as one array), and what each layer costs in state and activations.
Everything else is derived from it here: `ModelConfig.from_gguf`, `validate_tensors` (every needed
tensor present with the shape the metadata implies), `tensor_roles` (what the loader reads, per part),
`plan` (the file's tensors in converter order, for engine/synth.py and for pricing a shape without a
file in engine/placement.py).

What this is not: the forward pass (the functions of the model file), the placement arithmetic
(engine/placement.py), or a file writer (engine/synth.py). No numpy, no device, no file bytes.

Adding an architecture: copy the nearest model file, name it after `general.architecture`, fill its
`SPEC`, and register the name in engine/models/__init__.py.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from ..errors import (
    GGUFError,
    MissingTensorError,
    ShapeMismatchError,
    UnsupportedArchitectureError,
)

# layer kinds
GDN = "gdn"  # Gated DeltaNet (linear attention, recurrent state)
ATTN = "attention"  # full causal attention (KV cache)
SLIDING = "sliding"  # sliding-window attention (gemma3 local layers)

KIND_WORDS = {GDN: "Gated DeltaNet", ATTN: "full attention", SLIDING: "sliding-window attention"}

# Backend.load_weight roles
EMBEDDING, MATMUL, VECTOR, EXPERTS = "embedding", "matmul", "vector", "experts"

# Bounds far beyond any real model: a value outside them means a corrupt or hostile file, and checking
# here keeps e.g. block_count = 2**40 from building a tuple of a trillion layer kinds.
MAX_LAYERS = 4096
MAX_DIM = 1 << 24


@dataclass(frozen=True)
class ModelConfig:
    """The hyper-parameters of a model, read once from GGUF metadata by its architecture's
    `read_config`. One dataclass for every architecture: fields an architecture lacks keep their
    defaults. `layer_types` spells out each main layer's kind (GDN, ATTN, SLIDING)."""

    architecture: str
    name: str
    n_layers: int  # main decoder layers (MTP blocks excluded)
    hidden: int
    vocab_size: int
    context_length: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # attention key length
    value_head_dim: int
    rms_eps: float
    rope_base: float
    rope_dims: int  # rotated dims per head
    layer_types: tuple[str, ...]
    ffn: int = 0  # dense FFN width (0 for MoE)
    tied_embeddings: bool = True
    n_mtp_layers: int = 0
    rope_sections: tuple[int, ...] = ()
    # Gated DeltaNet
    conv_kernel: int = 0
    gdn_key_dim: int = 0  # d_k per head
    gdn_value_dim: int = 0  # d_v per head
    gdn_k_heads: int = 0  # n_k
    gdn_v_heads: int = 0  # n_v
    # MoE
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn: int = 0
    shared_expert_ffn: int = 0
    # gemma3
    sliding_window: int = 0
    rope_base_local: float = 0.0
    rope_scale: float = 1.0  # linear position scaling on global layers
    query_pre_attn_scalar: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_k_heads * self.gdn_key_dim + self.gdn_v_heads * self.gdn_value_dim

    @classmethod
    def from_gguf(cls, gf: GGUFLike) -> ModelConfig:
        """Build from an opened GGUFFile, through the architecture's spec."""
        return spec_for(gf.architecture, gf.path).read_config(gf)


class GGUFLike(Protocol):
    """What the spec reads of a GGUF file: engine/gguf_file.GGUFFile, or a test's stand-in."""

    @property
    def path(self) -> Path: ...

    @property
    def tensors(self) -> Mapping[str, Any]: ...  # name -> tensor info with a `.shape`

    @property
    def architecture(self) -> str: ...

    def get(self, key: str, default: Any = None) -> Any: ...

    def require(self, key: str) -> Any: ...


# ---------------------------------------------------------------------------------------------------
# metadata reading, shared by the architectures' read_config


def meta_int(gf: GGUFLike, key: str, *, lo: int = 1, hi: int = MAX_DIM, default: int | None = None) -> int:
    """An integer metadata value within [lo, hi]; MissingKeyError if absent without a default."""
    value = gf.get(key, default) if default is not None else gf.require(key)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise GGUFError(gf.path, f"value {value!r} is not an integer in [{lo}, {hi}]; the file is corrupt or "
                        "from an incompatible converter: re-convert it", key=key)
    return value


def meta_float(gf: GGUFLike, key: str, default: float | None = None) -> float:
    value = gf.get(key, default) if default is not None else gf.require(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise GGUFError(gf.path, f"value {value!r} is not a positive number; the file is corrupt: "
                        "re-convert it", key=key)
    return float(value)


def meta_list(gf: GGUFLike, key: str, elem_type: type | tuple[type, ...], min_len: int = 0
              ) -> list[Any] | None:
    value = gf.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) < min_len or not all(isinstance(x, elem_type) for x in value):
        kind = elem_type.__name__ if isinstance(elem_type, type) else "/".join(t.__name__ for t in elem_type)
        raise GGUFError(gf.path, f"expected a list of at least {min_len} {kind} values, got "
                        f"{str(value)[:60]}; the file is corrupt: re-convert it", key=key)
    return value


def vocab_size(gf: GGUFLike) -> int:
    """Rows of the token embedding (the tokenizer's length when the file has no embedding)."""
    emb = gf.tensors.get("token_embd.weight")
    if emb is not None:
        return int(emb.shape[0])
    toks = gf.get("tokenizer.ggml.tokens")
    return len(toks) if isinstance(toks, list) else 0


# ---------------------------------------------------------------------------------------------------
# the spec

Shape = tuple[int, ...]
ShapeOf = Callable[[ModelConfig], Shape]

VOCAB_ROWS = "@vocab"  # stands in `keys` for "the vocabulary size", which comes from token_embd's rows


@dataclass(frozen=True)
class Fill:
    """How `minecart synth` fills a tensor with random values (engine/synth.py _float_values):
    "linear", "embed", "normal": N(0, std^2); "norm": 1 + N(0, 0.2^2) (GGUF norms carry the +1);
    "ssm_a": -exp(U), exp(U) log-uniform in [0.02, 4]. With per_fan_in, std is divided by the square
    root of the tensor's last dimension (its input width), then capped at `cap`."""

    init: str = "linear"
    std: float = 0.7
    per_fan_in: bool = True
    cap: float = float("inf")  # the std never exceeds this


NORM = Fill("norm", 1.0, per_fan_in=False)


@dataclass(frozen=True)
class TensorDef:
    """One tensor. `name` is the GGUF name; inside a layer group it follows "blk.{i}."."""

    name: str
    shape: ShapeOf
    role: str  # EMBEDDING, MATMUL, VECTOR or EXPERTS (Backend.load_weight)
    keys: tuple[str, ...]  # metadata keys (after "<arch>.") the shape follows from, for messages
    f32: bool = False  # stored F32 whatever the file's matrix type (norms, conv taps, routers)
    fill: Fill = Fill()
    also: ShapeOf | None = None  # a second accepted shape (a converter variant)
    alt: str = ""  # the tensor that stands in for this one in another layout, for messages


@dataclass(frozen=True)
class Group:
    """Tensors a layer has when `applies(config, kind, options)`; options are the layout the file
    chose for that layer (ArchSpec.layer_options) plus "mtp" for a multi-token-prediction block."""

    tensors: tuple[TensorDef, ...]
    applies: Callable[[ModelConfig, str, frozenset[str]], bool] = lambda c, kind, opts: True
    # the routed-expert block (router + experts): may live apart from its layer, in the part
    # "layer.<i>.experts" (e.g. in host RAM while the layer runs on a GPU)
    routed: bool = False


@dataclass(frozen=True)
class LayerCosts:
    """What one layer costs wherever it runs (engine/placement.py PartCost has the same fields)."""

    kv_values_per_token: int = 0  # K and V values cached per token
    state_bytes: int = 0  # fixed per-sequence recurrent state
    act_values_per_token: int = 0  # peak live float32 activations per token (outside chunked kernels)
    mixer_values_per_token: int = 0  # live values per token while chunked GDN prefill kernels run
    segment_values_per_token: int = 0  # their scratch per token of one segment


@dataclass(frozen=True)
class ArchSpec:
    """Everything the engine needs to know about an architecture besides its forward pass."""

    architectures: tuple[str, ...]  # GGUF general.architecture values this spec reads
    read_config: Callable[[GGUFLike], ModelConfig]
    global_tensors: tuple[TensorDef, ...]  # the "global" part (token embedding)
    layer_groups: tuple[Group, ...]  # one layer, in the converter's order
    head_tensors: tuple[TensorDef, ...]  # the "head" part; output.weight absent = tied embedding
    layer_costs: Callable[[ModelConfig, str], LayerCosts]
    # layout options of layer i (names of the file's tensors, or None: decide from the config alone)
    layer_options: Callable[[ModelConfig, int, Collection[str] | None], frozenset[str]] = (
        lambda c, i, names: frozenset())
    # consistency of the metadata beyond single keys, checked before any tensor (raises GGUFError)
    check_metadata: Callable[[ModelConfig, GGUFLike], None] = lambda c, gf: None
    # groups of layer tensors that one matmul_many call of the model reads together (names after
    # "blk.{i}."); the loader lays each group out as one array (Backend.load_fused, fused_members)
    fused_groups: tuple[tuple[str, ...], ...] = ()

    # ---- derived -------------------------------------------------------------------------------------
    def layer_kind(self, config: ModelConfig, i: int) -> str:
        """Kind of block i; blocks past the main layers (MTP) are full-attention blocks."""
        return config.layer_types[i] if i < config.n_layers else ATTN

    def layer_tensors(self, config: ModelConfig, i: int, options: frozenset[str]) -> list[TensorDef]:
        kind = self.layer_kind(config, i)
        return [t for g in self.layer_groups if g.applies(config, kind, options) for t in g.tensors]

    def fused_members(self, roles: Mapping[str, str]) -> list[tuple[str, ...]]:
        """The weight groups among one part's tensors ({GGUF name: role}, a tensor_roles entry): for
        each layer and each of fused_groups, its members that the part holds as matmul weights, in the
        group's order, where there are at least two. The loader loads each as one array
        (Backend.load_fused); the model reads them with one matmul_many call."""
        layers: dict[str, None] = {}  # "blk.{i}." prefixes in order of appearance
        for name in roles:
            if name.startswith("blk."):
                layers.setdefault(name[: name.index(".", 4) + 1], None)
        out = []
        for prefix in layers:
            for group in self.fused_groups:
                members = tuple(prefix + t for t in group if roles.get(prefix + t) == MATMUL)
                if len(members) >= 2:
                    out.append(members)
        return out

    def tensor_roles(self, config: ModelConfig, available: Collection[str] | None = None, *,
                     experts_apart: bool = False) -> dict[str, dict[str, str]]:
        """{"global": {name: role}, "layer.<i>": {...}, "head": {...}}: every tensor the forward pass
        reads. `available` (the file's tensor names) picks each layer's layout and tied or separate
        LM head; without it the config decides. experts_apart: each MoE layer's routed-expert block
        (router and experts) in its own part "layer.<i>.experts" instead of the layer's."""
        roles: dict[str, dict[str, str]] = {"global": {t.name: t.role for t in self.global_tensors}}
        for i in range(config.n_layers):
            opts = self.layer_options(config, i, available)
            p = f"blk.{i}."
            kind = self.layer_kind(config, i)
            layer: dict[str, str] = {}
            routed: dict[str, str] = {}
            for g in self.layer_groups:
                if g.applies(config, kind, opts):
                    into = routed if (experts_apart and g.routed) else layer
                    into.update({p + t.name: t.role for t in g.tensors})
            roles[f"layer.{i}"] = layer
            if routed:
                roles[f"layer.{i}.experts"] = routed
        roles["head"] = self.head_roles(config, available)
        return roles

    def head_roles(self, config: ModelConfig, available: Collection[str] | None = None) -> dict[str, str]:
        """The output norm and the LM head, which is the token-embedding table itself when the file has
        no separate `output.weight` (tied; loaded once per device with the "global" part's copy)."""
        tied = config.tied_embeddings if available is None else "output.weight" not in available
        head: dict[str, str] = {}
        for t in self.head_tensors:
            if t.name == "output.weight" and tied:
                head["token_embd.weight"] = EMBEDDING
            else:
                head[t.name] = t.role
        return head

    def plan(self, config: ModelConfig, options: frozenset[str] = frozenset()
             ) -> list[tuple[str, TensorDef]]:
        """(GGUF name, definition) of every tensor of a file with this config, in converter order:
        global, the main layers, head (output.weight only when untied), then the MTP blocks. `options`
        adds layout choices to every layer's own (e.g. "fused_gate_up")."""
        out = [(t.name, t) for t in self.global_tensors]

        def block(i: int, extra: frozenset[str]) -> None:
            opts = self.layer_options(config, i, None) | options | extra
            out.extend((f"blk.{i}.{t.name}", t) for t in self.layer_tensors(config, i, opts))

        for i in range(config.n_layers):
            block(i, frozenset())
        out += [(t.name, t) for t in self.head_tensors
                if t.name != "output.weight" or not config.tied_embeddings]
        for i in range(config.n_layers, config.n_layers + config.n_mtp_layers):
            block(i, frozenset({MTP}))
        return out

    def validate_tensors(self, config: ModelConfig, gf: GGUFLike) -> None:
        """Raise MissingTensorError / ShapeMismatchError (naming the tensor and the metadata keys that
        imply its shape) unless the file holds every tensor `config` needs, each with the right shape.
        Tensors of MTP blocks are optional but checked when present; extra tensors are ignored."""
        self.check_metadata(config, gf)
        tensors = gf.tensors
        arch = config.architecture
        checks: list[tuple[str, TensorDef, str, bool]] = []  # (name, def, what needs it, optional)
        checks += [(t.name, t, _GLOBAL_WORDS.get(t.name, "token embedding"), False)
                   for t in self.global_tensors]
        checks += [(t.name, t, _GLOBAL_WORDS.get(t.name, "LM head"), t.name == "output.weight")
                   for t in self.head_tensors]
        for i in range(config.n_layers + config.n_mtp_layers):
            mtp = i >= config.n_layers
            # the layout the config implies plus the one the file shows (a fused expert tensor)
            opts = self.layer_options(config, i, None) | self.layer_options(config, i, tensors)
            if mtp:
                opts |= {MTP}
                what = f"MTP block {i}"
            else:
                what = f"layer {i} ({KIND_WORDS[self.layer_kind(config, i)]})"
            checks += [(f"blk.{i}.{t.name}", t, what, mtp) for t in self.layer_tensors(config, i, opts)]
        for name, t, what, optional in checks:
            info = tensors.get(name)
            if info is None:
                if optional:
                    continue
                alt = f" (or blk.{name.split('.')[1]}.{t.alt})" if t.alt else ""
                raise MissingTensorError(
                    gf.path,
                    f"required by {arch} {what}{alt} but absent; the file is incomplete, was converted "
                    "for another architecture, or its layer-pattern metadata is wrong: re-convert it with "
                    "a current llama.cpp",
                    tensor=name,
                )
            actual = tuple(int(x) for x in info.shape)
            allowed = [t.shape(config)] + ([t.also(config)] if t.also is not None else [])
            if actual not in allowed:
                why = ", ".join(f"vocabulary rows {config.vocab_size}" if k == VOCAB_ROWS
                                else f"{arch}.{k}={gf.get(f'{arch}.{k}')}" for k in t.keys)
                raise ShapeMismatchError(
                    gf.path,
                    f"{name} has shape {_fmt(actual)}, the metadata ({why}) implies "
                    f"{' or '.join(_fmt(s) for s in allowed)}; the file's metadata and tensors disagree: "
                    "re-convert the model",
                    tensor=name,
                )
        _check_vocab(config, gf)


MTP = "mtp"  # layout option of a multi-token-prediction block
_GLOBAL_WORDS = {"token_embd.weight": "token embedding", "output_norm.weight": "final norm",
                 "output.weight": "LM head"}


def _fmt(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(x) for x in shape) + (",)" if len(shape) == 1 else ")")


def _check_vocab(c: ModelConfig, gf: GGUFLike) -> None:
    tokens = gf.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > c.vocab_size:
        raise ShapeMismatchError(
            gf.path,
            f"token_embd.weight has {c.vocab_size} rows but the tokenizer has {len(tokens)} tokens, so "
            "some token ids have no embedding; the file mixes a tokenizer and weights of different "
            "models: re-convert it",
            tensor="token_embd.weight",
        )


# ---------------------------------------------------------------------------------------------------
# the registry: GGUF general.architecture -> model file of this package

_MODULES = {"qwen35": "qwen35", "qwen35moe": "qwen35", "gemma3": "gemma3"}
SUPPORTED_ARCHITECTURES = tuple(_MODULES)


def module_for(architecture: str, path: Path | str = "") -> ModuleType:
    """The model module of a GGUF architecture name (qwen35moe shares qwen35's file). The import is by
    name because the model files import this module; a file is loaded the first time it is asked for."""
    if architecture not in _MODULES:
        raise UnsupportedArchitectureError(
            path, f"architecture '{architecture}' is not supported; minecart runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}", key="general.architecture")
    return importlib.import_module(f"{__package__}.{_MODULES[architecture]}")


def spec_for(architecture: str, path: Path | str = "") -> ArchSpec:
    spec = module_for(architecture, path).SPEC
    assert isinstance(spec, ArchSpec)
    return spec


# ---------------------------------------------------------------------------------------------------
# cost helpers shared by the architectures' layer_costs


def q8_values(n: int) -> int:
    """float32-equivalent values of the q8_1 copy of n activations (int8 + two fp32 per 32 values,
    1.25 bytes per value), which the CUDA backend keeps beside a matmul input on the DP4A path."""
    return n * 5 // 16


def kv_values_per_token(config: ModelConfig, kind: str) -> int:
    """K and V values an attention layer caches per token: n_kv (d_k + d_v)."""
    return config.n_kv_heads * (config.head_dim + config.value_head_dim) if kind in (ATTN, SLIDING) else 0


def dense_ffn_values(config: ModelConfig) -> int:
    """Peak live values per token of a gate/up/down FFN as the CUDA backend runs it: x, the residual
    sum and the normed input with its q8_1 copy, the gate|up output and its two slices (4 F); then the
    activated product with its q8_1 copy."""
    h, f = config.hidden, config.ffn
    return max(3 * h + q8_values(h) + 4 * f, 3 * h + 3 * f + q8_values(f), 4 * h + 3 * f + q8_values(f))
