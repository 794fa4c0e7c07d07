"""``GreedyEvalCallback``: the greedy held-out reward before training starts and after it ends, printed and logged."""

from __future__ import annotations

import csv

import pytest
from conftest import TINY_LLAMA, quiet_trainer
from lightning.pytorch.loggers import CSVLogger
from online_fixtures import QUICKSTART_PROMPTS, TOY_REWARD

from aitraining_pl.callbacks.greedy_eval import GreedyEvalCallback, greedy_answers
from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.modules.critic_free import GRPOModule


def _module_and_data(val_split: float = 0.125):
    module = GRPOModule(
        model_config=TINY_LLAMA,
        tokenizer_name="byte",
        reward=TOY_REWARD,
        generation={"max_new_tokens": 6, "temperature": 1.0},
        num_generations=2,
        mini_batch_size=8,
        learning_rate=0.05,
        kl_coef=0.0,
    )
    data = PromptDataModule(data_path=QUICKSTART_PROMPTS, tokenizer=module.tokenizer, val_split=val_split, batch_size=4)
    return module, data


def test_the_greedy_reward_before_and_after_training_is_reported(tmp_path, caplog):
    caplog.set_level("INFO")
    module, data = _module_and_data()
    data.setup()
    answers_before, scores_before = greedy_answers(module, data.val_dataloader())
    callback = GreedyEvalCallback(num_samples=1)
    trainer = quiet_trainer(
        tmp_path, max_steps=2, limit_val_batches=0, callbacks=[callback], logger=CSVLogger(tmp_path, name="csv")
    )
    trainer.fit(module, datamodule=data)
    answers_after, scores_after = greedy_answers(module, data.val_dataloader())
    assert callback.answers == {"before": answers_before, "after": answers_after}
    assert callback.results["before"] == pytest.approx(sum(scores_before) / 10)
    assert callback.results["after"] == pytest.approx(sum(scores_after) / 10)
    assert len(answers_after) == len(data.val_dataset) == 10
    printed = caplog.text  # Lightning's rank-zero logger, which the command line prints
    assert f"held-out greedy reward before training: {callback.results['before']:.3f} (10 prompts)" in printed
    assert f"held-out greedy reward after training: {callback.results['after']:.3f} (10 prompts)" in printed
    (metrics,) = list(tmp_path.glob("csv/version_*/metrics.csv"))
    rows = list(csv.DictReader(metrics.open()))
    logged = [(r["step"], float(r["val/greedy_reward"])) for r in rows if r["val/greedy_reward"]]
    assert logged == [("0", pytest.approx(callback.results["before"])), ("2", pytest.approx(callback.results["after"]))]


def test_without_held_out_prompts_the_error_says_what_is_needed(tmp_path):
    module, data = _module_and_data(val_split=0.0)
    trainer = quiet_trainer(tmp_path, max_steps=1, limit_val_batches=0, callbacks=[GreedyEvalCallback()])
    with pytest.raises(ValueError, match="GreedyEvalCallback needs held-out prompts"):
        trainer.fit(module, datamodule=data)
