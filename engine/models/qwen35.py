"""Qwen3.5 / Qwen3.6 text models (GGUF archs `qwen35` dense and `qwen35moe`): the forward pass.

Pure functions over a weights dict {GGUF tensor name: Weight} and a Backend, following
/work/shared/docs/qwen35-architecture.md section 3 (section numbers below refer to it). Every layer is

    x = x + mixer(rms_norm(x, attn_norm))               # Gated DeltaNet or gated full attention
    x = x + ffn(rms_norm(x, post_attention_norm))       # SwiGLU, or routed experts + shared expert

Weights are used in GGUF order: GDN value head j pairs with key head j % n_k (the converter tiled the
value heads), every stored norm weight is already `1 + w` except `ssm_norm`, and `ssm_a` is already
`-exp(A_log)`. The MTP block (`blk.{n_layers}`, section 5) is not used for next-token prediction and is
not loaded. This file never imports numpy or cupy; vision input (M-RoPE with distinct components)
only needs (3, T) positions, which the backend's rope already accepts.
"""

from __future__ import annotations

import math

from ..backends.base import LayerState
from ..config import ATTN, GDN
from . import head_roles


def _layer_roles(config, i: int, available: set[str] | None) -> dict[str, str]:
    p = f"blk.{i}."
    roles = {p + "attn_norm.weight": "vector", p + "post_attention_norm.weight": "vector"}
    if config.layer_types[i] == GDN:
        for name in ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out"):
            roles[p + name + ".weight"] = "matmul"
        for name in ("ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_norm.weight"):
            roles[p + name] = "vector"
    else:
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            roles[p + name + ".weight"] = "matmul"
        roles[p + "attn_q_norm.weight"] = "vector"
        roles[p + "attn_k_norm.weight"] = "vector"
    if config.is_moe:
        roles[p + "ffn_gate_inp.weight"] = "matmul"
        fused = available is not None and p + "ffn_gate_up_exps.weight" in available
        if fused:
            roles[p + "ffn_gate_up_exps.weight"] = "experts"
        else:
            roles[p + "ffn_gate_exps.weight"] = "experts"
            roles[p + "ffn_up_exps.weight"] = "experts"
        roles[p + "ffn_down_exps.weight"] = "experts"
        shared = (config.shared_expert_ffn > 0 if available is None
                  else p + "ffn_gate_shexp.weight" in available)
        if shared:
            for name in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp"):
                roles[p + name + ".weight"] = "matmul"
    else:
        for name in ("ffn_gate", "ffn_up", "ffn_down"):
            roles[p + name + ".weight"] = "matmul"
    return roles


def tensor_roles(config, available: set[str] | None = None) -> dict[str, dict[str, str]]:
    """Every tensor the forward pass reads, per part. `available` (the file's tensor names) picks
    between the MoE layouts (separate or fused gate/up experts; shared expert present or not)."""
    roles: dict[str, dict[str, str]] = {"global": {"token_embd.weight": "embedding"}}
    for i in range(config.n_layers):
        roles[f"layer.{i}"] = _layer_roles(config, i, available)
    roles["head"] = head_roles(config, available)
    return roles


def new_layer_state(config, backend, i: int, capacity: int) -> LayerState:
    if config.layer_types[i] == GDN:
        conv = backend.zeros((config.conv_kernel - 1, config.gdn_conv_dim))
        ssm = backend.zeros((config.gdn_v_heads, config.gdn_key_dim, config.gdn_value_dim))
        return LayerState(recurrent={"conv": conv, "ssm": ssm})
    kv = backend.new_kv_cache(config.n_kv_heads, config.head_dim, config.value_head_dim, capacity)
    return LayerState(kv=kv)


def embed(config, backend, w, ids):
    return backend.embed(w["token_embd.weight"], ids)  # (T, H), no scaling


def layer(config, backend, w, i: int, x, state: LayerState, positions):
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


def feed_forward(config, backend, w, i: int, f, residual=None):
    """Layer i's FFN on its normed input f (T, H): dense SwiGLU (3.5) or MoE (3.6); with `residual`,
    residual + FFN (the dense down projection adds it itself)."""
    p = f"blk.{i}."
    if config.is_moe:
        y = _moe(config, backend, w, p, f)
        return y if residual is None else backend.add(residual, y)
    return _swiglu_ffn(backend, w, p + "ffn_", "", f, residual)


