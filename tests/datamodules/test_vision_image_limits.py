"""Images in data files are checked before they are decoded and rows do not keep their full-size pixels (issue 52,
items 5 and 6): a decompression bomb is one line naming the file, row and field; an image above
``max_image_pixels`` is refused from its header; a row keeps its image encoded (``EncodedImage``), decoded on use
into the same pixels."""

from __future__ import annotations

import io
import json

import pytest
from hostile_images import BOMB, HUGE, png_claiming, truncated_png

from aitraining_pl.datamodules.colours import colour_square
from aitraining_pl.datamodules.io import DataValidationError
from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.datamodules.vision import EncodedImage, read_image
from aitraining_pl.models.vision import load_processor


@pytest.fixture(scope="module")
def tokenizer():
    return load_processor("tiny-qwen2-vl").tokenizer


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _setup(tmp_path, tokenizer, image: bytes, **options):
    (tmp_path / "a.png").write_bytes(image)
    rows = [{"prompt": "colour?", "images": [str(tmp_path / "a.png")]}]
    data = PromptDataModule(data_path=_write(tmp_path / "p.jsonl", rows), tokenizer=tokenizer, batch_size=1, **options)
    data.setup()
    return data


def test_a_decompression_bomb_in_a_data_file_is_one_line_naming_the_file_row_and_field(tmp_path, tokenizer):
    """Before: PIL's DecompressionBombError went through (a traceback, exit 1)."""
    with pytest.raises(DataValidationError) as caught:
        _setup(tmp_path, tokenizer, png_claiming(*BOMB))
    message = str(caught.value)
    assert "p.jsonl, row 1, field 'images[0]'" in message and "DecompressionBombError" in message
    assert "\n" not in message


def test_an_image_above_max_image_pixels_is_refused_from_its_header_before_it_is_decoded(
    tmp_path, tokenizer, monkeypatch
):
    """The header says 9000 x 9000: before, the image was decoded (81M pixels, +305 MB for a real one) and then
    refused; now the size is refused before anything is decoded (decoding fails the test here)."""
    from PIL import PngImagePlugin

    def decoded(self):
        raise AssertionError("the image was decoded before its size was checked")

    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", decoded)
    with pytest.raises(DataValidationError, match=r"row 1, field 'images\[0\]'.*9000x9000 = 81000000 pixels is larger "
                       r"than max_image_pixels=3136"):  # fmt: skip
        _setup(tmp_path, tokenizer, png_claiming(*HUGE), max_image_pixels=3136)


def test_a_truncated_image_is_still_refused_before_training(tmp_path, tokenizer):
    with pytest.raises(DataValidationError, match=r"row 1, field 'images\[0\]'.*unreadable image"):
        _setup(tmp_path, tokenizer, truncated_png())


def test_rows_keep_their_images_encoded_and_decode_them_into_the_same_pixels(tmp_path, tokenizer):
    """Before: each row kept its image decoded at full size (a PIL image; +632 MB for 20 rows of 3000 x 3000 PNGs)."""
    square = colour_square("green", seed=3)
    buffer = io.BytesIO()
    square.save(buffer, format="PNG")
    data = _setup(tmp_path, tokenizer, buffer.getvalue())
    (kept,) = data.train_dataset[0]["images"]
    assert isinstance(kept, EncodedImage) and kept.data == buffer.getvalue() and kept.size == square.size
    assert list(kept.rgb().getdata()) == list(square.convert("RGB").getdata())


def test_read_image_takes_the_size_from_the_header_without_decoding():
    image = read_image(png_claiming(*HUGE), "test", 1, "images[0]", decode=False)
    assert image.size == HUGE
