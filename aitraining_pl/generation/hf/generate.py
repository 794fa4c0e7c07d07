"""The Hugging Face side of sampling: the one ``generate`` call of the project (``hf_generate``), with a
complete explicit ``transformers.GenerationConfig`` and the model's own generation config out of the way, and
``generate``'s view of the stop rule (``ResponseStoppingCriteria``; the rule itself, ``StopRule``, is the sampling
seam's: ``generation.backend``). The HF backend (``generation.hf.backend``) samples with
``generation.hf.decoding.sample_responses``, which decodes with these settings itself where it can (dropping ended
rows) and calls ``hf_generate`` otherwise."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig as HFGenerationConfig
from transformers import StoppingCriteria, StoppingCriteriaList

from aitraining_pl.generation.backend import SampledTokens, StopRule
from aitraining_pl.models.lora import base_model


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


@contextlib.contextmanager
def _blank_generation_config(model: torch.nn.Module):
    """Swap the model's ``generation_config`` for a blank one: ``generate`` fills every field we leave unset
    from it, so a checkpoint's settings would otherwise apply."""
    hf = base_model(model)
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
