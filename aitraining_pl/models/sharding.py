"""FSDP2 sharding (``torch.distributed.fsdp.fully_shard``, Zhao et al. 2023 "PyTorch FSDP") of the networks a
module trains or reads, for Lightning's ``ModelParallelStrategy``.

Each network is sharded on its own, as its own FSDP root: ``fully_shard`` on every transformer block (the classes
a transformers model lists in ``_no_split_modules``), then on the network (its embeddings, final norm and LM
head, or a small head such as PPO's value head). Blocks free their gathered parameters after forward; a root keeps
its own (they are needed again by the backward pass right away).

The project scores tokens without the model's ``forward`` (decoder, then the LM head on scored positions only:
``models.scoring``), which FSDP's hooks would not see; ``as_forward`` runs such a computation as a forward of the
root (parameters gathered before, gradients reduce-scattered after backward). ``gathered`` holds every parameter
gathered for a whole rollout phase (one all-gather per parameter, not one per generated token); inside it no
forward communicates, so ranks may generate different numbers of tokens. ``full_weights`` swaps the full
parameters in for an export or a comparison; every rank must enter it (it all-gathers, on the accelerator also
under CPU offload: ``full_tensor``).

On one device or under DDP nothing here runs: ``is_sharded`` is False and the helpers are no-ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


def is_sharded(network: nn.Module) -> bool:
    """Whether ``network`` (or a submodule) was sharded with ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in network.modules())


def transformer_blocks(network: nn.Module) -> list[nn.Module]:
    """The repeated blocks of the transformers models inside ``network`` (classes named in their
    ``_no_split_modules``, e.g. ``LlamaDecoderLayer``), in module order."""
    names: set[str] = set()
    for module in network.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [m for m in network.modules() if m is not network and type(m).__name__ in names]


def mixed_precision(precision: str | None) -> Any:
    """The ``MixedPrecisionPolicy`` for Lightning's ``precision`` flag: ``bf16-mixed`` / ``16-mixed`` compute in
    that dtype (gathered parameters) and reduce gradients in float32 over float32 sharded parameters; anything
    else (``32-true``, ``bf16-true``, where the parameters already have their dtype) casts nothing."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(precision))
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard(
    network: nn.Module,
    mesh: Any,
    precision: str | None = None,
    cpu_offload: bool = False,
    blocks: list[nn.Module] | None = None,
) -> nn.Module:
    """``fully_shard`` every block of ``network`` (default: ``transformer_blocks``) and then ``network`` itself, on
    the data-parallel ``mesh``; returns ``network`` (sharded in place). Methods the network lists in
    ``fsdp_forward_methods`` (entry points other than ``forward``, e.g. ``RewardModel.score``) gather its
    parameters as ``forward`` does.

    Args:
        network: a transformers model (optionally ``peft``-wrapped), a reward model or a small head.
        mesh: the 1-D device mesh of the data-parallel ranks.
        precision: Lightning's precision flag (``mixed_precision``).
        cpu_offload: keep sharded parameters, gradients and optimizer states in CPU memory (``CPUOffloadPolicy``).
        blocks: the submodules to shard as units (default: ``transformer_blocks(network)``).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard, register_fsdp_forward_method

    options = {
        "mesh": mesh,
        "mp_policy": mixed_precision(precision),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    for block in transformer_blocks(network) if blocks is None else blocks:
        fully_shard(block, reshard_after_forward=True, **options)
    fully_shard(network, reshard_after_forward=False, **options)
    network.__dict__["sharded_call"] = _call.__get__(network)
    for method in ("sharded_call", *getattr(network, "fsdp_forward_methods", ())):
        register_fsdp_forward_method(network, method)
    return network


def _call(self: nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, registered as a forward method of a sharded root (see ``shard``)."""
    return fn(*args, **kwargs)


def as_forward(network: nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` as a forward pass of ``network``: under FSDP2 its root parameters are gathered
    for ``fn`` and their gradients reduce-scattered in backward; a plain call otherwise."""
    call = network.__dict__.get("sharded_call")
    return call(fn, *args, **kwargs) if call is not None else fn(*args, **kwargs)


def mesh_device(mesh: Any) -> torch.device:
    """The device ``mesh``'s collectives run on (``cuda:<current>`` for a CUDA mesh)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of ``tensor``: a ``DTensor`` all-gathered on its mesh's device and returned on the device of its
    shard; any other tensor as it is. Under CPU offload the shards live in host memory while the mesh is the
    accelerator's: each shard moves to the device first, so the gather runs there (NCCL, not the process group's
    gloo side), and the full tensor comes back to the host (an export of a model the device could not hold)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    local, mesh = tensor.to_local(), tensor.device_mesh
    device = mesh_device(mesh)
    if local.device.type == device.type:
        return tensor.full_tensor()
    moved = DTensor.from_local(
        local.to(device, non_blocking=True), mesh, tensor.placements, run_check=False,
        shape=tensor.shape, stride=tensor.stride(),
    )  # fmt: skip
    return moved.full_tensor().to(local.device)


def _fsdp_modules(network: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in network.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(network: nn.Module) -> Iterator[nn.Module]:
    """Every parameter of a sharded ``network`` gathered for the whole block (e.g. a rollout: no all-gather per
    generated token, and no collective at all inside, so ranks may run different numbers of forwards);
    resharded afterwards. Every rank must enter it. A no-op for a network that is not sharded."""
    modules = _fsdp_modules(network)
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield network
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(module is not network, recurse=False)


def reshard(network: nn.Module) -> None:
    """Put every FSDP2 module's parameters of ``network`` back in their shards (a root keeps its own gathered
    after forward), e.g. before streaming its ``state_dict`` one all-gathered tensor at a time. A no-op when not
    sharded."""
    for module in _fsdp_modules(network):
        module.reshard()


@contextlib.contextmanager
def full_weights(*networks: nn.Module) -> Iterator[None]:
    """Within the block every sharded parameter of ``networks`` is replaced by its full tensor (float32 master
    weights under mixed precision; tied parameters stay tied), so code written for a plain model (an export, a
    ``state_dict``) sees the whole model; the shards are put back afterwards. Every rank must enter it (each
    parameter is all-gathered, in module order)."""
    from torch.distributed.tensor import DTensor

    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    full: dict[int, nn.Parameter] = {}
    for network in networks:
        for module in _fsdp_modules(network):  # a root left gathered after forward would re-register its shards
            module.reshard()  # in its ``state_dict`` hook, over the full tensors swapped in below
        for module in network.modules():
            for name, param in list(module._parameters.items()):
                if isinstance(param, DTensor):
                    if id(param) not in full:
                        full[id(param)] = nn.Parameter(full_tensor(param).detach(), requires_grad=param.requires_grad)
                    module._parameters[name] = full[id(param)]
                    swapped.append((module, name, param))
    try:
        yield
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param
