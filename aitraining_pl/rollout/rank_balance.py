"""Online rows balanced across data-parallel ranks (``balance_ranks``; issue 50): after sampling, every rank's rollout
is re-padded to the ranks' common prompt and response lengths and its prompt groups (a prompt's G samples, which
the group advantage needs together) are dealt to the ranks so that each trains on about the same number of real
tokens, as verl's ``balance_batch`` deals a step's rows (Karmarkar-Karp over the data-parallel ranks, equal group
counts per rank). The rows move with one ``all_to_all_single`` per per-row tensor (uneven splits; each rank sends
only the rows another rank takes), the texts, reward components and prompts with one ``all_gather_object``.

What moves is what the update needs: tokens, masks, ended flags, scores, the sampler's log-probs, token versions and
MoE routes. Multi-turn episodes and per-row images (``vision``) stay where they were sampled: their rows carry
objects that do not re-pad (refused at the call, naming them).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from aitraining_pl.errors import ConfigError
from aitraining_pl.losses.micro_batches import karmarkar_karp
from aitraining_pl.rollout.batch import RolloutBatch

#: RolloutBatch fields laid out as (N, P + R, ...) (prompt left padded, response right padded) and as (N, R, ...)
FULL_FIELDS = ("input_ids", "attention_mask", "routes")
RESPONSE_FIELDS = ("mask", "token_scores", "sampling_logprobs", "token_versions")
ROW_FIELDS = ("ended", "scores")


def check_balanceable(rollout: RolloutBatch, owner: str) -> None:
    """Refuse a rollout whose rows cannot move between ranks (episodes, per-row images)."""
    held = [name for name in ("episode_metrics", "episode", "vision") if getattr(rollout, name) is not None]
    if held:
        raise ConfigError(
            f"{owner}.balance_ranks",
            f"rows of multi-turn episodes or with their own images ({', '.join(held)}) stay on the rank that sampled "
            "them: set balance_ranks false",
        )


def repad(rollout: RolloutBatch, prompt_length: int, response_length: int, pad_id: int = 0) -> RolloutBatch:
    """``rollout`` with its prompts left padded to ``prompt_length`` and its responses right padded to
    ``response_length`` (masks, scores and log-probs padded with 0, tokens with ``pad_id``, versions with -1)."""
    left, right = prompt_length - rollout.prompt_length, response_length - rollout.mask.shape[1]
    if left < 0 or right < 0:
        raise ValueError(f"repad: cannot shorten ({rollout.prompt_length}, {rollout.mask.shape[1]}) rows")
    if left == right == 0:
        return rollout

    def pad(tensor: torch.Tensor | None, before: int, value: float) -> torch.Tensor | None:
        if tensor is None:
            return None
        widths = [0, 0] * (tensor.dim() - 2) + [before, right]  # F.pad lists the last dimension first
        return F.pad(tensor, widths, value=value)

    fields: dict[str, Any] = {"prompt_length": prompt_length}
    for name in FULL_FIELDS:
        fields[name] = pad(getattr(rollout, name), left, pad_id if name == "input_ids" else 0)
    for name in RESPONSE_FIELDS:
        fields[name] = pad(getattr(rollout, name), 0, -1 if name == "token_versions" else 0)
    return replace(rollout, **fields)


def deal_groups(tokens: list[list[int]]) -> list[list[tuple[int, int]]]:
    """``(rank, group)`` pairs each rank trains on, from ``tokens[rank][group]`` (real tokens of each prompt group of
    each rank): the groups in as many equal-count parts as ranks with balanced token sums (``karmarkar_karp``,
    ``equal_size``), part ``k`` to rank ``k``, each part in (rank, group) order. Every rank computes the same."""
    flat = [(rank, group) for rank, counts in enumerate(tokens) for group in range(len(counts))]
    parts = karmarkar_karp([tokens[r][g] for r, g in flat], len(tokens), equal_size=True)
    return [[flat[i] for i in part] for part in parts]


def imbalance(tokens: list[int]) -> float:
    """Max over mean of the ranks' token counts, minus 1 (0 when even)."""
    mean = sum(tokens) / len(tokens)
    return max(tokens) / mean - 1.0 if mean else 0.0


