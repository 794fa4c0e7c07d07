"""Tinker's built-in losses (``losses.tinker``) per token against numbers worked out by hand, and their config
checks."""

from __future__ import annotations

import math

import pytest
import torch

from aitraining_pl.losses.tinker import TINKER_LOSSES, UNSERVED_LOSSES, loss_config

LP = torch.tensor([math.log(0.5), math.log(0.2), math.log(0.9)])
Q = torch.tensor([math.log(0.25), math.log(0.2), math.log(0.9)])  # ratios 2, 1, 1
A = torch.tensor([1.0, -2.0, 0.5])


def run(name, mask=(1.0, 1.0, 1.0), **config):
    lp = LP.clone().requires_grad_(True)
    inputs = {"logprobs": Q, "advantages": A, "weights": torch.tensor([1.0, 0.0, 2.0]),
              "sequence_ratio_mask": torch.tensor(mask)}  # fmt: skip
    out = TINKER_LOSSES[name](lp, inputs, loss_config(name, config))
    out.sum().backward()
    return out.detach(), lp.grad


def test_each_loss_per_token_and_gradient_by_hand():
    out, grad = run("cross_entropy")
    assert out.tolist() == pytest.approx([-math.log(0.5), 0.0, -2 * math.log(0.9)])
    assert grad.tolist() == pytest.approx([-1.0, 0.0, -2.0])
    out, grad = run("importance_sampling")  # -r A; d/dlp = -r A
    assert out.tolist() == pytest.approx([-2.0, 2.0, -0.5])
    assert grad.tolist() == pytest.approx([-2.0, 2.0, -0.5])
    out, grad = run("ppo")  # token 0: r = 2 > 1.2 with A > 0: clipped, no gradient
    assert out.tolist() == pytest.approx([-1.2, 2.0, -0.5])
    assert grad.tolist() == pytest.approx([0.0, 2.0, -0.5])
    out, grad = run("cispo")  # -sg(clip(r)) lp A; d/dlp = -clip(r) A
    assert out.tolist() == pytest.approx([-1.2 * math.log(0.5), 2 * math.log(0.2), -0.5 * math.log(0.9)])
    assert grad.tolist() == pytest.approx([-1.2, 2.0, -0.5])
    out, grad = run("dro", beta=0.5)  # -(lp A - beta/2 (lp - q)^2); d/dlp = -A + beta (lp - q)
    d = math.log(2)
    assert out.tolist() == pytest.approx([-(math.log(0.5) - 0.25 * d * d), 2 * math.log(0.2), -0.5 * math.log(0.9)])
    assert grad.tolist() == pytest.approx([-1.0 + 0.5 * d, 2.0, -0.5])


def test_ppo_thresholds_from_the_config_and_unknown_keys_refused():
    out, _ = run("ppo", clip_low_threshold=0.5, clip_high_threshold=3.0)
    assert out.tolist() == pytest.approx([-2.0, 2.0, -0.5])
    with pytest.raises(ValueError, match="takes no loss_fn_config key beta"):
        loss_config("ppo", {"beta": 1.0})


def test_gspo_token_carries_the_sequence_ratio_and_each_tokens_own_gradient():
    """Log-ratios (log 2, 0, 0): over all three tokens s = 2^(1/3) ~ 1.26 > 1.2, so tokens with A > 0 are clipped
    (loss -1.2 A, no gradient) and the one with A < 0 keeps -s A with gradient -s A (d s_t / d log p_t = s_t)."""
    s = 2 ** (1 / 3)
    out, grad = run("gspo")
    assert out.tolist() == pytest.approx([-1.2, 2 * s, -0.6])
    assert grad.tolist() == pytest.approx([0.0, 2 * s, 0.0])
    out, grad = run("gspo", mask=(0.0, 1.0, 1.0))  # the mask leaves the ratio-2 token out: s = 1, -A each
    assert out.tolist() == pytest.approx([-1.0, 2.0, -0.5])
    assert grad.tolist() == pytest.approx([-1.0, 2.0, -0.5])
    out, _ = run("gspo", clip_low_threshold=0.5, clip_high_threshold=1.5)  # s inside the band: -s A
    assert out.tolist() == pytest.approx([-s, 2 * s, -0.5 * s])


def test_every_loss_the_client_names_is_served_or_refused_with_its_reason():
    from typing import get_args

    types = pytest.importorskip("tinker.types")
    named = set(get_args(types.LossFnType))
    assert named == set(TINKER_LOSSES) | set(UNSERVED_LOSSES)
