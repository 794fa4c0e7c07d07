"""Episodes as rollouts: the rollout engine's settings, a multi-turn decoder and an episode environment give the
same ``Rollout`` the online modules train on, with holes in the response mask where the environment spoke.

The token sequence of an episode is exactly: the prompt tokens, each turn's tokens as sampled, and each reply
of the environment rendered by the chat template and appended as tokens (``ChatFormat.reply_ids``), up to the
end. ``response_mask`` is 1 on sampled tokens only; ``response_attention`` on every real token. Each turn's
reward sits on that turn's last sampled token (``EpisodeInfo.token_rewards``); the episode return is their sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from aitraining_pl.environments.chat import ChatFormat, chat_ids, vision_chat_format, without_pixels
from aitraining_pl.environments.episode import AssistantTurn, EpisodeEnvironment
from aitraining_pl.environments.episode_guard import guarded_reset, guarded_step
from aitraining_pl.generation.hf.episode_decoding import EpisodeTokens, TurnSample, decode_episodes, decode_turns
from aitraining_pl.generation.hf.generate import hf_generation_config
from aitraining_pl.models.routing_replay import placed_routes, warn_unrecorded
from aitraining_pl.models.tokens import padded
from aitraining_pl.models.training import eval_mode
from aitraining_pl.models.vision import VisionInputs, merge_vision, processor_of
from aitraining_pl.rewards import DEFAULT_REWARD_TIMEOUT
from aitraining_pl.rollout import Rollout, RolloutEngine


@dataclass
class EpisodeInfo:
    """What an episode rollout adds to a ``Rollout`` (rows as in the rollout)."""

    response_attention: torch.Tensor  #: (N, R) 1 on every real token after the prompt (model and environment)
    token_rewards: torch.Tensor  #: (N, R) each turn's reward on its last sampled token
    returns: torch.Tensor  #: (N,) episode returns (sum of the turn rewards)
    metrics: dict[str, list[float]]  #: per episode: turns, tool_calls, tool_errors, truncated, env metrics
    transcripts: list[list[dict]]  #: per episode: the assistant turns and replies as messages
    prefilled: list[int] = field(default_factory=list)  #: tokens prefilled before each turn
    sampled: list[int] = field(default_factory=list)  #: tokens sampled in each turn
    #: (N,) long: the episode each row belongs to, where an episode gives several rows (``agents``: one per
    #: sequence); None: row ``i`` is episode ``i``
    episode: torch.Tensor | None = None


class _Episodes:
    """The environments of a batch and the ``respond`` callback of the decoder; for a VL policy (``processor``),
    each row's images so far (``images``: per-image vision inputs, in order)."""

    def __init__(
        self, environment: EpisodeEnvironment, chat: ChatFormat, tokenizer, rows: int, max_new_tokens: int, timeout
    ):
        self.envs, self.timeout = [environment.spawn() for _ in range(rows)], timeout
        self.vision = processor_of(tokenizer) is not None  # a VL policy
        self.images: list[list[dict]] = [[] for _ in range(rows)]
        self.chat, self.tokenizer, self.limits, self.max_new = chat, tokenizer, environment.limits, max_new_tokens
        self.length = [0] * rows
        self.done = [False] * rows
        self.rewards: list[list[float]] = [[] for _ in range(rows)]
        self.metrics: list[dict[str, float]] = [{"turns": 0.0, "truncated": 0.0} for _ in range(rows)]
        self.transcripts: list[list[dict]] = [[] for _ in range(rows)]

    def __call__(self, turn: int, rows: list[int], turns: list[list[int]], ended: list[bool]) -> list:
        replies = []
        for r, ids, closed in zip(rows, turns, ended):
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            raw = self.tokenizer.decode(ids, skip_special_tokens=False)
            result = guarded_step(self.envs[r], AssistantTurn(text, raw, list(ids), closed, turn), self.timeout)
            self.rewards[r].append(result.reward)
            self.metrics[r]["turns"] += 1
            for key, value in result.metrics.items():
                self.metrics[r][key] = self.metrics[r].get(key, 0.0) + value
            self.transcripts[r].append({"role": "assistant", "content": text})
            self.length[r] += len(ids)
            reply = None
            if result.done:
                self.done[r] = True
            elif turn + 1 < self.limits.max_turns:
                reply, images = self.reply(result, ids)
                if self.length[r] + len(reply) + self.max_new > self.limits.max_total_tokens:
                    reply = None
            if reply is None:
                self.metrics[r]["truncated"] = float(not self.done[r])
            else:
                self.length[r] += len(reply)
                self.images[r] += images
                self.transcripts[r] += [without_pixels(m) for m in result.messages]
            replies.append(reply)
        return replies

    def reply(self, result, turn_ids: list[int]) -> tuple[list[int], list[dict]]:
        """A reply's tokens (image tokens expanded) and its images' vision inputs."""
        where, source = "EpisodeStep.messages", "the environment's reply"
        return chat_ids(self.chat, result.messages, turn_ids, result.images, where=where, source=source)


