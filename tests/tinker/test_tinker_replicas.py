"""``tinker-serve --devices 2 --strategy ddp`` on two gloo CPU processes (Lightning Fabric's launcher) against one
process on the same batch, through the official client: ``loss:sum``, the per-datum log-probs and the adapter after
two forward_backward + optim_step rounds, then a third on a training client loaded from the saved state, agree
within float32 tolerance (rank 1's share of the batch is computed on its own replica, so the later rounds also show
that the replicas stayed equal and that every rank loaded the state). ``--strategy fsdp2`` is refused with one
line."""

from __future__ import annotations

import os
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


@pytest.mark.ddp
def test_two_ddp_processes_train_as_one(tmp_path):
    folder = saved_model(tmp_path / "model")
    (tmp_path / "keys").write_text("\n".join(KEYS))
    with tinker_server(folder, tmp_path / "one") as (url, _):
        one = rounds(url, folder)
    port, log = free_port(), open(tmp_path / "serve.log", "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TINKER_TELEMETRY": "0"}
    command = [sys.executable, "-m", "aitraining_pl.tinker.serve", "--model", folder, "--port", str(port),
               "--devices", "2", "--strategy", "ddp", "--accelerator", "cpu",
               "--checkpoint-dir", str(tmp_path / "two"), "--api-key-file", str(tmp_path / "keys")]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while "tinker-serve: " not in (tmp_path / "serve.log").read_text() or proc.poll() is not None:
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(1.0)
        two = rounds(f"http://127.0.0.1:{port}", folder)
    finally:
        proc.terminate()
        proc.wait(60)
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in (tmp_path / "serve.log").read_text()
    assert two[0] == pytest.approx(one[0], rel=1e-5)
    assert [len(x) for x in two[1]] == [len(x) for x in one[1]] == [len(BATCH)] * 2
    for a, b in zip(two[1], one[1]):
        for x, y in zip(a, b):
            assert x == pytest.approx(y, abs=1e-5)
    first, second = adapter(tmp_path / "one", one[2]), adapter(tmp_path / "two", two[2])
    assert first.keys() == second.keys() and any(t.abs().sum() > 0 for k, t in first.items() if "lora_B" in k)
    for key in first:  # the batches are padded and summed in another order: float32 rounding, through Adam
        torch.testing.assert_close(second[key], first[key], rtol=1e-4, atol=1e-5)


def test_fsdp2_is_refused_with_one_line():
    from aitraining_pl.tinker.serve import main

    with pytest.raises(SystemExit, match="--strategy fsdp2 is not served: every training client adds its own LoRA"):
        main(["--model", "unused", "--strategy", "fsdp2"])


def test_devices_without_ddp_are_refused_and_one_device_is_one_process():
    from aitraining_pl.tinker.serve import launch

    with pytest.raises(SystemExit, match="--devices 2: one, or more under --strategy ddp"):
        launch("auto", 2, "cpu")
    assert launch("ddp", 1, "cpu") == (None, None)
