"""Qwen3.5 / Qwen3.6 text models (GGUF archs `qwen35` dense and `qwen35moe`): the spec and the forward pass.

`SPEC` says what a file of this architecture holds (metadata, every tensor with its shape and role, the
MoE layouts, what each layer costs; engine/models/spec.py derives validation, the loader's roles,
placement costs and `minecart synth` from it). `SHAPES` are the released sizes and a few tiny ones.
The forward pass is pure functions over a weights dict {GGUF tensor name: Weight} and a Backend,
following docs/qwen35.md section 3 (section numbers below refer to that file). Every layer is

    x = x + mixer(rms_norm(x, attn_norm))               # Gated DeltaNet or gated full attention
    x = x + ffn(rms_norm(x, post_attention_norm))       # SwiGLU, or routed experts + shared expert

Weights are used in GGUF order: GDN value head j pairs with key head j % n_k (the converter tiled the
value heads), every stored norm weight is already `1 + w` except `ssm_norm`, and `ssm_a` is already
`-exp(A_log)` (docs/qwen35.md 2.4). The MTP block (`blk.{n_layers}`, section 5) is not used for
next-token prediction and is not loaded. This file never imports numpy or cupy; vision input (M-RoPE
with distinct components) only needs (3, T) positions, which the backend's rope already accepts.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Any

from ..backends.base import Array, Backend, LayerState, MoeShared, Weight
from ..errors import GGUFError, MissingKeyError
from .batch import SequenceRows, per_sequence
from .spec import (
    ATTN,
    EMBEDDING,
    EXPERTS,
    GDN,
    MATMUL,
    MAX_LAYERS,
    MTP,
    NORM,
    VECTOR,
    VOCAB_ROWS,
    ArchSpec,
    Fill,
    GGUFLike,
    Group,
    LayerCosts,
    ModelConfig,
    TensorDef,
    dense_ffn_values,
    kv_values_per_token,
    meta_float,
    meta_int,
    meta_list,
    q8_values,
    vocab_size,
)

# ------------------------------------------------------------------------------------------------
# the spec: metadata, tensors, layouts, costs

Weights = dict[str, Weight]  # {GGUF tensor name: Weight} of the parts a stage holds

FUSED_GATE_UP = "fused_gate_up"  # routed experts' gate and up in one (E, 2 F_e, H) tensor
SHARED_EXPERT = "shared_expert"  # the layer has the sigmoid-gated shared expert


def read_config(gf: GGUFLike) -> ModelConfig:
    """Hyper-parameters from the file's `qwen35.*` / `qwen35moe.*` keys (docs/qwen35.md, "Metadata")."""
    a = gf.architecture
    i = lambda k, **kw: meta_int(gf, f"{a}.{k}", **kw)  # noqa: E731
    block_count = i("block_count", lo=0, hi=MAX_LAYERS)
    n_mtp = i("nextn_predict_layers", lo=0, hi=block_count, default=0)
    n_layers = block_count - n_mtp
    recurrent = meta_list(gf, f"{a}.attention.recurrent_layers", (bool, int), min_len=n_layers)
    if recurrent is not None:
        kinds = tuple(GDN if bool(x) else ATTN for x in recurrent[:n_layers])
    else:
        interval = i("full_attention_interval", hi=MAX_LAYERS, default=4)
        kinds = tuple(ATTN if (k + 1) % interval == 0 else GDN for k in range(n_layers))
    d_k = i("ssm.state_size")
    n_v = i("ssm.time_step_rank")
    inner = i("ssm.inner_size")
    moe = a == "qwen35moe"
    sections = meta_list(gf, f"{a}.rope.dimension_sections", int) or []
    head_dim = i("attention.key_length")
    # rotated dims come in pairs within one head; more would load and then fail every generation
    rope_dims = i("rope.dimension_count", lo=0, hi=head_dim)
    if rope_dims % 2:
        raise GGUFError(gf.path, f"value {rope_dims} is odd; RoPE rotates pairs of dimensions "
                        f"(at most the head size {head_dim}): re-convert the file",
                        key=f"{a}.rope.dimension_count")
    return ModelConfig(
        architecture=a,
        name=str(gf.get("general.name", gf.path.stem)),
        n_layers=n_layers,
        n_mtp_layers=n_mtp,
        hidden=i("embedding_length"),
        vocab_size=vocab_size(gf),
        context_length=i("context_length", hi=1 << 40),
        n_heads=i("attention.head_count"),
        n_kv_heads=i("attention.head_count_kv"),
        head_dim=head_dim,
        value_head_dim=i("attention.value_length"),
        rms_eps=meta_float(gf, f"{a}.attention.layer_norm_rms_epsilon"),
        rope_base=meta_float(gf, f"{a}.rope.freq_base"),
        rope_dims=rope_dims,
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


def _check_metadata(c: ModelConfig, gf: GGUFLike) -> None:
    """Head counts that must divide each other, and MoE keys the tensors depend on."""
    a = c.architecture
    if c.n_heads <= 0 or c.n_kv_heads <= 0 or c.n_heads % c.n_kv_heads:
        raise GGUFError(gf.path, f"{c.n_heads} query heads cannot share {c.n_kv_heads} KV heads; "
                        "re-convert the model", key=f"{a}.attention.head_count_kv")
    n_v = c.gdn_v_heads
    inner = int(gf.get(f"{a}.ssm.inner_size", 0) or 0)
    if GDN in c.layer_types and (n_v <= 0 or c.gdn_k_heads <= 0 or inner % n_v or n_v % c.gdn_k_heads):
        raise GGUFError(gf.path, f"ssm.inner_size={inner}, time_step_rank={n_v} and group_count="
                        f"{c.gdn_k_heads} do not describe whole heads; re-convert the model",
                        key=f"{a}.ssm.inner_size")
    if not c.is_moe or c.n_layers == 0:
        return
    if not 0 < c.n_experts_used <= c.n_experts:
        raise GGUFError(gf.path, f"{c.n_experts_used} experts used per token out of {c.n_experts}; the "
                        "file is corrupt: re-convert it", key=f"{a}.expert_used_count")
    for i in range(c.n_layers):
        has_shared = any(f"blk.{i}.ffn_{p}_shexp.weight" in gf.tensors for p in ("gate", "up", "down"))
        if has_shared and c.shared_expert_ffn <= 0:
            raise MissingKeyError(gf.path, f"layer {i} has a shared expert but its width is not in the "
                                  "metadata; re-convert the model",
                                  key=f"{a}.expert_shared_feed_forward_length")


def _layer_options(c: ModelConfig, i: int, names: Collection[str] | None) -> frozenset[str]:
    """The MoE layout of layer i: fused gate/up experts (only a file can say so), and whether the
    shared expert is there (the file's tensors, or the config's shared width without a file)."""
    if not c.is_moe:
        return frozenset()
    p = f"blk.{i}."
    opts = set()
    if names is not None and p + "ffn_gate_up_exps.weight" in names:
        opts.add(FUSED_GATE_UP)
    if (c.shared_expert_ffn > 0) if names is None else (p + "ffn_gate_shexp.weight" in names):
        opts.add(SHARED_EXPERT)
    return frozenset(opts)


# metadata keys behind the shapes (shown in a shape-mismatch message)
_EMB = ("embedding_length",)
_ATT = (*_EMB, "attention.head_count", "attention.head_count_kv", "attention.key_length")
_ATT_V = (*_ATT, "attention.value_length")
_GDN_KEYS = (*_EMB, "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size")
_FFN = (*_EMB, "feed_forward_length")
_EXP = (*_EMB, "expert_count", "expert_feed_forward_length")
_SHEXP = (*_EMB, "expert_shared_feed_forward_length")
_OUT = Fill(std=0.3)  # projections that write into the residual stream start smaller
_ROUTER = Fill("normal")  # F32 router rows, N(0, (0.7 / sqrt(H))^2)


def _t(name: str, shape: Any, role: str, keys: tuple[str, ...], **kw: Any) -> TensorDef:
    return TensorDef(name, shape, role, keys, **kw)


def _vec(name: str, shape: Any, keys: tuple[str, ...], fill: Fill = NORM) -> TensorDef:
    return TensorDef(name, shape, VECTOR, keys, f32=True, fill=fill)


def _is_moe(c: ModelConfig, kind: str, opts: frozenset[str]) -> bool:
    return c.is_moe


# Converter order within a block (what `minecart synth` writes and a real file holds, give or take
# the alphabetical order of ffn_down/gate/up): MTP inputs, attn_norm, the mixer, the FFN,
# post_attention_norm. An MTP block is a full-attention block with its own input projection.
SPEC = ArchSpec(
    architectures=("qwen35", "qwen35moe"),
    read_config=read_config,
    global_tensors=(
        _t("token_embd.weight", lambda c: (c.vocab_size, c.hidden), EMBEDDING, _EMB,
           fill=Fill("embed", 2.83, cap=0.5)),  # tied logits keep a std of about 2.8
    ),
    layer_groups=(
        Group((_t("nextn.eh_proj.weight", lambda c: (c.hidden, 2 * c.hidden), MATMUL, _EMB),
               *(_vec(f"nextn.{n}.weight", lambda c: (c.hidden,), _EMB)
                 for n in ("enorm", "hnorm", "shared_head_norm"))),
              lambda c, kind, opts: MTP in opts),
        Group((_vec("attn_norm.weight", lambda c: (c.hidden,), _EMB),)),
        Group((  # gated full attention: attn_q holds query and output gate, interleaved per head
            _t("attn_q.weight", lambda c: (2 * c.n_heads * c.head_dim, c.hidden), MATMUL, _ATT),
            _t("attn_k.weight", lambda c: (c.n_kv_heads * c.head_dim, c.hidden), MATMUL, _ATT),
            _t("attn_v.weight", lambda c: (c.n_kv_heads * c.value_head_dim, c.hidden), MATMUL, _ATT_V),
            _t("attn_output.weight", lambda c: (c.hidden, c.n_heads * c.value_head_dim), MATMUL, _ATT_V,
               fill=_OUT),
            _vec("attn_q_norm.weight", lambda c: (c.head_dim,), ("attention.key_length",)),
            _vec("attn_k_norm.weight", lambda c: (c.head_dim,), ("attention.key_length",)),
        ), lambda c, kind, opts: kind == ATTN),
        Group((  # Gated DeltaNet
            _vec("ssm_a", lambda c: (c.gdn_v_heads,), ("ssm.time_step_rank",), Fill("ssm_a", 1.0, False)),
            _vec("ssm_conv1d.weight", lambda c: (c.gdn_conv_dim, c.conv_kernel), (*_GDN_KEYS, "ssm.conv_kernel"),
                 Fill("normal", 0.5, False)),
            _vec("ssm_dt.bias", lambda c: (c.gdn_v_heads,), ("ssm.time_step_rank",), Fill("normal", 1.0, False)),
            _t("ssm_alpha.weight", lambda c: (c.gdn_v_heads, c.hidden), MATMUL, _GDN_KEYS),
            _t("ssm_beta.weight", lambda c: (c.gdn_v_heads, c.hidden), MATMUL, _GDN_KEYS),
            _t("attn_qkv.weight", lambda c: (c.gdn_conv_dim, c.hidden), MATMUL, _GDN_KEYS),
            _t("attn_gate.weight", lambda c: (c.gdn_v_heads * c.gdn_value_dim, c.hidden), MATMUL, _GDN_KEYS),
            _vec("ssm_norm.weight", lambda c: (c.gdn_value_dim,), _GDN_KEYS),
            _t("ssm_out.weight", lambda c: (c.hidden, c.gdn_v_heads * c.gdn_value_dim), MATMUL, _GDN_KEYS,
               fill=_OUT),
        ), lambda c, kind, opts: kind == GDN),
        Group((_t("ffn_gate_inp.weight", lambda c: (c.n_experts, c.hidden), MATMUL,
                  (*_EMB, "expert_count"), f32=True, fill=_ROUTER),), _is_moe, routed=True),
        Group((_t("ffn_gate_up_exps.weight", lambda c: (c.n_experts, 2 * c.expert_ffn, c.hidden), EXPERTS,
                  _EXP),),
              lambda c, kind, opts: c.is_moe and FUSED_GATE_UP in opts, routed=True),
        Group((_t("ffn_gate_exps.weight", lambda c: (c.n_experts, c.expert_ffn, c.hidden), EXPERTS, _EXP,
                  alt="ffn_gate_up_exps.weight"),
               _t("ffn_up_exps.weight", lambda c: (c.n_experts, c.expert_ffn, c.hidden), EXPERTS, _EXP)),
              lambda c, kind, opts: c.is_moe and FUSED_GATE_UP not in opts, routed=True),
        Group((_t("ffn_down_exps.weight", lambda c: (c.n_experts, c.hidden, c.expert_ffn), EXPERTS, _EXP,
                  fill=_OUT),), _is_moe, routed=True),
        Group((
            # written 2-D by the converter, 1-D after llama.cpp's C++ tools drop the trailing 1
            _t("ffn_gate_inp_shexp.weight", lambda c: (1, c.hidden), MATMUL, _EMB, f32=True, fill=_ROUTER,
               also=lambda c: (c.hidden,)),
            _t("ffn_gate_shexp.weight", lambda c: (c.shared_expert_ffn, c.hidden), MATMUL, _SHEXP),
            _t("ffn_up_shexp.weight", lambda c: (c.shared_expert_ffn, c.hidden), MATMUL, _SHEXP),
            _t("ffn_down_shexp.weight", lambda c: (c.hidden, c.shared_expert_ffn), MATMUL, _SHEXP, fill=_OUT),
        ), lambda c, kind, opts: c.is_moe and SHARED_EXPERT in opts),
        Group((
            _t("ffn_gate.weight", lambda c: (c.ffn, c.hidden), MATMUL, _FFN),
            _t("ffn_up.weight", lambda c: (c.ffn, c.hidden), MATMUL, _FFN),
            _t("ffn_down.weight", lambda c: (c.hidden, c.ffn), MATMUL, _FFN, fill=_OUT),
        ), lambda c, kind, opts: not c.is_moe),
        Group((_vec("post_attention_norm.weight", lambda c: (c.hidden,), _EMB),)),
    ),
    head_tensors=(
        _vec("output_norm.weight", lambda c: (c.hidden,), _EMB),
        _t("output.weight", lambda c: (c.vocab_size, c.hidden), MATMUL, (*_EMB, VOCAB_ROWS)),
    ),
    layer_costs=lambda c, kind: _layer_costs(c, kind),
    layer_options=_layer_options,
    check_metadata=_check_metadata,
    # the weights each matmul_many call below reads together
    fused_groups=(("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight"),
                  ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
                  ("ffn_gate.weight", "ffn_up.weight"),
                  ("ffn_gate_shexp.weight", "ffn_up_shexp.weight")),
)


def _layer_costs(config: ModelConfig, kind: str) -> LayerCosts:
    """Per-sequence state and peak live float32 activations per token of one layer during a prefill
    chunk, counted the way the CUDA backend allocates them for the functions below.

    Every phase holds the residual x and the normed input a with its q8_1 copy (2 H + q8(H)).
    - matmul_many (fused projections): the (T, sum of rows) output and its per-weight contiguous
      slices are both alive: 2 x rows. GDN rows: conv_dim + n_v d_v + 2 n_v; attention: 2 nh d (query
      and gate, interleaved) + n_kv (d_k + d_v).
    - GDN mixer while the chunked kernels run: mixed [q|k|v] (conv_dim), z (n_v d_v), b and alpha, the
      conv output u (conv_dim), normed q and k (2 n_k d_k), g and beta, a contiguous copy of v and the
      output (2 n_v d_v); scratch n_v (3 d_k + 2 d_v) per token of the segment (kernels/gdn_chunk.py).
      The GDN state: conv (kernel - 1, conv_dim) and delta rule (n_v, d_k, d_v), fp32.
    - gated attention: q/gate and k, v, then roped q, the output, sigmoid(gate) and the gated output
      (2 nh d + 2 nh d_v besides the projections).
    - dense FFN: engine/models/spec.py dense_ffn_values.
    - MoE FFN: router logits, k experts' gate/up/down rows and the shared expert (3 H + ...).
    """
    h = config.hidden
    base = 2 * h + q8_values(h)
    seg = mixer_chunked = state = 0
    if kind == GDN:
        nv, dk, dv = config.gdn_v_heads, config.gdn_key_dim, config.gdn_value_dim
        value_dim = nv * dv
        conv = config.gdn_conv_dim
        project = base + 2 * (conv + value_dim + 2 * nv)
        mixer_chunked = base + 2 * conv + 3 * value_dim + 2 * config.gdn_k_heads * dk + 4 * nv
        mixer = max(project, mixer_chunked)  # the token-serial scan holds about as much as the chunked path
        seg = nv * (3 * dk + 2 * dv)
        state = (max(config.conv_kernel - 1, 0) * conv + nv * dk * dv) * 4
    else:
        mixer = _attention_values(config)
    if config.is_moe:
        ffn = 3 * h + (config.n_experts + 3 * config.n_experts_used * config.expert_ffn
                       + 3 * config.shared_expert_ffn)
    else:
        ffn = dense_ffn_values(config)
    return LayerCosts(kv_values_per_token=kv_values_per_token(config, kind), state_bytes=state,
                      act_values_per_token=max(mixer, ffn),
                      mixer_values_per_token=mixer_chunked if seg else 0, segment_values_per_token=seg)


def _attention_values(config: ModelConfig) -> int:
    """Peak live values per token of the gated attention block (see _layer_costs)."""
    h = config.hidden
    nh, d, dv, n_kv = config.n_heads, config.head_dim, config.value_head_dim, config.n_kv_heads
    rows = 2 * nh * d + n_kv * (d + dv)
    return 2 * h + q8_values(h) + max(2 * rows, rows + 2 * nh * d + 2 * nh * dv)


def tensor_roles(config: ModelConfig, available: set[str] | None = None) -> dict[str, dict[str, str]]:
    """Every tensor the forward pass reads, per part. `available` (the file's tensor names) picks
    between the MoE layouts (separate or fused gate/up experts; shared expert present or not)."""
    return SPEC.tensor_roles(config, available)


def new_layer_state(config: ModelConfig, backend: Backend, i: int, capacity: int) -> LayerState:
    if config.layer_types[i] == GDN:
        conv = backend.zeros((config.conv_kernel - 1, config.gdn_conv_dim))
        ssm = backend.zeros((config.gdn_v_heads, config.gdn_key_dim, config.gdn_value_dim))
        return LayerState(recurrent={"conv": conv, "ssm": ssm})
    kv = backend.new_kv_cache(config.n_kv_heads, config.head_dim, config.value_head_dim, capacity)
    return LayerState(kv=kv)


def embed(config: ModelConfig, backend: Backend, w: Weights, ids: Array) -> Array:
    return backend.embed(w["token_embd.weight"], ids)  # (T, H), no scaling


def layer(config: ModelConfig, backend: Backend, w: Weights, i: int, x: Array,
          state: LayerState | SequenceRows, positions: Array) -> Array:
    """state: one sequence's LayerState, or a batch's SequenceRows (engine/models/batch.py): then the
    projections and the FFN run once on the stacked rows and each mixer on its own sequence."""
    p = f"blk.{i}."
    eps = config.rms_eps
    a = backend.rms_norm(x, w[p + "attn_norm.weight"], eps)
    if config.layer_types[i] == GDN:
        mixed = _gated_deltanet(config, backend, w, p, a, state)
    elif config.layer_types[i] == ATTN:
        mixed = _gated_attention(config, backend, w, p, a, state, positions)
    else:
        raise ValueError(f"layer {i}: kind '{config.layer_types[i]}' is not a qwen35 layer")
    x, f = backend.add_rms_norm(x, mixed, w[p + "post_attention_norm.weight"], eps)
    return feed_forward(config, backend, w, i, f, residual=x)


def feed_forward(config: ModelConfig, backend: Backend, w: Weights, i: int, f: Array,
                 residual: Array | None = None) -> Array:
    """Layer i's FFN on its normed input f (T, H): dense SwiGLU (3.5) or MoE (3.6); with `residual`,
    residual + FFN (the dense down projection adds it itself)."""
    p = f"blk.{i}."
    if config.is_moe:
        return _moe(config, backend, w, p, f, residual)
    return _swiglu_ffn(backend, w, p + "ffn_", "", f, residual)


def final_norm(config: ModelConfig, backend: Backend, w: Weights, x: Array) -> Array:
    """The input of the LM head (the fixtures' `hidden[L+1]`)."""
    return backend.rms_norm(x, w["output_norm.weight"], config.rms_eps)


def head(config: ModelConfig, backend: Backend, w: Weights, x: Array) -> Array:
    lm_head = w.get("output.weight")
    if lm_head is None:
        lm_head = w["token_embd.weight"]  # tied: reuse the embedding (3.7)
    return backend.matmul(final_norm(config, backend, w, x), lm_head)  # (T, vocab)


# ------------------------------------------------------------------------------------------------
# mixers


def _gated_deltanet(config: ModelConfig, be: Backend, w: Weights, p: str, a: Array,
                    state: LayerState | SequenceRows) -> Array:
    """Section 3.4 (and 3.4.1 for T > 1)."""
    mixed, z, b, alpha = be.matmul_many(a, [w[p + "attn_qkv.weight"], w[p + "attn_gate.weight"],
                                            w[p + "ssm_beta.weight"], w[p + "ssm_alpha.weight"]])
    # mixed (T, conv_dim) = [q | k | v], z (T, n_v dv), b and alpha (T, n_v)

    weights = (w[p + "ssm_conv1d.weight"], w[p + "ssm_a"], w[p + "ssm_dt.bias"], w[p + "ssm_norm.weight"])
    dims: dict[str, Any] = dict(n_k=config.gdn_k_heads, n_v=config.gdn_v_heads, dk=config.gdn_key_dim,
                                dv=config.gdn_value_dim, eps=config.rms_eps)

    def mixer(st: LayerState, _positions: Any, mixed: Array, z: Array, b: Array, alpha: Array) -> Array:
        return be.gdn_decode(mixed, z, b, alpha, st.recurrent["conv"], st.recurrent["ssm"], *weights, **dims)

    if isinstance(state, SequenceRows) and state.decoding:  # one token per sequence: one launch for all
        y = be.gdn_decode_batch(mixed, z, b, alpha, [st.recurrent["conv"] for st in state.states],
                                [st.recurrent["ssm"] for st in state.states], *weights, **dims)
    else:
        y = per_sequence(be, state, None, (mixed, z, b, alpha), mixer)  # (T, n_v dv)
    return be.matmul(y, w[p + "ssm_out.weight"])


def _gated_attention(config: ModelConfig, be: Backend, w: Weights, p: str, a: Array,
                     state: LayerState | SequenceRows, positions: Array) -> Array:
    """Section 3.3: q/gate interleaved per head in attn_q, q/k RMSNorm, partial NEOX (M-)RoPE,
    contiguous GQA, sigmoid output gate."""
    nh, n_kv, d, dv = config.n_heads, config.n_kv_heads, config.head_dim, config.value_head_dim
    qg, k, v = be.matmul_many(a, [w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"]])

    norms = (w[p + "attn_q_norm.weight"], w[p + "attn_k_norm.weight"])
    rope: dict[str, Any] = dict(n_rot=config.rope_dims, base=config.rope_base,
                                sections=config.rope_sections, scale=1.0 / math.sqrt(d), eps=config.rms_eps)

    def mixer(st: LayerState, pos: Any, qg: Array, k: Array, v: Array) -> Array:
        T = qg.shape[0]
        return be.gated_attention(qg.reshape(T, nh, 2, d), k.reshape(T, n_kv, d), v.reshape(T, n_kv, dv),
                                  st.kv, *norms, pos, **rope)

    if isinstance(state, SequenceRows) and state.decoding:  # one token per sequence: one launch for all
        B = state.size
        o = be.gated_attention_batch(qg.reshape(B, nh, 2, d), k.reshape(B, n_kv, d), v.reshape(B, n_kv, dv),
                                     [st.kv for st in state.states], *norms, state.positions, **rope)
    else:
        o = per_sequence(be, state, positions, (qg, k, v), mixer)  # (T, nh dv)
    return be.matmul(o, w[p + "attn_output.weight"])


# ------------------------------------------------------------------------------------------------
# feed-forward


def _swiglu_ffn(be: Backend, w: Weights, prefix: str, suffix: str, f: Array,
                residual: Array | None = None) -> Array:
    """(silu(f @ gate.T) * (f @ up.T)) @ down.T with tensors `{prefix}gate{suffix}.weight` etc., plus
    `residual` when given."""
    h = be.matmul_swiglu(f, w[f"{prefix}gate{suffix}.weight"], w[f"{prefix}up{suffix}.weight"])
    down = w[f"{prefix}down{suffix}.weight"]
    return be.matmul(h, down) if residual is None else be.matmul_add(h, down, residual)


def _moe(config: ModelConfig, be: Backend, w: Weights, p: str, f: Array,
         residual: Array | None = None) -> Array:
    """Section 3.6: softmax router, top-k renormalized experts, plus the sigmoid-gated shared expert
    (and `residual`): one backend op, Backend.moe_block."""
    fused = w.get(p + "ffn_gate_up_exps.weight")
    shared = None
    if p + "ffn_gate_shexp.weight" in w:
        shared = MoeShared(w[p + "ffn_gate_inp_shexp.weight"], w[p + "ffn_gate_shexp.weight"],
                           w[p + "ffn_up_shexp.weight"], w[p + "ffn_down_shexp.weight"])
    return be.moe_block(
        f,
        w[p + "ffn_gate_inp.weight"],
        fused if fused is not None else w[p + "ffn_gate_exps.weight"],
        None if fused is not None else w[p + "ffn_up_exps.weight"],
        w[p + "ffn_down_exps.weight"],
        config.n_experts_used,
        shared,
        residual,
    )


# ------------------------------------------------------------------------------------------------
# named shapes: the released models' hyper-parameters (docs/qwen35.md, "The family"), and tiny ones
# for tests. engine/synth.py writes files of these shapes; engine/placement.py prices them.


@dataclass(frozen=True)
class Shape:
    """Hyper-parameters of a qwen35 / qwen35moe model in the few numbers that vary between sizes."""

    name: str
    display: str
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    gdn_k_heads: int
    gdn_v_heads: int
    ffn: int = 0
    tied: bool = True
    head_dim: int = 256
    gdn_head_dim: int = 128
    rope_dims: int = 64
    rope_sections: tuple[int, ...] = (11, 11, 10, 0)
    conv_kernel: int = 4
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn: int = 0
    shared_expert_ffn: int = 0
    vocab_size: int = 248320
    context_length: int = 262144
    rope_base: float = 10_000_000.0
    rms_eps: float = 1e-6
    full_attention_interval: int = 4
    n_mtp: int = 1

    @property
    def arch(self) -> str:
        return "qwen35moe" if self.n_experts else "qwen35"

    def config(self, name: str | None = None) -> ModelConfig:
        """The ModelConfig a file of this shape reads as (general.name aside)."""
        kinds = tuple(ATTN if (i + 1) % self.full_attention_interval == 0 else GDN for i in range(self.n_layers))
        return ModelConfig(
            architecture=self.arch, name=self.name if name is None else name, n_layers=self.n_layers,
            n_mtp_layers=self.n_mtp, hidden=self.hidden, vocab_size=self.vocab_size,
            context_length=self.context_length, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim, value_head_dim=self.head_dim, rms_eps=self.rms_eps,
            rope_base=self.rope_base, rope_dims=self.rope_dims, rope_sections=self.rope_sections,
            layer_types=kinds, ffn=0 if self.n_experts else self.ffn, tied_embeddings=self.tied,
            conv_kernel=self.conv_kernel, gdn_key_dim=self.gdn_head_dim, gdn_value_dim=self.gdn_head_dim,
            gdn_k_heads=self.gdn_k_heads, gdn_v_heads=self.gdn_v_heads, n_experts=self.n_experts,
            n_experts_used=self.n_experts_used, expert_ffn=self.expert_ffn,
            shared_expert_ffn=self.shared_expert_ffn if self.n_experts else 0,
        )

    def truncated(self, n_layers: int | None = None, mtp: bool = True) -> Shape:
        """The first n_layers main layers (the pattern stays), with or without the MTP block."""
        n = self.n_layers if n_layers is None else min(n_layers, self.n_layers)
        return replace(self, n_layers=n, n_mtp=self.n_mtp if mtp else 0)


_TINY: dict[str, Any] = dict(hidden=32, n_layers=8, n_heads=4, n_kv_heads=2, gdn_k_heads=2, gdn_v_heads=4,
                             head_dim=64, gdn_head_dim=16, rope_dims=16, rope_sections=(3, 3, 2, 0))
SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("qwen3.5-0.8b", "Qwen3.5-0.8B", 1024, 24, 8, 2, 16, 16, ffn=3584),
        Shape("qwen3.5-2b", "Qwen3.5-2B", 2048, 24, 8, 2, 16, 16, ffn=6144),
        Shape("qwen3.5-4b", "Qwen3.5-4B", 2560, 32, 16, 4, 16, 32, ffn=9216),
        Shape("qwen3.5-9b", "Qwen3.5-9B", 4096, 32, 16, 4, 16, 32, ffn=12288, tied=False),
        Shape("qwen3.5-27b", "Qwen3.5-27B", 5120, 64, 24, 4, 16, 48, ffn=17408, tied=False),
        Shape("qwen3.6-35b-a3b", "Qwen3.6-35B-A3B", 2048, 40, 16, 2, 16, 32, tied=False,
              n_experts=256, n_experts_used=8, expert_ffn=512, shared_expert_ffn=512),
        # the shared fixture's configuration (fixtures/dense/hf_config.json)
        Shape("tiny-dense", "tiny dense (fixture shape)", ffn=96, **_TINY),
        # the same tiny dims as a MoE model with an untied LM head
        Shape("tiny-moe", "tiny MoE", tied=False, n_experts=8, n_experts_used=2, expert_ffn=32,
              shared_expert_ffn=32, **_TINY),
        # real head sizes (256 / 128) and every row a multiple of 256, so K-quants are used as asked
        Shape("small-dense", "small dense (real head dims)", 256, 4, 2, 1, 2, 4, ffn=512),
    )
}
