"""Image preprocessing for the Qwen3.5/3.6 vision tower, with Pillow, as transformers does it.

Reproduces transformers' `Qwen2VLImageProcessorPil` with Qwen3.5's `preprocessor_config.json`
(docs/qwen35-vision.md section 3.1; steps 1-6 of the vision fixture's README), so the
patches equal transformers' `pixel_values` bit for bit:

1. decode (path, bytes, data: URL or a PIL image), apply the EXIF orientation, take the first frame;
   colour to RGB: transparent images (RGBA, LA, palette with tRNS, ...) are composited on white;
2. `smart_resize`: both sides to multiples of 32 px (Python round, ties to even), scaled into
   [min_pixels, max_pixels]; the cap is user-facing as a number of image tokens (one per 32 x 32 px);
3. bicubic resize (a stretch, no padding) with Pillow;
4. (v / 255 - mean) / std per channel (mean = std = 0.5 for Qwen3.5: range [-1, 1]);
5. 16 x 16 patches in merge-block order (2 x 2 blocks, block-row-major), each flattened as
   (channel, temporal, py, px) with the frame duplicated over the temporal pair.

Bad input (unreadable, truncated, unsupported, decompression bombs, absurd aspect ratios) raises
ImageError with a message a person can act on. What this file is not: the encoder (encoder.py).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ImageError

HF_MIN_PIXELS = 65536  # preprocessor_config.json size.shortest_edge (a pixel count: 64 tokens)
HF_MAX_PIXELS = 16777216  # size.longest_edge (16384 tokens); far beyond what a chat should send
DEFAULT_MAX_IMAGE_TOKENS = 1024  # default cap: about one megapixel (1024 x 1024) per image
MAX_DECODE_PIXELS = 89_478_485  # refuse to decode bigger images (decompression bombs; Pillow's limit)
MAX_ASPECT_RATIO = 200  # transformers' smart_resize limit
TEMPORAL_PATCH = 2  # Conv3d temporal kernel; a still image fills both slots with the same frame


@dataclass(frozen=True)
class PreprocessedImage:
    """One image ready for the encoder.

    pixel_values (P, 3 * 2 * p * p) float32 in merge-block order; patch_rowcol (P, 2) int (row, col)
    of each patch; grid_hw (gh, gw) patches; resized_hw (h, w) pixels; original_wh (W, H).
    """

    pixel_values: np.ndarray
    patch_rowcol: np.ndarray
    grid_hw: tuple[int, int]
    resized_hw: tuple[int, int]
    original_wh: tuple[int, int]
    merge_size: int = 2

    @property
    def merged_hw(self) -> tuple[int, int]:
        """(rows, cols) of image tokens."""
        return self.grid_hw[0] // self.merge_size, self.grid_hw[1] // self.merge_size

    @property
    def n_tokens(self) -> int:
        h, w = self.merged_hw
        return h * w


# ---------------------------------------------------------------------------------------------------
# decoding


def _describe(source) -> str:
    if isinstance(source, (str, Path)):
        text = str(source)
        return "a data: URL" if text.startswith("data:") else text
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"{len(source)} bytes of image data"
    return type(source).__name__


def _source_bytes(source) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    text = str(source)
    if text.startswith("data:"):
        head, sep, payload = text.partition(",")
        if not sep:
            raise ImageError("the data: URL has no ',' before its payload")
        if head.endswith(";base64"):
            try:  # strict: a lenient decode drops stray characters and turns "!!!!" into b""
                return base64.b64decode("".join(payload.split()), validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ImageError(f"the data: URL's base64 payload is invalid ({exc}); encode the "
                                 "picture's bytes with standard base64") from exc
        from urllib.parse import unquote_to_bytes

        return unquote_to_bytes(payload)
    if text.startswith(("http://", "https://")):
        raise ImageError(f"{text}: images are not fetched from the web; download it and give the file")
    if text.startswith("file://"):
        text = text[len("file://"):]
    path = Path(text).expanduser()
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ImageError(f"cannot read the image {path}: {exc.strerror or exc}") from exc


def open_image(source, *, max_decode_pixels: int = MAX_DECODE_PIXELS):
    """A fully decoded PIL image (first frame, EXIF orientation applied) from a path, bytes, a data:
    URL or a PIL image. Raises ImageError for anything that is not a readable picture."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    what = _describe(source)
    if isinstance(source, Image.Image):
        im = source
    else:
        data = _source_bytes(source)
        if not data:
            raise ImageError(f"{what}: the file is empty")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                im = Image.open(io.BytesIO(data))
        except UnidentifiedImageError as exc:
            raise ImageError(f"{what} is not an image format minecart can read (use PNG, JPEG, WebP, "
                             "GIF or BMP)") from exc
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ImageError(f"{what} is too large to decode safely ({exc}); scale it down "
                             "first") from exc
        except (OSError, ValueError, SyntaxError) as exc:
            raise ImageError(f"{what} could not be read ({exc})") from exc
    width, height = im.size
    if width <= 0 or height <= 0:
        raise ImageError(f"{what} has no pixels ({width}x{height})")
    if width * height > max_decode_pixels:
        raise ImageError(f"{what} is {width}x{height} = {width * height / 1e6:.0f} megapixels; images "
                         f"up to {max_decode_pixels / 1e6:.0f} megapixels are decoded (a safety limit "
                         "against decompression bombs); scale it down first")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            if getattr(im, "n_frames", 1) > 1:
                im.seek(0)  # animated images: the first frame
            im.load()
            im = ImageOps.exif_transpose(im) or im
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise ImageError(f"{what} is too large to decode safely ({exc})") from exc
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ImageError(f"{what} is damaged or truncated ({exc}); re-save or re-download it") from exc
    return im