def sample_episodes(
    engine: RolloutEngine,
    model: torch.nn.Module,
    environment: EpisodeEnvironment,
    prompts: Sequence[str],
    metadata: Sequence[dict],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    num_samples: int = 1,
    *,
    reprefill: bool = False,
    timeout: float | None = DEFAULT_REWARD_TIMEOUT,
    vision: VisionInputs | None = None,
) -> Rollout:
    """Play ``num_samples`` episodes per prompt with ``engine``'s settings (``max_new_tokens`` per turn) and
    return their ``Rollout``, its ``episodes`` (``EpisodeInfo``) set. Prompts whose ``reset`` returns messages
    are re-rendered from them (with the environment's tools); the others keep ``prompt_ids``. With a generation
    backend on ``engine`` (vLLM), each turn sends every unfinished episode's whole token sequence to it
    (``backend_turns``); the rollout then carries the backend's ``sampling_logprobs``. The environment's ``reset``
    and ``step`` run guarded (``episode_guard``): each call at most ``timeout`` seconds (the online modules'
    ``reward_timeout``), and any fault stops the run with one ``RewardError`` naming the environment.

    A vision-language policy (its tokenizer carries its processor) plays with images: the prompts' (``vision``, one
    entry per prompt, or the image parts of ``reset``'s messages) and those of the environment's replies
    (``EpisodeStep.images``, ``environments.chat``), their image tokens masked like the rest of a reply.
    Each turn re-runs every unfinished episode's whole sequence with all of its images so far through the HF
    decoder with images (``backend_turns`` with ``images``): exact on every architecture (the model places the image
    tokens and, for the Qwen VL family, their multimodal positions over the whole sequence itself), where extending
    the KV cache by a reply with a new image would need the new image's positions computed outside the model. The
    rollout carries each row's images in order (``Rollout.vision``) for the trainer's log-prob pass."""
    tokenizer, device = engine.tokenizer, prompt_ids.device
    chat = vision_chat_format(tokenizer, environment.tools)
    if environment.tools:
        environment.for_template(chat.template)
    n = len(prompts) * num_samples
    episodes = _Episodes(environment, chat, tokenizer, n, engine.generation.max_new_tokens, timeout)
    group = torch.arange(len(prompts), device=device).repeat_interleave(num_samples)
    first = [
        guarded_reset(episodes.envs[r], prompts[int(g)], dict(metadata[int(g)]), timeout)
        for r, g in enumerate(group.tolist())
    ]
    prompts_images = [vision.prompts[i] if vision is not None else {} for i in range(len(prompts))]
    prompt_ids, prompt_mask = _prompts(
        chat, first[::num_samples], prompt_ids, prompt_mask, engine, model, prompts_images
    )
    end_ids = engine.end_token_ids(model)
    config = hf_generation_config(engine.generation, end_ids, engine.pad_token_id(model, end_ids))
    replay = bool(getattr(engine.generation, "routing_replay", False))
    if episodes.vision:  # a VL policy: each row's images so far, the prompt's first
        episodes.images = [[prompts_images[g]] for g in group.tolist()]
        sample = backend_turns(engine, model, episodes.images)
        tokens = decode_turns(sample, prompt_ids, prompt_mask, config.pad_token_id, episodes, num_samples)
    elif engine.backend is not None and engine.backend.location != "policy":
        sample = backend_turns(engine, model)
        tokens = decode_turns(sample, prompt_ids, prompt_mask, config.pad_token_id, episodes, num_samples)
    else:
        with eval_mode(model):
            tokens = decode_episodes(model, prompt_ids, prompt_mask, config, episodes, engine.stop_rule or None,
                                     num_samples, reprefill, record_routes=replay)  # fmt: skip
    if tokens.routes is None:
        warn_unrecorded(model, "this multi-turn episode sampler (only the KV-cache episode decoder does)", replay)
    rollout = _as_rollout(tokens, episodes, prompt_ids[group], prompt_mask[group], group, config.pad_token_id)
    if tokens.routes is not None:
        flat = [torch.cat(parts).to(torch.int16) for parts in tokens.routes]
        rollout.routes = placed_routes(flat, prompt_mask[group], rollout.response_ids.shape[1]).to(device)
    if episodes.vision:
        rollout.vision = VisionInputs([merge_vision(images) for images in episodes.images])
    return rollout


