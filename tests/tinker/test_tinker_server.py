"""The official ``tinker`` client (0.38, from PyPI) against ``tinker-serve`` on loopback with a tiny Llama: each
built-in loss against a hand-written formula (loss and gradient), AdamW with the call's parameters, save/load and a
bit-identical resume, seeded sampling and prompt log-probs equal to the trainer's, two tenants at once, and bad
requests answered with one clear error while the server stays up."""

from __future__ import annotations

import threading

import pytest
import torch

# tinker.types, not tinker: without the client, this folder itself imports as a namespace package named tinker
pytest.importorskip("tinker.types")
import tinker  # noqa: E402
from tinker import types  # noqa: E402
from tinker_fixtures import KEYS, saved_model, tinker_server  # noqa: E402

TOKENS = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = saved_model(tmp_path_factory.mktemp("model"))
    with tinker_server(folder, tmp_path_factory.mktemp("checkpoints"), max_body=1 << 20) as (url, state):
        yield url, state, folder


@pytest.fixture(scope="module")
def service(served):
    url, _, _ = served
    client = tinker.ServiceClient(base_url=url, api_key=KEYS[0])
    yield client
    client.close("success").result()


def new_client(service, served, seed=0, rank=4):
    return service.create_lora_training_client(base_model=served[2], rank=rank, seed=seed).result()


def datum(tokens=TOKENS, **inputs):
    n = len(tokens) - 1
    inputs = {k: torch.as_tensor(v, dtype=torch.float32) if not isinstance(v, torch.Tensor) else v
              for k, v in inputs.items()}  # fmt: skip
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": torch.tensor(tokens[1:]), **inputs} if n else {})  # fmt: skip


def on_worker(state, fn):
    return state.engine.submit(fn).result()


def adapter_of(state, client):
    return state.engine.models[client.model_id]


def grads(state, entry):
    return on_worker(state, lambda: [p.grad.clone() for p in state.engine.adapter_params(entry.adapter)])


