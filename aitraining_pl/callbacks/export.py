"""Export the trained model as a Hugging Face folder during and after ``fit``."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import shutil
import sys
import uuid
from pathlib import Path

import lightning.pytorch as pl

from aitraining_pl.callbacks.guard import NonFiniteError, check_parameters, first_nonfinite_parameter
from aitraining_pl.models.lora import link_adapter_base
from aitraining_pl.models.sharding import full_weights

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
#: temporary folders of an export in progress (``.<name>.tmp-*``) or of a replaced one (``.<name>.old-*``)
_LEFTOVER = re.compile(r"^\.(last|step-\d+)\.(tmp|old)-")
_RENAME_EXCHANGE = 2  # renameat2 flag (Linux >= 3.15)
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    platform or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def replace_dir(new: Path, target: Path) -> None:
    """Put folder ``new`` at ``target``, which exists at every instant when it existed before: swapped in
    atomically (Linux), else the old one renamed aside just before the new one is renamed in (a window of
    two renames where ``target`` is missing). The old folder is removed afterwards."""
    if not target.exists():
        os.replace(new, target)
        return
    if _exchange(new, target):  # ``new`` now holds the old export
        shutil.rmtree(new, ignore_errors=True)
        return
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' progress bars off for the duration (restored after)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


class HFExportCallback(pl.Callback):
    """Writes ``<dirpath>/step-<N>`` every ``every_n_train_steps`` optimizer steps and ``<dirpath>/last`` at
    the end of a successful fit, each a folder loadable with ``from_pretrained`` (config, safetensors
    weights, tokenizer; LoRA adapters, or merged weights with ``merge_lora``).

    Each export is written to a temporary folder next to its target and renamed into place only when
    complete, so an interrupted or failed export never replaces a good one; an existing export is swapped
    for the new one atomically (``replace_dir``), so it is loadable at every instant. ``last`` is not
    written when fit ends with an exception, and nothing is exported under ``fast_dev_run``. Temporary
    folders left by killed runs are removed when fit starts. Folders get the permissions of a plain
    ``mkdir`` (the umask). Only global rank 0 writes (under FSDP2 every rank first gathers the full weights). The
    module must implement ``save_pretrained(path, merge_lora=...)`` (every ``AlignmentModule`` does; it also
    writes the model card ``README.md``). A LoRA export whose base was saved beside it (``base/``, for an
    inline-config model) has its ``adapter_config.json`` pointed at the final folder's ``base/`` before it is
    renamed into place. Weights that hold a NaN or inf are never exported: the fit stops with ``NonFiniteError``.

    With ``push_to_hub``, the ``last`` export is uploaded after it is written (global rank 0 only):
    ``huggingface_hub.HfApi().create_repo(hub_model_id, private=hub_private, exist_ok=True)`` then
    ``upload_folder``; the token is the usual one (``HF_TOKEN`` or ``huggingface-cli login``). An upload error
    ends the fit with that error, after the local export is complete.

    Args:
        dirpath: folder that receives the exports.
        every_n_train_steps: export every this many optimizer steps (``None``: only ``last`` at the end).
        keep_last_k: how many ``step-<N>`` folders to keep (oldest removed first; ``None`` keeps all).
        merge_lora: write LoRA adapters merged into the base weights instead of the adapters alone.
        save_last: write ``<dirpath>/last`` when fit ends.
        push_to_hub: upload ``last`` to the Hugging Face Hub after it is written.
        hub_model_id: the hub repository (``user/name``); required with ``push_to_hub``.
        hub_private: create the repository private.
    """

    def __init__(
        self,
        dirpath: str,
        every_n_train_steps: int | None = None,
        keep_last_k: int | None = 2,
        merge_lora: bool = False,
        save_last: bool = True,
        push_to_hub: bool = False,
        hub_model_id: str | None = None,
        hub_private: bool = False,
    ):
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be >= 1 or None, got {every_n_train_steps}")
        if keep_last_k is not None and keep_last_k < 1:
            raise ValueError(f"keep_last_k must be >= 1 or None, got {keep_last_k}")
        if push_to_hub and not hub_model_id:
            raise ValueError("push_to_hub needs hub_model_id (the hub repository, e.g. 'user/my-model')")
        if push_to_hub and not save_last:
            raise ValueError("push_to_hub uploads the 'last' export: it needs save_last=True")
        self.push_to_hub, self.hub_model_id, self.hub_private = push_to_hub, hub_model_id, hub_private
        self.dirpath = Path(dirpath)
        self.every_n_train_steps = every_n_train_steps
        self.keep_last_k = keep_last_k
        self.merge_lora = merge_lora
        self.save_last = save_last
        self._last_exported_step = -1

    def export(self, pl_module: pl.LightningModule, name: str) -> Path:
        """Write ``pl_module`` to ``<dirpath>/<name>`` atomically; returns the final path. Refuses (with
        ``NonFiniteError``) to write weights that hold a NaN or inf."""
        bad = first_nonfinite_parameter(pl_module)
        if bad is not None:
            raise NonFiniteError(f"non-finite weights ({bad}): export {name!r} not written to {self.dirpath}")
        target = self.dirpath / name
        self.dirpath.mkdir(parents=True, exist_ok=True)
        tmp = self.dirpath / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()  # mode 0777 & ~umask, as any folder the user creates (mkdtemp would make it 0700)
        try:
            with _no_progress_bars():  # transformers' "Writing model shards" bar, once per export, mid-epoch
                pl_module.save_pretrained(tmp, merge_lora=self.merge_lora)
            link_adapter_base(tmp, target)  # a base saved beside the adapters: named at its final place
            replace_dir(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("exported %s", target)
        return target

    def remove_leftovers(self) -> list[Path]:
        """Remove the temporary folders of exports that a killed run left behind; returns them."""
        if not self.dirpath.is_dir():
            return []
        found = [p for p in self.dirpath.iterdir() if p.is_dir() and not p.is_symlink() and _LEFTOVER.match(p.name)]
        for path in found:
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed the leftover export folder %s", path)
        return found

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero and not trainer.fast_dev_run:
            self.remove_leftovers()

    def _prune(self) -> None:
        if self.keep_last_k is None:
            return
        steps = sorted(
            (int(m.group(1)), p) for p in self.dirpath.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))
        )
        for _, path in steps[: -self.keep_last_k]:
            shutil.rmtree(path, ignore_errors=True)

    def _export_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        if step == self._last_exported_step:
            return
        check_parameters(trainer, pl_module, f"export step-{step} not written")  # all ranks, before gathering
        with full_weights(pl_module):  # FSDP2: every rank gathers, rank 0 writes
            if trainer.is_global_zero:
                self.export(pl_module, f"step-{step}")
                self._prune()
        self._last_exported_step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        n = self.every_n_train_steps
        if n and not trainer.fast_dev_run and trainer.global_step > 0 and trainer.global_step % n == 0:
            self._export_step(trainer, pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # on_fit_end runs only when fit finished without an exception
        if not self.save_last or trainer.interrupted or trainer.fast_dev_run:
            return
        check_parameters(trainer, pl_module, "export 'last' not written")
        with full_weights(pl_module):  # FSDP2: every rank gathers, rank 0 writes
            last = self.export(pl_module, "last") if trainer.is_global_zero else None
        if last is not None and self.push_to_hub:
            self.upload(last, trainer.global_step)

    def upload(self, folder: Path, step: int) -> str:
        """Upload ``folder`` to ``hub_model_id`` (created if missing); returns the repository id."""
        from huggingface_hub import HfApi

        api = HfApi()
        repo = api.create_repo(self.hub_model_id, private=self.hub_private, exist_ok=True)
        repo_id = getattr(repo, "repo_id", None) or self.hub_model_id
        message = f"aitraining_pl export (step {step})"
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message=message)
        log.info("uploaded %s to the hub as %s", folder, repo_id)
        return repo_id

    def state_dict(self) -> dict:
        return {"last_exported_step": self._last_exported_step}

    def load_state_dict(self, state_dict: dict) -> None:
        self._last_exported_step = int(state_dict.get("last_exported_step", -1))
