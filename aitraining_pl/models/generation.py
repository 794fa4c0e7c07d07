"""The Hugging Face side of sampling: the one ``generate`` call of the project (``hf_generate``), with a
complete explicit ``transformers.GenerationConfig`` and the model's own generation config out of the way, and
the stop rule (stop strings, stop sequences) that decoding and the response mask share. The rollout engine
(``aitraining_pl.rollout``) samples with ``models.decoding.sample_responses``, which decodes with these
settings itself where it can (dropping ended rows) and calls ``hf_generate`` otherwise."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from transformers import GenerationConfig as HFGenerationConfig
from transformers import StoppingCriteria, StoppingCriteriaList


class StopRule:
    """Stop strings and stop sequences of token ids, checked on the response tokens only.

    A response prefix ``ids`` stops when its decoding (special tokens decoded as their text) contains one of
    ``stop_strings``, or when it ends with one of ``stop_sequences``. ``generate`` checks every prefix as it
    grows (``ResponseStoppingCriteria``) and ``ends`` finds the first stopping prefix afterwards, so both agree.

    Args:
        tokenizer: decodes responses for ``stop_strings`` (may be None when there are none).
        stop_strings: texts that end a response.
        stop_sequences: token-id sequences that end a response.
        skip_special_tokens: look for stop strings in the text without special tokens (default: special tokens
            are decoded as their text, as transformers' own stop strings see them).
    """

    def __init__(
        self,
        tokenizer=None,
        stop_strings: Sequence[str] | None = None,
        stop_sequences: Sequence[Sequence[int]] | None = None,
        skip_special_tokens: bool = False,
    ):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.stop_strings = [s for s in (stop_strings or []) if s]
        self.stop_sequences = [[int(t) for t in s] for s in (stop_sequences or []) if len(s)]
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")

    def __bool__(self) -> bool:
        return bool(self.stop_strings or self.stop_sequences)

    def stops(self, ids: list[int]) -> bool:
        """Whether the response prefix ``ids`` has reached a stop."""
        if any(len(ids) >= len(s) and ids[-len(s) :] == s for s in self.stop_sequences):
            return True
        return bool(self.stop_strings) and self._contains_string(ids)

    def _contains_string(self, ids: list[int]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return any(s in text for s in self.stop_strings)

    def ends(self, response_ids: torch.Tensor) -> torch.Tensor:
        """(N,) index of the token at which a response first stops; -1 where it never does."""
        ends = torch.full((response_ids.shape[0],), -1, dtype=torch.long, device=response_ids.device)
        if not self:
            return ends
        for row, ids in enumerate(response_ids.tolist()):
            seq_hit = any(_find(ids, s) >= 0 for s in self.stop_sequences)
            if not (seq_hit or (self.stop_strings and self._contains_string(ids))):
                continue  # no prefix can stop if the whole response does not
            ends[row] = next(t for t in range(len(ids)) if self.stops(ids[: t + 1]))
        return ends


def _find(ids: list[int], seq: list[int]) -> int:
    """Start of the first occurrence of ``seq`` in ``ids``; -1 where none."""
    return next((i for i in range(len(ids) - len(seq) + 1) if ids[i : i + len(seq)] == seq), -1)


class ResponseStoppingCriteria(StoppingCriteria):
    """``generate``'s view of a ``StopRule``: rows whose response (tokens after the first ``prompt_length``)
    stops; rows that already hold an end token are finished and not decoded again."""

    def __init__(self, rule: StopRule, prompt_length: int, end_ids: Sequence[int]):
        self.rule, self.prompt_length, self.end_ids = rule, prompt_length, list(end_ids)

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        response = input_ids[:, self.prompt_length :]
        done = torch.zeros(response.shape[0], dtype=torch.bool, device=input_ids.device)
        ends = torch.tensor(self.end_ids, dtype=response.dtype, device=response.device)
        finished = torch.isin(response, ends).any(1).tolist()
        for row, ids in enumerate(response.tolist()):
            done[row] = not finished[row] and self.rule.stops(ids)
        return done


class SampledTokens(NamedTuple):
    """What a sampler returned: response ids (N, R) and, when asked, the per-step logits (N, R, V) before and
    after the sampling processors (temperature, top-k, top-p); a backend that returns no logits (vLLM) gives
    the sampled tokens' log-probs under the distribution sampled from (N, R) instead. A generation server also
    says which weights sampled each token (``token_versions``)."""

    response_ids: torch.Tensor
    logits: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    sampling_logprobs: torch.Tensor | None = None
    #: (N, R) int64: the step of the weights (version ``run:step``) that sampled each token, -1 after the end; one
    #: response may span two versions when a push landed while it was generated (``generation.servers.hf_server``)
    token_versions: torch.Tensor | None = None


def hf_generation_config(
    config: Any, end_ids: Sequence[int], pad_token_id: int, with_logprobs: bool = False
) -> HFGenerationConfig:
    """A complete ``transformers.GenerationConfig`` for ``config`` (an ``aitraining_pl.rollout.GenerationConfig``:
    ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_p``, ``top_k``): every logits processor that could
    change the sampled distribution is set to its neutral value (``top_k=0`` in particular: transformers' default
    is 50), the end ids are ours."""
    sampling = (
        dict(do_sample=True, temperature=float(config.temperature), top_p=float(config.top_p), top_k=int(config.top_k))
        if config.do_sample
        else dict(do_sample=False)
    )
    return HFGenerationConfig(
        max_new_tokens=config.max_new_tokens, min_new_tokens=0, eos_token_id=list(end_ids) or None,
        pad_token_id=pad_token_id, num_beams=1, num_return_sequences=1, repetition_penalty=1.0,
        encoder_repetition_penalty=1.0, no_repeat_ngram_size=0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
        renormalize_logits=False, use_cache=True, return_dict_in_generate=True, output_logits=with_logprobs,
        output_scores=with_logprobs, **sampling,
    )  # fmt: skip


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (the one whose ``generation_config`` ``generate`` reads)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextlib.contextmanager
def _blank_generation_config(model: torch.nn.Module):
    """Swap the model's ``generation_config`` for a blank one: ``generate`` fills every field we leave unset
    from it, so a checkpoint's settings would otherwise apply."""
    hf = hf_model(model)
    saved = getattr(hf, "generation_config", None)
    hf.generation_config = HFGenerationConfig()
    try:
        yield
    finally:
        hf.generation_config = saved


@torch.no_grad()
def hf_generate(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    config: HFGenerationConfig,
    stopping_criteria: StoppingCriteriaList | None = None,
) -> SampledTokens:
    """The one ``model.generate`` call of the project, for left-padded ``prompt_ids`` (N, P), with ``config``
    (``hf_generation_config``) and nothing from the model's own generation config. ``synced_gpus`` is off: under
    FSDP2 the caller gathers the weights first (``models.sharding.gathered``), so ranks need not step together
    (``generate`` would otherwise turn it on for a sharded model in a process group)."""
    with _blank_generation_config(model):
        out = model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            generation_config=config,
            stopping_criteria=stopping_criteria or StoppingCriteriaList(),
            synced_gpus=False,
        )
    return SampledTokens(out.sequences[:, prompt_ids.shape[1] :], _stacked(out.logits), _stacked(out.scores))


def _stacked(steps: tuple[torch.Tensor, ...] | None) -> torch.Tensor | None:
    """Per-step (N, V) tensors as one (N, R, V) float tensor."""
    return torch.stack(steps, 1).float() if steps else None
