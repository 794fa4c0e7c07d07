"""Multi-turn decoding: every unfinished episode of a batch decodes its turn together, and the KV cache is kept across
turns, so each turn prefills only what is new (the environment's reply).

A turn is ``generation.hf.decoding.sample_steps``, the loop ``decode`` runs (the same warpers, draws and end rule;
each row leaves the batch when its turn ends), with a ``park`` hook: a row that ends its turn is *parked* (its KV
cache rows copied aside; the rows that end at the turn's last step keep their tensors) instead of thrown away. When
every row has ended its turn, ``respond`` (the episode runner) gives each row the tokens to append (the environment's
reply rendered by the chat template) or None when its episode is over. The parked caches of the rows that go on are
copied once into one batch of preallocated buffers (shorter ones padded on the right, with room for the reply and the
next turn, which write in place), and one forward pass prefills, per row, its turn's last sampled token (never fed to
the model yet) and the reply tokens (left padded, so the last position of every row is real). Padding inside the
cache is masked out of attention; positions count real tokens only, so the logits equal those of the dense sequence
(prompt, sampled tokens, reply tokens) that training scores (``losses.positions_from_mask``). Tokens enter the
sequence exactly as sampled and as rendered: the model's text is never re-tokenised.

``reprefill=True``, and models whose cache is not made of plain full-attention layers (``plain_cache(cache,
sliding=False)``: sliding-window layers would count the padding inside the cache as positions; hybrid state-space
caches hold no rows to park), run the loop around ``generate`` instead: each turn samples from the whole history,
prefilled again (what the benchmark compares against). With one turn and the same seed, both draw what the
single-response decoder draws. That loop, ``decode_turns``, takes any per-turn sampler of whole histories: the vLLM
backend is one (its prefix cache keeps the earlier turns' KV, so only the new tokens are prefilled there too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import NamedTuple

import torch
from transformers import DynamicCache
from transformers import GenerationConfig as HFGenerationConfig

from aitraining_pl.generation.backend import StopRule
from aitraining_pl.generation.hf.decoding import (
    DecodeBatch,
    Forward,
    preallocated_cache,
    prefill,
    sample_responses,
    sample_steps,
)
from aitraining_pl.models.routing_replay import recording
from aitraining_pl.models.tokens import padded

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
    sampling_logprobs: list[list[float]] | None = None
    #: per row, the experts (T, layers, k) of its prompt's real tokens then of every token fed to the model after it,
    #: in order (an MoE model's, ``decode_episodes`` with ``record_routes``): ``routing_replay.placed_routes``' rows
    routes: list[list[torch.Tensor]] | None = None

    @classmethod
    def empty(cls, n: int) -> EpisodeTokens:
        """No tokens yet for ``n`` episode rows."""
        return cls(*([[] for _ in range(n)] for _ in range(4)))

    def add_turn(
        self, row: int, tokens: list[int], ended: bool, reply: list[int] | None, logprobs: list[float] | None = None
    ) -> None:
        """Append one turn of ``row``: its sampled ``tokens`` (and their ``logprobs``, when kept), then the
        environment's ``reply`` (None: the episode is over)."""
        self.tokens[row] += tokens
        self.from_model[row] += [True] * len(tokens)
        self.turn_ends[row].append(len(self.tokens[row]) - 1)
        self.turn_ended[row].append(ended)
        if self.sampling_logprobs is not None:
            self.sampling_logprobs[row] += list(logprobs) + [0.0] * len(reply or ())
        if reply is not None:
            self.tokens[row] += list(reply)
            self.from_model[row] += [False] * len(reply)


class TurnSample(NamedTuple):
    """One turn of ``decode_turns``' sampler, per row: the tokens up to the turn's end, whether it ended (end
    token or stop; False: ``max_new_tokens``), their log-probs under the distribution sampled from (or None);
    and the tokens the sampler prefilled (not found in a cache)."""

    tokens: list[list[int]]
    ended: list[bool]
    sampling_logprobs: list[list[float]] | None
    prefilled: int


#: ``sample(ids, mask, num_samples, rows)``: one turn for each left-padded history (rows ``repeat_interleave``d),
#: ``rows`` the episode rows of the turn (every ``num_samples``-th one is a history's)
TurnSampler = Callable[[torch.Tensor, torch.Tensor, int, list[int]], TurnSample]


