"""ForwardBackwardPipeline and AsyncTrainingClient: losses, accumulation, ordering, checkpoints, sampling."""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch

from aitraining_pl.compat.forward_backward import AsyncTrainingClient, ForwardBackwardPipeline, filter_logits
from aitraining_pl.losses import token_logps
from aitraining_pl.models import PPOModel, build_causal_lm


@pytest.fixture
def model(tiny_config):
    return build_causal_lm(tiny_config, seed=0)


def batch_of(n, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n, length), generator=g)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_accumulating_four_micro_batches_equals_one_batch_of_four_times_the_size(model):
    ids = batch_of(8)
    big = copy.deepcopy(model)
    acc = ForwardBackwardPipeline(model, device="cpu", gradient_accumulation_steps=4)
    one = ForwardBackwardPipeline(big, device="cpu", gradient_accumulation_steps=1)
    futures = [acc.forward_backward(ids[i : i + 2]) for i in range(0, 8, 2)]
    losses = [f.result().loss for f in futures]
    full = one.forward_backward(ids).result()
    assert sum(losses) / 4 == pytest.approx(full.loss, rel=1e-5)
    g_acc, g_one = grads(model), grads(big)
    assert g_acc.keys() == g_one.keys() and len(g_acc) > 0
    for name in g_acc:
        torch.testing.assert_close(g_acc[name], g_one[name], rtol=1e-4, atol=1e-6)
    # the optimizer step then moves both models identically (SGD, no clipping)
    res_acc = acc.optim_step(torch.optim.SGD(model.parameters(), lr=0.5), max_grad_norm=None).result()
    res_one = one.optim_step(torch.optim.SGD(big.parameters(), lr=0.5), max_grad_norm=None).result()
    assert res_acc.applied and res_one.applied and res_acc.num_micro_batches == 4
    assert res_acc.grad_norm == pytest.approx(res_one.grad_norm, rel=1e-4)
    for (_, p), (_, q) in zip(model.named_parameters(), big.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    acc.shutdown(), one.shutdown()


def test_optim_step_waits_for_enough_micro_batches(model):
    pipe = ForwardBackwardPipeline(model, device="cpu", gradient_accumulation_steps=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    pipe.forward_backward(batch_of(2))
    skipped = pipe.optim_step(opt).result()
    assert not skipped.applied and skipped.num_micro_batches == 1
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    pipe.forward_backward(batch_of(2, seed=1))
    done = pipe.optim_step(opt, max_grad_norm=1e-3).result()
    assert done.applied and done.step == 1 and done.grad_norm > 1e-3  # norm before clipping is reported
    assert all(p.grad is None for p in model.parameters())
    pipe.shutdown()


def test_cross_entropy_matches_the_models_own_loss_and_labels_mask(model):
    ids = batch_of(3)
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    expected = model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
    with ForwardBackwardPipeline(model, device="cpu") as pipe:
        result = pipe.forward_backward(ids, attention_mask=mask).result()
    assert result.loss == pytest.approx(expected, rel=1e-5)
    assert result.num_tokens == 3 * 11 - 4


def test_importance_sampling_and_ppo_losses(model):
    ids = batch_of(2)
    with torch.no_grad():
        old = token_logps(model(input_ids=ids).logits, ids)
    advantages = torch.tensor([1.0, -0.5])
    with ForwardBackwardPipeline(model, device="cpu") as pipe:
        with pytest.raises(ValueError, match="advantages"):
            pipe.forward_backward(ids, loss_fn="importance_sampling", old_logprobs=old)
        with pytest.raises(ValueError, match="unknown loss_fn"):
            pipe.forward_backward(ids, loss_fn="nope")
        is_result = pipe.forward_backward(
            ids, loss_fn="importance_sampling", old_logprobs=old, advantages=advantages
        ).result()
        # on-policy: every ratio is 1, so the loss is -mean(A) over the tokens
        assert is_result.loss == pytest.approx(-0.25, abs=1e-5) and is_result.metrics["ratio"] == pytest.approx(1.0)
        g_is = grads(model)
        model.zero_grad()
        ppo_result = pipe.forward_backward(ids, loss_fn="ppo", old_log_probs=old, advantages=advantages).result()
        assert ppo_result.loss == pytest.approx(-0.25, abs=1e-5) and ppo_result.metrics["clipfrac"] == 0.0
        for name, g in grads(model).items():  # unclipped PPO has the importance-sampling gradient
            torch.testing.assert_close(g, g_is[name], rtol=1e-4, atol=1e-7)
        with pytest.raises(ValueError, match="value head"):
            pipe.forward_backward(
                ids, loss_fn="ppo", old_log_probs=old, advantages=advantages, returns=advantages
            ).result()


def test_ppo_loss_with_a_value_head_adds_the_value_loss(model):
    ppo_model = PPOModel(model)
    ids = batch_of(2)
    with torch.no_grad():
        old = token_logps(ppo_model(ids).logits, ids)
    returns = torch.tensor([2.0, -2.0])
    with ForwardBackwardPipeline(ppo_model, device="cpu") as pipe:
        result = pipe.forward_backward(
            ids, loss_fn="ppo", old_log_probs=old, advantages=torch.zeros(2), returns=returns, value_coef=0.5
        ).result()
    # initial values are 0 (zero-initialised head): value loss = 0.5 * mean(R^2) = 2
    assert result.metrics["value_loss"] == pytest.approx(2.0, abs=1e-5)
    assert result.loss == pytest.approx(1.0, abs=1e-5)
    assert ppo_model.value_head.net[-1].weight.grad.abs().sum() > 0


def test_custom_loss_must_be_a_scalar_and_work_runs_in_submission_order(model):
    """The first job holds the queue (an event, set once all six are queued): the others wait behind it, none
    runs beside another, and they run in the order they were queued."""
    order, running, overlaps, lock = [], [], [], threading.Lock()
    all_queued = threading.Event()

    def custom(model, inputs, outputs, index):
        with lock:
            overlaps.append(len(running))
            running.append(index)
        if index == 0:
            all_queued.wait(timeout=60)  # a bound against a hang, not an ordering device
        with lock:
            running.remove(index)
            order.append(index)
        return outputs.logits.mean() * 0 + index

    with ForwardBackwardPipeline(model, device="cpu", max_workers=4) as pipe:
        try:
            futures = [pipe.forward_backward_custom(batch_of(1), custom, index=i) for i in range(6)]
        finally:
            all_queued.set()
        assert [f.result().loss for f in futures] == [0, 1, 2, 3, 4, 5]
        assert order == [0, 1, 2, 3, 4, 5] and overlaps == [0] * 6
        bad = pipe.forward_backward_custom(batch_of(1), lambda m, i, o: o.logits.mean(-1))
        with pytest.raises(ValueError, match="scalar"):
            bad.result()
        # a forward queued after an update sees the updated weights
        first = pipe.forward(batch_of(2))
        pipe.forward_backward(batch_of(2))
        pipe.optim_step(torch.optim.SGD(model.parameters(), lr=1.0))
        second = pipe.forward(batch_of(2))
        assert not torch.allclose(first.result().logprobs, second.result().logprobs)
    with pytest.raises(RuntimeError, match="shut down"):
        pipe.forward(batch_of(1))


def test_save_and_load_round_trip_restores_weights_and_optimizer(model, tiny_config, tmp_path):
    def train_step(pipe, opt, seed):
        pipe.forward_backward(batch_of(4, seed=seed))
        return pipe.optim_step(opt).result()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pipe = ForwardBackwardPipeline(model, device="cpu", checkpoint_dir=str(tmp_path))
    train_step(pipe, opt, 0), train_step(pipe, opt, 1)
    info = pipe.save_state("checkpoint_2")
    assert set(info) == {"path", "model_path", "optimizer_path", "state_path"}
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step(pipe, opt, 2)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    pipe.save_state("checkpoint_2")  # overwriting a checkpoint replaces it whole
    pipe.shutdown()

    fresh = build_causal_lm(tiny_config, seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    restored = ForwardBackwardPipeline(fresh, device="cpu", checkpoint_dir=str(tmp_path))
    state = restored.load_state(info["path"], optimizer=fresh_opt)
    assert state["step"] == 3 and restored.step == 3
    assert all(torch.equal(p, expected[n]) for n, p in fresh.named_parameters())
    pipe2 = ForwardBackwardPipeline(copy.deepcopy(fresh), device="cpu")
    # load by name under checkpoint_dir; the optimizer state waits for the first optim_step
    restored2 = ForwardBackwardPipeline(
        build_causal_lm(tiny_config, seed=2), device="cpu", checkpoint_dir=str(tmp_path)
    )
    restored2.load_state("checkpoint_2")
    opt2 = torch.optim.AdamW(restored2.model.parameters(), lr=1e-2)
    train_step(restored, fresh_opt, 3), train_step(restored2, opt2, 3)
    assert fresh_opt.state_dict()["state"][0]["step"] == 4  # Adam's step count came back
    for (n, p), q in zip(fresh.named_parameters(), restored2.model.parameters()):
        torch.testing.assert_close(p, q)
    assert not all(torch.equal(p, saved[n]) for n, p in fresh.named_parameters())
    for p in (restored, restored2, pipe2):
        p.shutdown()


def test_sample_near_zero_temperature_equals_greedy_generation(model, byte_tokenizer):
    prompt = byte_tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    with ForwardBackwardPipeline(model, device="cpu") as pipe:
        out = pipe.sample(prompt, max_tokens=20, temperature=1e-6, stop=[byte_tokenizer.eos_token_id])
        greedy = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=20,
            do_sample=False,
            eos_token_id=byte_tokenizer.eos_token_id,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert out["tokens"] == greedy and out["prompt"] == prompt and len(out["logprobs"]) == len(out["tokens"])
        # the KV-cache log-probs equal those of one full forward pass over prompt + sample
        full = pipe.forward(torch.tensor([prompt + out["tokens"]])).result().logprobs[0, len(prompt) - 1 :]
        torch.testing.assert_close(torch.tensor(out["logprobs"]), full, rtol=1e-4, atol=1e-5)
        assert pipe.sample(torch.tensor(prompt), max_tokens=20, top_k=1)["tokens"] == greedy
        a = pipe.sample(prompt, max_tokens=8, temperature=0.7, top_p=0.9, seed=3)
        assert a == pipe.sample(prompt, max_tokens=8, temperature=0.7, top_p=0.9, seed=3)
        stop_at = a["tokens"][2]
        stopped = pipe.sample(prompt, max_tokens=8, temperature=0.7, top_p=0.9, seed=3, stop=[a["tokens"][:3]])
        assert stopped["tokens"] == a["tokens"][:3] and stopped["stop_reason"] == "stop" and stop_at >= 0


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [False, False, True, True]
    assert torch.isinf(filter_logits(logits, top_p=0.8)).tolist() == [False, False, True, True]
    assert torch.isinf(filter_logits(logits, top_p=0.81)).tolist() == [False, False, False, True]
    assert torch.isinf(filter_logits(logits[[3, 0, 2, 1]], top_p=0.5)).tolist() == [True, False, True, True]


def test_async_client_with_a_reference_model(model):
    reference = copy.deepcopy(model)
    client = AsyncTrainingClient(model, reference_model=reference, device="cpu", gradient_accumulation_steps=2)
    batch = {"input_ids": batch_of(2), "attention_mask": torch.ones(2, 12, dtype=torch.long)}
    ref_before = client.forward(batch, use_reference=True)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    for seed in range(2):
        client.forward_backward({"input_ids": batch_of(2, seed=seed)}, loss_fn="cross_entropy")
    step = client.optim_step(opt, max_grad_norm=1.0)
    policy_after = client.forward(batch)
    ref_after = client.forward(batch, use_reference=True)
    assert step.result().applied
    assert torch.equal(ref_before.result().logprobs, ref_after.result().logprobs)  # the reference is frozen
    assert not torch.allclose(policy_after.result().logprobs, ref_after.result().logprobs)
    assert all(not p.requires_grad for p in reference.parameters())
    custom = client.forward_backward(batch, loss_fn=lambda m, i, o, scale: o.logits.pow(2).mean() * scale, scale=2.0)
    assert custom.result().loss > 0
    client.shutdown()
    with pytest.raises(ValueError, match="reference_model"):
        AsyncTrainingClient(model, device="cpu").forward(batch, use_reference=True)


def test_max_workers_is_deprecated_and_ignored(model):
    with pytest.warns(DeprecationWarning, match="max_workers is deprecated and ignored"):
        pipe = ForwardBackwardPipeline(model, device="cpu", max_workers=4)
    pipe.shutdown()
    with pytest.warns(DeprecationWarning, match="max_workers"):
        client = AsyncTrainingClient(model, device="cpu", max_workers=2)
    client.shutdown()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="max_workers")
        ForwardBackwardPipeline(model, device="cpu").shutdown()
