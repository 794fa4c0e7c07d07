"""``PushedWeights``: this project's vLLM worker extension (``vllm serve --worker-extension-cls
aitraining_pl.generation.servers.vllm_worker.PushedWeights``), the weight path of a ``vllm serve`` where vLLM has no
transfer backend (CPUs).

The trainer writes a push as one safetensors file in a private folder of shared memory (``/dev/shm``, the same
machine) and calls ``/collective_rpc`` with ``method: aitraining_pl_load`` and ``kwargs: {path, version, owner}``.
Each worker reads the file, checks it (``checks.WeightSpecs``: names, shapes and dtypes against the served
architecture's transformers ``state_dict``, values finite, nothing missing; ``checks.PushGuard``: the owner's key
and a newer version of its run) and only then loads it in place through vLLM's layerwise ``reload_weights``, the
call the colocated engine makes (a plain ``model.load_weights`` of a full state dict fails on vLLM's CPU-prepacked
parameters). A refused push loads nothing: the previous weights keep serving. Every method answers a dict
(``ok``, and ``error`` when refused), never raises to vLLM, whose ``/collective_rpc`` would answer an error 500
without the reason. The methods are named ``aitraining_pl_*`` so that they never shadow a worker's own."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from aitraining_pl.generation.images import reset_input_norms
from aitraining_pl.generation.servers.checks import PushGuard, PushRefused, WeightSpecs

#: a pushed file must sit in a folder whose name starts so (the trainer's ``tempfile.mkdtemp`` prefix)
PUSH_PREFIX = "aitraining-pl-push-"


def push_file(path: str, folder: bool = False) -> Path:
    """``path`` as a pushed file (``folder``: an adapter folder): a regular file in a folder named
    ``PUSH_PREFIX...``, or such a folder (a token holder cannot make the server read anything else); ``PushRefused``
    otherwise."""
    file = Path(str(path)).resolve()
    if not file.exists():
        raise PushRefused(f"{path!r} does not exist on the server's machine: CPU pushes go through this machine's "
                          "shared memory, so the server must run beside the trainer (GPUs: NCCL)")  # fmt: skip
    where = file if folder else file.parent
    if not where.name.startswith(PUSH_PREFIX) or not (file.is_dir() if folder else file.is_file()):
        kind = f"a {PUSH_PREFIX}* folder" if folder else f"a file in a {PUSH_PREFIX}* folder"
        raise PushRefused(f"{path!r} is not a pushed weights {'folder' if folder else 'file'} ({kind})")
    return file


def served_specs(hf_config: Any, dtype: torch.dtype) -> WeightSpecs:
    """The ``WeightSpecs`` of ``hf_config``'s transformers architecture (built on the meta device) in ``dtype``."""
    import transformers

    from aitraining_pl.models.vision import is_vision_model_type

    auto = "AutoModelForImageTextToText" if is_vision_model_type(hf_config.model_type) else "AutoModelForCausalLM"
    with torch.device("meta"):
        model = getattr(transformers, auto).from_config(hf_config, dtype=dtype)
    return WeightSpecs(model)


def load_checked(path: str, specs: WeightSpecs) -> list[tuple[str, torch.Tensor]]:
    """The tensors of the pushed file ``path``, checked and staged (``WeightSpecs.checked``)."""
    from safetensors import SafetensorError, safe_open

    try:  # a corrupt or truncated file is a refusal, never the server's error (issue 52)
        with safe_open(str(push_file(path)), framework="pt") as file:
            return specs.checked((name, file.get_tensor(name)) for name in file.keys())
    except (OSError, ValueError, SafetensorError) as err:
        raise PushRefused(f"the pushed file cannot be read ({type(err).__name__}: {str(err)[:200]})") from None


class PushedWeights:
    """Mixed into each vLLM worker (``self`` is the worker): loads the trainer's pushes (module docstring)."""

    def _aitraining_pl_state(self) -> tuple[WeightSpecs, PushGuard]:
        state = getattr(self, "_aitraining_pl", None)
        if state is None:
            model_config = self.vllm_config.model_config
            state = self._aitraining_pl = (served_specs(model_config.hf_config, model_config.dtype), PushGuard())
        return state

    @torch.no_grad()
    def aitraining_pl_load(self, path: str, version: str, owner: str) -> dict[str, Any]:
        """Load the pushed file ``path`` as ``version`` (``run:step``) of the key ``owner``, after every check; the
        answer: ``{"ok": True, "seconds": ...}`` or ``{"ok": False, "error": "<one line>"}``."""
        start = time.perf_counter()
        try:
            specs, guard = self._aitraining_pl_state()
            parsed = guard.admit(owner, version)
            staged = load_checked(path, specs)
            self.reload_weights(weights_iterator=iter(staged), is_checkpoint_format=True)
            self._aitraining_pl_input_norms()
            guard.accept(owner, parsed)
        except PushRefused as err:
            return {"ok": False, "error": str(err)}
        except Exception as err:  # noqa: BLE001 - one line back to the trainer, not a 500 without a reason
            return {"ok": False, "error": f"the load failed: {type(err).__name__}: {err}"}
        return {"ok": True, "seconds": time.perf_counter() - start}

    def _aitraining_pl_input_norms(self) -> None:
        """A VL model's folded image normalisation, which ``--load-format dummy`` randomised, set from the processor
        config (``generation.images.reset_input_norms``)."""
        model = self.get_model()
        if any(type(m).__name__ == "FusedMMInputNorm" for m in model.modules()):
            from vllm.model_executor.layers.fusion.mm_input_norm import _load_norm_params

            norm = _load_norm_params(self.vllm_config.model_config)
            reset_input_norms((norm.rescale_factor, norm.image_mean, norm.image_std), model)

    def aitraining_pl_release(self, owner: str) -> dict[str, Any]:
        """Free the server's weights for another run when ``owner`` holds them (the trainer closed its client)."""
        return {"ok": True, "released": self._aitraining_pl_state()[1].release(owner)}
