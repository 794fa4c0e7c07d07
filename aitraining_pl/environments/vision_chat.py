"""Chat messages with images, for a vision-language (VL) policy: the agent endpoint's calls and the replies of an
episode environment.

A message's ``content`` may be a list of parts (TRL's and OpenAI's layouts):

- ``{"type": "text", "text": ...}``;
- ``{"type": "image"}``: the next of the images given beside the messages (``EpisodeStep.images``), in order;
- ``{"type": "image", "image": ...}``: a part with its own image (a PIL image, path, bytes or data URL);
- ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``: a part with its own image.

Each image part becomes the processor's image placeholder (``datamodules.vision.image_placeholder``) in the rendered
chat, tokenised with its special tokens (``ChatFormat(image_placeholder=...)``; every other string stays plain text,
so a message's text cannot forge an image), and then each placeholder's tokens are expanded into that image's tokens
exactly as the processor expands them for that image alone (``datamodules.vision.encode_with_images``), the image's
vision inputs (``pixel_values``, ``image_grid_thw``, ...) beside: a sequence's images, in order, are the list of
those (``models.vision.merge_vision`` joins them for the model). Bad input raises ``DataValidationError`` naming the
field (``messages[2].content[0]``): an unreadable, truncated or bomb image, one of more than ``max_image_pixels``
pixels (refused from its header, before it is decoded), more than ``max_images`` images, a URL that is not a data
URL, a text that spells the placeholder, more or fewer images than ``{"type": "image"}`` parts, and any image for a
text-only policy. Images are decoded one at a time, as the processor takes each.
``chat_ids`` is the one entry point (a first prompt or a reply, text-only or VL).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aitraining_pl.datamodules.io import DataValidationError
from aitraining_pl.datamodules.vision import (
    MAX_IMAGE_PIXELS,
    MAX_IMAGES,
    encode_with_images,
    image_placeholder,
    read_image,
)
from aitraining_pl.models.vision import processor_of

IMAGE_PARTS = ("image", "image_url")


def image_part_field(messages: Sequence[dict], where: str = "messages", first: int = 0) -> str | None:
    """The field of the first image part of ``messages`` (``messages[1].content[0]``), or None without images."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                return f"{where}[{first + i}].content[{j}]"
    return None


def image_part_count(messages: Any) -> int:
    """How many image parts ``messages`` hold (nothing decoded)."""
    return sum(
        isinstance(part, dict) and part.get("type") in IMAGE_PARTS
        for message in (messages if isinstance(messages, list) else ())
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
    )


def without_pixels(message: dict) -> dict:
    """``message`` for a transcript: its image parts as ``{"type": "image"}`` (no image data)."""
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    parts = [{"type": "image"} if isinstance(p, dict) and p.get("type") in IMAGE_PARTS else p for p in content]
    return {**message, "content": parts}


def vision_chat_format(tokenizer, tools: Sequence[dict] = ()):
    """``ChatFormat`` of ``tokenizer``, with its processor's image placeholder when it is a VL model's."""
    from aitraining_pl.environments.episode_rollout import ChatFormat  # it imports this module

    processor = processor_of(tokenizer)
    return ChatFormat(tokenizer, tools, image_placeholder(processor) if processor is not None else None)


