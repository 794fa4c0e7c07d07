"""The seed's trainer API (``PPOConfig`` / ``PPOTrainer``, ``DPOConfig`` / ``DPOTrainer``) as thin facades
over the Lightning pieces: each ``train`` call builds the LightningModule's data, a Lightning ``Trainer``
(``device`` -> accelerator, ``save_every`` -> checkpoints, ``eval_every`` -> validation) and returns the
logged metrics as a dict of lists. ``RewardModelTrainer`` lives in ``aitraining_pl.compat.reward_trainer``
and is re-exported here; what the facades share is in ``aitraining_pl.compat.common``.

    config = PPOConfig(model_name="path/or/hub-id", batch_size=16, ...)
    metrics = PPOTrainer(config, reward_fn=my_reward_fn).train(prompts, num_iterations=100)
    metrics["train/reward_mean"]  # one value per iteration
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

from aitraining_pl.compat.common import EveryNBatchesCheckpoint, MetricsHistory, accelerator_options, fit
from aitraining_pl.compat.reward_trainer import RewardModelTrainer

__all__ = ["PPOConfig", "PPOTrainer", "DPOConfig", "DPOTrainer", "RewardModelTrainer", "MetricsHistory"]


# ---------------------------------------------------------------------------------------------------- PPO


@dataclass
class PPOConfig:
    """The seed's ``PPOConfig``: same fields and defaults, plus a few needed to run offline."""

    model_name: str | None = None  #: policy folder or hub id
    learning_rate: float = 1e-5
    batch_size: int = 16  #: prompts per PPO iteration
    mini_batch_size: int = 4  #: rollouts per forward/backward in the update
    gradient_accumulation_steps: int = 1
    ppo_epochs: int = 4
    gamma: float = 0.99  #: GAE discount
    lam: float = 0.95  #: GAE lambda
    clip_ratio: float = 0.2
    value_clip: float = 0.2
    max_grad_norm: float = 1.0
    kl_penalty_coef: float = 0.01  #: initial KL coefficient (adapted towards ``kl_target``)
    kl_target: float = 0.01  #: target KL per response, in nats
    kl_horizon: int = 10000
    entropy_coef: float = 0.01
    value_coef: float = 0.5
    max_new_tokens: int = 128
    temperature: float = 0.7
    top_p: float = 0.9
    num_iterations: int = 100
    save_every: int = 10  #: iterations between checkpoints in ``output_dir`` (0: none)
    eval_every: int = 5  #: iterations between validations (when ``train`` gets ``eval_prompts``)
    device: str | None = None  #: "cpu", "cuda", "cuda:1", ... or None (auto)
    # beyond the seed
    model_config: dict | None = None  #: inline config of a randomly initialised policy (instead of model_name)
    tokenizer_name: str | None = None  #: default: model_name; "byte" for the byte-level tokenizer
    output_dir: str = "ppo_output"
    seed: int = 0


