"""``tinker-serve --devices 2 --strategy ddp|fsdp2`` on two gloo CPU processes (Lightning Fabric's launcher) against
one process on the same batches, through the official client. Under ddp: ``loss:sum``, the per-datum log-probs and
the adapter after two forward_backward + optim_step rounds, then a third on a training client loaded from the saved
state, agree within float32 tolerance (rank 1's share of the batch is computed on its own replica, so the later
rounds also show that the replicas stayed equal and that every rank loaded the state). Under fsdp2 (the frozen base
sharded over the two ranks, each holding half of it): two training clients with different LoRA shapes, one of them
on a single datum (so rank 0's share is empty and it runs the zero-weight token), give the same losses, log-probs,
adapters, resumed state and seeded samples (drawn by rank 0 on the base gathered by both ranks) as one process."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("tinker.types")
import tinker  # noqa: E402
from tinker import types  # noqa: E402
from tinker_fixtures import KEYS, saved_model, tinker_server  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BATCH = [[72, 101, 108, 108, 111, 32, 119], [111, 114, 108, 100, 33], [84, 105, 110, 107, 101, 114, 32, 58],
         [97, 98, 99]]  # fmt: skip


def data():
    out = []
    for i, tokens in enumerate(BATCH):
        n = len(tokens) - 1
        inputs = {"target_tokens": torch.tensor(tokens[1:]), "logprobs": torch.full((n,), -5.0 + i),
                  "advantages": torch.linspace(-1.0, 1.5, n)}  # fmt: skip
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    return out


def rounds(url, folder):
    """Two rounds of forward_backward (importance_sampling, 4 datums) + optim_step; the losses, the log-probs and
    the saved adapter."""
    service = tinker.ServiceClient(base_url=url, api_key=KEYS[0])
    client = service.create_lora_training_client(base_model=folder, rank=4, seed=3).result()
    losses, logprobs = [], []
    for _ in range(2):
        out = client.forward_backward(data(), "importance_sampling").result()
        client.optim_step(types.AdamParams(learning_rate=0.05, grad_clip_norm=1.0)).result()
        losses.append(out.metrics["loss:sum"])
        logprobs.append([o["logprobs"].tolist() for o in out.loss_fn_outputs])
    path = client.save_state("after").result().path
    resumed = service.create_training_client_from_state_with_optimizer(path).result()  # loaded on every rank
    out = resumed.forward_backward(data(), "importance_sampling").result()
    resumed.optim_step(types.AdamParams(learning_rate=0.05, grad_clip_norm=1.0)).result()
    losses.append(out.metrics["loss:sum"])
    path = resumed.save_state("resumed").result().path
    service.close("success").result()
    return losses, logprobs, path


def adapter(checkpoints, path):
    from safetensors.torch import load_file

    run, _, name = path[len("tinker://") :].split("/")
    (owner,) = os.listdir(checkpoints)
    return load_file(os.path.join(checkpoints, owner, run.replace(":", "_"), "weights", name, "adapter.safetensors"))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def two_ranks(tmp_path, folder, strategy):
    """``tinker-serve --devices 2 --strategy STRATEGY --accelerator cpu`` over ``folder``; yields ``(url, log)``
    once rank 0 listens."""
    (tmp_path / "keys").write_text("\n".join(KEYS))
    port, log = free_port(), tmp_path / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TINKER_TELEMETRY": "0"}
    command = [sys.executable, "-m", "aitraining_pl.tinker.serve", "--model", folder, "--port", str(port),
               "--devices", "2", "--strategy", strategy, "--accelerator", "cpu",
               "--checkpoint-dir", str(tmp_path / "two"), "--api-key-file", str(tmp_path / "keys")]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while " on http://" not in log.read_text() or proc.poll() is not None:
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(1.0)
        yield f"http://127.0.0.1:{port}", log
    finally:
        proc.terminate()
        proc.wait(60)
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in log.read_text()


def assert_equal_logprobs(two, one):
    assert [len(x) for x in two] == [len(x) for x in one]
    for a, b in zip(two, one):
        for x, y in zip(a, b):
            assert x == pytest.approx(y, abs=1e-5)


def assert_equal_adapters(first, second):
    assert first.keys() == second.keys() and any(t.abs().sum() > 0 for k, t in first.items() if "lora_B" in k)
    for key in first:  # the batches are padded and summed in another order: float32 rounding, through Adam
        torch.testing.assert_close(second[key], first[key], rtol=1e-4, atol=1e-5)


@pytest.mark.ddp
def test_two_ddp_processes_train_as_one(tmp_path):
    folder = saved_model(tmp_path / "model")
    with tinker_server(folder, tmp_path / "one") as (url, _):
        one = rounds(url, folder)
    with two_ranks(tmp_path, folder, "ddp") as (url, _):
        two = rounds(url, folder)
    assert two[0] == pytest.approx(one[0], rel=1e-5)
    assert [len(x) for x in two[1]] == [len(BATCH)] * 2
    assert_equal_logprobs(two[1], one[1])
    assert_equal_adapters(adapter(tmp_path / "one", one[2]), adapter(tmp_path / "two", two[2]))


def tenants(url, folder):
    """Two training clients at once on the one base: A (rank 4, every layer) on the 4-datum batch, B (rank 2, no
    MLP) on one datum; two rounds each, interleaved; A's seeded samples with prompt log-probs; B resumed from its
    saved state for a third round. The losses, log-probs, samples and the final adapters' paths."""
    service = tinker.ServiceClient(base_url=url, api_key=KEYS[0])
    a = service.create_lora_training_client(base_model=folder, rank=4, seed=3).result()
    b = service.create_lora_training_client(base_model=folder, rank=2, seed=5, train_mlp=False).result()
    adam, losses, logprobs = types.AdamParams(learning_rate=0.05, grad_clip_norm=1.0), [], []
    for _ in range(2):
        out_a = a.forward_backward(data(), "importance_sampling")
        out_b = b.forward_backward(data()[1:2], "importance_sampling")
        a.optim_step(adam).result(), b.optim_step(adam).result()
        for out in (out_a.result(), out_b.result()):
            losses.append(out.metrics["loss:sum"])
            logprobs.append([o["logprobs"].tolist() for o in out.loss_fn_outputs])
    sampler = a.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, seed=11, temperature=0.9)
    sampled = sampler.sample(types.ModelInput.from_ints(BATCH[0]), 2, params, include_prompt_logprobs=True).result()
    samples = [s.tokens for s in sampled.sequences], sampled.prompt_logprobs[1:]
    path_a = a.save_state("a").result().path
    resumed = service.create_training_client_from_state_with_optimizer(b.save_state("b").result().path).result()
    out = resumed.forward_backward(data()[1:2], "importance_sampling").result()
    resumed.optim_step(adam).result()
    losses.append(out.metrics["loss:sum"])
    path_b = resumed.save_state("b-resumed").result().path
    service.close("success").result()
    return losses, logprobs, samples, (path_a, path_b)


