"""Run by tests/models/test_sequence_parallel.py: Ulysses sequence parallelism on 2 CPU processes with gloo.

``python sp_script.py OUT parity NAME...`` spawns 2 processes in one group; on each row ``NAME`` of the architecture
matrix both score the same packed rollout rows (GRPO-style rows sharing prompts, and DPO pairs with a shared
prompt) once whole (sequence parallelism off) and once split between them, and rank 0 writes ``OUT/parity.pt``:
per architecture the largest differences of log-probs, entropies, values (a value head on the gathered hidden
states) and gradients (the group's sum divided by 2, see ``models.sequence_parallel``), or the error raised before
scoring.

``python sp_script.py OUT STRATEGY CASE...`` runs training cases as ``fsdp_script.py`` does (``single``: one
process; ``sp``: ``FSDP2Strategy(sequence_parallel_size=2)`` on 2 processes, data parallel 1, so both see the same
global batch as the single process does).
"""

from __future__ import annotations

import os
import sys

import torch

torch.set_num_threads(1)
HELPERS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HELPERS, os.path.dirname(HELPERS)]

import torch.distributed as dist  # noqa: E402
from architectures import build_sharpened  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from aitraining_pl.errors import ConfigError  # noqa: E402
from aitraining_pl.models import sequence_parallel  # noqa: E402
from aitraining_pl.models.packing import pack_batch, pack_rows  # noqa: E402
from aitraining_pl.models.scoring import token_scores  # noqa: E402
from aitraining_pl.models.training import disable_dropout, enable_gradient_checkpointing  # noqa: E402
from aitraining_pl.models.value_head import ValueHead  # noqa: E402
from aitraining_pl.strategies import check_sequence_parallel  # noqa: E402


def rollout_rows() -> dict[str, torch.Tensor]:
    """6 rollout rows: 2 prompts (left-padded, 5 columns) x 3 responses of 3 to 11 tokens (right-padded)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 90, (n,), generator=g) for n in (5, 3)]
    rows, masks = [], []
    for i, length in enumerate([11, 4, 7, 3, 9, 6]):
        prompt = prompts[i // 3]
        response = torch.randint(3, 90, (length,), generator=g)
        pad_left, pad_right = 5 - len(prompt), 11 - length
        zeros = lambda n: torch.zeros(n, dtype=torch.long)  # noqa: E731
        rows.append(torch.cat([zeros(pad_left), prompt, response, zeros(pad_right)]))
        masks.append(torch.tensor([0] * pad_left + [1] * (len(prompt) + length) + [0] * pad_right))
    ids, mask = torch.stack(rows), torch.stack(masks)
    scored = mask.clone()
    scored[:, :5] = 0
    return {"input_ids": ids, "attention_mask": mask, "completion_mask": scored}


def pair_rows() -> dict[str, torch.Tensor]:
    """2 preference pairs, right-padded, each pair's prompt the same (chosen rows first)."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 90, (n,), generator=g) for n in (4, 6)]
    lengths = [(5, 8), (3, 2)]  # (chosen, rejected) completion lengths per pair
    rows = [(prompts[i], torch.randint(3, 90, (lengths[i][k],), generator=g)) for k in (0, 1) for i in (0, 1)]
    width = max(len(p) + len(c) for p, c in rows)
    pad = lambda t: torch.cat([t, torch.zeros(width - len(t), dtype=t.dtype)])  # noqa: E731
    ids = torch.stack([pad(torch.cat([p, c])) for p, c in rows])
    mask = torch.stack([pad(torch.ones(len(p) + len(c), dtype=torch.long)) for p, c in rows])
    completion = torch.stack([pad(torch.tensor([0] * len(p) + [1] * len(c))) for p, c in rows])
    return {"input_ids": ids, "attention_mask": mask, "completion_mask": completion}


