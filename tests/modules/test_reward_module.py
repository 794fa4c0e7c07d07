"""Reward-model training: RewardModule on preference batches, the multi-objective module and its data,
the seed's RewardModelTrainer, checkpoints, configs."""

from __future__ import annotations

import json
import random

import lightning.pytorch as pl
import pytest
import torch
from conftest import TINY_LLAMA
from reward_fixtures import synthetic_pairs

from aitraining_pl.compat import RewardModelTrainer
from aitraining_pl.datamodules.io import DataValidationError
from aitraining_pl.datamodules.preference import PreferenceDataModule
from aitraining_pl.datamodules.scores import ScoresDataModule
from aitraining_pl.losses import bradley_terry_loss
from aitraining_pl.models import RewardModel, RewardModelConfig, load_reward_model
from aitraining_pl.modules.reward import MultiObjectiveRewardModule, PairwiseRewardModule, RewardModule


def _trainer(**kw) -> pl.Trainer:
    options = dict(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, accelerator="cpu", devices=1,
    )  # fmt: skip
    return pl.Trainer(**{**options, **kw})


def _module(cls=RewardModule, **kw):
    kw.setdefault("learning_rate", 3e-3)
    return cls(model_config=TINY_LLAMA, tokenizer_name="byte", warmup_ratio=0.0, lr_schedule="constant", **kw)


def _preference_data(module, n=128, seed=0, **kw) -> PreferenceDataModule:
    prompts, chosen, rejected = synthetic_pairs(n, seed)
    options = dict(batch_size=16, val_split=0.25, max_length=64, max_prompt_length=32, seed=seed)
    return PreferenceDataModule(
        prompts=prompts, chosen=chosen, rejected=rejected, tokenizer=module.tokenizer, **{**options, **kw}
    )


# ------------------------------------------------------------------ learning
@pytest.mark.slow
def test_reward_module_learns_held_out_preferences_and_exports_for_ppo(tmp_path):
    pl.seed_everything(0)
    module = _module()
    data = _preference_data(module)
    trainer = _trainer(max_epochs=4)
    before = trainer.validate(module, datamodule=data, verbose=False)[0]["val/loss"]
    head_before = module.reward_model.head.weight.detach().clone()
    trainer.fit(module, datamodule=data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["val/rewards/accuracies"] >= 0.9 and metrics["val/loss"] < 0.5 * before
    assert metrics["val/rewards/margins"] > 0 and "train/reward_mean" in metrics and "val/reward_mean" in metrics
    assert not torch.equal(module.reward_model.head.weight, head_before)
    # the exported folder is what PPO loads as its reward source
    from aitraining_pl.rewards import RewardModelSource

    module.save_pretrained(tmp_path / "rm")
    source = RewardModelSource(str(tmp_path / "rm"))
    prompts, chosen, rejected = synthetic_pairs(32, seed=123)  # fresh pairs
    good, bad = source(prompts, chosen, [{}] * 32), source(prompts, rejected, [{}] * 32)
    assert sum(g > b for g, b in zip(good, bad)) / 32 >= 0.9


def test_shared_step_is_bradley_terry_with_margin_and_centring():
    module = _module(center_rewards_coefficient=0.5)
    module.eval()
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 1], [8, 9, 1, 0], [5, 6, 1, 0], [8, 1, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0]]),
        "margin": torch.tensor([0.5, 1.0]),
    }
    logged = {}
    module.log_metrics = lambda stage, values, batch_size, prog_bar=(): logged.update(values)
    loss = module.shared_step(batch, "train")
    rewards = module.reward_model.score(batch["input_ids"], batch["attention_mask"])
    chosen, rejected = rewards[:2], rewards[2:]
    hand = (
        -torch.log(torch.sigmoid(chosen - rejected - batch["margin"])).mean() + 0.5 * ((chosen + rejected) ** 2).mean()
    )
    torch.testing.assert_close(loss, hand)
    torch.testing.assert_close(loss, bradley_terry_loss(chosen, rejected, batch["margin"], 0.5))
    assert {"loss", "rewards/accuracies", "rewards/margins", "reward_mean"} <= set(logged)
    torch.testing.assert_close(logged["rewards/accuracies"], (chosen > rejected).float())


