"""The model side of the Tinker-compatible server: one base model, one LoRA adapter per training client (peft's
multiple adapters on one ``PeftModel``), each with its own AdamW state; every operation runs on ONE worker thread
in the order it was queued, and selects its adapter first (multi-tenant: adapters are swapped by
``set_adapter``, never merged).

Semantics follow Tinker's documentation: a ``forward_backward`` adds the gradient of the SUM of the elementwise
loss (``losses.tinker``) over every token of every datum to the adapter's gradients; gradients accumulate until
``optim_step``, which runs ``torch.optim.AdamW`` with that call's learning rate, betas, eps and weight decay after
clipping the global gradient norm to ``grad_clip_norm`` (0: none), then zeroes them. The model stays in eval mode
(no dropout), so a ``forward`` and a ``forward_backward`` on the same data give the same log-probabilities.

Precision is one of Lightning Fabric's precision plugins (``precision_plugin``): ``32-true``, ``bf16-true`` (the
base weights in bfloat16), ``bf16-mixed`` / ``16-mixed`` (float32 weights, the forward under autocast; ``16-mixed``
scales the loss with a ``GradScaler`` of each training client's own, unscaled before clipping, and skips a step
whose gradients are not finite). The adapters and their AdamW state are float32 in every mode, so small updates are
not lost below a bf16 ulp. ``replicas`` (``tinker.replicas``) runs the same operations on N data-parallel
processes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from aitraining_pl.losses import selective_log_softmax
from aitraining_pl.losses.tinker import TINKER_LOSSES
from aitraining_pl.models.sharding import as_forward, is_sharded, reshard
from aitraining_pl.tinker.replicas import REPLICATED, Ref
from aitraining_pl.tinker.wire import BadRequest, Datum, FwdBwd

#: the ``--precision`` values: Lightning Fabric's precision plugins (``precision_plugin``)
PRECISIONS = ("32-true", "bf16-true", "bf16-mixed", "16-mixed")
ADAPTER_FILE, OPTIMIZER_FILE, META_FILE = "adapter.safetensors", "optimizer.pt", "meta.json"
#: the ``ttl_seconds`` a checkpoint may take, as the client documents it: 1 hour to 10 years
TTL_RANGE = (3600, 10 * 365 * 86400)
#: the one-token batch of a rank with nothing else to run when every rank must run a forward (fsdp2)
IDLE = Datum([0], {"target_tokens": torch.zeros(1, dtype=torch.long)})


@dataclass(frozen=True)
class Lora:
    rank: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


@dataclass
class TrainedModel:
    model_id: str
    owner: str
    adapter: str
    lora: Lora
    optimizer: torch.optim.AdamW | None = None
    precision: Any = None  #: its Lightning precision plugin (its own GradScaler under 16-mixed)
    step: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


def linear_layers(model: torch.nn.Module) -> dict[str, str]:
    """The plain model's Linear layers by full name, each as ``attn`` (names with ``attn``/``attention``),
    ``mlp`` (``mlp``/``feed_forward``), ``unembed`` (the output embedding) or ``other``."""
    unembed, kinds = model.get_output_embeddings(), {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            if module is unembed:
                kinds[name] = "unembed"
            elif "attn" in name or "attention" in name:
                kinds[name] = "attn"
            else:
                kinds[name] = "mlp" if "mlp" in name or "feed_forward" in name else "other"
    return kinds


def target_modules(layers: dict[str, str], lora: Lora) -> list[str]:
    """The layers LoRA goes on, as ``lora`` asks (``train_attn``, ``train_mlp``, ``train_unembed``)."""
    wanted = {"attn": lora.train_attn, "mlp": lora.train_mlp, "unembed": lora.train_unembed}
    names = [name for name, kind in layers.items() if wanted.get(kind)]
    if not names:
        raise BadRequest("lora_config selects no layer of this model (train_attn, train_mlp, train_unembed)")
    return names


def precision_plugin(precision: str, device: torch.device):
    """Lightning Fabric's plugin for ``precision`` (one of ``PRECISIONS``) on ``device``."""
    from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision

    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r}: this server runs {', '.join(PRECISIONS)}")
    if precision == "32-true":
        return Precision()
    return HalfPrecision(precision) if precision.endswith("-true") else MixedPrecision(precision, device.type)


