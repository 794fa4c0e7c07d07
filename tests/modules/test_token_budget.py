"""``token_budget``: on a batch of rows with skewed lengths, every module's loss and gradients equal those of the
batch in one pass (the row-count path), for every aggregation; every micro-batch is within the budget; a row
longer than the budget is refused by name."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from conftest import TINY_LLAMA
from online_fixtures import TOY_REWARD

import aitraining_pl.models.micro_batches as micro_batches
from aitraining_pl.errors import ConfigError
from aitraining_pl.losses.micro_batches import TokenBudgetError
from aitraining_pl.modules.critic_free import CriticFreeModule, PolicyExperience
from aitraining_pl.modules.distill import DistillationExperience, DistillationModule
from aitraining_pl.modules.dpo import DPOModule
from aitraining_pl.modules.kto import KTOModule
from aitraining_pl.modules.orpo import CPOModule, ORPOModule
from aitraining_pl.modules.ppo import Experience, PPOModule
from aitraining_pl.modules.reward import MultiObjectiveRewardModule, RewardModule
from aitraining_pl.modules.sft import SFTModule
from aitraining_pl.rollout import GenerationConfig

BUDGET = 128
#: real tokens per row (pairs: first 4 rows chosen, last 4 rejected): long-tailed, two rows near the budget
LENGTHS = [14, 100, 17, 22, 12, 20, 96, 16]
PROMPT = 5
#: float tolerance: a micro-batch packs other rows beside a row than the whole batch does (other matmul shapes)
ATOL = 2e-5


def _rows(lengths: list[int], seed: int = 0, pairs: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded rows of the given lengths, the first ``PROMPT`` tokens a prompt (a pair's prompt is shared)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, 300, (len(lengths), width), generator=g)
    if pairs:
        half = len(lengths) // 2
        ids[half:, :PROMPT] = ids[:half, :PROMPT]
    columns = torch.arange(width)
    attention = (columns < torch.tensor(lengths)[:, None]).long()
    ids = ids * attention
    completion = attention * (columns >= PROMPT).long()
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture()
def partitions(monkeypatch):
    """The micro-batches the offline modules' forward was split into (lists of units), recorded."""
    seen: list[list[list[int]]] = []
    real = micro_batches.token_budget_partition

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(micro_batches, "token_budget_partition", spy)
    return seen


def _offline(module, batch: dict[str, torch.Tensor], budget: int | None) -> tuple[torch.Tensor, dict]:
    module.hparams["token_budget"] = budget
    module.zero_grad(set_to_none=True)
    module.log_metrics = lambda *args, **kwargs: None  # no trainer here
    loss = module.shared_step(batch, "val")
    loss.backward()
    return loss.detach(), _grads(module)


def _check_offline(module, batch, partitions, paired: bool, equality_table: list | None = None, name: str = ""):
    want_loss, want_grads = _offline(module, batch, None)
    loss, grads = _offline(module, batch, BUDGET)
    lengths = micro_batches.unit_lengths(batch["attention_mask"], paired)
    assert partitions, "the budget split nothing"
    for groups in partitions:
        assert len(groups) > 1 and all(sum(lengths[i] for i in g) <= BUDGET for g in groups)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=ATOL)
    assert _max_diff(grads, want_grads) < ATOL
    print(f"EQUALITY {name}: loss {float((loss - want_loss).abs()):.2e} grads {_max_diff(grads, want_grads):.2e}")


def _pairs(seed: int = 0) -> dict[str, torch.Tensor]:
    return _rows(LENGTHS, seed, pairs=True)


@pytest.fixture(scope="module")
def dpo():
    return DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte")


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "aot", ["sigmoid", "sft"]])
def test_dpo_losses(dpo, loss_type, partitions):
    dpo.hparams.update(loss_type=loss_type, padding_free=True, share_prompt=True)
    _check_offline(dpo, _pairs(), partitions, paired=True, name=f"DPO {loss_type}")


