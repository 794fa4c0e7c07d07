"""Hostile images for the pixel-limit and bad-image tests (issue 52): PNGs whose header claims a size far above what
their few bytes hold (a decompression bomb's shape: PIL reads the size from the header, decoding would need the
pixels), a truncated PNG and an SVG; each as bytes or a data URL."""

from __future__ import annotations

import base64
import io
import struct
import zlib


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_claiming(width: int, height: int) -> bytes:
    """A grey-scale PNG whose header says ``width`` x ``height`` and whose pixel data holds one row: opening it reads
    the size, decoding it fails (truncated)."""
    row = zlib.compress(b"\0" * (width + 1))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", row) + _chunk(b"IEND", b"")


def truncated_png() -> bytes:
    """A real 64 x 64 PNG cut in the middle of its pixel data."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.effect_noise((64, 64), 60).convert("RGB").save(buffer, format="PNG")
    data = buffer.getvalue()
    return data[: len(data) // 2]


SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'

#: a 20000 x 20000 header: more than twice PIL's MAX_IMAGE_PIXELS, so ``Image.open`` raises DecompressionBombError
BOMB = (20000, 20000)
#: a 9000 x 9000 header: 81M pixels, under PIL's own limits, far above any sensible max_image_pixels
HUGE = (9000, 9000)


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()
