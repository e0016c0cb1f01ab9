"""The engine's entry to a model's hyper-parameters: `ModelConfig.from_gguf(gf)` and
`validate_tensors(config, gf)`.

ModelConfig is one frozen dataclass for every supported architecture; fields that an architecture lacks
keep their defaults. Layer kinds are spelled out per layer in `layer_types` so model code and placement
never re-derive them. What each architecture reads from the metadata, and which tensors with which
shapes it needs, is written once in its model file's spec (engine/models/<arch>.py SPEC, described in
engine/models/spec.py); this module only names those for the rest of the engine. A missing required
key fails with the key's name (MissingKeyError), a missing or misshapen tensor with the tensor's name.
"""

from __future__ import annotations

from .models.spec import (
    ATTN,
    GDN,
    SLIDING,
    SUPPORTED_ARCHITECTURES,
    GGUFLike,
    ModelConfig,
    spec_for,
)

__all__ = ["ATTN", "GDN", "SLIDING", "SUPPORTED_ARCHITECTURES", "ModelConfig", "validate_tensors"]


def validate_tensors(config: ModelConfig, gguf_file: GGUFLike) -> None:
    """Raise MissingTensorError / ShapeMismatchError (naming the tensor and the metadata keys that
    imply its shape) unless the file holds every tensor `config` needs, each with the right shape.
    Tensors of MTP blocks are optional but checked when present; extra tensors are ignored."""
    spec_for(config.architecture, gguf_file.path).validate_tensors(config, gguf_file)
