"""Image preprocessing (engine/vision/preprocess.py): bit-exact against transformers' processor on the
vision fixtures, the resize rule, colour modes, EXIF orientation, and clear ImageErrors for bad input."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from minecart.engine.errors import ImageError
from minecart.engine.vision.preprocess import (
    DEFAULT_MAX_IMAGE_TOKENS,
    open_image,
    pixel_limits,
    position_interpolation,
    preprocess_image,
    smart_resize,
    to_rgb,
)
from PIL import Image

IMAGES = ["gradient_224x224", "photo_320x180", "native_352x192", "tiny_40x30", "rgba_336x272",
          "palette_80x100"]


@pytest.fixture(scope="module")
def vision_dir(fixtures_dir):
    d = fixtures_dir / "vision"
    if not d.is_dir():
        pytest.skip("vision fixtures not found")
    return d


@pytest.mark.parametrize("name", IMAGES)
def test_pixels_equal_transformers(vision_dir, name):
    ref = np.load(vision_dir / "ref_hf" / f"image_{name}.npz")
    pre = preprocess_image(vision_dir / "images" / f"{name}.png", max_tokens=None)
    assert pre.grid_hw == tuple(int(v) for v in ref["image_grid_thw"][1:])
    assert pre.resized_hw == tuple(int(v) for v in ref["resized_hw"])
    assert pre.original_wh == tuple(int(v) for v in ref["orig_size_wh"])
    assert pre.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(pre.pixel_values, ref["pixel_values"])  # bit-exact
    np.testing.assert_array_equal(pre.patch_rowcol, ref["patch_rowcol"])
    assert pre.n_tokens == pre.pixel_values.shape[0] // 4
    idx, wts = position_interpolation(pre.patch_rowcol, pre.grid_hw)
    np.testing.assert_array_equal(idx, ref["pos_interp_indices"])
    np.testing.assert_allclose(wts, ref["pos_interp_weights"], atol=1e-5)
    # the default cap (1024 tokens) does not change these small images
    again = preprocess_image(vision_dir / "images" / f"{name}.png")
    np.testing.assert_array_equal(again.pixel_values, ref["pixel_values"])


@pytest.mark.parametrize("name", ["rgba_336x272", "palette_80x100"])
def test_transparency_composited_on_white(vision_dir, name):
    ref = np.load(vision_dir / "ref_hf" / f"image_{name}.npz")
    rgb = to_rgb(open_image(vision_dir / "images" / f"{name}.png"))
    np.testing.assert_array_equal(np.asarray(rgb), ref["rgb"])


def test_smart_resize_rules():
    assert smart_resize(272, 336) == (256, 320)  # 8.5 and 10.5 round to even
    assert smart_resize(180, 320) == (192, 352)
    assert smart_resize(30, 40) == (224, 320)  # below the minimum: scaled up
    h, w = smart_resize(4000, 6000, max_pixels=1024 * 1024)
    assert h * w <= 1024 * 1024 and h % 32 == 0 and w % 32 == 0
    assert abs(w / h - 1.5) < 0.1
    lo, hi = pixel_limits(DEFAULT_MAX_IMAGE_TOKENS)
    assert hi == DEFAULT_MAX_IMAGE_TOKENS * 1024 and lo == 65536
    assert pixel_limits(16) == (16 * 1024, 16 * 1024)
    with pytest.raises(ImageError, match="aspect ratio"):
        smart_resize(10, 5000)


def test_token_cap_scales_big_images_down(tmp_path):
    rng = np.random.default_rng(0)
    big = Image.fromarray(rng.integers(0, 255, (1500, 2000, 3), dtype=np.uint8))
    pre = preprocess_image(big, max_tokens=300)
    assert pre.n_tokens <= 300
    assert pre.n_tokens >= 200  # close to the cap, not far below
    gh, gw = pre.grid_hw
    assert abs((gw / gh) - 2000 / 1500) < 0.15


def test_modes_greyscale_palette_sixteen_bit():
    grey = Image.fromarray((np.arange(64 * 64) % 256).reshape(64, 64).astype(np.uint8))
    rgb = np.asarray(to_rgb(grey))
    assert rgb.shape == (64, 64, 3) and (rgb[..., 0] == rgb[..., 2]).all()
    deep = Image.frombytes("I;16", (64, 64), (np.arange(64 * 64) * 16).astype("<u2").tobytes())
    out = np.asarray(to_rgb(deep))
    assert out.max() > 200 and out.min() == 0  # scaled, not clipped to white
    la = Image.new("LA", (8, 8), (0, 0))  # fully transparent black -> white
    assert (np.asarray(to_rgb(la)) == 255).all()


def test_exif_orientation_applied(tmp_path):
    im = Image.new("RGB", (64, 32), (255, 0, 0))
    im.paste((0, 0, 255), (0, 0, 32, 32))  # left half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise for display
    path = tmp_path / "rot.jpg"
    im.save(path, exif=exif, quality=95)
    shown = open_image(path)
    assert shown.size == (32, 64)
    top = np.asarray(shown.convert("RGB"))[5, 16]
    assert top[2] > 200 and top[0] < 60  # the blue half is now on top


def test_sources_bytes_data_url_and_pil(vision_dir):
    path = vision_dir / "images" / "native_352x192.png"
    data = path.read_bytes()
    ref = preprocess_image(path).pixel_values
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    np.testing.assert_array_equal(preprocess_image(data).pixel_values, ref)
    np.testing.assert_array_equal(preprocess_image(url).pixel_values, ref)
    np.testing.assert_array_equal(preprocess_image(Image.open(io.BytesIO(data))).pixel_values, ref)


def _png_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16))


def test_errors_are_image_errors(tmp_path, vision_dir):
    good = (vision_dir / "images" / "photo_320x180.png").read_bytes()
    cases = {
        "missing": tmp_path / "nope.png",
        "empty": b"",
        "garbage": b"this is not a picture at all" * 10,
        "truncated": good[: len(good) // 2],
        "bomb": _png_header(60000, 60000),
        "web": "https://example.com/cat.png",
        "bad data url": "data:image/png;base64",
    }
    for what, source in cases.items():
        with pytest.raises(ImageError) as info:
            preprocess_image(source)
        assert str(info.value), what
    with pytest.raises(ImageError, match="too large"):
        preprocess_image(_png_header(60000, 60000))
    with pytest.raises(ImageError, match="too large|megapixels"):
        preprocess_image(_png_header(10000, 9000))  # above 89 MP, below Pillow's hard limit
    with pytest.raises(ImageError, match="megapixels"):
        open_image(good, max_decode_pixels=1000)
    with pytest.raises(ImageError, match="truncated|damaged"):
        preprocess_image(good[: len(good) // 2])
    # nothing stuck: a good image still works afterwards
    assert preprocess_image(good).n_tokens == 66
