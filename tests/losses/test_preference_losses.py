"""The DPO variants added beside the originals, the multi-loss sum (RPO) and KTO, against values worked out by
hand with Python floats (``math``), on one- and three-pair tensors."""

from __future__ import annotations

import math

import pytest
import torch

from aitraining_pl import losses as L


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _ls(x: float) -> float:  # log sigmoid
    return math.log(_sig(x))


PC, PR, RC, RR = -10.0, -14.0, -11.0, -12.0  # policy / reference, chosen / rejected log-probs
RW, RL = PC - RC, PR - RR  # log-ratios: 1, -2
H = RW - RL  # 3
BETA = 0.5


def _one(loss_type, **kw):
    t = lambda v: torch.tensor([v])  # noqa: E731
    kw.setdefault("beta", BETA)
    return L.dpo_loss(t(PC), t(PR), t(RC), t(RR), loss_type=loss_type, **kw).losses.item()


HAND = {
    "nca_pair": -_ls(BETA * RW) - 0.5 * _ls(-BETA * RW) - 0.5 * _ls(-BETA * RL),
    "bco_pair": -_ls(BETA * RW) - _ls(-BETA * RL),
    "sppo_hard": (RW - 1 / (2 * BETA)) ** 2 + (RL + 1 / (2 * BETA)) ** 2,  # (1 - 1)^2 + (-2 + 1)^2 = 1
    "apo_zero": (1 - _sig(BETA * RW)) + _sig(BETA * RL),
    "apo_down": _sig(BETA * RW) + (1 - _sig(BETA * H)),
    # one pair: the sorted batches are the pair itself, so both AOT forms are DPO's sigmoid
    "aot": -_ls(BETA * H),
    "aot_unpaired": -_ls(BETA * H),
    "aot_pair": -_ls(BETA * H),
}


@pytest.mark.parametrize("loss_type", sorted(HAND))
def test_new_dpo_losses_match_hand_values(loss_type):
    assert _one(loss_type) == pytest.approx(HAND[loss_type], abs=1e-6)


def test_sppo_hard_is_zero_at_its_targets():
    # chosen log-ratio 1/(2 beta), rejected -1/(2 beta): both squared errors vanish
    t = lambda v: torch.tensor([v])  # noqa: E731
    out = L.dpo_loss(t(1.0), t(-1.0), t(0.0), t(0.0), beta=0.5, loss_type="sppo_hard")
    assert out.losses.item() == pytest.approx(0.0)


def test_exo_pair_is_a_kl_to_the_smoothed_label():
    eps = 1e-3
    q = _sig(BETA * H)
    expected = q * math.log(q / (1 - eps)) + (1 - q) * math.log((1 - q) / eps)
    assert _one("exo_pair", label_smoothing=eps) == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="label_smoothing > 0"):
        _one("exo_pair")


def test_discopop_blends_logistic_and_exponential():
    tau, z = 0.05, BETA * H
    mix = _sig(z / tau)
    expected = (1 - mix) * -_ls(z) + mix * math.exp(-z)
    assert _one("discopop", discopop_tau=tau) == pytest.approx(expected, abs=1e-6)
    # a wide temperature mixes the two halves nearly evenly at z = 0
    t = lambda v: torch.tensor([v])  # noqa: E731
    even = L.dpo_loss(t(-1.0), t(-1.0), t(-1.0), t(-1.0), loss_type="discopop", discopop_tau=1.0).losses.item()
    assert even == pytest.approx(0.5 * math.log(2) + 0.5 * 1.0, abs=1e-6)


def test_sigmoid_norm_averages_per_token():
    lc, lr = torch.tensor([2.0]), torch.tensor([4.0])
    h_avg = RW / 2 - RL / 4
    got = _one("sigmoid_norm", chosen_lengths=lc, rejected_lengths=lr)
    assert got == pytest.approx(-_ls(BETA * h_avg), abs=1e-6)


def test_aot_sorts_the_batch_before_matching():
    # three pairs; AOT compares the i-th smallest policy margin with the i-th smallest reference margin
    pc, pr = torch.tensor([-1.0, -5.0, -2.0]), torch.tensor([-3.0, -4.0, -2.0])  # policy margins 2, -1, 0
    rc, rr = torch.tensor([-2.0, -2.0, -1.0]), torch.tensor([-1.0, -4.0, -1.0])  # reference margins -1, 2, 0
    aot = L.dpo_loss(pc, pr, rc, rr, beta=1.0, loss_type="aot").losses
    deltas = [-1 - -1, 0 - 0, 2 - 2]  # sorted policy (-1, 0, 2) minus sorted reference (-1, 0, 2)
    assert aot.tolist() == pytest.approx([-_ls(d) for d in deltas], abs=1e-6)
    # unpaired: chosen log-ratios (1, -3, -1) and rejected (-2, 0, -1), each sorted
    unpaired = L.dpo_loss(pc, pr, rc, rr, beta=1.0, loss_type="aot_unpaired").losses
    deltas = [-3 - -2, -1 - -1, 1 - 0]
    assert unpaired.tolist() == pytest.approx([-_ls(d) for d in deltas], abs=1e-6)