def test_dpo_padded_rows(dpo, partitions):
    dpo.hparams.update(loss_type="sigmoid", padding_free=False, share_prompt=False)
    _check_offline(dpo, _pairs(1), partitions, paired=True, name="DPO padded")


@pytest.mark.parametrize("kind", [ORPOModule, CPOModule])
def test_orpo_and_cpo(kind, partitions):
    module = kind(model_config=TINY_LLAMA, tokenizer_name="byte")
    _check_offline(module, _pairs(2), partitions, paired=True, name=kind.__name__)
    if kind is ORPOModule:  # the chosen rows' prompt tokens in the NLL too: a second output, per pair
        partitions.clear()
        module.hparams["disable_prompt_loss"] = False
        _check_offline(module, _pairs(3), partitions, paired=True, name="ORPO prompt loss")


def test_kto_keeps_each_row_with_its_mismatched_partner(partitions):
    module = KTOModule(model_config=TINY_LLAMA, tokenizer_name="byte")
    batch = _rows(LENGTHS, 4)  # rows 4..7: the mismatched partners, other prompts
    batch["label"] = torch.tensor([True, False, True, False])
    _check_offline(module, batch, partitions, paired=True, name="KTO")


def test_sft_with_gradient_checkpointing(partitions):
    # per-layer checkpoints (transformers', non-reentrant) nested inside the checkpointed micro-batches, packed rows
    module = SFTModule(
        model_config=TINY_LLAMA, tokenizer_name="byte", gradient_checkpointing=True, disable_dropout=True
    )
    module.train()
    _check_offline(module, _rows(LENGTHS, 6), partitions, paired=False, name="SFT + gradient checkpointing")


def test_reward_model(partitions):
    module = RewardModule(model_config=TINY_LLAMA, tokenizer_name="byte", center_rewards_coefficient=0.01)
    batch = _pairs(7)
    batch["margin"] = torch.tensor([0.5, 0.0, 1.0, 0.2])
    _check_offline(module, batch, partitions, paired=True, name="Reward (Bradley-Terry)")


def test_multi_objective_reward_model(partitions):
    module = MultiObjectiveRewardModule(num_objectives=2, model_config=TINY_LLAMA, tokenizer_name="byte")
    batch = _rows(LENGTHS, 8)
    batch["targets"] = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
    batch["objective_mask"] = torch.tensor([[1, 1], [1, 0], [0, 1], [1, 1]] * 2)
    _check_offline(module, batch, partitions, paired=False, name="Reward (multi-objective)")


def test_too_long_row_is_named():
    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", token_budget=100)
    module.log_metrics = lambda *args, **kwargs: None
    why = r"pair 1 of the batch has 120 tokens, more than the token budget of 100 "
    with pytest.raises(TokenBudgetError, match=why):
        module.shared_step(_pairs(), "val")  # pair 1: 100 + 20 tokens
    assert issubclass(TokenBudgetError, ConfigError)


# ---------------------------------------------------------------------------------------------- online modules
class _Optimizer:
    """What ``minibatch_backward`` asks of Lightning's optimizer wrapper (one process: no gradient sync)."""

    def toggle_model(self, sync_grad: bool = True):
        return nullcontext()


def _online(module, experience, budget: int | None) -> tuple[torch.Tensor, dict]:
    module.hparams["token_budget"] = budget
    module.zero_grad(set_to_none=True)
    module.manual_backward = lambda loss: loss.backward()  # no trainer here
    rows = torch.arange(experience.input_ids.shape[0])
    stats = module.minibatch_backward(_Optimizer(), experience, rows, accum=2, sync=True)
    return stats["loss"], _grads(module)


