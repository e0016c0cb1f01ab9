"""The vision projector ("mmproj" GGUF, llama.cpp `clip` architecture): config, discovery, loading.

A Qwen3.5/3.6 model sees images through a ViT that llama.cpp's converter writes into a separate GGUF
(`general.architecture = "clip"`, `clip.projector_type = "qwen3vl_merger"`); see
docs/qwen35-vision.md section 2. This file reads that file with the same GGUF machinery as the
text model, checks that it fits the text model (projection width = text hidden size, a text
architecture that reads image rows), loads the tensors on a Backend and exposes `VisionTower.encode`.

What this file is not: the image preprocessing (preprocess.py), the ViT maths (encoder.py) or the
placement of image rows in the token sequence (insert.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..backends.base import Backend
from ..errors import GGUFError, MissingKeyError, ShapeMismatchError
from ..gguf_file import GGUFFile
from ..models.spec import MAX_LAYERS, meta_float, meta_int, meta_list
from . import encoder

SUPPORTED_PROJECTORS = ("qwen3vl_merger",)
VISION_TEXT_ARCHITECTURES = ("qwen35", "qwen35moe")
POSITION_TABLE_SIDE = 48  # the learned 48 x 48 absolute position table (2304 rows)
EMBED_CACHE_ENTRIES = 16  # encoded images kept per tower (later chat turns re-send the same pictures)


class MmprojMismatchError(GGUFError):
    """A vision projector that does not belong to the loaded text model."""


@dataclass(frozen=True)
class VisionConfig:
    """Hyper-parameters of a `qwen3vl_merger` tower, from `clip.*` GGUF keys."""

    projector_type: str
    n_layers: int  # clip.vision.block_count
    hidden: int  # d, clip.vision.embedding_length
    ffn: int  # clip.vision.feed_forward_length
    n_heads: int
    projection_dim: int  # output width = text hidden size
    patch_size: int
    merge_size: int  # 2: one output row per 2 x 2 patches
    eps: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    n_positions: int  # rows of v.position_embd.weight (48 * 48)
    rope_theta: float = 10000.0
    file_type: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def factor(self) -> int:
        """Pixels per merged token side (patch_size * merge_size = 32)."""
        return self.patch_size * self.merge_size

    @property
    def position_side(self) -> int:
        return int(round(self.n_positions ** 0.5))

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> VisionConfig:
        path = gf.path
        arch = gf.get("general.architecture")
        if arch != "clip":
            raise MmprojMismatchError(path, f"general.architecture is {arch!r}, not 'clip': this is not a "
                                      "vision projector (mmproj) file; pass the mmproj-*.gguf that came "
                                      "with the model", key="general.architecture")
        ptype = gf.get("clip.projector_type")
        if ptype not in SUPPORTED_PROJECTORS:
            raise MmprojMismatchError(path, f"projector type {ptype!r} is not supported (minecart reads "
                                      f"{', '.join(SUPPORTED_PROJECTORS)}, the Qwen3.5/3.6 tower); use the "
                                      "mmproj converted from the same Qwen3.5/3.6 checkpoint",
                                      key="clip.projector_type")
        if gf.get("clip.has_vision_encoder") is False:
            raise MmprojMismatchError(path, "the file has no vision encoder (audio-only projector?)",
                                      key="clip.has_vision_encoder")
        deepstack = meta_list(gf, "clip.vision.is_deepstack_layers", (bool, int)) or []
        if any(bool(x) for x in deepstack):
            raise MmprojMismatchError(path, "DeepStack layers (Qwen3-VL) are not supported; Qwen3.5/3.6 "
                                      "towers have none", key="clip.vision.is_deepstack_layers")

        # Every key typed and range-checked before anything is sized from it: a hostile projector sits
        # beside a model and is opened automatically (find_mmproj).
        i = lambda key, **kw: meta_int(gf, key, **kw)  # noqa: E731
        mean = _rgb(gf, "clip.vision.image_mean", positive=False)
        std = _rgb(gf, "clip.vision.image_std", positive=True)
        pos = gf.tensors.get("v.position_embd.weight")
        if pos is None:
            raise MissingKeyError(path, "the position table is missing; re-convert the mmproj",
                                  key="v.position_embd.weight")
        hidden = i("clip.vision.embedding_length")
        n_layers = i("clip.vision.block_count", hi=MAX_LAYERS)
        cfg = cls(
            projector_type=str(ptype),
            n_layers=n_layers,
            hidden=hidden,
            ffn=i("clip.vision.feed_forward_length"),
            n_heads=i("clip.vision.attention.head_count", hi=hidden),
            projection_dim=i("clip.vision.projection_dim"),
            patch_size=i("clip.vision.patch_size", hi=1024),
            merge_size=i("clip.vision.spatial_merge_size", hi=16, default=2),
            eps=meta_float(gf, "clip.vision.attention.layer_norm_epsilon", default=1e-6),
            image_mean=mean,
            image_std=std,
            n_positions=int(pos.shape[0]),
            file_type=gf.get("general.file_type"),
        )
        if cfg.hidden % cfg.n_heads or cfg.head_dim % 4:
            raise ShapeMismatchError(path, f"width {cfg.hidden} over {cfg.n_heads} heads does not give a "
                                     "head size divisible by 4 (needed by the 2-D RoPE)",
                                     key="clip.vision.attention.head_count")
        if len(pos.shape) != 2 or cfg.n_positions < 1 or pos.shape[1] != cfg.hidden \
                or cfg.position_side ** 2 != cfg.n_positions:
            raise ShapeMismatchError(path, f"shape {tuple(pos.shape)} is not a square grid of "
                                     f"{cfg.hidden}-wide rows (clip.vision.embedding_length); re-convert "
                                     "the mmproj", tensor="v.position_embd.weight")
        last = f"v.blk.{n_layers - 1}.attn_qkv.weight"
        if n_layers and last not in gf.tensors:
            raise ShapeMismatchError(path, f"clip.vision.block_count says {n_layers} blocks but tensor "
                                     f"'{last}' is missing; re-convert the mmproj",
                                     key="clip.vision.block_count")
        return cfg


def _rgb(gf: GGUFFile, key: str, *, positive: bool) -> tuple[float, float, float]:
    """A per-channel image mean or std: three finite numbers (std > 0); (0.5, 0.5, 0.5) if absent."""
    values = meta_list(gf, key, (int, float), min_len=3)
    if values is None:
        return (0.5, 0.5, 0.5)
    ok = len(values) == 3 and all(not isinstance(v, bool) and math.isfinite(v) for v in values)
    if not ok or (positive and min(values) <= 0):
        raise GGUFError(gf.path, f"expected 3 finite numbers (one per RGB channel{', each > 0' if positive else ''}"
                        f"), got {str(values)[:60]}; re-convert the mmproj", key=key)
    return (float(values[0]), float(values[1]), float(values[2]))


def tensor_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the encoder reads with its logical (row-major) shape."""
    d, f, p, D = cfg.hidden, cfg.ffn, cfg.patch_size, cfg.projection_dim
    m = d * cfg.merge_size ** 2
    shapes = {
        "v.patch_embd.weight": (d, 3, p, p),
        "v.patch_embd.weight.1": (d, 3, p, p),
        "v.patch_embd.bias": (d,),
        "v.position_embd.weight": (cfg.n_positions, d),
        "v.post_ln.weight": (d,), "v.post_ln.bias": (d,),
        "mm.0.weight": (m, m), "mm.0.bias": (m,),
        "mm.2.weight": (D, m), "mm.2.bias": (D,),
    }
    for i in range(cfg.n_layers):
        b = f"v.blk.{i}."
        shapes.update({
            b + "ln1.weight": (d,), b + "ln1.bias": (d,), b + "ln2.weight": (d,), b + "ln2.bias": (d,),
            b + "attn_qkv.weight": (3 * d, d), b + "attn_qkv.bias": (3 * d,),
            b + "attn_out.weight": (d, d), b + "attn_out.bias": (d,),
            b + "ffn_up.weight": (f, d), b + "ffn_up.bias": (f,),
            b + "ffn_down.weight": (d, f), b + "ffn_down.bias": (d,),
        })
    return shapes


