"""``RolloutSource``: what the online modules ask for rollouts. It owns the generation side of a run: the backend
that samples (``generation.registry.build_backend``: the policy itself, a colocated vLLM engine or a generation
server's client), a server it launched (``generation.server: launch``), the asynchronous pipeline
(``max_staleness`` >= 1) and the reward source that scores. A module sets it up and tears it down with itself, and
asks it to ``generate``, ``score`` and ``rollout`` (asynchronously: ``step_with``); the module keeps only
orchestration (the update, the metrics).

A rollout goes one way: module -> source -> engine -> backend. ``rollout`` samples through ``generate`` (the rollout
engine, ``RolloutEngine.sample``, which asks the backend, ``GenerationBackend.sample``) and scores; in asynchronous
training the source itself moves the call onto the pipeline's worker (``now``, ``step_with``). Nothing here calls
back into the module.

The policy, tokenizer and optimizer step are the module's: they are given at each call, never kept, so the source
holds no reference to the module (nothing of it is pickled with the module's state or moved with its device).
Multi-turn episodes are played by the ``episodes`` callable the module gives (the environments sit above this
layer); an environment that plays its own episodes (``play_episodes``, an agent) is called with the version its
recorded calls are sampled by.
"""

from __future__ import annotations

import contextlib
import functools
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch

from aitraining_pl.errors import ConfigError
from aitraining_pl.generation.backend import BackendContext, GenerationBackend
from aitraining_pl.generation.config import GenerationConfig
from aitraining_pl.generation.hf.backend import HFBackend
from aitraining_pl.generation.registry import build_backend
from aitraining_pl.generation.servers.fleet import Fleet
from aitraining_pl.generation.servers.launcher import LaunchedFleet
from aitraining_pl.losses import place_scores
from aitraining_pl.rewards import DEFAULT_REWARD_TIMEOUT
from aitraining_pl.rollout.asynchronous import RolloutPipeline
from aitraining_pl.rollout.batch import Rollout, RolloutBatch
from aitraining_pl.rollout.engine import RolloutEngine, score_rollout


