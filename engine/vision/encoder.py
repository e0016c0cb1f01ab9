"""The Qwen3.5/3.6 ViT (mmproj `qwen3vl_merger`) forward pass: pure functions over a Backend.

docs/qwen35-vision.md section 4, with GGUF tensor names verbatim:

    x = patches(frame 0) @ patch_embd.weight^T + patches(frame 1) @ patch_embd.weight.1^T + bias
      + bilinear(position table)                                   # 4.1, 4.2
    L x: x += attn_out(attention_full(rope2d(q), rope2d(k), v))     # 4.3, 4.4 (pre-LayerNorm)
         x += ffn_down(gelu_tanh(ffn_up(LayerNorm(x))))
    merger: LayerNorm per patch -> 4 consecutive patches concatenated -> mm.0 -> GELU(erf) -> mm.2   # 4.5

One image per call: attention runs over this image's patches only. Like the model files, this file never
imports numpy or cupy: host inputs (pixels, coordinates, interpolation taps) are made by preprocess.py.
"""

from __future__ import annotations

import math


def _linear(be, x, w, name):
    return be.add(be.matmul(x, w[name + ".weight"]), w[name + ".bias"])


def patch_embed(cfg, be, w, pixel_values):
    """(P, 3 * 2 * p * p) host pixels in (c, t, py, px) order -> (P, d): the Conv3d with kernel = stride,
    as one matmul per temporal slice (each slice a (d, 3 p p) matrix)."""
    P = pixel_values.shape[0]
    frames = be.asarray(pixel_values.reshape(P, 3, 2, -1))  # (P, c, t, p*p)
    per_frame = frames.shape[-1] * 3
    f0 = frames[:, :, 0, :].reshape(P, per_frame)
    f1 = frames[:, :, 1, :].reshape(P, per_frame)
    e = be.add(be.matmul(f0, w["v.patch_embd.weight"]), be.matmul(f1, w["v.patch_embd.weight.1"]))
    return be.add(e, w["v.patch_embd.bias"])


def position_embed(cfg, be, w, interp_idx, interp_wts):
    """Bilinear resampling of the 48 x 48 learned table: sum over 4 taps of weight * table row."""
    out = None
    for tap in range(interp_idx.shape[1]):
        rows = be.embed(w["v.position_embd.weight"], interp_idx[:, tap])  # (P, d)
        term = be.mul(rows, be.asarray(interp_wts[:, tap : tap + 1]))
        out = term if out is None else be.add(out, term)
    return out


def block(cfg, be, w, i, x, rowcol):
    """One pre-LN ViT block on (P, d); rowcol is the host (2, P) array of patch coordinates."""
    p = f"v.blk.{i}."
    P, d = x.shape
    nh, hd = cfg.n_heads, cfg.head_dim
    a = be.layer_norm(x, w[p + "ln1.weight"], w[p + "ln1.bias"], cfg.eps)
    qkv = _linear(be, a, w, p + "attn_qkv")  # (P, 3d): [q | k | v]
    q = be.vision_rope(qkv[:, :d].reshape(P, nh, hd), rowcol, cfg.rope_theta)
    k = be.vision_rope(qkv[:, d : 2 * d].reshape(P, nh, hd), rowcol, cfg.rope_theta)
    v = qkv[:, 2 * d :].reshape(P, nh, hd)
    o = be.attention_full(q, k, v, scale=1.0 / math.sqrt(hd))
    x = be.add(x, _linear(be, o.reshape(P, d), w, p + "attn_out"))
    b = be.layer_norm(x, w[p + "ln2.weight"], w[p + "ln2.bias"], cfg.eps)
    h = be.gelu(_linear(be, b, w, p + "ffn_up"))
    return be.add(x, _linear(be, h, w, p + "ffn_down"))


def merger(cfg, be, w, x):
    """(P, d) -> (P / 4, D): LayerNorm per patch, 2 x 2 blocks concatenated, Linear-GELU(erf)-Linear."""
    P, d = x.shape
    group = cfg.merge_size ** 2
    y = be.layer_norm(x, w["v.post_ln.weight"], w["v.post_ln.bias"], cfg.eps)
    z = y.reshape(P // group, group * d)  # merge-block order: 4 consecutive patches = one block
    u = be.gelu(_linear(be, z, w, "mm.0"), exact=True)
    return _linear(be, u, w, "mm.2")


def encode(cfg, be, w, pixel_values, rowcol, interp_idx, interp_wts, hook=None):
    """Image embeddings (N, D) on `be` for one preprocessed image.

    pixel_values (P, 3 * 2 * p * p) host float32 in merge-block order; rowcol (2, P) host int patch
    coordinates; interp_idx / interp_wts (P, 4) position-table taps. hook(name, array), when given,
    sees "patch_embed", "pos_embed", "block.<i>", "merger"."""
    x = patch_embed(cfg, be, w, pixel_values)
    pos = position_embed(cfg, be, w, interp_idx, interp_wts)
    if hook is not None:
        hook("patch_embed", x)
        hook("pos_embed", pos)
    x = be.add(x, pos)
    for i in range(cfg.n_layers):
        x = block(cfg, be, w, i, x, rowcol)
        if hook is not None:
            hook(f"block.{i}", x)
    out = merger(cfg, be, w, x)
    if hook is not None:
        hook("merger", out)
    return out