class _Parked:
    """KV cache rows, attention mask and last positions of the episode rows whose turn has ended (``sample_steps``'
    ``park`` hook)."""

    def __init__(self, rows: list[int]):
        self.rows = rows  #: the episode row of each response row of the turn
        self.groups: list[tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]] = []

    def add(self, at: torch.Tensor, index: torch.Tensor, batch: DecodeBatch) -> None:
        """Park rows ``index`` of the batch (response rows ``at``): copies, or the batch's own tensors when it is
        every row (the turn is over, nothing writes to them again)."""
        whole = index.numel() == batch.mask.shape[0]
        pick = (lambda t: t) if whole else (lambda t: t.index_select(0, index))
        kv = [(pick(layer.keys), pick(layer.values)) for layer in batch.cache.layers]
        self.groups.append(([self.rows[i] for i in at.tolist()], kv, pick(batch.mask), pick(batch.position)))

    def take(self, rows: list[int], room: int) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """One cache of ``rows`` (in this order), right padded to the longest, with ``room`` more positions
        preallocated (``preallocated_cache``: the reply's prefill and the next turn write in place); their mask and
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
        self.groups = []
        return preallocated_cache(layers, length), masks, positions

    def resume(self, forward: Forward, going: list[tuple[int, list[int]]], pad: int, steps: int) -> DecodeBatch:
        """The batch of the ``going`` rows (episode row, tokens to prefill: the turn's last sampled token and the
        reply) after one forward pass over those tokens, left padded, on their parked caches."""
        rows, chunks = [r for r, _ in going], [chunk for _, chunk in going]
        ids, new = padded(chunks, pad, "left", width=1, device=self.groups[0][2].device)  # the parked masks' device
        cache, mask, position = self.take(rows, new.shape[1] + steps)
        mask = torch.cat([mask, new], dim=1)
        positions = position + new.cumsum(1)
        logits, cache = forward(ids, mask, positions, cache)
        return DecodeBatch(logits, cache, mask, positions[:, -1:])


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
    record_routes: bool = False,
) -> EpisodeTokens:
    """Decode episodes of ``num_samples`` rows per left-padded prompt (B, P) (rows in ``repeat_interleave``
    order), ``config.max_new_tokens`` tokens per turn at most, until ``respond`` ends every episode (see the
    module docstring). ``record_routes``: an MoE model's routes (``EpisodeTokens.routes``; not on the ``generate``
    path, ``reprefill``)."""
    forward = Forward(model)
    with recording(model) if record_routes and not reprefill else contextlib.nullcontext() as recorder:
        batch = None if reprefill else prefill(forward, prompt_ids, prompt_mask, num_samples, sliding=False)
        if batch is None:
            sample = hf_turn_sampler(model, config, stop_rule)
            return decode_turns(sample, prompt_ids, prompt_mask, int(config.pad_token_id), respond, num_samples)
        rows = list(range(prompt_ids.shape[0] * num_samples))
        out = EpisodeTokens.empty(len(rows))
        routes = None
        if recorder is not None:  # each prompt's real tokens, for each of its rows
            first = recorder.take()
            first = first.reshape(*prompt_ids.shape, *first.shape[1:])
            keep = prompt_mask.bool()
            routes = out.routes = [[first[b][keep[b]]] for b in range(len(keep)) for _ in range(num_samples)]
        out.prefilled.append(int(prompt_mask.sum()))
        for turn in count():
            parked = _Parked(rows)
            drawn = sample_steps(forward, batch, config, stop_rule, parked.add, recorder=recorder)
            tokens = [row[:n] for row, n in zip(drawn.tokens.tolist(), drawn.lengths.tolist())]
            ended = drawn.ended.tolist()
            out.sampled.append(sum(map(len, tokens)))
            replies = respond(turn, rows, tokens, ended)
            for r, turn_tokens, turn_ended, reply in zip(rows, tokens, ended, replies):
                out.add_turn(r, turn_tokens, turn_ended, reply)
            if routes is not None and drawn.routes is not None:  # the turn's tokens fed back within it
                for i, (r, n) in enumerate(zip(rows, drawn.lengths.tolist())):
                    routes[r].append(drawn.routes[i, : n - 1])
            going = [(r, [t[-1], *reply]) for r, t, reply in zip(rows, tokens, replies) if reply is not None]
            if not going:
                return out
            out.prefilled.append(sum(len(chunk) for _, chunk in going))
            batch = parked.resume(forward, going, int(config.pad_token_id), config.max_new_tokens)
            rows = [r for r, _ in going]
            if routes is not None:  # the turn's last token and the reply (left padded in that pass)
                fed = recorder.take()
                fed = fed.reshape(len(going), -1, *fed.shape[1:])
                for i, (r, chunk) in enumerate(going):
                    routes[r].append(fed[i, fed.shape[1] - len(chunk) :].to(torch.int16))


def hf_turn_sampler(model, config: HFGenerationConfig, stop_rule: StopRule | None) -> TurnSampler:
    """``decode_turns``' sampler on the model's own decoder: each turn prefills the whole history again (the loop
    around ``generate``)."""
    ends = set(config.eos_token_id or [])

    def sample(ids: torch.Tensor, mask: torch.Tensor, samples: int, rows=None) -> TurnSample:
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
    out = EpisodeTokens.empty(n)
    prompts = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask)]
    prompts = [p for p in prompts for _ in range(num_samples)]
    rows, ids, mask, samples = list(range(n)), prompt_ids, prompt_mask, num_samples
    for turn in count():
        drawn = sample(ids, mask, samples, rows)
        out.prefilled.append(drawn.prefilled)
        out.sampled.append(sum(len(t) for t in drawn.tokens))
        if drawn.sampling_logprobs is not None and out.sampling_logprobs is None:
            out.sampling_logprobs = [[] for _ in range(n)]
        replies = respond(turn, rows, drawn.tokens, drawn.ended)
        logprobs = drawn.sampling_logprobs if drawn.sampling_logprobs is not None else [None] * len(rows)
        for r, tokens, ended, reply, row_logprobs in zip(rows, drawn.tokens, drawn.ended, replies, logprobs):
            out.add_turn(r, tokens, ended, reply, row_logprobs)
        going = [r for r, reply in zip(rows, replies) if reply is not None]
        if not going:
            return out
        rows, samples = going, 1
        ids, mask = padded([prompts[r] + out.tokens[r] for r in rows], pad, "left", width=1, device=prompt_ids.device)
