"""DPO on image preference pairs in RLAIF-V's layout (an ``image`` column of ``{"bytes", "path"}`` dicts, a
``question`` string, ``chosen`` / ``rejected`` answers), read from Parquet: held-out preference accuracy rises above
what any text-only policy can reach (1/2: the right colour is only in the image)."""

from __future__ import annotations

import io
import random

import datasets
import pytest
from conftest import quiet_trainer

from aitraining_pl.datamodules.colours import COLOURS, colour_square
from aitraining_pl.datamodules.preference import PreferenceDataModule
from aitraining_pl.modules.dpo import DPOModule

PRESET = "tiny-qwen2-vl-colours"


def _rlaif_v(path, n: int, seed: int) -> str:
    rng, names, rows = random.Random(seed), list(COLOURS), []
    for i in range(n):
        colour = names[i % 3]
        buffer = io.BytesIO()
        colour_square(colour, seed=seed * 1000 + i).save(buffer, format="PNG")
        wrong = rng.choice([c for c in names if c != colour])
        rows.append({"image": {"bytes": buffer.getvalue(), "path": None}, "question": "colour?",
                     "chosen": colour, "rejected": wrong, "ds_name": "colours"})  # fmt: skip
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


@pytest.mark.slow
def test_dpo_on_image_pairs_raises_held_out_preference_accuracy(tmp_path):
    module = DPOModule(model_config={"preset": PRESET}, tokenizer_name=PRESET, beta=0.1, learning_rate=0.005)
    data = PreferenceDataModule(
        data_path=_rlaif_v(tmp_path / "train.parquet", 48, 0),
        val_data_path=_rlaif_v(tmp_path / "val.parquet", 30, 1),
        prompt_column="question",
        tokenizer=module.tokenizer,
        batch_size=16,
        max_length=64,
        max_prompt_length=48,
    )
    trainer = quiet_trainer(tmp_path, max_epochs=8, num_sanity_val_steps=0)
    before = trainer.validate(module, data, verbose=False)[0]["val/rewards/accuracies"]
    trainer.fit(module, data)
    after = trainer.validate(module, data, verbose=False)[0]["val/rewards/accuracies"]
    print(f"DPO on image pairs: held-out preference accuracy {before:.2f} -> {after:.2f}")
    assert after >= 0.8
