"""Run by tests/rollout/test_online_rank_balance.py in 2 gloo processes (``torch.multiprocessing.spawn``): each rank
builds a rollout of 2 prompt groups x 2 samples with its own prompt and response lengths and row lengths, balances
it (``rollout.rank_balance.balance_across_ranks``) and saves what it got to OUT/rank<r>.pt."""

import os

import torch
import torch.distributed as dist

from aitraining_pl.rollout.batch import RolloutBatch
from aitraining_pl.rollout.rank_balance import balance_across_ranks

#: (prompt length, response length, real response tokens of each row) per rank: each rank has a short and a long
#: group, rank 1 the longer ones
LAYOUT = {0: (3, 5, [1, 1, 5, 4]), 1: (4, 6, [2, 1, 6, 5])}


def rollout_of(rank: int) -> tuple[RolloutBatch, list[str]]:
    """Rows whose tokens, texts, scores and log-probs all name (rank, row), so each can be followed across ranks."""
    P, R, responses = LAYOUT[rank]
    rows = len(responses)
    ids = torch.zeros(rows, P + R, dtype=torch.long)
    attention = torch.zeros(rows, P + R, dtype=torch.long)
    mask = torch.zeros(rows, R, dtype=torch.long)
    for i, length in enumerate(responses):
        prompt = 2 if i < 2 else P  # group 0's prompt is 2 tokens, group 1's fills P (left padded)
        ids[i, P - prompt : P] = 100 * rank + 10 * i + torch.arange(1, prompt + 1)
        ids[i, P : P + length] = 1000 + 100 * rank + 10 * i + torch.arange(length)
        attention[i, P - prompt : P + length] = 1
        mask[i, :length] = 1
    batch = RolloutBatch(
        input_ids=ids,
        attention_mask=attention,
        prompt_length=P,
        mask=mask,
        ended=torch.tensor([i % 2 == 0 for i in range(rows)]),
        group=torch.tensor([0, 0, 1, 1]),
        texts=[f"r{rank}-{i}" for i in range(rows)],
        scores=torch.tensor([float(10 * rank + i) for i in range(rows)]),
        components={"c": [float(10 * rank + i) for i in range(rows)]},
        sampling_logprobs=-(mask.float() * (10 * rank + torch.arange(rows)).unsqueeze(1) + mask),
        routes=ids.unsqueeze(-1).unsqueeze(-1).expand(-1, -1, 2, 1).clone(),
    )
    return batch, [f"prompt r{rank} g{g}" for g in range(2)]


def worker(rank: int, out: str, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        batch, prompts = rollout_of(rank)
        balanced, new_prompts, stats = balance_across_ranks(batch, prompts, pad_id=0, owner="Test")
        torch.save(
            {"batch": vars(balanced), "prompts": new_prompts, "stats": {k: float(v) for k, v in stats.items()}},
            os.path.join(out, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()
