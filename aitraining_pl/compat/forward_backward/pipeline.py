"""``ForwardBackwardPipeline``: queued forward/backward passes, gradient accumulation, optimizer steps,
checkpoints and sampling on one model.

**Ordering.** All work on the model (``forward_backward``, ``forward``, ``optim_step``, ``save_state``,
``load_state``, ``sample``) runs on ONE worker thread in submission order:
two passes over the same parameters running at once would race on gradients and weights, so the honest
asynchrony is "queue now, collect the future later". The caller's thread is free to prepare the next batch
(tokenise, score rewards) while the model works. The seed's ``max_workers`` is deprecated: it is accepted, ignored
and warned about (``DeprecationWarning``), and will be removed in the next release.

**Accumulation.** Each micro-batch's loss is divided by ``gradient_accumulation_steps`` before ``backward``.
``optim_step`` applies the update once at least that many micro-batches have been accumulated (otherwise it
returns ``applied=False`` and keeps the gradients); the applied gradient is the mean of the micro-batch
gradients, each counted exactly once (if more micro-batches than ``gradient_accumulation_steps`` were
queued, the gradients are rescaled to their mean; ``force=True`` steps with fewer). Micro-batches of equal
token counts therefore give exactly the gradient of one batch of their union.

Devices are plain ``torch`` placement (``device=None``: CUDA if available, else CPU); precision is the
model's own dtype. Lightning Fabric is not needed for a single process and is not used.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from aitraining_pl.compat.forward_backward.losses import PIPELINE_LOSSES, LossInputs, check_loss_kwargs
from aitraining_pl.compat.forward_backward.sampling import sample_with_cache
from aitraining_pl.losses import masked_mean, selective_log_softmax
from aitraining_pl.models.training import eval_mode

MODEL_FILE, OPTIMIZER_FILE, STATE_FILE = "model.safetensors", "optimizer.pt", "state.json"


@dataclass
class ForwardBackwardResult:
    """One micro-batch: its (unscaled) loss, loss statistics, label-token count and per-token log-probs."""

    loss: float
    metrics: dict[str, float] = field(default_factory=dict)
    num_tokens: int = 0
    logprobs: torch.Tensor | None = None  #: (B, T - 1) on the CPU, detached


@dataclass
class ForwardResult:
    """A forward pass without gradients: per-token log-probs of the labels, their mask and mean NLL."""

    logprobs: torch.Tensor  #: (B, T - 1) on the CPU
    mask: torch.Tensor  #: (B, T - 1)
    loss: float  #: mean negative log-likelihood of the label tokens
    logits: torch.Tensor | None = None  #: (B, T, V) on the CPU when asked for
    values: torch.Tensor | None = None  #: (B, T - 1) when the model has a value head


@dataclass
class OptimStepResult:
    """``applied`` is False when fewer than ``gradient_accumulation_steps`` micro-batches were accumulated."""

    applied: bool
    step: int  #: optimizer steps applied so far
    num_micro_batches: int
    grad_norm: float | None = None  #: total gradient norm before clipping
    learning_rate: float | None = None


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> ``cuda`` when available, else ``cpu``."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def no_cache_kwargs(model: nn.Module) -> dict[str, Any]:
    """``{"use_cache": False}`` when the model's forward takes it (transformers LMs, peft wrappers), else {}."""
    params = inspect.signature(model.forward).parameters
    takes = "use_cache" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    return {"use_cache": False} if takes else {}


def model_outputs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """``(logits (B, T, V), values (B, T) or None)`` from a transformers LM, a ``PPOModel`` (logits and
    values), a ``ReferencePolicy`` or any callable returning logits."""
    if isinstance(model, nn.Module):
        out = model(input_ids=input_ids, attention_mask=attention_mask, **no_cache_kwargs(model))
    else:
        out = model(input_ids, attention_mask)
    if torch.is_tensor(out):
        return out, None
    logits = out.logits if hasattr(out, "logits") else out[0]
    values = getattr(out, "values", None)  # PolicyValueOutput.values (a transformers output's is dict.values)
    return logits, values if torch.is_tensor(values) else None


def sampling_model(model: nn.Module) -> nn.Module:
    """The causal LM to sample from (a ``PPOModel``'s ``base_model``; the model itself otherwise)."""
    from aitraining_pl.models import PPOModel

    return model.base_model if isinstance(model, PPOModel) else model


