"""Which row holds each prompt token when rows share prompt prefixes (``models.packing.pack_rows``).

Rollout rows are left-padded prompts followed by responses. The ``G`` samples of one prompt repeat it, and the
prompts of a chat model's batch often begin alike too (its template's system turn): a packed row holds each such
prefix once, as a prefix tree (the shared prefix of the radix attention of SGLang, Zheng et al. 2024,
https://arxiv.org/abs/2312.07104, applied to a training forward). A prompt token is held by the first row whose
real tokens up to and including it are the same, at the same positions counted from each row's first real token;
every row's own tokens are then one run, a suffix of its real tokens (once a row differs from every earlier one,
all its later tokens do). Pure tensor code.
"""

from __future__ import annotations

import torch


def prefix_holders(input_ids: torch.Tensor, real: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """(N, P) the row that holds each real token of the first ``prompt_length`` columns (-1 for padding): the first
    row with the same real tokens from its first real token up to and including this one.

    Args:
        input_ids: (N, L) token ids.
        real: (N, L) bool, each row's real tokens one contiguous run.
        prompt_length: P, the columns that may be shared.
    """
    n, width = input_ids.shape[0], prompt_length
    device = input_ids.device
    rows = torch.arange(n, device=device)
    first = real.long().argmax(1, keepdim=True)
    columns = first + torch.arange(width, device=device)  # (N, P): the column of each depth
    inside = columns < width
    at = columns.clamp(max=max(width - 1, 0))
    valid = inside & real[:, :width].gather(1, at) if width else inside
    aligned = torch.where(valid, input_ids[:, :width].gather(1, at), -1) if width else at
    by_depth = torch.full((n, width), -1, dtype=torch.long, device=device)
    node = torch.zeros(n, dtype=torch.long, device=device)
    for depth in range(width):
        token = aligned[:, depth]
        going = token >= 0
        if not bool(going.any()):
            break
        _, node = torch.unique(torch.stack([node, token], 1), dim=0, return_inverse=True)
        holder = torch.full((n,), n, device=device).scatter_reduce(0, node, rows, "amin")[node]
        by_depth[:, depth] = torch.where(going, holder, -1)
        if bool((holder[going] == rows[going]).all()):  # every row's own from here: no more sharing
            by_depth[:, depth:] = torch.where(aligned[:, depth:] >= 0, rows[:, None], -1)
            break
    depth = torch.arange(width, device=device) - first  # (N, P): the depth of each column
    held = by_depth.gather(1, depth.clamp(min=0))
    return torch.where(real[:, :width] & (depth >= 0), held, -1)
