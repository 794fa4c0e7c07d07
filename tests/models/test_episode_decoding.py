"""The episode decoder (``generation.hf.episode_decoding``) on the architecture matrix: the KV cache kept across
turns draws what re-prefilling the whole history draws, and every token runs through the model once; architectures
whose cache cannot hold padded parked rows (sliding windows, hybrid state-space layers) fall back to re-prefilling.
And the decode loop's ``park`` hook (``generation.hf.decoding.sample_steps``), which the episode decoder keeps ended
rows with."""

from __future__ import annotations

import pytest
import torch
from architectures import HYBRID, MATRIX, SLIDING, model_config, names

from aitraining_pl.generation.hf.decoding import Forward, decode, prefill, sample_steps
from aitraining_pl.generation.hf.episode_decoding import decode_episodes
from aitraining_pl.generation.hf.generate import hf_generation_config
from aitraining_pl.models import build_causal_lm
from aitraining_pl.rollout import GenerationConfig

ENDS = [5, 9, 11, 13]  # frequent enough that turns end at different steps, rare enough that some hit the limit
#: rows that cannot keep a plain full-attention cache across turns: the decoder re-prefills each turn for them
REPREFILLED = names(SLIDING) + names(HYBRID)


@pytest.fixture(scope="module")
def models():
    """Each matrix model built once for the module (eval: no dropout)."""
    built: dict[str, torch.nn.Module] = {}

    def get(name: str) -> torch.nn.Module:
        if name not in built:
            built[name] = build_causal_lm(model_config(name), seed=0).eval()
        return built[name]

    return get


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded prompts of 4, 6 and 2 tokens."""
    ids = torch.randint(3, 90, (3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _config(max_new_tokens: int = 6):
    settings = GenerationConfig(max_new_tokens=max_new_tokens, temperature=1.0)
    return hf_generation_config(settings, ENDS, pad_token_id=0)


def _respond(turn, rows, tokens, ended):
    """Row r plays 2 + r % 3 turns; replies of 1-4 tokens, so parked rows have different lengths."""
    return [None if turn >= 1 + r % 3 else [40 + r] * (1 + (r + turn) % 4) for r in rows]


def _episodes(model, reprefill: bool):
    """The episodes (2 rows per prompt) from seed 1; per forward pass, the real tokens it ran through the model and
    the logits of each row's last position."""
    fed: list[int] = []
    logits: list[torch.Tensor] = []

    def record(module, args, kwargs, out):
        new = kwargs["input_ids"].shape[1]
        fed.append(int(kwargs["attention_mask"][:, -new:].sum()))
        logits.append(out.logits[:, -1].float())

    handle = model.register_forward_hook(record, with_kwargs=True)
    try:
        torch.manual_seed(1)
        return decode_episodes(model, *_prompts(), _config(), _respond, None, 2, reprefill), fed, logits
    finally:
        handle.remove()


@pytest.mark.parametrize("name", names(MATRIX))
def test_kv_cache_across_turns_draws_what_reprefilling_draws_and_runs_each_token_once(models, name):
    """Kept cache vs the whole history prefilled again each turn: the same tokens, turn ends and end flags from the
    same seed, and the logits each token was drawn from. With the cache kept, each token runs through the model
    once (the prompts once, not once per sample; each turn's last sampled token with the reply that follows it);
    the rows in ``REPREFILLED`` fall back to re-prefilling, with the same bookkeeping as ``reprefill=True``."""
    model = models(name)
    kept, kept_fed, kept_logits = _episodes(model, reprefill=False)
    again, again_fed, again_logits = _episodes(model, reprefill=True)
    assert kept.tokens == again.tokens and kept.from_model == again.from_model
    assert kept.turn_ends == again.turn_ends and kept.turn_ended == again.turn_ended
    turns = [len(ends) for ends in kept.turn_ends]
    assert turns == [2, 3, 4, 2, 3, 4] and len(kept.prefilled) == 4  # episodes of 2-4 turns
    flags = [flag for row in kept.turn_ended for flag in row]
    assert any(flags) and not all(flags), "turns must end both by an end token and by max_new_tokens"
    if name in REPREFILLED:
        assert kept.prefilled == again.prefilled  # each turn prefilled the whole history: the fallback ran
        return
    _, mask = _prompts()
    once = int(mask.sum()) + sum(len(tokens) - 1 for tokens in kept.tokens)  # the last sampled token is never fed
    assert sum(kept_fed) == once
    assert sum(kept.prefilled) + sum(kept.sampled) - sum(turns) == once  # prefills + decode steps, as counted
    assert sum(again_fed) > once + sum(kept.prefilled[1:])  # re-prefilling runs the histories again
    # the same batches step by step (a reply's prefill where the history is prefilled again): the same logits
    assert [t.shape for t in kept_logits] == [t.shape for t in again_logits]
    for got, want in zip(kept_logits, again_logits):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_park_sees_each_ended_row_once_with_its_cache_at_its_end(models):
    """``sample_steps``' ``park`` hook gets every row once, when it ends (end token, or all rows going at the last
    step), before it leaves the batch: its cache and mask then cover the prompt and every sampled token but the
    last (not run through the model yet). A hook changes nothing that is drawn: the tokens are ``decode``'s."""
    model, (ids, mask), config = models("llama"), _prompts(), _config(max_new_tokens=8)
    parked = []

    def park(rows, index, batch):
        layer = batch.cache.layers[0]
        assert layer.keys.shape[-2] == batch.mask.shape[1] and batch.mask.shape[0] == batch.logits.shape[0]
        parked.append((rows.tolist(), batch.mask[index].sum(1).tolist(), batch.mask.shape[1]))

    forward = Forward(model)
    torch.manual_seed(1)
    drawn = sample_steps(forward, prefill(forward, ids, mask, 2), config, park=park)
    torch.manual_seed(1)
    assert torch.equal(drawn.tokens, decode(model, ids, mask, config, None, 2).response_ids)
    rows = [r for group, _, _ in parked for r in group]
    assert sorted(rows) == list(range(6)) and len(parked) >= 2  # each row once, in more than one group
    lengths, real = drawn.lengths.tolist(), mask.repeat_interleave(2, 0).sum(1).tolist()
    for group, seen, width in parked:
        assert width == ids.shape[1] + lengths[group[0]] - 1  # the batch as it stood at the group's last step
        assert seen == [real[r] + lengths[r] - 1 for r in group]
    ended = torch.isin(drawn.tokens, torch.tensor(ENDS))
    assert drawn.ended.tolist() == ended.any(1).tolist()
    assert lengths == [int(row.nonzero()[0]) + 1 if row.any() else 8 for row in ended]
