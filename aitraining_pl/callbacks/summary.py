"""A model summary without the rows and columns that say nothing for this project's modules."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary


def compact_summary_data(summary_data: list[tuple[str, list[str]]], total_flops: int) -> list[tuple[str, list[str]]]:
    """``summary_data`` (Lightning's ``(column, values)`` pairs) without rows of private attributes (``_epoch_metrics``,
    the modules' torchmetrics holders, which have no parameters) and without the FLOPs column when nothing was
    counted (Lightning counts FLOPs only for a module with an ``example_input_array``)."""
    names = dict(summary_data).get("Name", [])
    keep = [i for i, name in enumerate(names) if not str(name).startswith("_")]
    return [
        (column, [values[i] for i in keep] if column != " " else [str(n) for n in range(len(keep))])
        for column, values in summary_data
        if not (column == "FLOPs" and not total_flops)
    ]


class CompactModelSummary(ModelSummary):
    """Lightning's ``ModelSummary`` (plain text), with ``compact_summary_data`` applied: no row for internal
    metric holders and no "FLOPs 0" column. The ``aitraining-pl`` command installs it unless the trainer
    already has a model summary or ``enable_model_summary`` is false."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._max_depth:
            return
        summary = self._summary(trainer, pl_module)
        total_flops = getattr(summary, "total_flops", 0)
        data = compact_summary_data(summary._get_summary_data(), total_flops)
        if trainer.is_global_zero:
            kwargs: dict[str, Any] = dict(self._summarize_kwargs)
            self.summarize(
                data,
                summary.total_parameters,
                summary.trainable_parameters,
                summary.model_size,
                summary.total_training_modes,
                total_flops=total_flops,
                **kwargs,
            )

    @staticmethod
    def summarize(
        summary_data,
        total_parameters,
        trainable_parameters,
        model_size,
        total_training_modes,
        total_flops,
        **summarize_kwargs: Any,
    ) -> None:
        """Lightning's plain-text table, without its "Total Flops" line when no FLOPs were counted."""
        from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table

        table = _format_summary_table(
            total_parameters, trainable_parameters, model_size, total_training_modes, total_flops, *summary_data
        )
        if not total_flops:
            table = "\n".join(line for line in table.splitlines() if not line.rstrip().endswith("Total Flops"))
        logging.getLogger("lightning.pytorch.callbacks.model_summary").info("\n" + table)  # as Lightning logs it