class PPOTrainer:
    """The seed's PPO trainer over ``PPOModule``, ``PromptDataModule`` and ``AdaptiveKLCallback``.

    Args:
        config: a ``PPOConfig``.
        tokenizer: the policy's tokenizer (default: loaded from ``tokenizer_name`` / ``model_name``).
        reward_fn: ``fn(prompts, responses, metadata) -> list[float]`` (any reward source, e.g. an RL
            environment); default: ``aitraining_pl.rewards:char_fraction_reward`` (a toy reward for examples).
    """

    def __init__(self, config: PPOConfig, tokenizer: Any = None, reward_fn: Callable | None = None):
        from aitraining_pl.callbacks.kl import AdaptiveKLCallback
        from aitraining_pl.modules.ppo import PPOModule
        from aitraining_pl.rollout import GenerationConfig

        self.config = c = config
        reward = {"reward": reward_fn if reward_fn is not None else "aitraining_pl.rewards:char_fraction_reward"}
        self.module = PPOModule(
            model_name=c.model_name, model_config=c.model_config, tokenizer_name=c.tokenizer_name,
            generation=GenerationConfig(max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_p=c.top_p),
            learning_rate=c.learning_rate, mini_batch_size=c.mini_batch_size,
            gradient_accumulation_steps=c.gradient_accumulation_steps, num_iterations=c.ppo_epochs, gamma=c.gamma,
            lam=c.lam, epsilon=c.clip_ratio, value_clip=c.value_clip, max_grad_norm=c.max_grad_norm,
            kl_coef=c.kl_penalty_coef, entropy_coef=c.entropy_coef, value_coef=c.value_coef, seed=c.seed,
            **reward,
        )  # fmt: skip
        if tokenizer is not None:
            self.module.set_tokenizer(tokenizer)
        # kept across train() calls: the KL coefficient and the checkpoint numbering continue
        self.kl_callback = AdaptiveKLCallback(kl_target=c.kl_target, kl_horizon=c.kl_horizon)
        self.checkpoints = EveryNBatchesCheckpoint(os.path.join(c.output_dir, "checkpoints"), c.save_every)
        self.trainer: pl.Trainer | None = None

    @property
    def tokenizer(self) -> Any:
        return self.module.tokenizer

    def _train_loader(self, prompts: Sequence[Any], metadata: Sequence[dict] | None, n_batches: int):
        """Exactly ``n_batches`` shuffled batches: the prompts (and metadata) are cycled to fill them."""
        from aitraining_pl.datamodules.prompt import PromptDataModule

        prompts = list(prompts)
        if not prompts:
            raise ValueError("train() needs at least one prompt")
        order = list(itertools.islice(itertools.cycle(range(len(prompts))), n_batches * self.config.batch_size))
        data = PromptDataModule(
            prompts=[prompts[i] for i in order],
            metadata=[metadata[i] for i in order] if metadata is not None else None,
            tokenizer=self.tokenizer, batch_size=self.config.batch_size, seed=self.config.seed,
        )  # fmt: skip
        data.setup("fit")
        return data.train_dataloader()

    def _eval_loader(self, prompts: Sequence[Any], metadata: Sequence[dict] | None):
        from torch.utils.data import DataLoader

        from aitraining_pl.datamodules.prompt import PromptCollator, PromptDataset

        dataset = PromptDataset(list(prompts), self.tokenizer, list(metadata) if metadata is not None else None)
        pad = self.tokenizer.pad_token_id
        return DataLoader(dataset, self.config.batch_size, collate_fn=PromptCollator(pad if pad is not None else 0))

    def train(
        self,
        prompts: Sequence[Any],
        num_iterations: int | None = None,
        metadata: Sequence[dict] | None = None,
        eval_prompts: Sequence[Any] | None = None,
        eval_metadata: Sequence[dict] | None = None,
        **trainer_kwargs: Any,
    ) -> dict[str, list[float]]:
        """Run ``num_iterations`` PPO iterations (default ``config.num_iterations``), each on a batch of
        ``batch_size`` prompts drawn in turn from ``prompts`` (repeated as needed, shuffled).

        Args:
            prompts: prompt texts (or chat message lists).
            num_iterations: PPO iterations to run.
            metadata: optional dict per prompt, given to the reward function.
            eval_prompts: optional held-out prompts, scored every ``eval_every`` iterations and at the end.
            eval_metadata: their metadata.
            **trainer_kwargs: extra ``lightning.Trainer`` arguments (``logger``, ``precision``, ...).

        Returns:
            ``{"train/reward_mean": [...], "train/kl": [...], ...}``: one value per iteration for each
            ``train/`` metric, one per validation for ``val/`` ones.
        """
        c = self.config
        n = int(num_iterations if num_iterations is not None else c.num_iterations)
        train_loader = self._train_loader(prompts, metadata, n)
        val_loader = self._eval_loader(eval_prompts, eval_metadata) if eval_prompts else None
        # PPOModule sizes its LR schedule from max_steps (optimizer steps) when no datamodule is attached
        options: dict[str, Any] = {
            "max_epochs": 1,
            "max_steps": n * self.module.updates_per_iteration(c.batch_size),
            **accelerator_options(c.device),
        }  # fmt: skip
        every = max(1, min(c.eval_every, n))
        if val_loader is not None:
            options.update(val_check_interval=every, check_val_every_n_epoch=None)
        else:
            options.update(limit_val_batches=0)
        callbacks = [self.kl_callback, self.checkpoints]
        self.trainer, history = fit(self.module, train_loader, val_loader, options, callbacks, trainer_kwargs, every)
        return history

    def save_model(self, path: str) -> None:
        """Write the policy (Hugging Face folder, safetensors) and tokenizer to ``path``."""
        self.module.save_pretrained(path)


# ---------------------------------------------------------------------------------------------------- DPO


@dataclass
class DPOConfig:
    """The seed's ``DPOConfig``: same fields and defaults, plus a few needed to run offline."""

    model_name: str | None = None  #: policy folder or hub id
    learning_rate: float = 1e-6
    batch_size: int = 8  #: preference pairs per batch
    gradient_accumulation_steps: int = 2
    beta: float = 0.1
    label_smoothing: float = 0.0
    reference_free: bool = False  #: no reference model (the reference is taken as uniform)
    num_epochs: int = 1
    max_grad_norm: float = 1.0
    warmup_ratio: float = 0.1
    max_length: int = 512  #: used when ``train`` gets raw pairs rather than a ``PreferenceDataset``
    max_prompt_length: int = 256
    eval_every: int = 100  #: optimizer steps between validations (when ``train`` gets ``eval_dataset``)
    save_every: int = 500  #: optimizer steps between checkpoints in ``output_dir`` (0: none)
    device: str | None = None  #: "cpu", "cuda", "cuda:1", ... or None (auto)
    # beyond the seed
    model_config: dict | None = None  #: inline config of a randomly initialised policy (instead of model_name)
    tokenizer_name: str | None = None  #: default: model_name; "byte" for the byte-level tokenizer
    loss_type: str = "sigmoid"  #: sigmoid (DPO), robust, hinge, ipo, simpo
    output_dir: str = "dpo_output"
    seed: int = 0


