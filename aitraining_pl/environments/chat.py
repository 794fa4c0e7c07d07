"""Chat messages as tokens: ``ChatFormat`` renders a conversation with the tokenizer's chat template (the first
prompt, then each reply appended as the template writes it, so a sequence is the tokens sampled and the tokens
rendered, never text re-tokenised), and its image variant renders messages with images for a vision-language (VL)
policy: the agent endpoint's calls and the replies of an episode environment.

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

import json
import re
from collections.abc import Sequence
from typing import Any

from aitraining_pl.datamodules.formats import FALLBACK_CHAT_TEMPLATE
from aitraining_pl.datamodules.io import DataValidationError
from aitraining_pl.datamodules.vision import (
    MAX_IMAGE_PIXELS,
    MAX_IMAGES,
    encode_with_images,
    image_placeholder,
    read_image,
)
from aitraining_pl.environments.tools import ToolTemplateError
from aitraining_pl.models.tokens import with_bos
from aitraining_pl.models.vision import processor_of

IMAGE_PARTS = ("image", "image_url")

#: a content's slot in a reply rendered to find the template's own text (plain ASCII: kept by ``trim``, ``tojson``)
_SLOT = "AITPLSLOT"
#: content of the assistant message whose rendering shows what a template writes after an assistant turn
_MARK = "\u2063ASSISTANT-TURN\u2063"


def check_assistant_turns(template: str, render=None) -> None:
    """``ValueError`` (one line saying what the template must render) unless ``template`` writes an assistant
    message's content and marks it as the assistant's (its rendering differs from the same text as a user's).
    ``render(messages)`` renders with the tokenizer; default: the template alone (no tokenizer, e.g. when an
    environment is built)."""
    if render is None:
        from transformers.utils.chat_template_utils import render_jinja_template

        def render(messages):
            return render_jinja_template([messages], chat_template=template, bos_token="", eos_token="")[0][0]

    user = {"role": "user", "content": "x"}
    try:
        head = render([user, {"role": "assistant", "content": _MARK}])
        same = head == render([user, {"role": "user", "content": _MARK}])
    except Exception:  # noqa: BLE001 - a template that refuses two user messages in a row distinguishes roles
        head, same = render([user, {"role": "assistant", "content": _MARK}]), False
    if _MARK not in head or same:
        raise ValueError(
            "the chat template does not mark assistant turns: it must render an assistant message's content, with "
            "markers of its own that differ from a user message's (e.g. <|im_start|>assistant ... <|im_end|>)"
        )


class ChatFormat:
    """Token ids of an episode's prompt and of the environment's replies, from the tokenizer's chat template
    (``FALLBACK_CHAT_TEMPLATE`` when it has none).

    A reply is what rendering the conversation with the reply adds after rendering it without (the delta of
    ``[user, assistant] + reply`` over ``[user, assistant]``, with the generation prompt), preceded by what
    the template writes after an assistant turn's text (``<|im_end|>\\n``, ``<|eot_id|>``, ``</s>``) less
    the end token the model already sampled. Replies are rendered without the tool list (templates such as
    Mistral's move it to the last user message; the prompt already showed it). Every string of the messages and
    tools (contents, names, tool-call arguments, tool descriptions) is tokenised as plain text, in the prompt as in
    a reply: a tool result or a user message holding ``<|im_start|>`` gets the characters, never the special token
    (``_plain_tokens``).

    Args:
        tokenizer: a Hugging Face tokenizer.
        tools: JSON schemas shown in the prompt; a template that never reads ``tools`` raises
            ``ToolTemplateError``.
        image_placeholder: a VL model's image placeholder (``datamodules.vision.image_placeholder``): where a
            content spells it, it is tokenised with its special tokens (an image's place, which
            ``environments.chat`` puts there for an image part and expands into the image's tokens).
    """

    def __init__(self, tokenizer, tools: Sequence[dict] = (), image_placeholder: str | None = None):
        self.tokenizer, self.tools = tokenizer, list(tools) or None
        self.image_placeholder = image_placeholder
        self.template = getattr(tokenizer, "chat_template", None) or FALLBACK_CHAT_TEMPLATE
        if self.tools and "tools" not in self.template:
            raise ToolTemplateError(
                "tools are configured but the tokenizer's chat template does not render them (it never reads the "
                "`tools` variable): use a tool-calling template (Qwen2.5 / Hermes, Llama 3.1+, Mistral v0.3+)"
            )
        self._base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
        self._head = self.render(self._base)
        check_assistant_turns(self.template, self.render)
        self.glue_ids = self.encode(self._head[self._head.rindex(_MARK) + len(_MARK) :])
        self._replies: dict[str, list[int]] = {}  # rendered replies by their messages (games repeat them)
        added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)  # special tokens' spellings
        self._added = re.compile("|".join(map(re.escape, added))) if added else None

    def render(self, messages: list[dict], tools=None, generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, chat_template=self.template, add_generation_prompt=generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first messages with the tools and the generation prompt, BOS first (as the data module does); every
        string of the messages and tools as plain text."""
        text = self.render(messages, self.tools, generation_prompt=True)
        ids = self._plain_tokens(
            lambda v: self.render(v[0], v[1], generation_prompt=True), (messages, self.tools), text
        )
        return with_bos(ids, self.tokenizer)

    def reply_ids(self, messages: list[dict], turn_ids: Sequence[int]) -> list[int]:
        """Tokens appended after a turn that ended with ``turn_ids``: the rest of the template's end of an
        assistant turn, then the reply messages and the generation prompt."""
        glue = self.glue_ids
        if glue and turn_ids and turn_ids[-1] == glue[0]:
            glue = glue[1:]
        key = json.dumps(messages, sort_keys=True, default=str)
        if key not in self._replies:
            head, full = self._head, self.render(self._base + list(messages), generation_prompt=True)
            if not full.startswith(head):
                raise ValueError(
                    "the chat template renders a conversation differently once a reply is added, so replies cannot "
                    f"be appended as tokens: {head[-80:]!r} is not the start of {full[len(head) - 80 :][:160]!r}"
                )
            if len(self._replies) > 4096:
                self._replies.clear()
            reply = lambda v: self.render(self._base + v, generation_prompt=True)[len(head) :]  # noqa: E731
            self._replies[key] = self._plain_tokens(reply, list(messages), full[len(head) :])
        return glue + self._replies[key]

    def encode_text(self, text: str) -> list[int]:
        """``text`` as plain text: a special token's spelling in it (``<|im_start|>``) is not that token."""
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] if text else []

    def _content_ids(self, text: str) -> list[int]:
        """A content's ``text`` as plain text, but for the image placeholders in it (with their special tokens)."""
        if not self.image_placeholder or self.image_placeholder not in text:
            return self.encode_text(text)
        pieces = text.split(self.image_placeholder)
        ids = self.encode_text(pieces[0])
        for piece in pieces[1:]:
            ids += self.encode(self.image_placeholder) + self.encode_text(piece)
        return ids

    def _slotted(self, value, slots: list[str]):
        """``value`` with each string (or mapping key) that holds a special token's spelling replaced by a slot
        (``slots`` collects them in order)."""
        if isinstance(value, str):
            if not self._added.search(value):
                return value
            slots.append(value)
            return f"{_SLOT}{len(slots) - 1}Z"
        if isinstance(value, dict):
            return {self._slotted(k, slots): self._slotted(v, slots) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._slotted(v, slots) for v in value]
        return value

    def _plain_tokens(self, render, value, text: str) -> list[int]:
        """Tokens of ``text = render(value)``: the template's own text with its special tokens, every string of
        ``value`` that spells a special token as plain text (``encode_text``), so content cannot forge a turn.

        The template's text is ``render`` of ``value`` with those strings replaced by slots (``_slotted``); each
        slot is then matched, at its known place, against the ways a template writes a string (as is, trimmed, or
        JSON-escaped by ``tojson``), so a content that repeats the template's markers cannot shift the places."""
        slots: list[str] = []
        slotted = self._slotted(value, slots) if self._added is not None else value
        if not slots:
            return self.encode(text)  # nothing to forge: the whole text at once
        pieces = re.split(f"{_SLOT}(\\d+)Z", render(slotted))
        ids, at = self.encode(pieces[0]), len(pieces[0])
        for index, piece in zip(pieces[1::2], pieces[2::2]):
            original = slots[int(index)]
            forms = (
                original,
                original.strip(),
                json.dumps(original)[1:-1],
                json.dumps(original, ensure_ascii=False)[1:-1],
            )
            form = next((f for f in forms if text.startswith(f + piece, at)), None)
            if form is None:
                raise ValueError(
                    "the chat template renders a message's text differently from its content (not as is, trimmed, "
                    "nor JSON-escaped), so it cannot be tokenised without its special tokens"
                )
            ids += self._content_ids(form) + self.encode(piece)
            at += len(form) + len(piece)
        if at != len(text):
            raise ValueError("the chat template renders these messages differently with the same text")
        return ids


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