def test_pairwise_module_trains_a_pairwise_model_and_logs_preference_prob():
    module = _module(PairwiseRewardModule)
    data = _preference_data(module, n=32, batch_size=8)
    trainer = _trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1)
    trainer.fit(module, datamodule=data)
    assert type(module.reward_model).__name__ == "PairwiseRewardModel"
    assert "val/preference_prob" in trainer.callback_metrics


def test_bf16_mixed_smoke():
    module = _module()
    data = _preference_data(module, n=16, batch_size=8, val_split=0.0)
    head_before = module.reward_model.head.weight.detach().clone()
    trainer = _trainer(max_steps=2, precision="bf16-mixed")
    trainer.fit(module, datamodule=data)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert module.reward_model.head.weight.dtype == torch.float32
    assert not torch.equal(module.reward_model.head.weight, head_before)


def test_checkpoint_round_trip_with_weights_only(tmp_path):
    module = _module(lora={"r": 4, "alpha": 8, "dropout": 0.0}, pooling_strategy="mean")
    data = _preference_data(module, n=32, batch_size=8, val_split=0.0)
    trainer = _trainer(max_steps=2, enable_checkpointing=True, default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=data)
    path = tmp_path / "rm.ckpt"
    trainer.save_checkpoint(path)
    restored = RewardModule.load_from_checkpoint(path, weights_only=True)
    texts = ["Q: bc\nA: aeiou", "Q: d\nA: xyz"]
    assert restored.reward_model.predict_rewards(texts) == pytest.approx(
        module.reward_model.predict_rewards(texts), abs=1e-6
    )


# ------------------------------------------------------------------ multi-objective
def _scores_rows(n: int, seed: int = 0) -> tuple[list[str], list[list]]:
    """Objective 0 = fraction of vowels, objective 1 = length / 10, objective 2 never known."""
    rng = random.Random(seed)
    texts, scores = [], []
    for _ in range(n):
        text = "".join(rng.choice("aeiouxyzqk") for _ in range(rng.randint(3, 10)))
        vowels = sum(c in "aeiou" for c in text) / len(text)
        scores.append([vowels, len(text) / 10 if rng.random() < 0.7 else None, None])
        texts.append(text)
    return texts, scores


@pytest.mark.slow
def test_multi_objective_module_learns_and_never_touches_an_unknown_objective(tmp_path):
    pl.seed_everything(0)
    module = _module(MultiObjectiveRewardModule, num_objectives=3, objective_names=["vowels", "length", "unknown"])
    texts, scores = _scores_rows(96)
    data = ScoresDataModule(
        num_objectives=3, texts=texts, scores=scores, tokenizer=module.tokenizer, batch_size=16, val_split=0.25
    )
    trainer = _trainer(max_epochs=4)
    before = trainer.validate(module, datamodule=data, verbose=False)[0]["val/loss"]
    unknown_head = module.reward_model.head.weight[2].detach().clone()
    trainer.fit(module, datamodule=data)
    after = float(trainer.callback_metrics["val/loss"])
    assert after < 0.5 * before
    assert "train/loss/vowels" in trainer.callback_metrics and "val/loss/length" in trainer.callback_metrics
    torch.testing.assert_close(module.reward_model.head.weight[2], unknown_head, rtol=0, atol=0)
    module.save_pretrained(tmp_path / "multi")
    loaded = load_reward_model(tmp_path / "multi")
    assert type(loaded).__name__ == "MultiObjectiveRewardModel" and loaded.num_outputs == 3
    trainer.save_checkpoint(tmp_path / "multi.ckpt")
    restored = MultiObjectiveRewardModule.load_from_checkpoint(tmp_path / "multi.ckpt", weights_only=True)
    assert restored.objective_names == ["vowels", "length", "unknown"]
    assert restored.reward_model.predict_rewards(texts[:4]) == pytest.approx(
        loaded.predict_rewards(texts[:4]), abs=1e-6
    )


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    "rows, match",
    [
        ([{"text": "abc", "score": [1, 2]}], r"missing column\(s\) 'scores'; columns found: text, score"),
        (
            [{"text": "abc", "scores": [1, 2]}, {"text": "de", "scores": [1, 2, 3]}],
            r"row 2, field 'scores': expected 2 scores, got 3",
        ),
        ([{"text": "abc", "scores": 1.5}], r"row 1, field 'scores': expected a list of 2 scores, got float"),
        ([{"text": "abc", "scores": [1, "high"]}], r"row 1, field 'scores': score 1 is 'high'"),
        ([{"text": "abc", "scores": [None, None]}], r"row 1, field 'scores': every score is null"),
        ([{"text": "", "scores": [1, 2]}], r"row 1, field 'text': empty text"),
    ],
)
def test_scores_data_errors_name_file_row_and_field(tmp_path, byte_tokenizer, rows, match):
    path = _write_jsonl(tmp_path / "scores.jsonl", rows)
    data = ScoresDataModule(path, num_objectives=2, tokenizer=byte_tokenizer, val_split=0.0)
    with pytest.raises(DataValidationError, match=match) as info:
        data.setup("fit")
    assert str(info.value).startswith(path)