def balance_across_ranks(
    rollout: RolloutBatch, prompts: list[Any], pad_id: int, owner: str
) -> tuple[RolloutBatch, list[Any], dict[str, torch.Tensor]]:
    """This rank's share of every rank's prompt groups after ``deal_groups`` (re-padded to the common lengths, groups
    renumbered in (rank, group) order) and the prompts of those groups, with ``rank_tokens/imbalance_before`` and
    ``/imbalance_after`` (``imbalance`` of the ranks' real tokens). Collective: every rank of the default process
    group calls it with a rollout of the same number of groups."""
    check_balanceable(rollout, owner)
    world, rank, device = dist.get_world_size(), dist.get_rank(), rollout.input_ids.device
    groups = len(prompts)
    group = rollout.group.long()
    row_tokens = rollout.attention_mask.sum(1).long()
    shapes = torch.tensor([rollout.prompt_length, rollout.mask.shape[1], groups], device=device)
    dims = [torch.empty_like(shapes) for _ in range(world)]
    dist.all_gather(dims, shapes)  # first: the token counts' gather needs one length on every rank
    if len({int(d[2]) for d in dims}) != 1:
        raise ValueError(f"{owner}.balance_ranks: the ranks sampled different numbers of prompts")
    mine = torch.zeros(groups, dtype=torch.long, device=device).index_add_(0, group, row_tokens)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    tokens = [t.tolist() for t in gathered]
    dealt = deal_groups(tokens)
    before = imbalance([sum(t) for t in tokens])
    after = imbalance([sum(tokens[r][g] for r, g in part) for part in dealt])
    padded = repad(rollout, max(int(d[0]) for d in dims), max(int(d[1]) for d in dims), pad_id)

    # rows this rank sends, ordered by destination rank, then by group
    destination = {g: k for k, part in enumerate(dealt) for r, g in part if r == rank}
    order = sorted(range(len(group)), key=lambda i: (destination[int(group[i])], int(group[i]), i))
    send = [sum(1 for i in order if destination[int(group[i])] == k) for k in range(world)]
    sizes = [torch.zeros(world, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor(send, device=device))
    receive = [int(s[rank]) for s in sizes]
    index = torch.tensor(order, dtype=torch.long, device=device)

    def exchange(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        out = tensor.new_empty((sum(receive), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.index_select(0, index).contiguous(), receive, send)
        return out

    fields = {name: exchange(getattr(padded, name)) for name in (*FULL_FIELDS, *RESPONSE_FIELDS, *ROW_FIELDS)}
    old_group = exchange(group)
    # the lists (texts, reward components, prompts) in one gather of small objects
    lists = [None] * world
    components = {k: [v[i] for i in order] for k, v in padded.components.items()}
    dist.all_gather_object(lists, ([padded.texts[i] for i in order], components, list(prompts)))
    keys = sorted({k for _, sent, _ in lists for k in sent})  # a component one rank lacks: None on its rows
    texts, parts, sources = [], {k: [] for k in keys}, []
    for source in range(world):
        sent_texts, sent_components, _ = lists[source]
        start = sum(int(sizes[source][k]) for k in range(rank))
        texts += sent_texts[start : start + receive[source]]
        for k in parts:
            parts[k] += sent_components.get(k, [None] * len(sent_texts))[start : start + receive[source]]
        sources += [source] * receive[source]
    # renumber: group j of this rank is the j-th (rank, group) pair of its part
    number = {pair: j for j, pair in enumerate(dealt[rank])}
    new_group = torch.tensor(
        [number[(s, int(g))] for s, g in zip(sources, old_group.tolist())], dtype=rollout.group.dtype, device=device
    )
    order_back = torch.argsort(new_group, stable=True)  # rows of a group contiguous, groups in part order
    fields = {k: None if v is None else v.index_select(0, order_back) for k, v in fields.items()}
    texts = [texts[i] for i in order_back.tolist()]
    parts = {k: [v[i] for i in order_back.tolist()] for k, v in parts.items()}
    balanced = replace(padded, **fields, group=new_group.index_select(0, order_back), texts=texts, components=parts)
    new_prompts = [lists[r][2][g] for r, g in dealt[rank]]
    stats = {
        "rank_tokens/imbalance_before": torch.tensor(before, device=device),
        "rank_tokens/imbalance_after": torch.tensor(after, device=device),
    }
    return balanced, new_prompts, stats