def reference_grads(state, entry, tokens, hand_loss):
    """The gradient of ``hand_loss(logprobs)`` computed here, independently of the server's loss code."""

    def run():
        engine = state.engine
        engine.use(entry.adapter)
        ids = torch.tensor([tokens[:-1]])
        logits = engine.model(input_ids=ids, use_cache=False).logits.float()[0]
        logprobs = torch.log_softmax(logits, -1)[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
        loss = hand_loss(logprobs)
        params = engine.adapter_params(entry.adapter)
        return loss.item(), torch.autograd.grad(loss, params)

    return on_worker(state, run)


def zero(state, entry):
    on_worker(state, lambda: [setattr(p, "grad", None) for p in state.engine.adapter_params(entry.adapter)])


N = len(TOKENS) - 1
WEIGHTS = [0.0, 0.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 2.0, 1.0]
ADV = [0.0, 0.0, 1.5, -1.0, 0.5, 2.0, -0.5, 1.0, -2.0, 0.7]
ADV = ADV[:N]
MASK = [0.0, 0.0] + [1.0] * (N - 2)  # gspo's sequence_ratio_mask: the "sampled" tokens


def hand(name, q):
    """Tinker's documented formulas, written out per token (q: the sampler's log-probs)."""

    def loss(lp):
        total = 0
        marked = [t for t in range(N) if MASK[t]]
        s = torch.exp(sum(lp[t].detach() - q[t] for t in marked) / len(marked))  # gspo's sequence ratio, sg
        for t in range(N):
            r = torch.exp(lp[t] - q[t])
            if name == "cross_entropy":
                total = total - WEIGHTS[t] * lp[t]
            elif name == "importance_sampling":
                total = total - r * ADV[t]
            elif name == "ppo":
                total = total - torch.min(r * ADV[t], torch.clamp(r, 0.7, 1.3) * ADV[t])
            elif name == "gspo":  # the sequence ratio's value, the token's own gradient
                s_t = s * torch.exp(lp[t] - lp[t].detach())
                total = total - torch.min(s_t * ADV[t], torch.clamp(s_t, 0.7, 1.3) * ADV[t])
            elif name == "cispo":
                total = total - torch.clamp(r, 0.7, 1.3).detach() * lp[t] * ADV[t]
            else:
                total = total - (lp[t] * ADV[t] - 0.5 * 0.1 * (lp[t] - q[t]) ** 2)
        return total

    return loss


@pytest.mark.parametrize("name", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"])
def test_loss_and_gradient_equal_hand_derived(service, served, name):
    _, state, _ = served
    client = new_client(service, served, seed=3)
    client.optim_step(types.AdamParams(learning_rate=0.05)).result()  # no gradients yet: a no-op step
    first = client.forward_backward([datum(weights=[1.0] * N)], "cross_entropy").result()  # move off B = 0
    client.optim_step(types.AdamParams(learning_rate=0.05)).result()
    entry = adapter_of(state, client)
    q = (first.loss_fn_outputs[0]["logprobs"].to_torch() + torch.linspace(-0.4, 0.4, N)).tolist()
    clip = {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
    config = {"ppo": clip, "cispo": clip, "gspo": clip, "dro": {"beta": 0.1}}.get(name)
    inputs = {"weights": WEIGHTS} if name == "cross_entropy" else {"logprobs": q, "advantages": ADV}
    if name == "gspo":
        inputs["sequence_ratio_mask"] = MASK
    expected_loss, expected = reference_grads(state, entry, TOKENS, hand(name, torch.tensor(q)))
    out = client.forward_backward([datum(**inputs)], name, config).result()
    got = grads(state, entry)
    zero(state, entry)
    assert out.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
    assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == N
    assert sum(out.loss_fn_outputs[0]["elementwise_loss"].tolist()) == pytest.approx(expected_loss, rel=1e-5)
    assert any(g.abs().sum() > 0 for g in got)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5 * float(e.abs().max()) + 1e-7)  # summation order


def test_get_info_names_the_model_and_its_tokenizer(service, served):
    client = new_client(service, served, seed=2, rank=8)
    info = client.get_info()
    assert info.model_data.model_name == served[2] and info.lora_rank == 8 and info.is_lora
    assert client.get_tokenizer().encode("Hi", add_special_tokens=False) == [75, 108]  # ByT5: byte + 3


def test_optim_step_is_adamw_with_the_calls_parameters(service, served):
    _, state, _ = served
    client = new_client(service, served, seed=4)
    entry = adapter_of(state, client)
    adam = types.AdamParams(learning_rate=0.03, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, grad_clip_norm=0.5)
    reference = None
    for step in range(3):
        client.forward_backward([datum(weights=[1.0] * N)], "cross_entropy").result()
        before = on_worker(state, lambda: [(p.detach().clone(), p.grad.clone())
                                            for p in state.engine.adapter_params(entry.adapter)])  # fmt: skip
        if reference is None:
            copies = [b[0].clone().requires_grad_(True) for b in before]
            reference = torch.optim.AdamW(copies, lr=0.03, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
        for c, (_, g) in zip(copies, before):
            c.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(copies, 0.5)
        reference.step()
        client.optim_step(adam).result()
        after = on_worker(state, lambda: [p.detach().clone() for p in state.engine.adapter_params(entry.adapter)])
        for a, c in zip(after, copies):
            torch.testing.assert_close(a, c.detach(), rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(a, b[0]) for a, b in zip(after, before))


def weights(state, client):
    entry = adapter_of(state, client)
    return on_worker(state, lambda: [p.detach().clone() for p in state.engine.adapter_params(entry.adapter)])


def train(client, steps, lr=0.02):
    for i in range(steps):
        client.forward_backward([datum(TOKENS[i:] + TOKENS[:i], weights=[1.0] * N)], "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=lr)).result()


def test_save_and_load_state_resume_bit_identical(service, served):
    _, state, _ = served
    client = new_client(service, served, seed=5)
    train(client, 2)
    path = client.save_state("resume-me").result().path
    saved = weights(state, client)
    train(client, 3)
    continued = weights(state, client)
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert all(torch.equal(a, b) for a, b in zip(weights(state, resumed), saved))
    train(resumed, 3)
    assert all(torch.equal(a, b) for a, b in zip(weights(state, resumed), continued))
    fresh_optimizer = service.create_training_client_from_state(path).result()
    train(fresh_optimizer, 3)
    assert not all(torch.equal(a, b) for a, b in zip(weights(state, fresh_optimizer), continued))


def test_sampling_is_seeded_and_prompt_logprobs_equal_the_trainers(service, served):
    client = new_client(service, served, seed=6)
    train(client, 2, lr=0.05)
    sampler = client.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, seed=11, temperature=0.9, top_p=0.95, top_k=50)
    prompt = types.ModelInput.from_ints(TOKENS)
    one = sampler.sample(prompt, 3, params, include_prompt_logprobs=True).result()
    two = sampler.sample(prompt, 3, params, include_prompt_logprobs=True).result()
    assert [s.tokens for s in one.sequences] == [s.tokens for s in two.sequences]
    assert len({tuple(s.tokens) for s in one.sequences}) > 1
    forward = client.forward([datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert one.prompt_logprobs[0] is None
    assert one.prompt_logprobs[1:] == pytest.approx(forward, abs=1e-5)
    assert sampler.compute_logprobs(prompt).result()[1:] == pytest.approx(forward, abs=1e-5)
    last = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=3).result()
    assert last[:-3] == [None] * (len(TOKENS) - 3) and last[-3:] == pytest.approx(forward[-3:], abs=1e-5)
    seq = one.sequences[0]
    scored = client.forward([datum(TOKENS + seq.tokens)], "cross_entropy").result()
    assert seq.logprobs == pytest.approx(scored.loss_fn_outputs[0]["logprobs"].tolist()[-len(seq.tokens) :], abs=1e-4)
    stopped = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[seq.tokens[1]]))
    greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result().sequences[0]
    stopped = stopped.result().sequences[0]
    if seq.tokens[1] in greedy.tokens:
        assert stopped.tokens[-1] == seq.tokens[1] and stopped.stop_reason == "stop"


def test_topk_prompt_logprobs_are_the_trainers_most_likely_tokens(service, served):
    """``topk_prompt_logprobs`` (what tinker-cookbook's off-policy distillation asks a teacher for): at each prompt
    position the k most likely next tokens and their log-probs under the sampler's weights, from a softmax written
    out here over the trainer's logits; none at the first position, and only the last N with ``last_n``."""
    _, state, _ = served
    client = new_client(service, served, seed=8)
    train(client, 1, lr=0.05)
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(TOKENS)
    out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2), topk_prompt_logprobs=3).result()
    entry = adapter_of(state, client)

    def logits():
        state.engine.use(entry.adapter)
        return state.engine.model(input_ids=torch.tensor([TOKENS[:-1]]), use_cache=False).logits[0].float()

    z = on_worker(state, logits)
    expected = z - z.exp().sum(-1, keepdim=True).log()
    top = expected.topk(3, -1)
    got = out.topk_prompt_logprobs
    assert got[0] is None and len(got) == len(TOKENS)
    for i, row in enumerate(got[1:]):
        assert [t for t, _ in row] == top.indices[i].tolist()
        assert [v for _, v in row] == pytest.approx(top.values[i].tolist(), abs=1e-5)
    last = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2), True, topk_prompt_logprobs=2,
                          prompt_logprobs_last_n=2).result().topk_prompt_logprobs  # fmt: skip
    assert last[:-2] == [None] * (len(TOKENS) - 2) and [t for t, _ in last[-1]] == top.indices[-1, :2].tolist()
    with pytest.raises(tinker.BadRequestError, match="topk_sample_logprobs is not served"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2), topk_sample_logprobs=2).result()


