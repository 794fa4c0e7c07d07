"""Ulysses sequence parallelism (Jacobs et al. 2023, "DeepSpeed Ulysses"; as verl and ms-swift run it) on the
packed scoring path (``models.packing``), so that one packed row longer than a device holds is split across the
ranks of a sequence-parallel group.

Each rank of the group runs the decoder on its contiguous slice of the packed row (``split_bounds``), the row
padded to a multiple of the group size by a trailing block that attends to itself only (``pad_packed``). Position
ids are sliced, not recounted, so rotary embeddings see every token's global position. Attention is the one place
that needs the whole sequence: ``ulysses_attention_forward``, registered with transformers' ``AttentionInterface``
(so it wraps the attention of every architecture that routes through ``ALL_ATTENTION_FUNCTIONS``), moves heads to
sequence with one all-to-all per query, key and value ((1, H, N/P, D) -> (1, H/P, N, D)), runs the packed
attention on the whole row for its H/P heads, and moves sequence back to heads. Query and key/value heads must
both divide by the group size P (``check_model``: checked before training).

The LM head runs on the scored positions that lie in the rank's slice, and their per-token outputs (log-probs,
entropies, a value head's hidden states) are gathered back to the whole row on every rank of the group
(``gather_scored``). Every loss then sees exactly the tensors of a one-rank run: token counts, sums, means,
whitening and KL need no change and no extra reduction. The backward of the gather sums the group's gradients of
those outputs (every rank of the group computed the same loss), so the parameters' gradients summed over the group
are P times the loss's gradient; FSDP2, sharding over every rank of the mesh (data x sequence), averages them over
data x sequence ranks: the data-parallel mean of a one-rank run's gradients, as without sequence parallelism.
Work outside this path (a reward model, a padded forward) runs whole on every rank of the group: its gradients
are the same on each, and the same average leaves them right.

The group is set by the strategy (``strategies.FSDP2Strategy(sequence_parallel_size=P)``) with ``set_group``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from aitraining_pl.errors import ConfigError
from aitraining_pl.losses import HeadLogps
from aitraining_pl.models.packing import (
    PACKED_ATTENTION,
    AttentionPlan,
    PackedBatch,
    packed_attention,
    supports_packing,
)

ULYSSES_ATTENTION = "aitraining_pl_ulysses"
OPTION = "trainer.strategy.sequence_parallel_size"

#: the process group of this rank's sequence-parallel ranks (None: no sequence parallelism)
_GROUP: list[Any] = [None]


def set_group(group: Any) -> None:
    """Make ``group`` (a process group of 2 or more ranks, or None) the sequence-parallel group of this process."""
    _GROUP[0] = group if group is not None and dist.get_world_size(group) > 1 else None


def active_group() -> Any:
    """The sequence-parallel process group, or None when sequence parallelism is off."""
    return _GROUP[0]


def group_size() -> int:
    """Ranks of the sequence-parallel group (1 when off)."""
    group = active_group()
    return 1 if group is None else dist.get_world_size(group)


@contextmanager
def disabled() -> Iterator[None]:
    """Sequence parallelism off inside the block (every rank computes whole rows)."""
    previous, _GROUP[0] = _GROUP[0], None
    try:
        yield
    finally:
        _GROUP[0] = previous


# ---------------------------------------------------------------------------------------------- pure functions
def split_bounds(length: int, size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s slice of a row of ``length`` tokens (a multiple of ``size``)."""
    if length % size:
        raise ValueError(f"a row of {length} tokens does not split into {size} equal slices")
    step = length // size
    return rank * step, (rank + 1) * step


def pad_packed(packed: PackedBatch, size: int, pad_id: int = 0) -> PackedBatch:
    """``packed`` with its row padded to a multiple of ``size`` tokens: the padding is a trailing causal block of
    its own (positions from 0) that no scored token reads, so every real token attends as before."""
    length = packed.input_ids.shape[1]
    extra = -length % size
    if not extra:
        return packed
    ids = torch.cat([packed.input_ids, packed.input_ids.new_full((1, extra), pad_id)], dim=1)
    positions = torch.cat([packed.position_ids, torch.arange(extra, device=ids.device).unsqueeze(0)], dim=1)
    plan = AttentionPlan([*packed.plan.blocks, (((length, length + extra),), extra)])
    return packed._replace(input_ids=ids, position_ids=positions, plan=plan)


