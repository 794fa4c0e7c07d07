"""What a server checks before it loads a push, the same in vLLM's worker extension (``vllm_worker``) and in the HF
server (``hf_routes``):

- **the tensors** (``WeightSpecs``): each name one of the served model's (its transformers ``state_dict`` names),
  each once, its shape the model's, its dtype of the same kind (floating or not), its values finite, and every
  tensor present; all of it before anything is loaded, so a refused push leaves the previous weights serving.
- **the owner** (``PushGuard``): the first pusher owns the server's weights. A push carries the owner's key, a
  secret the trainer's client draws and never sends anywhere else (only its SHA-256 is kept), so holding the
  server's token is not enough to push as another run; and its version must be of the owner's run and newer than
  the last one. Ownership ends when the owner closes its client (``release``) or after ``lease`` seconds without a
  push (a crashed run's resumption takes the server over then). A refusal names neither the owner's run nor its key.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterable

import torch

from aitraining_pl.generation.version import WeightsVersion

#: seconds without a push after which a server's weights owner may be replaced by another run
LEASE = 600.0


class PushRefused(ValueError):
    """A push the server will not load (the previous weights keep serving); the message is the client's line."""


class WeightSpecs:
    """The served model's tensors (``state_dict`` names, shapes and dtypes): what a push must carry, each once.

    Args:
        model: the served architecture (the meta device is enough: only names, shapes and dtypes are read).
    """

    def __init__(self, model: torch.nn.Module):
        self.specs = {name: (list(t.shape), t.dtype) for name, t in model.state_dict().items()}

    def check(self, name: str, dtype: torch.dtype, shape: list[int], seen: set[str]) -> None:
        """Refuse a declared tensor that is not one of the model's, comes twice, or has another shape or a dtype
        of another kind (an integer tensor for a float weight); before its bytes are looked at."""
        if name not in self.specs:
            raise PushRefused(f"{name!r} is not a tensor of the served model")
        if name in seen:
            raise PushRefused(f"{name!r} came twice")
        want_shape, want_dtype = self.specs[name]
        if list(shape) != want_shape:
            raise PushRefused(f"{name!r} has shape {list(shape)}, the served model's is {want_shape}")
        if dtype != want_dtype and not (dtype.is_floating_point and want_dtype.is_floating_point):
            raise PushRefused(f"{name!r} is {str(dtype).removeprefix('torch.')}, the served model's is "
                              f"{str(want_dtype).removeprefix('torch.')}")  # fmt: skip

    def stage(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in host memory in the served dtype, once its values are known finite."""
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise PushRefused(f"{name!r} has {bad} non-finite values (NaN or inf)")
        return tensor.to(device="cpu", dtype=self.specs[name][1])

    def missing(self, seen: set[str]) -> list[str]:
        return [name for name in self.specs if name not in seen]

    def checked(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """All of ``weights`` checked and staged (``PushRefused`` at the first fault, or when tensors are
        missing): nothing is loaded from a push that fails."""
        seen: set[str] = set()
        staged = []
        for name, tensor in weights:
            self.check(name, tensor.dtype, list(tensor.shape), seen)
            seen.add(name)
            staged.append((name, self.stage(name, tensor)))
        missing = self.missing(seen)
        if missing:
            more = ", ..." if len(missing) > 1 else ""
            raise PushRefused(f"the push lacks {len(missing)} of the served model's tensors ({missing[0]!r}{more})")
        return staged


def key_digest(owner: str) -> str:
    return hashlib.sha256(owner.encode()).hexdigest()


class PushGuard:
    """Whose weights a server holds (see the module docstring): ``admit`` before a push loads, ``accept`` after.

    Args:
        lease: seconds without a push after which another run may take the server over.
    """

    def __init__(self, lease: float = LEASE):
        self.lease = float(lease)
        self.lock = threading.Lock()
        self.owner: str | None = None  #: SHA-256 of the owner's key
        self.version: WeightsVersion | None = None  #: the owner's last accepted version
        self.last = 0.0  #: ``time.monotonic()`` of the owner's last push

    def admit(self, owner: str, version: str, same: bool = False) -> WeightsVersion:
        """The parsed ``version`` of a push by the key ``owner``; ``PushRefused`` when another run owns the
        weights, the version is not the owner's run's or not newer than its last (``same``: not older, for a LoRA
        adapter pushed right after its base weights)."""
        parsed = WeightsVersion.parse(version)
        if parsed is None or not owner:
            raise PushRefused("a push needs a weights version run:step and the pusher's key")
        with self.lock:
            held = self.owner is not None and time.monotonic() - self.last < self.lease
            if held and key_digest(owner) != self.owner:
                raise PushRefused(
                    "the server's weights belong to another training run (one run per server: stop that run, or "
                    f"start another server; it frees {self.lease:g} s after that run's last push)"
                )
            mine = held and self.version is not None
            if mine and parsed.run != self.version.run:
                raise PushRefused(f"weights version {parsed} is not of the run that owns this server")
            if mine and (parsed.step < self.version.step if same else parsed.step <= self.version.step):
                raise PushRefused(f"weights version {parsed} is not newer than the last push (step "
                                  f"{self.version.step})")  # fmt: skip
        return parsed

    def accept(self, owner: str, version: WeightsVersion) -> None:
        """Record a loaded push of ``owner`` at ``version``."""
        with self.lock:
            self.owner, self.version, self.last = key_digest(owner), version, time.monotonic()

    def release(self, owner: str) -> bool:
        """Free the server when ``owner`` owns it (its client closed); whether it did."""
        with self.lock:
            if self.owner is not None and key_digest(owner) == self.owner:
                self.owner = self.version = None
                return True
        return False
