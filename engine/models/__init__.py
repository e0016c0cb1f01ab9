"""Model files: one module per GGUF `general.architecture`, pure functions over weights and a Backend.

Every model module here fills one `SPEC` (an engine/models/spec.py ArchSpec: metadata, tensors, roles,
layouts and costs, from which config validation, the loader's roles, placement's cost model and
`minecart synth` derive) and exposes the same functions, so the executor can run any architecture
part by part, each part on its own stage:

    tensor_roles(config, available=None) -> dict[str, dict[str, str]]
        {"global": {gguf_name: role, ...}, "layer.<i>": {...}, "head": {...}} — every tensor the model
        reads, with the role passed to Backend.load_weight ("matmul", "embedding", "vector",
        "experts"). "global" = token embedding; "head" = output norm + LM head. `available` (the
        file's tensor names) picks between the layouts a file may choose.
    new_layer_state(config, backend, i, capacity) -> LayerState
        per-sequence state of layer i on that backend (KV cache, GDN conv + recurrent state).
    embed(config, backend, w, ids) -> x                       # (T, H)
    layer(config, backend, w, i, x, state, positions) -> x    # (T, H), state updated in place
    final_norm(config, backend, w, x) -> x                    # (T, H), the LM head's input
    head(config, backend, w, x) -> logits                     # (T, vocab)

`w` is a dict {gguf_name: Weight} holding (at least) the tensors of that part. `positions` is a host int
array (T,) — or (3, T) with M-RoPE — of absolute positions. GGUF tensor names are used verbatim.
Model modules never import numpy or cupy.
"""

from __future__ import annotations

from .spec import SUPPORTED_ARCHITECTURES, ArchSpec, ModelConfig, module_for, spec_for

__all__ = ["SUPPORTED_ARCHITECTURES", "ArchSpec", "ModelConfig", "module_for", "spec_for"]
