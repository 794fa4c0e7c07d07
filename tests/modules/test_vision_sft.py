"""SFT with images (``SFTDataModule`` rows with an ``images`` column or TRL's content parts, ``SFTModule``): the image
tokens are never trained on, bad rows stop with one line naming file, row and field, and SFT on the colour task
(``datamodules.colours``: the answer is the colour's letter) lowers the held-out loss and raises the held-out accuracy
with the images, not with blank ones."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from conftest import quiet_trainer

from aitraining_pl.datamodules.colours import colour_rows, colour_square
from aitraining_pl.datamodules.io import DataValidationError
from aitraining_pl.datamodules.sft import SFTDataModule
from aitraining_pl.models.vision import VisionInputs
from aitraining_pl.models.vision_scoring import vision_token_scores
from aitraining_pl.modules.sft import SFTModule

PRESET = "tiny-qwen2-vl-colours"


def sft_rows(n: int, seed: int, blank: bool = False) -> list[dict]:
    """The colour task as prompt-completion rows: the image before ``colour?``, the colour's letter as completion."""
    return [{**r, "completion": r.pop("colour")[0]} for r in colour_rows(n, seed, blank)]


def loader(tokenizer, rows, **arguments):
    data = SFTDataModule(rows=rows, tokenizer=tokenizer, val_split=0, shuffle=False, **arguments)
    data.setup()
    return data.train_dataloader()


@torch.no_grad()
def accuracy(module: SFTModule, batch: dict) -> float:
    """Share of rows whose most likely letter (of r, g, b) at the completion is the right one."""
    tokenizer = module.tokenizer
    letters = [tokenizer.convert_tokens_to_ids(c) for c in "rgb"]
    ids, attention, scored = batch["input_ids"], batch["attention_mask"], batch["completion_mask"].bool()
    first = scored.int().argmax(1)  # the letter's column
    rows = torch.arange(len(ids))
    logps = []
    for letter in letters:
        variant = ids.clone()
        variant[rows, first] = letter
        only = torch.zeros_like(scored)
        only[rows, first] = True
        logps.append(vision_token_scores(module.policy, variant, attention, only, batch["vision"]).logps.sum(1))
    guess = torch.stack(logps, 1).argmax(1)
    truth = torch.tensor([letters.index(i) for i in ids[rows, first].tolist()])
    return float((guess == truth).float().mean())


def test_image_tokens_are_never_trained_on_and_both_layouts_agree():
    module = SFTModule(model_config={"preset": PRESET}, tokenizer_name=PRESET)
    tokenizer = module.tokenizer
    image = colour_square("red", seed=1)
    column = {"prompt": "colour?", "completion": "r", "images": [image]}
    parts = {
        "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}],
        "completion": [{"role": "assistant", "content": "r"}],
        "images": [image],
    }
    for completion_only_loss in (True, False):
        batch = next(iter(loader(tokenizer, [column, parts], completion_only_loss=completion_only_loss)))
        image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        on_image = batch["input_ids"] == image_id
        assert on_image.sum(1).tolist() == [on_image[0].sum().item()] * 2 and on_image.any()  # the image's tokens
        assert not (batch["completion_mask"].bool() & on_image).any()  # never scored, even on all tokens
        assert len(batch["vision"]) == 2 and batch["vision"].prompts[0]["pixel_values"].shape[0] > 0
    loss = module.shared_step(batch, "val")
    assert torch.isfinite(loss)


