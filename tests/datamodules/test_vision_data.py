"""Prompts with images (``datamodules.vision``): the layouts (an ``images`` column of paths, PIL images or bytes,
TRL's content parts, RLAIF-V's ``image`` column, a ChartQA-like prompt set), image tokens in the prompt, and one line
naming the file, row and field for bad input."""

from __future__ import annotations

import base64
import io
import json

import pytest

from aitraining_pl.datamodules.colours import colour_square
from aitraining_pl.datamodules.io import DataValidationError
from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.models.vision import load_processor


@pytest.fixture(scope="module")
def tokenizer():
    return load_processor("tiny-qwen2-vl").tokenizer


def _png(colour="red") -> bytes:
    buffer = io.BytesIO()
    colour_square(colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_chartqa_like_file_with_paths_parts_and_data_urls(tmp_path, tokenizer):
    """A ChartQA-like set: a question about a chart image, the image as a path (``images`` column, string prompt
    without a placeholder: the image goes first), as TRL's ``{"type": "image"}`` part, or as an ``image_url`` part
    with a data URL; the image tokens are in the prompt ids and the batch carries the pixel values."""
    (tmp_path / "chart.png").write_bytes(_png("green"))
    url = "data:image/png;base64," + base64.b64encode(_png("blue")).decode()
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which bar is highest?"}]}]
    rows = [
        {"prompt": "What is the value in 2020?", "images": [str(tmp_path / "chart.png")], "answer": "12"},
        {"prompt": parts, "images": [str(tmp_path / "chart.png")], "answer": "A"},
        {
            "prompt": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Trend?"}],
                }
            ],
            "answer": "up",
        },  # fmt: skip
    ]
    data = PromptDataModule(data_path=_write(tmp_path / "chartqa.jsonl", rows), tokenizer=tokenizer, batch_size=3)
    data.setup()
    batch = next(iter(data.train_dataloader()))
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ((batch["input_ids"] == image_id).sum(1) == 4).all()  # 4 image tokens per 56 x 56 image
    assert len(batch["vision"].prompts) == 3 and batch["vision"].prompts[0]["pixel_values"].shape[0] == 16
    assert sorted(m["answer"] for m in batch["metadata"]) == ["12", "A", "up"]
    assert all("images" not in m for m in batch["metadata"])


@pytest.mark.parametrize(
    "row, message, field",
    [
        ({"prompt": "colour?", "images": ["missing.png"]}, "image file not found", "images[0]"),
        ({"prompt": "colour?", "images": [b"not a png"]}, "unreadable image", "images[0]"),
        ({"prompt": "colour?", "images": ["https://example.com/a.png"]}, "refused: nothing is fetched", "images[0]"),
        (
            {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}], "images": ["PNG"]},
            "2 image placeholder(s) but 1 image(s)",
            "images",
        ),  # fmt: skip
        ({"prompt": "colour?", "images": ["BIG"]}, "larger than max_image_pixels=3136: refused", "images[0]"),
    ],
)
def test_bad_images_name_file_row_and_field(tmp_path, tokenizer, row, message, field):
    (tmp_path / "ok.png").write_bytes(_png())
    colour_square("red", size=80).save(tmp_path / "big.png")
    named = {"PNG": str(tmp_path / "ok.png"), "BIG": str(tmp_path / "big.png")}
    row = {**row, "images": [named.get(v, v) if isinstance(v, str) else v for v in row["images"]]}
    row["images"] = [base64.b64encode(v).decode() if isinstance(v, bytes) else v for v in row["images"]]
    if isinstance(row["images"][0], str) and not row["images"][0].endswith(".png") and "://" not in row["images"][0]:
        row["images"] = [f"data:image/png;base64,{row['images'][0]}"]
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "fine", "images": [str(tmp_path / "ok.png")]}, row])
    data = PromptDataModule(data_path=path, tokenizer=tokenizer, batch_size=1, max_image_pixels=3136 if "max" in message
                            else None)  # fmt: skip
    with pytest.raises(DataValidationError) as err:
        data.setup()
    text = str(err.value)
    assert "\n" not in text and path in text and "row 2" in text and f"'{field}'" in text and message in text


def test_pil_images_and_bytes_in_memory(tokenizer):
    data = PromptDataModule(prompts=["colour?", "colour?"], tokenizer=tokenizer, batch_size=2,
                            metadata=[{"images": [colour_square("red")]}, {"images": [_png("blue")]}])  # fmt: skip
    data.setup()
    batch = next(iter(data.train_dataloader()))
    assert [p["image_grid_thw"].tolist() for p in batch["vision"].prompts] == [[[1, 4, 4]]] * 2
