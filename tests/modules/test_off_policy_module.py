"""The off-policy correction in the online modules: a rollout whose backend reports sampler log-probs is trained on
the loss corrected by hand (``policy_loss.importance_sampling_mode``), the ``sampling/...`` metrics are logged, and
the old ``generation.vllm.importance_sampling_correction`` / ``importance_sampling_cap`` still work with a warning."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import TINY_LLAMA, quiet_trainer

from aitraining_pl.errors import ConfigError
from aitraining_pl.generation.backend import SampledTokens
from aitraining_pl.generation.config import GenerationConfig
from aitraining_pl.losses import PolicyLossConfig, clipped_policy_loss, decoupled_policy_loss
from aitraining_pl.modules.critic_free import GRPOModule
from aitraining_pl.modules.policy_loss import moved_correction
from aitraining_pl.rollout import BACKEND_NAMES, BACKENDS
from aitraining_pl.validation import RenamedArgumentWarning

#: the responses of the 4 rows; the sampler reports -5.4 - 0.5 t - 0.15 r for token t of row r (the tiny model's
#: are near log(1/384) = -5.95: token ratios from about 0.55 to 2.4, around the bounds)
TOKENS = [[70, 71, 72], [73, 74, 75], [76, 77, 78], [79, 80, 81]]


class OffPolicySampler:
    """A backend that answers with fixed tokens and reports its own log-probs of them, as vLLM would."""

    location = "server"

    @classmethod
    def from_context(cls, generation, context):
        return cls()

    def sample(self, request):
        rows = request.prompt_ids.shape[0] * request.num_samples
        logps = torch.tensor([[-5.4 - 0.5 * t - 0.15 * r for t in range(3)] for r in range(rows)])
        return SampledTokens(torch.tensor(TOKENS[:rows]), None, None, logps)  # 4th: the sampler's log-probs

    def sync(self, policy, version=None):
        return True

    def sleep(self):
        pass

    def close(self):
        pass

    def stats(self):
        return {}


def grpo(monkeypatch, **policy_loss) -> GRPOModule:
    monkeypatch.setitem(BACKENDS, "off-policy", OffPolicySampler)
    monkeypatch.setattr("aitraining_pl.generation.registry.BACKEND_NAMES", sorted({*BACKEND_NAMES, "off-policy"}))
    return GRPOModule(
        model_config=TINY_LLAMA,
        tokenizer_name="byte",
        reward=lambda prompts, responses, metadata: [float(i * i) for i in range(len(responses))],
        num_generations=2,
        mini_batch_size=4,
        kl_coef=0.0,
        generation=GenerationConfig(backend="off-policy", max_new_tokens=3, temperature=1.0),
        policy_loss=policy_loss,
    )


def one_rollout(module: GRPOModule, monkeypatch):
    """Set ``module`` up (its backend built) and make the experience of one rollout of 2 prompts x 2; also the
    trainer's log-probs of it, computed here."""

    class Strategy:
        broadcast = staticmethod(lambda value: value)

    trainer = type("T", (), {"strategy": Strategy, "precision": "32-true"})
    monkeypatch.setattr(type(module), "trainer", property(lambda self: trainer()))
    module.setup("fit")
    ids = torch.tensor([[0, 104, 105], [106, 107, 108]])
    batch = {"input_ids": ids, "attention_mask": (ids > 0).long(), "prompts": ["ab", "cd"], "metadata": [{}, {}]}
    rollout = module.rollout(batch, 2)
    assert rollout.mask.all() and rollout.sampling_logprobs[1].tolist() == pytest.approx([-5.55, -6.05, -6.55])
    experience, stats = module.make_experience(rollout)
    with torch.no_grad():
        old = module.response_scores(module.policy.eval(), rollout.input_ids, rollout.attention_mask, 3).logprobs
    module.policy.train()
    # one optimizer step per iteration: no pass for pi_old, the correction is taken in the micro-batch against its
    # current log-probs (pi_old's: no step before it); what that micro-batch computes:
    assert experience.is_weights is None and torch.equal(experience.sampling_logprobs, rollout.sampling_logprobs)
    experience.is_weights, deferred = module.sampler_correction(old, rollout.sampling_logprobs, rollout.mask)
    return rollout, experience, {**stats, **deferred}, old


