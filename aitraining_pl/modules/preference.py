"""``PreferenceModule``: what the offline preference modules (DPO, CPO, ORPO, KTO) share.

Each trains a policy on batches of the preference contract (``datamodules.preference``: 2B rows, the first B
and the last B paired by position) with one ``shared_step``: the reference log-probs (when the objective has a
reference), the policy's log-probs of all 2B rows in one forward, then the subclass's ``objective``. This
class holds the reference plumbing (placement, no-grad forward, one pass precomputing it) and the metrics of a
pair; a subclass declares its arguments, calls ``build_models(uses_reference)`` and implements ``objective``.
"""

from __future__ import annotations

import torch

from aitraining_pl.losses import DPOOutput, SequenceLogps
from aitraining_pl.models.micro_batches import budgeted_forward
from aitraining_pl.models.scoring import completion_logps
from aitraining_pl.models.training import eval_mode
from aitraining_pl.modules.base import SharedStepModule


def preference_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """(B,) 1 where the chosen reward is higher, 0 where lower, 0.5 on ties: an untrained policy (equal to
    its reference, all rewards 0) scores 0.5, as a coin flip would."""
    return (chosen > rejected).float() + 0.5 * (chosen == rejected).float()


def pair_metrics(out: DPOOutput, chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's per-pair metrics: implicit rewards, their accuracy and margin, and the policy log-probs."""
    return {
        "rewards/chosen": out.chosen_rewards,
        "rewards/rejected": out.rejected_rewards,
        "rewards/accuracies": preference_accuracy(out.chosen_rewards, out.rejected_rewards),
        "rewards/margins": out.chosen_rewards - out.rejected_rewards,
        "logps/chosen": chosen,
        "logps/rejected": rejected,
    }


class PreferenceModule(SharedStepModule):
    """Base of the offline preference modules; reads the ``padding_free`` and ``share_prompt`` hyperparameters
    (and ``precompute_ref_log_probs`` where a subclass has it)."""

    def build_models(self, uses_reference: bool) -> None:
        """The policy and, when ``uses_reference``, its reference (the policy with adapters off under LoRA)."""
        self.uses_reference = uses_reference
        self.policy, self.reference = self.load_policy_from_hparams(with_reference=uses_reference)
        self.apply_training_options(self.reference.model if self.reference is not None else None)
        self._ref_cache: dict[str, torch.Tensor] = {}  # split -> (N, 2) precomputed reference log-probs

    def objective(
        self, policy: SequenceLogps, reference: torch.Tensor | None, batch: dict[str, torch.Tensor], stage: str
    ) -> torch.Tensor:
        """The loss from the (2B,) policy log-probs (with lengths) and reference log-probs; logs its metrics."""
        raise NotImplementedError

    def budgeted_logps(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> SequenceLogps:
        """``completion_logps`` of the batch's 2B rows, in micro-batches of pairs within ``token_budget`` when set
        (``models.micro_batches.budgeted_forward``)."""
        hp = self.hparams
        score = lambda rows: completion_logps(model, rows, hp.padding_free, hp.share_prompt)  # noqa: E731
        return budgeted_forward(score, batch, self.hparam("token_budget"), paired=True)

    # ------------------------------------------------------------------ reference log-probs
    def _place_reference(self) -> None:
        if self.reference is not None:  # a no-op under LoRA and once the frozen copy was released
            self.reference.to(self.device, self.frozen_dtype())

    def on_fit_start(self) -> None:
        self._place_reference()
        if self.reference is not None and self.hparam("precompute_ref_log_probs", False):
            self.precompute_reference()

    def on_validation_start(self) -> None:
        self._place_reference()

    def on_test_start(self) -> None:
        self._place_reference()

    @torch.no_grad()
    def _reference_forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(2B,) reference log-probs: the frozen copy, or the policy with adapters disabled, in eval mode."""
        model = self.reference.model
        with eval_mode(model), self.reference.context():
            return self.budgeted_logps(model, batch).logps

    def precompute_reference(self) -> None:
        """One pass over every split of the data module; afterwards the frozen reference copy is released."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "ordered_dataloaders"):
            raise ValueError(
                "precompute_ref_log_probs needs a data module with ordered_dataloaders() (PreferenceDataModule)"
            )
        # fork the RNG: creating DataLoader iterators draws from it, and the training order must not change
        with torch.random.fork_rng(devices=[]), self.trainer.precision_plugin.forward_context():
            for split, loader in datamodule.ordered_dataloaders().items():
                chunks = []
                for batch in loader:
                    batch = {k: v.to(self.device) for k, v in batch.items()}
                    logps = self._reference_forward(batch)
                    chunks.append(torch.stack(logps.chunk(2), dim=1))
                self._ref_cache[split] = torch.cat(chunks)
        self.reference.drop()

    def reference_logps(self, batch: dict[str, torch.Tensor], split: str) -> torch.Tensor:
        """(2B,) reference log-probs of the batch's rows: looked up when precomputed, else one forward."""
        split = "val" if split == "test" else split  # the test loader is the validation split
        if split in self._ref_cache:
            pairs = self._ref_cache[split][batch["index"]]
            return torch.cat([pairs[:, 0], pairs[:, 1]])
        return self._reference_forward(batch)

    # ------------------------------------------------------------------ steps
    def shared_step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        # 1. reference log-probs (precomputed, or under no_grad), when the objective has a reference; first, so
        #    that its activations are freed before the policy's are built (a lower peak)
        reference = self.reference_logps(batch, stage) if self.uses_reference else None
        # 2. policy log-probs of all 2B rows in one forward (or in micro-batches within ``token_budget``)
        policy = self.budgeted_logps(self.policy, batch)
        # 3. the loss and its metrics
        return self.objective(policy, reference, batch, stage)
