"""One spelling per concept (issue 15, item 3): TRL / peft names, the old names accepted with a warning, choices
typed as Literal, the same optimiser arguments on every module, PPO's reward required."""

from __future__ import annotations

import inspect
import re
import warnings
from pathlib import Path
from typing import get_args

import pytest
import torch
from conftest import TINY_LLAMA

from aitraining_pl.callbacks.kl import AdaptiveKLCallback
from aitraining_pl.cli import MODULES, _import, build_cli, main
from aitraining_pl.errors import ConfigError, HyperparameterError
from aitraining_pl.modules.dpo import DPOModule
from aitraining_pl.modules.ppo import PPOModule
from aitraining_pl.validation import CONSTRAINTS, RENAMED, RenamedArgumentWarning

ROOT = Path(__file__).resolve().parents[1]
TOY_REWARD = "aitraining_pl.rewards:char_fraction_reward"


def test_literal_choices_equal_their_registries():
    from aitraining_pl.losses import DPO_LOSSES, POOLING_STRATEGIES
    from aitraining_pl.losses.advantages import ADVANTAGE_ESTIMATORS, CRITIC_ESTIMATORS, CriticFreeAdvantage
    from aitraining_pl.losses.policy_gradient import LOSS_AGGREGATIONS, LossAggregation
    from aitraining_pl.losses.preference import DPOLossType
    from aitraining_pl.losses.reward import PoolingStrategy
    from aitraining_pl.losses.rl import _KL_ESTIMATORS, KLEstimator
    from aitraining_pl.optim import SCHEDULES, LRSchedule

    assert set(get_args(DPOLossType)) == set(DPO_LOSSES)
    assert set(get_args(KLEstimator)) == set(_KL_ESTIMATORS)
    assert set(get_args(LRSchedule)) == set(SCHEDULES)
    assert set(get_args(PoolingStrategy)) == set(POOLING_STRATEGIES)
    assert set(get_args(CriticFreeAdvantage)) == set(ADVANTAGE_ESTIMATORS) - CRITIC_ESTIMATORS
    assert set(get_args(LossAggregation)) == set(LOSS_AGGREGATIONS)


SHARED = (
    "model_name",
    "model_config",
    "tokenizer_name",
    "lora",
    "learning_rate",
    "warmup_ratio",
    "lr_schedule",
    "weight_decay",
    "dtype",
    "seed",
    "trust_remote_code",
    "disable_dropout",
    "gradient_checkpointing",
)


@pytest.mark.parametrize("name, path", MODULES, ids=[n for n, _ in MODULES])
def test_every_module_has_the_shared_arguments(name, path):
    cls = _import(path)
    params = set()
    for klass in cls.__mro__:  # GRPO/RLOO forward **kwargs to CriticFreeModule
        if "__init__" in vars(klass):
            params |= set(inspect.signature(klass.__init__).parameters)
    missing = [arg for arg in SHARED if arg not in params]
    assert not missing, f"{name} lacks {missing}"
    if name not in ("reward", "pairwise", "multi-objective"):  # the reward trunk loader has no attention option
        assert "attn_implementation" in params


def test_new_and_renamed_arguments_have_range_rows():
    module_args = ["kl_penalty_coef", "init_kl_coef", "center_rewards_coef"]  # numeric old names
    for name in (
        "kl_coef",
        "kl_target",
        "kl_horizon",
        "lr_schedule",
        "weight_decay",
        "center_rewards_coefficient",
        *module_args,
    ):
        assert name in CONSTRAINTS, name
    assert set(RENAMED.values()) - {"precompute_ref_log_probs"} <= set(CONSTRAINTS)  # a flag has no range


def test_peft_lora_config_is_accepted():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["v_proj", "q_proj"])
    module = DPOModule(model_config=dict(TINY_LLAMA), tokenizer_name="byte", lora=config)
    assert isinstance(module.policy, peft.PeftModel)
    adapter = module.policy.peft_config["default"]
    assert (adapter.r, adapter.lora_alpha, set(adapter.target_modules)) == (4, 8, {"q_proj", "v_proj"})
    assert module.hparams.lora == {
        "r": 4,
        "alpha": 8,
        "dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "modules_to_save": None,
        "checkpoint_base": False,
    }
    assert module.hparams_initial["lora"]["r"] == 4  # logged (hparams.yaml, W&B, TensorBoard), not only stored
    with pytest.warns(UserWarning, match="use_rslora"):  # a peft field this project does not carry is named
        DPOModule(
            model_config=dict(TINY_LLAMA),
            tokenizer_name="byte",
            reference_free=True,
            lora=peft.LoraConfig(r=2, use_rslora=True),
        )


