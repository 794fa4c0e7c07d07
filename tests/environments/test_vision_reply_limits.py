"""An environment's reply with images has the endpoint's bounds (issue 52, items 3 and 5): an image above
``MAX_IMAGE_PIXELS`` is refused from its header (never decoded), a decompression bomb and more than ``MAX_IMAGES``
images are one ``DataValidationError`` naming the reply's field."""

from __future__ import annotations

import pytest
from hostile_images import BOMB, HUGE, png_claiming

from aitraining_pl.datamodules.io import DataValidationError
from aitraining_pl.environments.chat import chat_ids, vision_chat_format
from aitraining_pl.models.vision import load_processor

WHERE, SOURCE = "EpisodeStep.messages", "the environment's reply"


@pytest.fixture(scope="module")
def chat():
    return vision_chat_format(load_processor("tiny-qwen2-vl").tokenizer)


def _reply(chat, images: list[bytes]):
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "colour?"}]
    return chat_ids(chat, [{"role": "user", "content": content}], images=images, where=WHERE, source=SOURCE)


def test_an_image_above_max_image_pixels_in_a_reply_is_refused_before_it_is_decoded(chat, monkeypatch):
    """Before: ``vision_chat`` read reply images with no pixel limit and decoded every one (81M pixels here)."""
    from PIL import PngImagePlugin

    def decoded(self):
        raise AssertionError("the image was decoded before its size was checked")

    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", decoded)
    with pytest.raises(DataValidationError, match=r"reply, field 'EpisodeStep.messages\[0\].content\[0\]'.*"
                       r"9000x9000 = 81000000 pixels is larger than max_image_pixels"):  # fmt: skip
        _reply(chat, [png_claiming(*HUGE)])


def test_a_decompression_bomb_in_a_reply_is_one_line_naming_the_field(chat):
    with pytest.raises(DataValidationError, match=r"content\[0\]'.*DecompressionBombError"):
        _reply(chat, [png_claiming(*BOMB)])


def test_more_images_than_max_images_in_a_reply_are_refused(chat):
    from aitraining_pl.datamodules.vision import MAX_IMAGES

    with pytest.raises(DataValidationError, match=rf"field 'EpisodeStep.messages'.*more than the {MAX_IMAGES}"):
        _reply(chat, [b"not read"] * (MAX_IMAGES + 1))
