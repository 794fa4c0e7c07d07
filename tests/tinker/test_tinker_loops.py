"""A small SL loop and a small RL loop written the way tinker-cookbook's ``recipes/sl_loop.py`` and
``recipes/rl_loop.py`` are (datums built the same way, ``forward_backward`` then ``optim_step``, a fresh sampling
client from ``save_weights_and_get_sampling_client`` each RL step, group-centred rewards as advantages), through the
``tinker`` client against ``tinker-serve``: held-out loss falls, reward rises."""

from __future__ import annotations

import pytest
import torch

# tinker.types, not tinker: without the client, this folder itself imports as a namespace package named tinker
pytest.importorskip("tinker.types")
import tinker  # noqa: E402
from tinker import types  # noqa: E402
from tinker_fixtures import KEYS, saved_model, tinker_server  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    folder = saved_model(tmp_path_factory.mktemp("model"))
    with tinker_server(folder, tmp_path_factory.mktemp("checkpoints")) as (url, _):
        client = tinker.ServiceClient(base_url=url, api_key=KEYS[0])
        yield client, folder
        client.close("success").result()


def sl_datum(text: str) -> types.Datum:
    """As sl_loop.py: tokens shifted by one, weights 0 on the prompt (the first 3 bytes) and 1 on the rest."""
    tokens = [b + 3 for b in text.encode()]  # ByT5's byte ids
    weights = [0.0] * 2 + [1.0] * (len(tokens) - 3)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": torch.tensor(tokens[1:]), "weights": torch.tensor(weights)},
    )


def held_out_loss(client, data) -> float:
    out = client.forward(data, "cross_entropy").result()
    return out.metrics["loss:sum"] / sum(float(d.loss_fn_inputs["weights"].to_torch().sum()) for d in data)


def test_sl_loop_held_out_loss_falls(service):
    service_client, folder = service
    client = service_client.create_lora_training_client(base_model=folder, rank=8, seed=0).result()
    train = [sl_datum(f"Q{i}: the cat sat on the mat.") for i in range(8)]
    held_out = [sl_datum(f"R{i}: the cat sat on the mat.") for i in range(3)]
    before = held_out_loss(client, held_out)
    adam = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
    for _ in range(12):
        fwd_bwd = client.forward_backward(train, loss_fn="cross_entropy")
        optim = client.optim_step(adam)
        fwd_bwd.result()
        optim.result()
    after = held_out_loss(client, held_out)
    print(f"SL held-out loss per token: {before:.3f} -> {after:.3f}")
    assert after < 0.7 * before


def reward(tokens: list[int]) -> float:
    """The task: answer with low byte ids (below 128); a random model does so about a third of the time."""
    return sum(t < 128 for t in tokens) / len(tokens)


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "gspo"])
def test_rl_loop_reward_rises(service, loss_fn):
    """As rl_loop.py with ``loss_fn`` (for ``gspo`` its ``sequence_ratio_mask``: 1 on the sampled tokens)."""
    service_client, folder = service
    client = service_client.create_lora_training_client(base_model=folder, rank=8, seed=1).result()
    prompt = types.ModelInput.from_ints([b + 3 for b in b"Say something:"])
    params = types.SamplingParams(max_tokens=6, temperature=1.0)
    adam = types.AdamParams(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-8)
    rewards = []
    for step in range(12):
        sampling_client = client.save_weights_and_get_sampling_client().result()
        futures = [sampling_client.sample(prompt, 8, params) for _ in range(2)]
        datums, batch_rewards = [], []
        for future in futures:
            sequences = future.result().sequences
            rewards_g = [reward(s.tokens) for s in sequences]
            batch_rewards += rewards_g
            mean = sum(rewards_g) / len(rewards_g)
            for seq, r in zip(sequences, rewards_g):
                ob_len = prompt.length - 1
                model_input = prompt.append(types.EncodedTextChunk(tokens=seq.tokens[:-1]))
                inputs = {
                    "target_tokens": torch.tensor([0] * ob_len + seq.tokens),
                    "logprobs": torch.tensor([0.0] * ob_len + seq.logprobs),
                    "advantages": torch.tensor([0.0] * ob_len + [r - mean] * (model_input.length - ob_len)),
                }
                if loss_fn == "gspo":
                    inputs["sequence_ratio_mask"] = torch.tensor([0.0] * ob_len + [1.0] * len(seq.tokens))
                datums.append(types.Datum(model_input=model_input, loss_fn_inputs=inputs))
        rewards.append(sum(batch_rewards) / len(batch_rewards))
        client.forward_backward(datums, loss_fn=loss_fn)
        client.optim_step(adam).result()
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"RL reward ({loss_fn}): first 3 steps {first:.3f}, last 3 steps {last:.3f}")
    assert last > first + 0.2
