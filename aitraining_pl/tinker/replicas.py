"""Data parallelism for ``tinker-serve --devices N --strategy ddp|fsdp2``: N processes launched by Lightning Fabric,
each holding every training client's adapter and AdamW state, and under ``ddp`` the whole base model; under
``fsdp2`` (Fabric's ``ModelParallelStrategy``) the frozen base is sharded once over the ranks
(``models.sharding.shard``: every decoder layer, then the model) before any adapter is added.

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
the other ranks' wait stays inside the process group's timeout.

Under ``fsdp2`` peft puts each adapter around the sharded ``nn.Linear`` (its ``base_layer``, the same object FSDP
gathers), so adapters added later, for each new training client, are ordinary replicated tensors FSDP never sees:
their gradients are summed by ``reduce_gradients`` as under ``ddp``, the base stays frozen and is never reduced.
Every forward all-gathers the base layer by layer, so every rank runs every forward: a rank whose share of a
``forward_backward`` is empty runs a one-token batch with zero weight (``Engine.run_forward_backward``). Sampling,
which rank 0 runs alone, first has every rank gather the whole base (``whole_base``: ``models.sharding.gathered``,
as the project's FSDP2 rollouts do), so rank 0 decodes without collectives while the others release theirs at
once: rank 0 holds the whole base for the length of a ``sample``. Loading an adapter's state (``load_state_dict``)
puts FSDP's parameters back in their shards, so the sampler loads its snapshot before gathering."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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
        self.sharded = getattr(fabric.strategy, "device_mesh", None) is not None

    def setup(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` as this rank holds it: sharded by the strategy's ``parallelize_fn`` under fsdp2, else as is."""
        return self.fabric.strategy.setup_module(model) if self.sharded else model

    @staticmethod
    def base_share(model: torch.nn.Module) -> tuple[int, int]:
        """The base parameters (elements) this rank holds, and the whole model's (a sharded one's at rest)."""
        from torch.distributed.tensor import DTensor

        params = list(model.parameters())
        held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
        return held, sum(p.numel() for p in params)

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

    @contextlib.contextmanager
    def whole_base(self, base: torch.nn.Module) -> Iterator[None]:
        """Rank 0 under fsdp2: every rank gathers the whole sharded ``base`` (``models.sharding.gathered``) and
        the others release it at once; inside, rank 0 runs forwards without any collective (its sampling)."""
        from aitraining_pl.models.sharding import gathered

        self.fabric.broadcast(("gather", ()), src=0)
        with gathered(base):
            yield

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
            if name == "gather":  # rank 0 samples on the whole base: take part in the all-gathers, release at once
                from aitraining_pl.models.sharding import gathered

                with gathered(engine.base):
                    pass
                continue
            args = tuple(engine.models.get(a.model_id) if isinstance(a, Ref) else a for a in args)
            try:
                getattr(engine, name)(*args)
            except BadRequest:
                continue