def _check_online(module, experience, name: str):
    want_loss, want_grads = _online(module, experience, None)
    loss, grads = _online(module, experience, BUDGET)
    rows = torch.arange(experience.input_ids.shape[0])
    parts = module.micro_batches(experience, rows)
    lengths = experience.attention_mask.sum(1)
    assert len(parts) > 1 and all(int(lengths[micro].sum()) <= BUDGET for micro, _ in parts)
    assert sorted(torch.cat([micro for micro, _ in parts]).tolist()) == rows.tolist()
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=ATOL)
    assert _max_diff(grads, want_grads) < ATOL
    print(f"EQUALITY {name}: loss {float((loss - want_loss).abs()):.2e} grads {_max_diff(grads, want_grads):.2e}")


def _rollout_tensors(seed: int = 0):
    """A rollout's rows: left-padded prompts of 4 tokens, responses of long-tailed lengths (one left out of the
    loss, as a dropped group is)."""
    g = torch.Generator().manual_seed(seed)
    response = [3, 92, 5, 8, 2, 30, 4, 6]
    R = max(response)
    prompt_mask = torch.ones(8, 4, dtype=torch.long)
    prompt_mask[1, :2] = 0
    mask = (torch.arange(R) < torch.tensor(response)[:, None]).float()
    attention = torch.cat([prompt_mask, mask.long()], 1)
    ids = torch.randint(3, 300, (8, 4 + R), generator=g) * attention
    loss_mask = mask.clone()
    loss_mask[6] = 0  # a row with no token in the loss
    advantages = torch.randn(8, 1, generator=g).expand(8, R) * mask
    old = -torch.rand(8, R, generator=g) * 6 * mask
    ref = -torch.rand(8, R, generator=g) * 6 * mask
    return ids, attention, mask, loss_mask, advantages, old, ref


@pytest.fixture(scope="module")
def grpo():
    return CriticFreeModule(
        model_config=TINY_LLAMA, tokenizer_name="byte", reward=TOY_REWARD, kl_coef=0.1,
        generation=GenerationConfig(max_new_tokens=100), num_generations=2, epsilon_high=0.28,
    )  # fmt: skip


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
def test_grpo_family(grpo, aggregation):
    grpo.hparams["loss_aggregation"] = aggregation
    ids, attention, mask, loss_mask, advantages, old, ref = _rollout_tensors()
    experience = PolicyExperience(ids, attention, 4, loss_mask, advantages, old, ref, mask)
    _check_online(grpo, experience, f"GRPO family, loss_aggregation {aggregation}")


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
def test_accumulated_minibatches_make_the_gradient_of_one(grpo, aggregation):
    """An optimizer step over 2 accumulated minibatches of 4 rows (``step_normaliser`` set for the step's 8 rows, as
    the update loop sets it) has the gradient of one minibatch of the 8 rows, for every aggregation: each
    minibatch's loss weighted by ``step_share`` (its normaliser over the mean of the step's), not a mean of
    per-minibatch means (which differ here for ``token`` and ``sequence``: the halves hold 108 and 38 tokens in the
    loss, and 4 and 3 rows with a token)."""
    grpo.hparams["loss_aggregation"] = aggregation
    grpo.hparams["token_budget"] = None
    ids, attention, mask, loss_mask, advantages, old, ref = _rollout_tensors()
    experience = PolicyExperience(ids, attention, 4, loss_mask, advantages, old, ref, mask)
    grpo.manual_backward = lambda loss: loss.backward()
    rows = torch.arange(8)
    grpo.zero_grad(set_to_none=True)
    grpo.minibatch_backward(_Optimizer(), experience, rows, accum=1, sync=True)
    want = _grads(grpo)
    grpo.zero_grad(set_to_none=True)
    grpo.step_normaliser = grpo.normaliser_over_ranks(experience, rows)
    try:
        for half in rows.split(4):
            grpo.minibatch_backward(_Optimizer(), experience, half, accum=2, sync=True)
    finally:
        grpo.step_normaliser = None
    assert _max_diff(_grads(grpo), want) < ATOL


