"""Asynchronous online RL end to end (issue 31): the online modules with ``generation.max_staleness`` >= 1 sample on
an HF generation server (``generation.servers.hf_server`` behind ``GenerationServer``, in a thread of this process, or
started by the trainer with ``server: launch``) while they train. Learning on the KL-regularised bandit, the
staleness the modules log, the quickstart, faults and shutdown."""

from __future__ import annotations

import csv
import re
import threading
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from async_fixtures import TOY_REWARD, grpo, hf_server_port, served
from conftest import TINY_LLAMA, quiet_trainer

from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.errors import ConfigError, GenerationServerError
from aitraining_pl.generation.config import VLLMConfig
from aitraining_pl.modules.critic_free import GRPOModule
from aitraining_pl.rollout import GenerationConfig

ROOT = Path(__file__).resolve().parents[2]


class Staleness(pl.Callback):
    """The ``async/staleness`` each trained step logged (Lightning's callback metrics)."""

    def __init__(self):
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        value = trainer.callback_metrics.get("train/async/staleness")
        if value is not None and pl_module.pipeline is not None and pl_module.pipeline.version > len(self.values):
            self.values.append(float(value))


@pytest.mark.slow
@pytest.mark.parametrize("advantage, staleness", [("rloo", 1), ("reinforce_pp", 1), ("rloo", 2), ("reinforce_pp", 2)])
def test_kl_regularised_bandit_reaches_the_optimum_with_stale_samples(tmp_path, advantage, staleness):
    """RLOO and REINFORCE++ trained on rollouts one or two versions old (the correction on: ``auto`` is
    ``sequence_mask`` with stale samples) still reach ``pi* = pi_ref exp(r / beta) / Z`` within total variation 0.1
    (``tests/helpers/bandit.py``; 0.36 away at the start)."""
    from bandit import POLICY, train_bandit

    with hf_server_port(POLICY) as port:
        policy, optimum = train_bandit(tmp_path, advantage, "hf", **served(port, max_staleness=staleness))
    tv = 0.5 * float((policy - optimum).abs().sum())
    print(f"{advantage} max_staleness {staleness}: total variation {tv:.4f}")
    assert tv < 0.1, (policy, optimum)


def test_grpo_trains_with_stale_rollouts_and_logs_the_staleness(tmp_path):
    """Every trained step logs its staleness (1 after the warm-up step, whose batch trains at the second step: 0
    there, as its weights are still the first ones); the policy changes and the reference does not; the sampler's
    log-probs are those of the HF server, so the off-policy stats are logged."""
    staleness = Staleness()
    with hf_server_port(TINY_LLAMA) as port:
        module, data = grpo(served(port, max_staleness=1))
        before = {k: v.clone() for k, v in module.policy.state_dict().items()}
        reference = {k: v.clone() for k, v in module.reference.model.state_dict().items()}
        quiet_trainer(tmp_path, max_steps=3, callbacks=[staleness]).fit(module, data)
    assert module.pipeline is None  # torn down
    assert staleness.values == [0.0, 1.0, 1.0]
    after = module.policy.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(reference[k], v) for k, v in module.reference.model.state_dict().items())
    assert "aitraining-pl-rollouts" not in [t.name for t in threading.enumerate()]


def test_ppo_and_multi_turn_grpo_train_asynchronously(tmp_path):
    """PPO (a value head trained beside the policy) and GRPO on the multi-turn guessing game (each turn a request
    to the server, the environment in this process) train on stale rollouts: policy and value head change, the
    reference does not, every trained step logged its staleness and the episodes their turns."""
    from aitraining_pl.environments.multiturn import GuessingGame
    from aitraining_pl.modules.ppo import PPOModule

    path = tmp_path / "game.jsonl"
    path.write_text("".join(f'{{"prompt": "Guess 1-7 (#{i}):", "secret": {1 + i % 7}}}\n' for i in range(8)))
    with hf_server_port(TINY_LLAMA) as port:
        ppo = PPOModule(
            reward=TOY_REWARD, model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-3, mini_batch_size=2,
            num_iterations=1, kl_coef=0.05,
            generation=GenerationConfig(max_new_tokens=4, temperature=1.0, top_p=1.0, **served(port, max_staleness=1)),
        )  # fmt: skip
        game = GRPOModule(
            reward=GuessingGame(max_turns=3), model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-3,
            num_generations=2, mini_batch_size=4, kl_coef=0.05,
            generation=GenerationConfig(max_new_tokens=2, temperature=1.0, top_p=1.0, **served(port, max_staleness=2)),
        )  # fmt: skip
        runs = [
            (ppo, PromptDataModule(prompts=["ab", "cd", "ef", "gh"] * 2, tokenizer=ppo.tokenizer, batch_size=2)),
            (game, PromptDataModule(data_path=str(path), batch_size=2)),
        ]
        for module, data in runs:
            before = {k: v.clone() for k, v in module.state_dict().items() if "reference" not in k}
            reference = {k: v.clone() for k, v in module.reference.model.state_dict().items()}
            staleness = Staleness()
            quiet_trainer(tmp_path, max_steps=3, callbacks=[staleness]).fit(module, data)
            after = module.state_dict()
            changed = {k for k in before if not torch.equal(before[k], after[k])}
            assert any("value_head" not in k for k in changed), changed
            assert module is game or any("value_head" in k for k in changed), changed
            assert all(torch.equal(reference[k], v) for k, v in module.reference.model.state_dict().items())
            assert len(staleness.values) >= 2 and max(staleness.values) <= module.generation.max_staleness
    assert module.last_episodes is not None and max(module.last_episodes.metrics["turns"]) >= 1