def _role(name: str) -> str:
    if name == "v.position_embd.weight":
        return "embedding"  # 4 bilinear taps per patch are row lookups
    if name.endswith(".bias") or ".ln" in name or "post_ln" in name:
        return "vector"
    return "matmul"


def check_fits(cfg: VisionConfig, text_config, path) -> None:
    """Raise MmprojMismatchError when this tower cannot feed `text_config`'s model."""
    arch = text_config.architecture
    if arch not in VISION_TEXT_ARCHITECTURES:
        raise MmprojMismatchError(path, f"the text model's architecture is {arch!r}; a "
                                  f"{cfg.projector_type} tower feeds Qwen3.5/3.6 models "
                                  f"({', '.join(VISION_TEXT_ARCHITECTURES)}) only")
    hidden = int(text_config.hidden)
    if cfg.projection_dim != hidden:
        raise MmprojMismatchError(path, f"the projector outputs {cfg.projection_dim}-wide embeddings but "
                                  f"the text model's hidden size is {hidden}: this mmproj belongs to "
                                  "another model size; use the mmproj converted with this model",
                                  key="clip.vision.projection_dim")


class VisionTower:
    """A loaded vision projector on one Backend. `encode(image)` -> (N, D) float32 host embeddings.

    Attributes: path, gguf, config (VisionConfig), backend, weights {GGUF name: Weight}, and
    max_image_tokens (the default cap of tokens per image, see preprocess.DEFAULT_MAX_IMAGE_TOKENS).
    Encoded images are cached by content (a chat re-sends its pictures every turn).
    """

    def __init__(self, path, gguf: GGUFFile, config: VisionConfig, backend: Backend, weights: dict,
                 max_image_tokens: int | None = None):
        from .preprocess import DEFAULT_MAX_IMAGE_TOKENS

        self.path = Path(path)
        self.gguf = gguf
        self.config = config
        self.backend = backend
        self.weights = weights
        self.max_image_tokens = int(max_image_tokens or DEFAULT_MAX_IMAGE_TOKENS)
        self._cache: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def preprocess(self, image, *, max_image_tokens: int | None = None):
        """preprocess.PreprocessedImage for an image source (path, bytes, data: URL, PIL image)."""
        from .preprocess import preprocess_image

        return preprocess_image(image, self.config, max_tokens=max_image_tokens or self.max_image_tokens)

    def encode_pixels(self, pre) -> np.ndarray:
        """(N, D) float32 host embeddings of a PreprocessedImage (no cache)."""
        from .preprocess import position_interpolation

        idx, wts = position_interpolation(pre.patch_rowcol, pre.grid_hw, self.config.position_side)
        out = encoder.encode(self.config, self.backend, self.weights, pre.pixel_values,
                             pre.patch_rowcol.T, idx, wts)
        return np.asarray(self.backend.to_numpy(out), dtype=np.float32)

    def encode(self, image, *, max_image_tokens: int | None = None):
        """(PreprocessedImage, (N, D) embeddings) for an image source; cached by pixel content."""
        pre = self.preprocess(image, max_image_tokens=max_image_tokens)
        key = (pre.grid_hw, hashlib.sha1(pre.pixel_values.tobytes()).hexdigest())
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return pre, hit
        emb = self.encode_pixels(pre)
        emb.setflags(write=False)
        with self._lock:
            self._cache[key] = emb
            while len(self._cache) > EMBED_CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return pre, emb

    def close(self) -> None:
        for wt in self.weights.values():
            self.backend.free(wt)
        self.weights = {}
        self._cache.clear()

    def __repr__(self) -> str:
        c = self.config
        return (f"VisionTower({self.path.name!r}, {c.n_layers} blocks, d={c.hidden}, "
                f"heads={c.n_heads}, out={c.projection_dim}, on {self.backend.device})")