def to_rgb(im):
    """RGB as transformers converts it: images with transparency are composited on white; 16-bit and
    float greyscale are scaled to 8 bits first (Pillow's own convert would clip them)."""
    from PIL import Image

    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        arr = np.asarray(im, dtype=np.float64)
        top = 65535.0 if im.mode.startswith("I;16") or arr.max(initial=0) > 255 else 255.0
        arr = np.clip(np.rint(arr * (255.0 / top)), 0, 255).astype(np.uint8)
        im = Image.fromarray(arr)  # 2-D uint8 -> mode L
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info:
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return im.convert("RGB")


# ---------------------------------------------------------------------------------------------------
# size rule, normalization, patches


def pixel_limits(max_tokens: int | None, factor: int = 32) -> tuple[int, int]:
    """(min_pixels, max_pixels) for a cap of `max_tokens` image tokens (None: transformers' limits)."""
    if max_tokens is None:
        return HF_MIN_PIXELS, HF_MAX_PIXELS
    if int(max_tokens) < 1:
        raise ImageError(f"the image token cap must be at least 1 (got {max_tokens})")
    max_pixels = int(max_tokens) * factor * factor
    return min(HF_MIN_PIXELS, max_pixels), max_pixels


def smart_resize(height: int, width: int, factor: int = 32, min_pixels: int = HF_MIN_PIXELS,
                 max_pixels: int = HF_MAX_PIXELS) -> tuple[int, int]:
    """(h, w) multiples of `factor` near (height, width) with min_pixels <= h * w <= max_pixels.
    Python round (ties to even) and float64, exactly as transformers."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"the image is {width}x{height}: its aspect ratio is above {MAX_ASPECT_RATIO}:1; "
                         "crop it to a less extreme shape")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return max(h_bar, factor), max(w_bar, factor)


def normalize(rgb_u8: np.ndarray, mean, std) -> np.ndarray:
    """(h, w, 3) uint8 -> (3, h, w) float32: float32(v * (1/255)) (computed in float64, as transformers'
    rescale), then (x - mean) / std in float32."""
    x = (rgb_u8.astype(np.float64) * (1.0 / 255.0)).astype(np.float32)
    y = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(y.transpose(2, 0, 1))


def patchify(chw: np.ndarray, patch: int = 16, merge: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """(3, h, w) -> pixel_values (P, 3 * 2 * patch^2) in merge-block order and patch_rowcol (P, 2)."""
    c, h, w = chw.shape
    gh, gw = h // patch, w // patch
    R, C = gh // merge, gw // merge
    x = chw.reshape(c, R, merge, patch, C, merge, patch)  # (c, R, dy, py, C, dx, px)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (R, C, dy, dx, c, py, px)
    x = np.broadcast_to(x[:, :, :, :, :, None], (R, C, merge, merge, c, TEMPORAL_PATCH, patch, patch))
    pixel_values = np.ascontiguousarray(x.reshape(R * C * merge * merge, -1), dtype=np.float32)
    rr, cc, dy, dx = np.meshgrid(np.arange(R), np.arange(C), np.arange(merge), np.arange(merge),
                                 indexing="ij")
    rowcol = np.stack([(rr * merge + dy).reshape(-1), (cc * merge + dx).reshape(-1)], axis=1)
    return pixel_values, rowcol.astype(np.int64)


def position_interpolation(patch_rowcol: np.ndarray, grid_hw, side: int = 48):
    """Bilinear taps (align_corners=True) into the side x side position table for each patch:
    indices (P, 4) and weights (P, 4) for (r0, c0), (r0, c1), (r1, c0), (r1, c1)."""
    gh, gw = grid_hw
    rows = patch_rowcol[:, 0].astype(np.float64) * (side - 1) / max(gh - 1, 1)
    cols = patch_rowcol[:, 1].astype(np.float64) * (side - 1) / max(gw - 1, 1)
    r0 = np.floor(rows).astype(np.int64)
    c0 = np.floor(cols).astype(np.int64)
    r1 = np.minimum(r0 + 1, side - 1)
    c1 = np.minimum(c0 + 1, side - 1)
    fr, fc = rows - r0, cols - c0
    idx = np.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], axis=1)
    wts = np.stack([(1 - fr) * (1 - fc), (1 - fr) * fc, fr * (1 - fc), fr * fc], axis=1)
    return idx, wts.astype(np.float32)


def preprocess_image(source, config=None, *, max_tokens: int | None = DEFAULT_MAX_IMAGE_TOKENS,
                     min_pixels: int | None = None, max_pixels: int | None = None) -> PreprocessedImage:
    """Decode, convert, resize, normalize and patchify one image for a tower `config` (VisionConfig;
    None: Qwen3.5's values). The size cap is `max_tokens` image tokens (None: transformers' limits,
    up to 16384 tokens); explicit min_pixels / max_pixels override it."""
    if config is None:  # Qwen3.5's tower
        patch, merge, mean, std = 16, 2, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    else:
        patch, merge, mean, std = config.patch_size, config.merge_size, config.image_mean, config.image_std
    factor = patch * merge
    lo, hi = pixel_limits(max_tokens, factor)
    lo = lo if min_pixels is None else int(min_pixels)
    hi = hi if max_pixels is None else int(max_pixels)
    im = open_image(source)
    rgb = to_rgb(im)
    W, H = rgb.size
    h, w = smart_resize(H, W, factor, lo, hi)
    if (w, h) != (W, H):
        from PIL import Image

        rgb = rgb.resize((w, h), resample=Image.Resampling.BICUBIC)
    arr = np.asarray(rgb, dtype=np.uint8)
    pixel_values, rowcol = patchify(normalize(arr, mean, std), patch, merge)
    return PreprocessedImage(pixel_values=pixel_values, patch_rowcol=rowcol,
                             grid_hw=(h // patch, w // patch), resized_hw=(h, w), original_wh=(W, H),
                             merge_size=merge)
