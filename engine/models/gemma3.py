"""Gemma 3 text decoder (GGUF architecture `gemma3`), written against the Backend protocol.

What this is: the forward pass of Gemma 3's language model as llama.cpp (`src/models/gemma3.cpp`) and
transformers (`Gemma3ForCausalLM`) compute it, in GGUF terms, split into the five functions every model
module exposes (engine/models/__init__.py). What it is not: a vision model (Gemma 3's SigLIP tower and
the multimodal projector are not read), a tokenizer, or a sampler.

The forward pass, per token sequence (H hidden, nh query heads, n_kv KV heads, d head dim):

    x = token_embd[ids] * sqrt(H)                          # sqrt(640) = 25.3 for the demo model
    for each layer i:
        h = rms(x) * attn_norm
        q, k, v = h @ attn_q.T, h @ attn_k.T, h @ attn_v.T   # (T, nh, d), (T, n_kv, d), (T, n_kv, d)
        q, k = rms(q) * attn_q_norm, rms(k) * attn_k_norm    # per head, over d
        q, k = rope(q), rope(k)          # NEOX, all d dims; base = rope_base_local (10 000) on
                                         # sliding layers, rope.freq_base (and linear scaling) on global
        o = attention(q, k, v, scale=1/sqrt(query_pre_attn_scalar), window on sliding layers)
        x = x + rms(o @ attn_output.T) * post_attention_norm  # norm BEFORE the residual add
        h = rms(x) * ffn_norm                                # "pre_feedforward_layernorm"
        f = (gelu_tanh(h @ ffn_gate.T) * (h @ ffn_up.T)) @ ffn_down.T
        x = x + rms(f) * post_ffw_norm
    logits = (rms(x) * output_norm) @ token_embd.T           # tied head (output.weight if present)

Norm weights: Gemma's RMSNorm multiplies by (1 + w) with w stored zero-centred in the checkpoints, and
llama.cpp's converter (`Gemma3Model.modify_tensors`) writes w + 1 into the GGUF for every `*norm.weight`.
So every norm here is a plain multiplier. Checked on the demo GGUF: `post_attention_norm` and
`ffn_norm` of layer 0 have a minimum of exactly 0.0 (zero-centred weight -1, i.e. a channel the
checkpoint switches off), and the logits match transformers, whose GGUF loader subtracts the 1 again
(docs/demo-check.md). Gemma 3 has no attention or final logit soft-capping (Gemma 2 had).
"""

from __future__ import annotations

import math
from typing import Any

from ..backends.base import Array, Backend, LayerState, Weight
from .batch import SequenceRows, per_sequence
from .spec import (
    ATTN,
    EMBEDDING,
    MATMUL,
    NORM,
    SLIDING,
    VECTOR,
    VOCAB_ROWS,
    ArchSpec,
    GGUFLike,
    Group,
    LayerCosts,
    ModelConfig,
    TensorDef,
    dense_ffn_values,
    kv_values_per_token,
    q8_values,
    vocab_size,
)

Weights = dict[str, Weight]  # {GGUF tensor name: Weight} of the parts a stage holds


def read_config(gf: GGUFLike) -> ModelConfig:
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
        vocab_size=vocab_size(gf),
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


def _layer_costs(config: ModelConfig, kind: str) -> LayerCosts:
    """KV cache per token and peak live activations of one layer. The attention block is counted as
    Qwen3.5's gated one is (query rows doubled for the gate, engine/models/qwen35.py _layer_costs), an
    upper bound for Gemma's ungated block that has not been measured on its own yet."""
    h = config.hidden
    nh, d, dv, n_kv = config.n_heads, config.head_dim, config.value_head_dim, config.n_kv_heads
    rows = 2 * nh * d + n_kv * (d + dv)
    mixer = 2 * h + q8_values(h) + max(2 * rows, rows + 2 * nh * d + 2 * nh * dv)
    return LayerCosts(kv_values_per_token=kv_values_per_token(config, kind),
                      act_values_per_token=max(mixer, dense_ffn_values(config)))


_EMB = ("embedding_length",)
_ATT = (*_EMB, "attention.head_count", "attention.head_count_kv", "attention.key_length")
_FFN = (*_EMB, "feed_forward_length")


def _norm(name: str, keys: tuple[str, ...] = _EMB, size: Any = lambda c: (c.hidden,)) -> TensorDef:
    return TensorDef(name, size, VECTOR, keys, f32=True, fill=NORM)


SPEC = ArchSpec(
    architectures=("gemma3",),
    read_config=read_config,
    global_tensors=(TensorDef("token_embd.weight", lambda c: (c.vocab_size, c.hidden), EMBEDDING, _EMB),),
    layer_groups=(Group((  # in the order the forward pass below reads them
        _norm("attn_norm.weight"),
        TensorDef("attn_q.weight", lambda c: (c.n_heads * c.head_dim, c.hidden), MATMUL, _ATT),
        TensorDef("attn_k.weight", lambda c: (c.n_kv_heads * c.head_dim, c.hidden), MATMUL, _ATT),
        TensorDef("attn_v.weight", lambda c: (c.n_kv_heads * c.value_head_dim, c.hidden), MATMUL, _ATT),
        _norm("attn_q_norm.weight", ("attention.key_length",), lambda c: (c.head_dim,)),
        _norm("attn_k_norm.weight", ("attention.key_length",), lambda c: (c.head_dim,)),
        TensorDef("attn_output.weight", lambda c: (c.hidden, c.n_heads * c.value_head_dim), MATMUL, _ATT),
        _norm("post_attention_norm.weight"),
        _norm("ffn_norm.weight"),
        TensorDef("ffn_gate.weight", lambda c: (c.ffn, c.hidden), MATMUL, _FFN),
        TensorDef("ffn_up.weight", lambda c: (c.ffn, c.hidden), MATMUL, _FFN),
        TensorDef("ffn_down.weight", lambda c: (c.hidden, c.ffn), MATMUL, _FFN),
        _norm("post_ffw_norm.weight"),
    )),),
    head_tensors=(
        _norm("output_norm.weight"),
        TensorDef("output.weight", lambda c: (c.vocab_size, c.hidden), MATMUL, (*_EMB, VOCAB_ROWS)),
    ),
    layer_costs=_layer_costs,
    # no fused_groups: every projection below is its own backend.matmul call
)


