"""The fleet (``generation.servers.fleet.Fleet``) over stand-in servers (``helpers/standin.py``): routing by load,
split requests reassembled in order with the same samples as one server, an episode's turns on one server, every
version on every server before a request names it, in-flight pushes, and the faults (a server killed mid-request,
``servers_up``, rejoining, all gone, deadlines)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from standin import StandInReplica, tokens_for

from aitraining_pl.errors import GenerationServerError
from aitraining_pl.generation.backend import SampleRequest, StopRule
from aitraining_pl.generation.config import GenerationConfig
from aitraining_pl.generation.servers.fleet import Fleet
from aitraining_pl.generation.servers.routing import MIN_PREFIX_TOKENS, PrefixAffinity
from aitraining_pl.generation.version import WeightsVersion

WEIGHTS = [("w", torch.zeros(4))]


def fleet_of(*replicas, **kw) -> Fleet:
    fleet = Fleet(list(replicas), weights=lambda policy: iter(WEIGHTS), run="run", **kw)
    fleet.push(WEIGHTS, 0)
    return fleet


def prompts(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
    return ids, mask


def sample(fleet: Fleet, rows, n=2, seed=7, max_new_tokens=3):
    ids, mask = prompts(rows)
    generation = GenerationConfig(max_new_tokens=max_new_tokens)
    return fleet.sample(SampleRequest(ids, mask, generation, [0], StopRule(), 0, n, seed))


ROWS = [[5, 6], [7], [8, 9, 10], [11], [12, 13], [14]]


def test_split_across_servers_gives_the_samples_of_one_server_in_order():
    one, (a, b, c) = fleet_of(StandInReplica()), (StandInReplica(f"standin://{i}") for i in range(3))
    three = fleet_of(a, b, c)
    alone, split = sample(one, ROWS), sample(three, ROWS)
    assert torch.equal(alone.response_ids, split.response_ids)
    expected = [tokens_for(row, 7 + i * 2 + j, 3, 50) for i, row in enumerate(ROWS) for j in range(2)]
    assert split.response_ids.tolist() == expected
    assert [sum(p for p, _ in r.served) for r in (a, b, c)] == [2, 2, 2]  # balanced: two prompts each


def test_requests_go_to_the_server_with_the_fewest_outstanding_tokens():
    slow, idle = StandInReplica("standin://slow", token_seconds=0.02), StandInReplica("standin://idle")
    fleet = fleet_of(slow, idle)
    busy = threading.Thread(target=sample, args=(fleet, [[1]] * 2), kwargs={"max_new_tokens": 4})
    busy.start()  # one prompt to each; the slow one stays busy for 0.16 s
    time.sleep(0.05)
    sample(fleet, [[2]], n=1)  # the idle server is the less loaded
    busy.join()
    assert slow.served == [(1, WeightsVersion("run", 0))]
    assert len(idle.served) == 2


def test_an_episode_s_next_turn_goes_to_the_server_of_its_first():
    replicas = [StandInReplica(f"standin://{i}") for i in range(2)]
    fleet = fleet_of(*replicas)
    one, two = list(range(1, 1 + MIN_PREFIX_TOKENS)), list(range(20, 20 + MIN_PREFIX_TOKENS))  # a cache block each
    first = sample(fleet, [one, two], n=1)
    assert [r.prompts for r in replicas] == [[one], [two]]  # by load: the least loaded first
    histories = [[*two, *first.response_ids[1].tolist(), 9], [*one, *first.response_ids[0].tolist(), 9]]
    sample(fleet, histories, n=1)  # turn 2, the order reversed (by load: the first history to server 0)
    assert [r.prompts[-1] for r in replicas] == [histories[1], histories[0]]
    sample(fleet, [one, one], n=1)  # a repeated prompt is no continuation: by load
    assert [r.prompts[-1] for r in replicas] == [one, one]
    affinity = PrefixAffinity(min_tokens=1)
    affinity.record([1, 2], 1)
    assert (affinity.lookup([1, 2, 3]), affinity.lookup([1, 2]), affinity.lookup([1, 5])) == (1, None, None)
    assert PrefixAffinity().lookup([1, 2, 3]) is None  # the default: shorter than one cache block counts for nothing


@pytest.mark.parametrize("prefix", [1, MIN_PREFIX_TOKENS + 4], ids=["short", "long"])
def test_a_shared_prefix_does_not_pin_a_rollout_to_one_server(prefix):
    """Issue 52: one earlier prompt that 16 later prompts extend sent all 16 to its server ([16, 0]). A prefix shorter
    than a cache block counts for nothing; a long one takes its server's fair share, and load places the rest."""
    replicas = [StandInReplica(f"standin://{i}") for i in range(2)]
    fleet = fleet_of(*replicas)
    shared = list(range(1, prefix + 1))
    sample(fleet, [shared], n=1)
    served = [len(r.prompts) for r in replicas]
    sample(fleet, [[*shared, 30 + i] for i in range(16)], n=1)
    assert [len(r.prompts) - before for r, before in zip(replicas, served)] == [8, 8]


