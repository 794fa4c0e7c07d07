"""PPO for language models (Schulman et al. 2017; Ziegler et al. 2019; Stiennon et al. 2020) as a
LightningModule under ``Trainer.fit``: one ``training_step`` is one PPO iteration on a prompt batch.

Manual optimisation: an iteration makes ``ppo_epochs * batch / (mini_batch_size * gradient_accumulation_steps)``
optimizer steps, and Lightning's ``global_step`` counts each of them (bound the run with ``max_epochs`` over
the prompts, or set ``max_steps`` in optimizer steps).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Union

import torch

from aitraining_pl.losses import (
    entropy_from_logits,
    explained_variance,
    gae,
    masked_mean,
    masked_whiten,
    ppo_policy_loss,
    ppo_value_loss,
    selective_log_softmax,
)
from aitraining_pl.models import LoRAConfig, PPOModel, is_peft_model
from aitraining_pl.modules.base import AlignmentModule
from aitraining_pl.optim import adamw_with_warmup
from aitraining_pl.rewards import build_reward_source, score_responses
from aitraining_pl.rollout import (
    GenerationConfig,
    decode_responses,
    position_ids_from_mask,
    response_mask,
    sample_responses,
    stop_string_ends,
    token_rewards,
)


def _primitive(value: Any) -> bool:
    """Whether ``value`` is made of str/int/float/bool/None, lists and str-keyed dicts only."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_primitive(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _primitive(v) for k, v in value.items())
    return False


@dataclass
class Experience:
    """One rollout batch with everything the PPO update needs; per-token tensors are (B, R)."""

    input_ids: torch.Tensor  #: (B, P + R) prompt and response
    attention_mask: torch.Tensor  #: (B, P + R)
    prompt_length: int  #: P
    mask: torch.Tensor  #: response mask
    logprobs: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor


class PPOModule(AlignmentModule):
    """PPO with a value head on the policy, a frozen reference and a reward source.

    Hyperparameter names and defaults follow the seed's ``PPOConfig``; the prompt batch size is the data
    module's ``batch_size``.

    Args:
        model_name: policy as a local folder or hub id.
        model_config: policy as an inline config dict (random init), instead of ``model_name``.
        tokenizer_name: tokenizer (default: ``model_name``; ``"byte"`` for the byte-level tokenizer).
        lora: LoRA adapters on the policy (the reference is then the policy with adapters disabled).
        reward: reward source: an import path ``"pkg.module:function"``, a reward-model folder,
            ``{"class_path", "init_args"}`` or ``{"components": {name: {"source", "weight", "kwargs"}}}``
            (see ``aitraining_pl.rewards``); in Python also any callable
            ``(prompts, responses, metadata) -> list[float]``.
        generation: sampling settings (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop_strings``).
        learning_rate: AdamW learning rate (linear warmup by ``warmup_ratio``, then linear decay).
        mini_batch_size: rollouts per forward/backward pass in the update.
        gradient_accumulation_steps: minibatches per optimizer step.
        ppo_epochs: passes over each rollout batch.
        gamma: discount factor of GAE.
        lam: lambda of GAE.
        clip_ratio: PPO policy clip range epsilon.
        value_clip: clip range of value predictions around the old values.
        max_grad_norm: gradient clipping by global norm (0 = off).
        kl_penalty_coef: initial coefficient of the per-token KL penalty (``AdaptiveKLCallback`` adapts it).
        kl_estimator: per-token KL estimator ``k1`` or ``k3`` (Schulman 2020).
        entropy_coef: weight of the entropy bonus.
        value_coef: weight of the value loss.
        missing_eos_penalty: subtracted from the score of responses that end without EOS or stop string.
        warmup_ratio: share of optimizer steps with linear warmup.
        seed: weight-initialisation seed of an inline ``model_config`` and of the minibatch order.
        dtype: dtype the models are loaded in (default: the checkpoint's).
        disable_dropout: set every dropout rate to 0 (policy, value head, reference, reward model), as TRL
            does: training forwards are then deterministic.
        gradient_checkpointing: recompute activations in backward instead of storing them (less memory, about a
            third more compute); works on the packed path.
    """

    def __init__(
        self,
        model_name: Optional[str] = None,
        model_config: Optional[dict[str, Any]] = None,
        tokenizer_name: Optional[str] = None,
        lora: Optional[LoRAConfig] = None,
        reward: Union[str, dict[str, Any], Callable, None] = "aitraining_pl.rewards:char_fraction_reward",
        generation: GenerationConfig = GenerationConfig(),
        learning_rate: float = 1e-5,
        mini_batch_size: int = 4,
        gradient_accumulation_steps: int = 1,
        ppo_epochs: int = 4,
        gamma: float = 0.99,
        lam: float = 0.95,
        clip_ratio: float = 0.2,
        value_clip: float = 0.2,
        max_grad_norm: float = 1.0,
        kl_penalty_coef: float = 0.01,
        kl_estimator: str = "k1",
        entropy_coef: float = 0.01,
        value_coef: float = 0.5,
        missing_eos_penalty: Optional[float] = None,
        warmup_ratio: float = 0.0,
        seed: int = 0,
        dtype: Optional[str] = None,
        disable_dropout: bool = True,
        gradient_checkpointing: bool = False,
    ):
        super().__init__()
        self.automatic_optimization = False
        self.strict_loading = False  # the frozen reference and the reward model are never saved
        # a reward given as a Python object (not YAML-describable primitives) is not saved with the hyperparameters
        self.save_hyperparameters(ignore=["lora", "generation"] + ([] if _primitive(reward) else ["reward"]))
        self.store_lora_hparam(lora)
        self.generation = generation if isinstance(generation, GenerationConfig) else GenerationConfig(**dict(generation))
        self.hparams["generation"] = asdict(self.generation)
        policy, self.reference = self.load_policy_from_hparams(with_reference=True)
        self.model = PPOModel(policy)
        self._reward_source = [build_reward_source(reward)]  # in a list: never a submodule, never saved
        self.kl_coef = float(kl_penalty_coef)
        self.last_kl = 0.0  #: batch-mean KL(pi || ref) per response (nats, summed over tokens), for the KL callback
        self.last_num_samples = 0  #: responses behind ``last_kl`` (all ranks)
        self.apply_training_options(self.reference.model, getattr(self.reward_source, "model", self.reward_source))

    @property
    def reward_source(self) -> Callable:
        """The reward source (protocol in ``aitraining_pl.rewards``)."""
        return self._reward_source[0]

    @property
    def policy(self) -> torch.nn.Module:
        """The language model being trained (peft model under LoRA); exported by ``save_pretrained``."""
        return self.model.base_model

    # ------------------------------------------------------------------ setup
    def on_fit_start(self) -> None:
        dtype = next(self.model.parameters()).dtype
        self.reference.to(self.device, dtype)
        if hasattr(self.reward_source, "to"):
            self.reward_source.to(self.device)

    def updates_per_iteration(self, batch_size: int) -> int:
        """Optimizer steps made by one PPO iteration on ``batch_size`` prompts."""
        hp = self.hparams
        per_step = hp.mini_batch_size * hp.gradient_accumulation_steps
        if batch_size % per_step:
            raise ValueError(
                f"the prompt batch size ({batch_size}) must be a multiple of mini_batch_size * "
                f"gradient_accumulation_steps ({hp.mini_batch_size} * {hp.gradient_accumulation_steps})"
            )
        return hp.ppo_epochs * batch_size // per_step

    def configure_optimizers(self):
        trainer = self.trainer
        if trainer.max_steps and trainer.max_steps > 0:
            total = trainer.max_steps  # already counted in optimizer steps
        else:  # estimated_stepping_batches counts training batches, i.e. PPO iterations
            iterations = trainer.estimated_stepping_batches
            batch_size = getattr(trainer.datamodule, "hparams", {}).get("batch_size")
            batch_size = batch_size or getattr(trainer.train_dataloader, "batch_size", None)
            per_step = self.hparams.mini_batch_size * self.hparams.gradient_accumulation_steps
            total = iterations * self.updates_per_iteration(batch_size or per_step)
        return adamw_with_warmup(
            self.trainable_parameters(), learning_rate=self.hparams.learning_rate, total_steps=total,
            warmup_ratio=self.hparams.warmup_ratio,
        )

    # ------------------------------------------------------------------ rollout and scoring
    def _generation_context(self):
        """Full parameters for ``generate`` under FSDP (``summon_full_params``); nothing otherwise."""
        from lightning.pytorch.strategies import FSDPStrategy

        if self._trainer is not None and isinstance(self.trainer.strategy, FSDPStrategy):
            from torch.distributed.fsdp import FullyShardedDataParallel

            return FullyShardedDataParallel.summon_full_params(self.trainer.strategy.model, writeback=False)
        return contextlib.nullcontext()

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, config: Optional[GenerationConfig] = None):
        """Sample responses for left-padded prompts: ``(response_ids (B, R), mask (B, R), ended (B,))``."""
        config = config or self.generation
        tok = self.tokenizer
        sharded = self._generation_context()
        was_training = self.model.training
        self.model.eval()
        try:
            with sharded:
                response = sample_responses(
                    self.policy, prompt_ids, prompt_mask, config, eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id, tokenizer=tok,
                    synced_gpus=not isinstance(sharded, contextlib.nullcontext),
                )
        finally:
            self.model.train(was_training)
        stops = stop_string_ends(tok, response, config.stop_strings) if config.stop_strings else None
        mask, ended = response_mask(response, tok.eos_token_id, stops)
        return response, mask, ended

    def score(self, prompts: list[str], responses: list[str], metadata: list[dict], ended: torch.Tensor):
        """Scores (B,) from the reward source, minus ``missing_eos_penalty`` where a response did not end;
        and the source's per-component scores."""
        scores, components = score_responses(self.reward_source, prompts, responses, metadata)
        scores = torch.tensor(scores, dtype=torch.float32, device=ended.device)
        if self.hparams.missing_eos_penalty is not None:
            scores = scores - self.hparams.missing_eos_penalty * (~ended).float()
        return scores, components

    def forward(self, input_ids, attention_mask, prompt_length: int):
        """Response logits (temperature-scaled, (B, R, V)) and values (B, R) of the policy."""
        out = self.model(input_ids, attention_mask, position_ids_from_mask(attention_mask))
        logits = out.logits[:, prompt_length - 1 : -1].float() / self.generation.temperature
        return logits, out.values[:, prompt_length - 1 : -1]

    @torch.no_grad()
    def old_and_reference(self, input_ids, attention_mask, prompt_length: int):
        """Log-probs and values of the policy (eval mode) and reference log-probs of the sampled responses,
        (B, R) each, computed ``mini_batch_size`` rows at a time (bounds the (rows, R, V) logits)."""
        was_training = self.model.training
        self.model.eval()
        parts = []
        try:
            for rows in torch.split(torch.arange(input_ids.shape[0], device=input_ids.device), self.hparams.mini_batch_size):
                ids, mask = input_ids[rows], attention_mask[rows]
                logits, values = self(ids, mask, prompt_length)
                logprobs = selective_log_softmax(logits, ids[:, prompt_length:])
                del logits
                parts.append((logprobs, values, self.reference_logprobs(ids, mask, prompt_length)))
        finally:
            self.model.train(was_training)
        return tuple(torch.cat(p) for p in zip(*parts))

    @torch.no_grad()
    def reference_logprobs(self, input_ids, attention_mask, prompt_length: int) -> torch.Tensor:
        logits = self.reference(input_ids, attention_mask, position_ids=position_ids_from_mask(attention_mask))
        logits = logits[:, prompt_length - 1 : -1].float() / self.generation.temperature
        return selective_log_softmax(logits, input_ids[:, prompt_length:])

    # ------------------------------------------------------------------ one PPO iteration
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        hp = self.hparams
        prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
        P = prompt_ids.shape[1]
        # 1. rollout: sample responses; the mask ends at the first EOS (or stop string)
        response, mask, ended = self.generate(prompt_ids, prompt_mask)
        texts = decode_responses(self.tokenizer, response, mask)
        input_ids = torch.cat([prompt_ids, response], dim=1)
        attention_mask = torch.cat([prompt_mask, mask.to(prompt_mask.dtype)], dim=1)
        # 2. score with the reward source (errors, wrong lengths and NaNs stop the run)
        scores, components = self.score(batch["prompts"], texts, batch["metadata"], ended)
        # 3. old log-probs and values of the policy, log-probs of the reference
        with torch.no_grad():
            old_logprobs, old_values, ref_logprobs = self.old_and_reference(input_ids, attention_mask, P)
            # 4. per-token rewards: -kl_coef * KL_t, plus the score on the last response token
            rewards, kl = token_rewards(scores, old_logprobs, ref_logprobs, mask, self.kl_coef, hp.kl_estimator)
            # 5. GAE, whitened advantages
            advantages, returns = gae(rewards, old_values, mask, hp.gamma, hp.lam)
            advantages = masked_whiten(advantages, mask)
        experience = Experience(input_ids, attention_mask, P, mask, old_logprobs, old_values, advantages, returns)
        # 6. ppo_epochs passes over shuffled minibatches
        stats = self.ppo_update(experience)
        # 7. log (one all-reduce of a fixed-size vector, never of ragged tensors)
        stats.update(
            reward_mean=scores.mean(), reward_sq=(scores**2).mean(), kl=kl.sum(1).mean(),
            response_length=mask.sum(1).float().mean(), ended=ended.float().mean(),
            explained_variance=explained_variance(old_values, returns, mask),
            **{f"reward/{k}": torch.tensor(v, dtype=torch.float32).mean() for k, v in sorted(components.items())},
        )
        self.log_iteration(stats, n=prompt_ids.shape[0])

    def minibatch_loss(self, exp: Experience, idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """PPO loss on rollouts ``idx``: clipped policy loss + ``value_coef`` * clipped value loss -
        ``entropy_coef`` * entropy."""
        hp = self.hparams
        mask = exp.mask[idx]
        logits, values = self(exp.input_ids[idx], exp.attention_mask[idx], exp.prompt_length)
        logprobs = selective_log_softmax(logits, exp.input_ids[idx, exp.prompt_length :])
        policy_loss, stats = ppo_policy_loss(logprobs, exp.logprobs[idx], exp.advantages[idx], mask, hp.clip_ratio)
        value_loss = ppo_value_loss(values, exp.values[idx], exp.returns[idx], mask, hp.value_clip)
        entropy = masked_mean(entropy_from_logits(logits), mask)
        loss = policy_loss + hp.value_coef * value_loss - hp.entropy_coef * entropy
        return loss, {
            "loss": loss.detach(), "policy_loss": policy_loss.detach(), "value_loss": value_loss.detach(),
            "entropy": entropy.detach(), "clipfrac": stats["clipfrac"], "approx_kl": stats["approx_kl"],
        }

    def ppo_update(self, exp: Experience) -> dict[str, torch.Tensor]:
        """``ppo_epochs`` passes over shuffled minibatches with gradient accumulation and clipping; every
        rank makes the same number of (synchronised) optimizer steps. Returns the minibatch-mean stats."""
        hp = self.hparams
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        n, accum = exp.input_ids.shape[0], hp.gradient_accumulation_steps
        self.updates_per_iteration(n)  # validates the batch split
        generator = torch.Generator().manual_seed(hp.seed * 1_000_003 + self.global_step)
        history: list[dict[str, torch.Tensor]] = []
        for _ in range(hp.ppo_epochs):
            order = torch.randperm(n, generator=generator).to(exp.input_ids.device)
            for i, start in enumerate(range(0, n, hp.mini_batch_size)):
                last_micro = (i + 1) % accum == 0
                with optimizer.toggle_model(sync_grad=last_micro):
                    loss, stats = self.minibatch_loss(exp, order[start : start + hp.mini_batch_size])
                    self.manual_backward(loss / accum)
                history.append(stats)
                if last_micro:
                    if hp.max_grad_norm:
                        self.clip_gradients(optimizer, gradient_clip_val=hp.max_grad_norm, gradient_clip_algorithm="norm")
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    scheduler.step()
        self.update_history = history  # per-minibatch stats of the last iteration (tests, debugging)
        return {k: torch.stack([h[k] for h in history]).mean() for k in history[0]}

    def log_iteration(self, stats: dict[str, torch.Tensor], n: int) -> None:
        """Average the iteration's stats over ranks in one all-reduce and log them as ``train/<name>``."""
        names = list(stats)
        vector = torch.stack([stats[k].detach().float().to(self.device) for k in names])
        if self.trainer.world_size > 1:
            vector = self.trainer.strategy.reduce(vector, reduce_op="mean")
        values = dict(zip(names, vector))
        values["reward_std"] = (values.pop("reward_sq") - values["reward_mean"] ** 2).clamp_min(0).sqrt()
        self.last_kl = float(values["kl"])
        self.last_num_samples = n * self.trainer.world_size
        values["kl_coef"] = torch.tensor(self.kl_coef, device=self.device)
        values["lr"] = torch.tensor(self.lr_schedulers().get_last_lr()[0], device=self.device)
        self.log_metrics("train", values, batch_size=n, prog_bar=("reward_mean", "kl"))

    # ------------------------------------------------------------------ validation: held-out reward
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        response, mask, ended = self.generate(batch["input_ids"], batch["attention_mask"])
        texts = decode_responses(self.tokenizer, response, mask)
        scores, _ = self.score(batch["prompts"], texts, batch["metadata"], ended)
        self.log_metrics("val", {"reward_mean": scores, "response_length": mask.sum(1).float()}, batch_size=len(texts))

    # ------------------------------------------------------------------ checkpoints and export
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["ppo_kl_coef"] = self.kl_coef

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.kl_coef = float(checkpoint.get("ppo_kl_coef", self.kl_coef))

    def save_pretrained(self, path: str | os.PathLike, merge_lora: bool = False) -> None:
        """The policy and tokenizer as a Hugging Face folder, with the value head beside them
        (``value_head.safetensors``)."""
        from safetensors.torch import save_file

        super().save_pretrained(path, merge_lora=merge_lora)
        state = {k: v.detach().cpu().contiguous() for k, v in self.model.value_head.state_dict().items()}
        save_file(state, os.path.join(str(path), "value_head.safetensors"))

    @property
    def uses_lora(self) -> bool:
        return is_peft_model(self.policy)