class ImageChat:
    """Messages with image parts as token ids and per-image vision inputs (see the module docstring).

    Args:
        chat: the chat format, made with the processor's placeholder (``vision_chat_format``).
        processor: the VL model's processor.
        source: what the errors name as the input (``the request``, ``the environment's reply``).
        max_image_pixels: the largest image accepted (width x height).
        max_images: the most images one call of ``flatten`` takes.
    """

    def __init__(self, chat: Any, processor: Any, source: str = "messages", max_image_pixels: int = MAX_IMAGE_PIXELS,
                 max_images: int = MAX_IMAGES):  # fmt: skip
        self.chat, self.processor, self.source = chat, processor, source
        self.max_image_pixels, self.max_images = max_image_pixels, max_images
        self.placeholder = image_placeholder(processor)
        self._placeholder_ids = chat.encode(self.placeholder)

    def _error(self, message: str, field: str) -> DataValidationError:
        return DataValidationError(self.source, message, None, field)

    def _text(self, text: Any, field: str) -> str:
        text = "" if text is None else str(text)
        if self.placeholder in text:
            raise self._error(f"the text spells the image placeholder {self.placeholder!r}: use an image part", field)
        return text

    def flatten(
        self, messages: Sequence[dict], images: Sequence[Any] = (), where: str = "messages", first: int = 0
    ) -> tuple[list[dict], list[Any]]:
        """``messages`` with each content list as one string, an image part as the placeholder, and their images
        in order (``EncodedImage``s, checked, decoded by ``expand``); ``images`` fill the ``{"type": "image"}``
        parts. ``first``: the index of the first message in the request (error fields)."""
        given, found, out = list(images), [], []
        count = image_part_count(list(messages))
        if count > self.max_images:  # before any image is read
            raise self._error(f"{count} images: more than the {self.max_images} one call or reply may carry", where)
        for i, message in enumerate(messages):
            at = f"{where}[{first + i}].content"
            content = message.get("content")
            if not isinstance(content, list):
                out.append({**message, "content": self._text(content, at)} if content is not None else message)
                continue
            text = []
            for j, part in enumerate(content):
                field, kind = f"{at}[{j}]", part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    text.append(self._text(part.get("text"), field))
                    continue
                if kind not in IMAGE_PARTS:
                    raise self._error(f"a content part must be text, image or image_url, got {kind!r:.40}", field)
                value = part.get("image") if kind == "image" else part.get("image_url")
                value = value.get("url") if isinstance(value, dict) else value
                if value is None and kind == "image":
                    if not given:
                        raise self._error("an image part without its image: more image parts than images", field)
                    value = given.pop(0)
                if isinstance(value, str) and kind == "image_url" and not value.startswith("data:image/"):
                    raise self._error(f"image URL {value[:60]!r} refused: only data:image/...;base64 URLs (nothing is "
                                      "fetched)", f"{field}.image_url.url")  # fmt: skip
                found.append(read_image(value, self.source, None, field, self.max_image_pixels))
                text.append(self.placeholder)
            out.append({**message, "content": "".join(text)})
        if given:
            raise self._error(f"{len(given)} image(s) more than the image parts of the messages", where)
        return out, found

    def expand(self, ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], list[dict]]:
        """``ids`` with each placeholder's tokens expanded into its image's tokens (the ``images`` in order) and
        each image's vision inputs."""
        raw, width = self._placeholder_ids, len(self._placeholder_ids)
        starts, i = [], 0
        while i <= len(ids) - width:
            if list(ids[i : i + width]) == raw:
                starts.append(i)
                i += width
            else:
                i += 1
        if len(starts) != len(images):
            raise self._error(f"{len(starts)} image placeholder(s) rendered for {len(images)} image(s)", "messages")
        out, parts, at = [], [], 0
        for start, image in zip(starts, images):
            expanded, vision = encode_with_images(self.processor, self.placeholder, [image])
            out += list(ids[at:start]) + expanded
            parts.append(vision)
            at = start + width
        return out + list(ids[at:]), parts


def chat_ids(chat, messages: Sequence[dict], turn_ids=None, images: Sequence[Any] = (), first: int = 0,
             where: str = "messages", source: str = "messages") -> tuple[list[int], list[dict]]:  # fmt: skip
    """Token ids of ``messages`` rendered by ``chat`` (a ``ChatFormat``): the first prompt's (``prompt_ids``), or
    with ``turn_ids`` a reply after that turn's (``reply_ids``); and the per-image vision inputs of their image parts
    (``images`` fill the ``{"type": "image"}`` ones). A text-only policy's tokenizer (no processor) refuses image
    parts and images with ``DataValidationError`` naming the field (``where[i].content[j]``), as bad images are."""
    processor = processor_of(chat.tokenizer)
    if processor is None:
        field = image_part_field(messages, where, first) or f"{where} images" * bool(images)
        if field:
            raise DataValidationError(source, "the policy is a text-only model: it takes no images", None, field)
        return (chat.prompt_ids(messages) if turn_ids is None else chat.reply_ids(messages, turn_ids)), []
    vision = ImageChat(chat, processor, source)
    flat, found = vision.flatten(messages, images, where, first)
    return vision.expand(chat.prompt_ids(flat) if turn_ids is None else chat.reply_ids(flat, turn_ids), found)