def warn_max_workers(max_workers: int | None) -> None:
    """The seed's ``max_workers`` is ignored (work runs on one thread, in order): say so when it is given."""
    if max_workers is not None:
        warnings.warn(
            "max_workers is deprecated and ignored: the pipeline runs all work on one thread in submission order; "
            "drop the argument (it will be removed in the next release)",
            DeprecationWarning,
            stacklevel=3,
        )


class ForwardBackwardPipeline:
    """Queued forward/backward passes with gradient accumulation, optimizer steps, checkpoints and sampling.

    Args:
        model: a transformers causal LM (optionally ``peft``-wrapped) or a ``PPOModel``.
        device: where the model runs (``None``: CUDA if available, else CPU).
        max_workers: deprecated and ignored (a ``DeprecationWarning`` when given); work always runs on one
            thread, in order (see above).
        gradient_accumulation_steps: micro-batches per optimizer step; each loss is divided by it.
        checkpoint_dir: folder under which ``save_state(name)`` writes ``<checkpoint_dir>/<name>``.
    """

    def __init__(
        self,
        model: nn.Module,
        device: str | torch.device | None = None,
        max_workers: int | None = None,
        gradient_accumulation_steps: int = 1,
        checkpoint_dir: str = "checkpoints",
    ):
        warn_max_workers(max_workers)
        if gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
        self.device = resolve_device(device)
        self.model = model.to(self.device)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.checkpoint_dir = checkpoint_dir
        self.step = 0
        self._micro_batches = 0
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: Any = None
        self._pending_optimizer_state: dict | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward-backward")
        self._closed = False

    # ------------------------------------------------------------------ queue
    def _submit(self, fn: Callable, *args: Any, **kwargs: Any) -> Future:
        if self._closed:
            raise RuntimeError("the pipeline was shut down")
        return self._executor.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True) -> None:
        """Finish (``wait=True``) the queued work and stop the worker thread."""
        self._closed = True
        self._executor.shutdown(wait=wait)

    def __enter__(self) -> ForwardBackwardPipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ passes
    def _batch(self, input_ids: Any, attention_mask: Any, labels: Any):
        input_ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if attention_mask is None:
            mask = torch.ones_like(input_ids)
        else:
            mask = torch.as_tensor(attention_mask, device=self.device).reshape(input_ids.shape)
        if labels is None:
            labels = input_ids.masked_fill(mask == 0, -100)
        labels = torch.as_tensor(labels, dtype=torch.long, device=self.device).reshape(input_ids.shape)
        return input_ids, mask.long(), labels

    def _score(self, model: Any, input_ids, attention_mask, labels):
        logits, values = model_outputs(model, input_ids, attention_mask)
        targets = labels[:, 1:]
        token_mask = ((targets != -100) & (attention_mask[:, 1:] > 0)).float()
        logprobs = selective_log_softmax(logits[:, :-1], targets.clamp_min(0))
        values = values[:, :-1].float() if values is not None else None
        return LossInputs(logprobs=logprobs, mask=token_mask, logits=logits, values=values)

    def forward_backward(
        self,
        input_ids: Any,
        attention_mask: Any = None,
        labels: Any = None,
        loss_fn: str = "cross_entropy",
        **loss_kwargs: Any,
    ) -> Future[ForwardBackwardResult]:
        """Queue a forward and backward pass of a built-in loss (``PIPELINE_LOSSES``).

        ``labels`` default to ``input_ids`` with padding ignored; -100 marks tokens that are not scored.
        Loss keyword arguments: ``importance_sampling`` needs ``old_logprobs`` and ``advantages``; ``ppo``
        needs ``old_log_probs`` and ``advantages`` and takes ``values``, ``returns``, ``clip_ratio``,
        ``value_clip``, ``value_coef``.
        """
        check_loss_kwargs(loss_fn, loss_kwargs)
        return self._submit(self._forward_backward, input_ids, attention_mask, labels, loss_fn, loss_kwargs)

    def _forward_backward(self, input_ids, attention_mask, labels, loss_fn, loss_kwargs) -> ForwardBackwardResult:
        batch = self._batch(input_ids, attention_mask, labels)
        inputs = self._score(self.model, *batch)
        loss, stats = PIPELINE_LOSSES[loss_fn](inputs, **loss_kwargs)
        self._backward(loss)
        return ForwardBackwardResult(loss.item(), stats, int(inputs.mask.sum()), inputs.logprobs.detach().cpu())

    def _backward(self, loss: torch.Tensor) -> None:
        (loss / self.gradient_accumulation_steps).backward()
        self._micro_batches += 1

    def forward_backward_custom(
        self, input_ids: Any, custom_loss_fn: Callable, attention_mask: Any = None, **kwargs: Any
    ) -> Future[ForwardBackwardResult]:
        """Queue ``loss = custom_loss_fn(model, inputs, outputs, **kwargs)`` and its backward pass; the
        loss must be a scalar tensor (``inputs`` holds ``input_ids`` and ``attention_mask``)."""
        return self._submit(self._forward_backward_custom, input_ids, custom_loss_fn, attention_mask, kwargs)

    def _forward_backward_custom(self, input_ids, custom_loss_fn, attention_mask, kwargs) -> ForwardBackwardResult:
        input_ids, attention_mask, _ = self._batch(input_ids, attention_mask, None)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        outputs = self.model(**inputs, **no_cache_kwargs(self.model))
        loss = custom_loss_fn(self.model, inputs, outputs, **kwargs)
        if not torch.is_tensor(loss) or loss.numel() != 1:
            shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
            raise ValueError(f"custom_loss_fn must return a scalar tensor, got {shape}")
        if not loss.requires_grad:
            raise ValueError(
                "custom_loss_fn returned a tensor without a gradient (computed under no_grad or detached?)"
            )
        loss = loss.reshape(())
        self._backward(loss)
        return ForwardBackwardResult(loss.item(), {}, int(attention_mask.sum()))

    def forward(
        self,
        input_ids: Any,
        attention_mask: Any = None,
        labels: Any = None,
        return_logits: bool = False,
        model: nn.Module | None = None,
    ) -> Future[ForwardResult]:
        """Queue a forward pass without gradients (eval mode): per-token log-probs of the labels, by ``model``
        (default: the pipeline's model; e.g. a frozen reference model) on the pipeline's queue."""
        model = self.model if model is None else model
        return self._submit(self._forward, model, input_ids, attention_mask, labels, return_logits)

    @torch.no_grad()
    def _forward(self, model, input_ids, attention_mask, labels, return_logits) -> ForwardResult:
        with eval_mode(model) if isinstance(model, nn.Module) else contextlib.nullcontext():
            inputs = self._score(model, *self._batch(input_ids, attention_mask, labels))
        return ForwardResult(
            inputs.logprobs.cpu(),
            inputs.mask.cpu(),
            -masked_mean(inputs.logprobs, inputs.mask).item(),
            inputs.logits.float().cpu() if return_logits else None,
            inputs.values.cpu() if inputs.values is not None else None,
        )

    # ------------------------------------------------------------------ optimizer
    def optim_step(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        max_grad_norm: float | None = 1.0,
        force: bool = False,
    ) -> Future[OptimStepResult]:
        """Queue an optimizer step: clip to ``max_grad_norm`` (``None``/0: no clipping), step, zero the
        gradients, then step ``scheduler``. Skipped (``applied=False``) until ``gradient_accumulation_steps``
        micro-batches are in, unless ``force``."""
        return self._submit(self._optim_step, optimizer, scheduler, max_grad_norm, force)

    def _adopt(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        self._optimizer, self._scheduler = optimizer, scheduler if scheduler is not None else self._scheduler
        if self._pending_optimizer_state is not None:
            state, self._pending_optimizer_state = self._pending_optimizer_state, None
            optimizer.load_state_dict(state["optimizer"])
            if state.get("scheduler") is not None and self._scheduler is not None:
                self._scheduler.load_state_dict(state["scheduler"])

    def _optim_step(self, optimizer, scheduler, max_grad_norm, force) -> OptimStepResult:
        self._adopt(optimizer, scheduler)
        count = self._micro_batches
        if count == 0 or (count < self.gradient_accumulation_steps and not force):
            return OptimStepResult(False, self.step, count)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if count != self.gradient_accumulation_steps:  # make the gradient the mean over the micro-batches
            for p in params:
                p.grad.mul_(self.gradient_accumulation_steps / count)
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        self.step += 1
        self._micro_batches = 0
        return OptimStepResult(True, self.step, count, float(norm), float(optimizer.param_groups[0]["lr"]))

    # ------------------------------------------------------------------ checkpoints
    def save_state(
        self, name: str, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None
    ) -> dict[str, str | None]:
        """Write ``<checkpoint_dir>/<name>`` (after the queued work): model weights as safetensors, the
        optimizer (the last one given to ``optim_step`` unless passed here) and scheduler state, and a JSON
        state file. The folder is written beside the target, then renamed over it, so a failed save never
        damages an earlier checkpoint. Gradients of micro-batches not yet stepped are not saved.

        Returns:
            ``{"path", "model_path", "optimizer_path" (None without an optimizer), "state_path"}``.
        """
        return self._submit(self._save_state, name, optimizer, scheduler).result()

    def _save_state(self, name, optimizer, scheduler) -> dict[str, str | None]:
        from safetensors.torch import save_model

        optimizer = optimizer or self._optimizer
        scheduler = scheduler or self._scheduler
        path = os.path.abspath(os.path.join(self.checkpoint_dir, name))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", dir=os.path.dirname(path))
        try:
            save_model(self.model, os.path.join(tmp, MODEL_FILE))
            if optimizer is not None:
                state = {
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                }
                torch.save(state, os.path.join(tmp, OPTIMIZER_FILE))
            with open(os.path.join(tmp, STATE_FILE), "w") as handle:
                state = {
                    "step": self.step,
                    "gradient_accumulation_steps": self.gradient_accumulation_steps,
                    "name": name,
                }
                json.dump(state, handle)
            if os.path.exists(path):
                old = path + ".old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(path, old)
                os.replace(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        has_optimizer = optimizer is not None
        return {
            "path": path,
            "model_path": os.path.join(path, MODEL_FILE),
            "optimizer_path": os.path.join(path, OPTIMIZER_FILE) if has_optimizer else None,
            "state_path": os.path.join(path, STATE_FILE),
        }

    def load_state(
        self, path: str, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None
    ) -> dict[str, Any]:
        """Load a ``save_state`` folder (a path, or a name under ``checkpoint_dir``) after the queued work.

        Weights load through safetensors, optimizer state with ``torch.load(weights_only=True)``: into
        ``optimizer`` / the last optimizer seen, or, if there is none yet, into the first one given to
        ``optim_step``. Returns the JSON state (``step``, ...).
        """
        return self._submit(self._load_state, path, optimizer, scheduler).result()

    def _load_state(self, path, optimizer, scheduler) -> dict[str, Any]:
        from safetensors.torch import load_model

        if not os.path.isdir(path) and os.path.isdir(os.path.join(self.checkpoint_dir, path)):
            path = os.path.join(self.checkpoint_dir, path)
        if not os.path.isfile(os.path.join(path, MODEL_FILE)):
            raise FileNotFoundError(f"{path!r} is not a checkpoint written by save_state (no {MODEL_FILE})")
        load_model(self.model, os.path.join(path, MODEL_FILE), device=str(self.device))
        with open(os.path.join(path, STATE_FILE)) as handle:
            state = json.load(handle)
        self.step, self._micro_batches = int(state.get("step", 0)), 0
        self._optimizer = optimizer or self._optimizer
        self._scheduler = scheduler or self._scheduler
        if os.path.isfile(os.path.join(path, OPTIMIZER_FILE)):
            self._pending_optimizer_state = torch.load(
                os.path.join(path, OPTIMIZER_FILE), map_location=self.device, weights_only=True
            )
            if self._optimizer is not None:
                self._adopt(self._optimizer, self._scheduler)
        return state

    # ------------------------------------------------------------------ sampling
    def sample(
        self,
        prompt: Sequence[int] | torch.Tensor,
        max_tokens: int = 100,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop: Sequence[int | Sequence[int]] | None = None,
        seed: int | None = None,
    ) -> dict[str, Any]:
        """Sample one continuation of ``prompt`` (token ids) with a KV cache, in eval mode, after the queued
        work. Temperatures at or below 1e-4 are greedy. Returns ``tokens``, ``logprobs`` (per new token,
        under the model at temperature 1), ``sampling_logprobs``, ``prompt`` and ``stop_reason``."""
        prompt_ids = torch.as_tensor(prompt).reshape(-1).tolist()
        return self._submit(self._sample, prompt_ids, max_tokens, temperature, top_k, top_p, stop, seed).result()

    def _sample(self, prompt_ids, max_tokens, temperature, top_k, top_p, stop, seed) -> dict[str, Any]:
        lm = sampling_model(self.model)
        generator = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        with eval_mode(lm):
            return sample_with_cache(
                lm, prompt_ids, max_tokens, temperature, top_k, top_p, stop, generator, self.device
            )
