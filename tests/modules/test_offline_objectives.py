"""KTO (unpaired data), ORPO, CPO and RPO: the KTO data contract, bad rows, and that each objective learns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dpo_utils import preference_data, preference_rows, read_metrics, series, write_config, write_jsonl

from aitraining_pl.cli import build_cli
from aitraining_pl.datamodules.io import DataValidationError
from aitraining_pl.datamodules.kto import KTOCollator, KTODataModule
from aitraining_pl.errors import HyperparameterError
from aitraining_pl.models.scoring import completion_logps

ROOT = Path(__file__).resolve().parents[2]
KTO_MODEL, KTO_DATA = "aitraining_pl.modules.kto.KTOModule", "aitraining_pl.datamodules.kto.KTODataModule"


def unpaired_rows(pairs: list[dict]) -> list[dict]:
    """One labelled completion per pair, alternating: the chosen one as desirable, the rejected one not."""
    return [
        {"prompt": p["prompt"], "completion": p["chosen"] if i % 2 == 0 else p["rejected"], "label": i % 2 == 0}
        for i, p in enumerate(pairs)
    ]


# ---------------------------------------------------------------- data


def test_kto_collator_pairs_each_prompt_with_the_previous_rows_completion():
    rows = [
        {"prompt_ids": [1, 2], "completion_ids": [5, 6, 7], "label": True, "index": 0},
        {"prompt_ids": [3], "completion_ids": [8], "label": False, "index": 1},
        {"prompt_ids": [4, 4, 4], "completion_ids": [9, 9], "label": True, "index": 2},
    ]
    batch = KTOCollator(pad_token_id=0, max_length=5)(rows)
    assert batch["input_ids"].tolist() == [
        [1, 2, 5, 6, 7],
        [3, 8, 0, 0, 0],
        [4, 4, 4, 9, 9],
        [1, 2, 9, 9, 0],  # prompt 0 + completion of row 2 (cyclic)
        [3, 5, 6, 7, 0],  # prompt 1 + completion of row 0
        [4, 4, 4, 8, 0],  # prompt 2 + completion of row 1
    ]
    assert batch["completion_mask"][3].tolist() == [0, 0, 1, 1, 0]
    assert batch["label"].tolist() == [True, False, True] and batch["index"].tolist() == [0, 1, 2]
    cut = KTOCollator(pad_token_id=0, max_length=3)(rows)  # a mismatched completion is cut to max_length
    assert cut["input_ids"][4].tolist()[:4] == [3, 5, 6, 0]


def test_kto_data_module_reads_the_unpaired_layout(tmp_path, byte_tokenizer):
    path = write_jsonl(tmp_path / "kto.jsonl", unpaired_rows(preference_rows(10)))
    data = KTODataModule(
        data_path=str(path), tokenizer=byte_tokenizer, val_split=0.2, batch_size=4, max_length=96, max_prompt_length=48
    )
    data.setup("fit")
    assert len(data.train_dataset) == 8 and len(data.val_dataset) == 2
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape[0] == 8 and batch["label"].dtype == torch.bool
    # row B + i shares row i's prompt (one packed sequence under share_prompt)
    prompt_len = int((batch["completion_mask"][0] == 0).sum() - (batch["attention_mask"][0] == 0).sum())
    assert torch.equal(batch["input_ids"][0, :prompt_len], batch["input_ids"][4, :prompt_len])


@pytest.mark.parametrize(
    "row, field, why",
    [
        ({"prompt": "hi", "completion": "yes", "label": "yes"}, "label", "expected true or false, got 'yes'"),
        ({"prompt": "hi", "completion": "", "label": True}, "completion", "empty text"),
        ({"prompt": None, "completion": "yes", "label": False}, "prompt", "missing field"),
    ],
)
def test_kto_bad_rows_name_file_row_and_field(tmp_path, byte_tokenizer, row, field, why):
    good = unpaired_rows(preference_rows(4))
    path = write_jsonl(tmp_path / "bad.jsonl", good[:2] + [row] + good[2:])
    data = KTODataModule(data_path=str(path), tokenizer=byte_tokenizer, val_split=0.0)
    with pytest.raises(DataValidationError) as info:
        data.setup("fit")
    assert (info.value.row, info.value.field) == (3, field) and info.value.source.endswith("bad.jsonl")
    assert why in str(info.value)


def test_kto_refuses_single_row_batches(byte_tokenizer):
    with pytest.raises(HyperparameterError, match="batch_size.*>= 2"):
        KTODataModule(prompts=["a"], completions=["b"], labels=[True], tokenizer=byte_tokenizer, batch_size=1)


def test_quickstart_kto_data_is_the_generators_output():
    from aitraining_pl.data.make_quickstart_kto import make

    data = ROOT / "aitraining_pl" / "data"
    pairs = [json.loads(line) for line in (data / "quickstart_preferences.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (data / "quickstart_kto.jsonl").read_text().splitlines()]
    assert rows == make(pairs)
    assert 0.4 < sum(r["label"] for r in rows) / len(rows) < 0.6


# ---------------------------------------------------------------- learning


def _fit(config: Path):
    return build_cli(["fit", "--config", str(config), "--trainer.enable_progress_bar", "false"])


def _before(config: Path, key: str) -> float:
    """``key`` of one validation pass before training."""
    cli = build_cli(["validate", "--config", str(config), "--trainer.enable_progress_bar", "false"])
    return float(cli.trainer.callback_metrics[key])


def same_length_rows(n: int, seed: int = 0) -> list[dict]:
    """``preference_rows`` with each dismissive answer repeated to the chosen answer's length in characters, so
    that a reference-free summed log-prob (CPO) is not decided by length alone."""
    rows = preference_rows(n, seed)
    for row in rows:
        size = len(row["chosen"])
        row["rejected"] = ((row["rejected"] + " ") * size)[:size].strip().ljust(size, ".")
    return rows


PAIR_RUNS = {
    "orpo": ("aitraining_pl.modules.orpo.ORPOModule", {"beta": 0.5}),
    "cpo": ("aitraining_pl.modules.orpo.CPOModule", {"beta": 0.1, "cpo_alpha": 1.0}),
    "rpo": ("aitraining_pl.modules.dpo.DPOModule", {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 1.0]}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PAIR_RUNS))
def test_orpo_cpo_rpo_raise_held_out_preference_accuracy(tmp_path, name):
    model_class, model = PAIR_RUNS[name]
    config = write_config(
        tmp_path,
        rows=same_length_rows(64),
        model_class=model_class,
        model=model,
        trainer={"max_steps": 24, "val_check_interval": 12},
    )
    before = _before(config, "val/rewards/accuracies")
    cli = _fit(config)
    rows = read_metrics(tmp_path)
    losses, accuracy = series(rows, "train/loss"), series(rows, "val/rewards/accuracies")
    assert (cli.model.reference is None) == (name != "rpo")  # ORPO and CPO are reference-free
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4
    assert accuracy[-1] >= 0.9 and accuracy[-1] > before, (before, accuracy)
    assert {"val/loss", "train/nll_loss" if name != "rpo" else "train/loss"} <= {k for r in rows for k in r}


@pytest.mark.slow
def test_kto_learns_from_unpaired_labels(tmp_path):
    """Trained on one labelled completion per prompt, KTO separates desirable from undesirable held-out
    completions (val/rewards/margins from 0 at the start, where policy = reference) and prefers the chosen
    completion of held-out *pairs* it never saw either side of."""
    pairs = same_length_rows(80, seed=1)
    train, held_out = pairs[:64], pairs[64:]
    config = write_config(
        tmp_path,
        model_class=KTO_MODEL,
        data_class=KTO_DATA,
        rows=unpaired_rows(train),
        model={"beta": 0.1},
        trainer={"max_steps": 24, "val_check_interval": 12},
    )
    assert _before(config, "val/rewards/margins") == pytest.approx(0.0, abs=1e-5)  # policy = reference
    cli = _fit(config)
    rows = read_metrics(tmp_path)
    margins = series(rows, "val/rewards/margins")
    assert margins[-1] > 0.5, margins
    assert all(k in rows[-1] or any(k in r for r in rows) for k in ("train/loss", "val/loss", "train/kl"))
    # held-out pairs: the implicit reward of the chosen completion above the rejected one
    module = cli.model
    data = preference_data(
        held_out, module.tokenizer, val_split=0.0, batch_size=16, max_length=96, max_prompt_length=48
    )
    data.setup("fit")
    wins = []
    with torch.no_grad():
        for batch in data.ordered_dataloaders()["train"]:
            policy = completion_logps(module.policy.eval(), batch).logps
            reference = module._reference_forward(batch)
            chosen, rejected = (policy - reference).chunk(2)
            wins += (chosen > rejected).tolist()
    assert sum(wins) / len(wins) >= 0.8, wins


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kto", "orpo"])
def test_quickstart_recipe_runs_offline_with_train_and_val_loss(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    data = (
        ROOT / "aitraining_pl" / "data" / ("quickstart_kto.jsonl" if name == "kto" else "quickstart_preferences.jsonl")
    )
    args = ["fit", "--config", str(ROOT / f"configs/quickstart/{name}.yaml"), "--data.init_args.data_path", str(data)]
    args += ["--trainer.max_steps", "3", "--trainer.limit_val_batches", "2", "--trainer.val_check_interval", "3"]
    args += ["--trainer.log_every_n_steps", "1"]
    cli = build_cli(args + ["--trainer.enable_progress_bar", "false"])
    assert cli.trainer.global_step == 3
    header = next((tmp_path / f"runs/quickstart-{name}/csv").glob("version_*/metrics.csv")).read_text().splitlines()[0]
    assert {"train/loss", "val/loss"} <= set(header.split(","))
    assert (tmp_path / f"runs/quickstart-{name}/export/last/model.safetensors").is_file()