class Engine:
    """Training clients (LoRA adapters) on one base model. Methods named ``run_*`` run on the worker thread; call
    them through ``submit``.

    Args:
        model: a folder (or hub id) of a transformers causal LM.
        precision: one of ``PRECISIONS``.
        device: where the model runs (``None``: CUDA if available, else CPU).
        checkpoint_dir: where ``save_state`` and named sampler weights go (one folder per API key).
        max_lora_rank: the largest LoRA rank a client may ask for.
        replicas: a ``tinker.replicas.Replicas`` (data parallelism over N processes; under fsdp2 it shards the base
            here), or ``None``: one process.
    """

    def __init__(self, model: str, precision: str = "32-true", device: str | None = None,
                 checkpoint_dir: str = "tinker_checkpoints", max_lora_rank: int = 64,
                 replicas: Any = None):  # fmt: skip
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.name, self.checkpoint_dir, self.max_lora_rank = model, checkpoint_dir, max_lora_rank
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.precision, self.plugin, self.replicas = precision, precision_plugin(precision, self.device), replicas
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        if replicas is not None:  # under fsdp2 the frozen base is sharded here, before any adapter
            self.model = replicas.setup(self.model)
        self.base, self.sharded = self.model, is_sharded(self.model)  # the plain model (peft wraps self.model)
        if self.sharded:  # FSDP2 takes its root from the first forward: run one through the root on every rank
            self.logprobs([IDLE], grad=False)
            reshard(self.base)
        self.vocab = self.model.get_output_embeddings().weight.shape[0]
        self.layers = linear_layers(self.model)
        self.models: dict[str, TrainedModel] = {}
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="tinker-engine")
        self.lock = threading.Lock()  # guards self.models between the HTTP threads and the worker

    def submit(self, fn: Callable, *args: Any) -> Future:
        """Queue ``fn(*args)`` on the worker; with replicas, an operation of ``REPLICATED`` runs on every rank
        (a new training client's seed is drawn here first, so every replica draws the same adapter)."""
        name = getattr(fn, "__name__", "")
        if self.replicas is None or getattr(fn, "__self__", None) is not self or name not in REPLICATED:
            return self.worker.submit(fn, *args)
        if name == "run_create" and args[1] is None:
            args = (args[0], int.from_bytes(os.urandom(4), "little"))
        message = tuple(Ref(a.model_id) if isinstance(a, TrainedModel) and a.model_id in self.models else a
                        for a in args)  # fmt: skip
        return self.worker.submit(self.replicas.lead, self, name, args, message)

    # ------------------------------------------------------------------ adapters
    def add_adapter(self, name: str, lora: Lora, seed: int | None) -> None:
        """Add a LoRA adapter ``name`` (B = 0, so it starts as the base model); A is drawn with ``seed``."""
        from peft import LoraConfig, PeftModel, get_peft_model

        if not 1 <= lora.rank <= self.max_lora_rank:
            raise BadRequest(f"lora_config.rank {lora.rank}: this server takes ranks 1 to {self.max_lora_rank}")
        config = LoraConfig(r=lora.rank, lora_alpha=32, lora_dropout=0.0,
                            target_modules=target_modules(self.layers, lora))  # fmt: skip
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
            if isinstance(self.model, PeftModel):
                self.model.add_adapter(name, config)
            else:
                self.model = get_peft_model(self.model, config, adapter_name=name)
        if not self.sharded:  # peft put the adapter beside its base layer; sharded, ``to`` would reshard the base
            self.model.to(self.device)
        self.model.eval()
        for parameter in self.adapter_params(name):  # fp32 master weights under bf16-true (AdamW steps below an ulp)
            parameter.data = parameter.data.float()

    def whole_base(self):
        """A context in which rank 0 runs forwards on its own (sampling): under fsdp2 every rank first gathers the
        whole base (``Replicas.whole_base``); otherwise nothing to do."""
        return self.replicas.whole_base(self.base) if self.sharded else contextlib.nullcontext()

    def use(self, adapter: str | None) -> None:
        """Make ``adapter`` the active one (``None``: the base model, every adapter off)."""
        if adapter is not None:
            self.model.set_adapter(adapter)

    def adapter_params(self, adapter: str) -> list[torch.nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if f".{adapter}." in n]

    def adapter_state(self, adapter: str) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.model, adapter_name=adapter, save_embedding_layers=False)
        return {k: v.detach().clone().contiguous() for k, v in state.items()}

    def load_adapter_state(self, adapter: str, state: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.model, state, adapter_name=adapter)
        if getattr(result, "unexpected_keys", None):
            raise BadRequest(f"the checkpoint does not fit this adapter ({len(result.unexpected_keys)} extra tensors)")

    def run_release(self, model_ids: list[str]) -> None:
        """Delete the adapters (and their optimizer state) of ``model_ids`` (a finished session's)."""
        for model_id in model_ids:
            with self.lock:
                entry = self.models.pop(model_id, None)
            if entry is not None:
                self.model.delete_adapter(entry.adapter)

    # ------------------------------------------------------------------ training
    def run_create(self, entry: TrainedModel, seed: int | None) -> dict:
        self.add_adapter(entry.adapter, entry.lora, seed)
        entry.precision = self.plugin if self.precision != "16-mixed" else precision_plugin("16-mixed", self.device)
        with self.lock:
            self.models[entry.model_id] = entry
        return {"model_id": entry.model_id}

    def logits(self, ids: torch.Tensor, mask: torch.Tensor, grad: bool) -> torch.Tensor:
        """(N, L, V) float32 logits of a padded batch, through the precision plugin's forward."""
        with torch.set_grad_enabled(grad), self.plugin.forward_context():
            out = as_forward(self.base, self.model, input_ids=ids.to(self.device),
                             attention_mask=mask.to(self.device), use_cache=False)  # fmt: skip
            return out.logits.float()

    def logprobs(self, data: list, grad: bool) -> list[torch.Tensor]:
        """Log-probabilities of each datum's ``target_tokens`` after each of its tokens (one padded batch)."""
        longest = max(len(d.tokens) for d in data)
        ids = torch.zeros(len(data), longest, dtype=torch.long)
        targets, mask = torch.zeros_like(ids), torch.zeros_like(ids)
        for i, d in enumerate(data):
            n = len(d.tokens)
            ids[i, :n], targets[i, :n], mask[i, :n] = torch.tensor(d.tokens), d.inputs["target_tokens"], 1
        with torch.set_grad_enabled(grad):
            logprobs = selective_log_softmax(self.logits(ids, mask, grad), targets.to(self.device))
        return [logprobs[i, : len(d.tokens)] for i, d in enumerate(data)]

    def run_forward_backward(self, entry: TrainedModel, request: FwdBwd) -> tuple[list[dict], dict]:
        """With replicas, this rank's share of the datums (``Replicas.shard``); outputs gathered in order. Under
        fsdp2 every rank runs the forward (and backward) of every request, whose layers gather the sharded base: a
        rank without a share runs one token with zero weight, and the base goes back to its shards afterwards on
        every rank alike (a root left gathered on one rank only would skip an all-gather the others make)."""
        self.use(entry.adapter)
        loss_fn = TINKER_LOSSES[request.loss_fn]
        data = self.replicas.shard(request.data) if self.replicas is not None else request.data
        logprobs = self.logprobs(data, grad=not request.forward_only) if data else []
        if self.sharded and not data:
            idle = self.logprobs([IDLE], grad=not request.forward_only)[0]
            if not request.forward_only:
                entry.precision.backward(idle.sum() * 0.0, self.model)
        total, outputs = torch.zeros((), device=self.device), []
        for d, lp in zip(data, logprobs):
            inputs = {k: v.to(self.device) for k, v in d.inputs.items()}
            elementwise = loss_fn(lp, inputs, request.config)
            total = total + elementwise.sum()
            outputs.append({"logprobs": lp.detach().float().cpu().numpy(),
                            "elementwise_loss": elementwise.detach().float().cpu().numpy()})  # fmt: skip
        if data and not request.forward_only:
            entry.precision.backward(total, self.model)
        if self.sharded:
            reshard(self.base)
        loss = float(total.detach())
        if self.replicas is not None:
            outputs, loss = self.replicas.gather(outputs, loss)
        return outputs, {"loss:sum": loss}

    def run_optim_step(self, entry: TrainedModel, adam: dict) -> dict:
        params = self.adapter_params(entry.adapter)
        if entry.optimizer is None:
            entry.optimizer = torch.optim.AdamW(params, lr=adam["learning_rate"])
        group = entry.optimizer.param_groups[0]
        group.update(lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]), eps=adam["eps"],
                     weight_decay=adam["weight_decay"])  # fmt: skip
        if self.replicas is not None:
            self.replicas.reduce_gradients(params)
        with_grad = [p for p in params if p.grad is not None]
        norm = torch.tensor(0.0)
        if with_grad:  # AdamW skips parameters without gradients: no gradient at all is no step
            entry.precision.unscale_gradients(entry.optimizer)
            clip = adam["grad_clip_norm"] if adam["grad_clip_norm"] > 0 else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(with_grad, clip)
            entry.precision.optimizer_step(entry.optimizer)
        entry.optimizer.zero_grad(set_to_none=True)
        entry.step += 1
        return {"metrics": {"grad_norm:mean": float(norm), "step:max": float(entry.step)}}

    # ------------------------------------------------------------------ checkpoints
    def folder(self, owner: str, run: str, kind: str, name: str) -> str:
        return os.path.join(self.checkpoint_dir, owner, run.replace(":", "_"), kind, name)

    def run_save(self, entry: TrainedModel, name: str, kind: str, with_optimizer: bool,
                 ttl_seconds: int | None = None) -> str:  # fmt: skip
        """Write the adapter (and AdamW state) to ``tinker://RUN/KIND/NAME``; past ``ttl_seconds`` (``None``: never)
        the checkpoint is deleted (``expired``)."""
        from safetensors.torch import save_file

        path = self.folder(entry.owner, entry.model_id, kind, name)
        os.makedirs(path, exist_ok=True)
        save_file(self.adapter_state(entry.adapter), os.path.join(path, ADAPTER_FILE))
        if with_optimizer and entry.optimizer is not None:
            torch.save(entry.optimizer.state_dict(), os.path.join(path, OPTIMIZER_FILE))
        meta = {"base_model": self.name, "lora": entry.lora.__dict__, "step": entry.step, "model_id": entry.model_id,
                "expires_at": None if ttl_seconds is None else time.time() + ttl_seconds}  # fmt: skip
        with open(os.path.join(path, META_FILE), "w") as handle:
            json.dump(meta, handle)
        return f"tinker://{entry.model_id}/{kind}/{name}"

    def resolve(self, owner: str, path: str) -> str:
        """The folder of a ``tinker://RUN/KIND/NAME`` path saved under ``owner``'s key (a clear error otherwise)."""
        parts = path[len("tinker://") :].split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or ".." in parts:
            raise BadRequest(f"path {path!r}: expected tinker://RUN/weights/NAME or tinker://RUN/sampler_weights/NAME")
        folder = self.folder(owner, *parts)
        if not os.path.isfile(os.path.join(folder, META_FILE)):
            raise BadRequest(f"path {path!r}: no such checkpoint for this API key")
        if self.expired(folder):
            shutil.rmtree(folder, ignore_errors=True)
            raise BadRequest(f"path {path!r}: the checkpoint expired (its ttl_seconds ran out) and was deleted")
        return folder

    @staticmethod
    def expired(folder: str) -> bool:
        with open(os.path.join(folder, META_FILE)) as handle:
            expires_at = json.load(handle).get("expires_at")
        return expires_at is not None and time.time() >= expires_at

    def read_checkpoint(self, folder: str) -> tuple[dict, dict[str, torch.Tensor]]:
        from safetensors.torch import load_file

        with open(os.path.join(folder, META_FILE)) as handle:
            meta = json.load(handle)
        return meta, load_file(os.path.join(folder, ADAPTER_FILE), device=str(self.device))

    def run_load(self, entry: TrainedModel, folder: str, with_optimizer: bool, create: bool) -> dict:
        meta, state = self.read_checkpoint(folder)
        if create:
            entry.lora = Lora(**meta["lora"])
            self.run_create(entry, 0)
        elif Lora(**meta["lora"]) != entry.lora:
            raise BadRequest(f"the checkpoint's LoRA {meta['lora']} differs from this training client's")
        self.load_adapter_state(entry.adapter, state)
        entry.optimizer, entry.step = None, int(meta.get("step", 0))
        optimizer_file = os.path.join(folder, OPTIMIZER_FILE)
        if with_optimizer and os.path.isfile(optimizer_file):
            entry.optimizer = torch.optim.AdamW(self.adapter_params(entry.adapter))
            entry.optimizer.load_state_dict(torch.load(optimizer_file, map_location=self.device, weights_only=True))
        for p in self.adapter_params(entry.adapter):
            p.grad = None
        return {"model_id": entry.model_id}