def test_two_training_clients_train_at_once_without_touching_each_other(service, served):
    _, state, _ = served
    alone = new_client(service, served, seed=7)
    train(alone, 3)
    expected = weights(state, alone)
    a, b = new_client(service, served, seed=7), new_client(service, served, seed=8)
    b_before = weights(state, b)
    threads = [threading.Thread(target=train, args=(a, 3)), threading.Thread(target=train, args=(b, 3, 0.1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(x, y) for x, y in zip(weights(state, a), expected))
    assert not any(torch.equal(x, y) for x, y in zip(weights(state, b), b_before) if x.abs().sum() > 0)
    assert state.engine.models[a.model_id].optimizer is not state.engine.models[b.model_id].optimizer


def test_bad_requests_get_one_clear_error_and_the_server_stays_up(service, served):
    url, state, folder = served
    with pytest.raises(Exception, match="unknown base_model"):
        service.create_lora_training_client(base_model="no/such-model", rank=4).result()
    client = new_client(service, served, seed=9)
    bad_shape = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                            loss_fn_inputs={"target_tokens": torch.tensor(TOKENS[1:4])})  # fmt: skip
    with pytest.raises(Exception, match=r"has shape \[3\].*must be \[10\]"):
        client.forward_backward([bad_shape], "cross_entropy").result()
    nan = datum(logprobs=[0.0] * N, advantages=[float("nan")] * N)
    with pytest.raises(Exception, match="NaN"):
        client.forward_backward([nan], "importance_sampling").result()
    plain = datum(logprobs=[0.0] * N, advantages=[1.0] * N)
    with pytest.raises(Exception, match="'stable_reinforce' is not served: its objective needs the stability"):
        client.forward_backward([plain], "stable_reinforce").result()
    with pytest.raises(Exception, match="needs 'sequence_ratio_mask' for loss_fn 'gspo'"):
        client.forward_backward([plain], "gspo").result()
    huge = datum(list(range(2, 250)) * 300, weights=[1.0] * (248 * 300 - 1))
    with pytest.raises(Exception, match="413|over this server's limit"):
        client.forward_backward([huge], "cross_entropy").result()
    with pytest.raises(Exception, match="unauthorized"):
        tinker.ServiceClient(base_url=url, api_key="tml-wrong-key").create_lora_training_client(
            base_model=folder, rank=4
        ).result()
    other = tinker.ServiceClient(base_url=url, api_key=KEYS[1])  # another tenant cannot reach this client
    with pytest.raises(Exception, match="no such checkpoint for this API key"):
        other.create_training_client_from_state(client.save_state("mine").result().path).result()
    out = client.forward_backward([datum(weights=[1.0] * N)], "cross_entropy").result()
    assert out.metrics["loss:sum"] > 0


def test_a_finished_sessions_training_clients_are_deleted(service, served):
    url, state, folder = served
    other_session = tinker.ServiceClient(base_url=url, api_key=KEYS[0])
    gone = other_session.create_lora_training_client(base_model=folder, rank=4, seed=0).result()
    adapter = state.engine.models[gone.model_id].adapter
    kept = new_client(service, served, seed=10)
    other_session.close("success").result()
    assert gone.model_id not in state.engine.models and adapter not in state.engine.model.peft_config
    assert kept.forward_backward([datum(weights=[1.0] * N)], "cross_entropy").result().metrics["loss:sum"] > 0


def test_forward_backward_custom_is_a_forward_and_a_weighted_cross_entropy(service, served):
    """A client-side loss (here 2 x the squared sum of log-probs) reaches the server as a forward, then a
    cross-entropy with weights -dC/dlogprobs: the adapter's gradient equals the loss's own."""
    _, state, _ = served
    client = new_client(service, served, seed=11)
    train(client, 1)
    entry = adapter_of(state, client)

    def custom(data, logprobs_list):
        loss = 2 * sum(lp.sum() for lp in logprobs_list) ** 2
        return loss, {"custom:mean": float(loss)}

    expected_loss, expected = reference_grads(state, entry, TOKENS, lambda lp: 2 * lp.sum() ** 2)
    out = client.forward_backward_custom([datum(weights=[1.0] * N)], custom).result()
    got = grads(state, entry)
    zero(state, entry)
    assert out.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-5)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5 * float(e.abs().max()) + 1e-7)