def test_scores_batches_mask_unknown_objectives(byte_tokenizer):
    data = ScoresDataModule(
        num_objectives=2, texts=["ab", "cde"], scores=[[1.0, None], [0.5, 2]], tokenizer=byte_tokenizer, val_split=0.0
    )
    data.setup("fit")
    batch = data.collate_fn(data.train_dataset)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (2, 4)  # text + EOS, right padded
    assert batch["objective_mask"].tolist() == [[True, False], [True, True]]
    assert batch["targets"].tolist() == [[1.0, 0.0], [0.5, 2.0]]


def test_preference_data_missing_column_is_reported_before_training(tmp_path):
    module = _module()
    path = _write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "p", "chosen": "a"}])
    data = PreferenceDataModule(path, tokenizer=module.tokenizer, val_split=0.0)
    with pytest.raises(DataValidationError, match="missing column.*'rejected'"):
        _trainer(max_steps=1).fit(module, datamodule=data)


# ------------------------------------------------------------------ the seed's facade
def test_reward_model_trainer_seed_api(tmp_path, byte_tokenizer):
    config = RewardModelConfig(model_config=TINY_LLAMA, dropout_prob=0.0, learning_rate=3e-3, warmup_steps=1)
    model = RewardModel(config)
    trainer = RewardModelTrainer(model=model, tokenizer=byte_tokenizer, config=config, device="cpu")
    _, chosen, rejected = synthetic_pairs(48, seed=0)
    _, val_chosen, val_rejected = synthetic_pairs(16, seed=1)
    metrics = trainer.train_on_preferences(chosen, rejected, num_epochs=2, batch_size=16,
                                           eval_chosen_texts=val_chosen, eval_rejected_texts=val_rejected)  # fmt: skip
    assert {"train/loss", "train/rewards/accuracies", "val/rewards/accuracies"} <= set(metrics)
    trainer.save_model(str(tmp_path / "reward_model.pt"))
    expected = model.predict_rewards(val_chosen, byte_tokenizer)
    fresh = RewardModelTrainer(RewardModel(config), byte_tokenizer, config)
    assert fresh.model.predict_rewards(val_chosen, byte_tokenizer) != pytest.approx(expected)
    fresh.load_model(str(tmp_path / "reward_model.pt"))
    assert fresh.model.predict_rewards(val_chosen, byte_tokenizer) == pytest.approx(expected, abs=1e-6)
    # under LoRA the trained adapters must not count twice after load_model
    lora_config = RewardModelConfig(
        model_config=TINY_LLAMA, use_lora=True, lora_rank=4, learning_rate=1e-2, warmup_steps=0
    )
    lora_trainer = RewardModelTrainer(RewardModel(lora_config), byte_tokenizer, lora_config, device="cpu")
    lora_trainer.train_on_preferences(chosen[:8], rejected[:8], num_epochs=2, batch_size=4)
    expected = lora_trainer.model.predict_rewards(val_chosen, byte_tokenizer)
    lora_trainer.save_model(str(tmp_path / "lora_rm"))
    lora_trainer.load_model(str(tmp_path / "lora_rm"))
    assert lora_trainer.model.predict_rewards(val_chosen, byte_tokenizer) == pytest.approx(expected, abs=1e-5)
    with pytest.raises(DataValidationError, match="as many chosen as rejected"):
        trainer.train_on_preferences(chosen, rejected[:-1])