def hand_weights(old: torch.Tensor, sampler: torch.Tensor, mode: str, low: float | None, high: float | None):
    """The weights of ``mode`` written out per row with Python floats."""
    rows = []
    for o, s in zip(old.tolist(), sampler.tolist()):
        ratios = [math.exp(a - b) for a, b in zip(o, s)]
        if mode.startswith("sequence"):
            ratios = [math.prod(ratios)] * len(ratios)
        low_, high_ = low if low is not None else 0.0, high if high is not None else math.inf
        if mode.endswith("truncate"):
            rows.append([min(max(r, low_), high_) for r in ratios])
        else:
            rows.append([r if low_ <= r <= high_ else 0.0 for r in ratios])
    return torch.tensor(rows)


@pytest.mark.parametrize(
    "mode, low, high", [("token_truncate", None, 1.3), ("token_mask", 0.7, 1.9), ("sequence_mask", None, 2.2)]
)
def test_the_module_trains_on_the_hand_corrected_loss(monkeypatch, mode, low, high):
    """One rollout from a backend with its own log-probs: the weights are the mode's of ``pi_old / pi_sampler``
    (``pi_old``: the trainer's log-probs of the rollout), the loss is GRPO's sequence mean of ``-A w`` (one
    iteration: the ratio is 1) and equals ``losses.decoupled_policy_loss`` (AReaL's objective); the stats are the
    mismatch's."""
    module = grpo(
        monkeypatch,
        importance_sampling_mode=mode,
        importance_sampling_clip_min=low,
        importance_sampling_clip_max=high,
    )
    rollout, experience, stats, old = one_rollout(module, monkeypatch)
    sampler = rollout.sampling_logprobs
    weights = hand_weights(old, sampler, mode, low, high)
    assert torch.allclose(experience.is_weights, weights, atol=1e-5)
    k3 = [math.expm1(a - b) - (a - b) for a, b in zip(old.flatten().tolist(), sampler.flatten().tolist())]
    assert stats["sampling/mismatch_kl"].item() == pytest.approx(sum(k3) / len(k3), rel=1e-4)
    name = "masked" if mode.endswith("mask") else "truncated"
    assert {f"sampling/{name}_tokens", f"sampling/{name}_sequences", "sampling/is_weight/mean"} <= set(stats)
    hit = (weights == 0) if name == "masked" else (weights == high)
    assert hit.any() and not hit.all()  # the bounds are reached by some tokens, not all
    assert stats[f"sampling/{name}_tokens"].item() == pytest.approx(hit.float().mean().item())

    loss, _ = module.minibatch_loss(experience, torch.arange(4))
    advantages = experience.advantages
    expected = (-advantages * weights).mean(1).mean()  # ratio 1 (one iteration), every row 3 tokens
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    out = module.response_scores(module.policy, rollout.input_ids, rollout.attention_mask, 3)
    decoupled, _ = decoupled_policy_loss(
        out.logprobs, out.logprobs.detach(), sampler, advantages, rollout.mask, mode, low, high, aggregation="sequence"
    )
    assert decoupled.item() == pytest.approx(loss.item(), abs=1e-5)


def test_the_coupled_loss_clips_the_ratio_to_the_sampler(monkeypatch):
    """``use_decoupled_loss: false``: the ratio is ``pi_theta / pi_sampler`` (at the rollout's weights, the plain
    ``pi_old / pi_sampler``), clipped by ``epsilon``, no separate weight: the loss is ``clipped_policy_loss`` with
    the sampler's log-probs as the old ones, and by hand GRPO's sequence mean of ``max(-A w, -A clip(w, 0.8, 1.2))``."""
    module = grpo(monkeypatch, use_decoupled_loss=False)
    rollout, experience, stats, old = one_rollout(module, monkeypatch)
    sampler, advantages = rollout.sampling_logprobs, experience.advantages
    ratio = torch.exp(old - sampler)
    assert torch.allclose(experience.is_weights, ratio, rtol=1e-5) and "sampling/is_weight/mean" not in stats
    loss, loss_stats = module.minibatch_loss(experience, torch.arange(4))
    hand = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2)).mean(1).mean()
    assert loss.item() == pytest.approx(hand.item(), abs=1e-5)
    out = module.response_scores(module.policy, rollout.input_ids, rollout.attention_mask, 3)
    coupled, _ = clipped_policy_loss(out.logprobs, sampler, advantages, rollout.mask, 0.2, aggregation="sequence")
    assert coupled.item() == pytest.approx(loss.item(), abs=1e-5) and loss_stats["clipfrac"] > 0
    with pytest.raises(ConfigError, match="takes no weight"):
        grpo(monkeypatch, use_decoupled_loss=False, importance_sampling_mode="token_mask")