def _zero_padded(gf: GGUFFile, info, rows: int = 0, cols: int = 0):
    """An F32 TensorInfo of `info` with `rows` zero rows / `cols` zero columns appended."""
    from .. import quants

    data = np.asarray(quants.dequantize(info, path=gf.path), dtype=np.float32)
    if data.ndim == 1:
        data = np.concatenate([data, np.zeros(rows, np.float32)])
    else:
        data = np.pad(data, ((0, rows), (0, cols)))
    data = np.ascontiguousarray(data)
    raw = data.view(np.uint8).reshape(data.shape[0], -1) if data.ndim == 2 else data.view(np.uint8)
    return dataclasses.replace(info, ggml_type=0, type_name="F32", shape=tuple(data.shape), raw=raw,
                               n_bytes=int(data.nbytes))


def load_vision(path, text_config=None, backend: Backend | None = None, *,
                max_image_tokens: int | None = None) -> VisionTower:
    """Open an mmproj GGUF, check it (and that it fits `text_config` when given), load its tensors on
    `backend` (default: the NumPy backend on the CPU)."""
    gf = GGUFFile(path)
    try:
        cfg = VisionConfig.from_gguf(gf)
        if text_config is not None:
            check_fits(cfg, text_config, gf.path)
        shapes = tensor_shapes(cfg)
        for name, shape in shapes.items():
            info = gf.tensor(name)
            if tuple(info.shape) != shape:
                raise ShapeMismatchError(gf.path, f"shape {tuple(info.shape)} does not match the metadata "
                                         f"(expected {shape}); re-convert the mmproj", tensor=name)
        if backend is None:
            from ..backends.numpy_backend import NumpyBackend

            backend = NumpyBackend("cpu:0")
        # GPU matmuls take rows of whole 32-value blocks; the 27B tower's MLP is 4304 wide. Zero rows
        # in ffn_up (+ bias) and zero columns in ffn_down give the same result: gelu(0) = 0.
        pad = 0 if backend.name == "numpy" else -cfg.ffn % 32
        weights = {}
        for name in shapes:
            info = gf.tensor(name)
            if name.startswith("v.patch_embd.weight"):
                # the (d, 3, p, p) kernel slice is a (d, 3 p p) matrix over one flattened frame
                info = dataclasses.replace(info, shape=(cfg.hidden, 3 * cfg.patch_size ** 2),
                                           raw=np.asarray(info.raw).reshape(cfg.hidden, -1))
            if pad and (".ffn_up." in name or ".ffn_down." in name):
                info = _zero_padded(gf, info, rows=pad if ".ffn_up." in name else 0,
                                    cols=pad if ".ffn_down." in name else 0)
            weights[name] = backend.load_weight(info, role=_role(name))
    except BaseException:
        gf.close()
        raise
    return VisionTower(path, gf, cfg, backend, weights, max_image_tokens=max_image_tokens)


