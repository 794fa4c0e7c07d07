"""Reward-model training as LightningModules.

- ``RewardModule``: Bradley-Terry on preference pairs (Ouyang et al. 2022) from ``PreferenceDataModule``
  batches, with an optional per-pair margin (Touvron et al. 2023) and reward centring (Eisenstein et al. 2023);
- ``PairwiseRewardModule``: the same objective on a ``PairwiseRewardModel`` (adds ``val/preference_prob``);
- ``MultiObjectiveRewardModule``: one head per objective regressed on score vectors (``ScoresDataModule``
  batches), missing objectives masked.

Each saves its reward model as a Hugging Face style folder (``save_pretrained``) that PPO can load.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import torch

from aitraining_pl.errors import ConfigError
from aitraining_pl.losses import bradley_terry_loss, masked_objective_mse
from aitraining_pl.losses.reward import PoolingStrategy, known_objectives
from aitraining_pl.models import LoRAConfig
from aitraining_pl.models.loading import load_backbone
from aitraining_pl.models.micro_batches import budgeted_forward
from aitraining_pl.models.quantization import (
    QuantizationConfig,
    as_quantization_config,
    check_quantization,
    is_quantized,
    load_quantized,
    merged_full_precision_state,
    quantization_hparam,
)
from aitraining_pl.models.reward import MultiObjectiveRewardModel, PairwiseRewardModel, RewardModel, RewardModelConfig
from aitraining_pl.modules.base import MODULE_RANGES, SharedStepModule
from aitraining_pl.optim import LRSchedule
from aitraining_pl.validation import POSITIVE, constructor_arguments, renamed, rules

#: ranges of the reward-model arguments of the reward modules; ``temperature`` divides the rewards here.
REWARD_MODEL_RANGES = {**MODULE_RANGES, **rules("pooling_strategy", "dropout_prob"), "temperature": POSITIVE}

#: RewardModelConfig fields that mirror a module argument of the same name.
_SHARED_FIELDS = (
    "model_name", "model_config", "tokenizer_name", "pooling_strategy", "dropout_prob", "temperature", "dtype",
    "seed", "trust_remote_code",
)  # fmt: skip


class RewardModule(SharedStepModule):
    """A scalar reward model trained with the Bradley-Terry loss on preference pairs.

    Args:
        model_name: folder or hub id of the trunk (``AutoModel``: a decoder such as Llama or an encoder such as BERT).
        model_config: inline transformers config for a randomly initialised trunk (instead of ``model_name``).
        tokenizer_name: tokenizer folder, hub id or ``"byte"`` (default: ``model_name``); shared with the data.
        lora: LoRA adapters on the trunk (``LoRAConfig``; the reward head is
            always trained in full).
        pooling_strategy: ``last`` (last real token), ``mean`` or ``cls`` (first real token).
        dropout_prob: dropout before the reward head.
        temperature: rewards are divided by this.
        center_rewards_coefficient: weight of ``mean((r_chosen + r_rejected)^2)``, which keeps rewards centred at 0.
        learning_rate: peak AdamW learning rate.
        warmup_ratio: fraction of the optimizer steps spent in linear warmup.
        lr_schedule: decay after warmup: ``linear``, ``cosine`` or ``constant``.
        weight_decay: AdamW weight decay.
        dtype: trunk dtype when loading (``bfloat16``, ``float32``, ...); the head stays float32.
        seed: seed of the random initialisation of the trunk (inline config) and the head.
        trust_remote_code: allow custom model code from the hub (off by default).
        reward_model: an already built reward model to train (Python use); the model arguments above are
            then read from its config.
        disable_dropout: set every dropout rate to 0 (trunk and head; overrides ``dropout_prob``), as TRL does:
            training forwards are then deterministic.
        token_budget: real tokens per forward pass (TRL's AsyncGRPO name; verl's ``ppo_max_token_len_per_gpu``): the
            batch's rows (pairs kept together) run in balanced micro-batches within it, each but the last recomputed
            in backward, with the whole batch's loss and gradients (docs/long_context.md); a longer row is an error.
            ``null``: the batch in one pass.
        gradient_checkpointing: recompute activations in backward instead of storing them (less memory, about a
            third more compute); works on the packed path.
        quantization: load the trunk's base weights in 4 bits (QLoRA through bitsandbytes, ``QuantizationConfig``:
            ``{load_in_4bit: true, quant_type: nf4, compute_dtype: bfloat16}``); needs ``lora``. The head stays
            in full precision; the export merges the adapters into the full-precision trunk.
        center_rewards_coef: deprecated spelling of ``center_rewards_coefficient`` (TRL's name; accepted with a
            warning until the next release).
    """

    model_class: type[RewardModel] = RewardModel

    argument_ranges = {**REWARD_MODEL_RANGES, **rules("center_rewards_coefficient", "center_rewards_coef")}

    def __init__(
        self,
        model_name: str | None = None,
        model_config: dict[str, Any] | None = None,
        tokenizer_name: str | None = None,
        lora: LoRAConfig | None = None,
        pooling_strategy: PoolingStrategy = "last",
        dropout_prob: float = 0.0,
        temperature: float = 1.0,
        center_rewards_coefficient: float = 0.0,
        learning_rate: float = 1e-5,
        warmup_ratio: float = 0.05,
        lr_schedule: LRSchedule = "linear",
        weight_decay: float = 0.0,
        dtype: str | None = None,
        seed: int = 0,
        trust_remote_code: bool = False,
        reward_model: RewardModel | None = None,
        disable_dropout: bool = True,
        gradient_checkpointing: bool = False,
        token_budget: int | None = None,
        quantization: QuantizationConfig | None = None,
        center_rewards_coef: float | None = None,
    ):
        super().__init__()
        center_rewards_coefficient = float(
            renamed(
                type(self).__name__,
                "center_rewards_coefficient",
                center_rewards_coefficient,
                0.0,
                center_rewards_coef=center_rewards_coef,
            )
        )
        if quantization_hparam(quantization) is not None and reward_model is not None:
            raise ConfigError("quantization", "applies to a reward model loaded here, not to a given reward_model")
        arguments = constructor_arguments(RewardModule.__init__, locals(), ignore=("reward_model",))
        arguments.update(self.subclass_arguments())
        if reward_model is not None:  # its settings, so that a checkpoint rebuilds the same model
            arguments.update(self.adopted_arguments(reward_model))
        self.save_arguments(arguments)
        check_quantization(quantization, lora)
        self.reward_model = reward_model if reward_model is not None else self.build_reward_model(self.reward_config())
        self.apply_training_options()

    def checkpointed_networks(self) -> list[torch.nn.Module]:
        return [self.reward_model.trunk]

    def sharded_networks(self) -> list[torch.nn.Module]:
        return [self.reward_model]

    # ------------------------------------------------------------------ the model
    def reward_config(self) -> RewardModelConfig:
        """The ``RewardModelConfig`` described by this module's hyperparameters."""
        return RewardModelConfig(**{name: self.hparams[name] for name in _SHARED_FIELDS}, lora=self.hparams.get("lora"))

    def subclass_arguments(self) -> dict[str, Any]:
        """The hyperparameters of a subclass's own constructor arguments (none here)."""
        return {}

    def adopted_arguments(self, model: RewardModel) -> dict[str, Any]:
        """The settings of a given reward model, stored as the hyperparameters they replace."""
        if not isinstance(model, self.model_class):
            raise TypeError(f"{type(self).__name__} trains a {self.model_class.__name__}, got {type(model).__name__}")
        return {**{name: getattr(model.config, name) for name in _SHARED_FIELDS}, "lora": model.config.lora}

    def build_reward_model(self, config: RewardModelConfig) -> RewardModel:
        return self.model_class(config, trunk=self.quantized_trunk(config))

    def quantized_trunk(self, config: RewardModelConfig) -> torch.nn.Module | None:
        """The trunk with 4-bit linear layers under ``quantization`` (``None`` otherwise: loaded as usual)."""
        quantized = as_quantization_config(self.hparams.get("quantization"))
        if quantized is None:
            return None
        source = functools.partial(load_backbone, **self._trunk_source(config))
        trust = config.trust_remote_code
        return load_quantized(source, config.model_name, quantized, "AutoModel", trust_remote_code=trust)

    @staticmethod
    def _trunk_source(config: RewardModelConfig) -> dict[str, Any]:
        names = ("model_name", "model_config", "dtype", "trust_remote_code", "seed")
        return {name: getattr(config, name) for name in names}

    def full_precision_copy(self) -> RewardModel:
        """The QLoRA reward model as a plain one: the adapters merged into the trunk reloaded in full precision
        (``models.quantization.merged_full_precision_state``, not into its 4-bit rounding), the head as trained."""
        model = self.reward_model
        full = load_backbone(**self._trunk_source(model.config))
        trunk = {f"trunk.{k}": v for k, v in merged_full_precision_state(model.trunk, full).items()}
        rest = {k: v.detach() for k, v in model.state_dict().items() if not k.startswith("trunk.")}
        plain = type(model)._from_config(dataclasses.replace(model.config, lora=None), full)
        plain.load_merged_state_dict({**trunk, **rest})
        return plain

    @property
    def tokenizer(self):
        """The reward model's tokenizer (its one owner: saved with the model, used by ``predict_rewards``), loaded
        from ``tokenizer_name`` / ``model_name`` on first use."""
        return self.reward_model.get_tokenizer()

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Give the reward model ``tokenizer`` (an object, e.g. from the seed's facades)."""
        self.reward_model.tokenizer = tokenizer

    def save_pretrained(self, path: str | os.PathLike, merge_lora: bool = True) -> None:
        """Write the reward model folder to ``path``: where the trunk allows, a standard
        ``AutoModelForSequenceClassification`` folder whose one logit is the reward, with ``reward_config.json``
        and ``reward_head.safetensors`` beside (``aitraining_pl.models.reward_export``), the tokenizer and a
        model card (``README.md``). LoRA adapters are always merged (under QLoRA into the full-precision trunk),
        so PPO, transformers and TRL load one plain model."""
        from aitraining_pl.callbacks.model_card import write_model_card

        quantized = is_quantized(self.reward_model.trunk)
        model = self.full_precision_copy() if quantized else self.reward_model
        model.save_pretrained(path, tokenizer=self.tokenizer)
        write_model_card(path, self)

    # ------------------------------------------------------------------ steps
    def shared_step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        # 1. one forward over chosen rows (first half) and rejected rows (second half)
        #    (in micro-batches of pairs within ``token_budget`` when set: ``models.micro_batches``)
        score = lambda rows: self.reward_model.score(rows["input_ids"], rows["attention_mask"])  # noqa: E731
        rewards = budgeted_forward(score, batch, self.hparam("token_budget"), paired=True)
        chosen, rejected = rewards.chunk(2)
        # 2. Bradley-Terry loss with the optional per-pair margin and the centring term
        loss = bradley_terry_loss(chosen, rejected, batch.get("margin"), self.hparams.center_rewards_coefficient)
        # 3. metrics
        metrics = {
            "loss": loss,
            "rewards/accuracies": (chosen > rejected).float(),
            "rewards/margins": chosen - rejected,
            "reward_mean": rewards,
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            **self.extra_metrics(chosen, rejected),
        }
        self.log_metrics(stage, metrics, batch_size=chosen.shape[0], prog_bar=("loss", "rewards/accuracies"))
        return loss

    def extra_metrics(self, chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}


class PairwiseRewardModule(RewardModule):
    """``RewardModule`` on a ``PairwiseRewardModel``; also logs ``preference_prob``, the mean P(chosen preferred)
    = s(r_chosen - r_rejected).

    Args: as ``RewardModule``.
    """

    model_class = PairwiseRewardModel

    def extra_metrics(self, chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"preference_prob": torch.sigmoid(chosen - rejected)}


class MultiObjectiveRewardModule(RewardModule):
    """One reward head per objective, regressed on score vectors with missing objectives masked
    (``masked_objective_mse``); trains on ``ScoresDataModule`` batches (``input_ids``, ``attention_mask``,
    ``targets`` (B, n), ``objective_mask`` (B, n)).

    Args:
        num_objectives: number of objectives n (the length of every score vector).
        objective_weights: n weights of the combined reward that PPO receives (default: equal, summing to 1).
        objective_names: n names used in metric names (``train/loss/<name>``; default ``0``, ``1``, ...).
        model_name, model_config, tokenizer_name, lora, pooling_strategy, dropout_prob, temperature,
        learning_rate, warmup_ratio, lr_schedule, weight_decay, dtype, seed, trust_remote_code, reward_model,
        disable_dropout, gradient_checkpointing, token_budget, quantization: as in ``RewardModule``.
    """

    model_class = MultiObjectiveRewardModel

    argument_ranges = {**REWARD_MODEL_RANGES, **rules("num_objectives")}

    def __init__(
        self,
        num_objectives: int = 1,
        objective_weights: list[float] | None = None,
        objective_names: list[str] | None = None,
        model_name: str | None = None,
        model_config: dict[str, Any] | None = None,
        tokenizer_name: str | None = None,
        lora: LoRAConfig | None = None,
        pooling_strategy: PoolingStrategy = "last",
        dropout_prob: float = 0.0,
        temperature: float = 1.0,
        learning_rate: float = 1e-5,
        warmup_ratio: float = 0.05,
        lr_schedule: LRSchedule = "linear",
        weight_decay: float = 0.0,
        dtype: str | None = None,
        seed: int = 0,
        trust_remote_code: bool = False,
        reward_model: MultiObjectiveRewardModel | None = None,
        disable_dropout: bool = True,
        gradient_checkpointing: bool = False,
        token_budget: int | None = None,
        quantization: QuantizationConfig | None = None,
    ):
        if objective_names is not None and len(objective_names) != num_objectives:
            raise ValueError(f"objective_names has {len(objective_names)} names for {num_objectives} objectives")
        self._objectives = (num_objectives, objective_weights, objective_names)  # read by ``subclass_arguments``
        super().__init__(
            model_name=model_name, model_config=model_config, tokenizer_name=tokenizer_name, lora=lora,
            pooling_strategy=pooling_strategy, dropout_prob=dropout_prob, temperature=temperature,
            learning_rate=learning_rate, warmup_ratio=warmup_ratio, lr_schedule=lr_schedule,
            weight_decay=weight_decay, dtype=dtype, seed=seed, trust_remote_code=trust_remote_code,
            reward_model=reward_model, disable_dropout=disable_dropout, gradient_checkpointing=gradient_checkpointing,
            token_budget=token_budget, quantization=quantization,
        )  # fmt: skip
        self.objective_names = list(objective_names or map(str, range(num_objectives)))

    def build_reward_model(self, config: RewardModelConfig) -> RewardModel:
        num_objectives, weights, _ = self._objectives
        return MultiObjectiveRewardModel(config, num_objectives, weights, trunk=self.quantized_trunk(config))

    def subclass_arguments(self) -> dict[str, Any]:
        return dict(zip(("num_objectives", "objective_weights", "objective_names"), self._objectives))

    def adopted_arguments(self, model: RewardModel) -> dict[str, Any]:
        arguments = super().adopted_arguments(model)
        if model.num_outputs != self._objectives[0]:
            raise ValueError(f"the given model has {model.num_outputs} objectives, not {self._objectives[0]}")
        return {**arguments, "objective_weights": list(model.config.extra["objective_weights"])}

    def setup(self, stage: str) -> None:
        """Refuse a data module whose score vectors have another length, before training starts."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        data_n = getattr(datamodule, "hparams", {}).get("num_objectives") if datamodule is not None else None
        if data_n is not None and data_n != self.hparams.num_objectives:
            raise ValueError(
                f"the data module has {data_n} objectives per row, the model {self.hparams.num_objectives}"
            )

    def shared_step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        # 1. every objective's reward and the combined reward
        forward = lambda rows: self.reward_model(rows["input_ids"], rows["attention_mask"], return_all_objectives=True)  # noqa: E731
        out = budgeted_forward(forward, batch, self.hparam("token_budget"))
        # 2. squared error per objective over the rows that have its score
        loss, per_objective = masked_objective_mse(out["rewards"], batch["targets"], batch["objective_mask"])
        # 3. metrics
        metrics = {"loss": loss, "reward_mean": out["combined_reward"]}
        if stage == "train":
            metrics.update({f"loss/{name}": value for name, value in zip(self.objective_names, per_objective)})
        self.log_metrics(stage, metrics, batch_size=batch["input_ids"].shape[0])
        if stage != "train":
            self.log_objective_losses(stage, per_objective, known_objectives(batch["targets"], batch["objective_mask"]))
        return loss

    def log_objective_losses(self, stage: str, per_objective: torch.Tensor, known: torch.Tensor) -> None:
        """Epoch-level ``<stage>/loss/<name>``: each batch's mean squared error of an objective weighted by the
        number of entries of that objective it knows (not by its rows), so the epoch value is the mean over all
        known entries of the epoch (across ranks too); a batch that knows none of an objective adds nothing."""
        for name, value, count in zip(self.objective_names, per_objective, known.sum(0).tolist()):
            if count > 0:
                self.log_metrics(stage, {f"loss/{name}": value}, batch_size=int(count))