def local_scored(sources: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """(m,) indices into ``sources`` (packed positions predicting the scored tokens) of those in ``[start, end)``."""
    return torch.nonzero((sources >= start) & (sources < end), as_tuple=True)[0]


def check_heads(query_heads: int, kv_heads: int, size: int, name: str = "the model") -> None:
    """A clear error where the attention heads of ``name`` do not divide over ``size`` sequence-parallel ranks."""
    for kind, heads in (("attention heads", query_heads), ("key/value heads", kv_heads)):
        if heads % size:
            raise ConfigError(
                OPTION,
                f"{name} has {heads} {kind}, not divisible by the sequence parallel size {size} (Ulysses gives each "
                "rank a whole number of heads); pick a size that divides both head counts",
            )


def check_model(model: torch.nn.Module, size: int) -> None:
    """Before training: ``model`` (a transformers causal LM, optionally ``peft``-wrapped) can run with its rows
    split over ``size`` ranks: its attention goes through ``AttentionInterface`` as plain softmax attention over
    the packed row (``supports_packing``), and its query and key/value heads divide by ``size``."""
    if size <= 1:
        return
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(lm, "config", None)
    name = type(lm).__name__
    if config is None or not supports_packing(config):
        implementation = getattr(config, "_attn_implementation", None)
        raise ConfigError(
            OPTION,
            f"{name}: its attention cannot be wrapped for sequence parallelism (attention {implementation!r}, "
            "sliding windows, soft-capping or non-attention layers: the rows cannot run packed); use "
            "sequence_parallel_size 1",
        )
    text = getattr(config, "get_text_config", lambda: config)()
    heads = getattr(text, "num_attention_heads", None)
    if not heads:
        raise ConfigError(OPTION, f"{name}: its config names no num_attention_heads to split")
    check_heads(int(heads), int(getattr(text, "num_key_value_heads", None) or heads), size, name)


# ---------------------------------------------------------------------------------------------- collectives
def _all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """``x`` cut in P equal pieces along ``scatter_dim``, piece i sent to rank i; the pieces received, in rank
    order, concatenated along ``gather_dim``."""
    size = dist.get_world_size(group)
    send = torch.stack([piece.contiguous() for piece in x.chunk(size, dim=scatter_dim)])
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all over ``group`` (backward: the reverse all-to-all)."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


class _GatherScored(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: torch.Tensor, index: torch.Tensor, total: int, group: Any) -> torch.Tensor:
        ctx.group = group
        ctx.save_for_backward(index)
        full = values.new_zeros((total, *values.shape[1:])).index_copy_(0, index, values)
        dist.all_reduce(full, group=group)
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # every rank's loss used these outputs: their gradients add up
        return grad.index_select(0, index), None, None, None


def gather_scored(values: torch.Tensor, index: torch.Tensor, total: int, group: Any) -> torch.Tensor:
    """(total, ...) per-token outputs of the whole row on every rank of ``group``, from each rank's (m, ...)
    ``values`` at rows ``index`` (the ranks' indices partition ``range(total)``). Backward: the sum of the group's
    gradients at this rank's rows (see the module docstring)."""
    return _GatherScored.apply(values, index, total, group)


# ---------------------------------------------------------------------------------------------- attention
def ulysses_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: the rank's slice ``(1, H, N/P, D)`` in, ``(1, N/P, H, D)`` out; in
    between the packed attention (``models.packing``) of the whole row for H/P heads."""
    group = active_group()
    if group is None:
        raise RuntimeError("Ulysses attention outside a sequence-parallel forward")
    check_heads(query.shape[1], key.shape[1], dist.get_world_size(group), type(module).__name__)
    query, key, value = (all_to_all(t, group, scatter_dim=1, gather_dim=2) for t in (query, key, value))
    out, _ = ALL_ATTENTION_FUNCTIONS[PACKED_ATTENTION](module, query, key, value, attention_mask, **kwargs)
    return all_to_all(out, group, scatter_dim=1, gather_dim=2), None  # (1, N, H/P, D) -> (1, N/P, H, D)


AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention_forward)


def split_packed(packed: PackedBatch, pad_id: int = 0) -> tuple[PackedBatch, int, int, torch.Tensor]:
    """The padded row (``pad_packed``), this rank's ``[start, end)`` slice of it and the indices of the scored
    tokens it predicts (``local_scored``), for the active group."""
    group = active_group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    packed = pad_packed(packed, size, pad_id)
    start, end = split_bounds(packed.input_ids.shape[1], size, rank)
    return packed, start, end, local_scored(packed.sources, start, end)


def sequence_parallel_scores(
    decoder: torch.nn.Module,
    config: Any,
    packed: PackedBatch,
    head_scores: Callable[[torch.Tensor, torch.Tensor], HeadLogps],
    with_hidden: bool = False,
) -> tuple[HeadLogps, torch.Tensor | None]:
    """The packed path (``models.scoring``) with the row split over the active group: ``decoder`` on this rank's
    slice with Ulysses attention, ``head_scores(hidden, targets)`` on the scored tokens it predicts, and the
    per-token outputs (and the hidden states with ``with_hidden``) gathered back to every scored token of the row,
    in ``packed.sources`` order, on every rank of the group."""
    group = active_group()
    packed, start, end, mine = split_packed(packed)
    with packed_attention(config, packed.plan, ULYSSES_ATTENTION):
        local = decoder(
            input_ids=packed.input_ids[:, start:end],
            position_ids=packed.position_ids[:, start:end],
            use_cache=False,
            packed_plan=packed.plan,
        ).last_hidden_state[0]
    hidden = local[packed.sources[mine] - start]
    token = head_scores(hidden, packed.targets[mine])
    total = packed.sources.shape[0]
    gather = lambda values: None if values is None else gather_scored(values, mine, total, group)  # noqa: E731
    return HeadLogps(gather(token.logps), gather(token.entropy)), gather(hidden) if with_hidden else None


def from_group_leader(obj: Any, device: torch.device) -> Any:
    """``obj`` (tensors in any nesting) as the group's first rank has it, on every rank of the active group, its
    tensors on ``device`` (the rollout that the group's ranks split: sampled once, not once per rank with its own
    random state); ``obj`` itself when sequence parallelism is off."""
    group = active_group()
    if group is None:
        return obj
    from lightning.fabric.utilities.apply_func import move_data_to_device

    box = [move_data_to_device(obj, torch.device("cpu"))]  # pickled tensors come back on the device they left
    dist.broadcast_object_list(box, group_src=0, group=group)
    return move_data_to_device(box[0], device)
