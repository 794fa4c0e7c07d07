"""The seed's forward/backward pipeline: queued passes with gradient accumulation, optimizer steps,
checkpoints and KV-cache sampling (``ForwardBackwardPipeline``), and its batch-dict client
(``AsyncTrainingClient``)."""

from aitraining_pl.compat.forward_backward.client import AsyncTrainingClient
from aitraining_pl.compat.forward_backward.losses import PIPELINE_LOSSES, LossInputs, register_loss
from aitraining_pl.compat.forward_backward.pipeline import (
    ForwardBackwardPipeline,
    ForwardBackwardResult,
    ForwardResult,
    OptimStepResult,
)
from aitraining_pl.compat.forward_backward.remote import RemotePipeline
from aitraining_pl.compat.forward_backward.sampling import filter_logits, sample_with_cache

__all__ = [
    "AsyncTrainingClient",
    "ForwardBackwardPipeline",
    "ForwardBackwardResult",
    "ForwardResult",
    "OptimStepResult",
    "RemotePipeline",
    "PIPELINE_LOSSES",
    "LossInputs",
    "register_loss",
    "filter_logits",
    "sample_with_cache",
]
