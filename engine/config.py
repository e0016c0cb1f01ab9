"""ModelConfig: the hyper-parameters of a model, read once from GGUF metadata.

One frozen dataclass for every supported architecture; fields that an architecture lacks keep their
defaults. A missing required key fails with the key's name (MissingKeyError). Layer kinds are spelled
out per layer in `layer_types` so model code and placement never re-derive them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import (
    GGUFError,
    MissingKeyError,
    MissingTensorError,
    ShapeMismatchError,
    UnsupportedArchitectureError,
)

SUPPORTED_ARCHITECTURES = ("qwen35", "qwen35moe", "gemma3")

# layer kinds
GDN = "gdn"  # Gated DeltaNet (linear attention, recurrent state)
ATTN = "attention"  # full causal attention (KV cache)
SLIDING = "sliding"  # sliding-window attention (gemma3 local layers)


@dataclass(frozen=True)
class ModelConfig:
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
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_k_heads * self.gdn_key_dim + self.gdn_v_heads * self.gdn_value_dim

    @classmethod
    def from_gguf(cls, gf) -> ModelConfig:
        """Build from an opened GGUFFile."""
        arch = gf.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                gf.path,
                f"architecture '{arch}' is not supported; minecart runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}",
                key="general.architecture",
            )
        if arch in ("qwen35", "qwen35moe"):
            return _qwen35(gf, arch)
        return _gemma3(gf)


def _vocab_size(gf) -> int:
    emb = gf.tensors.get("token_embd.weight")
    if emb is not None:
        return int(emb.shape[0])
    toks = gf.get("tokenizer.ggml.tokens")
    return len(toks) if isinstance(toks, list) else 0


# Bounds far beyond any real model: a value outside them means a corrupt or hostile file, and checking
# here keeps e.g. block_count = 2**40 from building a tuple of a trillion layer kinds.
_MAX_LAYERS = 4096
_MAX_DIM = 1 << 24


def _meta_int(gf, key: str, *, lo: int = 1, hi: int = _MAX_DIM, default=None) -> int:
    """An integer metadata value within [lo, hi]; MissingKeyError if absent without a default."""
    value = gf.get(key, default) if default is not None else gf.require(key)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise GGUFError(gf.path, f"value {value!r} is not an integer in [{lo}, {hi}]; the file is corrupt or "
                        "from an incompatible converter: re-convert it", key=key)
    return value


def _meta_float(gf, key: str, default=None) -> float:
    value = gf.get(key, default) if default is not None else gf.require(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise GGUFError(gf.path, f"value {value!r} is not a positive number; the file is corrupt: "
                        "re-convert it", key=key)
    return float(value)


def _meta_list(gf, key: str, elem_type, min_len: int = 0) -> list | None:
    value = gf.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) < min_len or not all(isinstance(x, elem_type) for x in value):
        kind = elem_type.__name__ if isinstance(elem_type, type) else "/".join(t.__name__ for t in elem_type)
        raise GGUFError(gf.path, f"expected a list of at least {min_len} {kind} values, got "
                        f"{str(value)[:60]}; the file is corrupt: re-convert it", key=key)
    return value


def _qwen35(gf, arch: str) -> ModelConfig:
    a = arch
    i = lambda k, **kw: _meta_int(gf, f"{a}.{k}", **kw)  # noqa: E731
    block_count = i("block_count", lo=0, hi=_MAX_LAYERS)
    n_mtp = i("nextn_predict_layers", lo=0, hi=block_count, default=0)
    n_layers = block_count - n_mtp
    recurrent = _meta_list(gf, f"{a}.attention.recurrent_layers", (bool, int), min_len=n_layers)
    if recurrent is not None:
        kinds = tuple(GDN if bool(x) else ATTN for x in recurrent[:n_layers])
    else:
        interval = i("full_attention_interval", hi=_MAX_LAYERS, default=4)
        kinds = tuple(ATTN if (k + 1) % interval == 0 else GDN for k in range(n_layers))
    d_k = i("ssm.state_size")
    n_v = i("ssm.time_step_rank")
    inner = i("ssm.inner_size")
    moe = arch == "qwen35moe"
    sections = _meta_list(gf, f"{a}.rope.dimension_sections", int) or []
    return ModelConfig(
        architecture=arch,
        name=str(gf.get("general.name", gf.path.stem)),
        n_layers=n_layers,
        n_mtp_layers=n_mtp,
        hidden=i("embedding_length"),
        vocab_size=_vocab_size(gf),
        context_length=i("context_length", hi=1 << 40),
        n_heads=i("attention.head_count"),
        n_kv_heads=i("attention.head_count_kv"),
        head_dim=i("attention.key_length"),
        value_head_dim=i("attention.value_length"),
        rms_eps=_meta_float(gf, f"{a}.attention.layer_norm_rms_epsilon"),
        rope_base=_meta_float(gf, f"{a}.rope.freq_base"),
        rope_dims=i("rope.dimension_count", lo=0),
        rope_sections=tuple(int(x) for x in sections),
        layer_types=kinds,
        ffn=0 if moe else i("feed_forward_length"),
        tied_embeddings="output.weight" not in gf.tensors,
        conv_kernel=i("ssm.conv_kernel", hi=64),
        gdn_key_dim=d_k,
        gdn_value_dim=inner // n_v,
        gdn_k_heads=i("ssm.group_count"),
        gdn_v_heads=n_v,
        n_experts=i("expert_count", hi=1 << 16) if moe else 0,
        n_experts_used=i("expert_used_count", hi=1 << 16) if moe else 0,
        expert_ffn=i("expert_feed_forward_length") if moe else 0,
        shared_expert_ffn=i("expert_shared_feed_forward_length", lo=0, default=0) if moe else 0,
    )


def _gemma3(gf) -> ModelConfig:
    """Gemma 3 text model. llama.cpp (`llama_load_hparams_gemma3`) hard-codes several values that the
    GGUF does not carry; they are repeated here, and read from the file where a newer converter writes
    them. Checked against the demo GGUF (gemma-3-270m, 18 layers) and transformers' Gemma3TextConfig."""
    r = lambda k: gf.require(f"gemma3.{k}")  # noqa: E731
    g = lambda k, d=None: gf.get(f"gemma3.{k}", d)  # noqa: E731
    n_layers = int(r("block_count"))
    hidden = int(r("embedding_length"))
    n_heads = int(r("attention.head_count"))
    # Every 6th layer (i % 6 == 5) attends globally, the others through the sliding window (llama.cpp
    # set_swa_pattern(6), HF sliding_window_pattern 6). A file may spell the pattern out: an integer
    # period, or one boolean per layer (true = sliding).
    pattern = g("attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)) and len(pattern) >= n_layers:
        kinds = tuple(SLIDING if bool(x) else ATTN for x in list(pattern)[:n_layers])
    else:
        period = int(pattern) if isinstance(pattern, (int, float)) and int(pattern) > 0 else 6
        kinds = tuple(ATTN if i % period == period - 1 else SLIDING for i in range(n_layers))
    head_dim = int(g("attention.key_length", 0) or 0) or hidden // n_heads
    # Linear position scaling (4B/12B/27B: factor 8) applies to the global layers only; local layers
    # keep base 10 000 and scale 1 (llama.cpp rope_freq_scale_train_swa = 1).
    scale_type = g("rope.scaling.type")
    rope_scale = float(g("rope.scaling.factor", 1.0) or 1.0) if scale_type in (None, "linear") else 1.0
    # Query scale 1/sqrt(query_pre_attn_scalar): head_dim for every size except 27B (62 layers), whose
    # scalar is hidden / n_heads = 168 (gemma_pytorch config; llama.cpp's f_attention_scale).
    query_pre_attn_scalar = float(hidden // n_heads) if n_layers == 62 else float(head_dim)
    return ModelConfig(
        architecture="gemma3",
        name=str(gf.get("general.name", gf.path.stem)),
        n_layers=n_layers,
        hidden=hidden,
        vocab_size=_vocab_size(gf),
        context_length=int(r("context_length")),
        n_heads=n_heads,
        n_kv_heads=int(r("attention.head_count_kv")),
        head_dim=head_dim,
        value_head_dim=int(g("attention.value_length", head_dim) or head_dim),
        rms_eps=float(r("attention.layer_norm_rms_epsilon")),
        rope_base=float(g("rope.freq_base", 1_000_000.0)),
        rope_dims=head_dim,
        layer_types=kinds,
        ffn=int(r("feed_forward_length")),
        tied_embeddings="output.weight" not in gf.tensors,
        sliding_window=int(r("attention.sliding_window")),
        rope_base_local=float(g("rope.freq_base_swa", 10_000.0) or 10_000.0),
        rope_scale=rope_scale,
        query_pre_attn_scalar=query_pre_attn_scalar,
    )


# ---------------------------------------------------------------------------------------------------
# Tensor inventory check: every tensor the architecture needs is present, and its shape follows from the
# metadata. Runs before any weight is uploaded, so a wrong or truncated file fails with the tensor's name
# instead of a broadcasting error deep inside a layer.


def validate_tensors(config: ModelConfig, gguf_file) -> None:
    """Raise MissingTensorError / ShapeMismatchError (naming the tensor and the metadata keys that
    imply its shape) unless the file holds every tensor `config` needs, each with the right shape.
    Tensors of MTP blocks are optional but checked when present; extra tensors are ignored."""
    arch = config.architecture
    if arch in ("qwen35", "qwen35moe"):
        specs = _qwen35_specs(config, gguf_file)
    elif arch == "gemma3":
        specs = _gemma3_specs(config, gguf_file)
    else:
        raise UnsupportedArchitectureError(gguf_file.path, f"architecture '{arch}' is not supported",
                                           key="general.architecture")
    tensors = gguf_file.tensors
    for spec in specs:
        present = [name for name in spec.names if name in tensors]
        if not present:
            if spec.optional:
                continue
            alt = f" (or {' / '.join(spec.names[1:])})" if len(spec.names) > 1 else ""
            raise MissingTensorError(
                gguf_file.path,
                f"required by {arch} {spec.role}{alt} but absent; the file is incomplete, was converted "
                "for another architecture, or its layer-pattern metadata is wrong: re-convert it with a "
                "current llama.cpp",
                tensor=spec.names[0],
            )
        for name in present:
            actual = tuple(int(x) for x in tensors[name].shape)
            allowed = spec.shapes[spec.names.index(name)]
            if actual not in allowed:
                raise ShapeMismatchError(
                    gguf_file.path,
                    f"{name} has shape {_fmt(actual)}, the metadata ({spec.why}) implies "
                    f"{' or '.join(_fmt(s) for s in allowed)}; the file's metadata and tensors disagree: "
                    "re-convert the model",
                    tensor=name,
                )
    _check_vocab(config, gguf_file)


@dataclass(frozen=True)
class _Spec:
    names: tuple[str, ...]  # alternatives, first = canonical
    shapes: tuple[tuple[tuple[int, ...], ...], ...]  # per name: the accepted shapes
    why: str  # "key=value, ..." that implies the shape
    role: str
    optional: bool = False


def _fmt(shape) -> str:
    return "(" + ", ".join(str(x) for x in shape) + (",)" if len(shape) == 1 else ")")


def _spec(name, shape, why, role, optional=False) -> _Spec:
    return _Spec((name,), ((tuple(shape),),), why, role, optional)


def _qwen35_specs(c: ModelConfig, gf) -> list[_Spec]:
    a = c.architecture
    k = lambda key: f"{a}.{key}={gf.get(f'{a}.{key}')}"  # noqa: E731
    H, V = c.hidden, c.vocab_size
    emb = k("embedding_length")
    if c.n_heads <= 0 or c.n_kv_heads <= 0 or c.n_heads % c.n_kv_heads:
        raise GGUFError(gf.path, f"{c.n_heads} query heads cannot share {c.n_kv_heads} KV heads; "
                        "re-convert the model", key=f"{a}.attention.head_count_kv")
    n_v = c.gdn_v_heads
    inner = int(gf.get(f"{a}.ssm.inner_size", 0) or 0)
    if GDN in c.layer_types and (n_v <= 0 or c.gdn_k_heads <= 0 or inner % n_v or n_v % c.gdn_k_heads):
        raise GGUFError(gf.path, f"ssm.inner_size={inner}, time_step_rank={n_v} and group_count="
                        f"{c.gdn_k_heads} do not describe whole heads; re-convert the model",
                        key=f"{a}.ssm.inner_size")
    conv_dim = c.gdn_conv_dim
    value_dim = n_v * c.gdn_value_dim
    specs = [
        _spec("token_embd.weight", (V, H), emb, "token embedding"),
        _spec("output_norm.weight", (H,), emb, "final norm"),
        _spec("output.weight", (V, H), f"{emb}, vocabulary rows {V}", "LM head", optional=True),
    ]
    attn_why = f"{emb}, {k('attention.head_count')}, {k('attention.head_count_kv')}, {k('attention.key_length')}"
    gdn_why = (f"{emb}, {k('ssm.state_size')}, {k('ssm.group_count')}, {k('ssm.time_step_rank')}, "
               f"{k('ssm.inner_size')}")

    def attention(i, role, optional=False):
        q_out = 2 * c.n_heads * c.head_dim  # query and output gate, interleaved per head
        kv = c.n_kv_heads
        return [
            _spec(f"blk.{i}.attn_q.weight", (q_out, H), attn_why, role, optional),
            _spec(f"blk.{i}.attn_k.weight", (kv * c.head_dim, H), attn_why, role, optional),
            _spec(f"blk.{i}.attn_v.weight", (kv * c.value_head_dim, H),
                  f"{attn_why}, {k('attention.value_length')}", role, optional),
            _spec(f"blk.{i}.attn_output.weight", (H, c.n_heads * c.value_head_dim),
                  f"{attn_why}, {k('attention.value_length')}", role, optional),
            _spec(f"blk.{i}.attn_q_norm.weight", (c.head_dim,), k("attention.key_length"), role, optional),
            _spec(f"blk.{i}.attn_k_norm.weight", (c.head_dim,), k("attention.key_length"), role, optional),
        ]

    def gdn(i, role):
        return [
            _spec(f"blk.{i}.attn_qkv.weight", (conv_dim, H), gdn_why, role),
            _spec(f"blk.{i}.attn_gate.weight", (value_dim, H), gdn_why, role),
            _spec(f"blk.{i}.ssm_beta.weight", (n_v, H), gdn_why, role),
            _spec(f"blk.{i}.ssm_alpha.weight", (n_v, H), gdn_why, role),
            _spec(f"blk.{i}.ssm_conv1d.weight", (conv_dim, c.conv_kernel),
                  f"{gdn_why}, {k('ssm.conv_kernel')}", role),
            _spec(f"blk.{i}.ssm_dt.bias", (n_v,), k("ssm.time_step_rank"), role),
            _spec(f"blk.{i}.ssm_a", (n_v,), k("ssm.time_step_rank"), role),
            _spec(f"blk.{i}.ssm_norm.weight", (c.gdn_value_dim,), gdn_why, role),
            _spec(f"blk.{i}.ssm_out.weight", (H, value_dim), gdn_why, role),
        ]

    def dense_ffn(i, role, optional=False):
        F = c.ffn if c.ffn else int(gf.get(f"{a}.feed_forward_length", 0) or 0)
        why = f"{emb}, {k('feed_forward_length')}"
        return [
            _spec(f"blk.{i}.ffn_gate.weight", (F, H), why, role, optional),
            _spec(f"blk.{i}.ffn_up.weight", (F, H), why, role, optional),
            _spec(f"blk.{i}.ffn_down.weight", (H, F), why, role, optional),
        ]

    def moe_ffn(i, role):
        E, Fe, Fs = c.n_experts, c.expert_ffn, c.shared_expert_ffn
        if not 0 < c.n_experts_used <= E:
            raise GGUFError(gf.path, f"{c.n_experts_used} experts used per token out of {E}; the file is "
                            "corrupt: re-convert it", key=f"{a}.expert_used_count")
        why = f"{emb}, {k('expert_count')}, {k('expert_feed_forward_length')}"
        out = [
            _spec(f"blk.{i}.ffn_gate_inp.weight", (E, H), f"{emb}, {k('expert_count')}", role),
            # routed experts: gate and up stacked separately, or fused (--fuse-gate-up-exps)
            _Spec((f"blk.{i}.ffn_gate_exps.weight", f"blk.{i}.ffn_gate_up_exps.weight"),
                  (((E, Fe, H),), ((E, 2 * Fe, H),)), why, role),
            _spec(f"blk.{i}.ffn_down_exps.weight", (E, H, Fe), why, role),
        ]
        if f"blk.{i}.ffn_gate_up_exps.weight" not in gf.tensors:
            out.append(_spec(f"blk.{i}.ffn_up_exps.weight", (E, Fe, H), why, role))
        has_shared = any(f"blk.{i}.ffn_{p}_shexp.weight" in gf.tensors for p in ("gate", "up", "down"))
        if has_shared and Fs <= 0:
            raise MissingKeyError(gf.path, f"layer {i} has a shared expert but its width is not in the "
                                  "metadata; re-convert the model",
                                  key=f"{a}.expert_shared_feed_forward_length")
        if Fs > 0:
            swhy = f"{emb}, {k('expert_shared_feed_forward_length')}"
            out += [
                _spec(f"blk.{i}.ffn_gate_shexp.weight", (Fs, H), swhy, role),
                _spec(f"blk.{i}.ffn_up_shexp.weight", (Fs, H), swhy, role),
                _spec(f"blk.{i}.ffn_down_shexp.weight", (H, Fs), swhy, role),
                # written 2-D by the converter, 1-D after llama.cpp's C++ tools drop the trailing 1
                _Spec((f"blk.{i}.ffn_gate_inp_shexp.weight",), (((1, H), (H,)),), emb, role),
            ]
        return out

    for i, kind in enumerate(c.layer_types):
        role = f"layer {i} ({'Gated DeltaNet' if kind == GDN else 'full attention'})"
        specs.append(_spec(f"blk.{i}.attn_norm.weight", (H,), emb, role))
        specs.append(_spec(f"blk.{i}.post_attention_norm.weight", (H,), emb, role))
        specs += gdn(i, role) if kind == GDN else attention(i, role)
        specs += moe_ffn(i, role) if c.is_moe else dense_ffn(i, role)
    for i in range(c.n_layers, c.n_layers + c.n_mtp_layers):
        role = f"MTP block {i}"
        specs += [_spec(f"blk.{i}.{n}.weight", (H,), emb, role, optional=True)
                  for n in ("attn_norm", "post_attention_norm", "nextn.enorm", "nextn.hnorm",
                            "nextn.shared_head_norm")]
        specs.append(_spec(f"blk.{i}.nextn.eh_proj.weight", (H, 2 * H), emb, role, optional=True))
        specs += attention(i, role, optional=True)
        if not c.is_moe:
            specs += dense_ffn(i, role, optional=True)
    return specs


def _gemma3_specs(c: ModelConfig, gf) -> list[_Spec]:
    k = lambda key: f"gemma3.{key}={gf.get(f'gemma3.{key}')}"  # noqa: E731
    H, V, F = c.hidden, c.vocab_size, c.ffn
    emb = k("embedding_length")
    attn_why = f"{emb}, {k('attention.head_count')}, {k('attention.head_count_kv')}, {k('attention.key_length')}"
    ffn_why = f"{emb}, {k('feed_forward_length')}"
    specs = [
        _spec("token_embd.weight", (V, H), emb, "token embedding"),
        _spec("output_norm.weight", (H,), emb, "final norm"),
        _spec("output.weight", (V, H), f"{emb}, vocabulary rows {V}", "LM head", optional=True),
    ]
    for i in range(c.n_layers):
        role = f"layer {i}"
        specs += [_spec(f"blk.{i}.{n}.weight", (H,), emb, role)
                  for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")]
        specs += [
            _spec(f"blk.{i}.attn_q.weight", (c.n_heads * c.head_dim, H), attn_why, role),
            _spec(f"blk.{i}.attn_k.weight", (c.n_kv_heads * c.head_dim, H), attn_why, role),
            _spec(f"blk.{i}.attn_v.weight", (c.n_kv_heads * c.value_head_dim, H), attn_why, role),
            _spec(f"blk.{i}.attn_output.weight", (H, c.n_heads * c.value_head_dim), attn_why, role),
            _spec(f"blk.{i}.attn_q_norm.weight", (c.head_dim,), k("attention.key_length"), role),
            _spec(f"blk.{i}.attn_k_norm.weight", (c.head_dim,), k("attention.key_length"), role),
            _spec(f"blk.{i}.ffn_gate.weight", (F, H), ffn_why, role),
            _spec(f"blk.{i}.ffn_up.weight", (F, H), ffn_why, role),
            _spec(f"blk.{i}.ffn_down.weight", (H, F), ffn_why, role),
        ]
    return specs


def _check_vocab(c: ModelConfig, gf) -> None:
    tokens = gf.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > c.vocab_size:
        raise ShapeMismatchError(
            gf.path,
            f"token_embd.weight has {c.vocab_size} rows but the tokenizer has {len(tokens)} tokens, so "
            "some token ids have no embedding; the file mixes a tokenizer and weights of different "
            "models: re-convert it",
            tensor="token_embd.weight",
        )
