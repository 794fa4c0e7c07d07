"""``RemotePipeline``: ``ForwardBackwardPipeline``'s calls (``forward_backward``, ``forward``, ``optim_step``,
``sample``, ``save_state``, ``load_state``) against a Tinker-compatible server (``aitraining-pl tinker-serve``, or any
server the ``tinker`` client speaks to), training a LoRA adapter there; ``AsyncTrainingClient.connect`` wraps it, so a
loop written for the seed's client runs unchanged against a server.

The pipeline's conventions are kept: a loss is the MEAN over the batch's label tokens (labels ``-100`` and padding
do not count) divided by ``gradient_accumulation_steps``, and an optimizer step applies once that many micro-batches
are in. Tinker sums per-token losses, so each token's weight (``cross_entropy``) or advantage (``importance_sampling``,
``ppo``) is sent divided by the batch's label-token count and by ``gradient_accumulation_steps``; PPO's clipped
minimum is unchanged by that positive scaling. ``ppo``'s value loss needs the model's value head and is not served.
``optim_step`` takes the learning rate, betas, eps and weight decay of ``optimizer.param_groups[0]`` (a torch
optimizer, or a dict of those keys) and ``max_grad_norm``; the AdamW step itself runs on the server."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from aitraining_pl.compat.forward_backward.losses import align
from aitraining_pl.compat.forward_backward.pipeline import ForwardBackwardResult, ForwardResult, OptimStepResult

SERVED = ("cross_entropy", "importance_sampling", "ppo")


class RemotePipeline:
    """Args:
    base_url: the server (``http://127.0.0.1:8000``). api_key: a ``tml-`` key it accepts.
    base_model: the model it serves. rank: LoRA rank. seed: LoRA init seed.
    gradient_accumulation_steps: micro-batches per optimizer step.
    """

    def __init__(self, base_url: str, api_key: str, base_model: str, rank: int = 16, seed: int | None = None,
                 gradient_accumulation_steps: int = 1):  # fmt: skip
        import tinker

        self.service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
        self.client = self.service.create_lora_training_client(base_model=base_model, rank=rank, seed=seed).result()
        self.gradient_accumulation_steps, self.step, self._micro_batches = gradient_accumulation_steps, 0, 0
        self.device, self.model = torch.device("cpu"), None  # the model is on the server

    def _datums(self, input_ids, attention_mask, labels, fields: dict[str, torch.Tensor]):
        from tinker import types

        ids = torch.as_tensor(input_ids).long()
        ids = ids[None] if ids.dim() == 1 else ids
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask).long()
        mask = mask[None] if mask.dim() == 1 else mask
        target = ids if labels is None else torch.as_tensor(labels).long().reshape(ids.shape)
        label_mask = ((target[:, 1:] != -100) & (mask[:, 1:] > 0)).float()
        scale = 1.0 / max(float(label_mask.sum()), 1.0) / self.gradient_accumulation_steps
        datums = []
        for b in range(ids.shape[0]):
            n = int(mask[b].sum())
            inputs = {"target_tokens": target[b, 1:n].clamp(min=0)}
            for name, value in fields.items():
                inputs[name] = value[b, : n - 1] * (label_mask[b, : n - 1] if name in ("weights", "advantages") else 1)
                if name in ("weights", "advantages"):
                    inputs[name] = inputs[name] * scale
            datums.append(types.Datum(model_input=types.ModelInput.from_ints(ids[b, : n - 1].tolist()),
                                      loss_fn_inputs=inputs))  # fmt: skip
        return datums, label_mask

    def _fields(self, loss_fn: str, shape_of: torch.Tensor, kwargs: dict) -> tuple[dict, dict]:
        like = torch.zeros(shape_of.shape[0], shape_of.shape[1] - 1)
        if loss_fn == "cross_entropy":
            return {"weights": torch.ones_like(like)}, {}
        if loss_fn not in SERVED or (loss_fn == "ppo" and kwargs.get("returns") is not None):
            raise ValueError(f"loss_fn {loss_fn!r} is not served remotely (served: {', '.join(SERVED)}; no value loss)")
        old = kwargs.get("old_logprobs" if loss_fn == "importance_sampling" else "old_log_probs")
        if old is None or kwargs.get("advantages") is None:
            raise ValueError(f"loss_fn {loss_fn!r} needs old log-probs and advantages")
        fields = {"logprobs": align(old, like, "old_logprobs"), "advantages": align(kwargs["advantages"], like, "adv")}
        clip = float(kwargs.get("clip_ratio", 0.2))
        config = {"clip_low_threshold": 1 - clip, "clip_high_threshold": 1 + clip} if loss_fn == "ppo" else {}
        return fields, config

    def forward_backward(
        self,
        input_ids: Any,
        attention_mask: Any = None,
        labels: Any = None,
        loss_fn: str = "cross_entropy",
        **loss_kwargs: Any,
    ) -> Future[ForwardBackwardResult]:
        ids = torch.as_tensor(input_ids)
        fields, config = self._fields(loss_fn, ids[None] if ids.dim() == 1 else ids, loss_kwargs)
        datums, label_mask = self._datums(input_ids, attention_mask, labels, fields)
        remote = self.client.forward_backward(datums, loss_fn, config or None)
        self._micro_batches += 1
        return _then(remote, lambda out: ForwardBackwardResult(
            out.metrics["loss:sum"] * self.gradient_accumulation_steps, {}, int(label_mask.sum()),
            _padded(out, label_mask)))  # fmt: skip

    def forward(self, input_ids: Any, attention_mask: Any = None, labels: Any = None, return_logits: bool = False,
                model: Any = None) -> Future[ForwardResult]:  # fmt: skip
        if return_logits or model is not None:
            raise ValueError("a remote forward returns log-probs only (no logits, no other model)")
        datums, label_mask = self._datums(input_ids, attention_mask, labels, {})
        remote = self.client.forward(datums, "cross_entropy")
        return _then(remote, lambda out: _forward_result(_padded(out, label_mask), label_mask))

    def optim_step(self, optimizer: Any = None, scheduler: Any = None, max_grad_norm: float | None = 1.0,
                   force: bool = False) -> Future[OptimStepResult]:  # fmt: skip
        from tinker import types

        count = self._micro_batches
        if count == 0 or (count < self.gradient_accumulation_steps and not force):
            done: Future = Future()
            done.set_result(OptimStepResult(False, self.step, count))
            return done
        group = optimizer.param_groups[0] if hasattr(optimizer, "param_groups") else dict(optimizer or {})
        betas = group.get("betas", (0.9, 0.999))
        adam = types.AdamParams(learning_rate=group.get("lr", 1e-4), beta1=betas[0], beta2=betas[1],
                                eps=group.get("eps", 1e-8), weight_decay=group.get("weight_decay", 0.0),
                                grad_clip_norm=float(max_grad_norm or 0.0))  # fmt: skip
        self._micro_batches, self.step = 0, self.step + 1
        step = self.step
        return _then(self.client.optim_step(adam), lambda out: OptimStepResult(
            True, step, count, float((out.metrics or {}).get("grad_norm:mean", 0.0)), adam.learning_rate))  # fmt: skip

    def sample(self, prompt: Any, max_tokens: int = 100, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, stop: Any = None, seed: int | None = None) -> dict[str, Any]:  # fmt: skip
        from tinker import types

        ids = torch.as_tensor(prompt).reshape(-1).tolist()
        sampler = self.client.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k or -1, top_p=top_p,
                                      seed=seed, stop=[int(s) for s in stop] if stop else None)  # fmt: skip
        seq = sampler.sample(types.ModelInput.from_ints(ids), 1, params).result().sequences[0]
        return {"tokens": list(seq.tokens), "logprobs": list(seq.logprobs or []), "prompt": ids,
                "stop_reason": seq.stop_reason}  # fmt: skip

    def save_state(self, name: str, **_: Any) -> dict[str, str]:
        return {"path": self.client.save_state(name).result().path}

    def load_state(self, path: str, **_: Any) -> dict[str, Any]:
        self.client = self.service.create_training_client_from_state_with_optimizer(path).result()
        return {"path": path}

    def shutdown(self, wait: bool = True) -> None:
        self.service.close("success").result()


def _then(remote: Any, convert) -> Future:
    """A ``concurrent.futures.Future`` of ``convert(remote.result())``."""
    future: Future = Future()
    remote.future().add_done_callback(
        lambda done: future.set_exception(done.exception()) if done.exception() else future.set_result(
            convert(done.result())))  # fmt: skip
    return future


def _padded(out: Any, label_mask: torch.Tensor) -> torch.Tensor:
    logprobs = torch.zeros_like(label_mask)
    for b, record in enumerate(out.loss_fn_outputs):
        values = record["logprobs"].to_torch().float()
        logprobs[b, : values.numel()] = values
    return logprobs


def _forward_result(logprobs: torch.Tensor, mask: torch.Tensor) -> ForwardResult:
    loss = -float((logprobs * mask).sum() / mask.sum().clamp(min=1))
    return ForwardResult(logprobs, mask, loss)
