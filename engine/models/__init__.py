"""Model files: one module per GGUF `general.architecture`, pure functions over weights and a Backend.

Every module here exposes the same five functions, so the runner in engine/model.py can execute any
architecture layer by layer, each layer on its own device (that is all a layer split needs):

    tensor_roles(config) -> dict[str, dict[str, str]]
        {"global": {gguf_name: role, ...}, "layer.<i>": {...}, "head": {...}} — every tensor the model
        reads, with the role passed to Backend.load_weight ("matmul", "embedding", "vector",
        "experts"). "global" = token embedding; "head" = output norm + LM head.
    new_layer_state(config, backend, i, capacity) -> object
        per-sequence state of layer i on that backend (KV cache, GDN conv + recurrent state).
    embed(config, backend, w, ids) -> x                       # (T, H)
    layer(config, backend, w, i, x, state, positions) -> x    # (T, H), state updated in place
    head(config, backend, w, x) -> logits                     # (T, vocab)

`w` is a dict {gguf_name: Weight} holding (at least) the tensors of that part. `positions` is a host int
array (T,) — or (3, T) with M-RoPE — of absolute positions. GGUF tensor names are used verbatim.
Model modules never import numpy or cupy.
"""

from __future__ import annotations

import importlib


def head_roles(config, available: set[str] | None = None) -> dict[str, str]:
    """Roles of the "head" part shared by every architecture: the output norm and the LM head, which
    is the token-embedding table itself when the file has no separate `output.weight` (tied)."""
    head = {"output_norm.weight": "vector"}
    tied = config.tied_embeddings if available is None else "output.weight" not in available
    if tied:
        head["token_embd.weight"] = "embedding"  # the same table as "global": loaded once per device
    else:
        head["output.weight"] = "matmul"
    return head


def module_for(architecture: str):
    """The model module for a GGUF architecture name (qwen35moe shares qwen35's file)."""
    name = {"qwen35moe": "qwen35"}.get(architecture, architecture)
    return importlib.import_module(f"{__name__}.{name}")
