"""The policy's weights as a stream of ``(name, tensor)`` under the plain transformers names: what every engine is
loaded with (the colocated vLLM engine's ``sync``, a push to a generation server, the asynchronous pipeline's
snapshot)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from aitraining_pl.models.lora import is_peft_model, plain_weights
from aitraining_pl.models.sharding import full_tensor, reshard


def policy_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of ``model`` under the plain transformers names, one at a time: a ``peft`` model's base
    weights with the LoRA deltas merged (``plain_weights``), a plain model's ``state_dict``. Under FSDP2 each
    sharded tensor is all-gathered when it is reached (``sharding.full_tensor``: on the accelerator, also from
    CPU-offloaded shards) and dropped after vLLM has copied it, so at most one full parameter exists at a time; every
    rank must consume the whole stream."""
    reshard(model)  # the state dict then holds the shards, not the parameters a forward left gathered
    weights = plain_weights(model, merged=True) if is_peft_model(model) else model.state_dict().items()
    for name, tensor in weights:
        yield name, full_tensor(tensor).detach()
