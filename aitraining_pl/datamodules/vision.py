"""Images in prompt, preference and SFT rows: reading, checking, chat content parts and the processor.

A row brings its images in an ``images`` column (or ``image``, RLAIF-V's: one image) as file paths, PIL images,
bytes or ``{"bytes": ..., "path": ...}`` dicts (a ``datasets`` ``Image`` column), and places them in its text the way
TRL does:

- chat content parts: ``{"type": "image"}`` placeholders, one per image of the ``images`` column, in order, beside
  ``{"type": "text", "text": ...}`` parts; or ``{"type": "image_url", "image_url": {"url": ...}}`` parts that carry
  their own image (a ``data:image/...;base64,`` URL or a file path);
- a plain string prompt: the processor's image placeholder (``image_placeholder``) in the text, one per image, or
  none, and then one placeholder per image is put in front of the text.

A URL (``http://``, ``https://``) is refused: nothing is fetched. The model's processor (``models.vision.
load_processor``) expands each placeholder into the model's image tokens and makes the vision inputs; image tokens
are part of the prompt, so they are never trained on.

Bad input stops before training with one line naming the file, row and field: a missing image file, an unreadable
image, a placeholder count different from the image count, an image of more than ``max_image_pixels`` pixels
(refused, not resized: resize it, or raise the limit).
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Sequence
from typing import Any

from aitraining_pl.datamodules.io import DataValidationError
from aitraining_pl.models.vision import VisionInputs, processor_of

#: the columns a row's images may come in (TRL's, then RLAIF-V's one image)
IMAGE_COLUMNS = ("images", "image")
#: the column of an encoded row that holds its images as read (``EncodedImage``: decoded on use)
IMAGES = "__images"


def image_placeholder(processor: Any) -> str:
    """The text that stands for one image in a prompt: the processor's image token (Qwen VL wrapped in its vision
    start and end tokens, as its chat template writes it)."""
    token = processor.image_token
    vocab = processor.tokenizer.get_vocab()
    if "<|vision_start|>" in vocab and token == "<|image_pad|>":
        return f"<|vision_start|>{token}<|vision_end|>"
    return token


def row_images(record: dict) -> tuple[str | None, list[Any]]:
    """(column, images) of a row: its ``images`` or ``image`` column as a list (empty when it has none)."""
    for column in IMAGE_COLUMNS:
        value = record.get(column)
        if value is not None:
            return column, list(value) if isinstance(value, (list, tuple)) else [value]
    return None, []


#: the largest image (width x height) the agent endpoint, the HF server and environment replies decode unless told
#: otherwise (4096 x 4096; Qwen2-VL's processor shrinks anything above 12.8M pixels anyway): a larger one is refused
#: from its header, before it is decoded
MAX_IMAGE_PIXELS = 4096 * 4096
#: the most images one request (an endpoint call, an HF server prompt) or one environment reply may carry
MAX_IMAGES = 32


class EncodedImage:
    """An image kept as its encoded bytes (a file's, a data URL's) and decoded on use (``rgb``), so that rows do not
    keep full-size pixels (``size``: its width and height, from its header). A PIL image given in memory is kept as
    it is (the caller holds it anyway)."""

    __slots__ = ("data", "size")

    def __init__(self, data: Any, size: tuple[int, int]):
        self.data, self.size = data, size

    def rgb(self):
        """A fresh RGB PIL image."""
        from PIL import Image

        image = self.data if isinstance(self.data, Image.Image) else Image.open(io.BytesIO(self.data))
        return image.convert("RGB")

    def __repr__(self) -> str:
        return f"EncodedImage({self.size[0]}x{self.size[1]})"


def as_rgb(image: Any):
    """``image`` as an RGB PIL image: an ``EncodedImage`` decoded, a PIL image converted where it is not RGB."""
    if isinstance(image, EncodedImage):
        return image.rgb()
    return image if getattr(image, "mode", "RGB") == "RGB" else image.convert("RGB")


def _encoded_bytes(value: Any, source: str, row: int | None, field: str) -> Any:
    """The encoded bytes of an image value (or the PIL image itself); ``DataValidationError`` for a URL, a missing
    file or something that is not an image."""
    from PIL import Image

    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path") or value.get("url")
    if isinstance(value, (Image.Image, bytes)):
        return value
    if isinstance(value, bytearray):
        return bytes(value)
    if isinstance(value, str) and value.startswith("data:"):
        return base64.b64decode(value.split(",", 1)[-1])
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        raise DataValidationError(source, f"image URL {value[:80]!r} refused: nothing is fetched (offline); "
                                  "download the image and give its path", row, field)  # fmt: skip
    if isinstance(value, str):
        path = os.path.expanduser(value)
        if not os.path.isfile(path):
            raise DataValidationError(source, f"image file not found: {value}", row, field)
        with open(path, "rb") as handle:
            return handle.read()
    raise DataValidationError(source, f"not an image (path, bytes or PIL image): {type(value).__name__}", row, field)


def read_image(value: Any, source: str, row: int | None, field: str, max_image_pixels: int | None = None,
               decode: bool = True) -> EncodedImage:  # fmt: skip
    """One image from a path, PIL image, bytes, a ``{"bytes", "path"}`` dict or a data URL, kept encoded
    (``EncodedImage``). Its size is read from its header and checked against ``max_image_pixels`` before anything is
    decoded; with ``decode`` it is then decoded once (and dropped) so that a broken file fails here. A URL, a missing
    file, an unreadable, truncated or oversized image (PIL's decompression-bomb limit included) is a
    ``DataValidationError`` naming ``source``, ``row`` and ``field``."""
    from PIL import Image

    data = _encoded_bytes(value, source, row, field)
    try:
        image = data if isinstance(data, Image.Image) else Image.open(io.BytesIO(data))  # reads the header only
        width, height = image.size
        if max_image_pixels is not None and width * height > max_image_pixels:
            raise DataValidationError(source, f"image of {width}x{height} = {width * height} pixels is larger than "
                                      f"max_image_pixels={max_image_pixels}: refused (resize it or raise the limit)",
                                      row, field)  # fmt: skip
        if decode and not isinstance(data, Image.Image):
            image.load()
    except DataValidationError:
        raise
    except Exception as err:  # UnidentifiedImageError, OSError (truncated), DecompressionBombError, ValueError, ...
        raise DataValidationError(source, f"unreadable image: {type(err).__name__}: {err}"[:300], row, field) from None
    return EncodedImage(data, (width, height))


def load_image(value: Any, source: str, row: int | None, field: str, max_image_pixels: int | None = None):
    """``read_image`` decoded: an RGB PIL image (the same ``DataValidationError``s)."""
    image = read_image(value, source, row, field, max_image_pixels, decode=False)
    try:
        return image.rgb()
    except Exception as err:  # noqa: BLE001 - a truncated or broken image, however PIL says it
        raise DataValidationError(source, f"unreadable image: {type(err).__name__}: {err}"[:300], row, field) from None


def _flatten(content: Any, placeholder: str, urls: list[Any]) -> tuple[Any, int]:
    """A message's content with TRL's parts as one string (image parts as ``placeholder``; ``image_url`` parts'
    images appended to ``urls``), and how many image placeholders it has."""
    if not isinstance(content, list):
        return content, 0
    text, count = [], 0
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text.append(part.get("text") or "")
        elif kind in ("image", "image_url"):
            text.append(placeholder)
            count += 1
            if kind == "image_url":
                url = part.get("image_url")
                urls.append(url.get("url") if isinstance(url, dict) else url)
    return "".join(text), count


def flatten_parts(value: Any, placeholder: str) -> tuple[Any, int, list[Any]]:
    """A prompt or completion (string or messages) with content parts flattened: (value, placeholders, the images
    of its ``image_url`` parts)."""
    urls: list[Any] = []
    if not isinstance(value, list):
        return value, (value.count(placeholder) if isinstance(value, str) else 0), urls
    messages, total = [], 0
    for message in value:
        if isinstance(message, dict) and "content" in message:
            content, count = _flatten(message["content"], placeholder, urls)
            if not isinstance(message["content"], list) and isinstance(content, str):
                count = content.count(placeholder)
            messages.append({**message, "content": content})
            total += count
        else:
            messages.append(message)
    return messages, total, urls


class RowImages:
    """The images of one row and its texts with their placeholders, checked (``DataValidationError`` otherwise).

    Args:
        processor: the VL model's processor.
        record: the row.
        fields: the row's text fields that may hold image placeholders (prompt, chosen, rejected, messages, ...).
        source, row: where the row comes from (error messages).
        max_image_pixels: the largest image accepted, in pixels (None: any).
    """

    def __init__(self, processor, record: dict, fields: Sequence[str], source: str, row: int,
                 max_image_pixels: int | None):  # fmt: skip
        self.placeholder = image_placeholder(processor)
        column, images = row_images(record)
        self.values: dict[str, Any] = {}
        count, urls = 0, []
        for name in fields:
            value, n, found = flatten_parts(record.get(name), self.placeholder)
            self.values[name], count, urls = value, count + n, urls + found
        field = column or (fields[0] if fields else "images")
        self.images = [
            read_image(v, source, row, f"{field}[{i}]" if column else field, max_image_pixels)
            for i, v in enumerate(images + urls)
        ]  # fmt: skip (kept encoded: ``EncodedImage``)
        if count == 0 and images and not urls and fields and isinstance(self.values[fields[0]], str):
            self.values[fields[0]] = self.placeholder * len(images) + self.values[fields[0]]  # images first
            count = len(images)
        if count != len(self.images):
            raise DataValidationError(source, f"{count} image placeholder(s) but {len(self.images)} image(s)", row,
                                      column or fields[0])  # fmt: skip


def encode_with_images(processor, text: str, images: list[Any]) -> tuple[list[int], dict[str, Any]]:
    """``text`` and its images through the processor: the token ids (image placeholders expanded, no special tokens
    added) and the vision inputs (no text keys)."""
    images = [as_rgb(image) for image in images]  # an ``EncodedImage`` decoded here, dropped after
    out = processor(text=[text], images=[images] if images else None, add_special_tokens=False, return_tensors="pt")
    vision = VisionInputs.from_processor([out]).prompts[0] if images else {}
    return out["input_ids"][0].tolist(), vision


def encode_pieces(processor, text: str, images: list[Any], placeholder: str) -> tuple[list[int], list[int], list]:
    """``text`` with its ``images`` (one per ``placeholder`` in it, in order) as (ids, image, vision): the text
    between placeholders through the tokenizer, each placeholder through the processor with its image (expanded to
    the model's image tokens), ``image`` 1 on those expansion tokens (never trained on), ``vision`` each image's
    inputs (concatenated over images as ``VisionInputs`` concatenates prompts)."""
    ids, image, vision = [], [], []
    parts = text.split(placeholder)
    for i, part in enumerate(parts):
        piece = list(processor.tokenizer(part, add_special_tokens=False)["input_ids"]) if part else []
        ids, image = ids + piece, image + [0] * len(piece)
        if i < len(parts) - 1:
            expansion, inputs = encode_with_images(processor, placeholder, [images[len(vision)]])
            ids, image = ids + expansion, image + [1] * len(expansion)
            vision.append(inputs)
    return ids, image, vision


def merged_vision(inputs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row's vision inputs from those of its images (``encode_pieces``), each key concatenated (dim 0)."""
    import torch

    return {k: torch.cat([x[k] for x in inputs]) for k in inputs[0]} if inputs else {}


def vision_processor(tokenizer: Any):
    """The processor behind ``tokenizer`` (``models.vision.processor_of``), or None for a text model's."""
    return processor_of(tokenizer)


def collate_vision(examples: Sequence[dict]) -> VisionInputs | None:
    """The ``vision`` entry of a batch: each example's vision inputs (``VisionInputs``; ``{}`` for a row without
    images beside rows with) and its images as read (``[]`` for such a row; None when an example with vision inputs
    did not keep them), or None when no row has images."""
    if not any("vision" in e for e in examples):
        return None
    kept = all("images" in e for e in examples if "vision" in e)
    images = [e.get("images", []) for e in examples] if kept else None
    return VisionInputs([e.get("vision", {}) for e in examples], images=images)


#: the encoded row's vision inputs (a dict of tensors, empty for a row without images)
VISION = "__vision"


class PairImages:
    """A preference (or SFT) row's images: ``row`` (``RowImages``: the flattened texts and the images), ``encode``
    (the prompt text through the processor with them, for ``datamodules.preference.encode_pair``) and, once that
    ran, ``vision`` (the prompt's vision inputs)."""

    def __init__(self, processor, row: RowImages, source: str, index: int, field: str, max_prompt_length: int):
        self.processor, self.row, self.vision = processor, row, {}
        self.where, self.max_prompt_length = (source, index, field), max_prompt_length

    def encode(self, text: str) -> list[int]:
        from aitraining_pl.models.tokens import with_bos

        ids, self.vision = encode_with_images(self.processor, text, self.row.images)
        ids = with_bos(ids, self.processor.tokenizer)
        if len(ids) > self.max_prompt_length:
            message = f"{len(ids)} prompt tokens with its image tokens: more than max_prompt_length="
            raise DataValidationError(self.where[0], f"{message}{self.max_prompt_length} (an image cannot be cut)",
                                      self.where[1], self.where[2])  # fmt: skip
        return ids


def vision_pair(tokenizer, record: dict, fields: Sequence[str], source: str, row: int, max_prompt_length: int,
                max_image_pixels: int | None) -> PairImages | None:  # fmt: skip
    """``PairImages`` of a row for a VL model's tokenizer (the images belong to the prompt, ``fields[0]``), else
    None."""
    processor = vision_processor(tokenizer)
    if processor is None:
        return None
    found = RowImages(processor, record, fields, source, row, max_image_pixels)
    return PairImages(processor, found, source, row, fields[0], max_prompt_length)
