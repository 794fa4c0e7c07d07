"""Multi-turn decoding: every unfinished episode of a batch decodes its turn together, and the KV cache is kept across
turns, so each turn prefills only what is new (the environment's reply).

A turn decodes as ``models.decoding.decode`` does (the same warpers, draws and end rule; each row leaves the batch
when its turn ends), but a row that ends its turn is *parked* (its KV cache rows copied aside; the rows that end at
the turn's last step keep their tensors) instead of thrown away. When every row has ended its turn, ``respond`` (the
episode runner) gives each row the tokens to append (the environment's reply rendered by the chat template) or None
when its episode is over. The parked caches of the rows that go on are copied once into one batch of preallocated
buffers (shorter ones padded on the right, with room for the reply and the next turn, which write in place), and one
forward pass prefills, per row, its turn's last sampled token (never fed to the model yet) and the reply tokens
(left padded, so the last position of every row is real). Padding inside the cache is masked out of attention;
positions count real tokens only, so the logits equal those of the dense sequence (prompt, sampled tokens, reply
tokens) that training scores (``losses.positions_from_mask``). Tokens enter the sequence exactly as sampled and as
rendered: the model's text is never re-tokenised.

``reprefill=True`` (and models whose cache is not made of plain full-attention layers) runs the loop around
``generate`` instead: each turn samples from the whole history, prefilled again (what the benchmark compares
against). With one turn and the same seed, both draw what the single-response decoder draws. That loop,
``decode_turns``, takes any per-turn sampler of whole histories: the vLLM backend is one (its prefix cache keeps the
earlier turns' KV, so only the new tokens are prefilled there too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers import DynamicCache
from transformers import GenerationConfig as HFGenerationConfig

from aitraining_pl.losses import positions_from_mask
from aitraining_pl.models.decoding import (
    DynamicLayer,
    _Forward,
    _preallocate,
    _PreallocatedLayer,
    next_tokens,
    sample_responses,
)
from aitraining_pl.models.decoding import warpers as make_warpers
from aitraining_pl.models.generation import StopRule

#: ``respond(turn, rows, turn_tokens, turn_ended)`` -> per row the tokens to append, or None: episode over
Respond = Callable[[int, list[int], list[list[int]], list[bool]], list[list[int] | None]]


@dataclass
class EpisodeTokens:
    """Per episode row: every token after the prompt, in order, and where each came from."""

    tokens: list[list[int]]
    from_model: list[list[bool]]  #: True: sampled by the model; False: the environment's (rendered) reply
    turn_ends: list[list[int]]  #: index in ``tokens`` of each turn's last sampled token
    turn_ended: list[list[bool]]  #: each turn ended by an end token or stop (False: tokens-per-turn limit)
    prefilled: list[int] = field(default_factory=list)  #: real tokens run through the model before each turn
    sampled: list[int] = field(default_factory=list)  #: tokens sampled in each turn
    #: per row, the sampler's log-prob of each token (0 on the environment's), when the sampler gives them (vLLM)
    sampled_logprobs: list[list[float]] | None = None


class TurnSample(NamedTuple):
    """One turn of ``decode_turns``' sampler, per row: the tokens up to the turn's end, whether it ended (end
    token or stop; False: ``max_new_tokens``), their log-probs under the distribution sampled from (or None);
    and the tokens the sampler prefilled (not found in a cache)."""

    tokens: list[list[int]]
    ended: list[bool]
    logprobs: list[list[float]] | None
    prefilled: int


#: ``sample(ids, mask, num_samples)``: one turn for each left-padded history (rows ``repeat_interleave``d)
TurnSampler = Callable[[torch.Tensor, torch.Tensor, int], TurnSample]


def _full_attention(cache) -> bool:
    layers = getattr(cache, "layers", None)
    return (
        type(cache) is DynamicCache
        and bool(layers)
        and all(type(x) in (DynamicLayer, _PreallocatedLayer) for x in layers)
    )


class _Parked:
    """KV cache rows, attention mask and last positions of rows whose turn has ended."""

    def __init__(self):
        self.groups: list[tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]] = []

    def add(self, rows: list[int], cache, index: torch.Tensor, mask: torch.Tensor, position: torch.Tensor) -> None:
        """Park rows ``index`` of the batch (copies; the batch's own tensors when it is every row: the turn is
        over, nothing writes to them again)."""
        whole = index.numel() == mask.shape[0]
        pick = (lambda t: t) if whole else (lambda t: t.index_select(0, index))
        kv = [(pick(layer.keys), pick(layer.values)) for layer in cache.layers]
        self.groups.append((rows, kv, pick(mask), pick(position)))

    def take(self, rows: list[int], room: int) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """One cache of ``rows`` (in this order), right padded to the longest, with ``room`` more positions
        preallocated (``_PreallocatedLayer``: the reply's prefill and the next turn write in place); their mask and
        positions. Each parked row is copied once."""
        where = {r: (g, i) for g, (members, *_) in enumerate(self.groups) for i, r in enumerate(members)}
        length = max(self.groups[where[r][0]][2].shape[1] for r in rows)
        _, kv, mask, position = self.groups[0]
        n = len(rows)
        layers = [tuple(t.new_empty(n, t.shape[1], length + room, t.shape[-1]) for t in pair) for pair in kv]
        masks, positions = mask.new_zeros(n, length), position.new_empty(n, position.shape[1])
        for to, r in enumerate(rows):
            g, at = where[r]
            _, kv, mask, position = self.groups[g]
            filled = mask.shape[1]
            for buffers, pair in zip(layers, kv):
                for buffer, t in zip(buffers, pair):
                    buffer[to, :, :filled].copy_(t[at])
                    buffer[to, :, filled:length].zero_()  # padding: masked out, never uninitialised (0 * NaN)
            masks[to, :filled], positions[to] = mask[at], position[at]
        cache = DynamicCache()
        cache.layers = [_PreallocatedLayer.over(keys, values, length) for keys, values in layers]
        self.groups = []
        return cache, masks, positions


def _left_padded(chunks: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(c) for c in chunks))
    ids = torch.full((len(chunks), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, chunk in enumerate(chunks):
        if chunk:
            ids[i, width - len(chunk) :] = torch.tensor(chunk, device=device)
            mask[i, width - len(chunk) :] = 1
    return ids, mask


def _turn_end(ids: list[int], ends: set[int], stop_rule: StopRule | None) -> tuple[int, bool]:
    """Length of a sampled turn up to its end (end token or stop), and whether it ended."""
    for t, token in enumerate(ids):
        if token in ends or (stop_rule and stop_rule.stops(ids[: t + 1])):
            return t + 1, True
    return len(ids), False


@torch.no_grad()
def decode_episodes(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    config: HFGenerationConfig,
    respond: Respond,
    stop_rule: StopRule | None = None,
    num_samples: int = 1,
    reprefill: bool = False,
) -> EpisodeTokens:
    """Decode episodes of ``num_samples`` rows per left-padded prompt (B, P) (rows in ``repeat_interleave``
    order), ``config.max_new_tokens`` tokens per turn at most, until ``respond`` ends every episode (see the
    module docstring)."""
    n = prompt_ids.shape[0] * num_samples
    out = EpisodeTokens([[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)])
    ends = list(config.eos_token_id or [])
    step = _Forward(model)
    if not reprefill:
        logits, cache = step(prompt_ids, prompt_mask, positions_from_mask(prompt_mask))
    if reprefill or not _full_attention(cache):
        sample = hf_turn_sampler(model, config, stop_rule)
        return decode_turns(sample, prompt_ids, prompt_mask, int(config.pad_token_id), respond, num_samples)
    out.prefilled.append(int(prompt_mask.sum()))
    mask, position = prompt_mask, positions_from_mask(prompt_mask)[:, -1:]
    if num_samples > 1:
        cache.batch_repeat_interleave(num_samples)
        logits, mask, position = (t.repeat_interleave(num_samples, 0) for t in (logits, mask, position))
    rows = list(range(n))
    for turn in range(1 << 30):
        parked, turn_tokens, turn_ended = _decode_turn(
            step, cache, logits, mask, position, rows, config, ends, stop_rule
        )
        out.sampled.append(sum(len(t) for t in turn_tokens.values()))
        replies = respond(turn, rows, [turn_tokens[r] for r in rows], [turn_ended[r] for r in rows])
        going = []
        for r, reply in zip(rows, replies):
            out.tokens[r] += turn_tokens[r]
            out.from_model[r] += [True] * len(turn_tokens[r])
            out.turn_ends[r].append(len(out.tokens[r]) - 1)
            out.turn_ended[r].append(turn_ended[r])
            if reply is not None:
                out.tokens[r] += list(reply)
                out.from_model[r] += [False] * len(reply)
                going.append((r, [turn_tokens[r][-1], *reply]))
        if not going:
            return out
        rows = [r for r, _ in going]
        ids, new = _left_padded([chunk for _, chunk in going], int(config.pad_token_id), prompt_ids.device)
        cache, mask, position = parked.take(rows, new.shape[1] + config.max_new_tokens)
        mask = torch.cat([mask, new], dim=1)
        positions = position + new.cumsum(1)
        out.prefilled.append(int(new.sum()))
        logits, cache = step(ids, mask, positions, cache)
        position = positions[:, -1:]
    return out


def _decode_turn(step, cache, logits, mask, position, rows, config, ends, stop_rule):
    """One turn of every row of the batch; the parked caches, sampled tokens and ended flags by row."""
    device, warp = logits.device, make_warpers(config)
    end_ids = torch.tensor(ends, dtype=torch.long, device=device)
    batch = torch.tensor(rows, device=device)
    buffer = torch.full((len(rows), config.max_new_tokens), int(config.pad_token_id), dtype=torch.long, device=device)
    index = torch.arange(len(rows), device=device)  # each batch row's row in ``buffer``
    _preallocate(cache, mask.shape[1] + config.max_new_tokens)
    parked, tokens_by_row, ended_by_row = _Parked(), {}, {}
    for t in range(config.max_new_tokens):
        scores = warp(buffer[index, :t], logits)
        tokens = next_tokens(scores, config.do_sample)
        buffer[index, t] = tokens
        going = ~torch.isin(tokens, end_ids)
        if stop_rule:
            for i in going.nonzero().flatten().tolist():
                going[i] = not stop_rule.stops(buffer[index[i], : t + 1].tolist())
        ended = ~going
        if t + 1 == config.max_new_tokens:
            going[:] = False
        if not going.all():
            done = (~going).nonzero().flatten()
            members = batch[done].tolist()
            parked.add(members, cache, done, mask, position)
            for i, r in zip(done.tolist(), members):
                tokens_by_row[r] = buffer[index[i], : t + 1].tolist()
                ended_by_row[r] = bool(ended[i])
            if not going.any():
                break
            keep = going.nonzero().flatten()
            cache.batch_select_indices(keep)
            batch, index, mask, position, tokens = batch[keep], index[keep], mask[keep], position[keep], tokens[keep]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        position = position + 1
        logits, cache = step(tokens[:, None], mask, position, cache)
    return parked, tokens_by_row, ended_by_row


def hf_turn_sampler(model, config: HFGenerationConfig, stop_rule: StopRule | None) -> TurnSampler:
    """``decode_turns``' sampler on the model's own decoder: each turn prefills the whole history again (the loop
    around ``generate``)."""
    ends = set(config.eos_token_id or [])

    def sample(ids: torch.Tensor, mask: torch.Tensor, samples: int) -> TurnSample:
        sampled = sample_responses(model, ids, mask, config, stop_rule, True, samples).response_ids.tolist()
        turns = [_turn_end(row, ends, stop_rule) for row in sampled]
        return TurnSample(
            [row[:n] for row, (n, _) in zip(sampled, turns)], [e for _, e in turns], None, int(mask.sum())
        )

    return sample


def decode_turns(
    sample: TurnSampler,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    pad: int,
    respond: Respond,
    num_samples: int,
) -> EpisodeTokens:
    """Episodes of ``num_samples`` rows per left-padded prompt, each turn sampled by ``sample`` from every
    unfinished episode's whole token sequence (prompt, sampled tokens, replies; never re-tokenised)."""
    n = prompt_ids.shape[0] * num_samples
    out = EpisodeTokens([[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)])
    prompts = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask)]
    prompts = [p for p in prompts for _ in range(num_samples)]
    rows, ids, mask, samples = list(range(n)), prompt_ids, prompt_mask, num_samples
    for turn in range(1 << 30):
        drawn = sample(ids, mask, samples)
        out.prefilled.append(drawn.prefilled)
        out.sampled.append(sum(len(t) for t in drawn.tokens))
        if drawn.logprobs is not None and out.sampled_logprobs is None:
            out.sampled_logprobs = [[] for _ in range(n)]
        replies = respond(turn, rows, drawn.tokens, drawn.ended)
        going = []
        for i, (r, tokens, reply) in enumerate(zip(rows, drawn.tokens, replies)):
            out.tokens[r] += tokens
            out.from_model[r] += [True] * len(tokens)
            out.turn_ends[r].append(len(out.tokens[r]) - 1)
            out.turn_ended[r].append(drawn.ended[i])
            if out.sampled_logprobs is not None:
                out.sampled_logprobs[r] += list(drawn.logprobs[i]) + [0.0] * len(reply or ())
            if reply is not None:
                out.tokens[r] += list(reply)
                out.from_model[r] += [False] * len(reply)
                going.append(r)
        if not going:
            return out
        rows, samples = going, 1
        ids, mask = _left_padded([prompts[r] + out.tokens[r] for r in rows], pad, prompt_ids.device)
    return out
