"""Untrusted bytes → a fully loaded RGB image, or an :class:`ImageDecodeError` with a stable ``code``.

Uploaded bytes are hostile until proven otherwise, so every limit is checked from the header *before*
pixels are decoded, only an allow-list of well-trodden formats is handed to Pillow's parsers, and no
Pillow global (``MAX_IMAGE_PIXELS``, ``LOAD_TRUNCATED_IMAGES``) is read as a safety net or mutated.
Any exception a decoder raises becomes an ``ImageDecodeError`` so that callers only ever handle one type.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import numpy as np
from PIL import Image, ImageOps, JpegImagePlugin, UnidentifiedImageError

from vit_backbone.errors import ImageDecodeError, InvalidOptionError

ALLOWED_FORMATS: Final = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")

# EXIF orientations that swap width and height (transpose / rotate 90 / transverse / rotate 270).
_SWAPPING_ORIENTATIONS: Final = frozenset({5, 6, 7, 8})
_EXIF_ORIENTATION_TAG: Final = 0x0112
_TIFF_BITS_PER_SAMPLE: Final = 258
_TIFF_SAMPLE_FORMAT: Final = 339

# (min_w, min_h) in display orientation, computed from the (H, W) display size of the full image.
MinSizeFn = Callable[[tuple[int, int]], tuple[int, int] | None]


@dataclass(frozen=True)
class DecodeLimits:
    """What an upload may cost us. The defaults admit any real photo (40 MP) while refusing bombs.

    ``max_pixels`` is checked from the header, before any pixel is decoded. Pillow's own global bomb
    check still runs inside ``Image.open``: it cannot be raised above (2 × ``Image.MAX_IMAGE_PIXELS``,
    about 179 MP by default, reported here as ``too_many_pixels`` too) and it emits a
    ``DecompressionBombWarning`` for headers above ``MAX_IMAGE_PIXELS``, which we leave to the logs
    rather than touch process-global warning filters.
    """

    max_bytes: int = 32 * 1024 * 1024
    max_pixels: int = 40_000_000
    max_aspect_ratio: float = 20.0
    formats: tuple[str, ...] = ALLOWED_FORMATS
    background: tuple[int, int, int] = (255, 255, 255)

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidOptionError(f"DecodeLimits.{name} must be a positive int, got {value!r}")
        if not isinstance(self.max_aspect_ratio, int | float) or not self.max_aspect_ratio >= 1.0:
            raise InvalidOptionError(
                f"DecodeLimits.max_aspect_ratio must be a number >= 1.0, got {self.max_aspect_ratio!r}"
            )
        if not isinstance(self.formats, tuple) or not self.formats:
            raise InvalidOptionError(
                f"DecodeLimits.formats must be a non-empty tuple drawn from {ALLOWED_FORMATS}, "
                f"got {self.formats!r}"
            )
        unknown = [f for f in self.formats if f not in ALLOWED_FORMATS]
        if unknown:
            raise InvalidOptionError(
                f"DecodeLimits.formats contains {unknown}; only {ALLOWED_FORMATS} are allowed "
                "(spell them in upper case, as Pillow does)"
            )
        bg = self.background
        if (
            not isinstance(bg, tuple)
            or len(bg) != 3
            or any(isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= 255 for c in bg)
        ):
            raise InvalidOptionError(
                f"DecodeLimits.background must be an (R, G, B) tuple of ints in 0..255, got {bg!r}"
            )


@dataclass(frozen=True)
class DecodedImage:
    """A decoded image plus what the preprocessing needs to know about the original."""

    image: Image.Image  # RGB, loaded, EXIF orientation applied; smaller than the source if drafted
    format: str  # Pillow's format name, e.g. "JPEG"
    source_size: tuple[int, int]  # (H, W) of the full-resolution image in display orientation
    draft_scale: int  # 1, 2, 4 or 8: the JPEG DCT-domain reduction that was applied


def decode_image(
    data: bytes,
    *,
    limits: DecodeLimits | None = None,
    min_size: tuple[int, int] | None = None,
) -> Image.Image:
    """Decode untrusted bytes into a new RGB image; ``min_size=(min_w, min_h)`` allows JPEG draft mode."""
    return decode(data, limits=limits, min_size=min_size).image


def decode(
    data: bytes,
    *,
    limits: DecodeLimits | None = None,
    min_size: tuple[int, int] | MinSizeFn | None = None,
) -> DecodedImage:
    """Like :func:`decode_image`, but also reports the full-resolution size.

    ``min_size`` may be a function of the display-oriented (H, W) source size, because the smallest
    useful decode for an aspect-preserving resize depends on the aspect ratio, which is only known once
    the header has been read. Exceptions raised by that function propagate unchanged.
    """
    limits = limits or DecodeLimits()
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ImageDecodeError(f"expected image bytes, got {type(data).__name__}", code="not_an_image")
    data = bytes(data)
    if not data:
        raise ImageDecodeError("the image is empty (0 bytes)", code="empty")
    if len(data) > limits.max_bytes:
        raise ImageDecodeError(
            f"the image is {len(data)} bytes, more than the limit of {limits.max_bytes} bytes; "
            "re-encode it smaller",
            code="too_large",
        )

    sniffed = _sniff_format(data)
    if sniffed is not None and sniffed not in limits.formats:
        raise ImageDecodeError(
            f"{sniffed} images are not accepted; convert to one of {', '.join(limits.formats)}",
            code="unsupported_format",
        )

    img = _open(data, limits, sniffed)
    try:
        return _decode_opened(img, str(img.format or sniffed), limits, min_size)
    finally:
        img.close()  # the result is always a separate image; free the parser and its buffer now


def _decode_opened(
    img: Image.Image, fmt: str, limits: DecodeLimits, min_size: tuple[int, int] | MinSizeFn | None
) -> DecodedImage:
    width, height = img.size
    _check_geometry(width, height, limits)
    orientation = _orientation(img)
    display_hw = (width, height) if orientation in _SWAPPING_ORIENTATIONS else (height, width)

    wanted = min_size(display_hw) if callable(min_size) else min_size
    draft_scale = 1
    if wanted is not None:
        min_w, min_h = _check_min_size(wanted)
        if orientation in _SWAPPING_ORIENTATIONS:
            min_w, min_h = min_h, min_w  # the JPEG stores the image before rotation
        # MPO (multi-picture camera JPEGs) subclasses the JPEG plugin and drafts the same way.
        if isinstance(img, JpegImagePlugin.JpegImageFile) and width >= 2 * min_w and height >= 2 * min_h:
            try:
                img.draft("RGB", (min_w, min_h))
            except Exception:
                draft_scale = 1  # drafting is only an optimisation: decode at full size instead
            else:
                draft_scale = max(1, round(width / img.size[0]))

    try:
        img.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise _too_many_pixels(width, height, limits) from exc
    except Exception as exc:
        raise ImageDecodeError(
            f"the {fmt} image is truncated or corrupt and could not be decoded ({exc})",
            code="truncated",
        ) from exc

    oriented = _apply_orientation(img)  # a new image, detached from the byte buffer
    if oriented.mode != "RGB" or "transparency" in oriented.info:
        oriented = to_rgb(oriented, limits.background)
    return DecodedImage(image=oriented, format=fmt, source_size=display_hw, draft_scale=draft_scale)


def _open(data: bytes, limits: DecodeLimits, sniffed: str | None) -> Image.Image:
    """Parse only the header, and only with the allowed plugins."""
    try:
        img: Image.Image = Image.open(io.BytesIO(data), formats=list(limits.formats))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow's own (global) ceiling fired first; report it as ours.
        raise ImageDecodeError(
            f"the image has too many pixels (more than {limits.max_pixels}); downscale it before upload",
            code="too_many_pixels",
        ) from exc
    except Exception as exc:  # UnidentifiedImageError, a bare OSError, SyntaxError, struct.error...
        if sniffed is None:
            raise ImageDecodeError(
                f"the bytes are not an image in a recognised format (accepted: {', '.join(limits.formats)})",
                code="not_an_image",
            ) from exc
        if _header_has_zero_size(data, sniffed):
            raise ImageDecodeError(
                f"the {sniffed} image has a zero width or height", code="zero_size"
            ) from exc
        detail = "" if isinstance(exc, UnidentifiedImageError) else f" ({exc})"
        raise ImageDecodeError(
            f"the data starts like a {sniffed} image but its header is truncated or corrupt{detail}",
            code="truncated",
        ) from exc
    return img


def _check_geometry(width: int, height: int, limits: DecodeLimits) -> None:
    if width <= 0 or height <= 0:
        raise ImageDecodeError(f"the image has a zero size ({width}x{height})", code="zero_size")
    if width * height > limits.max_pixels:
        raise _too_many_pixels(width, height, limits)
    ratio = max(width, height) / min(width, height)
    if ratio > limits.max_aspect_ratio:
        raise ImageDecodeError(
            f"the image is {width}x{height}, an aspect ratio of {ratio:.1f}:1, more than the limit of "
            f"{limits.max_aspect_ratio:g}:1; crop it to its content first",
            code="aspect_ratio",
        )


def _too_many_pixels(width: int, height: int, limits: DecodeLimits) -> ImageDecodeError:
    return ImageDecodeError(
        f"the image is {width}x{height} = {width * height} pixels, more than the limit of "
        f"{limits.max_pixels}; downscale it before upload",
        code="too_many_pixels",
    )


def _check_min_size(wanted: tuple[int, int]) -> tuple[int, int]:
    if (
        not isinstance(wanted, tuple)
        or len(wanted) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in wanted)
    ):
        raise InvalidOptionError(f"min_size must be a (min_w, min_h) tuple of positive ints, got {wanted!r}")
    return wanted[0], wanted[1]


def _orientation(img: Image.Image) -> int:
    """The EXIF orientation (1 when absent or unreadable: a broken EXIF block must not lose the image)."""
    try:
        value = img.getexif().get(_EXIF_ORIENTATION_TAG, 1)
        return value if isinstance(value, int) and 1 <= value <= 8 else 1
    except Exception:
        return 1


def _apply_orientation(img: Image.Image) -> Image.Image:
    """Always returns a new image (``exif_transpose`` copies even when there is nothing to do)."""
    try:
        out = ImageOps.exif_transpose(img)
    except Exception:  # broken EXIF: keep the pixels as stored rather than fail the request
        return img.copy()
    return out if out is not None else img.copy()


def to_rgb(image: Image.Image, background: tuple[int, int, int] = (255, 255, 255)) -> Image.Image:
    """Convert any Pillow mode to a new RGB image, explicitly.

    ``Image.convert("RGB")`` is wrong for two common cases: it drops alpha, revealing whatever colour
    the encoder left under transparent pixels, and it saturates 16-bit data to white. So alpha is
    composited over ``background`` and high-bit-depth data is rescaled by its real bit depth. ICC
    profiles are not applied (pixels are taken as sRGB).
    """
    mode = image.mode
    if mode.startswith("I;16"):
        return _gray_to_rgb(np.asarray(image).astype(np.float64) / 257.0)  # 65535 / 257 == 255
    if mode == "I":
        return _int32_to_rgb(image)
    if mode == "F":
        return _float_to_rgb(image)
    if "A" in image.getbands() or "a" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")  # palette/tRNS transparency and premultiplied modes included
        base = Image.new("RGBA", rgba.size, (*background, 255))
        return Image.alpha_composite(base, rgba).convert("RGB")
    if mode == "RGB":
        return image.copy()
    try:  # 1, L, P, CMYK, YCbCr, LAB, HSV, RGBX: Pillow's own conversions are correct for these
        return image.convert("RGB")
    except (ValueError, OSError) as exc:
        raise ImageDecodeError(
            f"images in Pillow mode {mode!r} cannot be converted to RGB", code="unsupported_format"
        ) from exc


def _gray_to_rgb(values: np.ndarray) -> Image.Image:
    gray = np.rint(np.clip(values, 0.0, 255.0)).astype(np.uint8)  # [H, W]
    return Image.fromarray(gray).convert("RGB")


def _int32_to_rgb(image: Image.Image) -> Image.Image:
    """Mode "I" holds 16- or 32-bit integers; scale by the declared (TIFF) or evident bit depth.

    Negative values (signed data) are clipped to black: a meaningful window for arbitrary-range
    scientific data is the caller's decision, not something to guess here.
    """
    values = np.asarray(image).astype(np.float64)  # [H, W]
    bits, signed = 0, False
    tags = getattr(image, "tag_v2", None)
    if tags is not None:
        try:
            raw_bits = tags.get(_TIFF_BITS_PER_SAMPLE)
            bits = int(raw_bits[0] if isinstance(raw_bits, tuple) else raw_bits or 0)
            raw_format = tags.get(_TIFF_SAMPLE_FORMAT)
            signed = int(raw_format[0] if isinstance(raw_format, tuple) else raw_format or 1) == 2
        except (TypeError, ValueError, IndexError):
            bits = 0
    if bits <= 8 or bits > 32:
        bits = 16 if values.size == 0 or (values.min() >= 0 and values.max() <= 65535) else 32
        signed = bits == 32
    top = float(2 ** (bits - 1) - 1) if signed else float(2**bits - 1)
    return _gray_to_rgb(values * (255.0 / top))


def _float_to_rgb(image: Image.Image) -> Image.Image:
    """Mode "F": values within [0, 1] are read as normalised intensities (×255), as transformers does
    before handing floats to PIL; anything else is taken as 0..255 and clipped, as Pillow's own F→L
    conversion does. NaN becomes black."""
    values = np.nan_to_num(np.asarray(image).astype(np.float64), nan=0.0, posinf=255.0, neginf=0.0)
    if values.size and values.max() <= 1.0:
        values = values * 255.0
    return _gray_to_rgb(values)


def _sniff_format(data: bytes) -> str | None:
    """Name the format from its magic bytes, so that a real image in a format we refuse is reported as
    ``unsupported_format`` rather than ``not_an_image``. Cheap: looks at the first bytes only."""
    head = data[:64]
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):
        return "TIFF"
    if head.startswith(b"BM") and len(head) >= 18 and struct.unpack("<I", head[14:18])[0] in _BMP_HEADERS:
        return "BMP"
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in (b"avif", b"avis"):
            return "AVIF"
        if brand in (b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1"):
            return "HEIF"
        if brand in (b"jp2 ", b"jpx "):
            return "JPEG2000"
        return "ISOBMFF"
    for magic, name in _OTHER_MAGIC:
        if head.startswith(magic):
            return name
    if head[:1] == b"P" and head[1:2] in (b"1", b"2", b"3", b"4", b"5", b"6", b"7") and head[2:3].isspace():
        return "PPM"
    if (
        len(head) >= 4
        and head[0] == 0x0A
        and head[1] in (0, 2, 3, 4, 5)
        and head[2] <= 1
        and head[3] in (1, 2, 4, 8)
    ):
        return "PCX"
    if head[:2] == b"\x00\x00" and head[2:4] in (b"\x01\x00", b"\x02\x00") and _looks_like_icon(head):
        return "ICO" if head[2] == 1 else "CUR"
    if _looks_like_tga(head):
        return "TGA"
    stripped = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if stripped.startswith(b"<svg") or (stripped.startswith(b"<?xml") and b"<svg" in data[:1024].lower()):
        return "SVG"
    return None


_BMP_HEADERS: Final = frozenset({12, 16, 40, 52, 56, 64, 108, 124})
_TGA_DEPTHS: Final = frozenset({8, 15, 16, 24, 32})


def _looks_like_tga(head: bytes) -> bool:
    """TGA has no magic; a consistent colour-map/image-type/depth/descriptor combination names it."""
    if len(head) < 18 or head[16] not in _TGA_DEPTHS or head[17] & 0xC0:
        return False
    width, height = struct.unpack("<HH", head[12:16])
    if head[1] == 1:  # colour-mapped
        return head[2] in (1, 9) and width > 0 and height > 0
    return head[1] == 0 and head[2] in (2, 3, 10, 11) and head[3:8] == bytes(5) and width > 0 and height > 0


def _looks_like_icon(head: bytes) -> bool:
    """ICO/CUR share their first bytes with some TGA headers; check the first directory entry too."""
    if len(head) < 22:
        return False
    count = struct.unpack("<H", head[4:6])[0]
    size, offset = struct.unpack("<II", head[14:22])
    return 1 <= count <= 256 and head[9] == 0 and size > 0 and offset >= 6 + 16 * count


_OTHER_MAGIC: Final = (
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG2000"),
    (b"\xffO\xffQ", "JPEG2000"),
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n", "JPEGXL"),
    (b"\xff\n", "JPEGXL"),
    (b"8BPS", "PSD"),
    (b"icns", "ICNS"),
    (b"qoif", "QOI"),
    (b"DDS ", "DDS"),
    (b"%PDF", "PDF"),
    (b"%!PS", "EPS"),
    (b"\xc5\xd0\xd3\xc6", "EPS"),
    (b"v/1\x01", "EXR"),
    (b"#?RADIANCE", "HDR"),
    (b"SIMPLE  =", "FITS"),
    (b"\x01\xda", "SGI"),
)


def _header_has_zero_size(data: bytes, fmt: str) -> bool:
    """Pillow refuses zero-sized PNG/BMP headers with a generic error; read the size ourselves so that
    the caller learns the real reason."""
    try:
        if fmt == "PNG" and data[12:16] == b"IHDR":
            width, height = struct.unpack(">II", data[16:24])
            return width == 0 or height == 0
        if fmt == "BMP":
            if struct.unpack("<I", data[14:18])[0] == 12:
                width, height = struct.unpack("<HH", data[18:22])
            else:
                width, height = struct.unpack("<ii", data[18:26])
            return width == 0 or height == 0
        if fmt == "GIF":
            width, height = struct.unpack("<HH", data[6:10])
            return width == 0 or height == 0
    except struct.error:
        return False
    return False