def test_gspo_sequence_ratio():
    module = CriticFreeModule(
        model_config=TINY_LLAMA, tokenizer_name="byte", reward=TOY_REWARD, kl_coef=0.0, num_generations=2,
        policy_loss={"importance_sampling_level": "sequence"},
    )  # fmt: skip
    ids, attention, mask, loss_mask, advantages, old, _ = _rollout_tensors(1)
    _check_online(module, PolicyExperience(ids, attention, 4, loss_mask, advantages, old, None, mask), "GSPO")


def test_ppo():
    module = PPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", reward=TOY_REWARD)
    ids, attention, mask, loss_mask, advantages, old, _ = _rollout_tensors(2)
    g = torch.Generator().manual_seed(9)
    values, returns = torch.randn(8, mask.shape[1], generator=g) * mask, torch.randn(8, mask.shape[1], generator=g)
    experience = Experience(ids, attention, 4, loss_mask, old, values, advantages, returns * mask)
    _check_online(module, experience, "PPO (policy + value + entropy)")


#: a tiny Qwen3-MoE over the byte vocabulary whose config asks for the router's load-balancing loss
MOE = {
    "model_type": "qwen3_moe", "vocab_size": 384, "hidden_size": 32, "intermediate_size": 64,
    "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "output_router_logits": True,
    "router_aux_loss_coef": 0.5, "pad_token_id": 0, "eos_token_id": 1,
}  # fmt: skip


def _recorded_routes(module, ids, attention):
    """The routes the policy itself takes on the rows (the sampler's, as the HF decoder records them)."""
    from aitraining_pl.models.routing_replay import recording

    with torch.no_grad(), recording(module.policy) as recorder:
        module.policy(input_ids=ids, attention_mask=attention)
    routes = recorder.take().reshape(*ids.shape, 2, 2).to(torch.int16)
    return routes.masked_fill(attention[..., None, None] == 0, -1)


@pytest.mark.parametrize("replay", [False, True])
def test_moe_router_aux_loss_is_the_minibatchs(replay):
    """GRPO and PPO on an MoE policy whose config adds the router's load-balancing loss (not additive over
    micro-batches: a product of two means over the minibatch's tokens): under the budget, a gradient-free pass counts
    the minibatch's router load and each micro-batch adds its exact part (``RouterLoad``), so the loss (auxiliary
    loss included) and every gradient, the routers' too, equal the one-pass step's; with and without the sampler's
    routes replayed."""
    ids, attention, mask, loss_mask, advantages, old, ref = _rollout_tensors(4)
    grpo = CriticFreeModule(model_config=MOE, tokenizer_name="byte", reward=TOY_REWARD, kl_coef=0.1,
                            generation=GenerationConfig(max_new_tokens=100), num_generations=2)  # fmt: skip
    routes = _recorded_routes(grpo, ids, attention) if replay else None
    experience = PolicyExperience(ids, attention, 4, loss_mask, advantages, old, ref, mask, routes=routes)
    _check_online(grpo, experience, f"GRPO, MoE router aux loss, replay {replay}")
    stats = grpo.minibatch_backward(_Optimizer(), experience, torch.arange(8), accum=1, sync=True)
    assert stats["routing/aux_loss"] > 0 and ("routing/flip_rate" in stats) == replay

    ppo = PPOModule(model_config=MOE, tokenizer_name="byte", reward=TOY_REWARD)
    g = torch.Generator().manual_seed(9)
    values, returns = torch.randn(8, mask.shape[1], generator=g) * mask, torch.randn(8, mask.shape[1], generator=g)
    routes = _recorded_routes(ppo, ids, attention) if replay else None
    experience = Experience(ids, attention, 4, loss_mask, old, values, advantages, returns * mask, routes=routes)
    _check_online(ppo, experience, f"PPO, MoE router aux loss, replay {replay}")