@pytest.mark.parametrize(
    "row, field, message",
    [
        ({"prompt": "colour?", "completion": "r", "images": ["missing.png"]}, "images[0]", "image file not found"),
        ({"prompt": "colour?", "completion": "r", "images": ["BROKEN"]}, "images[0]", "unreadable image"),
        (
            {
                "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}],
                "completion": "r",
                "images": ["IMAGE"],
            },
            "images",
            "2 image placeholder(s) but 1 image(s)",
        ),  # fmt: skip
    ],
    ids=["missing", "unreadable", "count"],
)
def test_a_bad_row_is_one_line_naming_file_row_and_field(tmp_path, row, field, message):
    module = SFTModule(model_config={"preset": PRESET}, tokenizer_name=PRESET)
    good = tmp_path / "red.png"
    colour_square("red").save(good)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    row = json.loads(json.dumps(row).replace("IMAGE", str(good)).replace("BROKEN", str(broken)))
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"prompt": "colour?", "completion": "r", "images": [str(good)]},
                                                      row]))  # fmt: skip
    data = SFTDataModule(data_path=str(path), tokenizer=module.tokenizer, val_split=0)
    with pytest.raises(DataValidationError) as err:
        data.setup()
    text = str(err.value)
    assert "\n" not in text and str(path) in text and "row 2" in text and repr(field) in text and message in text


def run(tmp_path, blank: bool) -> tuple[tuple[float, float], tuple[float, float]]:
    """SFT on 48 colour rows (``blank``: black images); held-out (loss, accuracy) on 30 rows before and after."""
    pl.seed_everything(0)
    module = SFTModule(model_config={"preset": PRESET}, tokenizer_name=PRESET, learning_rate=0.004,
                       lr_schedule="constant")  # fmt: skip
    tokenizer = module.tokenizer
    held_out = loader(tokenizer, sft_rows(30, seed=7, blank=blank), batch_size=30)
    train = SFTDataModule(rows=sft_rows(48, seed=0, blank=blank), tokenizer=tokenizer, val_split=0, batch_size=16)
    trainer = quiet_trainer(tmp_path, max_epochs=EPOCHS, num_sanity_val_steps=0, limit_val_batches=0)

    def measure() -> tuple[float, float]:
        loss = quiet_trainer(tmp_path).validate(module, held_out, verbose=False)[0]["val/loss"]
        return round(loss, 3), accuracy(module, next(iter(held_out)))

    before = measure()
    trainer.fit(module, train)
    after = measure()
    print(f"SFT on the colour task, {'blank images' if blank else 'images'}: held-out (loss, accuracy) {before} -> "
          f"{after}")  # fmt: skip
    return before, after


EPOCHS = 6


@pytest.mark.slow
def test_sft_learns_the_colour_from_the_image_and_not_from_blank_images(tmp_path):
    before, after = run(tmp_path / "images", blank=False)
    assert after[0] < before[0] and after[1] >= 0.8
    _, blank = run(tmp_path / "blank", blank=True)
    assert blank[1] <= 0.4 and blank[0] > after[0]  # identical images: one letter for all, 1/3


def test_a_batch_mixing_rows_with_and_without_images_scores_each_row_as_alone():
    module = SFTModule(model_config={"preset": PRESET}, tokenizer_name=PRESET)
    rows = [{"prompt": "colour?", "completion": "g", "images": [colour_square("green", seed=2)]},
            {"prompt": "colour?", "completion": "b"}]  # fmt: skip
    mixed = next(iter(loader(module.tokenizer, rows, batch_size=2)))
    assert mixed["vision"].prompts[1] == {}

    def logps(batch):  # a text row alone: no images at all
        scored = batch["completion_mask"].bool()
        vision = batch.get("vision") or VisionInputs([{}] * len(scored))
        with torch.no_grad():
            return vision_token_scores(module.policy, batch["input_ids"], batch["attention_mask"], scored,
                                       vision).logps.sum(1)  # fmt: skip

    alone = [
        logps(next(iter(loader(module.tokenizer, rows[:1])))),
        logps(next(iter(loader(module.tokenizer, rows[1:])))),
    ]
    torch.testing.assert_close(logps(mixed), torch.cat(alone), atol=1e-5, rtol=1e-4)


def test_a_max_length_that_would_cut_an_image_is_refused():
    module = SFTModule(model_config={"preset": PRESET}, tokenizer_name=PRESET)
    rows = [{"prompt": "colour?", "completion": "r", "images": [colour_square("red")]}]
    with pytest.raises(DataValidationError, match=r"row 1, field 'prompt'.*an image cannot be cut"):
        loader(module.tokenizer, rows, max_length=4)
