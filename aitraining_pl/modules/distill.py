"""On-policy distillation (GKD, Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes", https://arxiv.org/abs/2306.13649): a student LM samples completions of the prompt data, a
teacher LM scores them, and the student moves toward the teacher on its own samples.

Two modes, one module on the online-RL base (``CriticFreeModule``: the rollout engine and its generation backends,
multi-turn episodes, the reward sources, the update loop over minibatches, the policy loss and its options):

- ``mode: full`` (GKD): the loss is the generalized JSD of ``losses.fused_distillation_loss`` (``beta``: 0 forward
  KL(teacher || student), 1 reverse KL(student || teacher), TRL's convention) between the two next-token
  distributions at ``temperature``, over the full vocabulary, on every response token; a share ``lmbda`` of the
  batches is sampled by the student, the rest are the data's own completions (a ``completion`` column). Both heads run
  fused, chunk by chunk: no (tokens, vocabulary) tensor of either model is kept.
- ``mode: sampled`` (on-policy distillation with a per-token reward, the form of Tinker / Thinking Machines 2025 and
  NeMo-RL): the reward of each sampled token is ``r_t = kl_coef * (log p_teacher(y_t) - log p_student(y_t))`` plus the
  task reward (``reward``; weighted components as ``reward: {components: ...}``) on the last token, optimised with the
  online policy loss and every option of ``CriticFreeModule``. The design that reuses most: that reward is exactly the
  online modules' k1 KL penalty in the reward (``kl_in_reward``, ``losses.token_rewards``) with the *teacher*'s
  log-probs in the reference's part (``reference_logprobs``), so the advantage estimators, episodes (per-turn rewards,
  response masks with holes), vLLM rollouts (the sampler correction) and the KL metric (``train/kl``: the reverse KL to
  the teacher per response) apply unchanged. Any online module (``PPOModule``, ``GRPOModule`` with ``kl_in_reward:
  true``, ``RLOOModule``) distils the same way once its ``reference`` is the teacher (``use_teacher``).

The teacher is scored through a small interface, ``TeacherScorer`` (``token_logprobs``: the teacher's log-probs of given
token sequences; ``modules.teacher``), an object the module holds; ``LocalTeacher`` is the teacher in this process (its
hidden states and head also give the full distribution). A served teacher (``teacher_server: {url: ...}``:
``servers.teacher.HTTPTeacher``, the prompt log-probs of a ``vllm serve --model <teacher>`` through its
``/v1/completions``, or of the HF server with ``--teacher``) implements ``token_logprobs`` only, enough for
``mode: sampled``. The teacher is
held outside the module tree: checkpoints and exports never contain it. Its log-probs are checked before use, and
its tokenizer (not its embedding's rows) is compared with the student's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from aitraining_pl.errors import ConfigError
from aitraining_pl.losses import fused_distillation_loss, masked_mean
from aitraining_pl.losses.advantages import CriticFreeAdvantage
from aitraining_pl.losses.policy_gradient import LossAggregation
from aitraining_pl.models import ReferencePolicy, load_tokenizer
from aitraining_pl.models.lm_head import head_parameters, logit_postprocessing
from aitraining_pl.models.loading import hidden_size_of, load_causal_lm
from aitraining_pl.models.lora import base_model
from aitraining_pl.models.tokens import padded
from aitraining_pl.models.training import eval_mode
from aitraining_pl.models.vision import load_processor, load_vision_lm, vision_source
from aitraining_pl.modules.critic_free import CriticFreeModule
from aitraining_pl.modules.teacher import (
    LocalTeacher,
    TeacherScorer,
    check_teacher_server,
    check_vocabularies,
    checked_logprobs,
    response_hidden,
    served_teacher,
    teacher_rows,
)
from aitraining_pl.rollout.batch import Rollout, RolloutBatch
from aitraining_pl.validation import FRACTION, OneOf, Range, check_arguments, fixed, rules, save_hparams

#: the reward source of a run without a task reward: every response scores 0 (only the teacher trains the student)
NO_TASK_REWARD = "aitraining_pl.modules.distill:no_task_reward"
DistillationMode = Literal["full", "sampled"]


def no_task_reward(prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]:
    """0 for every response: distillation without a task reward."""
    return [0.0] * len(responses)


def head_of(model: torch.nn.Module, owner: str) -> tuple[torch.Tensor, torch.Tensor | None, tuple]:
    """``(weight, bias, (scale, softcap))`` of the model's LM head (``models.lm_head``); a ``ConfigError`` for a head
    the fused loss cannot run (not a linear layer, or logits scaled in a way ``logit_postprocessing`` does not know)."""
    lm = base_model(model)
    params, post = head_parameters(lm.get_output_embeddings()), logit_postprocessing(lm.config)
    if params is None or post is None:
        why = "its LM head is not a plain (LoRA) linear layer with known logit post-processing"
        raise ConfigError(owner, f"{type(lm).__name__}: {why}, which the full distribution needs; use mode: sampled")
    return params[0], params[1], post


def use_teacher(module: Any, teacher: torch.nn.Module) -> LocalTeacher:
    """Make ``teacher`` the reference of an online module (``PPOModule``, ``GRPOModule``, ``RLOOModule``): with the
    KL in the reward (k1, ``kl_in_reward``; PPO's default) each sampled token's reward becomes ``kl_coef * (log
    p_teacher - log p_student)``, i.e. sampled-token distillation, combined with the module's task reward. (The
    ``DistillationModule`` holds its teacher itself, apart from the reference's slot.)"""
    teacher.eval().requires_grad_(False)
    module.reference = ReferencePolicy(teacher, build_reference=lambda: teacher)
    return module.reference


@dataclass
class DistillationExperience:
    """One batch of the full-distribution mode; per-token tensors are (N, R)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_length: int
    mask: torch.Tensor  #: response tokens in the loss (the sampled ones; holes where an environment spoke)
    teacher_hidden: torch.Tensor  #: (N, R, H_T) the teacher's hidden states on the masked tokens, 0 elsewhere
    advantages: torch.Tensor  #: zeros (the completion log of ``CompletionLogCallback`` reads them)
    vision: Any = None  #: each row's images (``models.vision.VisionInputs``) for a VL student and teacher


class DistillationModule(CriticFreeModule):
    """On-policy distillation of ``teacher_model_name`` into the student ``model_name`` (see the module docstring).

    Metrics: ``train/loss`` and ``val/loss`` (the generalized JSD at ``beta`` per response token; ``val/`` on the
    student's samples of held-out prompts), ``forward_kl`` and ``reverse_kl`` (per token, to the teacher),
    ``teacher_logprob`` (the teacher's mean log-prob of the student's tokens), ``agreement`` (share of tokens where
    both argmax tokens agree), ``reward_mean`` (the task reward, when one is given). The other arguments are
    ``CriticFreeModule``'s (``model_name``, ``generation``, ``learning_rate``, ``mini_batch_size``, ``policy_loss``,
    ...); its ``kl_in_reward`` is always on here.

    Args:
        teacher_model_name: the teacher as a local folder or hub id; it must share the student's tokenizer.
        teacher_model_config: the teacher as an inline config dict (random init; tests), instead of a name.
        teacher_server: a served teacher instead of one in this process (``mode: sampled`` and
            ``generation.temperature`` 1 only): ``{url, timeout, token_file}`` of a server that speaks the engine's
            HTTP routes, a ``vllm serve --model <teacher>`` or the HF server with ``--teacher`` (defaults
            ``http://127.0.0.1:8000``, 240 s, the token as for ``generation.vllm.server_token_file``; docs/
            distillation.md); ``{launch: vllm | hf, devices, timeout}``: a server of ``teacher_model_name`` the
            trainer starts (each scoring process its own, on GPUs ``devices``) and stops. Otherwise
            ``teacher_model_name``, if given, only checks the tokenizer.
        mode: ``full`` (the generalized JSD over the full vocabulary, GKD) or ``sampled`` (per-token reward
            ``log p_teacher - log p_student`` of the sampled tokens, optimised with the online policy loss).
        beta: the generalized JSD's interpolation (TRL's ``beta``, not DPO's): 0 forward KL(teacher || student),
            1 reverse KL(student || teacher), 0.5 the symmetric JSD. ``full`` mode.
        lmbda: GKD's share of on-policy batches (sampled by the student); the others train on the data's own
            completions (a ``completion`` column). ``full`` mode; ``sampled`` needs 1.
        temperature: both distributions are softmax(logits / ``temperature``) in the loss (default: the sampling
            temperature ``generation.temperature``, as TRL's one ``temperature``).
        reward: an optional task reward source (as ``CriticFreeModule``'s); in ``sampled`` mode added to the teacher's
            per-token reward, else only logged (``reward_mean``).
        kl_coef: weight of the teacher's per-token reward ``log p_teacher - log p_student`` (``sampled`` mode: the
            weight of KL(student || teacher), the teacher's log-probs in the reference's part).
        advantage: the advantage estimator of ``sampled`` mode (default ``reinforce_pp``: per-token returns).
        num_generations: samples per prompt.
        loss_aggregation: how ``sampled`` mode averages the policy loss (default ``token``).
    """

    argument_ranges = {
        **CriticFreeModule.argument_ranges,
        **rules(
            beta=FRACTION,
            lmbda=FRACTION,
            temperature=Range(0, low_open=True, optional=True),
            mode=OneOf(fixed("full", "sampled")),
        ),
    }

    def __init__(
        self,
        teacher_model_name: str | None = None,
        teacher_model_config: dict[str, Any] | None = None,
        teacher_server: dict[str, Any] | None = None,
        mode: DistillationMode = "full",
        beta: float = 1.0,
        lmbda: float = 1.0,
        temperature: float | None = None,
        reward: Any = None,
        kl_coef: float = 1.0,
        advantage: CriticFreeAdvantage = "reinforce_pp",
        num_generations: int = 1,
        loss_aggregation: LossAggregation = "token",
        **kwargs: Any,
    ):
        own = dict(teacher_model_name=teacher_model_name, teacher_model_config=teacher_model_config, mode=mode)
        own.update(teacher_server=teacher_server, beta=beta, lmbda=lmbda, temperature=temperature)
        check_arguments(type(self).argument_ranges, own, type(self).__name__)  # before any model loads
        if teacher_server is not None:
            check_teacher_server(teacher_server, mode)
        elif (teacher_model_name is None) == (teacher_model_config is None):
            raise ConfigError("DistillationModule.teacher_model_name", "give the teacher: a name or a model config")
        if kwargs.pop("kl_in_reward", True) is not True:  # stored in the hyperparameters: back on a reload
            raise ConfigError("DistillationModule.kl_in_reward", "always on: the teacher's term is a per-token reward")
        if mode == "sampled" and lmbda != 1.0:
            raise ConfigError("DistillationModule.lmbda", "sampled mode trains on the student's own samples: lmbda 1")
        super().__init__(
            reward=NO_TASK_REWARD if reward is None else reward,
            kl_coef=kl_coef,
            kl_in_reward=True,
            advantage=advantage,
            num_generations=num_generations,
            loss_aggregation=loss_aggregation,
            **kwargs,
        )
        if teacher_server is not None and float(self.generation.temperature) != 1.0:
            raise ConfigError(
                "DistillationModule.teacher_server",
                f"a served teacher's log-probs are at temperature 1 (vLLM's prompt log-probs are of the raw logits), "
                f"so the student samples at generation.temperature 1, not {self.generation.temperature:g}",
            )
        save_hparams(self, {**self.hparams, **own})  # the base's hyperparameters and this class's, in one store
        self._teacher = [self.build_teacher()]  # in a list: never a submodule, never saved
        self.check_tokenizers()

    # ------------------------------------------------------------------ setup
    def load_policy_from_hparams(self, *, with_reference: bool):
        """The student, with no reference (the teacher is held apart: ``build_teacher``)."""
        return super().load_policy_from_hparams(with_reference=False)

    @property
    def has_reference(self) -> bool:
        """The teacher's log-probs take the reference's part in the sampled mode's reward (``reference_logprobs``)."""
        return True

    def build_teacher(self) -> LocalTeacher | TeacherScorer:
        """The teacher of ``teacher_server`` (``served_teacher``) or of ``teacher_model_name`` /
        ``teacher_model_config`` (a ``LocalTeacher``, without dropout when ``disable_dropout``)."""
        hp = self.hparams
        server = hp.get("teacher_server")
        if server is not None:
            return served_teacher(dict(server), hp.teacher_model_name)
        trust = bool(hp.trust_remote_code)
        vision = vision_source(hp.teacher_model_name, hp.teacher_model_config, trust)
        teacher = (load_vision_lm if vision else load_causal_lm)(  # a VL teacher scores with the prompts' images
            hp.teacher_model_name,
            hp.teacher_model_config,
            dtype=hp.dtype,
            attn_implementation=hp.attn_implementation,
            trust_remote_code=trust,
            seed=int(hp.seed) + 1,
        )
        self.apply_training_options(teacher)
        return LocalTeacher(teacher)

    @property
    def teacher(self) -> LocalTeacher | TeacherScorer:
        """The teacher (``TeacherScorer``), held outside the module tree."""
        return self._teacher[0]

    @property
    def teacher_name(self) -> str:
        """The teacher as messages name it: its server, or its model."""
        teacher = self.teacher
        if hasattr(teacher, "address"):
            return f"DistillationModule.teacher_server ({teacher.kind} {teacher.address})"
        return f"DistillationModule teacher {self.hparams.teacher_model_name or '(teacher_model_config)'}"

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.teacher.to(self.device, self.frozen_dtype())

    def teardown(self, stage: str) -> None:
        """The base's, and a served teacher's connections closed (a launched teacher server stopped)."""
        super().teardown(stage)
        close = getattr(self.teacher, "close", None)
        if close is not None:
            close()

    def sharded_networks(self) -> list[torch.nn.Module]:
        """The student's and, in this process, the teacher (its own FSDP root)."""
        model = getattr(self.teacher, "model", None)
        return super().sharded_networks() + ([model] if model is not None else [])

    @property
    def loss_temperature(self) -> float:
        return float(self.hparams.temperature or self.generation.temperature)

    def check_tokenizers(self) -> None:
        """One ``ConfigError`` before training when the teacher cannot score the student's tokens: another tokenizer
        (``teacher_model_name``'s, compared with the student's), or fewer vocabulary rows than the student's
        tokenizer has tokens (``modules.teacher.check_vocabularies``; a checkpoint's padding rows are allowed)."""
        name, trust = self.hparams.teacher_model_name, bool(self.hparams.trust_remote_code)
        if name and getattr(self.teacher, "sees_images", False):  # a VL teacher: its processor's tokenizer
            theirs = load_processor(name, trust_remote_code=trust).tokenizer
        else:
            theirs = load_tokenizer(name, trust_remote_code=trust) if name else None
        where = "DistillationModule.teacher_model_name"
        check_vocabularies(self.tokenizer, theirs, teacher_rows(self.teacher), where)

    # ------------------------------------------------------------------ rollouts: the student's, or the data's
    def own_rollout(self, batch: dict[str, Any], samples: int) -> RolloutBatch | None:
        """The student's samples (None) in a share ``lmbda`` of the training batches (drawn per step, the same on
        every rank), else the data's own completions (``full`` mode)."""
        draw = torch.rand((), generator=torch.Generator().manual_seed(int(self.hparams.seed) * 7919 + self.global_step))
        if self.training and float(draw) >= float(self.hparams.lmbda):
            return self.data_rollout(batch, samples)
        return None

    def data_rollout(self, batch: dict[str, Any], samples: int) -> RolloutBatch:
        """The data's completions (``metadata["completion"]``, tokenised, ended by EOS, at most ``max_new_tokens``)
        as a rollout of ``samples`` identical rows per prompt, scored by the reward source."""
        tokenizer, limit = self.tokenizer, self.generation.max_new_tokens
        texts = [(m or {}).get("completion") for m in batch["metadata"]]
        if any(not isinstance(t, str) for t in texts):
            raise ConfigError("DistillationModule.lmbda", "lmbda < 1 trains on the data's completions: the prompt "
                              "data needs a 'completion' column (or set lmbda: 1)")  # fmt: skip
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        ids = [(tokenizer(t, add_special_tokens=False)["input_ids"] + eos)[:limit] for t in texts]
        device = batch["input_ids"].device
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        response, mask = padded(ids, pad, width=1, device=device)
        ended = torch.tensor([bool(i) and i[-1] in eos for i in ids], device=device)
        group = torch.arange(len(ids), device=device).repeat_interleave(samples)
        rollout = Rollout(
            batch["input_ids"][group], batch["attention_mask"][group], response[group], mask[group], ended[group],
            [texts[g] for g in group.tolist()], group,
        )  # fmt: skip
        scores, components = self.score(batch["prompts"], batch["metadata"], rollout)
        return RolloutBatch.from_rollout(rollout, scores, components)

    # ------------------------------------------------------------------ the teacher's scores
    @torch.no_grad()
    def reference_logprobs(self, input_ids, attention_mask, prompt_length: int, vision: Any = None) -> torch.Tensor:
        """(N, R) the teacher's log-probs at the sampling temperature, through the ``TeacherScorer``, checked
        (``modules.teacher.checked_logprobs``: one value per response token, finite, at most 0). ``vision`` (a VL
        student's images) goes to a VL teacher (``check_sees_images``)."""
        self.check_sees_images(vision)
        images = {} if vision is None else {"vision": vision}
        scores = self.teacher.token_logprobs(input_ids, attention_mask, prompt_length, self.generation.temperature,
                                             **images)  # fmt: skip
        return checked_logprobs(scores, input_ids, attention_mask, prompt_length, self.teacher_name)

    def check_sees_images(self, vision: Any) -> None:
        """A ``ConfigError`` when rows with images (``vision``) would be scored by a teacher that cannot see them (a
        text model, or a served teacher): its scores would be of the text alone."""
        if vision is not None and not getattr(self.teacher, "sees_images", False):
            raise ConfigError("DistillationModule.teacher_model_name", "the prompts carry images but the teacher is "
                              "a text model (or served): give a vision-language teacher in this process")  # fmt: skip

    def divergence(self, ids, attention, prompt_length, mask, teacher_hidden, grad: bool = True, vision: Any = None):
        """``fused_distillation_loss`` of the student on rows ``ids`` (token mean over ``mask``) against the teacher's
        hidden states (M, H_T) at the same tokens; ``vision``: the rows' images (a VL student)."""
        student = response_hidden(self.policy, ids, attention, prompt_length, mask, vision)
        weight, bias, post = head_of(self.policy, "DistillationModule.model_name")
        t_weight, t_bias, t_post = head_of(self.teacher.model, "DistillationModule.teacher_model_name")
        shared = min(weight.shape[0], t_weight.shape[0])  # rows past the tokenizer: a checkpoint's padding
        if weight.shape[0] != t_weight.shape[0]:  # (check_tokenizers): the distributions over the rows both have
            weight, bias = weight[:shared], None if bias is None else bias[:shared]
            t_weight, t_bias = t_weight[:shared], None if t_bias is None else t_bias[:shared]
        targets = ids[:, prompt_length:][mask.bool()]
        weights = torch.full(targets.shape, 1.0 / max(1, targets.numel()), device=ids.device)
        return fused_distillation_loss(
            student, weight, teacher_hidden.to(t_weight.dtype), t_weight, weights,
            beta=float(self.hparams.beta), temperature=self.loss_temperature, targets=targets,
            student_bias=bias, teacher_bias=t_bias, student_post=post, teacher_post=t_post,
        )  # fmt: skip

    @staticmethod
    def distribution_stats(stats) -> dict[str, torch.Tensor]:
        """Token means of the per-token statistics (``losses.DistillationStats``)."""
        return {
            "forward_kl": stats.forward_kl.mean(),
            "reverse_kl": stats.reverse_kl.mean(),
            "teacher_logprob": stats.teacher_logps.mean(),
            "agreement": stats.agreement.mean(),
        }

    # ------------------------------------------------------------------ one iteration (steps in OnlineRLModule)
    def make_experience(self, rollout: RolloutBatch):
        """``sampled``: ``CriticFreeModule``'s (the teacher's log-probs as the reference's, k1 in the reward) and the
        teacher's log-prob and the reverse KL of the sampled tokens. ``full``: the teacher's hidden states."""
        if self.hparams.mode == "sampled":
            old, teacher = self.frozen_passes(rollout)
            experience, stats = self.experience(rollout, old, teacher)
            stats.update(
                teacher_logprob=masked_mean(teacher, rollout.mask), reverse_kl=masked_mean(old - teacher, rollout.mask)
            )
            return experience, stats
        ids, attention, P, mask = rollout.input_ids, rollout.attention_mask, rollout.prompt_length, rollout.mask
        self.check_sees_images(rollout.vision)
        hidden = ids.new_zeros(*mask.shape, hidden_size_of(self.teacher.model), dtype=torch.float32)
        for rows in self.row_chunks(len(ids), attention):
            images = self.vision_rows(rollout.vision, rows)
            values = self.teacher.hidden(ids[rows], attention[rows], P, mask[rows], images).float()
            hidden[rows] = hidden[rows].index_put(torch.nonzero(mask[rows], as_tuple=True), values)
        advantages = torch.zeros(mask.shape, device=ids.device)
        return DistillationExperience(ids, attention, P, mask, hidden, advantages, rollout.vision), {}

    def share_aggregation(self) -> str:
        """``full``: the divergence is a token mean; ``sampled``: ``loss_aggregation`` (``token_budget``)."""
        return super().share_aggregation() if self.hparams.mode == "sampled" else "token"

    def minibatch_loss(self, exp, idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``full``: the generalized JSD (token mean) on rows ``idx``; ``sampled``: the online policy loss."""
        if self.hparams.mode == "sampled":
            return super().minibatch_loss(exp, idx)
        mask = exp.mask[idx]
        out = self.divergence(
            exp.input_ids[idx], exp.attention_mask[idx], exp.prompt_length, mask, exp.teacher_hidden[idx][mask.bool()],
            vision=self.vision_rows(exp.vision, idx),
        )  # fmt: skip
        return out.loss, {"loss": out.loss.detach(), **self.distribution_stats(out.stats)}

    # ------------------------------------------------------------------ validation: divergence on held-out prompts
    @torch.no_grad()
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        rollout = self.rollout(batch, 1)  # the student's samples (not training: never the data's)
        ids, attention, P, mask = rollout.input_ids, rollout.attention_mask, rollout.prompt_length, rollout.mask
        self.check_sees_images(rollout.vision)
        teacher = self.teacher.hidden(ids, attention, P, mask, rollout.vision)
        with eval_mode(self.policy):
            out = self.divergence(ids, attention, P, mask, teacher, vision=rollout.vision)
        tokens = max(1, int(mask.sum()))
        self.log_metrics("val", {"loss": out.stats.divergence.mean(), **self.distribution_stats(out.stats)}, tokens)
        lengths = mask.sum(1).float()
        self.log_metrics("val", {"reward_mean": rollout.scores, "completion_length": lengths}, len(rollout.texts))
