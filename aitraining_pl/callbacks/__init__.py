"""Lightning callbacks: KL control, export, sampling and completion logs, greedy held-out reward, guards, exact
resume, reference sync."""

from aitraining_pl.callbacks.completions import CompletionLogCallback
from aitraining_pl.callbacks.export import HFExportCallback
from aitraining_pl.callbacks.greedy_eval import GreedyEvalCallback
from aitraining_pl.callbacks.guard import NonFiniteError, NonFiniteGuard
from aitraining_pl.callbacks.kl import AdaptiveKLCallback, AdaptiveKLController
from aitraining_pl.callbacks.reference_sync import SyncReferenceCallback
from aitraining_pl.callbacks.resume import ExactResumeCallback
from aitraining_pl.callbacks.sampling import SamplingCallback
from aitraining_pl.callbacks.summary import CompactModelSummary

__all__ = [
    "AdaptiveKLCallback",
    "AdaptiveKLController",
    "HFExportCallback",
    "SamplingCallback",
    "GreedyEvalCallback",
    "CompletionLogCallback",
    "NonFiniteGuard",
    "NonFiniteError",
    "ExactResumeCallback",
    "SyncReferenceCallback",
    "CompactModelSummary",
]