def test_a_checkpoint_expires_after_its_ttl_seconds(service, served, monkeypatch):
    """``save_state(name, ttl_seconds)``: loadable within its time; past it (the engine's clock moved on) refused as
    expired and deleted, while a checkpoint without a ttl stays; a ttl outside 1 hour .. 10 years is refused."""
    import os
    import time
    from types import SimpleNamespace

    import aitraining_pl.tinker.engine as engine_module

    _, state, _ = served
    client = new_client(service, served, seed=12)
    short = client.save_state("short-lived", ttl_seconds=3600).result().path
    kept = client.save_state("kept").result().path
    service.create_training_client_from_state(short).result()
    folder = state.engine.folder(adapter_of(state, client).owner, client.model_id, "weights", "short-lived")
    later = time.time() + 3601
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(time=lambda: later))
    with pytest.raises(Exception, match="the checkpoint expired"):
        service.create_training_client_from_state(short).result()
    assert not os.path.exists(folder)
    service.create_training_client_from_state(kept).result()
    with pytest.raises(Exception, match=r"ttl_seconds 10: whole seconds from 3600 \(1 hour\)"):
        client.save_state("too-short", ttl_seconds=10).result()


def test_rest_routes_list_a_keys_runs_and_checkpoints(service, served):
    """The ``RestClient`` calls tinker-cookbook's ``checkpoint_utils`` makes: a run's ``user_metadata`` (its
    renderer) and latest checkpoints by tinker path, its checkpoint list, a checkpoint deleted; another key sees
    none of it."""
    url, _, folder = served
    client = service.create_lora_training_client(base_model=folder, rank=4, seed=0,
                                                 user_metadata={"renderer_name": "role_colon"}).result()  # fmt: skip
    state_path = client.save_state("rest-a").result().path
    sampler_path = client.save_weights_for_sampler("rest-s").result().path
    rest = service.create_rest_client()
    run = rest.get_training_run_by_tinker_path(sampler_path).result()
    assert (run.training_run_id, run.base_model, run.lora_rank) == (client.model_id, folder, 4)
    assert run.user_metadata == {"renderer_name": "role_colon"}
    assert run.last_checkpoint.tinker_path == state_path and run.last_sampler_checkpoint.tinker_path == sampler_path
    listed = rest.list_checkpoints(client.model_id).result().checkpoints
    assert {c.tinker_path for c in listed} == {state_path, sampler_path}
    assert client.model_id in [r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs]
    rest.delete_checkpoint_from_tinker_path(state_path).result()
    assert [c.tinker_path for c in rest.list_checkpoints(client.model_id).result().checkpoints] == [sampler_path]
    stranger = tinker.ServiceClient(base_url=url, api_key=KEYS[1]).create_rest_client()
    with pytest.raises(tinker.BadRequestError, match="unknown training run"):
        stranger.get_training_run(client.model_id).result()
    assert client.model_id not in [r.training_run_id for r in stranger.list_training_runs().result().training_runs]
