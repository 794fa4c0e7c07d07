"""Asynchronous online RL (``generation.max_staleness`` >= 1): the rollouts of the next batches are generated on a
generation server while the current ones train, with a fixed schedule, so a run is reproducible and resumes
bit-identical.

**Versions.** A version is one iteration's update (``num_iterations`` passes of minibatches: one or several
optimizer steps; the clipped ratio is taken around the weights at the start of the iteration, as in the
synchronous loop). ``version`` counts the iterations that trained.

**The schedule** (verl's one-step-off-policy and NeMo-RL's ``max_trajectory_age_steps``, generalised to k steps):
at each ``training_step`` the pipeline

1. pushes the policy's weights as ``version`` when ``weight_sync_steps`` versions have passed since the last push
   (a host snapshot queued here, and sent by the worker thread in order: ``HostSnapshot``; on a GPU the copies go
   into pinned buffers on a side stream, non-blocking, and overlap the next step, whose first optimizer step waits
   for them on the device, not in the trainer's thread);
2. submits the rollouts of this step's batch, to be sampled by the last pushed version, and scored, on a worker
   thread (the server samples; the reward source runs in this process);
3. returns the rollouts submitted ``lag = max_staleness - weight_sync_steps + 1`` steps ago (waiting for them if
   they are not ready), to be trained on now: they were sampled by a version at most ``max_staleness`` behind
   the weights that train on them. The first ``lag`` steps of a run only submit (nothing is ready to train on:
   the warm-up; their batches are trained ``lag`` steps later); the rollouts in flight when ``fit`` ends are
   dropped (``close``).

The worker runs one job at a time, in submission order, so a push never overtakes the rollouts of the version
before it, and each rollout's requests name the exact version that samples it (the server answers them once it
holds that version). Each job samples with its own seed (run seed, step, rank), so the draws do not depend on the
server's state: a run is reproducible and a resumed one bit-identical. What the trainer's thread needs sampled
outside the schedule (validation, ``SampleLogCallback``) goes through the same worker (``now``): the current
weights are pushed first when they are newer than the last push.

**Checkpoints.** ``state_dict`` waits for the rollouts in flight and saves them (nothing lost, nothing trained
twice), with the counters and, when the last push is older than the policy (``weight_sync_steps`` > 1), its
weights; ``load_state_dict`` restores them, and the resumed run pushes those weights to its new server first.

**Faults.** A failure in the worker (the server gone, a refused request, a reward source error) is raised in the
trainer's thread at its next wait, as the same one-line error; nothing trains on a rollout that failed. ``close``
stops the worker (daemon thread; joined) and drops the rest.

**The free schedule** (``generation.async_schedule: free``; AReaL's and PipelineRL's in-flight weight updates): the
same lag and bound, but rank 0 pushes from the trainer's thread as soon as a push is due, marked ``in_flight``, and
the rollouts ask for their version or any later one. The HF server's engine takes such a push between two decode
steps of the rollouts it is generating (``generation.servers.hf_server``; vLLM's engine loads between batches), so a
response may span two versions, its later tokens fresher; each token's behaviour log-prob is that of the weights
that sampled it and its version is reported (``token_versions``; the staleness is then measured per token). Which
tokens get which weights depends on timing: a free run is not reproducible, and a resumed one continues the
schedule without being bit-identical.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from aitraining_pl.generation.version import WeightsVersion
from aitraining_pl.models.sharding import is_sharded
from aitraining_pl.models.weights import policy_weights

Weights = list[tuple[str, torch.Tensor]]
#: the times ``stats`` reports (seconds since its last call): the trainer waiting for rollouts, the worker sampling
#: and scoring, the worker waiting for work, rank 0 pushing weights
TIMES = ("trainer_wait", "generator_busy", "generator_idle", "push")


class HostSnapshot(list):
    """The policy's weights as host copies, ``(name, tensor)`` pairs, perhaps still being copied: ``wait`` before
    reading them (the worker does, before a push). On a GPU each tensor is copied into a pinned buffer (PyTorch's
    caching host allocator reuses them across pushes once their copies are done) with a non-blocking copy on a side
    stream; the event recorded after the last copy is what ``wait`` waits for, and the device's next optimizer step
    waits for it too (on the device: it would change the parameters being read)."""

    def __init__(self, weights: Weights, done: Any = None):
        super().__init__(weights)
        self.done = done  #: the CUDA event recorded after the copies (None: copied already)

    def wait(self) -> HostSnapshot:
        if self.done is not None:
            self.done.synchronize()
        return self


def copy_to_host(weights: Any) -> HostSnapshot:
    """``HostSnapshot`` of the ``(name, tensor)`` stream ``weights`` (see there); the trainer's thread only queues the
    copies of device tensors."""
    copies: Weights = []
    stream = event = None
    for name, tensor in weights:
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            copies.append((name, tensor.to("cpu", copy=True)))
            continue
        if stream is None:
            stream = torch.cuda.Stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the weights as the step left them
        with torch.cuda.stream(stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # a gathered (FSDP2) or merged (LoRA) temporary stays alive until copied
        copies.append((name, host))
    if stream is not None:
        event = torch.cuda.Event()
        event.record(stream)
        before_next_update(event)
    return HostSnapshot(copies, event)


def before_next_update(event: Any) -> None:
    """Make the device's next optimizer step (any optimizer's) wait for ``event`` first, once."""
    handle = None

    def hook(*args: Any) -> None:
        torch.cuda.current_stream().wait_event(event)
        handle.remove()

    handle = torch.optim.optimizer.register_optimizer_step_pre_hook(hook)


def snapshot(policy: torch.nn.Module, keep: bool) -> HostSnapshot | None:
    """The policy's weights as host copies (``keep``: rank 0), or None; under FSDP2 every rank walks the gathers
    (the other ranks copy nothing)."""
    if keep:
        return copy_to_host(policy_weights(policy))
    if is_sharded(policy):
        collections.deque(policy_weights(policy), maxlen=0)
    return None


def job_seed(seed: int, step: int, rank: int, stream: int = 0) -> int:
    """A non-negative seed for the job of ``step`` on ``rank`` (``stream`` 0: the schedule's, 1: ``now``'s)."""
    return (int(seed) * 1_000_003 + int(step) * 1_009 + int(rank) * 7 + int(stream)) % (2**62)


class _Job:
    """One unit of the worker's work: ``fn()``, its result or its error."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.done = fn, threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


