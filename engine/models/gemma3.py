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

from ..backends.base import LayerState
from ..config import SLIDING
from . import head_roles

_LAYER_VECTORS = (
    "attn_norm",
    "attn_q_norm",
    "attn_k_norm",
    "post_attention_norm",
    "ffn_norm",
    "post_ffw_norm",
)
_LAYER_MATMULS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def tensor_roles(config, available: set[str] | None = None) -> dict[str, dict[str, str]]:
    """Every tensor the forward pass reads, per part, with its Backend.load_weight role. `available`
    (the file's tensor names) decides tied versus separate LM head when given."""
    roles: dict[str, dict[str, str]] = {"global": {"token_embd.weight": "embedding"}}
    for i in range(config.n_layers):
        part = {f"blk.{i}.{n}.weight": "vector" for n in _LAYER_VECTORS}
        part.update({f"blk.{i}.{n}.weight": "matmul" for n in _LAYER_MATMULS})
        roles[f"layer.{i}"] = part
    roles["head"] = head_roles(config, available)
    return roles


def new_layer_state(config, backend, i: int, capacity: int) -> LayerState:
    """A KV cache for layer i. Sliding layers keep every token too: the backend's attention applies
    the window by position, and keeping all keys lets a session truncate to any earlier length."""
    kv = backend.new_kv_cache(config.n_kv_heads, config.head_dim, config.value_head_dim, capacity)
    return LayerState(kv=kv)


def embed(config, backend, w, ids):
    x = backend.embed(w["token_embd.weight"], ids)  # (T, H)
    return backend.scale(x, math.sqrt(config.hidden))


def _attention_params(config, i: int) -> tuple[float, float, int]:
    """(rope base, rope position scale, window) of layer i."""
    if config.layer_types[i] == SLIDING:
        return config.rope_base_local, 1.0, config.sliding_window
    return config.rope_base, config.rope_scale, 0


def layer(config, backend, w, i: int, x, state: LayerState, positions):
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
    q = backend.rope(q, positions, config.rope_dims, base, scale=pos_scale)
    k = backend.rope(k, positions, config.rope_dims, base, scale=pos_scale)
    scale = 1.0 / math.sqrt(config.query_pre_attn_scalar)
    o = backend.attention(q, k, v, state.kv, scale=scale, window=window)  # (T, nh, dv)
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


def final_norm(config, backend, w, x):
    """The input of the LM head."""
    return backend.rms_norm(x, w["output_norm.weight"], config.rms_eps)


def head(config, backend, w, x):
    """Logits (T, vocab) for every row of x; the runner passes only the rows it needs (the last one
    while generating), since this matmul over the 262 144-row vocabulary dominates a decode step."""
    lm_head = w.get("output.weight")
    if lm_head is None:
        lm_head = w["token_embd.weight"]  # tied
    return backend.matmul(final_norm(config, backend, w, x), lm_head)
