"""``balance_ranks``: the training order dealt to the data-parallel ranks with balanced token counts per step, as
Lightning's distributed sampler wrapper splits it."""

from __future__ import annotations

import random

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

from aitraining_pl.datamodules.resumable import RankBalancedSampler, SeededShuffleSampler
from aitraining_pl.datamodules.sft import SFTDataModule
from aitraining_pl.models import load_tokenizer


def _rank_tokens(sampler, lengths, ranks: int, batch_size: int) -> list[list[int]]:
    """Per step, the tokens of each rank's batch, split as Lightning splits a custom sampler."""
    per_rank = [
        list(DistributedSamplerWrapper(sampler, num_replicas=ranks, rank=r, shuffle=False)) for r in range(ranks)
    ]
    steps = len(per_rank[0]) // batch_size
    return [
        [sum(lengths[i] for i in per_rank[r][s * batch_size : (s + 1) * batch_size]) for r in range(ranks)]
        for s in range(steps)
    ]


def test_ranks_get_balanced_token_counts_per_step():
    rng = random.Random(0)
    lengths = [int(rng.lognormvariate(4, 1.2)) + 1 for _ in range(64)]  # long-tailed
    order = SeededShuffleSampler(64, seed=3)
    plain = _rank_tokens(order, lengths, 2, 8)
    balanced_sampler = RankBalancedSampler(order, lengths, batch_size=8, ranks=2)
    balanced = _rank_tokens(balanced_sampler, lengths, 2, 8)
    # every step keeps its rows (the same 16 rows, dealt differently), each index once over the epoch
    assert sorted(balanced_sampler) == list(range(64))
    for step in range(4):
        assert sum(balanced[step]) == sum(plain[step])
    gaps, plain_gaps = [abs(a - b) for a, b in balanced], [abs(a - b) for a, b in plain]
    assert sum(gaps) < sum(plain_gaps) / 3
    for step, gap in enumerate(gaps):  # within the longest row of the step (the rows are not split)
        assert gap <= max(lengths[i] for i in list(order)[step * 16 : (step + 1) * 16])


def test_the_data_module_deals_balanced_batches(monkeypatch):
    rows = [{"prompt": f"Q{i}?", "completion": " ok" * (1 + (i * 7) % 13) + " long" * (40 if i % 5 == 0 else 0)}
            for i in range(16)]  # fmt: skip
    data = SFTDataModule(rows=rows, tokenizer=load_tokenizer("byte"), val_split=0, batch_size=4, balance_ranks=True)
    assert data.hparams.balance_ranks
    data.setup()
    monkeypatch.setattr(type(data), "_ranks", lambda self: 2)  # as under a 2-process trainer
    sampler = data.train_dataloader().sampler
    assert isinstance(sampler, RankBalancedSampler) and sampler.ranks == 2 and sampler.batch_size == 4
    lengths = data.train_dataset.lengths()
    for a, b in _rank_tokens(sampler, lengths, 2, 4):
        assert abs(a - b) <= max(lengths)  # within one row of each other
    assert torch.Size([len(list(sampler))]) == torch.Size([16])
