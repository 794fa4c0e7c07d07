"""A small shared base for the alignment LightningModules (DPO, reward models, PPO).

It holds what every module needs and nothing algorithm-specific:

- ``load_policy_from_hparams``: the policy (LoRA-wrapped when asked) and its reference, built from the
  module's ``model_name`` / ``model_config`` / ``lora`` / ``dtype`` / ``seed`` hyperparameters;
- ``tokenizer``: loaded once from ``tokenizer_name`` (or ``model_name``); the CLI links it into the data
  module, so model and data always share one tokenizer;
- ``configure_optimizers``: AdamW with linear warmup then linear / cosine / constant decay
  (``adamw_with_warmup``) over ``trainer.estimated_stepping_batches``;
- ``log_metrics``: namespaced metrics (``train/loss``, ``val/rewards/accuracies``, ...). Per-step training
  values are logged as they are; validation and test values go through ``torchmetrics.MeanMetric`` so
  epoch values are reduced across ranks;
- ``save_pretrained``: Hugging Face export of the policy and tokenizer (used by ``HFExportCallback``);
- ``apply_training_options``: the ``disable_dropout`` and ``gradient_checkpointing`` arguments every module has.
- ``configure_callbacks``: ``ExactResumeCallback`` (exact resume) and ``NonFiniteGuard`` (NaN/inf stops the run).

A subclass calls ``super().__init__()``, then ``self.save_hyperparameters(...)`` and
``self.store_lora_hparam(lora)``, and reads its arguments from ``self.hparams``; once its networks are built it
calls ``self.apply_training_options(...)``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterable, Mapping

import lightning.pytorch as pl
import torch
from torch import nn
from torchmetrics import MeanMetric

from aitraining_pl.models import LoRAConfig, ReferencePolicy, is_peft_model, load_policy, load_tokenizer
from aitraining_pl.models.training import disable_dropout, enable_gradient_checkpointing
from aitraining_pl.optim import adamw_with_warmup

#: stages whose values are averaged over the epoch with torchmetrics (training values are per step).
EPOCH_STAGES = ("val", "test")


def as_lora_config(lora: LoRAConfig | Mapping[str, Any] | None) -> LoRAConfig | None:
    """``LoRAConfig`` from a dataclass, a plain dict (as stored in hparams/checkpoints) or ``None``."""
    if lora is None or isinstance(lora, LoRAConfig):
        return lora
    return LoRAConfig(**dict(lora))


class AlignmentModule(pl.LightningModule):
    """Base class: policy loading, tokenizer, optimizer, metric logging and HF export.

    Hyperparameters read (with defaults when a subclass does not declare them): ``model_name``,
    ``model_config``, ``tokenizer_name``, ``lora``, ``dtype``, ``seed``, ``trust_remote_code``,
    ``attn_implementation``, ``learning_rate`` (1e-5), ``warmup_ratio`` (0.0), ``lr_schedule`` ("linear"),
    ``weight_decay`` (0.0), ``disable_dropout`` (True), ``gradient_checkpointing`` (False).
    """

    #: attribute holding the trained network exported by ``save_pretrained`` (a subclass may change it).
    policy: nn.Module

    def __init__(self) -> None:
        super().__init__()
        self._tokenizer = None
        self._epoch_metrics = nn.ModuleDict()

    # ------------------------------------------------------------------ hyperparameters
    def hparam(self, name: str, default: Any = None) -> Any:
        """``self.hparams[name]`` or ``default`` when the subclass does not have that argument."""
        return self.hparams.get(name, default)

    def store_lora_hparam(self, lora: LoRAConfig | Mapping[str, Any] | None) -> LoRAConfig | None:
        """Keep ``lora`` in hparams as a plain dict (checkpoints load with ``weights_only=True``)."""
        config = as_lora_config(lora)
        self.hparams["lora"] = dataclasses.asdict(config) if config is not None else None
        return config

    # ------------------------------------------------------------------ models
    def load_policy_from_hparams(self, *, with_reference: bool) -> tuple[nn.Module, ReferencePolicy | None]:
        """The policy and (if asked) its reference, from ``model_name`` or ``model_config``.

        Runs in a forked RNG seeded with ``seed``: LoRA initialisation is reproducible and building the
        module never shifts the caller's random stream (so data order is the same with or without LoRA)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(self.hparam("seed", 0) or 0))
            return self._load_policy(with_reference)

    def _load_policy(self, with_reference: bool) -> tuple[nn.Module, ReferencePolicy | None]:
        return load_policy(
            self.hparam("model_name"),
            self.hparam("model_config"),
            as_lora_config(self.hparam("lora")),
            with_reference=with_reference,
            dtype=self.hparam("dtype"),
            attn_implementation=self.hparam("attn_implementation"),
            trust_remote_code=bool(self.hparam("trust_remote_code", False)),
            seed=int(self.hparam("seed", 0) or 0),
        )

    @property
    def tokenizer(self):
        """The tokenizer named by ``tokenizer_name`` (default: ``model_name``), loaded on first use."""
        if self._tokenizer is None:
            name = self.hparam("tokenizer_name") or self.hparam("model_name")
            if name is None:
                raise ValueError("set tokenizer_name (e.g. 'byte') when the model comes from an inline model_config")
            self._tokenizer = load_tokenizer(name, trust_remote_code=bool(self.hparam("trust_remote_code", False)))
        return self._tokenizer

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Use ``tokenizer`` (an object, not a name) instead of loading one from ``tokenizer_name`` /
        ``model_name``; e.g. the seed's facades, which take a tokenizer object."""
        self._tokenizer = tokenizer

    def apply_training_options(self, *outside: Any) -> None:
        """``disable_dropout``: no dropout in this module's networks (policy, value head, reward model) nor in
        ``outside`` (networks held out of the module tree: the frozen reference, a reward source's model); TRL
        does the same, so that PPO's first ratio is 1 and DPO's first rewards are 0. ``gradient_checkpointing``:
        recompute activations in backward for the networks of ``checkpointed_networks``."""
        if self.hparam("disable_dropout", True):
            disable_dropout(self, *(net for net in outside if isinstance(net, nn.Module)))
        if self.hparam("gradient_checkpointing", False):
            for network in self.checkpointed_networks():
                enable_gradient_checkpointing(network)

    def checkpointed_networks(self) -> list[nn.Module]:
        """The transformers models trained with gradients (the policy; a subclass may change it)."""
        return [self.policy]

    def trainable_parameters(self) -> Iterable[nn.Parameter]:
        """Parameters handed to the optimizer (all with ``requires_grad``)."""
        return (p for p in self.parameters() if p.requires_grad)

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        return adamw_with_warmup(
            self.trainable_parameters(),
            learning_rate=float(self.hparam("learning_rate", 1e-5)),
            total_steps=self.trainer.estimated_stepping_batches,
            warmup_ratio=float(self.hparam("warmup_ratio", 0.0)),
            schedule=self.hparam("lr_schedule", "linear"),
            weight_decay=float(self.hparam("weight_decay", 0.0)),
        )

    def configure_callbacks(self):
        """Callbacks every fit gets unless the trainer already has one of the type: ``ExactResumeCallback``
        (random states in checkpoints, for an exact resume) and ``NonFiniteGuard`` (stop on a NaN/inf loss or
        gradient norm)."""
        from aitraining_pl.callbacks.guard import NonFiniteGuard
        from aitraining_pl.callbacks.resume import ExactResumeCallback

        present = self.trainer.callbacks if self._trainer is not None else []
        kinds = (ExactResumeCallback, NonFiniteGuard)
        return [kind() for kind in kinds if not any(isinstance(c, kind) for c in present)]

    # ------------------------------------------------------------------ logging
    def _epoch_metric(self, key: str, device: torch.device) -> tuple[str, MeanMetric]:
        slot = key.replace("/", "__").replace(".", "_")
        if slot not in self._epoch_metrics:
            # created outside inference mode: a metric first made inside ``trainer.validate`` must still
            # accept updates in a later ``fit`` (inference tensors refuse in-place updates outside it)
            with torch.inference_mode(False):
                self._epoch_metrics[slot] = MeanMetric().to(device)
        metric = self._epoch_metrics[slot]
        if not torch.is_inference_mode_enabled():  # a reset inside ``trainer.validate`` left inference tensors
            for name, value in metric.metric_state.items():
                if isinstance(value, torch.Tensor) and value.is_inference():
                    setattr(metric, name, value.clone())
        return f"_epoch_metrics.{slot}", metric

    def log_metrics(
        self, stage: str, values: Mapping[str, torch.Tensor], batch_size: int, prog_bar: Iterable[str] = ("loss",)
    ) -> None:
        """Log ``values`` as ``<stage>/<name>`` (each a scalar or a per-example tensor that is averaged).

        ``train``: one value per step. ``val``/``test``: a ``MeanMetric`` per name, weighted by batch size,
        reduced across ranks at epoch end.
        """
        prog_bar = set(prog_bar)
        for name, value in values.items():
            value = value.detach().float().mean()
            key = f"{stage}/{name}"
            if stage in EPOCH_STAGES:
                attribute, metric = self._epoch_metric(key, value.device)
                metric.update(value, weight=batch_size)
                self.log(
                    key, metric, on_step=False, on_epoch=True, batch_size=batch_size,
                    prog_bar=name in prog_bar, metric_attribute=attribute,
                )
            else:
                self.log(key, value, on_step=True, on_epoch=False, batch_size=batch_size, prog_bar=name in prog_bar)

    # ------------------------------------------------------------------ checkpoints and export
    def state_dict(self, *args, **kwargs):
        """Module state without torchmetrics accumulators (they hold no learnt state)."""
        state = super().state_dict(*args, **kwargs)
        for key in [k for k in state if k.startswith("_epoch_metrics.")]:
            del state[key]
        return state

    def save_pretrained(self, path: str | os.PathLike, merge_lora: bool = False) -> None:
        """Write the policy as a Hugging Face folder (config + safetensors) and the tokenizer to ``path``.

        Under LoRA the adapters are written (``adapter_config.json`` + ``adapter_model.safetensors``), or,
        with ``merge_lora=True``, the base weights with the adapters merged in (the live model is untouched).
        """
        model = self.policy
        if is_peft_model(model) and merge_lora:
            model = _merged_copy(model)
        model.save_pretrained(str(path), safe_serialization=True)
        self.tokenizer.save_pretrained(str(path))


class SharedStepModule(AlignmentModule):
    """An ``AlignmentModule`` whose training, validation and test steps are one ``shared_step(batch, stage)``
    (DPO and reward models: the same loss and metrics, logged under ``train/``, ``val/`` or ``test/``)."""

    def shared_step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.shared_step(batch, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.shared_step(batch, "val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.shared_step(batch, "test")


def _merged_copy(peft_model: nn.Module) -> nn.Module:
    """A copy of ``peft_model`` with adapters merged into the base weights."""
    import copy

    return copy.deepcopy(peft_model).merge_and_unload()
