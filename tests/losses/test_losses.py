"""The maths of aitraining_pl.losses against hand-derived values and plain Python loops."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from aitraining_pl import losses as L


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---------------------------------------------------------------- log-probs


def test_selective_log_softmax_matches_log_softmax_gather():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    index = torch.randint(0, 11, (3, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(L.selective_log_softmax(logits, index), expected)
    # half precision goes row by row in float32
    got = L.selective_log_softmax(logits.bfloat16(), index)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0)


def test_sequence_logps_scores_token_t_plus_1_on_completion_only():
    # vocab 2, logits chosen so that log p(token) is known: softmax([0, log 3]) = [1/4, 3/4]
    logits = torch.tensor([[[0.0, math.log(3)]] * 4])  # (1, 4, 2)
    input_ids = torch.tensor([[0, 1, 0, 1]])
    completion_mask = torch.tensor([[0, 0, 1, 1]])  # completion = tokens 2 and 3
    out = L.sequence_logps(logits, input_ids, completion_mask)
    # token 2 (=0) scored by logits[1]: log 1/4; token 3 (=1) scored by logits[2]: log 3/4
    assert out.logps.item() == pytest.approx(math.log(0.25) + math.log(0.75), abs=1e-6)
    assert out.lengths.item() == 2


def test_entropy_from_logits():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    assert L.entropy_from_logits(logits).item() == pytest.approx(
        -(0.5 * math.log(0.5) + 0.5 * math.log(0.25)), abs=1e-6
    )
    assert L.entropy_from_logits(torch.zeros(4, 7)).allclose(torch.full((4,), math.log(7)))


def test_masked_mean_var_whiten_against_loops():
    torch.manual_seed(1)
    x = torch.randn(4, 6)
    mask = (torch.rand(4, 6) > 0.3).float()
    values = [x[i, j].item() for i in range(4) for j in range(6) if mask[i, j]]
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    assert L.masked_mean(x, mask).item() == pytest.approx(mean, abs=1e-6)
    assert L.masked_var(x, mask).item() == pytest.approx(var, abs=1e-5)
    row_means = [sum(x[i, j].item() for j in range(6) if mask[i, j]) / max(1, mask[i].sum().item()) for i in range(4)]
    torch.testing.assert_close(L.masked_mean(x, mask, dim=1), torch.tensor(row_means))
    w = L.masked_whiten(x, mask)
    for i in range(4):
        for j in range(6):
            expected = (x[i, j].item() - mean) / math.sqrt(var + 1e-8) if mask[i, j] else 0.0
            assert w[i, j].item() == pytest.approx(expected, abs=1e-5)
    w_noshift = L.masked_whiten(x, mask, shift_mean=False)
    assert L.masked_mean(w_noshift, mask).item() == pytest.approx(mean, abs=1e-5)


def test_explained_variance():
    t = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    m = torch.ones_like(t)
    assert L.explained_variance(t, t, m).item() == pytest.approx(1.0)
    assert L.explained_variance(torch.full_like(t, 2.5), t, m).item() == pytest.approx(0.0, abs=1e-6)


# ---------------------------------------------------------------- DPO family

PC, PR, RC, RR = -10.0, -14.0, -11.0, -12.0  # policy/ref chosen/rejected log-probs
H = (PC - RC) - (PR - RR)  # = 1 - (-2) = 3


def _dpo(loss_type, **kw):
    t = lambda v: torch.tensor([v])  # noqa: E731
    return L.dpo_loss(t(PC), t(PR), t(RC), t(RR), loss_type=loss_type, **kw)


def test_dpo_sigmoid_hand_value_and_rewards():
    out = _dpo("sigmoid", beta=0.1)
    assert out.losses.item() == pytest.approx(-math.log(_sig(0.1 * H)), abs=1e-6)
    assert out.chosen_rewards.item() == pytest.approx(0.1 * (PC - RC))
    assert out.rejected_rewards.item() == pytest.approx(0.1 * (PR - RR))
    assert not out.chosen_rewards.requires_grad


def test_dpo_conservative_and_robust():
    eps, beta = 0.1, 0.5
    cdpo = _dpo("sigmoid", beta=beta, label_smoothing=eps).losses.item()
    assert cdpo == pytest.approx(-(1 - eps) * math.log(_sig(beta * H)) - eps * math.log(_sig(-beta * H)), abs=1e-6)
    robust = _dpo("robust", beta=beta, label_smoothing=eps).losses.item()
    expected = (-(1 - eps) * math.log(_sig(beta * H)) + eps * math.log(_sig(-beta * H))) / (1 - 2 * eps)
    assert robust == pytest.approx(expected, abs=1e-6)


def test_dpo_hinge_ipo_simpo_hand_values():
    assert _dpo("hinge", beta=0.1).losses.item() == pytest.approx(max(0.0, 1 - 0.1 * H), abs=1e-6)
    lc, lr = torch.tensor([2.0]), torch.tensor([4.0])
    ipo = _dpo("ipo", beta=0.1, chosen_lengths=lc, rejected_lengths=lr).losses.item()
    h_avg = (PC - RC) / 2 - (PR - RR) / 4
    assert ipo == pytest.approx((h_avg - 1 / (2 * 0.1)) ** 2, abs=1e-5)
    simpo = _dpo("simpo", beta=2.0, gamma=0.5, chosen_lengths=lc, rejected_lengths=lr)
    z = 2.0 * (PC / 2 - PR / 4) - 0.5  # reference ignored
    assert simpo.losses.item() == pytest.approx(-math.log(_sig(z)), abs=1e-6)
    assert simpo.chosen_rewards.item() == pytest.approx(2.0 * PC / 2)


def test_dpo_reference_free_and_errors():
    t = lambda v: torch.tensor([v])  # noqa: E731
    out = L.dpo_loss(t(PC), t(PR), None, None, beta=0.1, reference_free=True)
    assert out.losses.item() == pytest.approx(-math.log(_sig(0.1 * (PC - PR))), abs=1e-6)
    with pytest.raises(ValueError, match="unknown DPO loss_type .*hinge, ipo, nca_pair"):
        _dpo("nope")
    with pytest.raises(ValueError, match="chosen_lengths"):
        _dpo("ipo")
    with pytest.raises(ValueError, match="reference log-probs"):
        L.dpo_loss(t(PC), t(PR), None, None)


def test_dpo_gradient_pushes_chosen_up():
    pc = torch.tensor([-5.0], requires_grad=True)
    pr = torch.tensor([-5.0], requires_grad=True)
    L.dpo_loss(pc, pr, torch.tensor([-5.0]), torch.tensor([-5.0])).losses.sum().backward()
    assert pc.grad.item() < 0 < pr.grad.item()  # descent raises chosen, lowers rejected


def test_orpo_hand_value():
    c, r, nll, beta = math.log(0.5), math.log(0.25), 0.7, 0.1
    log_odds = math.log(0.5 / 0.5) - math.log(0.25 / 0.75)
    out = L.orpo_loss(torch.tensor([c]), torch.tensor([r]), torch.tensor([nll]), beta)
    assert out.log_odds.item() == pytest.approx(log_odds, abs=1e-6)
    assert out.losses.item() == pytest.approx(nll - beta * math.log(_sig(log_odds)), abs=1e-6)


def test_bradley_terry_margin_and_centering():
    c, r = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    base = (-math.log(_sig(1.0)) - math.log(_sig(-2.0))) / 2
    assert L.bradley_terry_loss(c, r).item() == pytest.approx(base, abs=1e-6)
    m = torch.tensor([0.5, 0.0])
    with_margin = (-math.log(_sig(0.5)) - math.log(_sig(-2.0))) / 2
    assert L.bradley_terry_loss(c, r, margin=m).item() == pytest.approx(with_margin, abs=1e-6)
    centred = base + 0.01 * ((1.0 + 0.0) ** 2 + (0.0 + 2.0) ** 2) / 2
    assert L.bradley_terry_loss(c, r, center_coef=0.01).item() == pytest.approx(centred, abs=1e-6)


# ---------------------------------------------------------------- RL


def test_kl_estimators():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    d = -1.0 - -1.5
    assert L.kl_penalty(lp, ref, "k1").item() == pytest.approx(d)
    assert L.kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert L.kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(-d) - 1 + d, abs=1e-7)
    with pytest.raises(ValueError, match="k1, k2, k3"):
        L.kl_penalty(lp, ref, "k9")


def test_kl_estimators_are_unbiased_for_sampled_tokens():
    torch.manual_seed(0)
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.3, 0.3, 0.4])
    true_kl = (p * (p / q).log()).sum().item()
    samples = torch.multinomial(p, 200_000, replacement=True)
    lp, lq = p.log()[samples], q.log()[samples]
    assert L.kl_penalty(lp, lq, "k1").mean().item() == pytest.approx(true_kl, abs=0.01)
    assert L.kl_penalty(lp, lq, "k3").mean().item() == pytest.approx(true_kl, abs=0.01)


def _gae_loop(rewards, values, mask, gamma, lam):
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        last = [t for t in range(T) if mask[b][t]]
        running = 0.0
        for t in reversed(last):
            nxt = values[b][t + 1] if t + 1 < T and mask[b][t + 1] else 0.0
            delta = rewards[b][t] + gamma * nxt - values[b][t]
            running = delta + gamma * lam * running
            adv[b][t] = running
    return adv


def test_gae_against_loop_and_terminal_value_zero():
    torch.manual_seed(0)
    rewards, values = torch.randn(3, 7), torch.randn(3, 7)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1, 0]]).float()
    adv, ret = L.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    expected = torch.tensor(_gae_loop(rewards.tolist(), values.tolist(), mask.tolist(), 0.9, 0.8))
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, (expected + values) * mask)
    # last response token: advantage = r - V (value after it is 0); padding contributes nothing
    assert adv[1, 2].item() == pytest.approx(rewards[1, 2].item() - values[1, 2].item(), abs=1e-6)
    assert (adv[mask == 0] == 0).all()
    # gamma = lam = 1: advantage = sum of future rewards - V
    adv1, _ = L.gae(rewards, values, mask, 1.0, 1.0)
    assert adv1[1, 0].item() == pytest.approx(rewards[1, :3].sum().item() - values[1, 0].item(), abs=1e-5)


def test_ppo_policy_loss_clipping_hand_values():
    # PPO's policy loss is clipped_policy_loss with the token-mean aggregation and no KL term
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    mask = torch.ones(1, 3)
    loss, stats = L.clipped_policy_loss(logp, old, adv, mask, epsilon=0.2, aggregation="token")
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(-0.5, -0.8) = -0.5; token 2: max(2.2, 2.2) = 2.2
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 2.2) / 3, abs=1e-6)
    assert stats["clipfrac"].item() == pytest.approx(1 / 3)
    ratios = torch.tensor([1.5, 0.5, 1.1])
    assert stats["approx_kl"].item() == pytest.approx(((ratios - 1) - ratios.log()).mean().item(), abs=1e-6)


def test_ppo_value_loss_hand_values():
    values = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0]])
    # token 0: unclipped (1-2)^2 = 1; clipped V = 0.2 -> (0.2-2)^2 = 3.24 -> max 3.24; token 1: 1 and 1
    loss = L.ppo_value_loss(values, old, returns, torch.ones(1, 2), value_clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (3.24 + 1.0) / 2, abs=1e-6)


def test_group_and_rloo_advantages_against_loops():
    # sequence scores on each response's last token; groups of 3 consecutive rows (the registry's estimators)
    r = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 6.0])
    g = 3
    group = torch.arange(6) // g
    rewards, mask = torch.zeros(6, 2), torch.ones(6, 2)
    rewards[:, -1] = r
    for name, scale in (("grpo", "group"), ("dr_grpo", "none")):
        got = L.compute_advantages(name, rewards, mask, group)
        for i in range(6):
            grp = r[(i // g) * g : (i // g + 1) * g].tolist()
            mean = sum(grp) / g
            std = math.sqrt(sum((v - mean) ** 2 for v in grp) / (g - 1))
            denom = {"group": std + 1e-4, "none": 1.0}[scale]
            assert got[i].tolist() == pytest.approx([(r[i].item() - mean) / denom] * 2, abs=1e-5)
    rloo = L.compute_advantages("rloo", rewards, mask, group)
    for i in range(6):
        grp = r[(i // g) * g : (i // g + 1) * g].tolist()
        others = grp[: i % g] + grp[i % g + 1 :]
        assert rloo[i].tolist() == pytest.approx([r[i].item() - sum(others) / (g - 1)] * 2, abs=1e-6)
    with pytest.raises(ValueError, match="unknown advantage estimator 'x'"):
        L.compute_advantages("x", rewards, mask, group)


# ---------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_update_and_state():
    from aitraining_pl.callbacks.kl import AdaptiveKLController

    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=12.0, n_steps=100)  # error clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000))
    before = ctl.value
    ctl.update(current_kl=5.4, n_steps=100)  # error = -0.1
    assert ctl.value == pytest.approx(before * (1 - 0.1 * 100 / 10000))
    assert ctl.value < before
    restored = AdaptiveKLController(0.5, target=6.0, horizon=10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=1)


def test_losses_package_has_no_lightning_or_transformers_imports():
    import ast
    import pathlib

    for path in pathlib.Path(L.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] not in {"lightning", "pytorch_lightning", "transformers", "peft"}, (
                    path,
                    name,
                )


def test_selective_log_softmax_gradient_matches():
    torch.manual_seed(0)
    a = torch.randn(2, 3, 5, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    idx = torch.randint(0, 5, (2, 3))
    L.selective_log_softmax(a, idx).sum().backward()
    F.log_softmax(b, -1).gather(-1, idx.unsqueeze(-1)).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