class RolloutSource:
    """The rollouts of one online module (see the module docstring).

    Args:
        generation: how responses are sampled, and by which backend (``GenerationConfig``).
        reward: the reward source (``aitraining_pl.rewards``), or an episode environment.
        episodes: plays episodes (``environments.episode_rollout.sample_episodes`` with the environment bound) when
            ``reward`` is an episode environment without ``play_episodes``; None: single responses.
        missing_eos_penalty: subtracted from the score of a response (or episode) that did not end.
        reward_timeout: seconds a reward call may take (``rewards.score_responses``).
        owner: the module's class name (messages name its options by it).
    """

    def __init__(
        self,
        generation: GenerationConfig,
        reward: Any,
        episodes: Callable[..., Rollout] | None = None,
        missing_eos_penalty: float | None = None,
        reward_timeout: float | None = DEFAULT_REWARD_TIMEOUT,
        owner: str = "OnlineRLModule",
    ):
        self.generation, self.reward, self.play, self.owner = generation, reward, episodes, owner
        self.missing_eos_penalty, self.reward_timeout = missing_eos_penalty, reward_timeout
        self.built: GenerationBackend | None = None  #: what samples the rollouts (built in ``setup``)
        #: the servers this process started (``server: launch``, ``server: {launch: ...}``)
        self.launched: LaunchedFleet | None = None
        self.pipeline: RolloutPipeline | None = None  #: the asynchronous schedule (``max_staleness``)
        self.sampling_seed: torch.Generator | None = None  #: the seeds of an asynchronous job's sampling calls
        self.last_episodes = None  #: ``EpisodeInfo`` of the last episode rollout (multi-turn episodes only)
        #: times a named section (the module's ``modules.timing.Stopwatch``): sampling, or playing episodes, is ``gen``
        self.timer: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext()

    @property
    def episodic(self) -> bool:
        """Whether rollouts are multi-turn episodes."""
        return self.play is not None

    # ------------------------------------------------------------------ setup and teardown
    def setup(self, policy: torch.nn.Module, tokenizer: Any, rank: int, trainer: Any, seed: int, device: Any) -> None:
        """Build the generation backend (``registry.build_backend``: the policy itself, a colocated vLLM engine or
        the fleet of the running servers ``generation.server`` names, one server a fleet of one; one line naming the
        extra to install when vLLM is missing), on this ``rank`` of ``trainer`` (its ``strategy.broadcast``, devices,
        precision and data module); rank 0 first launches the servers of ``server: launch`` / ``{launch: ...}``, which
        every rank then connects to (``Fleet.connect``). It gets the policy's weights before the first rollout
        (``sampling``), so a resumed run samples from the resumed weights."""
        if self.built is not None:
            return
        strategy = trainer.strategy
        run = strategy.broadcast(uuid.uuid4().hex)  # one id for the run's weight versions (servers)
        generation, fleet, endpoints = self.generation, self.generation.fleet(), None
        if fleet is not None and fleet.launch is not None:  # rank 0 starts them; every rank connects (one machine)
            if rank == 0:
                on_gpu = strategy.root_device.type == "cuda"  # read here, not from the policy (still on the CPU)
                gpus = trainer.num_devices if on_gpu else 0
                self.launched = LaunchedFleet(fleet.launch, generation, policy, tokenizer, seed, gpus)
            endpoints = strategy.broadcast(self.launched.endpoints() if self.launched else None)
        datamodule = getattr(trainer, "datamodule", None)
        prompts = None if self.episodic else getattr(datamodule, "hparams", {}).get("max_prompt_length")
        context = BackendContext(policy, tokenizer, rank, run, seed, str(trainer.precision), prompts)
        if endpoints is not None:
            backend = self.built = Fleet.connect(fleet, endpoints, generation, context)
        else:  # in this process, or running servers (``Fleet.from_context``)
            backend = self.built = build_backend(generation, context, device)
        if self.generation.pipelined:
            if backend.location != "server":
                raise ConfigError(
                    f"{self.owner}.generation.max_staleness",
                    f"{self.generation.max_staleness}: asynchronous training samples on a generation server while the "
                    "policy trains; set generation.server: launch (the trainer starts one on this machine) or connect "
                    "(docs/async.md)",
                )
            lag, every = self.generation.lag(), self.generation.weight_sync_steps
            free = self.generation.async_schedule == "free"
            self.pipeline = RolloutPipeline(backend, policy, rank, lag, every, seed, free)

    def teardown(self) -> None:
        """Stop the asynchronous pipeline (its rollouts in flight dropped), close the backend and the reward
        source's own servers (an agent's endpoint), stop a launched server."""
        pipeline, backend, server = self.pipeline, self.built, self.launched
        self.pipeline = self.built = self.launched = None
        try:
            if pipeline is not None:
                pipeline.close()
            if backend is not None:
                backend.close()
            if hasattr(self.reward, "close"):
                self.reward.close()
        finally:
            if server is not None:
                server.stop()

    def backend(self, policy: torch.nn.Module) -> GenerationBackend:
        """What samples the rollouts (``generation.backend``); ``policy`` itself before ``setup``."""
        return self.built if self.built is not None else HFBackend(policy)

    # ------------------------------------------------------------------ sampling
    def engine(self, policy: torch.nn.Module, tokenizer: Any, config: GenerationConfig | None = None) -> RolloutEngine:
        """The rollout engine for ``generation`` (or ``config``) with ``tokenizer`` and the backend."""
        if config is None:
            return RolloutEngine(
                tokenizer, self.generation, warn_truncation=False, backend=self.backend(policy), seed=self.sampling_seed
            )
        return RolloutEngine(tokenizer, config, backend=self.backend(policy), seed=self.sampling_seed)

    @contextlib.contextmanager
    def sampling(self, policy: torch.nn.Module, step: int) -> Iterator[None]:
        """Around a rollout: the backend takes ``policy``'s weights of optimizer step ``step`` (a vLLM engine or
        server loads them if they changed since its last rollout; the policy itself gathers its full parameters under
        FSDP2: one all-gather for the whole rollout) and sleeps afterwards. Nothing on the asynchronous pipeline's
        worker: it pushed the weights its jobs name."""
        backend = self.backend(policy)
        if self.pipeline is not None:
            yield
            return
        backend.sync(policy, version=step)
        try:
            yield
        finally:
            backend.sleep()

    def generate(
        self,
        policy: torch.nn.Module,
        tokenizer: Any,
        step: int,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        config: GenerationConfig | None = None,
        num_samples: int = 1,
        vision: Any = None,
    ) -> Rollout:
        """``num_samples`` responses per left-padded prompt by ``policy`` at ``step`` (``sampling``): the rollout
        engine (``generation``, or ``config``) samples through the backend; ``vision``: a VL model's prompt images
        (``models.vision.VisionInputs``). In asynchronous training, on the pipeline's worker with the current weights
        (``now``)."""
        return self.now(self._generate, policy, tokenizer, step, prompt_ids, prompt_mask, config, num_samples, vision)

    def _generate(self, policy, tokenizer, step, prompt_ids, prompt_mask, config, num_samples, vision) -> Rollout:
        engine = self.engine(policy, tokenizer, config)
        with self.timer("gen"), self.sampling(policy, step):
            return engine.sample(policy, prompt_ids, prompt_mask, num_samples, vision=vision)

    def seeded(self, seed: int, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` with every sampling call seeded from ``seed`` (an asynchronous job on the worker)."""
        self.sampling_seed = torch.Generator().manual_seed(seed)
        try:
            return fn(*args)
        finally:
            self.sampling_seed = None

    def now(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` (one of this source's sampling methods); in asynchronous training on the pipeline's worker,
        with the current weights and a seed of the pipeline's (``RolloutPipeline.now``)."""
        pipeline = self.pipeline
        if pipeline is None or pipeline.in_worker():
            return fn(*args)
        return pipeline.now(lambda seed: self.seeded(seed, fn, *args))

    def step_with(
        self,
        policy: torch.nn.Module,
        tokenizer: Any,
        step: int,
        batch: dict[str, Any],
        samples: int,
        given: RolloutBatch | None = None,
    ) -> Any:
        """One asynchronous training step (``RolloutPipeline.step_with``): submit the rollouts of ``batch``
        (``samples`` per prompt, sampled and scored on the worker, seeded by the pipeline; ``given``: rows the module
        trains on instead, queued in the same order) and return those of ``lag`` steps ago, or None in the
        warm-up."""

        def job(batch: dict[str, Any], seed: int) -> RolloutBatch:
            if given is not None:
                return given
            return self.seeded(seed, self._rollout, policy, tokenizer, step, batch, samples)

        return self.pipeline.step_with(batch, job)

    # ------------------------------------------------------------------ scoring
    def score(self, prompts: list[str], metadata: list[dict], rollout: Rollout):
        """Scores (N,) from the reward source, minus ``missing_eos_penalty`` where a response did not end; and the
        source's per-component scores."""
        return score_rollout(
            self.reward, prompts, metadata, rollout, self.missing_eos_penalty, timeout=self.reward_timeout
        )

    def rollout(
        self, policy: torch.nn.Module, tokenizer: Any, step: int, batch: dict[str, Any], samples: int
    ) -> RolloutBatch:
        """Sample ``samples`` responses per prompt of ``batch`` by ``policy`` at ``step`` (``generate``) and score
        them, or play that many episodes; in asynchronous training, on the pipeline's worker with the current weights
        (``now``)."""
        return self.now(self._rollout, policy, tokenizer, step, batch, samples)

    def _rollout(self, policy, tokenizer, step: int, batch: dict[str, Any], samples: int) -> RolloutBatch:
        if self.episodic:
            return self.episode_rollout(policy, tokenizer, step, batch, samples)
        vision = batch.get("vision")  # a VL model's prompt images (``datamodules.vision``)
        rollout = self._generate(policy, tokenizer, step, batch["input_ids"], batch["attention_mask"], None, samples,
                                 vision)  # fmt: skip
        scores, components = self.score(batch["prompts"], batch["metadata"], rollout)
        rows = {} if vision is None else {"vision": vision.for_rows(rollout.group)}
        return RolloutBatch.from_rollout(rollout, scores, components, **rows)

    def episode_rollout(
        self, policy: torch.nn.Module, tokenizer: Any, step: int, batch: dict[str, Any], samples: int
    ) -> RolloutBatch:
        """Play ``samples`` episodes per prompt; the score of an episode is its return, minus
        ``missing_eos_penalty`` (on its last sampled token) when a limit cut it short."""
        # an environment that plays its own episodes (``play_episodes``, e.g. an agent given the policy through an
        # endpoint) returns the same ``Rollout``; the others are played turn by turn (``episodes``)
        play = getattr(self.reward, "play_episodes", None)
        if play is not None:  # the version its recorded calls were sampled by
            play = functools.partial(play, version=self.pipeline.version if self.pipeline else step)
        play = play or self.play
        images = {"vision": batch["vision"]} if batch.get("vision") is not None else {}  # the prompts' images
        with self.timer("gen"), self.sampling(policy, step):
            rollout = play(
                self.engine(policy, tokenizer),
                policy,
                prompts=batch["prompts"],
                metadata=batch["metadata"],
                prompt_ids=batch["input_ids"],
                prompt_mask=batch["attention_mask"],
                num_samples=samples,
                timeout=self.reward_timeout,
                **images,
            )
        info, mask = rollout.episodes, rollout.response_mask
        self.last_episodes = info
        penalty = (~rollout.ended).float() * float(self.missing_eos_penalty or 0.0)
        return RolloutBatch.from_rollout(
            rollout,
            info.returns - penalty,
            token_scores=info.token_rewards - place_scores(penalty, mask),
            episode_metrics=info.metrics,
            episode=info.episode,
            token_versions=None,  # an episode's staleness is measured per rollout
            vision=rollout.vision,  # each row's images (a vision-language policy's episodes)
        )
