"""The one rollout engine: prompts in; responses, masks, ended flags and texts out (``G`` samples per prompt).

Shapes: B prompts, G samples per prompt, N = B * G rows, P prompt tokens (left padded), R response tokens
(right padded after the end). Prompt ``i``'s samples are rows ``i*G .. i*G+G-1`` (``Rollout.group``).

**End of a response.** A response ends at its first *end token*: every id in the tokenizer's EOS and in the model's
``generation_config.eos_token_id`` (chat models end a turn with ids such as ``<|eot_id|>``, ``<|im_end|>`` or
``<end_of_turn>`` that are not the tokenizer's EOS), or at the token that completes a stop string (or a stop
sequence of token ids), or at ``max_new_tokens``. The end token is part of the response (it is the action that ends
the episode, and the score sits on it). One rule (``StopRule``) decides this for decoding and for the response mask
afterwards, and it only ever looks at the response tokens: a stop string that spans the prompt/response boundary
neither stops generation nor ends the mask. ``ended`` is False where a response hit ``max_new_tokens`` instead
(``missing_eos_penalty``).

**Sampling distribution.** Sampling follows a complete, explicit ``transformers.GenerationConfig`` built from
``GenerationConfig``; nothing from a checkpoint's ``generation_config.json`` (``repetition_penalty``, ``top_k``,
``min_p``, ...) nor transformers' own defaults (``top_k=50``) apply: responses are sampled from the softmax of
the logits divided by ``temperature``, truncated only by the ``top_p`` / ``top_k`` given here.

**Decoding.** ``generation.hf.decoding`` decodes with the model's KV cache and takes each row out of the batch once it
has ended, so a GRPO batch whose responses end at different lengths costs its real tokens, not 64 rows run to
the longest; it draws what ``generate`` draws while no row has ended. Models without a plain ``DynamicCache``
(hybrid state-space ones), and ``GenerationConfig.drop_ended=False``, use transformers' ``generate``, with the
model's own ``generation_config`` swapped for a blank one during the call.

**Backends.** What samples is a ``generation.backend.GenerationBackend``: the policy itself (``HFBackend``, the
decoder above), a colocated vLLM engine or a generation server; ``generation.registry.BACKENDS`` names them
(imported only when chosen) and ``build_backend`` makes one. Whichever sampled, the ``Rollout`` is made here by
the same end rule.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from aitraining_pl.errors import ConfigError
from aitraining_pl.generation.backend import GenerationBackend, SampledTokens, SampleRequest, StopRule
from aitraining_pl.generation.config import GenerationConfig
from aitraining_pl.generation.hf.backend import HFBackend
from aitraining_pl.generation.images import PromptImages
from aitraining_pl.losses import selective_log_softmax
from aitraining_pl.models.vision import VisionInputs
from aitraining_pl.rewards import DEFAULT_REWARD_TIMEOUT, score_responses
from aitraining_pl.rollout.batch import Rollout


def end_token_ids(tokenizer, model) -> list[int]:
    """Ids that end a response: the tokenizer's EOS and the model's ``generation_config.eos_token_id`` (an int
    or a list), deduplicated, in that order. Either may be missing (``tokenizer``/``model`` may be None)."""
    ids: list[int] = []
    model_ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for item in (getattr(tokenizer, "eos_token_id", None), model_ids):
        for token in item if isinstance(item, (list, tuple)) else [item]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return ids


def response_mask(
    response_ids: torch.Tensor, eos_token_id: int | Sequence[int], stop_ends: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of response tokens up to and including the first end token (or the stop end, if earlier).

    Args:
        response_ids: (N, R).
        eos_token_id: one end id or several.
        stop_ends: optional (N,) index of the token that completes a stop, -1 where none (``StopRule.ends``).

    Returns:
        ``(mask, ended)``: (N, R) long mask; (N,) bool, True where the response ended by an end token or a stop
        (False: truncated at ``max_new_tokens``).
    """
    eos = torch.as_tensor(eos_token_id, device=response_ids.device).view(-1)
    is_end = torch.isin(response_ids, eos)
    positions = torch.arange(response_ids.shape[1], device=response_ids.device)
    if stop_ends is not None:
        is_end = is_end | ((positions[None, :] == stop_ends[:, None]) & (stop_ends[:, None] >= 0))
    ended = is_end.any(dim=1)
    truncated = torch.full_like(ended, response_ids.shape[1] - 1, dtype=torch.long)
    last = torch.where(ended, is_end.long().argmax(dim=1), truncated)
    return (positions[None, :] <= last[:, None]).long(), ended