def score(model, head, batch, packed) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Log-probs, entropies and values of the scored tokens, and the gradients of a loss using all three."""
    model.zero_grad(set_to_none=True)
    head.zero_grad(set_to_none=True)
    positions = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
    out = token_scores(
        model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"], positions, packed,
        temperature=0.7, with_entropy=True, with_hidden=True,
    )  # fmt: skip
    values = head(out.hidden)
    weights = torch.linspace(-1.0, 1.0, out.logps.numel()).view_as(out.logps)
    loss = (out.logps * weights).sum() + 0.3 * out.entropy.sum() + 0.5 * values.square().sum()
    loss.backward()
    grads = {f"model.{k}": p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    grads.update({f"head.{k}": p.grad.clone() for k, p in head.named_parameters()})
    return {"logps": out.logps.detach(), "entropy": out.entropy.detach(), "values": values.detach()}, grads


class CountCalls:
    """Counts the Ulysses attention calls (the split path really ran) while registered in its place."""

    def __init__(self):
        self.calls = 0
        self.inner = ALL_ATTENTION_FUNCTIONS[sequence_parallel.ULYSSES_ATTENTION]

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def compare(name: str) -> dict:
    model = build_sharpened(name, seed=0, scale=2.0)
    disable_dropout(model)  # as the modules train (random masks would differ between the two passes)
    torch.manual_seed(1)
    head = ValueHead(model.config.get_text_config().hidden_size)
    torch.nn.init.normal_(head.net[-1].weight, std=0.5)
    try:
        check_sequence_parallel(model, 2)
    except ConfigError as err:
        return {"error": str(err)}
    result = {}
    kinds = [
        ("rollout", rollout_rows(), lambda b: pack_rows(b, shared_prefix=5)),
        ("pairs", pair_rows(), lambda b: pack_batch(b, share_prompt=True)),
        ("rows", rollout_rows(), lambda b: None),  # packed by token_scores itself under sequence parallelism
    ]
    if name == "llama":  # and once with activation checkpointing: the recomputation runs the Ulysses attention too
        kinds.append(("checkpointed", rollout_rows(), lambda b: pack_rows(b, shared_prefix=5)))
    for kind, batch, pack in kinds:
        if kind == "checkpointed":
            enable_gradient_checkpointing(model)
        with sequence_parallel.disabled():
            whole, whole_grads = score(model, head, batch, pack(batch))
        counter = CountCalls()
        ALL_ATTENTION_FUNCTIONS[sequence_parallel.ULYSSES_ATTENTION] = counter
        try:
            split, split_grads = score(model, head, batch, pack(batch))
        finally:
            ALL_ATTENTION_FUNCTIONS[sequence_parallel.ULYSSES_ATTENTION] = counter.inner
        result[f"{kind}/ulysses_calls"] = counter.calls
        for grad in split_grads.values():
            dist.all_reduce(grad)
            grad /= 2
        for key in whole:
            result[f"{kind}/{key}"] = float((whole[key] - split[key]).abs().max())
        result[f"{kind}/grads"] = max(float((whole_grads[k] - split_grads[k]).abs().max()) for k in whole_grads)
        result[f"{kind}/grad_scale"] = max(float(g.abs().max()) for g in whole_grads.values())
        result[f"{kind}/scored"] = int(batch["completion_mask"][:, 1:].sum())
    return result


def parity_worker(rank: int, out: str, port: int, names: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    sequence_parallel.set_group(dist.group.WORLD)
    results = {name: compare(name) for name in names}
    if rank == 0:
        torch.save(results, os.path.join(out, "parity.pt"))
    dist.barrier()  # both done before gloo's threads are joined
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # not the interpreter's teardown, where gloo's threads now and then abort ('terminate called')


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(out: str, mode: str, *args: str) -> None:
    if mode == "parity":
        torch.multiprocessing.spawn(parity_worker, args=(out, free_port(), list(args)), nprocs=2)
        return
    from sp_train import run_cases

    run_cases(out, mode, args)


if __name__ == "__main__":
    main(*sys.argv[1:])
