"""ModelConfig: the hyper-parameters of a model, read once from GGUF metadata.

One frozen dataclass for every supported architecture; fields that an architecture lacks keep their
defaults. A missing required key fails with the key's name (MissingKeyError). Layer kinds are spelled
out per layer in `layer_types` so model code and placement never re-derive them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import UnsupportedArchitectureError

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
    return len(toks) if toks is not None else 0


def _qwen35(gf, arch: str) -> ModelConfig:
    r = lambda k: gf.require(f"{arch}.{k}")  # noqa: E731
    g = lambda k, d=None: gf.get(f"{arch}.{k}", d)  # noqa: E731
    block_count = int(r("block_count"))
    n_mtp = int(g("nextn_predict_layers", 0) or 0)
    n_layers = block_count - n_mtp
    recurrent = g("attention.recurrent_layers")
    if recurrent is not None:
        kinds = tuple(GDN if bool(x) else ATTN for x in list(recurrent)[:n_layers])
    else:
        interval = int(g("full_attention_interval", 4) or 4)
        kinds = tuple(ATTN if (i + 1) % interval == 0 else GDN for i in range(n_layers))
    d_k = int(r("ssm.state_size"))
    n_v = int(r("ssm.time_step_rank"))
    inner = int(r("ssm.inner_size"))
    moe = arch == "qwen35moe"
    return ModelConfig(
        architecture=arch,
        name=str(gf.get("general.name", gf.path.stem)),
        n_layers=n_layers,
        n_mtp_layers=n_mtp,
        hidden=int(r("embedding_length")),
        vocab_size=_vocab_size(gf),
        context_length=int(r("context_length")),
        n_heads=int(r("attention.head_count")),
        n_kv_heads=int(r("attention.head_count_kv")),
        head_dim=int(r("attention.key_length")),
        value_head_dim=int(r("attention.value_length")),
        rms_eps=float(r("attention.layer_norm_rms_epsilon")),
        rope_base=float(r("rope.freq_base")),
        rope_dims=int(r("rope.dimension_count")),
        rope_sections=tuple(int(x) for x in (g("rope.dimension_sections") or ())),
        layer_types=kinds,
        ffn=0 if moe else int(r("feed_forward_length")),
        tied_embeddings="output.weight" not in gf.tensors,
        conv_kernel=int(r("ssm.conv_kernel")),
        gdn_key_dim=d_k,
        gdn_value_dim=inner // n_v,
        gdn_k_heads=int(r("ssm.group_count")),
        gdn_v_heads=n_v,
        n_experts=int(r("expert_count")) if moe else 0,
        n_experts_used=int(r("expert_used_count")) if moe else 0,
        expert_ffn=int(r("expert_feed_forward_length")) if moe else 0,
        shared_expert_ffn=int(g("expert_shared_feed_forward_length", 0) or 0) if moe else 0,
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
