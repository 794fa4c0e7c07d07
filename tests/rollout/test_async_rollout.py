"""The fixed asynchronous schedule (``rollout.asynchronous.RolloutPipeline``, issue 31) against a stand-in server
client: the staleness bound, the push order, the warm-up, a slow generator, checkpoints and faults. No model: the
policy is one linear layer whose weight says its version."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from aitraining_pl.errors import GenerationServerError
from aitraining_pl.generation.config import GenerationConfig
from aitraining_pl.rollout.asynchronous import RolloutPipeline, job_seed


class StandInClient:
    """Records what a server would see: each push (version, the weight's value) and each rollout (the version its
    requests name), in the order the worker sent them; sample number ``fail_at`` (from 0) fails as a lost server."""

    location, run = "server", "run"

    def __init__(self, delay: float = 0.0, fail_at: int = -1):
        self.version, self.delay, self.fail_at = None, delay, fail_at
        self.events: list[tuple[str, int, float]] = []
        self.held: dict[int, float] = {}

    def push(self, weights, version, in_flight=False):
        value = float(dict(weights)["weight"].flatten()[0])
        self.held[version] = value
        self.events.append(("push", version, value))

    def sample(self, batch: int) -> tuple[int, int, float | None]:
        if sum(kind == "sample" for kind, _, _ in self.events) == self.fail_at:
            raise GenerationServerError("generation server 127.0.0.1:1", "the connection was lost while sampling")
        time.sleep(self.delay)
        step = int(self.version.rsplit(":", 1)[1])
        self.events.append(("sample", step, float(batch)))
        return batch, step, self.held.get(step)


def policy_at(version: int) -> torch.nn.Linear:
    layer = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(float(version))
    return layer


def run(pipeline: RolloutPipeline, client: StandInClient, batches: range, policy: torch.nn.Linear) -> list[tuple]:
    """Drive ``pipeline`` over ``batches`` as ``training_step`` does; returns (batch, version trained at, version that
    sampled, the value of the weights that sampled) per trained step."""
    trained = []
    for b in batches:
        ready = pipeline.step_with({"b": b}, lambda batch, seed: client.sample(batch["b"]))
        if ready is None:
            continue
        batch, sampled_by, value = ready.job.result
        assert batch == ready.batch["b"]
        trained.append((batch, pipeline.version, sampled_by, value))
        pipeline.trained()
        with torch.no_grad():
            policy.weight.fill_(float(pipeline.version))
    return trained


@pytest.mark.parametrize("staleness, sync_every", [(1, 1), (2, 1), (2, 2), (3, 2)])
def test_no_rollout_trains_on_weights_older_than_max_staleness(staleness, sync_every):
    generation = GenerationConfig(max_staleness=staleness, weight_sync_steps=sync_every)
    client, policy = StandInClient(), policy_at(0)
    pipeline = RolloutPipeline(client, policy, 0, generation.lag(), sync_every, seed=0)
    try:
        trained = run(pipeline, client, range(12), policy)
    finally:
        pipeline.close()
    lag = staleness - sync_every + 1
    assert [t[0] for t in trained] == list(range(12 - lag))  # every batch in order, the first ``lag`` steps warm up
    for _, now, sampled_by, value in trained:
        assert 0 <= now - sampled_by <= staleness
        assert value == sampled_by  # the weights pushed as version v are the policy's after v updates
    assert max(now - by for _, now, by, _ in trained) == staleness  # the bound is reached, not only respected
    # the worker sends in order: every rollout after the push of the version it names, none before
    pushed = []
    for kind, version, _ in client.events:
        if kind == "push":
            pushed.append(version)
        else:
            assert pushed and pushed[-1] == version
    assert pushed == list(range(0, pushed[-1] + 1, sync_every))


def test_a_slow_generator_is_waited_for_and_counted():
    client, policy = StandInClient(delay=0.05), policy_at(0)
    pipeline = RolloutPipeline(client, policy, 0, lag=1, sync_every=1, seed=0)
    try:
        trained = run(pipeline, client, range(4), policy)
        stats = pipeline.stats()
    finally:
        pipeline.close()
    assert [now - by for _, now, by, _ in trained] == [0, 1, 1]  # still within the bound
    assert float(stats["async/trainer_wait_s"]) > 0 and float(stats["async/generator_busy_s"]) > 0


def test_only_rank_zero_pushes_and_every_rank_names_the_version():
    client, policy = StandInClient(), policy_at(0)
    pipeline = RolloutPipeline(client, policy, 1, lag=1, sync_every=1, seed=0)
    try:
        trained = run(pipeline, client, range(4), policy)
    finally:
        pipeline.close()
    assert [e for e in client.events if e[0] == "push"] == []
    assert [by for _, _, by, _ in trained] == [0, 0, 1]


@pytest.mark.parametrize("sync_every", [1, 2])
def test_resumed_schedule_equals_the_uninterrupted_one(sync_every):
    lag = 2 - sync_every + 1

    def pipeline_for(client, policy):
        return RolloutPipeline(client, policy, 0, lag=lag, sync_every=sync_every, seed=3)

    client, policy = StandInClient(), policy_at(0)
    whole = pipeline_for(client, policy)
    expected = run(whole, client, range(10), policy)
    whole.close()

    client, policy = StandInClient(), policy_at(0)
    first = pipeline_for(client, policy)
    trained = run(first, client, range(5), policy)
    state = first.state_dict()  # waits for the rollouts in flight and keeps them
    first.close()
    assert len(state["queue"]) == lag and first.dropped == lag

    client = StandInClient()  # a new server: holds nothing
    second = pipeline_for(client, policy)
    second.load_state_dict(state, restore=lambda plain: tuple(plain))
    try:
        trained += run(second, client, range(5, 10), policy)
    finally:
        second.close()
    assert trained == expected


def test_seeds_depend_on_seed_step_and_rank_only():
    seeds = {job_seed(s, step, rank) for s in (0, 1) for step in range(50) for rank in range(4)}
    assert len(seeds) == 400 and all(0 <= s < 2**62 for s in seeds)


def test_a_server_fault_is_raised_in_the_trainer_and_the_worker_stops():
    client, policy = StandInClient(fail_at=3), policy_at(0)
    pipeline = RolloutPipeline(client, policy, 0, lag=1, sync_every=1, seed=0)
    with pytest.raises(GenerationServerError, match="connection was lost"):
        run(pipeline, client, range(6), policy)
    pipeline.close()
    assert not pipeline.thread.is_alive()
    assert "aitraining-pl-rollouts" not in [t.name for t in threading.enumerate()]


def test_a_push_queues_the_host_copy_and_the_worker_sends_it_once_copied(monkeypatch):
    """The trainer's thread only queues the snapshot (on a GPU: non-blocking copies into pinned buffers on a side
    stream; here a stub device whose copy finishes when the test says): ``push`` returns at once, the next step
    goes on (the policy changes), and the worker sends the weights of the push once the copy is done."""
    import aitraining_pl.rollout.asynchronous as asynchronous

    copied = threading.Event()

    class StubCopy:
        def synchronize(self):
            assert copied.wait(10)

    def queued_copy(weights):  # what the device would hold once done: the values at the push
        return asynchronous.HostSnapshot([(n, t.detach().clone()) for n, t in weights], StubCopy())

    monkeypatch.setattr(asynchronous, "copy_to_host", queued_copy)
    client, policy = StandInClient(), policy_at(3)
    pipeline = RolloutPipeline(client, policy, 0, lag=1, sync_every=1, seed=0)
    try:
        start = time.perf_counter()
        pipeline.push()
        assert time.perf_counter() - start < 1.0 and client.events == []  # queued, not sent, the trainer goes on
        with torch.no_grad():
            policy.weight.fill_(4.0)  # the next step's update
        copied.set()
        pipeline.wait(pipeline._run(lambda: None))  # the worker is past the push
        assert client.events == [("push", 0, 3.0)]
    finally:
        pipeline.close()


def test_host_snapshot_holds_the_weights_of_the_push():
    from aitraining_pl.rollout.asynchronous import copy_to_host

    policy = policy_at(5)
    weights = copy_to_host(policy.state_dict().items())
    with torch.no_grad():
        policy.weight.fill_(6.0)
    assert float(dict(weights.wait())["weight"]) == 5.0 and weights.done is None  # on the CPU: copied at once
