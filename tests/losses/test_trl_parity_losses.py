"""Where the online policy loss and TRL 1.16's ``GRPOTrainer`` differ on purpose or by option (issue 34, part 7):
``use_bias_correction_kl``, ``loss_aggregation: sequence`` with empty rows, CISPO's ``epsilon_high``. Each is
checked against hand-derived values and against TRL's formula written here from its documented semantics."""

from __future__ import annotations

import math

import pytest
import torch

from aitraining_pl.losses import clipped_policy_loss, completed_rows
from aitraining_pl.losses.policy_gradient import sequence_mean

LN2 = math.log(2.0)


def _trl_grpo_loss(logprobs, old, ref, advantages, mask, beta, epsilon, level, bias_correction):
    """TRL 1.16's ``loss_type: grpo`` as its docs describe it: token or sequence (mean log-ratio) importance
    weight, the clipped surrogate, ``beta`` times k3 (times the weight when ``use_bias_correction_kl``), the mean
    over each row's tokens (a row with no token: 0), then the mean over all rows."""
    log_ratio = logprobs - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    weight = torch.exp(log_ratio)
    kl = torch.exp(ref - logprobs) - (ref - logprobs) - 1
    if bias_correction:
        kl = kl * weight
    surrogate = -torch.min(weight * advantages, torch.clamp(weight, 1 - epsilon, 1 + epsilon) * advantages)
    per_token = surrogate + beta * kl
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


# ---------------------------------------------------------------- use_bias_correction_kl