def test_a_push_reaches_every_server_before_a_request_names_it():
    replicas = [StandInReplica(f"standin://{i}", push_seconds_per_gb=2e7) for i in range(3)]  # 0.3 s a push
    fleet = Fleet(replicas, weights=lambda policy: iter(WEIGHTS), run="run")
    fleet.push(WEIGHTS, 0)
    pushing = threading.Thread(target=fleet.push, args=(WEIGHTS, 1))
    pushing.start()
    time.sleep(0.1)
    assert fleet.version == WeightsVersion("run", 0)  # not yet: some server may lack version 1
    pushing.join()
    assert fleet.version == WeightsVersion("run", 1) and all(r.version == fleet.version for r in replicas)
    sample(fleet, ROWS)
    assert all(version == WeightsVersion("run", 1) for r in replicas for _, version in r.served)


def test_an_in_flight_push_pauses_pushes_and_resumes_each_server():
    replicas = [StandInReplica(f"standin://{i}") for i in range(2)]
    fleet = fleet_of(*replicas)
    fleet.push(WEIGHTS, 1, in_flight=True)
    assert all(r.events == ["push", "pause", "push", "resume"] for r in replicas)


def test_a_lora_policy_pushes_its_base_once_per_server_then_adapters_alone():
    from peft import LoraConfig, get_peft_model

    from aitraining_pl.models.loading import build_causal_lm

    policy = get_peft_model(build_causal_lm({"preset": "tiny-llama"}), LoraConfig(r=2, target_modules=["q_proj"]))
    replicas = [StandInReplica(f"standin://{i}") for i in range(2)]
    fleet = Fleet(replicas, weights=lambda policy: iter(WEIGHTS), run="run")
    fleet.sync(policy, 0)
    fleet.sync(policy, 1)
    for replica in replicas:  # base (no adapter weight), adapter (only those), adapter
        base, first, second = replica.pushed
        assert not any("lora_" in n for n in base) and all("lora_" in n for n in first + second), replica.pushed
    replicas[0].kill()
    with pytest.warns(RuntimeWarning, match="is down"):
        sample(fleet, ROWS)
    replicas[0].restart()
    with pytest.warns(RuntimeWarning, match="rejoined"):
        fleet.sync(policy, 2)
    assert [len(r.pushed) for r in replicas] == [5, 4]  # the restarted server gets the base again


def test_a_killed_server_s_requests_are_resent_and_the_run_goes_on():
    doomed, other = StandInReplica("standin://doomed", token_seconds=0.01), StandInReplica("standin://other")
    fleet = fleet_of(doomed, other)
    threading.Timer(0.05, doomed.kill).start()  # mid-request (its half takes 0.18 s)
    with pytest.warns(RuntimeWarning, match=r"server 0 \(standin://doomed\) is down while sampling"):
        out = sample(fleet, ROWS)
    expected = [tokens_for(row, 7 + i * 2 + j, 3, 50) for i, row in enumerate(ROWS) for j in range(2)]
    assert out.response_ids.tolist() == expected  # re-sent with the same seeds: the same samples
    stats = fleet.stats()
    assert (stats["fleet/size"].item(), stats["fleet/servers_up"].item()) == (2.0, 1.0)
    assert stats["fleet/1/requests"].item() == 2.0 and stats["fleet/1/tokens_per_s"].item() > 0
    sample(fleet, ROWS)  # all to the one up
    assert other.served[-1][0] == len(ROWS)


def test_another_rank_asks_for_the_version_rank_0_pushed():
    """The asynchronous pipeline pushes from rank 0 only: another rank's fleet, which walked no push, names the
    version and its requests go to the servers up (which hold them until rank 0's push arrives)."""
    shared = StandInReplica("standin://shared")
    fleet_of(shared)  # rank 0: pushes step 0
    other = Fleet([shared], weights=lambda policy: iter(WEIGHTS), rank=1, run="run")
    other.version = "run:0"
    out = sample(other, ROWS)
    assert out.token_versions.eq(0).all() and shared.served[-1][1] == WeightsVersion("run", 0)


