"""An agent's episodes as training rows: ``episode_rows`` lays out the sequences of each episode's records
(``recording.split_sequences``) as the ``Rollout`` the online modules train on, ``max_sequences`` rows per episode
(``AgentEnvironment``'s docstring says how)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aitraining_pl.agents.recording import CallRecord, split_sequences
from aitraining_pl.environments.episode_rollout import EpisodeInfo
from aitraining_pl.models.vision import VisionInputs, merge_vision
from aitraining_pl.rollout import Rollout


def episode_rows(
    records: Sequence[Sequence[CallRecord]],
    rewards: Sequence[float],
    groups: Sequence[int],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    max_sequences: int,
    pad: int,
    tokenizer,
    extra: Sequence[dict] | None = None,
) -> Rollout:
    """The ``Rollout`` of episodes' records (one list per episode, in ``groups`` order: the prompt index of each
    episode): ``max_sequences`` rows per episode, laid out as ``AgentEnvironment``'s docstring says; ``extra``: more
    metrics per episode (``agent_errors``, ``no_calls``, ...). Where the calls had images (a VL policy's), the
    rollout carries each row's (``Rollout.vision``: its sequence's last call's, in order)."""
    device = prompt_ids.device
    rows, metrics, transcripts = [], [], []
    for e, (episode, reward, g) in enumerate(zip(records, rewards, groups)):
        sequences = split_sequences(episode)
        kept = sequences[-max_sequences:]
        data_prompt = prompt_ids[g][prompt_mask[g].bool()].tolist()
        for s in range(max_sequences):
            rows.append((e, g, reward, kept[s] if s < len(kept) else None, data_prompt))
        stats = {
            "calls": float(len(episode)),
            "sequences": float(len(sequences)),
            "dropped_sequences": float(len(sequences) - len(kept)),
            "tool_calls": float(sum(r.tool_calls for r in episode)),
            "truncated": float(bool(episode) and not episode[-1].ended),
            **(extra[e] if extra is not None else {}),
        }
        chat = [m for r in episode[-1:] for m in [*r.messages, r.assistant]]
        metrics += [stats] * max_sequences
        transcripts += [chat] * max_sequences
    responses = []
    for _, _, _, sequence, data_prompt in rows:
        if sequence is None:
            responses.append(([], [], [], [], True))
            continue
        ids = sequence.all_ids
        starts = len(sequence.prompt) >= len(data_prompt) and ids[: len(data_prompt)] == data_prompt
        skip = len(data_prompt) if starts else 0
        sampled = [False] * len(sequence.prompt) + sequence.from_model
        logps = [0.0] * len(sequence.prompt) + sequence.logprobs
        ends = [len(sequence.prompt) + i - skip for i in sequence.ends]
        responses.append((ids[skip:], sampled[skip:], logps[skip:], ends, starts))
    n, width = len(rows), max(1, max(len(r[0]) for r in responses))
    ids = torch.full((n, width), int(pad), dtype=torch.long)
    mask, attention = torch.zeros_like(ids), torch.zeros_like(ids)
    token_rewards, logprobs = torch.zeros(n, width), torch.zeros(n, width)
    row_prompt_mask = prompt_mask[list(groups[e] for e, *_ in rows)].clone() if n else prompt_mask[:0]
    ended = torch.ones(n, dtype=torch.bool)
    for r, ((e, g, reward, sequence, _), (tokens, sampled, logps, ends, starts)) in enumerate(zip(rows, responses)):
        length = len(tokens)
        if length:
            ids[r, :length] = torch.tensor(tokens)
            mask[r, :length] = torch.tensor(sampled, dtype=torch.long)
            attention[r, :length] = 1
            logprobs[r, :length] = torch.tensor(logps)
            token_rewards[r, ends[-1]] = reward
            ended[r] = sequence.ended
        if not starts:
            row_prompt_mask[r] = 0
    group = torch.tensor([g for _, g, *_ in rows], dtype=torch.long)
    texts = [tokenizer.decode(row[m.bool()], skip_special_tokens=True) for row, m in zip(ids, mask)]
    returns = torch.tensor([reward for _, _, reward, *_ in rows], dtype=torch.float32)
    keys = sorted({k for m in metrics for k in m})
    info = EpisodeInfo(
        attention.to(device),
        token_rewards.to(device),
        returns.to(device),
        {k: [m[k] for m in metrics] for k in keys},
        transcripts,
        episode=torch.tensor([e for e, *_ in rows], dtype=torch.long, device=device),
    )
    rollout = Rollout(
        prompt_ids[group.to(device)], row_prompt_mask.to(device), ids.to(device), mask.to(device), ended.to(device),
        texts, group.to(device), sampling_logprobs=logprobs.to(device),
    )  # fmt: skip
    rollout.episodes = info
    if any(sequence is not None and sequence.images for _, _, _, sequence, _ in rows):  # each row's images
        rollout.vision = VisionInputs([merge_vision(s.images) if s is not None else {} for _, _, _, s, _ in rows])
    return rollout
