"""CompletionLogCallback: the rollouts a GRPO update trains on, with reward components and advantages, as JSONL and
a W&B table."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import quiet_trainer
from online_fixtures import EOS, fixed_rollout_module

from aitraining_pl.callbacks.completions import CompletionLogCallback
from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.errors import HyperparameterError
from aitraining_pl.rewards import WeightedRewards


def test_completions_are_logged_every_n_steps_with_components_and_advantages(tmp_path, monkeypatch, byte_tokenizer):
    fixed = torch.tensor([[40, 41, EOS, 0], [EOS, 0, 0, 0], [50, 51, 52, 53], [60, EOS, 0, 0]])
    module = fixed_rollout_module(monkeypatch, [0.0] * 4, fixed, num_generations=2, kl_coef=0.0, mini_batch_size=4)
    reward = WeightedRewards(
        {"a": lambda p, r, m: [1.0, 0.0, 0.5, None], "b": lambda p, r, m: [None, 1.0, 0.5, 0.5]}, {"a": 1.0, "b": 2.0}
    )
    module.source.reward = reward
    data = PromptDataModule(prompts=["hello", "a longer prompt"] * 2, tokenizer=byte_tokenizer, batch_size=2)
    callback = CompletionLogCallback(every_n_steps=2)
    quiet_trainer(tmp_path, max_epochs=2, callbacks=[callback]).fit(module, data)  # 4 iterations: 2 logged
    rows = [json.loads(line) for line in open(callback.path, encoding="utf-8")]
    assert len(rows) == 2 * 4 and len({r["step"] for r in rows}) == 2
    first = rows[:4]
    assert set(first[0]) == {"step", "prompt", "completion", "reward", "reward/a", "reward/b", "advantage"}
    assert [r["reward/a"] for r in first] == [1.0, 0.0, 0.5, None]
    assert [r["reward/b"] for r in first] == [None, 1.0, 0.5, 0.5]
    assert [r["reward"] for r in first] == [1.0, 2.0, 1.5, 1.0]  # None leaves the weighted sum
    # GRPO's advantages of the scores logged: (r - mean_g) / (std_g + 1e-4) within each pair
    a, b = 0.5 / (2**0.5 / 2 + 1e-4), 0.25 / (0.5 * 2**-0.5 + 1e-4)  # groups (1, 2) and (1.5, 1)
    assert [r["advantage"] for r in first] == pytest.approx([-a, a, b, -b], abs=1e-5)
    assert first[0]["prompt"] == first[1]["prompt"] != first[2]["prompt"]


def test_completions_go_to_a_wandb_table_and_the_jsonl(tmp_path):
    from lightning.pytorch.loggers import WandbLogger

    logger = WandbLogger(offline=True, save_dir=str(tmp_path))
    tables = []
    logger.log_table = lambda **kwargs: tables.append(kwargs)  # no wandb run is started
    rows = [{"step": 3, "prompt": "p", "completion": "c", "reward": 0.5, "advantage": 0.1}]
    progress = SimpleNamespace(total=SimpleNamespace(processed=1))
    trainer = SimpleNamespace(
        loggers=[logger],
        world_size=1,
        is_global_zero=True,
        log_dir=str(tmp_path),
        default_root_dir=str(tmp_path),
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
    )
    callback = CompletionLogCallback()
    callback.on_train_batch_end(trainer, SimpleNamespace(last_completions=rows))
    assert tables == [{"key": "completions", "columns": list(rows[0]), "data": [[3, "p", "c", 0.5, 0.1]]}]
    assert [json.loads(line) for line in open(callback.path, encoding="utf-8")] == rows
    with pytest.raises(HyperparameterError, match="every_n_steps"):
        CompletionLogCallback(every_n_steps=0)
