"""Token-budget micro-batches in the online RL modules' update (``OnlineRLModule``, manual optimisation): each
minibatch of ``mini_batch_size`` rows is split into micro-batches of at most ``token_budget`` real tokens, balanced
(``losses.micro_batches``), one forward and backward each. Each micro-batch's loss, with its own normaliser, is
weighted by its ``loss_share`` (its normaliser over the minibatch's), so the minibatch's loss and gradient are the
same as in one pass for every ``loss_aggregation``, with no second forward; the peak holds one micro-batch's
activations. The no-grad passes (old, reference, teacher) run in consecutive runs within the budget.

The same holds for an optimizer step over accumulated minibatches and data-parallel ranks (``step_share``): each
minibatch's loss is weighted by its normaliser over the mean of the step's, so the ranks' average of the
accumulated gradients (DDP's and FSDP's reduction) is the gradient of the loss of all the step's rows with one
normaliser (for ``token``, a token mean over the whole accumulated batch of every rank, as TRL's ``dapo`` loss,
verl's global token mean and transformers' ``num_items_in_batch`` fix of gradient accumulation), not a mean of
per-minibatch or per-rank means."""

from __future__ import annotations

from typing import Any

import torch

from aitraining_pl.errors import ConfigError
from aitraining_pl.losses.micro_batches import contiguous_budget_split, loss_share, normaliser, token_budget_partition
from aitraining_pl.models.routing_replay import RouterLoad
from aitraining_pl.models.sequence_parallel import group_size


def check_token_budget(owner: str, token_budget: int | None, top_entropy_quantile: float) -> None:
    """Refuse what a token budget cannot split exactly: ``policy_loss.top_entropy_quantile`` below 1 ranks the
    entropies of the whole minibatch, which no micro-batch sees."""
    if token_budget and top_entropy_quantile < 1:
        raise ConfigError(
            f"{owner}.policy_loss.top_entropy_quantile",
            "ranks the entropies of the whole minibatch: not with token_budget (set one of them only)",
        )


def check_row_budget(module: Any, trainer: Any, generation: Any, open_ended: bool) -> None:
    """Before training: with a ``token_budget`` and no sequence parallelism, a row (a prompt of the training data and
    ``generation.max_new_tokens``) that can be longer than the budget fits no micro-batch; refused here, naming the
    option and the longest prompt, rather than at the step that samples it (``TokenBudgetError``, kept as the
    backstop). Not checked for ``open_ended`` rows (episodes, agents' sequences: their length is the environment's)."""
    budget = module.hparam("token_budget")
    dataset = getattr(getattr(trainer, "datamodule", None), "train_dataset", None)
    prompts = getattr(dataset, "input_ids", None)
    if not budget or open_ended or group_size() > 1 or not prompts:
        return
    index = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    longest, new = len(prompts[index]), int(generation.max_new_tokens)
    if longest + new > budget:
        raise ConfigError(
            f"{type(module).__name__}.token_budget",
            f"{budget} tokens: prompt {index} of the training data has {longest} tokens, and with "
            f"generation.max_new_tokens {new} its rows can have {longest + new}, which no micro-batch holds; raise "
            "token_budget, lower max_new_tokens or the data module's max_prompt_length, or split rows with sequence "
            "parallelism (docs/long_context.md)",
        )


