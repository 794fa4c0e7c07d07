"""Export the trained model as a Hugging Face folder during and after ``fit``."""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_only

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")


class HFExportCallback(pl.Callback):
    """Writes ``<dirpath>/step-<N>`` every ``every_n_train_steps`` optimizer steps and ``<dirpath>/last`` at
    the end of a successful fit, each a folder loadable with ``from_pretrained`` (config, safetensors
    weights, tokenizer; LoRA adapters, or merged weights with ``merge_lora``).

    Each export is written to a temporary folder next to its target and renamed into place only when
    complete, so an interrupted or failed export never replaces a good one; ``last`` is not written when
    fit ends with an exception. Only global rank 0 writes. The module must implement
    ``save_pretrained(path, merge_lora=...)`` (every ``AlignmentModule`` does).

    Args:
        dirpath: folder that receives the exports.
        every_n_train_steps: export every this many optimizer steps (``None``: only ``last`` at the end).
        keep_last_k: how many ``step-<N>`` folders to keep (oldest removed first; ``None`` keeps all).
        merge_lora: write LoRA adapters merged into the base weights instead of the adapters alone.
        save_last: write ``<dirpath>/last`` when fit ends.
    """

    def __init__(
        self,
        dirpath: str,
        every_n_train_steps: Optional[int] = None,
        keep_last_k: Optional[int] = 2,
        merge_lora: bool = False,
        save_last: bool = True,
    ):
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be >= 1 or None, got {every_n_train_steps}")
        if keep_last_k is not None and keep_last_k < 1:
            raise ValueError(f"keep_last_k must be >= 1 or None, got {keep_last_k}")
        self.dirpath = Path(dirpath)
        self.every_n_train_steps = every_n_train_steps
        self.keep_last_k = keep_last_k
        self.merge_lora = merge_lora
        self.save_last = save_last
        self._last_exported_step = -1

    def export(self, pl_module: pl.LightningModule, name: str) -> Path:
        """Write ``pl_module`` to ``<dirpath>/<name>`` atomically; returns the final path."""
        target = self.dirpath / name
        self.dirpath.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=self.dirpath))
        try:
            pl_module.save_pretrained(tmp, merge_lora=self.merge_lora)
            old = None
            if target.exists():
                old = self.dirpath / f".{name}.old-{os.getpid()}"
                if old.exists():
                    shutil.rmtree(old)
                os.replace(target, old)
            os.replace(tmp, target)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("exported %s", target)
        return target

    def _prune(self) -> None:
        if self.keep_last_k is None:
            return
        steps = sorted(
            (int(m.group(1)), p) for p in self.dirpath.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))
        )
        for _, path in steps[: -self.keep_last_k]:
            shutil.rmtree(path, ignore_errors=True)

    @rank_zero_only
    def _export_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        if step == self._last_exported_step:
            return
        self.export(pl_module, f"step-{step}")
        self._last_exported_step = step
        self._prune()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        n = self.every_n_train_steps
        if n and trainer.global_step > 0 and trainer.global_step % n == 0:
            self._export_step(trainer, pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # on_fit_end runs only when fit finished without an exception
        if self.save_last and trainer.is_global_zero and not trainer.interrupted:
            self.export(pl_module, "last")

    def state_dict(self) -> dict:
        return {"last_exported_step": self._last_exported_step}

    def load_state_dict(self, state_dict: dict) -> None:
        self._last_exported_step = int(state_dict.get("last_exported_step", -1))
