"""Training on the vLLM generation backend: the GRPO quickstart on vLLM raises the held-out reward with the
engine's log-probs equal to the trainer's at every rollout (weights synced after each iteration's optimizer
steps), and a resumed run's engine samples from the resumed weights. Skipped where vLLM is not installed."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import lightning.pytorch as pl  # noqa: E402
import yaml  # noqa: E402
from conftest import quiet_trainer  # noqa: E402

from aitraining_pl.datamodules.prompt import PromptDataModule  # noqa: E402
from aitraining_pl.modules.critic_free import GRPOModule  # noqa: E402
from aitraining_pl.rollout import GenerationConfig  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = str(ROOT / "aitraining_pl/data/quickstart_prompts.jsonl")


def test_grpo_quickstart_on_vllm_learns_with_the_engine_in_sync(tmp_path):
    """configs/quickstart/grpo_vllm.yaml through ``aitraining-pl fit``: held-out reward rises as with the HF
    backend, and every iteration's |logp_vllm - logp_trainer| stays at float32 noise (the engine holds the
    weights of the policy that the update steps changed)."""
    from aitraining_pl.cli import main

    config = yaml.safe_load((ROOT / "configs/quickstart/grpo_vllm.yaml").read_text())
    config["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(tmp_path / "export")
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(config))
    main(
        ["fit", "--config", str(tmp_path / "grpo.yaml"), "--data.init_args.data_path", PROMPTS]
        + ["--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"]
    )
    (metrics,) = list(tmp_path.glob("csv/version_*/metrics.csv"))
    rows = list(csv.DictReader(metrics.open()))
    train = [r for r in rows if r.get("train/reward_mean")]
    val = [float(r["val/reward_mean"]) for r in rows if r.get("val/reward_mean")]
    assert len(train) == 16 and len(val) == 4
    gaps = [float(r["train/sampling/logp_gap/max"]) for r in train]
    assert max(gaps) < 1e-3, gaps
    weights = [float(r["train/sampling/is_weight/mean"]) for r in train]
    assert all(abs(w - 1) < 1e-3 for w in weights), weights
    assert val[-1] > val[0] + 0.2, val
    assert (tmp_path / "export").exists()


class GapRecorder(pl.Callback):
    """The largest sampler/trainer log-prob gap of each training batch."""

    def __init__(self):
        self.gaps: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.gaps.append(float(trainer.callback_metrics["train/sampling/logp_gap/max"]))


def grpo_module() -> GRPOModule:
    return GRPOModule(
        model_config={"preset": "tiny-llama", "num_attention_heads": 2, "num_key_value_heads": 1},
        tokenizer_name="byte",
        reward="aitraining_pl.rewards:char_fraction_reward",
        generation=GenerationConfig(max_new_tokens=8, temperature=1.0, backend="vllm"),
        num_generations=4,
        learning_rate=0.01,
        mini_batch_size=16,
        kl_coef=0.0,
    )


def test_a_resumed_run_samples_from_the_resumed_weights(tmp_path, byte_tokenizer):
    """Two iterations, a checkpoint, then a new module resumed from it: its engine (built at setup, before the
    checkpoint is loaded) gets the resumed weights before its first rollout; the weights it would otherwise hold
    (the fresh module's) sample with a clearly different distribution."""
    dm = PromptDataModule(data_path=PROMPTS, tokenizer=byte_tokenizer, batch_size=8, val_split=0.0)
    first = grpo_module()
    trainer = quiet_trainer(tmp_path, max_steps=4, limit_val_batches=0)
    trainer.fit(first, dm)
    checkpoint = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(checkpoint)
    resumed, recorder = grpo_module(), GapRecorder()
    fresh = {k: v.clone() for k, v in resumed.policy.state_dict().items()}
    trained = first.policy.state_dict()
    assert max((fresh[k] - trained[k]).abs().max().item() for k in fresh) > 1e-2  # the checkpoint's weights differ
    resumed_trainer = quiet_trainer(tmp_path, max_steps=8, max_epochs=2, limit_val_batches=0, callbacks=[recorder])
    resumed_trainer.fit(resumed, dm, ckpt_path=checkpoint)
    assert len(recorder.gaps) == 2 and max(recorder.gaps) < 1e-3, recorder.gaps
    assert resumed._backend[0] is None  # closed at teardown
    with torch.no_grad():
        assert any((resumed.policy.state_dict()[k] - fresh[k]).abs().max() > 0 for k in fresh)


@pytest.mark.parametrize("advantage", ["rloo", "reinforce_pp"])
def test_kl_regularised_bandit_reaches_the_closed_form_optimum_on_vllm(tmp_path, advantage):
    """As ``test_online.py``'s bandit test with ``backend: vllm``: RLOO and REINFORCE++ (k1 KL in the reward,
    whose optimum is ``pi_ref exp(r / beta) / Z`` for the reverse KL) end within total variation 0.05 of it,
    sampling from the colocated engine synced after every optimizer step."""
    from bandit import train_bandit

    policy, optimum = train_bandit(tmp_path, advantage, backend="vllm")
    assert 0.5 * (policy - optimum).abs().sum() < 0.05, (policy, optimum)
