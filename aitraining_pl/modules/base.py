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
- ``configure_model``: FSDP2 sharding of ``sharded_networks`` under Lightning's ``ModelParallelStrategy``;
- ``configure_callbacks``: ``ExactResumeCallback`` (exact resume) and ``NonFiniteGuard`` (NaN/inf stops the run).

A subclass calls ``super().__init__()``, then ``self.save_arguments(constructor_arguments(<its __init__>,
locals()))`` (its hyperparameters, stored once), and reads its arguments from ``self.hparams``; once its networks
are built it calls ``self.apply_training_options(...)``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.distributed.tensor import DTensor
from torchmetrics import MeanMetric

from aitraining_pl.errors import ConfigError
from aitraining_pl.models import LoRAConfig, ReferencePolicy, is_peft_model, load_policy, load_tokenizer
from aitraining_pl.models.lora import as_lora_config, save_adapter_base, save_plain
from aitraining_pl.models.quantization import is_quantized, merged_full_precision_state, quantization_hparam
from aitraining_pl.models.sharding import is_sharded, shard
from aitraining_pl.models.training import disable_dropout, enable_gradient_checkpointing, keep_float32
from aitraining_pl.models.vision import is_vision_model, is_vision_name, load_processor
from aitraining_pl.optim import adamw_with_warmup, fused_adamw_applies
from aitraining_pl.strategies import FSDP2Strategy, sharding_mesh  # noqa: F401 - FSDP2Strategy registers "fsdp2"
from aitraining_pl.validation import Ranges, check_arguments, rules, save_hparams

#: stages whose values are averaged over the epoch with torchmetrics (training values are per step).
EPOCH_STAGES = ("val", "test")

#: ranges of the arguments every module has (the optimizer, the weights' dtype, LoRA); a module adds its own.
MODULE_RANGES = rules(
    "learning_rate",
    "warmup_ratio",
    "weight_decay",
    "lr_schedule",
    "dtype",
    "token_budget",
    lora=LoRAConfig.argument_ranges,
)