def test_auto_on_a_cpu_only_measures_the_gap(monkeypatch, tmp_path):
    """The default ``auto`` on a CPU: no weights, the gap's metrics logged by a real ``fit`` step."""
    module = grpo(monkeypatch)
    assert module.policy_loss.importance_sampling_mode == "auto"
    trainer = quiet_trainer(tmp_path, max_steps=1, limit_val_batches=0)
    ids = torch.tensor([[0, 104, 105], [106, 107, 108]])
    data = [{"input_ids": ids, "attention_mask": (ids > 0).long(), "prompts": ["ab", "cd"], "metadata": [{}, {}]}]
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    logged = {k for k in trainer.callback_metrics if k.startswith("train/sampling/")}
    assert logged == {"train/sampling/logp_gap/mean", "train/sampling/logp_gap/max", "train/sampling/mismatch_kl"}
    assert float(trainer.callback_metrics["train/sampling/mismatch_kl"]) > 0


def test_old_names_warn_and_become_the_token_truncate_mode(monkeypatch):
    """``generation.vllm.importance_sampling_correction: true`` is ``token_truncate`` with the old cap 2.0 (or
    ``importance_sampling_cap``), ``false`` is ``none``; each old name warns once; the saved hyperparameters hold
    only the new names; both spellings at once is an error."""
    with pytest.warns(RenamedArgumentWarning, match="importance_sampling_correction is replaced"):
        module = GRPOModule(
            model_config=TINY_LLAMA,
            tokenizer_name="byte",
            reward="aitraining_pl.rewards:char_fraction_reward",
            kl_coef=0.0,
            generation={"vllm": {"importance_sampling_correction": True}},
        )
    options = module.policy_loss
    assert (options.importance_sampling_mode, options.importance_sampling_clip_max) == ("token_truncate", 2.0)
    assert module.hparams.policy_loss["importance_sampling_mode"] == "token_truncate"
    assert module.hparams.generation["vllm"]["importance_sampling_correction"] is None
    assert module.generation.vllm.importance_sampling_cap is None

    old = GenerationConfig(vllm={"importance_sampling_correction": False, "importance_sampling_cap": 2.5})
    with pytest.warns(RenamedArgumentWarning) as warned:
        options, generation = moved_correction(PolicyLossConfig(), old, "GRPOModule")
    assert len(
        warned
    ) == 2 and "importance_sampling_cap is replaced by policy_loss.importance_sampling_clip_max" in str(
        warned[1].message
    )
    assert (options.importance_sampling_mode, options.importance_sampling_clip_max) == ("none", 2.5)
    assert old.vllm.importance_sampling_correction is False and generation.vllm.importance_sampling_correction is None
    with pytest.warns(RenamedArgumentWarning):
        kept, _ = moved_correction(
            PolicyLossConfig(importance_sampling_clip_max=5.0),
            GenerationConfig(vllm={"importance_sampling_correction": True}),
            "GRPOModule",
        )
    assert (kept.importance_sampling_mode, kept.importance_sampling_clip_max) == ("token_truncate", 5.0)
    with pytest.raises(ConfigError, match="GRPOModule.policy_loss.importance_sampling_mode: given twice"):
        moved_correction(
            PolicyLossConfig(importance_sampling_mode="token_mask"),
            GenerationConfig(vllm={"importance_sampling_correction": True}),
            "GRPOModule",
        )
    saved = GenerationConfig(vllm={"importance_sampling_correction": "auto", "importance_sampling_cap": 2.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the old defaults in the hparams of an earlier checkpoint: no warning
        options, generation = moved_correction(PolicyLossConfig(), saved, "GRPOModule")
    assert options == PolicyLossConfig() and generation.vllm.importance_sampling_cap is None
    untouched = PolicyLossConfig(importance_sampling_mode="token_mask")
    assert moved_correction(untouched, GenerationConfig(), "GRPOModule")[0] is untouched


def test_bad_bounds_are_refused_before_training(monkeypatch):
    with pytest.raises(ConfigError, match="importance_sampling_clip_min"):
        grpo(monkeypatch, importance_sampling_clip_min=1.0, importance_sampling_clip_max=1.0)
    with pytest.raises(ConfigError, match="a truncate mode needs a bound"):
        grpo(monkeypatch, importance_sampling_mode="sequence_truncate", importance_sampling_clip_max=None)
    with pytest.raises(Exception, match="importance_sampling_mode"):
        grpo(monkeypatch, importance_sampling_mode="geometric")