# ------------------------------------------------------------------ the quickstart recipe
@pytest.mark.slow
def test_reward_quickstart_accuracy_rises_and_exports_a_loadable_folder(tmp_path, monkeypatch):
    import csv
    from pathlib import Path

    from aitraining_pl.cli import build_cli

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    data = root / "aitraining_pl" / "data" / "quickstart_reward.jsonl"
    build_cli(["fit", "--config", str(root / "configs/quickstart/reward.yaml"), "--data.init_args.data_path", str(data),
               "--trainer.max_steps", "24", "--trainer.limit_val_batches", "3",
               "--trainer.enable_progress_bar", "false"])  # fmt: skip
    (metrics_file,) = (tmp_path / "runs/quickstart-reward/csv").glob("version_*/metrics.csv")
    rows = csv.DictReader(metrics_file.open())
    accuracy = [float(r["val/rewards/accuracies"]) for r in rows if r.get("val/rewards/accuracies")]
    assert len(accuracy) >= 5 and accuracy[0] < 0.8 and min(accuracy[-3:]) >= 0.9
    model = load_reward_model(tmp_path / "runs/quickstart-reward/export/last")
    good, bad = model.predict_rewards(
        ["Explain gravity.Sure! Gravity is the force that pulls masses toward each other.", "Explain gravity.no."]
    )
    assert good > bad


@pytest.mark.slow
def test_multi_objective_quickstart_runs_briefly_and_checks_objective_counts(tmp_path, monkeypatch):
    from pathlib import Path

    from aitraining_pl.cli import build_cli

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", str(root / "configs/quickstart/reward_multi_objective.yaml"),
            "--data.init_args.data_path", str(root / "aitraining_pl/data/quickstart_scores.jsonl"),
            "--trainer.max_steps", "3", "--trainer.limit_val_batches", "1",
            "--trainer.enable_progress_bar", "false"]  # fmt: skip
    cli = build_cli(args)
    assert cli.trainer.global_step == 3 and "val/loss/polite" in cli.trainer.callback_metrics
    assert (
        type(load_reward_model(tmp_path / "runs/quickstart-reward-mo/export/last")).__name__
        == "MultiObjectiveRewardModel"
    )
    with pytest.raises(DataValidationError, match="row 1, field 'scores': expected 2 scores, got 3"):
        build_cli(args + ["--data.init_args.num_objectives", "2"])
    with pytest.raises(ValueError, match="data module has 3 objectives per row, the model 2"):
        build_cli(args + ["--model.init_args.num_objectives", "2", "--model.init_args.objective_weights", "null",
                          "--model.init_args.objective_names", "null"])  # fmt: skip


def test_val_objective_losses_are_weighted_by_known_entries():
    """Two val batches knowing objective 0 in 3 and 1 rows: ``val/loss/<name>`` is the mean squared error over
    the 4 known entries, not the row-weighted mean of the two batch means; an objective unknown in a batch
    adds nothing to its epoch value."""
    module = _module(MultiObjectiveRewardModule, num_objectives=2, objective_names=["a", "b"]).eval()
    torch.manual_seed(0)
    batches = []
    for known_a, known_b in (([1, 1, 1, 0], [1, 0, 0, 0]), ([0, 1, 0, 0], [1, 1, 1, 1])):
        ids = torch.randint(3, 200, (4, 6))
        mask = torch.ones_like(ids)
        targets = torch.randn(4, 2)
        batches.append({"input_ids": ids, "attention_mask": mask, "targets": targets,
                        "objective_mask": torch.tensor([known_a, known_b]).T.contiguous()})  # fmt: skip
    sq_errors = {0: [], 1: []}
    row_weighted = {0: 0.0, 1: 0.0}
    with torch.no_grad():
        for batch in batches:
            rewards = module.reward_model(batch["input_ids"], batch["attention_mask"], return_all_objectives=True)[
                "rewards"
            ]
            for j in (0, 1):
                known = batch["objective_mask"][:, j].bool()
                errors = ((rewards[:, j] - batch["targets"][:, j]) ** 2)[known].tolist()
                sq_errors[j] += errors
                row_weighted[j] += 4 * sum(errors) / len(errors) / 8
    expected = {j: sum(e) / len(e) for j, e in sq_errors.items()}  # 4 entries of "a", 5 of "b"
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    result = _trainer().validate(module, dataloaders=loader, verbose=False)[0]
    assert result["val/loss/a"] == pytest.approx(expected[0], rel=1e-5)
    assert result["val/loss/b"] == pytest.approx(expected[1], rel=1e-5)
    assert abs(expected[0] - row_weighted[0]) > 1e-3  # the batch-size weighting would give another value
