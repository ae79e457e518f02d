"""decode.py: every Pillow mode to the right RGB values, EXIF, first frames, each error code, draft."""

from __future__ import annotations

import io
import random
import struct
import time
import zlib
from typing import Any

import numpy as np
import pytest
from PIL import Image

from vit_backbone.decode import ALLOWED_FORMATS, DecodeLimits, decode, decode_image, to_rgb
from vit_backbone.errors import ImageDecodeError, InvalidOptionError

BG = (10, 200, 30)  # a background no test image uses, so compositing is visible


def encode(image: Image.Image, fmt: str, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A syntactically valid PNG header claiming width x height, with an empty IDAT: tiny bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    )


def photo(width: int, height: int) -> Image.Image:
    """A smooth RGB image (JPEG-friendly, unlike noise)."""
    y, x = np.mgrid[0:height, 0:width]
    arr = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    return Image.fromarray(arr.astype(np.uint8))


def px(image: Image.Image, xy: tuple[int, int]) -> tuple[int, ...]:
    value = image.getpixel(xy)
    if not isinstance(value, tuple):
        raise TypeError(f"expected a multi-band pixel, got {value!r}")
    return value


def error_code(data: bytes, **kwargs: Any) -> str:
    with pytest.raises(ImageDecodeError) as info:
        decode_image(data, **kwargs)
    return info.value.code


# --- modes -------------------------------------------------------------------------------------------


def test_rgb_png_round_trips_exactly() -> None:
    src = photo(37, 23)
    out = decode_image(encode(src, "PNG"))
    assert out.mode == "RGB" and out.size == (37, 23)
    assert np.array_equal(np.asarray(out), np.asarray(src))


def test_palette_with_transparency_composites_on_background() -> None:
    img = Image.new("P", (4, 1))
    img.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)  # index 0 red, index 1 blue
    img.putdata([0, 1, 1, 0])
    out = decode_image(encode(img, "PNG", transparency=0), limits=DecodeLimits(background=BG))
    assert out.getpixel((0, 0)) == BG  # the transparent index hides red
    assert out.getpixel((1, 0)) == (0, 0, 255)


def test_grey_modes() -> None:
    assert decode_image(encode(Image.new("L", (3, 3), 77), "PNG")).getpixel((1, 1)) == (77, 77, 77)
    assert to_rgb(Image.new("1", (2, 2), 1)).getpixel((0, 0)) == (255, 255, 255)
    la = Image.new("LA", (2, 1))
    la.putdata([(100, 255), (100, 0)])
    out = decode_image(encode(la, "PNG"), limits=DecodeLimits(background=BG))
    assert out.getpixel((0, 0)) == (100, 100, 100) and out.getpixel((1, 0)) == BG


def test_rgba_is_alpha_composited_not_alpha_dropped() -> None:
    rgba = Image.new("RGBA", (3, 1))
    rgba.putdata([(255, 0, 0, 0), (255, 0, 0, 255), (0, 0, 255, 128)])  # red hidden under alpha 0
    data = encode(rgba, "PNG")
    assert Image.open(io.BytesIO(data)).convert("RGB").getpixel((0, 0)) == (255, 0, 0)  # the naive bug
    out = decode_image(data)  # default background: white
    assert out.getpixel((0, 0)) == (255, 255, 255)
    assert out.getpixel((1, 0)) == (255, 0, 0)
    r, g, b = px(out, (2, 0))  # half blue over white
    assert abs(r - 127) <= 1 and abs(g - 127) <= 1 and b == 255
    assert decode_image(data, limits=DecodeLimits(background=BG)).getpixel((0, 0)) == BG


def test_cmyk() -> None:
    img = Image.new("CMYK", (2, 1))
    img.putdata([(0, 0, 0, 0), (255, 0, 0, 0)])  # white, cyan
    assert to_rgb(img).getpixel((0, 0)) == (255, 255, 255)
    assert to_rgb(img).getpixel((1, 0)) == (0, 255, 255)
    out = decode_image(encode(Image.new("CMYK", (16, 16), (255, 0, 0, 0)), "JPEG", quality=95))
    r, g, b = px(out, (8, 8))
    assert r < 10 and g > 245 and b > 245


