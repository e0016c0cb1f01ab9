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
    return backend.add(x, feed_forward(config, backend, w, i, f))


def feed_forward(config, backend, w, i: int, f):
    """Layer i's FFN on its normed input f (T, H): dense SwiGLU (3.5) or MoE (3.6)."""
    p = f"blk.{i}."
    if config.is_moe:
        return _moe(config, backend, w, p, f)
    return _swiglu_ffn(backend, w, p + "ffn_", "", f)


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
    T = a.shape[0]
    n_k, n_v = config.gdn_k_heads, config.gdn_v_heads
    dk, dv = config.gdn_key_dim, config.gdn_value_dim
    key_dim = n_k * dk
    mixed = be.matmul(a, w[p + "attn_qkv.weight"])  # (T, conv_dim): [q | k | v]
    z = be.matmul(a, w[p + "attn_gate.weight"]).reshape(T, n_v, dv)
    b = be.matmul(a, w[p + "ssm_beta.weight"])  # (T, n_v)
    alpha = be.matmul(a, w[p + "ssm_alpha.weight"])  # (T, n_v)
    u = be.conv1d_silu(mixed, state.recurrent["conv"], w[p + "ssm_conv1d.weight"])
    q = u[:, :key_dim].reshape(T, n_k, dk)
    k = u[:, key_dim : 2 * key_dim].reshape(T, n_k, dk)
    v = u[:, 2 * key_dim :].reshape(T, n_v, dv)
    q = be.scale(be.l2_norm(q, config.rms_eps), 1.0 / math.sqrt(dk))
    k = be.l2_norm(k, config.rms_eps)
    g, beta = be.gdn_gates(alpha, b, w[p + "ssm_a"], w[p + "ssm_dt.bias"])
    if T == 1:
        o = be.gdn_step(q, k, v, g, beta, state.recurrent["ssm"])
    else:
        o = be.gdn_chunk(q, k, v, g, beta, state.recurrent["ssm"], chunk=64)
    y = be.gated_rms_norm(o, z, w[p + "ssm_norm.weight"], config.rms_eps)  # (T, n_v, dv)
    return be.matmul(y.reshape(T, n_v * dv), w[p + "ssm_out.weight"])


def _gated_attention(config, be, w, p, a, state: LayerState, positions):
    """Section 3.3: q/gate interleaved per head in attn_q, q/k RMSNorm, partial NEOX (M-)RoPE,
    contiguous GQA, sigmoid output gate."""
    T = a.shape[0]
    nh, n_kv, d, dv = config.n_heads, config.n_kv_heads, config.head_dim, config.value_head_dim
    qg = be.matmul(a, w[p + "attn_q.weight"]).reshape(T, nh, 2, d)
    q = qg[:, :, 0, :]
    gate = qg[:, :, 1, :]
    k = be.matmul(a, w[p + "attn_k.weight"]).reshape(T, n_kv, d)
    v = be.matmul(a, w[p + "attn_v.weight"]).reshape(T, n_kv, dv)
    q = be.rms_norm(q, w[p + "attn_q_norm.weight"], config.rms_eps)
    k = be.rms_norm(k, w[p + "attn_k_norm.weight"], config.rms_eps)
    q = be.rope(q, positions, config.rope_dims, config.rope_base, sections=config.rope_sections)
    k = be.rope(k, positions, config.rope_dims, config.rope_base, sections=config.rope_sections)
    o = be.attention(q, k, v, state.kv, scale=1.0 / math.sqrt(d))  # (T, nh, dv)
    o = be.mul(o, be.sigmoid(gate))
    return be.matmul(o.reshape(T, nh * dv), w[p + "attn_output.weight"])


# ------------------------------------------------------------------------------------------------
# feed-forward


def _swiglu_ffn(be, w, prefix, suffix, f):
    """(silu(f @ gate.T) * (f @ up.T)) @ down.T with tensors `{prefix}gate{suffix}.weight` etc."""
    gate = be.matmul(f, w[f"{prefix}gate{suffix}.weight"])
    up = be.matmul(f, w[f"{prefix}up{suffix}.weight"])
    return be.matmul(be.swiglu(gate, up), w[f"{prefix}down{suffix}.weight"])


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