def test_bias_corrected_kl_hand_values():
    """pi = (1/2, 1/4), pi_old = (1/4, 1/4), ref = (1/4, 1/2) on two tokens, no advantage: the ratios are (2, 1),
    ref / pi = (1/2, 2), so k3 = ref/pi - 1 - ln(ref/pi) = (ln2 - 1/2, 1 - ln2); plain token mean 0.25,
    corrected (2 (ln2 - 0.5) + 1 - ln2) / 2 = ln2 / 2. Gradients per log-prob: plain (1 - ref/pi) / 2 = (1/4, -1/2),
    corrected ratio (k3 + 1 - ref/pi) / 2 = (ln2, -ln2 / 2)."""
    beta = 0.5
    old = torch.log(torch.tensor([[0.25, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    mask, advantages = torch.ones(1, 2), torch.zeros(1, 2)
    want = {False: (0.25, [0.25, -0.5]), True: (LN2 / 2, [LN2, -LN2 / 2])}
    for corrected, (value, grad) in want.items():
        logprobs = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
        loss, stats = clipped_policy_loss(
            logprobs, old, advantages, mask, aggregation="token", ref_logprobs=ref, kl_coef=beta,
            use_bias_correction_kl=corrected,
        )  # fmt: skip
        loss.backward()
        assert loss.item() == pytest.approx(beta * value, rel=1e-6)
        assert stats["kl"].item() == pytest.approx(value, rel=1e-6)  # the KL term as it enters the loss
        torch.testing.assert_close(logprobs.grad, beta * torch.tensor([grad]))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("corrected", [False, True])
def test_kl_term_matches_trl_grpo_formula(level, corrected):
    """Value and gradient equal TRL's ``loss_type: grpo`` (our ``loss_aggregation: sequence``) with
    ``use_bias_correction_kl`` on and off, at both importance-sampling levels, off-policy (num_iterations > 1)."""
    g = torch.Generator().manual_seed(0)
    shape = (4, 5)
    logprobs = (-torch.rand(shape, generator=g) * 2).requires_grad_()
    old = logprobs.detach() + 0.1 * torch.randn(shape, generator=g)
    ref = logprobs.detach() + 0.3 * torch.randn(shape, generator=g)
    advantages = torch.randn(shape[0], 1, generator=g).expand(shape)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.float)
    ours, _ = clipped_policy_loss(
        logprobs, old, advantages, mask, epsilon=0.2, aggregation="sequence", ref_logprobs=ref, kl_coef=0.1,
        importance_sampling_level=level, use_bias_correction_kl=corrected,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(ours, logprobs)
    trl = _trl_grpo_loss(logprobs, old, ref, advantages, mask, 0.1, 0.2, level, corrected)
    (trl_grad,) = torch.autograd.grad(trl, logprobs)
    torch.testing.assert_close(ours, trl)
    torch.testing.assert_close(grad, trl_grad)


def test_on_policy_the_correction_changes_the_gradient_not_the_value():
    """With pi_old = pi (``num_iterations: 1``) the ratio is 1: the loss is the same, and the gradient gains
    ``kl_coef * k3 / n`` per token (the ratio's own gradient, d ratio / d logp = 1)."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    mask, advantages = torch.ones(1, 3), torch.zeros(1, 3)
    values, grads = [], []
    for corrected in (False, True):
        loss, _ = clipped_policy_loss(
            logprobs, logprobs.detach(), advantages, mask, aggregation="token", ref_logprobs=ref, kl_coef=0.2,
            use_bias_correction_kl=corrected,
        )  # fmt: skip
        values.append(loss)
        grads.append(torch.autograd.grad(loss, logprobs)[0])
    r = ref - logprobs.detach()
    k3 = torch.expm1(r) - r
    torch.testing.assert_close(values[0], values[1])
    torch.testing.assert_close(grads[1] - grads[0], 0.2 * k3 / 3)


def test_bias_corrected_kl_gradient_is_the_reverse_kl_gradient():
    """Exact expectation over a 5-token vocabulary (every one-token response weighted by pi_old = pi): the
    corrected term's expected gradient is the gradient of KL(pi || ref), plain k3's that of KL(ref || pi)."""
    theta = torch.tensor([0.3, -1.0, 0.8, 0.0, -0.4], requires_grad=True)
    ref = torch.log_softmax(torch.tensor([-0.2, 0.5, 0.1, -1.0, 0.7]), 0)
    expected = {}
    for corrected in (False, True):
        logp = torch.log_softmax(theta, 0)
        total = 0.0
        for y in range(5):
            one = logp[y].view(1, 1)
            loss, _ = clipped_policy_loss(
                one, one.detach(), torch.zeros(1, 1), torch.ones(1, 1), aggregation="token",
                ref_logprobs=ref[y].view(1, 1), kl_coef=1.0, use_bias_correction_kl=corrected,
            )  # fmt: skip
            total = total + logp[y].exp().detach() * loss
        expected[corrected] = torch.autograd.grad(total, theta)[0]
    logp = torch.log_softmax(theta, 0)
    reverse = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)[0]
    logp = torch.log_softmax(theta, 0)
    forward = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), theta)[0]
    torch.testing.assert_close(expected[True], reverse)
    torch.testing.assert_close(expected[False], forward)


# ---------------------------------------------------------------- loss_aggregation: sequence with empty rows


def test_sequence_mean_leaves_empty_rows_out_eight_sevenths_of_trl():
    """Eight rows whose token means are 1..7 and one row cut at max_new_tokens (mask_truncated_completions): the
    mean over the seven rows left is 4; TRL's mean over all eight rows (the empty one as 0) is 28 / 8 = 3.5."""
    per_token = torch.arange(1.0, 9.0).unsqueeze(1).repeat(1, 3)  # row i: value i + 1 on every token
    mask = torch.ones(8, 3)
    mask[1, 2] = 0  # a shorter response: its mean is still its value
    ended = torch.tensor([True] * 7 + [False])  # the last response hit max_new_tokens
    kept = completed_rows(mask, ended)
    ours = sequence_mean(per_token, kept, 3)
    trl = ((per_token * kept).sum(-1) / kept.sum(-1).clamp(min=1.0)).mean()
    assert ours.item() == pytest.approx(4.0)
    assert trl.item() == pytest.approx(3.5)
    assert (ours / trl).item() == pytest.approx(8 / 7)


def test_sequence_aggregation_with_an_empty_row_through_the_policy_loss():
    """The same choice through ``clipped_policy_loss``: on-policy, loss = -mean(A) over the responses left, and each
    kept response's gradient weight is 1 / 7 (TRL: 1 / 8)."""
    advantages = torch.arange(1.0, 9.0).unsqueeze(1).expand(8, 2)
    mask = completed_rows(torch.ones(8, 2), torch.tensor([True] * 7 + [False]))
    logprobs = torch.full((8, 2), -1.0, requires_grad=True)
    loss, _ = clipped_policy_loss(logprobs, logprobs.detach(), advantages, mask, aggregation="sequence")
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert loss.item() == pytest.approx(-4.0)  # -(1 + ... + 7) / 7
    torch.testing.assert_close(grad[:7], -advantages[:7] / (7 * 2))
    assert grad[7].abs().sum() == 0
    trl = _trl_grpo_loss(logprobs, logprobs.detach(), logprobs.detach(), advantages, mask, 0.0, 0.2, "token", False)
    assert (loss / trl).item() == pytest.approx(8 / 7)


def test_sequence_mean_without_empty_rows_equals_trl():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    trl = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    assert sequence_mean(per_token, mask, 3).item() == pytest.approx(trl.item()) == pytest.approx(3.0)


# ---------------------------------------------------------------- CISPO's epsilon_high


def test_cispo_epsilon_high_is_trls_minus_one():
    """TRL 1.16's cispo: ``-clamp(ratio, max=epsilon_high).detach() * A * logp``; ours bounds the weight by
    ``1 + epsilon_high``, so TRL's 5.0 is our 4.0. Hand values: ratios (0.5, 3, 8) -> weights (0.5, 3, 5)."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = logprobs.detach() - torch.log(torch.tensor([[0.5, 3.0, 8.0]]))
    advantages, mask = torch.tensor([[1.0, -2.0, 1.0]]), torch.ones(1, 3)
    ours, _ = clipped_policy_loss(
        logprobs, old, advantages, mask, epsilon_high=4.0, aggregation="token", loss_type="cispo"
    )
    (grad,) = torch.autograd.grad(ours, logprobs)
    trl_weight = torch.clamp(torch.exp(logprobs.detach() - old), max=5.0)
    trl = (-trl_weight * advantages * logprobs).sum() / mask.sum()
    torch.testing.assert_close(ours, trl)
    torch.testing.assert_close(grad, -torch.tensor([[0.5, 3.0, 5.0]]) * advantages / 3)
