"""The seed's ``AsyncTrainingClient`` / ``ForwardBackwardPipeline`` calls against ``tinker-serve`` (``RemotePipeline``,
``AsyncTrainingClient.connect``): the same batch-dict code gives the in-process pipeline's losses and log-probs on
the same weights (a new LoRA adapter is the base model), accumulates and steps as it does, and learns."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tinker")
from tinker_fixtures import KEYS, saved_model, tinker_server  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from aitraining_pl.compat import AsyncTrainingClient  # noqa: E402


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    folder = saved_model(tmp_path_factory.mktemp("model"))
    with tinker_server(folder, tmp_path_factory.mktemp("checkpoints")) as (url, _):
        local = AsyncTrainingClient(AutoModelForCausalLM.from_pretrained(folder).eval(), device="cpu")
        remote = AsyncTrainingClient.connect(url, KEYS[0], folder, rank=4, seed=0, gradient_accumulation_steps=2)
        yield local, remote
        local.shutdown()
        remote.shutdown()


def batch():
    ids = torch.tensor([[72, 101, 108, 108, 111, 32, 119, 111], [84, 104, 101, 32, 99, 97, 116, 0]])
    mask = torch.tensor([[1] * 8, [1] * 7 + [0]])
    labels = ids.clone()
    labels[:, :3] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_same_code_same_losses_in_process_and_remote(clients):
    local, remote = clients
    for client in (local, remote):  # the same code for both
        results = [client.forward_backward(batch()).result(), client.forward(batch()).result()]
        old = results[1].logprobs + 0.1
        adv = torch.tensor([1.0, -0.5])
        results.append(client.forward_backward({**batch(), "old_logprobs": old, "advantages": adv},
                                               "importance_sampling").result())  # fmt: skip
        results.append(client.forward_backward({**batch(), "old_log_probs": old, "advantages": adv}, "ppo").result())
        if client is local:
            expected = results
    for got, want in zip(results, expected):
        assert got.loss == pytest.approx(want.loss, rel=1e-4, abs=1e-6)
        torch.testing.assert_close(got.logprobs * results[1].mask, want.logprobs * results[1].mask, atol=1e-5, rtol=0)


def test_remote_accumulates_steps_and_learns(clients):
    _, remote = clients
    optimizer = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
    assert remote.optim_step(optimizer, force=True).result().applied  # the first test's micro-batches
    first = remote.forward(batch()).result().loss
    for _ in range(6):
        remote.forward_backward(batch())
        assert not remote.optim_step(optimizer).result().applied  # 1 of 2 micro-batches
        remote.forward_backward(batch())
        assert remote.optim_step(optimizer).result().applied
    assert remote.forward(batch()).result().loss < 0.7 * first
    sample = remote.sample(torch.tensor([72, 101]), max_tokens=4, temperature=0.0)
    assert len(sample["tokens"]) == 4 and len(sample["logprobs"]) == 4