def test_distillation_full_divergence():
    module = DistillationModule(
        teacher_model_config={**TINY_LLAMA, "num_hidden_layers": 1}, model_config=TINY_LLAMA, tokenizer_name="byte"
    )
    ids, attention, mask, _, _, _, _ = _rollout_tensors(3)
    values = module.teacher.hidden(ids, attention, 4, mask).float()
    hidden = torch.zeros(*mask.shape, values.shape[-1]).index_put(torch.nonzero(mask, as_tuple=True), values)
    experience = DistillationExperience(ids, attention, 4, mask, hidden, torch.zeros_like(mask))
    _check_online(module, experience, "Distillation (generalized JSD)")


def test_top_entropy_quantile_is_refused_with_a_budget():
    with pytest.raises(ConfigError, match="top_entropy_quantile"):
        CriticFreeModule(
            model_config=TINY_LLAMA, tokenizer_name="byte", reward=TOY_REWARD, token_budget=64,
            policy_loss={"top_entropy_quantile": 0.2},
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------- through Lightning
def _skewed_sft_rows() -> list[dict]:
    """One long completion among short ones (a long reasoning trace)."""
    rows = [{"prompt": f"Q{i}?", "completion": " ok." * (1 + i % 3)} for i in range(7)]
    rows.insert(2, {"prompt": "Why?", "completion": " because" * 14})
    return rows


@pytest.mark.slow
def test_sft_fit_with_a_budget_makes_the_same_updates(tmp_path):
    """Lightning's automatic optimisation (the checkpointed micro-batches inside ``training_step``, its backward):
    the weights after two steps equal those of the row-count run."""
    from conftest import quiet_trainer

    from aitraining_pl.datamodules.sft import SFTDataModule
    from aitraining_pl.models import load_tokenizer

    weights = []
    for budget in (None, 160):  # the batch with the long row: 153 tokens, two micro-batches
        module = SFTModule(model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-2, token_budget=budget)
        data = SFTDataModule(rows=_skewed_sft_rows(), tokenizer=load_tokenizer("byte"), val_split=0, batch_size=4,
                             shuffle=False)  # fmt: skip
        quiet_trainer(tmp_path, max_steps=2).fit(module, data)
        weights.append({n: p.detach().clone() for n, p in module.policy.named_parameters()})
    assert max(float((weights[0][n] - weights[1][n]).abs().max()) for n in weights[0]) < 1e-5
    initial = SFTModule(model_config=TINY_LLAMA, tokenizer_name="byte").policy.lm_head.weight
    assert not torch.allclose(initial, weights[1]["lm_head.weight"])  # it trained


@pytest.mark.slow
def test_grpo_fit_with_a_budget_makes_the_same_update(tmp_path, monkeypatch):
    """Lightning's manual optimisation (``toggle_model``, ``manual_backward``, one optimizer step per minibatch):
    one iteration with a budget moves the weights as the one pass over the minibatch does."""
    from conftest import quiet_trainer
    from online_fixtures import EOS, fixed_rollout_module

    from aitraining_pl.datamodules.prompt import PromptDataModule
    from aitraining_pl.models import load_tokenizer

    fixed = torch.tensor([[40] * 30 + [EOS], [41, EOS] + [0] * 29, [42, 43, EOS] + [0] * 28, [44] * 31])
    weights = []
    for budget in (None, 60):  # rows of 36, 7, 18 and 46 real tokens: two micro-batches
        module = fixed_rollout_module(
            monkeypatch, [1.0, 0.0, 0.2, 0.7], fixed, num_generations=2, kl_coef=0.0, mini_batch_size=4,
            learning_rate=1e-2, max_grad_norm=0.0, token_budget=budget,
        )  # fmt: skip
        data = PromptDataModule(prompts=["hello", "a longer prompt"], tokenizer=load_tokenizer("byte"), batch_size=2)
        quiet_trainer(tmp_path, limit_train_batches=1).fit(module, data)
        assert len(module.update_history) == 1  # one minibatch
        weights.append({n: p.detach().clone() for n, p in module.policy.named_parameters()})
    assert max(float((weights[0][n] - weights[1][n]).abs().max()) for n in weights[0]) < 1e-5
    initial = CriticFreeModule(model_config=TINY_LLAMA, tokenizer_name="byte", reward=TOY_REWARD).policy
    assert not torch.allclose(initial.lm_head.weight, weights[1]["lm_head.weight"])  # it trained


@pytest.mark.slow
def test_vision_language_grpo_with_a_budget_makes_the_same_update(tmp_path):
    """Rows that carry images (a tiny Qwen2-VL on the colour-squares task, 19 tokens a row with the image's): with a
    budget of 40 tokens the minibatch of 8 rows runs as 4 micro-batches, each with its rows' images, and one step
    moves the weights as the one pass over the minibatch does."""
    import lightning.pytorch as pl
    from conftest import quiet_trainer

    from aitraining_pl.datamodules.colours import ColourSquaresDataModule
    from aitraining_pl.modules.critic_free import GRPOModule

    weights, splits = [], []
    for budget in (None, 40):
        pl.seed_everything(0)
        module = GRPOModule(
            model_config={"preset": "tiny-qwen2-vl"}, tokenizer_name="tiny-qwen2-vl",
            reward=lambda prompts, responses, metadata: [float(len(r) % 3) for r in responses],
            generation={"max_new_tokens": 6, "temperature": 1.0}, num_generations=4, learning_rate=1e-2,
            mini_batch_size=8, kl_coef=0.0, max_grad_norm=0.0, token_budget=budget,
        )  # fmt: skip
        data = ColourSquaresDataModule(num_prompts=2, num_val_prompts=0, tokenizer=module.tokenizer, batch_size=2)
        split = module.micro_batches
        module.micro_batches = lambda experience, rows: splits.append(split(experience, rows)) or splits[-1]
        quiet_trainer(tmp_path, max_steps=1, limit_val_batches=0).fit(module, data)
        weights.append({n: p.detach().clone() for n, p in module.policy.named_parameters()})
    assert [len(parts) for parts in splits] == [1, 4]
    assert max(float((weights[0][n] - weights[1][n]).abs().max()) for n in weights[0]) < 1e-5
    start = GRPOModule(model_config={"preset": "tiny-qwen2-vl"}, tokenizer_name="tiny-qwen2-vl", reward=TOY_REWARD)
    assert not torch.allclose(start.policy.lm_head.weight, weights[1]["lm_head.weight"])  # it trained


def test_a_prompt_too_long_for_the_budget_is_refused_before_training(tmp_path):
    """GRPO with ``token_budget: 20`` and ``max_new_tokens: 16``: the training data's 9-token prompt makes rows of up
    to 25 tokens, which fit no micro-batch; ``fit`` stops at setup, before any rollout, with one line naming the
    option, the prompt and the lengths. A budget of 25 passes the check."""
    from conftest import quiet_trainer

    from aitraining_pl.datamodules.prompt import PromptDataModule
    from aitraining_pl.modules.critic_free import GRPOModule
    from aitraining_pl.modules.token_budget import check_row_budget

    module = GRPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", reward=TOY_REWARD, num_generations=2,
                        mini_batch_size=4, token_budget=20, generation=GenerationConfig(max_new_tokens=16))  # fmt: skip
    module.generate_rollouts = lambda *a, **k: pytest.fail("sampled before the check")
    data = PromptDataModule(prompts=["ab", "abcdefghi"], tokenizer=module.tokenizer, batch_size=2)
    why = r"GRPOModule\.token_budget: 20 tokens: prompt 1 of the training data has 9 tokens, .* can have 25"
    with pytest.raises(ConfigError, match=why):
        quiet_trainer(tmp_path, max_steps=1).fit(module, data)
    module.hparams["token_budget"] = 25
    trainer = type("T", (), {"datamodule": data})()
    check_row_budget(module, trainer, module.generation, False)  # no error
