"""The collective weight channel of server mode (``generation.vllm.weight_channel``: ``nccl`` or ``gloo``): a
process group of two members, the generation server (member 0, which hosts its rendezvous store) and the
trainer's rank 0 (member 1), apart from the training run's own process group. A weight push then sends each
tensor's name, dtype and shape as a header-only frame over the server's TCP connection and its bytes as a
``broadcast`` from member 1 on this group: GPU to GPU with NCCL, with no copy through the trainer's host memory
(the server stages what it received in its host memory, checked, before loading it: ``guards``); the same code
with gloo moves CPU tensors (how the path is tested on a CPU).

The group is built from torch's own ``TCPStore`` and ``ProcessGroupNCCL`` / ``ProcessGroupGloo`` objects without
``init_process_group``, so neither side's default process group is touched (vLLM's workers and the trainer's DDP or
FSDP2 group keep theirs). This follows the stateless-group design TRL's ``vllm-serve`` and OpenRLHF use for their
NCCL weight updates (there with vLLM's ``StatelessProcessGroup`` and ``PyNcclCommunicator``).
"""

from __future__ import annotations

import datetime
import re
from typing import Any

import torch

BACKENDS = ("nccl", "gloo")
SERVER, TRAINER = 0, 1  #: the members of the group: the server hosts the store, the trainer broadcasts
PREFIX = "aitraining-pl/weights"  #: the keys of the group's store


class ChannelBroken(ConnectionError):
    """A broadcast on the weight channel failed: the other member left (or timed out)."""


def failure(err: BaseException) -> str:
    """The gist of a failed collective's message (gloo's and NCCL's carry a source location and advice): e.g.
    ``Read error [127.0.0.1]:20882: Connection reset by peer``."""
    text = " ".join(str(err).split())
    return re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0] or type(err).__name__


def group_device(backend: str) -> torch.device:
    """Where the tensors of a ``backend`` group live: this process's current GPU for NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def host_store(host: str, port: int, timeout: float) -> torch.distributed.TCPStore:
    """The server's side: the group's rendezvous store listening on ``host:port`` (``port`` 0: any free one, read
    back from ``.port``); it returns at once, the trainer joins by ``WeightGroup``."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, 2, True, datetime.timedelta(seconds=timeout), wait_for_workers=False)


class WeightGroup:
    """One member of the two-member weight group.

    Args:
        backend: ``nccl`` (GPUs) or ``gloo`` (CPU tensors).
        store: the server's ``host_store``; None on the trainer, which connects to ``host:port``.
        host, port: where the store listens (the trainer's side).
        timeout: seconds to wait for the other member, at the rendezvous and in each broadcast.
    """

    def __init__(self, backend: str, timeout: float, store: Any = None, host: str = "", port: int = 0):
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise ValueError(f"weight channel backend {backend!r}; known: {', '.join(BACKENDS)}")
        wait = datetime.timedelta(seconds=timeout)
        self.backend, self.device = backend, group_device(backend)
        self.rank = SERVER if store is not None else TRAINER
        if store is None:
            store = dist.TCPStore(host, port, 2, False, wait)
        self.store = store  # kept alive as long as the group
        prefixed = dist.PrefixStore(PREFIX, store)
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(prefixed, self.rank, 2, wait)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = wait
            self.group = dist.ProcessGroupNCCL(prefixed, self.rank, 2, options)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank = TRAINER
        try:
            self.group.broadcast([tensor], options).wait()
        except RuntimeError as err:
            raise ChannelBroken(f"the weight channel broke ({failure(err)})") from None

    def send(self, tensor: torch.Tensor) -> None:
        """The trainer: broadcast ``tensor`` to the server (copied to the group's device when it lies elsewhere);
        ``ChannelBroken`` when the server has left."""
        self._broadcast(tensor.detach().to(self.device).contiguous())

    def receive(self, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        """The server: the next tensor the trainer broadcasts, of ``dtype`` and ``shape``, on the group's device."""
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        self._broadcast(tensor)
        return tensor

    def close(self) -> None:
        """Release the group's connections (NCCL's communicator; gloo's sockets go with the object)."""
        group, self.group = getattr(self, "group", None), None
        shutdown = getattr(group, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:  # pragma: no cover - an already broken group
                pass
