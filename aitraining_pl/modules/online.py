"""The shared base of the online RL modules (PPO, GRPO, RLOO, REINFORCE++): rollout, scoring, the update loop
over minibatches, metrics reduced across ranks, held-out reward and checkpoint state.

One ``training_step`` is one iteration on a prompt batch:

1. rollout: ``num_generations`` responses per prompt (rows ``i*G .. i*G+G-1`` answer prompt ``i``, so each
   prompt's group stays on the rank that drew the prompt);
2. score them with the reward source;
3. ``make_experience`` (the subclass): old / reference log-probs, values, advantages;
4. ``num_iterations`` passes over shuffled minibatches of ``minibatch_loss`` (the subclass), with gradient
   accumulation and clipping; every rank makes the same number of optimizer steps (its row count is fixed);
5. log the stats, averaged over ranks in one all-reduce of a fixed-size vector (extrema in one more).

Manual optimisation: Lightning's ``global_step`` counts optimizer steps.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch

from aitraining_pl.environments.episode import is_episode_environment
from aitraining_pl.environments.episode_rollout import sample_episodes
from aitraining_pl.errors import ConfigError
from aitraining_pl.generation.backend import GenerationBackend
from aitraining_pl.generation.config import check_server
from aitraining_pl.losses import group_statistics, off_policy_log_ratio, off_policy_weights
from aitraining_pl.models.rollout_scoring import ResponseScores, response_logps
from aitraining_pl.models.routing_replay import replaying, router_aux_loss
from aitraining_pl.models.scoring import scoring_path
from aitraining_pl.models.sequence_parallel import OPTION, from_group_leader, group_size
from aitraining_pl.models.training import eval_mode
from aitraining_pl.modules.base import MODULE_RANGES, AlignmentModule
from aitraining_pl.modules.policy_loss import POLICY_LOSS_RANGES, PolicyLossOptions, moved_correction
from aitraining_pl.modules.timing import Stopwatch
from aitraining_pl.modules.token_budget import TokenBudgetSteps, check_row_budget, check_token_budget
from aitraining_pl.rewards import DEFAULT_REWARD_TIMEOUT, build_reward_source
from aitraining_pl.rollout import (
    GenerationConfig,
    Rollout,
    RolloutEngine,
    warn_truncated_sampling,
)
from aitraining_pl.rollout.asynchronous import RolloutPipeline, staleness
from aitraining_pl.rollout.batch import RolloutBatch
from aitraining_pl.rollout.rank_balance import balance_across_ranks
from aitraining_pl.rollout.source import RolloutSource
from aitraining_pl.validation import rules

#: ranges of the arguments every online RL module has; PPO and the critic-free module add their own.
ONLINE_RANGES = {
    **MODULE_RANGES,
    **rules(
        "mini_batch_size",
        "gradient_accumulation_steps",
        "num_iterations",
        "epsilon",
        "epsilon_high",
        "max_grad_norm",
        "kl_coef",
        "reward_timeout",
    ),
    "generation": GenerationConfig.argument_ranges,
    "policy_loss": POLICY_LOSS_RANGES,
}


def primitive(value: Any) -> bool:
    """Whether ``value`` is made of str/int/float/bool/None, lists and str-keyed dicts only."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, (list, tuple)):
        return all(primitive(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and primitive(v) for k, v in value.items())
    return False


class TeardownOnFailure(pl.Callback):
    """Calls the module's ``teardown`` when ``fit`` raises (``OnlineRLModule.configure_callbacks``)."""

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        pl_module.teardown("fit")


class OnlineRLModule(TokenBudgetSteps, PolicyLossOptions, AlignmentModule):
    """Base class; subclasses call ``setup_online`` in ``__init__`` and implement ``make_experience`` and
    ``minibatch_loss``. They read ``mini_batch_size``, ``gradient_accumulation_steps``, ``max_grad_norm``,
    ``learning_rate``, ``warmup_ratio``, ``seed``, ``missing_eos_penalty``, ``num_iterations`` and (when they
    have it) ``num_generations`` from ``hparams``."""

    #: keep each iteration's ``completion_rows`` in ``last_completions`` (``CompletionLogCallback`` sets it)
    record_completions: bool = False
    last_completions: list[dict] = []

    @property
    def num_generations(self) -> int:
        """Responses sampled per prompt (the group size ``G``; 1 for PPO)."""
        return int(self.hparam("num_generations", 1))

    @property
    def num_iterations(self) -> int:
        """Passes over each rollout batch."""
        return int(self.hparams.num_iterations)

    def setup_online(self, arguments: dict[str, Any], sequence_level: bool = True) -> None:
        """Store the hyperparameters (``arguments``: the subclass's constructor arguments, renamed ones resolved;
        ``generation`` and ``policy_loss`` are stored as dicts, a ``reward`` given as a Python object is not stored)
        and build the reward source; the subclass then builds the policy and reference."""
        self.automatic_optimization = False
        self.strict_loading = False  # the frozen reference and the reward model are never saved
        reward, generation = arguments["reward"], arguments["generation"]
        if reward is None:
            raise ConfigError(
                f"{type(self).__name__}.reward",
                "required: a reward source (an import path "
                "'pkg.module:function', a reward-model folder, a class_path dict or, in Python, a callable)",
            )
        self.generation = (
            generation if isinstance(generation, GenerationConfig) else GenerationConfig(**dict(generation))
        )
        check_server(self.generation.server, f"{type(self).__name__}.generation.server")
        options = self.policy_loss_options(arguments["policy_loss"])
        options, self.generation = moved_correction(options, self.generation, type(self).__name__)  # old names
        values = {**arguments, "kl_coef": float(arguments["kl_coef"])}
        values.update(generation=asdict(self.generation), policy_loss=asdict(options))
        if not primitive(reward):  # a Python object (not YAML-describable primitives) is not saved
            del values["reward"]
        self.save_arguments(values)
        self.set_policy_loss(options, sequence_level)
        check_token_budget(type(self).__name__, arguments.get("token_budget"), options.top_entropy_quantile)
        warn_truncated_sampling(self.generation)
        source = reward if is_episode_environment(reward) else build_reward_source(reward)
        episodes = functools.partial(sample_episodes, environment=source) if is_episode_environment(source) else None
        #: what this module asks for rollouts: the backend, launched servers, the pipeline and the reward source
        self.source = RolloutSource(
            self.generation,
            source,
            episodes,
            self.hparams.missing_eos_penalty,
            self.hparams.get("reward_timeout", DEFAULT_REWARD_TIMEOUT),
            type(self).__name__,
        )
        self.kl_coef = values["kl_coef"]
        self.last_kl = 0.0  #: batch-mean KL(pi || ref) per response (nats), for the KL callback
        self.last_num_samples = 0  #: responses behind ``last_kl`` (all ranks)
        self.update_history: list[dict[str, torch.Tensor]] = []
        self.stopwatch = Stopwatch()  #: seconds per section of the current step (``Stopwatch.online_step``)
        self.source.timer = self.stopwatch  # the source times its sampling as ``gen``

    @property
    def reward_source(self) -> Callable:
        """The reward source (protocol in ``aitraining_pl.rewards``), or an episode environment."""
        return self.source.reward

    @property
    def episodic(self) -> bool:
        """Whether rollouts are multi-turn episodes (the reward is an ``EpisodeEnvironment``)."""
        return self.source.episodic

    @property
    def last_episodes(self) -> Any:
        """``EpisodeInfo`` of the last episode rollout (multi-turn episodes only)."""
        return self.source.last_episodes

    @property
    def _launched(self) -> list[Any]:
        """``[source.launched]``: the servers this process started (read-only; for one release)."""
        return [self.source.launched]

    @property
    def _backend(self) -> list[GenerationBackend | None]:
        """``[source.built]``: the backend once set up (read-only; for one release)."""
        return [self.source.built]

    # ------------------------------------------------------------------ setup
    def on_fit_start(self) -> None:
        if self.reference is not None:
            self.reference.to(self.device, self.frozen_dtype())
        if hasattr(self.reward_source, "to"):
            self.reward_source.to(self.device)

    def setup(self, stage: str) -> None:
        """Set the rollout source up (``RolloutSource.setup``: the generation backend or fleet, launched servers,
        the asynchronous pipeline) for this process's rank."""
        seed = int(self.hparam("seed", 0))
        check_row_budget(self, self.trainer, self.generation, self.source.episodic or self.rows_per_sample > 1)
        self.source.setup(self.policy, self.tokenizer, self.global_rank, self.trainer, seed, self.device)
        if self.pipeline is not None and group_size() > 1:  # its worker thread would run the group's collectives
            raise ConfigError(OPTION, "sequence parallelism runs synchronous rollouts (generation.max_staleness 0)")

    @property
    def backend(self) -> GenerationBackend:
        """What samples the rollouts (``generation.backend``); the policy itself before ``setup``."""
        return self.source.backend(self.policy)

    def configure_callbacks(self):
        """``AlignmentModule``'s, and one that tears the generation side down when ``fit`` fails (Lightning calls
        ``teardown`` only when it ends normally): no worker thread, connection or launched server is left behind."""
        return [*super().configure_callbacks(), TeardownOnFailure()]

    @property
    def pipeline(self) -> RolloutPipeline | None:
        """The asynchronous schedule (``generation.max_staleness`` >= 1; ``rollout.asynchronous``), once set up."""
        return self.source.pipeline

    def teardown(self, stage: str) -> None:
        """Tear the rollout source down (``RolloutSource.teardown``: the pipeline, the backend, launched
        servers)."""
        self.source.teardown()

    @property
    def rows_per_sample(self) -> int:
        """Training rows per sampled response or episode: an agent environment's ``max_sequences`` (one row per
        sequence of an episode), else 1."""
        return int(getattr(self.reward_source, "max_sequences", 1))

    def updates_per_iteration(self, batch_size: int) -> int:
        """Optimizer steps made by one iteration on ``batch_size`` prompts."""
        hp = self.hparams
        samples = self.num_generations * self.rows_per_sample
        rows, per_step = batch_size * samples, hp.mini_batch_size * hp.gradient_accumulation_steps
        if rows % per_step:
            raise ValueError(
                f"the rollouts per batch ({batch_size} prompts x {samples} rows) must be a multiple of "
                f"mini_batch_size * gradient_accumulation_steps "
                f"({hp.mini_batch_size} * {hp.gradient_accumulation_steps})"
            )
        return self.num_iterations * rows // per_step

    def configure_optimizers(self):
        trainer = self.trainer
        if trainer.max_steps and trainer.max_steps > 0:
            total = trainer.max_steps  # already counted in optimizer steps
        else:  # estimated_stepping_batches counts training batches, i.e. iterations
            iterations = trainer.estimated_stepping_batches
            batch_size = getattr(trainer.datamodule, "hparams", {}).get("batch_size")
            batch_size = batch_size or getattr(trainer.train_dataloader, "batch_size", None)
            per_step = self.hparams.mini_batch_size * self.hparams.gradient_accumulation_steps
            total = iterations * self.updates_per_iteration(batch_size or per_step)
        return self.adamw(total)

    # ------------------------------------------------------------------ rollout and scoring
    @property
    def rollout_engine(self) -> RolloutEngine:
        """The rollout engine for ``generation`` with this module's tokenizer and generation backend."""
        return self.source.engine(self.policy, self.tokenizer)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        config: GenerationConfig | None = None,
        num_samples: int = 1,
        vision: Any = None,
    ) -> Rollout:
        """Sample ``num_samples`` responses per left-padded prompt with the rollout engine (``generation``, or
        ``config``), in eval mode; rows ``i*G .. i*G+G-1`` answer prompt ``i`` (``RolloutSource.generate``). With the
        vLLM backend the engine first loads the policy's weights if they changed since its last rollout (one sync per
        optimizer step count), and the rollout carries vLLM's log-probs (``sampling_logprobs``). In asynchronous
        training the pipeline's worker samples it, with the current weights."""
        args = (prompt_ids, prompt_mask, config, num_samples, vision)
        return self.source.generate(self.policy, self.tokenizer, self.global_step, *args)

    def score(self, prompts: list[str], metadata: list[dict], rollout: Rollout):
        """Scores (N,) from the reward source, minus ``missing_eos_penalty`` where a response did not end;
        and the source's per-component scores."""
        return self.source.score(prompts, metadata, rollout)

    def own_rollout(self, batch: dict[str, Any], samples: int) -> RolloutBatch | None:
        """Rows this module trains on instead of sampled ones for ``batch`` (the distillation module's data
        completions), or None: sample."""
        return None

    def rollout(self, batch: dict[str, Any], samples: int) -> RolloutBatch:
        """Sample ``samples`` responses per prompt of ``batch`` and score them, or play that many episodes
        (``RolloutSource.rollout``; in asynchronous training on the pipeline's worker with the current weights), or
        the module's own rows (``own_rollout``). Under sequence parallelism the group's ranks train on its first
        rank's rollout (``from_group_leader``), since they split that rollout's rows."""
        own = self.own_rollout(batch, samples)
        if own is not None:
            return own
        rollout = self.source.rollout(self.policy, self.tokenizer, self.global_step, batch, samples)
        return from_group_leader(rollout, self.device)

    # ------------------------------------------------------------------ log-prob passes
    @property
    def padding_free(self) -> bool:
        """Whether the log-prob passes may run packed (``models.rollout_scoring.will_pack`` decides per batch)."""
        return bool(self.hparams.get("padding_free", True))

    def response_scores(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_length: int,
        with_entropy: bool = False,
        vision: Any = None,
        padding_free: bool | None = None,
    ) -> ResponseScores:
        """``response_logps`` of ``model`` at the sampling temperature (fused head, packed where it pays unless
        ``padding_free`` is False; with the rows' images, ``vision``, for a VL model)."""
        return response_logps(
            model,
            input_ids,
            attention_mask,
            prompt_length,
            self.generation.temperature,
            self.padding_free if padding_free is None else padding_free,
            with_entropy,
            vision=vision,
        )

    def policy_scores(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_length: int,
        with_entropy: bool = False,
        vision: Any = None,
        routes: torch.Tensor | None = None,
    ) -> tuple[ResponseScores, dict[str, torch.Tensor]]:
        """``response_scores`` of the policy and its routing statistics (``routed``)."""
        score = lambda free: self.response_scores(  # noqa: E731
            self.policy, input_ids, attention_mask, prompt_length, with_entropy, vision=vision, padding_free=free
        )
        return self.routed(score, attention_mask, routes)

    def routed(self, score: Callable[[bool], Any], attention_mask: torch.Tensor, routes: torch.Tensor | None = None):
        """``score(padding_free)`` (a pass of the policy over rows with ``attention_mask`` (N, L)) and the routing
        statistics of an MoE policy: with the sampler's ``routes`` (N, L, layers, k) and ``generation.routing_replay``,
        the pass routes as the sampler did (R3, ``models.routing_replay``; rows padded, not packed) and
        ``routing/flip_rate`` says how many (token, layer) routes it replaced; in training mode the router's
        auxiliary loss where the config asks for it (``routing/aux_loss``, which ``minibatch_backward`` adds to the
        loss; a micro-batch's exact share of its minibatch's under a token budget: ``router_load``)."""
        model = self.policy
        replay = routes if routes is not None and self.generation.routing_replay else None
        aux = model.training and bool(getattr(getattr(model, "config", None), "output_router_logits", False))
        if replay is None and not aux:
            return score(self.padding_free), {}
        if replay is not None and group_size() > 1:
            raise ConfigError(
                OPTION,
                "routing replay does not split routes over a sequence group: set "
                "generation.routing_replay false with sequence parallelism",
            )
        scoring_path(model)  # probed before the routers are hooked
        with replaying(model, replay, keep_logits=aux) as routed:
            out = score(False)
        stats = {}
        if replay is not None:
            stats["routing/flip_rate"] = torch.tensor(routed.flipped / max(routed.replayed, 1))
        load = self.router_load  # a minibatch split by a token budget: its counts, then each micro-batch's share
        aux_loss = None
        if aux and load is not None and load.counting:
            load.add(model, routed.logits, attention_mask)
        elif aux:
            share = load.share if load is not None else router_aux_loss
            aux_loss = share(model, routed.logits, attention_mask)
        if aux_loss is not None:
            stats["routing/aux_loss"] = aux_loss
        return out, stats

    @staticmethod
    def vision_rows(vision: Any, rows: torch.Tensor) -> Any:
        """The images of rollout rows ``rows`` (``VisionInputs.rows``: each prompt's tensors held once, never per
        sample), or None for a text rollout."""
        return vision.rows(rows) if vision is not None else None

    def in_minibatches(
        self, fn: Callable[[torch.Tensor], Any], n: int, attention_mask: torch.Tensor | None = None
    ) -> list[Any]:
        """``fn(rows)`` over the runs of ``row_chunks`` (bounds the activations of a no-grad pass): ``mini_batch_size``
        rows at a time, or with a ``token_budget`` and the rows' ``attention_mask`` runs within the budget."""
        return [fn(rows) for rows in self.row_chunks(n, attention_mask)]

    @torch.no_grad()
    def reference_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, vision: Any = None
    ) -> torch.Tensor:
        """(N, R) log-probs of the frozen reference (eval mode; adapters off under LoRA)."""
        model = self.reference.model
        with eval_mode(model), self.reference.context(), self.stopwatch("ref"):
            return self.response_scores(model, input_ids, attention_mask, prompt_length, vision=vision).logprobs

    def sampler_correction(
        self, logprobs: torch.Tensor | None, sampled: torch.Tensor | None, mask: torch.Tensor
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """For rows that carry the sampler's log-probs ``sampled`` (vLLM, a generation server; ``mask``: their
        sampled tokens), ``logprobs`` being the trainer's (``pi_old``, around which the ratio is clipped): the
        importance weights of the policy term under ``policy_loss.importance_sampling_mode`` (``auto``:
        ``sequence_mask`` on a GPU or with
        stale samples, else none; ``losses.off_policy_weights``: with the clip around ``pi_old`` this is AReaL's
        decoupled PPO; with ``use_decoupled_loss: false`` the plain ratio, which the loss moves into its clipped ratio)
        and the ``sampling/...`` stats: ``logp_gap/mean``, ``/max``, ``mismatch_kl``, and with a mode
        ``is_weight/mean``, ``/min``, ``/max``, ``masked_tokens`` / ``masked_sequences`` or ``truncated_tokens`` /
        ``truncated_sequences``. ``(None, {})`` for other rollouts."""
        if sampled is None or logprobs is None:
            return None, {}
        options = self.policy_loss
        mode = (
            options.off_policy_mode(self.device.type, self.generation.pipelined) if options.use_decoupled_loss else None
        )
        low, high = options.importance_sampling_clip_min, options.importance_sampling_clip_max
        weights, stats = off_policy_weights(logprobs, sampled, mask, mode, low, high)
        if not options.use_decoupled_loss:  # the coupled loss: pi_old / pi_b, moved into the ratio by the loss
            weights = torch.exp(off_policy_log_ratio(logprobs, sampled, mask).clamp(-20.0, 20.0))
        return weights, {f"sampling/{k}": v for k, v in stats.items()}

    # ------------------------------------------------------------------ one iteration
    def make_experience(self, rollout: RolloutBatch) -> tuple[Any, dict[str, torch.Tensor]]:
        """Everything the update needs (no gradients), and stats to log."""
        raise NotImplementedError

    def minibatch_loss(self, experience: Any, idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss on rollout rows ``idx`` and detached stats."""
        raise NotImplementedError

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        # 1-2. rollout and scoring (errors, wrong lengths and NaNs of the reward source stop the run); asynchronous:
        # submit this batch's, train on those of ``lag`` steps ago (none yet in the warm-up)
        pipeline, pipelined, watch = self.pipeline, {}, self.stopwatch
        watch.reset()
        if pipeline is None:
            with watch("rollout"):
                rollout = self.rollout(batch, self.num_generations)
        else:
            G, step = self.num_generations, self.global_step
            ready = self.source.step_with(self.policy, self.tokenizer, step, batch, G, self.own_rollout(batch, G))
            if ready is None:
                return
            batch, rollout = ready.batch, self.on_device(ready.job.result)
            pipelined = {**staleness(pipeline.version, ready.version, rollout), **pipeline.stats()}
        if self.hparam("balance_ranks") and self.trainer.world_size > 1:
            rollout, batch, balance = self.balance_ranks(rollout, batch)
            pipelined.update(balance)
        # 3. old / reference log-probs, values, advantages
        with torch.no_grad(), watch("experience"):
            experience, stats = self.make_experience(rollout)
            if self.record_completions:  # asked for by ``CompletionLogCallback``
                self.last_completions = self.completion_rows(batch["prompts"], rollout, experience.advantages)
        # 4. num_iterations passes over shuffled minibatches
        with watch("update_actor"):
            stats.update(self.update(experience, rollout.input_ids.shape[0]))
        if pipeline is not None:
            pipeline.trained()
        # 5. log (one all-reduce of a fixed-size vector, never of ragged tensors)
        backend = self.backend.stats()  # a fleet's: servers up, per-server figures
        stats.update(self.rollout_stats(rollout), **pipelined, **backend)
        stats.update({k: torch.tensor(v) for k, v in watch.online_step(int(rollout.attention_mask.sum())).items()})
        self.log_iteration(stats, n=rollout.input_ids.shape[0])

    def balance_ranks(
        self, rollout: RolloutBatch, batch: dict[str, Any]
    ) -> tuple[RolloutBatch, dict[str, Any], dict[str, torch.Tensor]]:
        """This rank's share of the ranks' prompt groups dealt by real tokens (``balance_ranks``;
        ``rollout.rank_balance``), the batch with their prompts, and the ranks' token imbalance before and after."""
        owner = type(self).__name__
        if group_size() > 1:
            raise ConfigError(f"{owner}.balance_ranks", "not with sequence parallelism: set one of them only")
        pad = getattr(self.tokenizer, "pad_token_id", None) or 0
        rollout, prompts, stats = balance_across_ranks(rollout, list(batch["prompts"]), pad, owner)
        return rollout, {**batch, "prompts": prompts}, stats

    def on_device(self, rollout: RolloutBatch | dict[str, Any]) -> RolloutBatch:
        """``rollout`` (or its plain form from a checkpoint) with its tensors on this module's device."""
        fields = rollout if isinstance(rollout, dict) else vars(rollout)
        return RolloutBatch(**{k: v.to(self.device) if torch.is_tensor(v) else v for k, v in fields.items()})

    def completion_rows(self, prompts: list[str], rollout: RolloutBatch, advantages: torch.Tensor) -> list[dict]:
        """One dict per response of this rank's rollout: ``step``, ``prompt``, ``completion``, ``reward`` (the score
        trained on), each reward component (``reward/<name>``, ``None`` where it did not apply) and ``advantage``
        (the mean over the response's tokens)."""
        mask = rollout.mask.to(advantages.dtype)
        advantage = ((advantages * mask).sum(1) / mask.sum(1).clamp_min(1.0)).tolist()
        scores, step = rollout.scores.tolist(), self.global_step
        return [
            {
                "step": step,
                "prompt": prompts[g],
                "completion": rollout.texts[i],
                "reward": scores[i],
                **{f"reward/{k}": v[i] for k, v in sorted(rollout.components.items())},
                "advantage": advantage[i],
            }
            for i, g in enumerate(rollout.group.tolist())
        ]

    def rollout_stats(self, rollout: RolloutBatch) -> dict[str, torch.Tensor]:
        """Reward and completion statistics of one rollout batch (this rank's)."""
        scores, lengths = rollout.scores, rollout.mask.sum(1).float()
        count, _, std = group_statistics(scores, rollout.group)
        return {
            "reward_mean": scores.mean(),
            "reward_sq": (scores**2).mean(),
            "frac_reward_zero_std": ((std == 0) | (count < 2)).float().mean(),
            "completion_length": lengths.mean(),
            "completion_length/min": lengths.min(),
            "completion_length/max": lengths.max(),
            "clipped_ratio": (~rollout.ended).float().mean(),
            **{
                f"reward/{k}": torch.tensor([math.nan if x is None else x for x in v], dtype=torch.float32).nanmean()
                for k, v in sorted(rollout.components.items())  # None: the component did not apply to that row
            },
            **self.episode_stats(rollout),
        }

    def episode_stats(self, rollout: RolloutBatch) -> dict[str, torch.Tensor]:
        """Means over episodes of their metrics (``episode/turns``, ``episode/tool_calls``, ...); {} without."""
        metrics = rollout.episode_metrics or {}
        return {f"episode/{k}": torch.tensor(v, dtype=torch.float32).mean() for k, v in sorted(metrics.items())}

    def update(self, experience: Any, n: int) -> dict[str, torch.Tensor]:
        """``num_iterations`` passes over shuffled minibatches of the ``n`` rollouts with gradient accumulation
        and clipping; every rank makes the same number of (synchronised) optimizer steps, each the loss of all its
        rows (every accumulated minibatch, every rank) with one normaliser (``step_share``). Returns the
        minibatch-mean stats."""
        hp = self.hparams
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        accum = hp.gradient_accumulation_steps
        self.updates_per_iteration(n // (self.num_generations * self.rows_per_sample))  # validates the batch split
        generator = torch.Generator().manual_seed(hp.seed * 1_000_003 + self.global_step)
        history: list[dict[str, torch.Tensor]] = []
        try:
            for _ in range(self.num_iterations):
                order = torch.randperm(n, generator=generator).to(self.device)
                for i, start in enumerate(range(0, n, hp.mini_batch_size)):
                    last_micro = (i + 1) % accum == 0
                    rows = order[start : start + hp.mini_batch_size]
                    if i % accum == 0:  # the optimizer step's rows: one normaliser for them all
                        step_rows = order[start : start + accum * hp.mini_batch_size]
                        self.step_normaliser = self.normaliser_over_ranks(experience, step_rows)
                    history.append(self.minibatch_backward(optimizer, experience, rows, accum, sync=last_micro))
                    if last_micro:
                        optimizer.step()  # clips first (``on_before_optimizer_step``)
                        optimizer.zero_grad(set_to_none=True)
                        scheduler.step()
        finally:
            self.step_normaliser = None
        self.update_history = history  # per-minibatch stats of the last iteration (tests, debugging)
        return {k: torch.stack([h[k] for h in history]).mean() for k in history[0]}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Clip the gradients to ``max_grad_norm`` inside the precision plugin's step, where they are unscaled:
        under ``16-mixed`` Lightning unscales only inside ``optimizer.step()`` (Lightning #18089), so a clip before
        it would clip gradients still multiplied by the loss scale; here the plugin's ``scaler.unscale_`` has run,
        once, and the scaler then skips a step whose gradients are not finite."""
        if self.hparams.max_grad_norm:
            self.clip_gradients(optimizer, gradient_clip_val=self.hparams.max_grad_norm, gradient_clip_algorithm="norm")

    def log_iteration(self, stats: dict[str, torch.Tensor], n: int) -> None:
        """Average the iteration's stats over ranks in one all-reduce (``.../min`` and ``.../max`` entries in
        a second one, reduced by max) and log them as ``train/<name>``."""
        extrema = {
            k: stats.pop(k) * (-1 if k.endswith("/min") else 1)
            for k in [k for k in stats if k.endswith(("/min", "/max"))]
        }
        values = {}
        for part, op in ((stats, "mean"), (extrema, "max")):
            if not part:
                continue
            names = list(part)
            vector = torch.stack([part[k].detach().float().to(self.device) for k in names])
            if self.trainer.world_size > 1:
                vector = self.trainer.strategy.reduce(vector, reduce_op=op)
            values.update(dict(zip(names, vector)))
        for k in extrema:
            values[k] = values[k] * (-1 if k.endswith("/min") else 1)
        values["reward_std"] = (values.pop("reward_sq") - values["reward_mean"] ** 2).clamp_min(0).sqrt()
        self.last_kl = float(values.get("kl", 0.0))
        self.last_num_samples = n * self.trainer.world_size
        values["kl_coef"] = torch.tensor(self.kl_coef, device=self.device)
        values["lr"] = torch.tensor(self.lr_schedulers().get_last_lr()[0], device=self.device)
        self.log_metrics("train", values, batch_size=n, prog_bar=("reward_mean", "kl"))

    # ------------------------------------------------------------------ validation: held-out reward
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        rollout = self.rollout(batch, 1)
        lengths = rollout.mask.sum(1).float()
        self.log_metrics(
            "val",
            {"reward_mean": rollout.scores, "completion_length": lengths, **self.episode_stats(rollout)},
            batch_size=len(rollout.texts),
        )

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["kl_coef"] = self.kl_coef
        if self.pipeline is not None:  # the rollouts in flight, finished and saved: resumed, none lost or repeated
            checkpoint["async_rollouts"] = self.pipeline.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("async_rollouts")
        if state is not None and self.pipeline is not None:
            self.pipeline.load_state_dict(state, self.on_device)
        # ``ppo_kl_coef``: the key of checkpoints written before issue 25
        self.kl_coef = float(checkpoint.get("kl_coef", checkpoint.get("ppo_kl_coef", self.kl_coef)))
