"""The architecture matrix: sequence log-probs of DPO (packed, shared prompt) and PPO (left-padded rollouts)
equal per-sequence log-probs from each model's own forward, on tiny random configs of real architectures.

Run with ``-s`` to print the table (architecture -> max abs difference, path taken).
"""

from __future__ import annotations

import pytest
import torch
from architectures import HYBRID, MATRIX, VOCAB, build_sharpened, names, sharpen, spec

from aitraining_pl.models.scoring import completion_logps, scoring_path
from aitraining_pl.models.training import disable_dropout
from aitraining_pl.modules.ppo import PPOModule

TOY_REWARD = "aitraining_pl.rewards:char_fraction_reward"  # PPO/GRPO/RLOO need a reward source

RESULTS: dict[str, dict[str, object]] = {}
#: FalconH1 runs its Mamba layers on transformers' slow reference kernels on CPU (seconds): marked slow
ROWS = [pytest.param(n, marks=pytest.mark.slow) if n in names(HYBRID) else n for n in names(MATRIX)]


@pytest.fixture(scope="module", autouse=True)
def table():
    yield
    if RESULTS:
        print(f"\n{'architecture':<14} {'path':<8} {'DPO max |diff|':>15} {'PPO max |diff|':>15}  reason")
        for name, row in RESULTS.items():
            print(
                f"{name:<14} {row.get('path', '-'):<8} {row.get('dpo', float('nan')):>15.2e} "
                f"{row.get('ppo', float('nan')):>15.2e}  {row.get('reason', '')}"
            )


def _rows(seed: int) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt, chosen, rejected) token lists of different lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    return [(ids(4), ids(3), ids(6)), (ids(2), ids(5), ids(1)), (ids(6), ids(2), ids(4))]


def preference_batch(rows) -> dict[str, torch.Tensor]:
    """2B right-padded rows (chosen rows, then rejected rows), as ``PreferenceDataModule`` collates them."""
    seqs = [(p, c) for p, c, _ in rows] + [(p, r) for p, _, r in rows]
    width = max(len(p) + len(c) for p, c in seqs)
    keys = ("input_ids", "attention_mask", "completion_mask")
    batch = {k: torch.zeros(len(seqs), width, dtype=torch.long) for k in keys}
    for i, (p, c) in enumerate(seqs):
        batch["input_ids"][i, : len(p) + len(c)] = torch.tensor(p + c)
        batch["attention_mask"][i, : len(p) + len(c)] = 1
        batch["completion_mask"][i, len(p) : len(p) + len(c)] = 1
    return batch


@torch.no_grad()
def own_logps(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """(len(completion),) log-probs of the completion from the model's own forward on the sequence alone."""
    was_training = model.training
    model.eval()
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float() / temperature
    model.train(was_training)
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]


@pytest.fixture(scope="module")
def models():
    return {}  # model type -> the sharpened model, built once for this module's tests


@pytest.mark.parametrize("model_type", ROWS)
def test_dpo_completion_logps_equal_the_models_own_forward(model_type, models):
    model = models.setdefault(model_type, build_sharpened(model_type))
    disable_dropout(model)  # as DPOModule does by default; the policy forward runs in training mode
    model.train()
    rows = _rows(0)
    got = completion_logps(model, preference_batch(rows), padding_free=True, share_prompt=True).logps
    sequences = [(p, c) for p, c, _ in rows] + [(p, r) for p, _, r in rows]
    want = torch.stack([own_logps(model, p, c).sum() for p, c in sequences])
    path = scoring_path(model)
    difference = float((got.detach() - want).abs().max())
    RESULTS.setdefault(model_type, {}).update(path=path.name, reason=path.reason[:110], dpo=difference)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("model_type", ROWS)
def test_ppo_old_logprobs_equal_the_models_own_forward(model_type):
    module = PPOModule(
        reward=TOY_REWARD,
        model_config={"model_type": model_type, **spec(model_type)},
        tokenizer_name="byte",
        mini_batch_size=2,
    )
    sharpen(module.policy)
    sharpen(module.reference.model)
    temperature = module.generation.temperature
    # left-padded prompts, responses right-padded after their end (as a rollout makes them)
    rows = _rows(1)
    P, R = max(len(p) for p, _, _ in rows), max(len(c) for _, c, _ in rows)
    input_ids = torch.zeros(len(rows), P + R, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, (p, c, _) in enumerate(rows):
        input_ids[i, P - len(p) : P], input_ids[i, P : P + len(c)] = torch.tensor(p), torch.tensor(c)
        attention_mask[i, P - len(p) : P + len(c)] = 1
    old, _, ref = module.old_and_reference(input_ids, attention_mask, P)
    difference = 0.0
    for i, (p, c, _) in enumerate(rows):
        want = own_logps(module.policy, p, c, temperature)
        torch.testing.assert_close(old[i, : len(c)], want, rtol=0, atol=1e-4)
        reference = own_logps(module.reference.model, p, c, temperature)
        torch.testing.assert_close(ref[i, : len(c)], reference, rtol=0, atol=1e-4)
        difference = max(difference, float((old[i, : len(c)] - want).abs().max()))
    RESULTS.setdefault(model_type, {})["ppo"] = difference
