"""PPO for language models (Schulman et al. 2017; Ziegler et al. 2019; Stiennon et al. 2020) as a
LightningModule under ``Trainer.fit``: one ``training_step`` is one PPO iteration on a prompt batch. The
rollout, scoring, update loop and logging are the online-RL family's (``modules/online.py``); PPO adds the
critic (a value head on the policy), per-token KL-penalised rewards and GAE.

Manual optimisation: an iteration makes ``num_iterations * batch / (mini_batch_size * gradient_accumulation_steps)``
optimizer steps, and Lightning's ``global_step`` counts each of them (bound the run with ``max_epochs`` over
the prompts, or set ``max_steps`` in optimizer steps).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from aitraining_pl.errors import ConfigError
from aitraining_pl.losses import (
    PolicyLossConfig,
    explained_variance,
    masked_mean,
    ppo_value_loss,
    token_rewards,
    whitened_gae,
)
from aitraining_pl.losses.rl import KLEstimator
from aitraining_pl.models import LoRAConfig, PolicyValueScores, PPOModel
from aitraining_pl.models.quantization import QuantizationConfig
from aitraining_pl.models.training import eval_mode
from aitraining_pl.modules.online import ONLINE_RANGES, OnlineRLModule, RolloutBatch
from aitraining_pl.optim import LRSchedule
from aitraining_pl.rollout import GenerationConfig
from aitraining_pl.validation import constructor_arguments, renamed, rules


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
    is_weights: torch.Tensor | None = None  #: truncated importance weights of a vLLM rollout (``sampler_correction``)
    vision: Any = None  #: each row's images (``models.vision.VisionInputs``) for a VL policy
    routes: torch.Tensor | None = None  #: (B, P + R, layers, k) an MoE sampler's routes, replayed (``routed``)


class PPOModule(OnlineRLModule):
    """PPO with a value head on the policy, a frozen reference and a reward source.

    Hyperparameter names and defaults follow the seed's ``PPOConfig``; the prompt batch size is the data
    module's ``batch_size``. A vision-language policy trains on prompts with images (``docs/vlm.md``): the value head
    reads its language model's hidden states from the pass that runs with the pixel values.

    Args:
        model_name: policy as a local folder or hub id.
        model_config: policy as an inline config dict (random init), instead of ``model_name``.
        tokenizer_name: tokenizer (default: ``model_name``; ``"byte"`` for the byte-level tokenizer).
        lora: LoRA adapters on the policy (``LoRAConfig``; the reference is then
            the policy with adapters disabled).
        reward: required: the reward source: an import path ``"pkg.module:function"``, a reward-model folder,
            ``{"class_path", "init_args"}`` or ``{"components": {name: {"source", "weight", "kwargs"}}}``
            (see ``aitraining_pl.rewards``); in Python also any callable
            ``(prompts, responses, metadata) -> list[float]``.
        generation: sampling settings (``max_new_tokens``, ``temperature``, ``top_p`` (default 1.0), ``top_k``,
            ``stop_strings``), used as given: the checkpoint's ``generation_config`` never applies. Responses end
            at the tokenizer's EOS, any of the model's ``generation_config.eos_token_id`` or a stop string
            (``aitraining_pl.rollout``).
        learning_rate: peak AdamW learning rate (warmup by ``warmup_ratio``, then ``lr_schedule``).
        mini_batch_size: rollouts per forward/backward pass in the update.
        gradient_accumulation_steps: minibatches per optimizer step.
        token_budget: real tokens per forward/backward pass in the update (TRL's AsyncGRPO name; verl's
            ``ppo_max_token_len_per_gpu``): each minibatch of ``mini_batch_size`` rows is split into balanced
            micro-batches within it with the minibatch's loss and gradients (docs/
            long_context.md); a longer row is an error. ``null``: one pass per minibatch.
        balance_ranks: under data parallelism, deal each step's prompt groups to the ranks by their real tokens
            after sampling (verl's ``balance_batch``: Karmarkar-Karp, as many groups on every rank), so that no
            rank's update waits on another's longer rows; the rows move with ``all_to_all`` (docs/long_context.md).
            Not for multi-turn episodes, per-row images or sequence parallelism.
        num_iterations: passes over each rollout batch (TRL's ``num_ppo_epochs``; the seed's ``ppo_epochs``).
        gamma: discount factor of GAE.
        lam: lambda of GAE.
        epsilon: clip range of the policy ratio (``1 - epsilon``; TRL's ``cliprange``, the seed's ``clip_ratio``).
        epsilon_high: upper clip range (``1 + epsilon_high``; default ``epsilon``).
        policy_loss: options of the policy loss (``PolicyLossConfig``, as for ``GRPOModule``): ``loss_type``
            (``clip`` or CISPO's ``cispo``), ``delta`` (two-sided clip), ``top_entropy_quantile`` and
            ``mask_truncated_completions`` (truncated responses leave the policy, value and entropy terms);
            ``importance_sampling_level`` stays ``token`` (GAE gives per-token advantages) and
            ``use_bias_correction_kl`` off (PPO's KL is in the reward).
        value_clip: clip range of value predictions around the old values.
        max_grad_norm: gradient clipping by global norm (0 = off).
        kl_coef: (initial) coefficient of the per-token KL penalty (``AdaptiveKLCallback`` adapts it); TRL's
            ``kl_coef``, the seed's ``kl_penalty_coef``.
        kl_estimator: per-token KL estimator ``k1``, ``k2`` or ``k3`` (Schulman 2020).
        entropy_coef: weight of the entropy bonus.
        value_coef: weight of the value loss.
        missing_eos_penalty: subtracted from the score of responses that end without EOS or stop string.
        reward_timeout: seconds one call of the reward source may take; a call that does not return by then
            stops the run with a ``RewardError`` naming the source (``None``: no limit).
        warmup_ratio: share of optimizer steps with linear warmup.
        lr_schedule: decay after warmup: ``linear``, ``cosine`` or ``constant``.
        weight_decay: AdamW weight decay.
        trust_remote_code: allow custom model code from the hub (off by default).
        attn_implementation: attention kernel passed to transformers (``sdpa``, ``eager``, ``flash_attention_2``;
            default: transformers' choice, SDPA where supported).
        seed: weight-initialisation seed of an inline ``model_config`` and of the minibatch order.
        dtype: dtype the models are loaded in (default: the checkpoint's).
        disable_dropout: set every dropout rate to 0 (policy, value head, reference, reward model), as TRL
            does: training forwards are then deterministic.
        gradient_checkpointing: recompute activations in backward instead of storing them (less memory, about a
            third more compute); works on the packed path.
        freeze_vision_tower: a vision-language policy's vision encoder gets no gradients (its projector into the
            language model still trains, unless it sits inside the encoder, as Qwen VL's merger does); no effect
            on a text model.
        quantization: load the policy's base weights in 4 bits (QLoRA through bitsandbytes, ``QuantizationConfig``:
            ``{load_in_4bit: true, quant_type: nf4, compute_dtype: bfloat16}``); needs ``lora``. The reference is
            the same 4-bit base with the adapters off.
        kl_penalty_coef: deprecated spelling of ``kl_coef`` (accepted with a warning until the next release).
        ppo_epochs: deprecated spelling of ``num_iterations``.
        clip_ratio: deprecated spelling of ``epsilon``.
    """

    argument_ranges = {
        **ONLINE_RANGES,
        **rules(
            "gamma", "lam", "value_clip", "value_coef", "kl_estimator", "kl_penalty_coef", "ppo_epochs", "clip_ratio"
        ),
    }

    def __init__(
        self,
        model_name: str | None = None,
        model_config: dict[str, Any] | None = None,
        tokenizer_name: str | None = None,
        lora: LoRAConfig | None = None,
        reward: str | dict[str, Any] | Callable | None = None,
        generation: GenerationConfig = GenerationConfig(),
        learning_rate: float = 1e-5,
        mini_batch_size: int = 4,
        gradient_accumulation_steps: int = 1,
        token_budget: int | None = None,
        balance_ranks: bool = False,
        num_iterations: int = 4,
        gamma: float = 0.99,
        lam: float = 0.95,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        policy_loss: PolicyLossConfig = PolicyLossConfig(),
        value_clip: float = 0.2,
        max_grad_norm: float = 1.0,
        kl_coef: float = 0.01,
        kl_estimator: KLEstimator = "k1",
        entropy_coef: float = 0.01,
        value_coef: float = 0.5,
        missing_eos_penalty: float | None = None,
        reward_timeout: float | None = 600.0,
        warmup_ratio: float = 0.0,
        lr_schedule: LRSchedule = "linear",
        weight_decay: float = 0.0,
        seed: int = 0,
        dtype: str | None = None,
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
        disable_dropout: bool = True,
        gradient_checkpointing: bool = False,
        freeze_vision_tower: bool = True,
        quantization: QuantizationConfig | None = None,
        kl_penalty_coef: float | None = None,
        ppo_epochs: int | None = None,
        clip_ratio: float | None = None,
    ):
        super().__init__()
        owner = type(self).__name__
        kl_coef = renamed(owner, "kl_coef", kl_coef, 0.01, kl_penalty_coef=kl_penalty_coef)
        num_iterations = renamed(owner, "num_iterations", num_iterations, 4, ppo_epochs=ppo_epochs)
        epsilon = renamed(owner, "epsilon", epsilon, 0.2, clip_ratio=clip_ratio)
        self.setup_online(constructor_arguments(PPOModule.__init__, locals()), sequence_level=False)
        if self.policy_loss.use_bias_correction_kl:  # the KL is in PPO's reward, not in its loss
            raise ConfigError(f"{owner}.policy_loss.use_bias_correction_kl", "PPO's KL is in the reward, not the loss")
        policy, self.reference = self.load_policy_from_hparams(with_reference=True)
        self.model = PPOModel(policy)
        self.apply_training_options(self.reference.model, getattr(self.reward_source, "model", self.reward_source))

    @property
    def policy(self) -> torch.nn.Module:
        """The language model being trained (peft model under LoRA); exported by ``save_pretrained``."""
        return self.model.base_model

    def sharded_networks(self) -> list[torch.nn.Module]:
        """The policy, the frozen reference, the value head and a separate critic trunk if there is one."""
        critic = [self.model.critic] if self.model.critic is not None else []
        return [*super().sharded_networks(), self.model.value_head, *critic]

    # ------------------------------------------------------------------ forward passes
    def forward(
        self, input_ids, attention_mask, prompt_length: int, with_entropy: bool = False, vision: Any = None
    ) -> PolicyValueScores:
        """Response log-probs (temperature-scaled), entropies (``with_entropy``) and values, (B, R) each, from one
        decoder pass with the fused LM head (``PPOModel.score``: no (B, R, V) logits); ``vision``: the rows' images
        (a VL policy: the value head on its language model's hidden states)."""
        return self.scores(input_ids, attention_mask, prompt_length, with_entropy, vision)[0]

    def scores(self, input_ids, attention_mask, prompt_length: int, with_entropy: bool = False, vision: Any = None,
               routes: torch.Tensor | None = None) -> tuple[PolicyValueScores, dict[str, torch.Tensor]]:  # fmt: skip
        """``forward`` with an MoE policy's routing statistics: the sampler's ``routes`` replayed, the router's
        auxiliary loss (``OnlineRLModule.routed``)."""
        temperature = self.generation.temperature
        score = lambda free: self.model.score(  # noqa: E731
            input_ids, attention_mask, prompt_length, temperature, with_entropy, free, vision=vision
        )
        return self.routed(score, attention_mask, routes)

    @torch.no_grad()
    def old_and_reference(self, input_ids, attention_mask, prompt_length: int, vision: Any = None, routes=None):
        """Log-probs and values of the policy (eval mode) and reference log-probs of the sampled responses,
        (B, R) each, computed a run of rows at a time (``row_chunks``; with their images, ``vision``, for a VL
        policy; an MoE sampler's ``routes`` replayed by the policy)."""

        def rows(r: torch.Tensor):
            ids, mask, images = input_ids[r], attention_mask[r], self.vision_rows(vision, r)
            with eval_mode(self.model):
                scores, _ = self.scores(ids, mask, prompt_length, vision=images, routes=_rows(routes, r))
            return scores.logprobs, scores.values, self.reference_logprobs(ids, mask, prompt_length, images)

        return tuple(torch.cat(p) for p in zip(*self.in_minibatches(rows, input_ids.shape[0], attention_mask)))

    # ------------------------------------------------------------------ one PPO iteration (steps in OnlineRLModule)
    def make_experience(self, rollout: RolloutBatch) -> tuple[Experience, dict[str, torch.Tensor]]:
        """Old log-probs and values, reference log-probs, per-token KL-penalised rewards, whitened GAE."""
        hp, mask, P = self.hparams, rollout.mask, rollout.prompt_length
        old_logprobs, old_values, ref_logprobs = self.old_and_reference(
            rollout.input_ids, rollout.attention_mask, P, rollout.vision, rollout.routes
        )
        # per-token rewards: -kl_coef * KL_t, plus the score on the last response token
        rewards, kl = token_rewards(
            rollout.scores, old_logprobs, ref_logprobs, mask, self.kl_coef, hp.kl_estimator, rollout.token_scores
        )
        advantages, returns = whitened_gae(rewards, old_values, mask, hp.gamma, hp.lam)
        weights, stats = self.sampler_correction(old_logprobs, rollout.sampling_logprobs, mask)
        loss_mask = self.loss_mask(mask, rollout.ended)  # mask_truncated_completions
        experience = Experience(
            rollout.input_ids,
            rollout.attention_mask,
            P,
            loss_mask,
            old_logprobs,
            old_values,
            advantages,
            returns,
            weights,
            rollout.vision,
            rollout.routes,
        )
        stats.update(kl=kl.sum(1).mean(), explained_variance=explained_variance(old_values, returns, mask))
        return experience, stats

    def minibatch_loss(self, exp: Experience, idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """PPO loss on rollouts ``idx``: clipped policy loss + ``value_coef`` * clipped value loss -
        ``entropy_coef`` * entropy."""
        hp = self.hparams
        mask = exp.mask[idx]
        images = self.vision_rows(exp.vision, idx)
        out, routing = self.scores(exp.input_ids[idx], exp.attention_mask[idx], exp.prompt_length, True, images,
                                   _rows(exp.routes, idx))  # fmt: skip
        is_weights = exp.is_weights[idx] if exp.is_weights is not None else None
        policy_loss, stats = self.policy_gradient_loss(
            out.logprobs, out.entropy, exp.logprobs[idx], exp.advantages[idx], mask, "token", None, is_weights
        )
        value_loss = ppo_value_loss(out.values, exp.values[idx], exp.returns[idx], mask, hp.value_clip)
        entropy = masked_mean(out.entropy, mask)
        loss = policy_loss + hp.value_coef * value_loss - hp.entropy_coef * entropy
        return loss, {  # an MoE config's router auxiliary loss, ``routing/aux_loss``: added by ``minibatch_backward``
            **routing,
            "loss": loss.detach(),
            "policy_loss": policy_loss.detach(),
            "value_loss": value_loss.detach(),
            "entropy": entropy.detach(),
            **stats,
        }

    # ------------------------------------------------------------------ export
    def save_pretrained(self, path: str | os.PathLike, merge_lora: bool = False) -> None:
        """The policy and tokenizer as a Hugging Face folder, with the value head beside them
        (``value_head.safetensors``)."""
        from safetensors.torch import save_file

        super().save_pretrained(path, merge_lora=merge_lora)
        state = {k: v.detach().cpu().contiguous() for k, v in self.model.value_head.state_dict().items()}
        save_file(state, os.path.join(str(path), "value_head.safetensors"))


def _rows(routes: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if routes is None else routes[rows]