class TokenBudgetSteps:
    """Mixin of ``OnlineRLModule``: reads ``token_budget`` and ``mini_batch_size`` from ``hparams``; calls the
    module's ``minibatch_loss`` and ``manual_backward``."""

    #: while a minibatch split into micro-batches runs, the counts of its MoE router load (``minibatch_backward``)
    router_load: RouterLoad | None = None

    def row_chunks(self, n: int, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Consecutive runs of the ``n`` rows for a no-grad pass: ``mini_batch_size`` rows at a time, or with a
        ``token_budget`` (and the rows' ``attention_mask``) runs of at most that many real tokens."""
        budget = self.hparam("token_budget")
        if budget and attention_mask is not None:
            lengths = attention_mask.sum(1).tolist()
            runs = contiguous_budget_split(lengths, budget, row_limit=budget * group_size())
            return [torch.arange(r.start, r.stop, device=self.device) for r in runs]
        return list(torch.arange(n, device=self.device).split(self.hparams.mini_batch_size))

    def share_aggregation(self) -> str:
        """The aggregation of ``minibatch_loss`` that ``losses.micro_batches.loss_share`` weighs micro-batches by
        (PPO: ``token``; the critic-free family: its ``loss_aggregation``)."""
        return "token"

    def micro_batches(self, experience: Any, rows: torch.Tensor) -> list[tuple[torch.Tensor, float]]:
        """The micro-batches of minibatch ``rows`` with the share of the minibatch's loss each carries: ``[(rows,
        1.0)]``, or with a ``token_budget`` the rows balanced into the fewest micro-batches within it
        (``token_budget_partition``), as many on every rank as the most any rank needs (FSDP2 gathers the weights in
        every forward; a rank with fewer rows than that makes one pass per row), each weighted by ``loss_share`` of
        ``share_aggregation`` so that the normalisers stay the minibatch's."""
        budget = self.hparam("token_budget")
        if not budget:
            return [(rows, 1.0)]
        lengths = experience.attention_mask[rows].sum(1).tolist()
        limit = budget * group_size()  # a longer row than the budget: alone, split by the sequence-parallel group
        count = len(token_budget_partition(lengths, budget, row_limit=limit))
        if self._trainer is not None and self.trainer.world_size > 1:
            count = int(self.trainer.strategy.reduce(torch.tensor(float(count), device=self.device), reduce_op="max"))
        groups = token_budget_partition(lengths, budget, min_parts=min(count, len(lengths)), row_limit=limit)
        mask, aggregation = experience.mask, self.share_aggregation()
        return [(rows[g], loss_share(aggregation, mask[rows[g]], mask[rows])) for g in groups]

    #: the normaliser of the current optimizer step's rows over every rank (``normaliser_over_ranks``), set by the
    #: update loop at each step's first minibatch; None: each minibatch is its own step (direct calls)
    step_normaliser: float | None = None

    def normaliser_over_ranks(self, experience: Any, rows: torch.Tensor) -> float:
        """``losses.micro_batches.normaliser`` (of ``share_aggregation``) of ``rows`` summed over the ranks (one
        all-reduce of a number; none in one process)."""
        local = normaliser(self.share_aggregation(), experience.mask[rows])
        if self._trainer is None or self.trainer.world_size == 1:
            return local
        return float(self.trainer.strategy.reduce(torch.tensor(local, device=self.device), reduce_op="sum"))

    def step_share(self, experience: Any, rows: torch.Tensor, accum: int) -> float:
        """The weight of minibatch ``rows``'s loss (computed with its own normaliser, then divided by ``accum``) in
        its optimizer step's: its normaliser times ``accum`` times the ranks over ``step_normaliser``, so that the
        ranks' average of the accumulated gradients is that of all the step's rows under one normaliser. 1 without
        a step normaliser, when the step has no token in the loss, and for one minibatch in one process.
        (Sequence-parallel ranks hold the same rows: their counts scale both sides.)"""
        if not self.step_normaliser:
            return 1.0
        ranks = 1 if self._trainer is None else self.trainer.world_size
        return normaliser(self.share_aggregation(), experience.mask[rows]) * accum * ranks / self.step_normaliser

    def minibatch_backward(
        self, optimizer: Any, experience: Any, rows: torch.Tensor, accum: int, sync: bool
    ) -> dict[str, torch.Tensor]:
        """``minibatch_loss`` on ``rows`` and its backward, divided by ``accum``; gradients synchronised across
        ranks after the last backward when ``sync``. With a ``token_budget``, one forward/backward per micro-batch
        (``micro_batches``), each loss times its share: the sum is the minibatch's loss, and its gradient. An MoE
        policy's router auxiliary loss (``routing/aux_loss`` of the stats, added here) is the minibatch's too: split,
        a gradient-free pass over the micro-batches first counts the router load
        (``models.routing_replay.RouterLoad``), then each micro-batch adds its exact part. Returns the stats: ``loss``
        that sum (the auxiliary loss included), ``routing/aux_loss`` the minibatch's, the others the share-weighted
        means of the micro-batches'. The loss is also weighted by ``step_share`` (the returned stats are not: they
        stay this minibatch's)."""
        parts = self.micro_batches(experience, rows)
        split, scale = len(parts) > 1, self.step_share(experience, rows, accum)
        if split and bool(getattr(getattr(self.policy, "config", None), "output_router_logits", False)):
            self.router_load = RouterLoad()
            with torch.no_grad():
                for micro, _ in parts:
                    self.minibatch_loss(experience, micro)
            self.router_load.counting = False
        merged: dict[str, torch.Tensor] = {}
        try:
            for k, (micro, share) in enumerate(parts):
                with optimizer.toggle_model(sync_grad=sync and k == len(parts) - 1):
                    loss, stats = self.minibatch_loss(experience, micro)
                    aux = stats.get("routing/aux_loss")
                    weight = (share if split else 1.0) * scale
                    loss = loss * weight if split or scale != 1.0 else loss
                    self.manual_backward((loss if aux is None else loss + aux) / accum)
                for key, value in stats.items():
                    whole = key == "routing/aux_loss"  # each micro-batch's part of the minibatch's: summed
                    if whole:
                        merged["loss"] = merged.get("loss", 0.0) + value.detach()
                    merged[key] = merged.get(key, 0.0) + (value * share if split and not whole else value)
        finally:
            self.router_load = None
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in merged.items()}