def tensor_roles(config: ModelConfig, available: set[str] | None = None) -> dict[str, dict[str, str]]:
    """Every tensor the forward pass reads, per part, with its Backend.load_weight role. `available`
    (the file's tensor names) decides tied versus separate LM head when given."""
    return SPEC.tensor_roles(config, available)


def new_layer_state(config: ModelConfig, backend: Backend, i: int, capacity: int) -> LayerState:
    """A KV cache for layer i. Sliding layers keep every token too: the backend's attention applies
    the window by position, and keeping all keys lets a session truncate to any earlier length."""
    kv = backend.new_kv_cache(config.n_kv_heads, config.head_dim, config.value_head_dim, capacity)
    return LayerState(kv=kv)


def embed(config: ModelConfig, backend: Backend, w: Weights, ids: Array) -> Array:
    x = backend.embed(w["token_embd.weight"], ids)  # (T, H)
    return backend.scale(x, math.sqrt(config.hidden))


def _attention_params(config: ModelConfig, i: int) -> tuple[float, float, int]:
    """(rope base, rope position scale, window) of layer i."""
    if config.layer_types[i] == SLIDING:
        return config.rope_base_local, 1.0, config.sliding_window
    return config.rope_base, config.rope_scale, 0


def layer(config: ModelConfig, backend: Backend, w: Weights, i: int, x: Array,
          state: LayerState | SequenceRows, positions: Array) -> Array:
    """state: one sequence's LayerState, or a batch's SequenceRows (engine/models/batch.py): every
    row-wise step runs once on the stacked rows, the attention per sequence over its own cache."""
    p = f"blk.{i}."
    eps = config.rms_eps
    T = x.shape[0]
    nh, n_kv, d, dv = config.n_heads, config.n_kv_heads, config.head_dim, config.value_head_dim
    base, pos_scale, window = _attention_params(config, i)

    # ---- attention block
    h = backend.rms_norm(x, w[p + "attn_norm.weight"], eps)
    q = backend.matmul(h, w[p + "attn_q.weight"]).reshape(T, nh, d)
    k = backend.matmul(h, w[p + "attn_k.weight"]).reshape(T, n_kv, d)
    v = backend.matmul(h, w[p + "attn_v.weight"]).reshape(T, n_kv, dv)
    q = backend.rms_norm(q, w[p + "attn_q_norm.weight"], eps)
    k = backend.rms_norm(k, w[p + "attn_k_norm.weight"], eps)
    # positions: the batch's rows' positions side by side (the executor stacks them), so rope runs once
    q = backend.rope(q, positions, config.rope_dims, base, scale=pos_scale)
    k = backend.rope(k, positions, config.rope_dims, base, scale=pos_scale)
    scale = 1.0 / math.sqrt(config.query_pre_attn_scalar)

    def attend(st: LayerState, _positions: Any, q: Array, k: Array, v: Array) -> Array:
        assert st.kv is not None  # new_layer_state gives every gemma3 layer a KV cache
        return backend.attention(q, k, v, st.kv, scale=scale, window=window)

    o = per_sequence(backend, state, positions, (q, k, v), attend)  # (T, nh, dv)
    o = backend.matmul(o.reshape(T, nh * dv), w[p + "attn_output.weight"])
    o = backend.rms_norm(o, w[p + "post_attention_norm.weight"], eps)
    # residual add and the pre-feed-forward norm in one op (a backend may fuse them)
    x, h = backend.add_rms_norm(x, o, w[p + "ffn_norm.weight"], eps)

    # ---- feed-forward block (GeGLU, tanh-approximated GELU)
    gate = backend.matmul(h, w[p + "ffn_gate.weight"])
    up = backend.matmul(h, w[p + "ffn_up.weight"])
    f = backend.matmul(backend.geglu(gate, up), w[p + "ffn_down.weight"])
    f = backend.rms_norm(f, w[p + "post_ffw_norm.weight"], eps)
    return backend.add(x, f)


def final_norm(config: ModelConfig, backend: Backend, w: Weights, x: Array) -> Array:
    """The input of the LM head."""
    return backend.rms_norm(x, w["output_norm.weight"], config.rms_eps)


def head(config: ModelConfig, backend: Backend, w: Weights, x: Array) -> Array:
    """Logits (T, vocab) for every row of x; the runner passes only the rows it needs (the last one
    while generating), since this matmul over the 262 144-row vocabulary dominates a decode step."""
    lm_head = w.get("output.weight")
    if lm_head is None:
        lm_head = w["token_embd.weight"]  # tied
    return backend.matmul(final_norm(config, backend, w, x), lm_head)