def test_16bit_png_is_scaled_by_bit_depth_not_saturated() -> None:
    arr = np.array([[0, 32896, 65535]], dtype=np.uint16)  # 32896 = 128 * 257
    data = encode(Image.fromarray(arr), "PNG")
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    assert Image.open(io.BytesIO(data)).convert("RGB").getpixel((1, 0)) == (255, 255, 255)  # the bug
    out = decode_image(data)
    assert [out.getpixel((x, 0)) for x in range(3)] == [(0, 0, 0), (128, 128, 128), (255, 255, 255)]


def test_int32_and_float_modes() -> None:
    as_i = Image.fromarray(np.array([[0, 32896, 65535]], dtype=np.int32))
    assert as_i.mode == "I"
    assert to_rgb(as_i).getpixel((1, 0)) == (128, 128, 128)  # values fit 16 bits: read as 16-bit
    unit = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32))
    assert [px(to_rgb(unit), (x, 0))[0] for x in range(3)] == [0, 128, 255]  # [0, 1] → ×255
    wide = Image.fromarray(np.array([[-5.0, 100.0, 300.0, np.nan]], dtype=np.float32))
    assert [px(to_rgb(wide), (x, 0))[0] for x in range(4)] == [0, 100, 255, 0]  # clipped, NaN → 0


def test_colour_spaces_via_pillow() -> None:
    assert to_rgb(Image.new("HSV", (1, 1), (0, 255, 255))).getpixel((0, 0)) == (255, 0, 0)
    assert to_rgb(Image.new("YCbCr", (1, 1), (128, 128, 128))).getpixel((0, 0)) == (128, 128, 128)
    r, g, b = px(to_rgb(Image.new("LAB", (1, 1), (128, 128, 128))), (0, 0))  # L=50, a=b=0
    assert r == g == b and 110 < r < 130


def test_to_rgb_returns_a_new_image() -> None:
    src = Image.new("RGB", (2, 2), (1, 2, 3))
    out = to_rgb(src)
    assert out is not src and out.getpixel((0, 0)) == (1, 2, 3)


# --- orientation, frames -----------------------------------------------------------------------------