def test_attn_implementation_reaches_the_model():
    module = DPOModule(
        model_config=dict(TINY_LLAMA), tokenizer_name="byte", attn_implementation="eager", reference_free=True
    )
    assert module.policy.config._attn_implementation == "eager"
    assert module.hparams_initial["attn_implementation"] == "eager"


def _ppo(**kwargs):
    return PPOModule(model_config=dict(TINY_LLAMA), tokenizer_name="byte", **kwargs)


def test_ppo_reward_is_required():
    with pytest.raises(ConfigError, match=r"PPOModule.reward: required"):
        _ppo()


def test_ppo_kl_coef_and_its_old_name():
    assert _ppo(reward=TOY_REWARD, kl_coef=0.2).kl_coef == 0.2
    with pytest.warns(RenamedArgumentWarning, match="'kl_penalty_coef' is renamed 'kl_coef'"):
        module = _ppo(reward=TOY_REWARD, kl_penalty_coef=0.3)
    assert module.kl_coef == 0.3 and module.hparams.kl_coef == 0.3 and "kl_penalty_coef" not in module.hparams
    with pytest.raises(ConfigError, match="given twice"):
        _ppo(reward=TOY_REWARD, kl_coef=0.2, kl_penalty_coef=0.3)


def test_ppo_num_iterations_and_epsilon_and_their_old_names():
    module = _ppo(reward=TOY_REWARD, num_iterations=2, epsilon=0.1, epsilon_high=0.3)
    assert (module.num_iterations, module.hparams.epsilon, module.hparams.epsilon_high) == (2, 0.1, 0.3)
    with pytest.warns(RenamedArgumentWarning) as record:
        old = _ppo(reward=TOY_REWARD, ppo_epochs=3, clip_ratio=0.3)
    assert {str(w.message).split("'")[1] for w in record} == {"ppo_epochs", "clip_ratio"}
    assert old.num_iterations == 3 and old.hparams.num_iterations == 3 and old.hparams.epsilon == 0.3
    assert "ppo_epochs" not in old.hparams and "clip_ratio" not in old.hparams
    with pytest.raises(ConfigError, match="PPOModule.num_iterations: given twice"):
        _ppo(reward=TOY_REWARD, num_iterations=2, ppo_epochs=3)


def test_ppo_logs_generation_and_optimiser_arguments():
    module = _ppo(reward=TOY_REWARD, generation={"max_new_tokens": 5}, lr_schedule="cosine", weight_decay=0.1)
    assert module.hparams_initial["generation"]["max_new_tokens"] == 5
    optimizer = module.configure_optimizers  # the schedule and decay reach the optimizer
    assert module.hparams.lr_schedule == "cosine" and module.hparams.weight_decay == 0.1 and callable(optimizer)


def test_dpo_precompute_ref_log_probs_and_its_old_name():
    with pytest.warns(RenamedArgumentWarning, match="'precompute_ref_logps' is renamed 'precompute_ref_log_probs'"):
        module = DPOModule(model_config=dict(TINY_LLAMA), tokenizer_name="byte", precompute_ref_logps=True)
    assert module.hparams.precompute_ref_log_probs is True and "precompute_ref_logps" not in module.hparams


def test_reward_center_rewards_coefficient_and_its_old_name(monkeypatch):
    from aitraining_pl.modules.reward import RewardModule

    with pytest.warns(RenamedArgumentWarning, match="'center_rewards_coef' is renamed 'center_rewards_coefficient'"):
        module = RewardModule(model_config=dict(TINY_LLAMA), tokenizer_name="byte", center_rewards_coef=0.25)
    assert module.hparams.center_rewards_coefficient == 0.25 and "center_rewards_coef" not in module.hparams


def test_kl_callback_names_and_old_names():
    callback = AdaptiveKLCallback(kl_target=2.0, kl_horizon=50, kl_coef=0.1)
    assert (callback.kl_target, callback.kl_horizon, callback.kl_coef) == (2.0, 50.0, 0.1)
    with pytest.warns(RenamedArgumentWarning) as record:
        old = AdaptiveKLCallback(target=2.0, horizon=50, init_kl_coef=0.1)
    assert (old.kl_target, old.kl_horizon, old.kl_coef) == (2.0, 50.0, 0.1) and len(record) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AdaptiveKLCallback(kl_target=2.0)  # the new names warn about nothing
    with pytest.raises(HyperparameterError, match="AdaptiveKLCallback.kl_target: must be > 0"):
        AdaptiveKLCallback(kl_target=0.0)