@dataclasses.dataclass
class _Pending:
    """Rollouts submitted and not trained on yet (``job`` done once sampled and scored)."""

    job: _Job
    batch: dict[str, Any]
    version: int  #: the version that samples them
    step: int  #: the step that submitted them


class RolloutPipeline:
    """The fixed asynchronous schedule of one training process (see the module docstring).

    Args:
        backend: a generation server's client (``location == "server"``).
        policy: the policy whose weights are pushed.
        rank: this process's global rank (rank 0 pushes).
        lag: steps between submitting a batch's rollouts and training on them (``GenerationConfig.lag``).
        sync_every: ``weight_sync_steps``.
        seed: the run's seed (each job's seed derives from it).
        free: ``generation.async_schedule: free``: rank 0 pushes from the trainer's thread as soon as an update is
            done, ``in_flight`` (the server's engine takes the weights between decode steps of the rollouts it is
            generating), and the rollouts ask for their version or any later one; not reproducible.
    """

    def __init__(
        self, backend: Any, policy: torch.nn.Module, rank: int, lag: int, sync_every: int, seed: int, free=False
    ):
        self.backend, self.policy, self.rank, self.free = backend, policy, int(rank), bool(free)
        backend.at_least = self.free
        self.lag, self.sync_every, self.seed = int(lag), int(sync_every), int(seed)
        self.version = 0  #: iterations that trained (the policy's version)
        self.pushed = -1  #: the last version pushed (-1: none yet)
        self.step = 0  #: batches submitted
        self.now_calls = 0  #: off-schedule jobs (validation, sample logs)
        self.queue: collections.deque[_Pending] = collections.deque()
        self.held: Weights | None = None  #: rank 0: the weights of ``pushed``, kept while the policy is newer
        self.restore: Weights | None = None  #: weights of a checkpoint's last push, pushed first after a resume
        self.dropped = 0  #: rollouts in flight when the pipeline closed
        self.timing = collections.Counter()  #: seconds: trainer_wait, generator_busy, generator_idle, push
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.closing = False  #: set by ``close``: the worker drops the jobs left
        self.failure: BaseException | None = None  #: the first job's error: every later job fails with it
        self.thread = threading.Thread(target=self._work, name="aitraining-pl-rollouts", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ the worker
    def in_worker(self) -> bool:
        """Whether the caller runs on the worker thread."""
        return threading.current_thread() is self.thread

    def _work(self) -> None:
        last = time.perf_counter()
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if self.closing or self.failure is not None:  # dropped: the pipeline is closing, or a job failed
                job.error = self.failure or RuntimeError("the rollout pipeline closed before this job ran")
                job.done.set()
                continue
            start = time.perf_counter()
            self.timing["generator_idle"] += start - last
            try:
                job.result = job.fn()
            except BaseException as err:  # noqa: BLE001 - raised in the trainer's thread by ``wait``
                job.error = self.failure = err  # a push nobody waits for fails the jobs after it
            last = time.perf_counter()
            self.timing["generator_busy"] += last - start
            job.done.set()

    def _run(self, fn: Callable[[], Any]) -> _Job:
        job = _Job(fn)
        self.jobs.put(job)
        return job

    def wait(self, job: _Job) -> Any:
        """The job's result (the trainer waits for it; counted); its error, raised here."""
        start = time.perf_counter()
        job.done.wait()
        self.timing["trainer_wait"] += time.perf_counter() - start
        if job.error is not None:
            raise job.error
        return job.result

    # ------------------------------------------------------------------ versions
    def key(self, version: int) -> str:
        return str(WeightsVersion(self.backend.run, version))

    def push(self, force: bool = False) -> None:
        """Push the policy's weights as ``version`` when due (``sync_every`` versions since the last push, or
        ``force`` and newer), or a restored checkpoint's last push first."""
        if self.restore is not None:
            weights, self.restore = self.restore, None
            self._push(weights, self.pushed)
        due = self.pushed < 0 or self.version - self.pushed >= (1 if force else self.sync_every)
        if not due or self.version == self.pushed:
            return
        self.pushed = self.version
        weights = snapshot(self.policy, keep=self.rank == 0)
        self.held = weights if self.sync_every > 1 else None
        self._push(weights, self.version)

    def _push(self, weights: Weights | None, version: int) -> None:
        if self.rank != 0:
            return

        def send() -> None:
            start = time.perf_counter()
            if isinstance(weights, HostSnapshot):
                weights.wait()  # the copies queued in the trainer's thread
            self.backend.push(weights, version, in_flight=self.free)
            self.timing["push"] += time.perf_counter() - start

        if self.free:  # now, from this thread, while the worker's rollouts generate
            if self.failure is None:
                send()
        else:  # in order after the rollouts before it
            self._run(send)

    def pinned(self, fn: Callable[[], Any], version: int) -> Callable[[], Any]:
        """``fn`` with this process's requests naming ``version``."""

        def run() -> Any:
            self.backend.version = self.key(version)
            return fn()

        return run

    # ------------------------------------------------------------------ the schedule
    def step_with(self, batch: dict[str, Any], rollout: Callable[[dict[str, Any], int], Any]) -> _Pending | None:
        """One ``training_step``: push when due, submit ``rollout(batch, seed)`` for this step, and return the
        rollouts to train on now (sampled and scored: ``_Pending.job.result``), or None during the warm-up."""
        self.push()
        seed = job_seed(self.seed, self.step, self.rank)
        job = self._run(self.pinned(lambda: rollout(batch, seed), self.pushed))
        self.queue.append(_Pending(job, batch, self.pushed, self.step))
        self.step += 1
        if len(self.queue) <= self.lag:
            return None
        pending = self.queue.popleft()
        self.wait(pending.job)
        return pending

    def trained(self) -> None:
        """An iteration's update is done: the policy is one version newer."""
        self.version += 1

    def now(self, fn: Callable[[int], Any]) -> Any:
        """Run ``fn(seed)`` on the worker with the current weights (pushed first if newer) and wait for it."""
        self.push(force=True)
        seed = job_seed(self.seed, self.now_calls, self.rank, stream=1)
        self.now_calls += 1
        return self.wait(self._run(self.pinned(lambda: fn(seed), self.pushed)))

    def stats(self) -> dict[str, torch.Tensor]:
        """``async/...`` figures of the last step (times since the previous call, queue depth)."""
        figures = {f"async/{k}_s": torch.tensor(float(self.timing[k])) for k in TIMES}  # the same keys on every rank
        self.timing.clear()
        figures["async/queue_depth"] = torch.tensor(float(len(self.queue)))
        return figures

    # ------------------------------------------------------------------ checkpoints and shutdown
    def state_dict(self) -> dict[str, Any]:
        """The counters and the rollouts in flight (waited for), as plain tensors, lists and dicts."""
        for pending in self.queue:
            self.wait(pending.job)
        return {
            "version": self.version,
            "pushed": self.pushed,
            "step": self.step,
            "now_calls": self.now_calls,
            "queue": [
                {
                    "batch": pending.batch,
                    "rollout": plain(pending.job.result),
                    "version": pending.version,
                    "step": pending.step,
                }
                for pending in self.queue
            ],  # fmt: skip
            "weights": held_weights(self.held) if self.pushed < self.version < self.pushed + self.sync_every else None,
        }

    def load_state_dict(self, state: dict[str, Any], restore: Callable[[dict[str, Any]], Any]) -> None:
        """Restore ``state_dict``'s counters and rollouts (``restore`` rebuilds a rollout from its plain form)."""
        self.version, self.pushed = int(state["version"]), int(state["pushed"])
        self.step, self.now_calls = int(state["step"]), int(state["now_calls"])
        self.queue.clear()
        for item in state["queue"]:
            job = _Job(lambda: None)
            job.result = restore(item["rollout"])
            job.done.set()
            self.queue.append(_Pending(job, item["batch"], int(item["version"]), int(item["step"])))
        weights = state.get("weights")
        if weights is not None:  # the next rollouts are of the last push, older than the policy: push it first
            self.restore = self.held = weights
        else:  # the next rollouts are of the current weights: pushed anew to the new server
            self.pushed = -1

    def close(self, timeout: float = 300.0) -> None:
        """Stop the worker after the job it runs (every server request has its own timeout; at most ``timeout``
        seconds are waited here), dropping the jobs not started and the rollouts in flight (``dropped``)."""
        self.dropped += len(self.queue)
        self.queue.clear()
        self.closing = True
        self.jobs.put(None)
        self.thread.join(timeout=timeout)


def held_weights(held: Weights | None) -> Weights | None:
    """The held push as a plain list of finished copies (checkpoint-safe)."""
    if isinstance(held, HostSnapshot):
        held.wait()
    return None if held is None else list(held)


def staleness(version: int, sampled_by: int, rollout: Any) -> dict[str, torch.Tensor]:
    """``async/staleness`` (mean over sampled tokens) and ``/max``: how many versions behind ``version`` the weights
    that sampled ``rollout`` are: per token where the server reported each token's version (a push may land
    mid-generation), else the version the rollout was submitted with (``sampled_by``)."""
    versions, mask = rollout.token_versions, rollout.mask.bool()
    if versions is None or not mask.any():
        value = torch.tensor(float(version - sampled_by))
        return {"async/staleness": value, "async/staleness/max": value}
    behind = (version - versions[mask]).float()
    return {"async/staleness": behind.mean().cpu(), "async/staleness/max": behind.max().cpu()}


def plain(value: Any) -> Any:
    """``value`` with dataclasses turned into dicts and tensors moved to the CPU (checkpoint-safe types)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