def oriented_jpeg(width: int, height: int, orientation: int) -> bytes:
    img = Image.new("RGB", (width, height), (255, 0, 0))
    img.paste((0, 0, 255), (width // 2, 0, width, height))  # stored: left red, right blue
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(img, "JPEG", quality=95, exif=exif.tobytes())


def test_exif_orientation_6_rotates_to_display_orientation() -> None:
    decoded = decode(oriented_jpeg(40, 20, 6))
    out = decoded.image
    assert out.size == (20, 40) and decoded.source_size == (40, 20)  # (H, W) in display orientation
    top, bottom = px(out, (10, 5)), px(out, (10, 35))  # rotated 90° clockwise: left → top
    assert top[0] > 200 and top[2] < 60
    assert bottom[2] > 200 and bottom[0] < 60


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow reports the corrupt EXIF it skips
def test_broken_exif_does_not_lose_the_image() -> None:
    data = encode(photo(16, 8), "JPEG", exif=b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\xff\xff garbage")
    assert decode_image(data).size == (16, 8)


def test_first_frame_of_animations() -> None:
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    for fmt in ("GIF", "WEBP", "TIFF"):
        extra = {"lossless": True} if fmt == "WEBP" else {}
        data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], **extra)
        assert getattr(Image.open(io.BytesIO(data)), "n_frames", 1) == 3
        assert decode_image(data).getpixel((4, 4)) == (255, 0, 0), fmt


# --- error codes -------------------------------------------------------------------------------------


def test_empty_and_garbage() -> None:
    assert error_code(b"") == "empty"
    assert error_code(b"this is not an image at all" * 4) == "not_an_image"
    assert error_code(bytes(range(256))) == "not_an_image"


def test_jpeg_truncated_in_header_and_in_scan_data() -> None:
    data = encode(photo(64, 48), "JPEG")
    for cut in (3, 20, 100, 200):
        assert error_code(data[:cut]) == "truncated", cut
    assert error_code(data[: len(data) // 2]) == "truncated"  # opens fine, fails in load()


def test_zero_size_header() -> None:
    assert error_code(png_header_only(0, 10)) == "zero_size"
    assert error_code(png_header_only(10, 0)) == "zero_size"


def test_decompression_bomb_refused_from_header_without_decoding() -> None:
    bomb = png_header_only(20000, 20000)  # 400 MP claimed in ~60 bytes
    assert len(bomb) < 100
    start = time.perf_counter()
    assert error_code(bomb) == "too_many_pixels"
    # 49 MP: below Pillow's own bomb threshold, so this is our limit firing, not Pillow's global.
    assert error_code(png_header_only(7000, 7000)) == "too_many_pixels"
    assert time.perf_counter() - start < 0.5
    small = encode(Image.new("RGB", (20, 20)), "PNG")
    assert error_code(small, limits=DecodeLimits(max_pixels=399)) == "too_many_pixels"
    assert decode_image(small, limits=DecodeLimits(max_pixels=400)).size == (20, 20)


def test_extreme_aspect_ratio() -> None:
    assert error_code(encode(Image.new("RGB", (2000, 1)), "PNG")) == "aspect_ratio"
    assert error_code(encode(Image.new("RGB", (1, 2000)), "PNG")) == "aspect_ratio"
    strip = encode(Image.new("RGB", (200, 10)), "PNG")
    assert decode_image(strip, limits=DecodeLimits(max_aspect_ratio=20.0)).size == (200, 10)


def test_unsupported_formats() -> None:
    assert error_code(encode(Image.new("RGB", (16, 16)), "ICO")) == "unsupported_format"
    assert error_code(encode(Image.new("RGB", (16, 16)), "TGA")) == "unsupported_format"
    assert error_code(b"8BPS\x00\x01" + bytes(40)) == "unsupported_format"  # PSD
    assert error_code(b"\x00\x00\x00\x1cftypavif" + bytes(40)) == "unsupported_format"
    png_bytes = encode(Image.new("RGB", (4, 4)), "PNG")
    with pytest.raises(ImageDecodeError, match="PNG images are not accepted") as info:
        decode_image(png_bytes, limits=DecodeLimits(formats=("JPEG",)))
    assert info.value.code == "unsupported_format"


def test_too_many_bytes() -> None:
    data = encode(Image.new("RGB", (4, 4)), "PNG")
    assert error_code(data, limits=DecodeLimits(max_bytes=len(data) - 1)) == "too_large"


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow warns about the corrupt TIFF/EXIF it skips
def test_no_decoder_exception_escapes_on_corrupted_bytes() -> None:
    rng = random.Random(1234)
    seeds = [encode(photo(24, 16), fmt) for fmt in ALLOWED_FORMATS]
    for _ in range(300):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[: rng.randrange(1, len(data))]
        try:
            out = decode_image(bytes(data))
        except ImageDecodeError:
            continue
        assert out.mode == "RGB"


def test_limits_are_validated() -> None:
    with pytest.raises(InvalidOptionError, match="ICO"):
        DecodeLimits(formats=("PNG", "ICO"))
    with pytest.raises(InvalidOptionError):
        DecodeLimits(max_pixels=0)
    with pytest.raises(InvalidOptionError):
        DecodeLimits(background=(0, 0, 256))
    with pytest.raises(InvalidOptionError):
        decode_image(encode(Image.new("RGB", (4, 4)), "PNG"), min_size=(0, 4))


# --- JPEG draft --------------------------------------------------------------------------------------


def test_jpeg_draft_downscales_in_dct_domain_but_not_below_min_size() -> None:
    data = encode(photo(1600, 1200), "JPEG", quality=90)
    decoded = decode(data, min_size=(256, 256))
    w, h = decoded.image.size
    assert 256 <= w <= 800 and 256 <= h <= 600
    assert (w, h) == (400, 300) and decoded.draft_scale == 4
    assert decoded.source_size == (1200, 1600)
    assert decode_image(data).size == (1600, 1200)  # no min_size: full size
    assert decode_image(data, min_size=(1000, 1000)).size == (1600, 1200)  # not 2x larger: no draft
    png = decode(encode(photo(1600, 1200), "PNG"), min_size=(256, 256))
    assert png.image.size == (1600, 1200) and png.draft_scale == 1  # draft is JPEG-only


def test_jpeg_draft_accounts_for_exif_rotation() -> None:
    data = oriented_jpeg(1600, 1200, 6)  # displayed as 1200 wide x 1600 high
    decoded = decode(data, min_size=(300, 700))  # display orientation: (min_w, min_h)
    w, h = decoded.image.size
    assert w >= 300 and h >= 700
    assert (w, h) == (600, 800) and decoded.draft_scale == 2