def final_norm(config, backend, w, x):
    """The input of the LM head (the fixtures' `hidden[L+1]`)."""
    return backend.rms_norm(x, w["output_norm.weight"], config.rms_eps)


def head(config, backend, w, x):
    lm_head = w.get("output.weight")
    if lm_head is None:
        lm_head = w["token_embd.weight"]  # tied: reuse the embedding (3.7)
    return backend.matmul(final_norm(config, backend, w, x), lm_head)  # (T, vocab)


# ------------------------------------------------------------------------------------------------
# mixers


def _gated_deltanet(config, be, w, p, a, state: LayerState):
    """Section 3.4 (and 3.4.1 for T > 1)."""
    mixed, z, b, alpha = be.matmul_many(a, [w[p + "attn_qkv.weight"], w[p + "attn_gate.weight"],
                                            w[p + "ssm_beta.weight"], w[p + "ssm_alpha.weight"]])
    # mixed (T, conv_dim) = [q | k | v], z (T, n_v dv), b and alpha (T, n_v)
    y = be.gdn_decode(mixed, z, b, alpha, state.recurrent["conv"], state.recurrent["ssm"],
                      w[p + "ssm_conv1d.weight"], w[p + "ssm_a"], w[p + "ssm_dt.bias"], w[p + "ssm_norm.weight"],
                      n_k=config.gdn_k_heads, n_v=config.gdn_v_heads, dk=config.gdn_key_dim,
                      dv=config.gdn_value_dim, eps=config.rms_eps)  # (T, n_v dv)
    return be.matmul(y, w[p + "ssm_out.weight"])


def _gated_attention(config, be, w, p, a, state: LayerState, positions):
    """Section 3.3: q/gate interleaved per head in attn_q, q/k RMSNorm, partial NEOX (M-)RoPE,
    contiguous GQA, sigmoid output gate."""
    T = a.shape[0]
    nh, n_kv, d, dv = config.n_heads, config.n_kv_heads, config.head_dim, config.value_head_dim
    qg, k, v = be.matmul_many(a, [w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"]])
    o = be.gated_attention(qg.reshape(T, nh, 2, d), k.reshape(T, n_kv, d), v.reshape(T, n_kv, dv), state.kv,
                           w[p + "attn_q_norm.weight"], w[p + "attn_k_norm.weight"], positions,
                           n_rot=config.rope_dims, base=config.rope_base, sections=config.rope_sections,
                           scale=1.0 / math.sqrt(d), eps=config.rms_eps)  # (T, nh dv)
    return be.matmul(o, w[p + "attn_output.weight"])


# ------------------------------------------------------------------------------------------------
# feed-forward


def _swiglu_ffn(be, w, prefix, suffix, f, residual=None):
    """(silu(f @ gate.T) * (f @ up.T)) @ down.T with tensors `{prefix}gate{suffix}.weight` etc., plus
    `residual` when given."""
    gate, up = be.matmul_many(f, [w[f"{prefix}gate{suffix}.weight"], w[f"{prefix}up{suffix}.weight"]])
    h = be.swiglu(gate, up)
    down = w[f"{prefix}down{suffix}.weight"]
    return be.matmul(h, down) if residual is None else be.matmul_add(h, down, residual)


def _moe(config, be, w, p, f):
    """Section 3.6: softmax router, top-k renormalized experts, plus the sigmoid-gated shared expert."""
    fused = w.get(p + "ffn_gate_up_exps.weight")
    routed = be.moe(
        f,
        w[p + "ffn_gate_inp.weight"],
        fused if fused is not None else w[p + "ffn_gate_exps.weight"],
        None if fused is not None else w[p + "ffn_up_exps.weight"],
        w[p + "ffn_down_exps.weight"],
        config.n_experts_used,
    )
    if p + "ffn_gate_shexp.weight" not in w:
        return routed
    shared = _swiglu_ffn(be, w, p + "ffn_", "_shexp", f)
    shared_gate = be.sigmoid(be.matmul(f, w[p + "ffn_gate_inp_shexp.weight"]))  # (T, 1)
    return be.add(routed, be.mul(shared, shared_gate))