def test_multi_loss_sums_with_weights_and_sft_is_rpo():
    t = lambda v: torch.tensor(v)  # noqa: E731
    pc, pr, rc, rr = t([-6.0, -9.0]), t([-8.0, -7.0]), t([-7.0, -8.0]), t([-7.0, -7.0])
    lengths = t([3.0, 6.0])
    rpo = L.dpo_loss(
        pc, pr, rc, rr, beta=0.1, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], chosen_lengths=lengths
    )
    nll = (6.0 + 9.0) / (3.0 + 6.0)  # the chosen completions' mean token NLL over the batch
    h = [(-6 + 7) - (-8 + 7), (-9 + 8) - (-7 + 7)]  # 2, -1
    assert rpo.losses.tolist() == pytest.approx([-_ls(0.1 * x) + 0.5 * nll for x in h], abs=1e-6)
    assert rpo.chosen_rewards.tolist() == pytest.approx([0.1, -0.1])  # the sigmoid term's rewards
    # default weights: 1 each
    plain = L.dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type=["sigmoid", "sft"], chosen_lengths=lengths)
    assert plain.losses.tolist() == pytest.approx([-_ls(0.1 * x) + nll for x in h], abs=1e-6)
    with pytest.raises(ValueError, match="2 loss types"):
        L.dpo_loss(pc, pr, rc, rr, loss_type=["sigmoid", "sft"], loss_weights=[1.0], chosen_lengths=lengths)
    with pytest.raises(ValueError, match="chosen_lengths"):
        L.dpo_loss(pc, pr, rc, rr, loss_type=["sigmoid", "sft"])
    with pytest.raises(ValueError, match="unknown DPO loss_type"):
        L.dpo_loss(pc, pr, rc, rr, loss_type=["sigmoid", "nope"])


def test_reference_needs_follow_every_loss_type():
    assert not L.needs_reference(["simpo", "sft"])
    assert L.needs_reference(["sigmoid", "sft"])
    assert not L.needs_reference(["sigmoid", "sft"], reference_free=True)
    t = lambda v: torch.tensor([v])  # noqa: E731
    # CPO (Xu et al. 2024): reference-free sigmoid plus the chosen NLL
    cpo = L.dpo_loss(
        t(PC), t(PR), None, None, beta=BETA, loss_type=["sigmoid", "sft"], reference_free=True, chosen_lengths=t(5.0)
    )
    assert cpo.losses.item() == pytest.approx(-_ls(BETA * (PC - PR)) + -PC / 5.0, abs=1e-6)


def test_every_registered_loss_has_a_gradient_that_prefers_chosen():
    for loss_type in sorted(L.DPO_LOSSES):
        if loss_type in ("sft", "apo_down", "discopop"):
            # sft ignores the rejected; apo_down lowers both by design; DiscoPOP's loss is not monotone at a zero
            # margin (its mixing weight moves fastest there; Chan et al. 2024 note the non-convex region)
            continue
        pc = torch.tensor([-5.0, -6.0], requires_grad=True)
        pr = torch.tensor([-5.0, -6.0], requires_grad=True)
        ref = torch.tensor([-5.0, -6.0])
        lengths = torch.tensor([2.0, 3.0])
        eps = 0.01 if loss_type == "exo_pair" else 0.0
        L.dpo_loss(
            pc,
            pr,
            ref,
            ref,
            beta=0.5,
            loss_type=loss_type,
            label_smoothing=eps,
            chosen_lengths=lengths,
            rejected_lengths=lengths,
        ).losses.sum().backward()
        assert (pc.grad - pr.grad < 0).all(), loss_type  # descent raises chosen relative to rejected


# ---------------------------------------------------------------- KTO


def test_kto_reference_point_is_a_clamped_mean():
    policy, ref = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -5.0])
    assert L.kto_reference_point(policy, ref).item() == pytest.approx(0.5)
    assert L.kto_reference_point(ref - 1, ref).item() == 0.0  # a negative estimate is clamped to 0


def test_kto_loss_hand_values():
    policy, ref = torch.tensor([-3.0, -9.0, -4.0]), torch.tensor([-4.0, -8.0, -4.0])  # r = 1, -1, 0
    desirable = torch.tensor([True, False, True])
    z0, beta, wd, wu = 0.25, 2.0, 1.5, 0.5
    out = L.kto_loss(policy, ref, desirable, z0, beta=beta, desirable_weight=wd, undesirable_weight=wu)
    expected = [
        wd * (1 - _sig(beta * (1 - z0))),
        wu * (1 - _sig(beta * (z0 - -1))),
        wd * (1 - _sig(beta * (0 - z0))),
    ]
    assert out.losses.tolist() == pytest.approx(expected, abs=1e-6)
    assert out.rewards.tolist() == pytest.approx([2.0, -2.0, 0.0])
    assert not out.rewards.requires_grad


def test_kto_gradient_raises_desirable_and_lowers_undesirable():
    policy = torch.tensor([-4.0, -4.0], requires_grad=True)
    ref = torch.tensor([-4.0, -4.0])
    L.kto_loss(policy, ref, torch.tensor([True, False]), 0.0).losses.sum().backward()
    assert policy.grad[0] < 0 < policy.grad[1]
