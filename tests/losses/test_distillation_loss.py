"""The generalized JSD of GKD (``losses.distillation``): hand values at beta 0, 0.5, 1 and a temperature, the closed
forms, the fused (chunked) form against the plain one, its gradient, and that it keeps no (tokens, vocabulary)
tensor for backward."""

from __future__ import annotations

import math

import pytest
import torch

from aitraining_pl.losses import fused_distillation_loss, generalized_jsd

P = [0.5, 0.3, 0.2]  # the student's distribution of the hand-derived cases
Q = [0.2, 0.2, 0.6]  # the teacher's


def kl(a, b) -> float:
    return sum(x * math.log(x / y) for x, y in zip(a, b))


def hand_gjsd(student, teacher, beta) -> float:
    """GKD eq. 2 written out in floats: beta KL(T || m) + (1 - beta) KL(S || m), m = beta T + (1 - beta) S."""
    if beta == 0:
        return kl(teacher, student)
    if beta == 1:
        return kl(student, teacher)
    m = [beta * t + (1 - beta) * s for s, t in zip(student, teacher)]
    return beta * kl(teacher, m) + (1 - beta) * kl(student, m)


def logps(probabilities) -> torch.Tensor:
    return torch.tensor(probabilities, dtype=torch.float64).log().unsqueeze(0)