@pytest.mark.ddp
def test_two_fsdp2_processes_shard_the_base_and_train_two_clients_as_one(tmp_path):
    folder = saved_model(tmp_path / "model")
    with tinker_server(folder, tmp_path / "one") as (url, _):
        one = tenants(url, folder)
    with two_ranks(tmp_path, folder, "fsdp2") as (url, log):
        two = tenants(url, folder)
    shares = {int(r): (int(held), int(whole)) for r, held, whole in
              re.findall(r"rank (\d) holds (\d+) of the base model's (\d+) parameters", log.read_text())}  # fmt: skip
    whole = shares[0][1]
    assert sorted(shares) == [0, 1] and sum(held for held, _ in shares.values()) == whole
    assert all(abs(held - whole / 2) <= 0.02 * whole for held, _ in shares.values())  # each rank: half the base
    assert two[0] == pytest.approx(one[0], rel=1e-5)
    assert_equal_logprobs(two[1], one[1])
    assert two[2][0] == one[2][0] and two[2][1] == pytest.approx(one[2][1], abs=1e-5)  # seeded samples
    for path_one, path_two in zip(one[3], two[3]):
        assert_equal_adapters(adapter(tmp_path / "one", path_one), adapter(tmp_path / "two", path_two))


@pytest.mark.ddp
def test_fsdp2_adapters_added_after_sharding_are_plain_replicated_tensors(tmp_path):
    """``tests/helpers/tinker_fsdp2_script.py``: on both ranks, two adapters added after ``fully_shard`` (the second
    a new tenant) are ordinary parameters no FSDP group holds; the base parameters stay the sharded DTensors FSDP
    made (half of them on each rank), frozen and without gradients, through forward_backward on either adapter
    and set_adapter swaps; B (untrained, B = 0) gives the base's loss after A's step, and A swapped back in gives a
    lower one."""
    script = os.path.join(ROOT, "tests", "helpers", "tinker_fsdp2_script.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = json.loads((tmp_path / "fsdp2.json").read_text())
    assert records[0] == records[1]
    record = records[0]
    held, whole = record["holds"]
    assert 2 * held == whole  # the tiny model's dimensions are even: an exact half
    assert record["lora_plain"] and not record["lora_managed"]
    assert record["frozen_dtensor"] and record["frozen_same_objects"]
    assert not record["frozen_requires_grad"] and not record["frozen_grad"]
    assert record["with_grad"] == [["client_a"], ["client_b"], ["client_b"]]
    first, untrained, trained = record["losses"]
    assert untrained == pytest.approx(first, rel=1e-6) and trained < first - 1.0


def test_fsdp2_with_sampling_servers_is_refused_with_one_line():
    from aitraining_pl.tinker.serve import main

    with pytest.raises(SystemExit, match="--strategy fsdp2 samples in process only"):
        main(["--model", "unused", "--strategy", "fsdp2", "--devices", "2", "--sampler-server", "launch"])


def test_devices_without_ddp_or_fsdp2_are_refused_and_one_device_is_one_process():
    from aitraining_pl.tinker.serve import launch

    with pytest.raises(SystemExit, match="--devices 2: one, or more under --strategy ddp or fsdp2"):
        launch("auto", 2, "cpu")
    assert launch("ddp", 1, "cpu") == launch("fsdp2", 1, "cpu") == (None, None)