class AlignmentModule(pl.LightningModule):
    """Base class: policy loading, tokenizer, optimizer, metric logging and HF export.

    Hyperparameters read (with defaults when a subclass does not declare them): ``model_name``,
    ``model_config``, ``tokenizer_name``, ``lora``, ``dtype``, ``seed``, ``trust_remote_code``,
    ``attn_implementation``, ``learning_rate`` (1e-5), ``warmup_ratio`` (0.0), ``lr_schedule`` ("linear"),
    ``weight_decay`` (0.0), ``disable_dropout`` (True), ``gradient_checkpointing`` (False).
    """

    #: attribute holding the trained network exported by ``save_pretrained`` (a subclass may change it).
    policy: nn.Module
    #: allowed values of the constructor's arguments (``validation.check_arguments``), checked by ``save_arguments``
    argument_ranges: ClassVar[Ranges] = {}

    def __init__(self) -> None:
        super().__init__()
        self._tokenizer = None
        self._epoch_metrics = nn.ModuleDict()

    # ------------------------------------------------------------------ hyperparameters
    def save_arguments(self, arguments: Mapping[str, Any]) -> None:
        """Store the constructor's arguments as the hyperparameters, in one step and before any model loads.

        ``arguments`` come normalised (``validation.constructor_arguments``: renamed ones under their new name,
        option groups such as ``generation`` as plain dicts); ``lora`` and ``quantization`` are stored here as plain
        dicts (``None`` when off: checkpoints load with ``weights_only=True``). Every value is checked first, once,
        against the class's ``argument_ranges``."""
        values = dict(arguments)
        if "lora" in values:
            config = as_lora_config(values["lora"], f"{type(self).__name__}.lora")
            values["lora"] = dataclasses.asdict(config) if config is not None else None
        if "quantization" in values:
            values["quantization"] = quantization_hparam(values["quantization"])
        check_arguments(type(self).argument_ranges, values, type(self).__name__)
        save_hparams(self, values)

    def hparam(self, name: str, default: Any = None) -> Any:
        """``self.hparams[name]`` or ``default`` when the subclass does not have that argument."""
        return self.hparams.get(name, default)

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
            quantization=self.hparam("quantization"),
            freeze_vision_tower=bool(self.hparam("freeze_vision_tower", True)),
        )

    def full_precision_base(self) -> nn.Module:
        """The policy's base model as loaded without quantization (the base a QLoRA export merges into)."""
        from aitraining_pl.models.loading import load_causal_lm

        return load_causal_lm(
            self.hparam("model_name"),
            self.hparam("model_config"),
            dtype=self.hparam("dtype"),
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
            trust = bool(self.hparam("trust_remote_code", False))
            if is_vision_name(name) or is_vision_model(getattr(self, "policy", None)):  # the processor's tokenizer
                self._tokenizer = load_processor(name, trust_remote_code=trust).tokenizer
            else:
                self._tokenizer = load_tokenizer(name, trust_remote_code=trust)
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

    # ------------------------------------------------------------------ sharding (FSDP2)
    def sharded_networks(self) -> list[nn.Module]:
        """The networks ``configure_model`` shards, each as its own FSDP root: the policy and the frozen reference
        copy (held outside the module tree; under LoRA the reference is the policy with adapters off). A subclass
        adds its other networks (value head, critic, reward model)."""
        reference = getattr(self, "reference", None)
        frozen = reference.frozen_copy if reference is not None else None
        return [self.policy] + ([frozen] if frozen is not None else [])

    def configure_model(self) -> None:
        """FSDP2 under Lightning's ``ModelParallelStrategy`` (``models.sharding.shard``: every transformer block,
        then each network of ``sharded_networks``), with the mixed precision of ``--trainer.precision`` and, when
        the strategy has ``cpu_offload=True`` (``aitraining_pl.FSDP2Strategy``), sharded state in CPU memory.
        Nothing happens on one device or under DDP. Data parallelism only: a tensor-parallel mesh dimension
        above 1 is refused."""
        from lightning.pytorch.strategies import FSDPStrategy

        if self._trainer is not None and isinstance(self.trainer.strategy, FSDPStrategy):
            raise ConfigError(  # FSDP1 flat parameters: scoring and generation would read sharded weights
                "trainer.strategy", "FSDPStrategy (FSDP1) is not supported; use fsdp2 (FSDP2, docs/sharding.md)"
            )
        self.keep_master_weights()
        mesh = self.device_mesh
        if mesh is None or is_sharded(self):  # not model-parallel, or already sharded (fit, then test)
            return
        names = mesh.mesh_dim_names or ()
        tensor_parallel = mesh["tensor_parallel"].size() if "tensor_parallel" in names else 1
        if tensor_parallel > 1:
            raise ConfigError(
                "trainer.strategy",
                f"tensor_parallel_size={tensor_parallel}: the modules shard with FSDP2 only; "
                "set tensor_parallel_size=1 and data_parallel_size to the number of processes",
            )
        data_parallel = sharding_mesh(mesh)  # every rank (data x sequence) under sequence parallelism
        offload = bool(getattr(self.trainer.strategy, "cpu_offload", False))
        if offload and self.trainer.strategy.root_device.type == "cpu":  # the module is still on the CPU here
            raise ConfigError("trainer.strategy", "cpu_offload moves shards off an accelerator; on CPU use fsdp2")
        for network in self.sharded_networks():
            shard(network, data_parallel, self.trainer.precision, offload)
        missed = [name for name, p in self.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
        if missed:  # gradients of a parameter no FSDP unit owns would never be averaged across ranks
            raise RuntimeError(f"{type(self).__name__}: trainable parameters outside sharded_networks(): {missed[:5]}")

    def keep_master_weights(self) -> None:
        """The trained weights' dtype under ``--trainer.precision`` (``configure_model``, before sharding and the
        optimizer). Under ``*-mixed`` and ``32-true`` every trainable parameter is a float32 master weight, whatever
        ``dtype`` loaded it as: transformers 5 loads a checkpoint's bf16 as it is, and an AdamW update below a bf16
        weight's ulp (lr 1e-6 to 1e-5) would be lost; autocast gives the bf16/fp16 compute. Frozen networks (the
        reference, a teacher) keep the dtype they were loaded in. Under ``bf16-true``/``16-true`` Lightning casts
        the module to that dtype, weights and AdamW's states alike: on purpose (half the memory), and logged."""
        precision = str(self.trainer.precision) if self._trainer is not None else "32-true"
        if precision in ("bf16-true", "16-true"):
            rank_zero_info(
                f"precision {precision}: weights and optimizer states in {precision[:-5]}, no float32 master copy "
                "(updates below a weight's ulp are lost); bf16-mixed keeps float32 master weights"
            )
        elif precision.endswith("-mixed") or precision == "32-true":
            cast = keep_float32(self)
            if cast:
                rank_zero_info(f"precision {precision}: {cast} trainable parameters cast to float32 master weights")

    def frozen_dtype(self) -> torch.dtype | None:
        """The dtype of the frozen networks held outside the module tree (the reference, a teacher): the policy's
        under ``bf16-true``/``16-true`` (Lightning cast the module), else None: as loaded (the reference of a bf16
        checkpoint stays bf16 beside the float32 master weights; autocast computes both in bf16)."""
        precision = str(self.trainer.precision) if self._trainer is not None else "32-true"
        return next(self.policy.parameters()).dtype if precision in ("bf16-true", "16-true") else None

    def trainable_parameters(self) -> Iterable[nn.Parameter]:
        """Parameters handed to the optimizer (all with ``requires_grad``)."""
        return (p for p in self.parameters() if p.requires_grad)

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        return self.adamw(self.trainer.estimated_stepping_batches)

    def adamw(self, total_steps: int):
        """AdamW over ``trainable_parameters`` with the module's learning-rate schedule over ``total_steps``
        optimizer steps; fused where ``optim.fused_adamw_applies``."""
        params = list(self.trainable_parameters())
        plain = type(self.trainer.precision_plugin) is Precision  # 32-true: no mixed-precision plugin
        return adamw_with_warmup(
            params,
            fused=fused_adamw_applies(params, plain),
            learning_rate=float(self.hparam("learning_rate", 1e-5)),
            total_steps=total_steps,
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
                    key,
                    metric,
                    on_step=False,
                    on_epoch=True,
                    batch_size=batch_size,
                    prog_bar=name in prog_bar,
                    metric_attribute=attribute,
                )
            else:
                self.log(key, value, on_step=True, on_epoch=False, batch_size=batch_size, prog_bar=name in prog_bar)

    # ------------------------------------------------------------------ checkpoints and export
    @property
    def checkpoint_frozen_base(self) -> bool:
        """Whether checkpoints hold the frozen base of a LoRA network too (``lora.checkpoint_base``; off: only
        what trains, and the base is rebuilt from its source, ``model_name`` or ``model_config``, when the module
        is built for a resume)."""
        lora = as_lora_config(self.hparam("lora"))
        return lora is not None and lora.checkpoint_base

    def state_dict(self, *args, **kwargs):
        """Module state without torchmetrics accumulators (they hold no learnt state) and, under LoRA, without the
        frozen base (``checkpoint_frozen_base``): a LoRA checkpoint holds the adapters, not the whole model."""
        state = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        frozen = {prefix + key for key in self.frozen_base_keys()}
        for key in [k for k in state if k.startswith(prefix + "_epoch_metrics.") or k in frozen]:
            del state[key]
        return state

    def frozen_base_keys(self) -> set[str]:
        """State keys of the frozen base of every LoRA network (everything of it but its trainable parameters:
        base weights, a 4-bit base's quantization state), unless ``checkpoint_frozen_base``."""
        if self.checkpoint_frozen_base:
            return set()
        keys: set[str] = set()
        for name, network in self.named_modules():
            if is_peft_model(network):
                trainable = {n for n, p in network.named_parameters() if p.requires_grad}
                head = f"{name}." if name else ""
                keys |= {head + k for k in nn.Module.state_dict(network) if k not in trainable}
        return keys

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """As ``nn.Module.load_state_dict``, with the frozen LoRA base (``frozen_base_keys``) not expected: the base
        as built from its source stays."""
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        frozen = self.frozen_base_keys()
        missing = [k for k in result.missing_keys if k not in frozen and not k.startswith("_epoch_metrics.")]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"{type(self).__name__}: checkpoint state does not match: missing {missing[:5]}, "
                f"unexpected {result.unexpected_keys[:5]}"
            )
        return result

    def save_pretrained(self, path: str | os.PathLike, merge_lora: bool = False) -> None:
        """Write the policy as a Hugging Face folder (config + safetensors), the tokenizer and a model card
        (``README.md``, ``aitraining_pl.callbacks.model_card``) to ``path``.

        Under LoRA the adapters are written (``adapter_config.json`` + ``adapter_model.safetensors``), or,
        with ``merge_lora=True``, the base weights with the adapters merged in (the live model is untouched; under
        QLoRA the full-precision base reloaded from its source, so the export loads in plain transformers).
        The adapters name a loadable base (``base_model_name_or_path``): ``model_name``, or for an inline
        ``model_config`` the base weights written to ``<path>/base/`` (``models.lora.save_adapter_base``), so
        ``peft.AutoPeftModelForCausalLM.from_pretrained(path)`` loads the export offline.
        """
        from aitraining_pl.callbacks.model_card import write_model_card

        model = self.policy
        quantized = is_quantized(model)
        full = self.full_precision_base() if quantized and (merge_lora or self.hparam("model_name") is None) else None
        if is_peft_model(model) and merge_lora:
            if quantized:  # the adapters added to the full-precision base, not to its 4-bit rounding
                full.save_pretrained(str(path), state_dict=merged_full_precision_state(model, full))
            else:
                save_plain(model, path, merged=True)
        else:
            model.save_pretrained(str(path), safe_serialization=True)
        self.tokenizer.save_pretrained(str(path))
        if is_peft_model(model) and not merge_lora:
            save_adapter_base(model, path, self.hparam("model_name"), self.tokenizer, full_base=full)
        write_model_card(path, self)


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

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Lightning's step, then the gradients freed at once (``set_to_none``), as the Hugging Face Trainer does.
        Lightning's automatic optimisation zeroes them only after the next batch's forward, so a full set of
        gradients (with a large vocabulary, the embedding's and the head's above all) would sit in memory beside
        that forward's activations. With gradient accumulation this runs after the last micro-batch only."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        optimizer.zero_grad(set_to_none=True)