def test_hand_values():
    # beta 0: KL(T || S) = 0.2 ln 0.4 + 0.2 ln(2/3) + 0.6 ln 3
    forward = 0.2 * math.log(0.4) + 0.2 * math.log(2 / 3) + 0.6 * math.log(3)
    # beta 1: KL(S || T) = 0.5 ln 2.5 + 0.3 ln 1.5 + 0.2 ln(1/3)
    reverse = 0.5 * math.log(2.5) + 0.3 * math.log(1.5) + 0.2 * math.log(1 / 3)
    # beta 0.5: m = (0.35, 0.25, 0.4); JSD = (KL(T || m) + KL(S || m)) / 2
    jsd = 0.5 * (0.2 * math.log(0.2 / 0.35) + 0.2 * math.log(0.2 / 0.25) + 0.6 * math.log(0.6 / 0.4)) + 0.5 * (
        0.5 * math.log(0.5 / 0.35) + 0.3 * math.log(0.3 / 0.25) + 0.2 * math.log(0.2 / 0.4)
    )
    for beta, want in ((0.0, forward), (1.0, reverse), (0.5, jsd)):
        got = float(generalized_jsd(logps(P), logps(Q), beta))
        assert got == pytest.approx(want, abs=1e-12), beta
    assert forward == pytest.approx(0.3948, abs=1e-4) and reverse == pytest.approx(0.3601, abs=1e-4)
    assert jsd == pytest.approx(0.0906, abs=1e-4)
    assert float(generalized_jsd(logps(P), logps(P), 0.5)) == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_temperature_closed_form(beta):
    """At temperature T both distributions are softmax(logits / T): the fused form equals GKD eq. 2 written out on
    those probabilities (no T^2 factor, as TRL)."""
    torch.manual_seed(0)
    hidden_s, hidden_t = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    weight_s, weight_t = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    temperature = 2.5
    out = fused_distillation_loss(
        hidden_s, weight_s, hidden_t, weight_t, torch.ones(4, dtype=torch.float64), beta=beta, temperature=temperature
    )
    student = torch.softmax(hidden_s @ weight_s.T / temperature, -1).tolist()
    teacher = torch.softmax(hidden_t @ weight_t.T / temperature, -1).tolist()
    want = [hand_gjsd(s, t, beta) for s, t in zip(student, teacher)]
    assert out.stats.divergence.tolist() == pytest.approx(want, abs=1e-12)
    assert out.stats.forward_kl.tolist() == pytest.approx([kl(t, s) for s, t in zip(student, teacher)], abs=1e-12)
    assert out.stats.reverse_kl.tolist() == pytest.approx([kl(s, t) for s, t in zip(student, teacher)], abs=1e-12)
    assert float(out.loss) == pytest.approx(sum(want), abs=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gradient_closed_form(beta):
    """d JSD / d student logits: p_S - p_T at beta 0, p_S (log p_S - log p_T - KL) at beta 1 (GKD eq. 2 through the
    softmax), and the fused gradients equal autograd on the plain form; gradcheck passes."""
    torch.manual_seed(1)
    logits = torch.randn(1, 5, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(1, 5, dtype=torch.float64).log_softmax(-1)
    (grad,) = torch.autograd.grad(generalized_jsd(logits.log_softmax(-1), teacher, beta).sum(), logits)
    p_s, p_t = logits.softmax(-1).detach(), teacher.exp()
    if beta == 0.0:
        assert torch.allclose(grad, p_s - p_t)
    elif beta == 1.0:
        gap = p_s.log() - teacher
        assert torch.allclose(grad, p_s * (gap - (p_s * gap).sum()))
    # the fused form: gradients to the student's hidden states, head weight and bias (scale and soft-cap on)
    hidden = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(9, dtype=torch.float64, requires_grad=True)
    hidden_t, weight_t = torch.randn(7, 3, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)
    weights = torch.rand(7, dtype=torch.float64)

    def fused(h, w, b):
        return fused_distillation_loss(
            h, w, hidden_t, weight_t, weights, beta=beta, temperature=1.5, student_bias=b,
            student_post=(0.8, 4.0), chunk_size=3,
        ).loss  # fmt: skip

    def plain(h, w, b):
        z = 4.0 * torch.tanh(0.8 * (h @ w.T + b) / 4.0) / 1.5
        return (weights * generalized_jsd(z.log_softmax(-1), (hidden_t @ weight_t.T / 1.5).log_softmax(-1), beta)).sum()

    inputs = (hidden, weight, bias)
    got, want = torch.autograd.grad(fused(*inputs), inputs), torch.autograd.grad(plain(*inputs), inputs)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-12)
    assert torch.autograd.gradcheck(fused, inputs)


def test_no_gradient_work_without_grad():
    hidden, weight = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    with torch.no_grad():
        out = fused_distillation_loss(hidden, weight, torch.randn(3, 2), torch.randn(5, 2), torch.ones(3))
    assert not out.loss.requires_grad


def test_stats_of_targets_and_agreement():
    student = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    teacher = torch.tensor([[1.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    eye = torch.eye(3)
    out = fused_distillation_loss(student, eye, teacher, eye, torch.ones(2), targets=torch.tensor([0, 1]))
    assert out.stats.agreement.tolist() == [1.0, 0.0]
    assert torch.allclose(out.stats.teacher_logps, teacher.log_softmax(-1)[[0, 1], [0, 1]])
    assert torch.allclose(out.stats.student_logps, student.log_softmax(-1)[[0, 1], [0, 1]])


def test_bad_arguments():
    h, w = torch.randn(2, 3), torch.randn(4, 3)
    with pytest.raises(ValueError, match="beta"):
        fused_distillation_loss(h, w, h, w, torch.ones(2), beta=1.5)
    with pytest.raises(ValueError, match="vocabularies differ"):
        fused_distillation_loss(h, w, h, torch.randn(5, 3), torch.ones(2))


def test_keeps_no_vocabulary_sized_tensor():
    """At a 32k vocabulary, nothing of (tokens, V) elements is saved for backward: the gradients of the student's
    hidden states (M, H), head weight (V, H) and bias (V,), computed in the forward, are all it keeps."""
    vocab, tokens = 32_000, 256
    head = torch.nn.Linear(16, vocab)
    hidden = torch.randn(tokens, 16, requires_grad=True)
    teacher_h, teacher_w = torch.randn(tokens, 24), torch.randn(vocab, 24)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        loss = fused_distillation_loss(
            hidden, head.weight, teacher_h, teacher_w, torch.full((tokens,), 1 / tokens), student_bias=head.bias
        ).loss
    loss.backward()
    assert sorted(saved) == sorted([(tokens, 16), (vocab, 16), (vocab,)]), saved
    assert hidden.grad is not None and head.weight.grad is not None


def test_bfloat16_weights_and_autocast():
    """bf16 weights (the recipes' ``dtype: bfloat16``) and bf16 autocast: the matmuls in bf16, the softmaxes in
    float32; loss and gradients close to float32's, gradients in the parameters' dtypes."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(40, 16), torch.randn(300, 16) * 0.3
    hidden_t, weight_t, weights = torch.randn(40, 24), torch.randn(300, 24) * 0.3, torch.full((40,), 1 / 40)

    def run(h, w, dtype, autocast=False):
        h, w = h.detach().to(dtype).clone().requires_grad_(), w.detach().to(dtype).clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = fused_distillation_loss(h, w, hidden_t.to(dtype), weight_t.to(dtype), weights, beta=0.5).loss
        loss.backward()
        return loss, h.grad, w.grad

    want = run(hidden, weight, torch.float32)
    for got in (run(hidden, weight, torch.bfloat16), run(hidden, weight, torch.float32, autocast=True)):
        assert got[0].dtype == torch.float32 and abs(float(got[0] - want[0])) < 2e-2 * float(want[0])
        for g, w in zip(got[1:], want[1:]):
            assert torch.allclose(g.float(), w, atol=3e-2 * float(w.abs().max()))
    assert run(hidden, weight, torch.bfloat16)[2].dtype == torch.bfloat16