def backend_turns(engine: RolloutEngine, model: torch.nn.Module, images: list[list[dict]] | None = None):
    """``decode_turns``' sampler on ``engine``'s generation backend: each turn is ``engine.sample`` of the
    histories as prompts (token ids as they are: vLLM's ``prompt_token_ids``), with the single-response path's
    sampling settings, end ids and stop rule; the backend's prefix cache keeps the earlier turns' KV
    (``prefilled``: the prompt tokens it did not find there, ``VLLMEngine.cached_tokens``). With ``images`` (a VL
    policy's: each row's per-image vision inputs so far, in order), each history is sampled with its images by the HF
    decoder with images (``sample_episodes`` says why the whole history)."""

    def sample(ids: torch.Tensor, mask: torch.Tensor, samples: int, rows: list[int]) -> TurnSample:
        extra = {} if images is None else {"vision": VisionInputs([merge_vision(images[r]) for r in rows[::samples]])}
        drawn = engine.sample(model, ids, mask, samples, **extra)
        lengths = drawn.response_mask.sum(1).tolist()
        tokens = [row[:n].tolist() for row, n in zip(drawn.response_ids, lengths)]
        logps = drawn.sampling_logprobs
        logps = None if logps is None else [row[:n].tolist() for row, n in zip(logps, lengths)]
        cached = int(getattr(engine.backend, "cached_tokens", 0) or 0)
        return TurnSample(tokens, drawn.ended.tolist(), logps, int(mask.sum()) - cached)

    return sample


def _prompts(chat: ChatFormat, first, prompt_ids, prompt_mask, engine, model, images: list[dict]):
    """The prompts: ``reset``'s messages rendered (a VL policy's: their image parts' images replace the prompt's,
    ``images[i]``), the data module's where it returned None."""
    if all(messages is None for messages in first):
        return prompt_ids, prompt_mask
    rows = []
    for i, messages in enumerate(first):
        if messages is None:
            rows.append(prompt_ids[i][prompt_mask[i].bool()].tolist())
        else:
            ids, parts = chat_ids(chat, messages, where="reset", source="the environment's reset")
            rows.append(ids)
            images[i] = merge_vision(parts)
    end_ids = engine.end_token_ids(model)
    ids, mask = padded(rows, engine.pad_token_id(model, end_ids), "left", device="cpu")
    return ids.to(prompt_ids.device), mask.to(prompt_mask.device)


def _as_rollout(tokens: EpisodeTokens, episodes: _Episodes, prompt_ids, prompt_mask, group, pad) -> Rollout:
    n, device = len(tokens.tokens), prompt_ids.device
    ids, attention = padded(tokens.tokens, int(pad), width=1, device="cpu")
    model_mask, _ = padded(tokens.from_model, 0, width=ids.shape[1], device="cpu")
    rewards = torch.zeros(ids.shape)
    for r in range(n):
        for end, reward in zip(tokens.turn_ends[r], episodes.rewards[r]):
            rewards[r, end] += reward
    # ended: the environment ended the episode after a turn that itself ended (not cut at max_new_tokens)
    ended = torch.tensor([d and t[-1] for d, t in zip(episodes.done, tokens.turn_ended)], dtype=torch.bool)
    texts = [episodes.tokenizer.decode(row[m.bool()], skip_special_tokens=True) for row, m in zip(ids, model_mask)]
    keys = sorted({k for m in episodes.metrics for k in m})
    info = EpisodeInfo(
        attention.to(device),
        rewards.to(device),
        rewards.sum(1).to(device),
        {k: [m.get(k, 0.0) for m in episodes.metrics] for k in keys},
        episodes.transcripts,
        tokens.prefilled,
        tokens.sampled,
    )
    rollout = Rollout(prompt_ids, prompt_mask, ids.to(device), model_mask.to(device), ended.to(device), texts, group)
    if tokens.sampling_logprobs is not None:
        logps, _ = padded(tokens.sampling_logprobs, 0.0, width=ids.shape[1], dtype=torch.float32, device="cpu")
        rollout.sampling_logprobs = logps.to(device)
    rollout.episodes = info
    return rollout
