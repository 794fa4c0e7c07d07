"""Data parallelism for ``tinker-serve --devices N --strategy ddp``: N processes launched by Lightning Fabric's DDP
strategy, each holding the whole base model and every training client's adapter and AdamW state.

Rank 0 serves HTTP. Its engine worker, before running an operation that changes or reads trained state
(``REPLICATED``: creating, releasing and loading a training client, ``forward_backward``, ``optim_step``),
broadcasts it (``Fabric.broadcast``) to the other ranks, which run the same operation on their replica
(``follow``). A ``forward_backward`` is split by datum (``shard``: contiguous slices, rank 0 first): each rank
computes its slice's loss and adds its gradient to its replica's; the outputs and ``loss:sum`` are gathered to
rank 0. ``optim_step`` first sums every rank's accumulated gradients (``reduce_gradients``, the strategy's
``all_reduce``), so each replica takes the same AdamW step as one process on the whole batch (Tinker's loss is a
sum over datums, so the sum of the shards' gradients is the batch's). Saving state, sampler weights and sampling
run on rank 0 alone: every replica holds the same weights. Checkpoints are read by every rank from
``--checkpoint-dir`` (one machine, or a shared filesystem). An idle rank 0 sends a no-op every ``PING`` seconds so
the other ranks' wait stays inside the process group's timeout."""

from __future__ import annotations

from typing import Any

import torch

from aitraining_pl.tinker.wire import BadRequest

#: the engine's operations every rank runs
REPLICATED = ("run_create", "run_release", "run_forward_backward", "run_optim_step", "run_load")
#: seconds between rank 0's keep-alive no-ops (the process group's collectives time out after 30 minutes)
PING = 60.0


class Ref:
    """A training client named by its id in a broadcast message (each rank resolves it to its own replica)."""

    def __init__(self, model_id: str):
        self.model_id = model_id


class Replicas:
    """The collectives of one rank (see the module docstring); ``fabric`` is a launched ``lightning.fabric.Fabric``
    with the DDP strategy."""

    def __init__(self, fabric: Any):
        self.fabric, self.rank, self.world = fabric, fabric.global_rank, fabric.world_size

    def shard(self, items: list) -> list:
        """This rank's contiguous slice of ``items`` (sizes differ by at most one; a slice may be empty)."""
        n = len(items)
        return items[n * self.rank // self.world : n * (self.rank + 1) // self.world]

    def gather(self, outputs: list, loss: float) -> tuple[list, float]:
        """Every rank's outputs in rank order and the sum of their losses."""
        parts: list = [None] * self.world
        torch.distributed.all_gather_object(parts, (outputs, loss))
        return [o for part in parts for o in part[0]], sum(part[1] for part in parts)

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum ``params``' gradients over the ranks (a rank without one adds zeros); left ``None`` when no rank has
        any."""
        if not params:
            return
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        has = torch.tensor([float(any(p.grad is not None for p in params))], device=grads[0].device)
        flat = self.fabric.strategy.all_reduce(torch.cat([*grads, has.to(grads[0].dtype)]), reduce_op="sum")
        if float(flat[-1]) == 0:
            return
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def lead(self, engine: Any, name: str, args: tuple, message: tuple) -> Any:
        """Rank 0: broadcast ``message`` (``args`` with each known training client as a ``Ref``), then run
        ``engine.name(*args)``."""
        self.fabric.broadcast((name, message), src=0)
        return getattr(engine, name)(*args)

    def ping(self) -> None:
        self.fabric.broadcast(("ping", ()), src=0)

    def stop(self) -> None:
        self.fabric.broadcast(None, src=0)

    def follow(self, engine: Any) -> None:
        """Ranks other than 0: run what rank 0 broadcasts until it stops. A refused request (``BadRequest``: the
        checks are deterministic, so rank 0 refused it too, before any collective) is skipped; any other error ends
        this rank, so rank 0's next collective fails with a message instead of waiting for it forever."""
        while (message := self.fabric.broadcast(None, src=0)) is not None:
            name, args = message
            if name == "ping":
                continue
            args = tuple(engine.models.get(a.model_id) if isinstance(a, Ref) else a for a in args)
            try:
                getattr(engine, name)(*args)
            except BadRequest:
                continue