def mmproj_candidates(model_path) -> list[Path]:
    """mmproj*.gguf files next to a model, the likeliest partner first (longest shared name)."""
    model_path = Path(model_path)
    folder = model_path.parent
    try:
        found = [p for p in folder.iterdir()
                 if p.is_file() and p.suffix.lower() == ".gguf" and p.name.lower().startswith("mmproj")
                 and p != model_path]
    except OSError:
        return []
    stem = model_path.stem.lower()

    def shared(p: Path) -> int:
        name = p.stem.lower()
        for prefix in ("mmproj-", "mmproj_", "mmproj"):
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        n = 0
        while n < min(len(name), len(stem)) and name[n] == stem[n]:
            n += 1
        return n + (1000 if name == stem else 0)

    return sorted(found, key=lambda p: (-shared(p), p.name))


def find_mmproj(model_path, text_config=None) -> Path | None:
    """The vision projector beside a model file: the best-named mmproj*.gguf that fits the text
    model (projector type known, projection width = hidden size). None when there is none."""
    for cand in mmproj_candidates(model_path):
        try:
            with GGUFFile(cand) as gf:
                cfg = VisionConfig.from_gguf(gf)
                if text_config is not None:
                    check_fits(cfg, text_config, cand)
        except GGUFError:
            continue  # another model's projector, or not one we can run: not this model's partner
        return cand
    return None
