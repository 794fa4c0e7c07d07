"""``RewardModelTrainer``: the seed's reward-model training API as a thin facade over ``RewardModule`` and a
Lightning ``Trainer``.

    trainer = RewardModelTrainer(model, tokenizer, config)          # model: RewardModel(config)
    metrics = trainer.train_on_preferences(chosen_texts, rejected_texts, num_epochs=3, batch_size=8)
    trainer.save_model("reward_model")                              # a folder PPO can name as its reward model
    trainer.load_model("reward_model")
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch.utils.data import DataLoader

from aitraining_pl.compat.common import accelerator_options, fit
from aitraining_pl.datamodules.io import DataValidationError, check_text
from aitraining_pl.datamodules.preference import PreferenceCollator
from aitraining_pl.models.reward import RewardModel, RewardModelConfig, encode_for_reward

_SOURCE = "<chosen_texts/rejected_texts>"


class RewardModelTrainer:
    """Trains a ``RewardModel`` (or ``PairwiseRewardModel``) on preference pairs with the Bradley-Terry loss.

    Args:
        model: the reward model to train (trained in place).
        tokenizer: its tokenizer (saved with the model).
        config: the ``RewardModelConfig``: ``learning_rate``, ``warmup_steps`` and
            ``gradient_accumulation_steps`` are used here.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ... or ``None`` to pick automatically.
    """

    def __init__(self, model: RewardModel, tokenizer: Any, config: RewardModelConfig, device: str | None = None):
        self.model, self.tokenizer, self.config, self.device = model, tokenizer, config, device
        if model.tokenizer is None:
            model.tokenizer = tokenizer

    def _loader(self, chosen: Sequence[str], rejected: Sequence[str], batch_size: int, shuffle: bool) -> DataLoader:
        """Pairs in the preference batch contract (``PreferenceCollator``), each text laid out as at scoring time."""
        if len(chosen) != len(rejected) or not chosen:
            raise DataValidationError(
                _SOURCE, f"need as many chosen as rejected texts (> 0), got {len(chosen)} and {len(rejected)}"
            )
        examples = []
        for i, (good, bad) in enumerate(zip(chosen, rejected)):
            check_text(good, _SOURCE, i + 1, "chosen", allow_messages=False)
            check_text(bad, _SOURCE, i + 1, "rejected", allow_messages=False)
            examples.append({
                "prompt_ids": [], "index": i,
                "chosen_ids": encode_for_reward(self.tokenizer, good),
                "rejected_ids": encode_for_reward(self.tokenizer, bad),
            })  # fmt: skip
        pad = self.tokenizer.pad_token_id
        return DataLoader(
            examples, batch_size, shuffle=shuffle, collate_fn=PreferenceCollator(pad if pad is not None else 0)
        )

    def train_on_preferences(
        self,
        chosen_texts: Sequence[str],
        rejected_texts: Sequence[str],
        num_epochs: int = 1,
        batch_size: int = 8,
        eval_chosen_texts: Sequence[str] | None = None,
        eval_rejected_texts: Sequence[str] | None = None,
        **trainer_kwargs: Any,
    ) -> dict[str, float]:
        """Fit on (chosen, rejected) text pairs; returns the last logged metrics (``train/loss``,
        ``train/rewards/accuracies``, ``train/rewards/margins``, ``train/reward_mean``, and ``val/...`` when eval
        texts are given).

        Args:
            chosen_texts, rejected_texts: the preferred and dispreferred text of each pair.
            num_epochs: passes over the pairs.
            batch_size: pairs per batch.
            eval_chosen_texts, eval_rejected_texts: optional held-out pairs, evaluated after every epoch.
            **trainer_kwargs: extra ``lightning.Trainer`` arguments (``precision``, ``logger``, ...).
        """
        from aitraining_pl.modules.reward import PairwiseRewardModule, RewardModule

        train = self._loader(chosen_texts, rejected_texts, batch_size, shuffle=True)
        val = None
        if eval_chosen_texts is not None and eval_rejected_texts is not None:
            val = self._loader(eval_chosen_texts, eval_rejected_texts, batch_size, shuffle=False)
        accumulate = max(1, self.config.gradient_accumulation_steps)
        steps = max(1, math.ceil(len(train) / accumulate) * num_epochs)
        module_cls = PairwiseRewardModule if isinstance(self.model, PairwiseRewardModule.model_class) else RewardModule
        module = module_cls(
            reward_model=self.model, learning_rate=self.config.learning_rate,
            warmup_ratio=min(1.0, self.config.warmup_steps / steps),
        )  # fmt: skip
        module.set_tokenizer(self.tokenizer)
        options = {"max_epochs": num_epochs, "accumulate_grad_batches": accumulate, **accelerator_options(self.device)}
        trainer, _ = fit(module, train, val, options, [], trainer_kwargs)
        self.model.eval()
        return {name: float(value) for name, value in trainer.callback_metrics.items()}

    def save_model(self, path: str) -> None:
        """Save the model folder (config JSON, safetensors, tokenizer) at ``path`` (a directory, whatever its name)."""
        self.model.save_pretrained(path, tokenizer=self.tokenizer)

    def load_model(self, path: str) -> None:
        """Load weights saved by ``save_model`` into this trainer's model (same architecture), never unpickling."""
        loaded = type(self.model).from_pretrained(path)  # checks the folder and the saved class
        if loaded.config.pooling_strategy != self.model.config.pooling_strategy:
            raise ValueError(
                f"{path} was saved with pooling {loaded.config.pooling_strategy!r}, "
                f"this model uses {self.model.config.pooling_strategy!r}"
            )
        device = self.model.head.weight.device
        self.model.load_merged_state_dict({k: v.to(device) for k, v in loaded.merged_state_dict().items()})