def test_a_restarted_server_rejoins_at_the_next_push():
    back, other = StandInReplica("standin://back"), StandInReplica("standin://other")
    fleet = fleet_of(back, other)
    back.kill()
    with pytest.warns(RuntimeWarning, match="is down"):
        sample(fleet, ROWS)
    back.restart()
    sample(fleet, ROWS)  # not before a push: it holds no weights
    assert back.served == []
    with pytest.warns(RuntimeWarning, match=r"server 0 \(standin://back\) answers again and rejoined at step 1"):
        fleet.push(WEIGHTS, 1)
    assert fleet.stats()["fleet/servers_up"].item() == 2.0
    sample(fleet, ROWS)
    assert back.served and back.served[-1][1] == WeightsVersion("run", 1)


def test_every_server_gone_is_one_line():
    replicas = [StandInReplica(f"standin://{i}") for i in range(2)]
    fleet = fleet_of(*replicas)
    for replica in replicas:
        replica.kill()
    with pytest.warns(RuntimeWarning), pytest.raises(GenerationServerError) as caught:
        sample(fleet, ROWS)
    assert str(caught.value) == (
        "generation fleet: all 2 generation servers (standin://0, standin://1) are down or unreachable while sampling "
        "with the weights of step 0; start them again; a run that had started resumes from its last checkpoint "
        "with --ckpt_path"
    )
    with pytest.raises(GenerationServerError, match="while pushing the weights of step 1"):
        fleet.push(WEIGHTS, 1)


def test_a_slow_server_misses_its_deadline_and_the_others_answer():
    slow, fast = StandInReplica("standin://slow", token_seconds=1.0), StandInReplica("standin://fast")
    fleet = fleet_of(slow, fast, connect_timeout=0.2, token_timeout=0.05)  # deadline 0.35 s for 3 tokens
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="no answer by its deadline"):
        out = sample(fleet, ROWS)
    assert time.monotonic() - start < 1.0 and out.response_ids.shape == (12, 3)
    assert slow.served == [] and fast.served


@pytest.mark.parametrize(
    ("server", "message"),
    [
        ("conect", "GenerationConfig.server: unknown 'conect'; must be none, connect, launch, a URL"),
        ({"urls": ["http://h:1", "h:2"]}, r"GenerationConfig.server.urls\[1\]: 'h:2' is not a URL"),
        ({"urls": []}, "GenerationConfig.server.urls: is empty"),
        ({"launch": {"count": 0}}, "GenerationConfig.server.launch.count: must be >= 1 \\(an integer\\), got 0"),
        (
            {"launch": {"count": 2, "devices": ["1"]}},
            "GenerationConfig.server.launch.devices: 1 entries for count 2: one entry",
        ),
        ({"launch": {"engine": "sglang"}}, "GenerationConfig.server.launch.engine: unknown engine 'sglang'"),
        ({"urls": ["http://h:1"], "launch": {}}, "GenerationConfig.server: give either urls"),
    ],
)
def test_a_bad_server_option_is_one_line_naming_it(server, message):
    from aitraining_pl.errors import HyperparameterError

    with pytest.raises(HyperparameterError, match=message):
        GenerationConfig(server=server).validate()


def test_the_forms_of_server():
    """Every form of ``generation.server`` is a fleet; one server a fleet of one, whose requests keep
    ``vllm.server_timeout`` as their deadline (nowhere else to send them); ``none`` samples in this process."""
    assert GenerationConfig().fleet() is None
    connect = GenerationConfig(server="connect", vllm={"server_port": 8123, "server_timeout": 90}).fleet()
    assert connect.urls == ["http://127.0.0.1:8123"] and (connect.connect_timeout, connect.token_timeout) == (90, 0)
    assert GenerationConfig(backend="vllm", vllm={"mode": "server"}).fleet().urls == ["http://127.0.0.1:8000"]
    one = GenerationConfig(server="launch", backend="vllm", server_devices=[1, 2]).fleet().launch
    assert (one.count, one.engine, one.devices) == (1, "vllm", ["1,2"])
    assert GenerationConfig(server="launch").fleet().launch.engine == "hf"
    assert GenerationConfig(server="http://127.0.0.1:8000").fleet().urls == ["http://127.0.0.1:8000"]
    launch = GenerationConfig(server={"launch": {"count": 2, "devices": ["0", "1"]}})
    launch.validate()
    assert launch.fleet().launch.count == 2