def decode_responses(tokenizer, response_ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Texts of the masked response tokens, special tokens (end tokens) removed."""
    lengths = mask.sum(1).tolist()
    return [tokenizer.decode(ids[: int(n)], skip_special_tokens=True) for ids, n in zip(response_ids.tolist(), lengths)]


_TRUNCATION_WARNED: set[tuple[float, int]] = set()


def warn_truncated_sampling(config: GenerationConfig) -> None:
    """One warning per process and setting: training log-probs are not of the truncated sampling distribution."""
    key = (float(config.top_p), int(config.top_k))
    if config.truncated and key not in _TRUNCATION_WARNED:
        _TRUNCATION_WARNED.add(key)
        warnings.warn(
            f"generation.top_p={config.top_p} / top_k={config.top_k} truncate sampling, but the log-probs used for "
            "the policy ratio, KL and entropy are of the untruncated softmax at the temperature, so the responses "
            "do not come from the distribution that is trained on. Set top_p: 1.0 and top_k: 0 for on-policy "
            "sampling.",
            UserWarning,
            stacklevel=3,
        )


def prompt_images(model: torch.nn.Module, vision: VisionInputs | None) -> PromptImages | None:
    """The images of ``vision``'s prompts for a backend that encodes them itself (vLLM: ``generation.images``)."""
    if vision is None:
        return None
    if vision.images is None:
        raise ConfigError("generation.backend", "these prompts' images were not kept (only their pixel values): "
                          "sample them with hf, or load the prompts with PromptDataModule")  # fmt: skip
    return PromptImages.of(model, [vision.images[i] for i in vision.prompt_of()])


class RolloutEngine:
    """Samples ``num_samples`` responses per prompt and returns a ``Rollout`` (see the module docstring).

    Args:
        tokenizer: decodes responses (texts, stop strings); gives the EOS and pad ids. May be None when there
            are no stop strings (texts are then empty strings).
        generation: sampling settings.
        end_token_ids: ids that end a response (default: ``end_token_ids(tokenizer, model)`` at each call;
            ``[]``: none, only stops and ``max_new_tokens`` end a response).
        stop_sequences: token-id sequences that end a response, besides ``generation.stop_strings``.
        warn_truncation: warn (once) that ``top_p`` / ``top_k`` make the training log-probs off-policy.
        skip_special_tokens: match stop strings in the text without special tokens (``StopRule``).
        backend: the ``GenerationBackend`` that samples (``build_backend``); None, or one whose ``location`` is
            ``policy``: the model given to ``sample`` samples itself (``HFBackend``).
        seed: a generator that draws the seed of each ``sample`` call given none (every turn of an episode gets
            its own draw): reproducible sampling whatever the backend's own state (asynchronous training).
    """

    def __init__(
        self,
        tokenizer,
        generation: GenerationConfig,
        end_token_ids: list[int] | None = None,
        stop_sequences: Sequence[Sequence[int]] | None = None,
        warn_truncation: bool = True,
        skip_special_tokens: bool = False,
        backend: GenerationBackend | None = None,
        seed: torch.Generator | None = None,
    ):
        generation.validate()
        self.tokenizer, self.generation, self.backend, self.seed = tokenizer, generation, backend, seed
        self.end_ids = None if end_token_ids is None else [int(t) for t in end_token_ids]
        self.stop_rule = StopRule(tokenizer, generation.stop_strings, stop_sequences, skip_special_tokens)
        if warn_truncation:
            warn_truncated_sampling(generation)

    def end_token_ids(self, model: torch.nn.Module) -> list[int]:
        """The ids that end a response of ``model``."""
        return list(self.end_ids) if self.end_ids is not None else end_token_ids(self.tokenizer, model)

    def pad_token_id(self, model: torch.nn.Module, end_ids: Sequence[int]) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
        return int(pad if pad is not None else (end_ids[0] if end_ids else 0))

    @torch.no_grad()
    def sample(
        self,
        model: torch.nn.Module,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        num_samples: int = 1,
        *,
        with_logprobs: bool = False,
        seed: int | torch.Generator | None = None,
        vision: VisionInputs | None = None,
    ) -> Rollout:
        """Sample ``num_samples`` responses for each left-padded prompt (B, P), in eval mode.

        Args:
            model: the plain (unwrapped) transformers or peft causal LM.
            with_logprobs: also return ``logprobs`` and ``sampling_logprobs`` (from ``generate``'s logits).
            seed: sample in a forked RNG seeded with this int, or with a seed drawn from this generator (the
                global RNG is then left untouched).
            vision: the prompts' images (``models.vision.VisionInputs``) for a vision-language model, sampled
                through the backend like every prompt: the HF backend decodes them with their pixel values
                (``generation.hf.vision_decoding``), a vLLM engine or a server is given the images
                (``generation.images``).
        """
        end_ids = self.end_token_ids(model)
        group = torch.arange(prompt_ids.shape[0], device=prompt_ids.device).repeat_interleave(num_samples)
        pad = self.pad_token_id(model, end_ids)
        seed = self.seed if seed is None else seed
        if isinstance(seed, torch.Generator):
            seed = int(torch.randint(0, 2**62, (1,), generator=seed, device=seed.device))
        backend = self.backend
        if backend is None or backend.location == "policy":  # the model given samples itself
            backend = HFBackend(model, with_logprobs)
        args = prompt_ids, prompt_mask, self.generation, end_ids, self.stop_rule, pad, num_samples, seed
        if backend.location == "policy":  # the policy decodes the images' pixel values itself
            request = SampleRequest(*args, vision=vision)
        else:  # an engine or a server that encodes the images itself
            request = SampleRequest(*args, images=prompt_images(model, vision))
        sampled = backend.sample(request)
        return self.rollout(prompt_ids[group], prompt_mask[group], sampled, group, end_ids, pad)

    def rollout(
        self, prompt_ids, prompt_mask, sampled: SampledTokens, group: torch.Tensor, end_ids, pad: int | None = None
    ) -> Rollout:
        """The ``Rollout`` of sampled tokens: masks and ``ended`` by the same rule as generation, texts. With
        ``pad``, tokens a backend drew after the end this rule finds become ``pad``."""
        response = sampled.response_ids
        stop_ends = self.stop_rule.ends(response) if self.stop_rule else None
        mask, ended = response_mask(response, end_ids, stop_ends)
        if pad is not None:
            response = torch.where(mask.bool(), response, torch.full_like(response, pad))
        texts = decode_responses(self.tokenizer, response, mask) if self.tokenizer is not None else [""] * len(response)
        logprobs = sampling = None
        if sampled.logits is not None:
            logprobs = selective_log_softmax(sampled.logits, response)
            sampling = selective_log_softmax(sampled.scores, response)
        if sampled.sampling_logprobs is not None:
            sampling = sampled.sampling_logprobs * mask
        versions = sampled.token_versions
        if versions is not None:
            versions = versions.masked_fill(~mask.bool(), -1)
        return Rollout(prompt_ids, prompt_mask, response, mask, ended, texts, group, logprobs, sampling, versions)


def score_rollout(
    reward_source,
    prompts: Sequence[str],
    metadata: Sequence[dict] | None,
    rollout: Rollout,
    missing_eos_penalty: float | None = None,
    timeout: float | None = DEFAULT_REWARD_TIMEOUT,
) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """Score every row of ``rollout`` with a reward source (through ``rewards.score_responses``, which raises
    ``RewardError`` on failures, and on a call longer than ``timeout`` seconds); each row gets its prompt's text
    and metadata.

    Returns:
        ``(scores, components)``: (N,) float32 on the rollout's device, minus ``missing_eos_penalty`` where a
        response did not end; the source's per-component scores (lists of N).
    """
    rows = rollout.group.tolist()
    metadata = list(metadata) if metadata is not None else [{} for _ in prompts]
    scores, components = score_responses(
        reward_source, [prompts[i] for i in rows], rollout.texts, [metadata[i] for i in rows], timeout=timeout
    )
    scores = torch.tensor(scores, dtype=torch.float32, device=rollout.ended.device)
    if missing_eos_penalty is not None:
        scores = scores - missing_eos_penalty * (~rollout.ended).float()
    return scores, components
