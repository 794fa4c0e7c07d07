"""``AsyncTrainingClient``: batch-dict front end of ``ForwardBackwardPipeline`` with an optional reference
model for PPO/DPO-style log-probs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from aitraining_pl.compat.forward_backward.pipeline import (
    ForwardBackwardPipeline,
    ForwardBackwardResult,
    ForwardResult,
    OptimStepResult,
    warn_max_workers,
)


class AsyncTrainingClient:
    """Queue training work on ``model`` with batches as dicts; ``forward(batch, use_reference=True)`` runs
    the frozen ``reference_model`` on the same queue, so its results stay ordered with the policy's updates.

    Args:
        model: the trained model (a transformers causal LM or a ``PPOModel``).
        reference_model: a frozen model (an ``nn.Module``, moved to ``device`` and set to eval with gradients
            off) or a ``ReferencePolicy``; needed only for ``use_reference=True``.
        device: where the models run (``None``: CUDA if available, else CPU).
        gradient_accumulation_steps: micro-batches per optimizer step.
        max_workers: deprecated and ignored (a ``DeprecationWarning`` when given); work runs on one thread, in order.
        checkpoint_dir: folder for ``save_state``.
    """

    def __init__(
        self,
        model: nn.Module,
        reference_model: Any = None,
        device: str | torch.device | None = None,
        gradient_accumulation_steps: int = 1,
        max_workers: int | None = None,
        checkpoint_dir: str = "checkpoints",
    ):
        warn_max_workers(max_workers)
        self.pipeline = ForwardBackwardPipeline(model, device, None, gradient_accumulation_steps, checkpoint_dir)
        self.device = self.pipeline.device
        if isinstance(reference_model, nn.Module):
            reference_model = reference_model.to(self.device).eval()
            reference_model.requires_grad_(False)
        elif reference_model is not None and hasattr(reference_model, "to"):
            reference_model.to(self.device)
        self.reference_model = reference_model

    @classmethod
    def connect(cls, base_url: str, api_key: str, base_model: str, **remote: Any) -> AsyncTrainingClient:
        """The same client against a Tinker-compatible server (``aitraining-pl tinker-serve``): its work goes to a
        LoRA adapter there (``remote.RemotePipeline``; ``remote`` holds ``rank``, ``seed``,
        ``gradient_accumulation_steps``). There is no local model and no reference model."""
        from aitraining_pl.compat.forward_backward.remote import RemotePipeline

        client = cls.__new__(cls)
        client.pipeline = RemotePipeline(base_url, api_key, base_model, **remote)
        client.device, client.reference_model = client.pipeline.device, None
        return client

    @property
    def model(self) -> nn.Module:
        return self.pipeline.model

    @staticmethod
    def _split(batch: Mapping[str, Any]) -> tuple[Any, Any, Any, dict[str, Any]]:
        if "input_ids" not in batch:
            raise KeyError(f"a batch needs 'input_ids'; got keys {sorted(batch)}")
        rest = dict(batch)
        return rest.pop("input_ids"), rest.pop("attention_mask", None), rest.pop("labels", None), rest

    def forward_backward(
        self, batch: Mapping[str, Any], loss_fn: str | Callable = "cross_entropy", **loss_kwargs: Any
    ) -> Future[ForwardBackwardResult]:
        """Queue a forward/backward pass. ``batch`` holds ``input_ids`` and optionally ``attention_mask``,
        ``labels`` and the loss's tensors (``old_logprobs``, ``advantages``, ...); ``loss_fn`` is a built-in
        name or a custom ``fn(model, inputs, outputs, **kwargs) -> scalar``."""
        input_ids, attention_mask, labels, extra = self._split(batch)
        extra.update(loss_kwargs)
        if callable(loss_fn):
            return self.pipeline.forward_backward_custom(input_ids, loss_fn, attention_mask, **extra)
        return self.pipeline.forward_backward(input_ids, attention_mask, labels, loss_fn, **extra)

    def forward(
        self, batch: Mapping[str, Any], use_reference: bool = False, return_logits: bool = False
    ) -> Future[ForwardResult]:
        """Queue a no-gradient forward pass of the model, or of the reference model with ``use_reference``."""
        input_ids, attention_mask, labels, _ = self._split(batch)
        model = self.pipeline.model
        if use_reference:
            if self.reference_model is None:
                raise ValueError("forward(use_reference=True) needs the client to be built with a reference_model")
            model = self.reference_model
        return self.pipeline.forward(input_ids, attention_mask, labels, return_logits, model=model)

    def optim_step(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        max_grad_norm: float | None = 1.0,
        force: bool = False,
    ) -> Future[OptimStepResult]:
        """Queue an optimizer step (see ``ForwardBackwardPipeline.optim_step``)."""
        return self.pipeline.optim_step(optimizer, scheduler, max_grad_norm, force)

    def sample(self, prompt: Any, **kwargs: Any) -> dict[str, Any]:
        """``ForwardBackwardPipeline.sample`` on the trained model."""
        return self.pipeline.sample(prompt, **kwargs)

    def save_state(self, name: str, **kwargs: Any) -> dict[str, str | None]:
        return self.pipeline.save_state(name, **kwargs)

    def load_state(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self.pipeline.load_state(path, **kwargs)

    def shutdown(self, wait: bool = True) -> None:
        """Finish the queued work and stop the worker thread."""
        self.pipeline.shutdown(wait)

    def __enter__(self) -> AsyncTrainingClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