def test_old_yaml_keys_still_run_with_a_warning(tmp_path):
    """A recipe written with the old spellings (module and callback) parses, builds and warns; the value is used."""
    text = (ROOT / "configs/quickstart/ppo.yaml").read_text()
    text = text.replace("    kl_coef: 0.01", "    kl_penalty_coef: 0.02").replace("kl_target:", "target:")
    text = text.replace("    num_iterations: 4", "    ppo_epochs: 2")
    assert "kl_penalty_coef: 0.02" in text and "        target:" in text and "ppo_epochs: 2" in text
    config = tmp_path / "old.yaml"
    config.write_text(text)
    with pytest.warns(RenamedArgumentWarning) as record:
        cli = build_cli(
            [
                "--config",
                str(config),
                "--data.init_args.data_path",
                str(ROOT / "aitraining_pl/data/quickstart_prompts.jsonl"),
            ],
            run=False,
        )
    renamed = [str(w.message).split("'")[1] for w in record if w.category is RenamedArgumentWarning]
    assert set(renamed) >= {"kl_penalty_coef", "target", "ppo_epochs"}
    assert cli.model.kl_coef == 0.02 and cli.model.hparams.kl_coef == 0.02 and cli.model.num_iterations == 2
    kl = [c for c in cli.trainer.callbacks if isinstance(c, AdaptiveKLCallback)]
    assert kl and kl[0].kl_target == 6.0


def test_new_names_are_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--model.help", "PPOModule"])
    out = capsys.readouterr().out
    assert "--model.kl_coef" in out and "--model.lr_schedule {linear,cosine,constant}" in out
    assert "--model.kl_estimator {k1,k2,k3}" in out and "--model.attn_implementation" in out
    with pytest.raises(SystemExit):
        main(["fit", "--trainer.callbacks.help", "AdaptiveKLCallback"])
    assert "--trainer.callbacks.kl_target" in capsys.readouterr().out


def test_reward_missing_from_a_recipe_is_one_message(capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(ROOT / "configs/quickstart/ppo.yaml"), "--model.init_args.reward", "null"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "aitraining-pl: config error: PPOModule.reward: required" in err, err
    torch.set_num_threads(torch.get_num_threads())  # (no thread setting leaked from the CLI)


# ---------------------------------------------------------------- the naming table (docs/naming.md)


def naming_table(section: str) -> tuple[set[str], set[str]]:
    """The names (second column) and old names (last column) of a table in ``docs/naming.md``."""
    text = (ROOT / "docs/naming.md").read_text().split(f"## {section}")[1].split("\n## ")[0]
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    names = {n for row in rows for n in re.findall(r"`([^`]+)`", row[1])}
    return names, {n for row in rows for n in re.findall(r"`([^`]+)`", row[-1])}


def test_naming_table_covers_the_renamed_arguments():
    names, old = naming_table("Arguments and attributes")
    assert set(RENAMED) <= old and set(RENAMED.values()) <= names
    assert not names & old


QUICKSTARTS = {
    "ppo": ("ppo.yaml", []),
    "grpo": ("grpo.yaml", []),
    "rloo": ("grpo.yaml", ["--model.class_path", "aitraining_pl.modules.critic_free.RLOOModule"]),
}


@pytest.mark.parametrize("recipe", list(QUICKSTARTS))
def test_quickstart_metric_names_follow_the_naming_table(recipe, tmp_path, monkeypatch):
    """One iteration and one held-out batch of the PPO, GRPO and RLOO quickstarts: every logged metric name is a
    name of the table's metric section, none is an old name."""
    names, old = naming_table("Logged metrics")
    config, extra = QUICKSTARTS[recipe]
    monkeypatch.chdir(tmp_path)  # the recipes write under runs/
    cli = build_cli(
        [
            "--config",
            str(ROOT / "configs/quickstart" / config),
            *extra,
            "--data.init_args.data_path",
            str(ROOT / "aitraining_pl/data/quickstart_prompts.jsonl"),
            "--trainer.max_epochs",
            "1",
            "--trainer.limit_train_batches",
            "1",
            "--trainer.limit_val_batches",
            "1",
            "--trainer.val_check_interval",
            "1",
        ],
        run=False,
    )
    assert type(cli.model).__name__.lower().startswith(recipe)
    cli.trainer.fit(cli.model, cli.datamodule)
    logged = {k.split("/", 1)[1] for k in cli.trainer.callback_metrics if k.startswith(("train/", "val/"))}
    assert {"loss", "clipfrac", "completion_length", "reward_mean", "kl_coef"} <= logged
    patterns = [re.compile(re.sub(r"<[a-z]+>", "[^/]+", re.escape(n))) for n in names]  # <component>: any name
    unknown = {k for k in logged if not any(p.fullmatch(k) for p in patterns)}
    assert not unknown, f"{recipe} logs names missing from docs/naming.md: {sorted(unknown)}"
    assert not logged & old, f"{recipe} logs old names: {sorted(logged & old)}"
