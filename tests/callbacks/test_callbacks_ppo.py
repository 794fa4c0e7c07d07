"""AdaptiveKLCallback and SamplingCallback; resuming PPO keeps the KL coefficient and the step."""

from __future__ import annotations

import json
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from conftest import TINY_LLAMA

from aitraining_pl.callbacks.kl import AdaptiveKLCallback
from aitraining_pl.callbacks.sampling import SamplingCallback
from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.modules.ppo import PPOModule
from aitraining_pl.rollout import GenerationConfig


def _fake_module(kl):
    return SimpleNamespace(kl_coef=0.1, last_kl=kl, last_num_samples=100)


@pytest.mark.parametrize("kl, direction", [(5.0, 1), (0.5, -1), (1.0, 0)])
def test_kl_coefficient_moves_towards_the_target(kl, direction):
    callback = AdaptiveKLCallback(kl_target=1.0, kl_horizon=1000)
    module = _fake_module(kl)
    callback.on_train_start(None, module)
    callback.on_train_batch_end(None, module)
    change = module.kl_coef - 0.1
    assert (change > 0) - (change < 0) == direction
    # proportional control with the error clipped at +/-0.2 (Ziegler et al. 2019)
    error = max(-0.2, min(0.2, kl / 1.0 - 1))
    assert module.kl_coef == pytest.approx(0.1 * (1 + error * 100 / 1000))


def test_kl_coefficient_has_one_owner_the_module():
    """The callback moves the module's coefficient and keeps none of its own (issue 25): its checkpoint state is
    empty, an old checkpoint's callback state loads without effect, a starting ``kl_coef`` is applied in ``setup``
    (before a checkpoint is restored)."""
    callback = AdaptiveKLCallback(kl_target=1.0, kl_horizon=10)
    module = _fake_module(3.0)
    callback.on_train_batch_end(None, module)
    assert module.kl_coef != 0.1 and callback.state_dict() == {}
    callback.load_state_dict({"value": 0.7, "target": 1.0, "horizon": 10.0})  # written before issue 25
    module.kl_coef = 0.1
    callback.on_train_batch_end(None, module)  # continues from the module's coefficient
    assert module.kl_coef == pytest.approx(0.1 * (1 + 0.2 * 100 / 10))
    started = _fake_module(3.0)
    AdaptiveKLCallback(kl_target=1.0, kl_coef=0.3).setup(None, started, "fit")
    assert started.kl_coef == 0.3


def _module(**kwargs):
    defaults = dict(
        model_config=TINY_LLAMA,
        tokenizer_name="byte",
        reward="aitraining_pl.rewards:char_fraction_reward",
        generation=GenerationConfig(max_new_tokens=4, temperature=1.0, top_p=1.0),
        learning_rate=1e-3,
        mini_batch_size=2,
        num_iterations=1,
        kl_coef=0.05,
    )
    return PPOModule(**{**defaults, **kwargs})


def _data(byte_tokenizer):
    return PromptDataModule(prompts=["ab", "cd", "ef", "gh"], tokenizer=byte_tokenizer, batch_size=2)


class _Probe(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.start = (pl_module.kl_coef, trainer.global_step)


def test_resume_keeps_kl_coefficient_and_step(tmp_path, byte_tokenizer):
    common = dict(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    first = pl.Trainer(max_epochs=1, callbacks=[AdaptiveKLCallback(kl_target=1e-3, kl_horizon=10), ckpt], **common)
    module = _module()
    first.fit(module, _data(byte_tokenizer))
    saved_coef, saved_step = module.kl_coef, first.global_step
    assert saved_coef != pytest.approx(0.05) and saved_step == 2  # moved; 2 iterations x 1 update
    assert not any(
        k.startswith(("reference", "_reward"))
        for k in torch.load(ckpt.last_model_path, weights_only=True)["state_dict"]
    )

    probe = _Probe()
    second = pl.Trainer(max_epochs=2, callbacks=[AdaptiveKLCallback(kl_target=1e-3, kl_horizon=10), probe], **common)
    resumed = _module()
    second.fit(resumed, _data(byte_tokenizer), ckpt_path=ckpt.last_model_path)
    assert probe.start == (pytest.approx(saved_coef), saved_step)
    assert second.global_step == 4

    # without the callback the module alone restores its coefficient
    bare = _module()
    bare.on_load_checkpoint(torch.load(ckpt.last_model_path, weights_only=True))
    assert bare.kl_coef == pytest.approx(saved_coef)
    checkpoint = torch.load(ckpt.last_model_path, weights_only=True)
    assert checkpoint["kl_coef"] == pytest.approx(saved_coef) and "ppo_kl_coef" not in checkpoint
    old = _module()
    old.on_load_checkpoint({"ppo_kl_coef": 0.25})  # a checkpoint written before issue 25
    assert old.kl_coef == 0.25


def test_sampling_callback_writes_jsonl_rows(tmp_path, byte_tokenizer):
    sampler = SamplingCallback(every_n_iterations=1, num_prompts=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=pl.loggers.CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[sampler],
    )
    trainer.fit(_module(), _data(byte_tokenizer))
    rows = [json.loads(line) for line in open(sampler.path)]
    assert len(rows) == 4  # 2 prompts x 2 iterations
    assert rows[0]["prompt"] == "ab" and rows[-1]["iteration"] == 2
    assert {"prompt", "response", "reward", "step", "iteration"} <= set(rows[0])
    assert all(isinstance(r["reward"], float) for r in rows)


def test_sampling_callback_logs_a_wandb_table_when_wandb_is_the_logger(tmp_path):
    from lightning.pytorch.loggers import WandbLogger

    logger = WandbLogger(offline=True, save_dir=str(tmp_path))
    tables = []
    logger.log_table = lambda **kwargs: tables.append(kwargs)  # no wandb run is started
    rows = [{"iteration": 1, "step": 4, "prompt": "p", "response": "r", "reward": 0.5}]
    SamplingCallback().write(SimpleNamespace(loggers=[logger]), rows)
    assert tables == [
        {
            "key": "samples",
            "columns": ["iteration", "step", "prompt", "response", "reward"],
            "data": [[1, 4, "p", "r", 0.5]],
        }
    ]