class DPOTrainer:
    """The seed's DPO trainer over ``DPOModule`` and the preference collator.

    Args:
        config: a ``DPOConfig``.
        tokenizer: the policy's tokenizer (default: loaded from ``tokenizer_name`` / ``model_name``).
    """

    def __init__(self, config: DPOConfig, tokenizer: Any = None):
        from aitraining_pl.modules.dpo import DPOModule

        self.config = c = config
        self.module = DPOModule(
            model_name=c.model_name, model_config=c.model_config, tokenizer_name=c.tokenizer_name, beta=c.beta,
            loss_type=c.loss_type, label_smoothing=c.label_smoothing, reference_free=c.reference_free,
            learning_rate=c.learning_rate, warmup_ratio=c.warmup_ratio, seed=c.seed,
        )  # fmt: skip
        if tokenizer is not None:
            self.module.set_tokenizer(tokenizer)
        self.trainer: pl.Trainer | None = None

    @property
    def tokenizer(self) -> Any:
        return self.module.tokenizer

    def _dataset(self, data: Any):
        """A ``PreferenceDataset`` as is, or one built from ``{"prompts", "chosen", "rejected"}`` lists (e.g.
        ``PreferenceComparisonEnv.preference_pairs()``)."""
        from aitraining_pl.datamodules.preference import PreferenceDataset

        if isinstance(data, Mapping):
            c = self.config
            return PreferenceDataset(
                data.get("prompts"), data["chosen"], data["rejected"], self.tokenizer,
                max_length=c.max_length, max_prompt_length=c.max_prompt_length,
            )  # fmt: skip
        return data

    def _loader(self, dataset: Any, shuffle: bool):
        import torch
        from torch.utils.data import DataLoader

        from aitraining_pl.datamodules.preference import PreferenceCollator

        pad = self.tokenizer.pad_token_id
        generator = torch.Generator().manual_seed(self.config.seed)
        return DataLoader(
            dataset,
            self.config.batch_size,
            shuffle=shuffle,
            generator=generator,
            collate_fn=PreferenceCollator(pad if pad is not None else 0),
        )

    def train(self, dataset: Any, eval_dataset: Any = None, **trainer_kwargs: Any) -> dict[str, list[float]]:
        """Train for ``num_epochs`` on ``dataset`` (a ``PreferenceDataset`` or a dict of ``prompts`` /
        ``chosen`` / ``rejected`` lists), validating on ``eval_dataset`` every ``eval_every`` optimizer steps
        (within each epoch) and at the end.

        Returns:
            ``{"train/loss": [...], "train/rewards/accuracies": [...], ..., "val/...": [...]}``: one value per
            training batch for ``train/`` metrics, one per validation for ``val/`` ones.
        """
        c = self.config
        train_loader = self._loader(self._dataset(dataset), shuffle=True)
        val_loader = self._loader(self._dataset(eval_dataset), shuffle=False) if eval_dataset is not None else None
        accumulate = max(1, c.gradient_accumulation_steps)
        options: dict[str, Any] = {
            "max_epochs": c.num_epochs, "accumulate_grad_batches": accumulate,
            "gradient_clip_val": c.max_grad_norm or None, **accelerator_options(c.device),
        }  # fmt: skip
        every = max(1, min(c.eval_every * accumulate, len(train_loader)))
        if val_loader is not None:
            options.update(val_check_interval=every, check_val_every_n_epoch=1)
        else:
            options.update(limit_val_batches=0)
        callbacks = []
        if c.save_every > 0:
            callbacks.append(pl.callbacks.ModelCheckpoint(
                dirpath=os.path.join(c.output_dir, "checkpoints"), every_n_train_steps=c.save_every, save_top_k=-1,
                filename="step-{step}",
            ))  # fmt: skip
            options["enable_checkpointing"] = True
        self.trainer, history = fit(self.module, train_loader, val_loader, options, callbacks, trainer_kwargs, every)
        return history

    def save_model(self, path: str) -> None:
        """Write the policy (Hugging Face folder, safetensors) and tokenizer to ``path``."""
        self.module.save_pretrained(path)