def test_free_schedule_trains_with_per_token_versions(tmp_path):
    """``async_schedule: free``: pushes land while rollouts generate (in flight on the HF server), each token carries
    the version that sampled it, and the per-token staleness stays within ``max_staleness``."""
    seen = []

    class Versions(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            value = trainer.callback_metrics.get("train/async/staleness/max")
            if value is not None:
                seen.append(float(value))

    with hf_server_port(TINY_LLAMA) as port:
        module, data = grpo(served(port, max_staleness=1, async_schedule="free", max_new_tokens=12))
        before = {k: v.clone() for k, v in module.policy.state_dict().items()}
        rollouts = []
        experience = module.make_experience  # the rollouts trained on, sampled on the pipeline's worker
        module.make_experience = lambda rollout: rollouts.append(rollout) or experience(rollout)
        quiet_trainer(tmp_path, max_steps=4, callbacks=[Versions()]).fit(module, data)
    assert seen and max(seen) <= 1.0
    assert any(not torch.equal(before[k], v) for k, v in module.policy.state_dict().items())
    for rollout in rollouts:
        versions = rollout.token_versions[rollout.mask.bool()]
        assert versions.numel() and int(versions.min()) >= 0  # every sampled token says which weights drew it
        assert (rollout.token_versions[~rollout.mask.bool()] == -1).all()


def test_async_needs_a_server(tmp_path):
    module, data = grpo({"max_staleness": 1})
    with pytest.raises(ConfigError, match="generation.server: launch"):
        quiet_trainer(tmp_path, max_steps=1).fit(module, data)


@pytest.mark.slow
def test_a_server_killed_mid_run_stops_the_run_with_one_line(tmp_path):
    """The trainer's own server (``server: launch``) is killed (SIGKILL) after the first update: the next wait raises
    the client's one-line error, and when ``fit`` has raised, no worker thread, connection or process is left."""

    class KillServer(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if pl_module.pipeline.version == 1:
                pl_module._launched[0].servers[0].process.kill()

    module, data = grpo({"server": "launch", "max_staleness": 1, "vllm": VLLMConfig(server_timeout=30)})
    with pytest.raises(GenerationServerError) as caught:
        quiet_trainer(tmp_path, max_steps=6, callbacks=[KillServer()]).fit(module, data)
    print(caught.value)
    assert "\n" not in str(caught.value) and re.search(
        r"generation server http://127\.0\.0\.1:\d+: cannot reach the server while ", str(caught.value)
    )
    assert module.pipeline is None and module._launched[0] is None  # torn down on the failure
    assert "aitraining-pl-rollouts" not in [t.name for t in threading.enumerate()]


@pytest.mark.slow
def test_async_quickstart_launches_its_server_and_learns(tmp_path):
    """configs/quickstart/grpo_async.yaml through ``aitraining-pl fit``: the trainer starts the HF server, trains on
    rollouts one version old, raises the held-out reward, and stops the server (no process left)."""
    import psutil
    import yaml

    from aitraining_pl.cli import main

    config = yaml.safe_load((ROOT / "configs/quickstart/grpo_async.yaml").read_text())
    config["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(tmp_path / "export")
    (tmp_path / "grpo_async.yaml").write_text(yaml.safe_dump(config))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    main(
        ["fit", "--config", str(tmp_path / "grpo_async.yaml"),
         "--data.init_args.data_path", str(ROOT / "aitraining_pl/data/quickstart_prompts.jsonl"),
         "--trainer.logger.init_args.save_dir", str(tmp_path),
         "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    )  # fmt: skip
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before  # the server stopped
    (metrics,) = list(tmp_path.glob("csv/version_*/metrics.csv"))
    rows = list(csv.DictReader(metrics.open()))
    val = [float(r["val/reward_mean"]) for r in rows if r.get("val/reward_mean")]
    staleness = [float(r["train/async/staleness"]) for r in rows if r.get("train/async/staleness")]
    print(f"val/reward_mean: {val}; staleness: {staleness}")
    assert val[-1] > val[0] + 0.2, val
    assert max(staleness) == 1.0 and min(staleness) >= 0.0
