"""Knowledge distillation of a student LM into a teacher's next-token distribution: the generalized Jensen-Shannon
divergence of GKD (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes", https://arxiv.org/abs/2306.13649, eq. 2), with TRL's ``beta`` convention (TRL 1.16
``DistillationTrainer`` / ``trl.kernels.chunked_divergence``):

- ``beta = 0``: forward KL(teacher || student) = ``sum p_T (log p_T - log p_S)``;
- ``beta = 1``: reverse KL(student || teacher) = ``sum p_S (log p_S - log p_T)``;
- otherwise, with the mixture ``m = beta p_T + (1 - beta) p_S``:
  ``JSD_beta = beta KL(p_T || m) + (1 - beta) KL(p_S || m)`` (``beta = 0.5``: the symmetric JSD).

Both distributions are the softmax of the (post-processed) logits divided by ``temperature`` (no ``T^2`` factor, as
TRL). ``fused_distillation_loss`` computes it over the full vocabulary from the two models' hidden states and LM heads
without keeping any (tokens, vocabulary) tensor: the logits of a chunk of tokens are built, the divergence and its
gradient with respect to the student's logits computed, and the chunk's contribution to the gradients of the student's
hidden states, head weight and bias accumulated at once, in the forward pass (the method of Liger Kernel's fused
linear losses, Hsu et al. 2024, https://arxiv.org/abs/2410.10989): each model's head runs once per token, and the
backward only scales the stored gradients. Pure tensor code: no Lightning or transformers imports. Shapes: M tokens,
H hidden size (the teacher's may differ from the student's), V vocabulary (shared).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from aitraining_pl.losses.fused_head import DEFAULT_MEMORY_BUDGET, _logits

_TEMPORARIES = (
    6  # float32 (chunk, V) buffers live at once in one chunk: both log-softmaxes, both probabilities, two more
)


class DistillationStats(NamedTuple):
    """Per-token statistics of ``fused_distillation_loss`` (each (M,), float32, detached)."""

    divergence: torch.Tensor  #: the generalized JSD at ``beta`` (the loss's per-token term)
    forward_kl: torch.Tensor  #: KL(teacher || student)
    reverse_kl: torch.Tensor  #: KL(student || teacher)
    agreement: torch.Tensor  #: 1.0 where the student's and the teacher's argmax tokens agree
    teacher_logps: torch.Tensor  #: the teacher's log-prob of each target token (0 without targets)
    student_logps: torch.Tensor  #: the student's log-prob of each target token (0 without targets)


class DistillationOutput(NamedTuple):
    loss: torch.Tensor  #: scalar ``sum_t weights_t * divergence_t`` (differentiable in the student's inputs)
    stats: DistillationStats


def generalized_jsd(student_logps: torch.Tensor, teacher_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-row generalized JSD (GKD eq. 2, TRL's ``beta``) of two log-softmax tensors (..., V) -> (...).

    ``beta = 0`` is KL(teacher || student), ``beta = 1`` KL(student || teacher), else ``beta KL(p_T || m) + (1 - beta)
    KL(p_S || m)`` with ``m = beta p_T + (1 - beta) p_S``. Differentiable (autograd); a reference for the fused form."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    p_s, p_t = student_logps.exp(), teacher_logps.exp()
    if beta == 0.0:
        return (p_t * (teacher_logps - student_logps)).sum(-1)
    if beta == 1.0:
        return (p_s * (student_logps - teacher_logps)).sum(-1)
    log_m = torch.logaddexp(teacher_logps + math.log(beta), student_logps + math.log(1 - beta))
    return beta * (p_t * (teacher_logps - log_m)).sum(-1) + (1 - beta) * (p_s * (student_logps - log_m)).sum(-1)


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(C,) ``(a * b).sum(-1)`` of two (C, V) tensors without a (C, V) temporary (a batched matrix-vector product)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _divergence_and_grad(log_ps: torch.Tensor, log_pt: torch.Tensor, beta: float, with_grad: bool):
    """One chunk: (divergence, forward KL, reverse KL, d divergence / d student logits or None) from the two
    log-softmaxes (C, V), which it may overwrite. The gradient is with respect to the temperature-scaled logits ``y``
    (``log_ps = log_softmax(y)``): ``p_S - p_T`` at ``beta = 0``; ``p_S (log p_S - log p_T - KL(p_S || p_T))`` at
    ``beta = 1``; else ``(1 - beta) p_S (log p_S - log m - KL(p_S || m))`` (the derivative of GKD eq. 2 through the
    softmax). At most four more (C, V) buffers are live at once: the probabilities, and two for differences."""
    p_s, p_t = log_ps.exp(), log_pt.exp()
    work = torch.sub(log_ps, log_pt)  # log p_S - log p_T
    reverse, forward = _rowdot(p_s, work), -_rowdot(p_t, work)
    if beta == 0.0:
        return forward, forward, reverse, p_s.sub_(p_t) if with_grad else None
    if beta == 1.0:
        return reverse, forward, reverse, work.sub_(reverse.unsqueeze(-1)).mul_(p_s) if with_grad else None
    log_m = torch.add(log_pt, math.log(beta))  # log m = logaddexp(log p_T + log beta, log p_S + log(1 - beta))
    torch.logaddexp(log_m, work.copy_(log_ps).add_(math.log(1 - beta)), out=log_m)
    student = work.copy_(log_ps).sub_(log_m)  # log p_S - log m
    kl_student = _rowdot(p_s, student)
    kl_teacher = _rowdot(p_t, log_m.neg_().add_(log_pt))  # KL(p_T || m)
    divergence = beta * kl_teacher + (1 - beta) * kl_student
    grad = student.sub_(kl_student.unsqueeze(-1)).mul_(p_s).mul_(1 - beta) if with_grad else None
    return divergence, forward, reverse, grad


def _raw_grad(grad: torch.Tensor, z: torch.Tensor, scale: float, softcap: float | None, temperature: float):
    """d/dz of a loss whose gradient with respect to ``y = post(z) / temperature`` is ``grad`` (in place);
    ``post(z) = cap tanh(scale z / cap)`` or ``scale z`` (``fused_head``'s logit post-processing)."""
    if temperature != 1.0:
        grad /= temperature
    if softcap:
        grad *= z.mul(scale / softcap).tanh_().square_().neg_().add_(1)
    if scale != 1.0:
        grad *= scale
    return grad


def _project(hidden, weight, bias, post: tuple[float, float | None], temperature: float, keep_z: bool):
    """(y, z): the post-processed, temperature-scaled logits (float32 at least) of ``hidden`` (C, H), and the raw
    ones (a tensor of their own when ``keep_z``, else None)."""
    raw = F.linear(hidden, weight, bias)
    z = raw.to(torch.promote_types(raw.dtype, torch.float32))
    y = _logits(z, post[0], post[1], temperature, keep_z=keep_z)
    return y, (z if keep_z else None)


class _FusedDistillation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, weights, targets, config):
        beta, temperature, s_post, t_post, chunk, grad_enabled = config
        need_h, need_w, need_b = (grad_enabled and need for need in ctx.needs_input_grad[:3])
        with_grad = need_h or need_w or need_b
        acc = torch.promote_types(s_hidden.dtype, torch.float32)
        grad_h = torch.zeros_like(s_hidden) if need_h else None
        grad_w = torch.zeros(s_weight.shape, dtype=acc, device=s_weight.device) if need_w else None
        grad_b = torch.zeros(s_bias.shape, dtype=acc, device=s_bias.device) if need_b else None
        stats, loss = [], s_hidden.new_zeros((), dtype=acc)
        keep_z = bool(s_post[1]) and with_grad  # the soft-cap's derivative needs the raw logits
        for start in range(0, s_hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            h = s_hidden[rows]
            y_s, z_s = _project(h, s_weight, s_bias, s_post, temperature, keep_z)
            top_s, log_ps = y_s.argmax(-1), y_s.log_softmax(-1)
            del y_s
            y_t, _ = _project(t_hidden[rows], t_weight, t_bias, t_post, temperature, False)
            agree, log_pt = (top_s == y_t.argmax(-1)).to(acc), y_t.log_softmax(-1)
            del y_t
            if targets is not None:
                index = targets[rows].unsqueeze(-1)
                target_t, target_s = log_pt.gather(-1, index).squeeze(-1), log_ps.gather(-1, index).squeeze(-1)
            else:
                target_t = target_s = agree.new_zeros(agree.shape)
            divergence, forward, reverse, grad = _divergence_and_grad(log_ps, log_pt, beta, with_grad)
            w = weights[rows].to(acc)
            loss = loss + (w * divergence).sum()
            stats.append(torch.stack([divergence, forward, reverse, agree, target_t, target_s]))
            del log_ps, log_pt
            if with_grad:
                grad = _raw_grad(grad.mul_(w.unsqueeze(-1)), z_s, s_post[0], s_post[1], temperature)
                grad = grad.to(h.dtype) if h.dtype != acc else grad
                if need_h:
                    grad_h[rows] = grad @ s_weight.to(grad.dtype)
                if need_w:
                    grad_w.addmm_(grad.t().to(acc), h.to(acc))
                if need_b:
                    grad_b += grad.sum(0).to(acc)
                del grad, z_s  # before the next chunk's buffers are allocated
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (s_weight.dtype, None if s_bias is None else s_bias.dtype)
        stats = torch.cat(stats, 1) if stats else s_hidden.new_zeros(6, 0, dtype=acc)
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, g_loss, g_stats):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        scale = lambda g, dtype: None if g is None else (g * g_loss).to(dtype)  # noqa: E731
        return (
            scale(grad_h, grad_h.dtype if grad_h is not None else None),
            scale(grad_w, w_dtype),
            scale(grad_b, b_dtype),
            *(None,) * 6,
        )


def distillation_chunk_rows(vocab_size: int, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> int:
    """Tokens per chunk so that one chunk's float32 (chunk, V) buffers fit ``memory_budget`` bytes (at least 1)."""
    return max(1, int(memory_budget) // (_TEMPORARIES * 4 * int(vocab_size)))


def fused_distillation_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    weights: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    targets: torch.Tensor | None = None,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    student_post: tuple[float, float | None] = (1.0, None),
    teacher_post: tuple[float, float | None] = (1.0, None),
    chunk_size: int | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> DistillationOutput:
    """``sum_t weights_t * JSD_beta(p_T(. | t) || p_S(. | t))`` over the full vocabulary, from hidden states and heads.

    Equal to ``(weights * generalized_jsd(log_softmax(student logits / T), log_softmax(teacher logits / T),
    beta)).sum()`` but computed ``chunk_size`` tokens at a time: no (M, V) tensor is kept (see the module docstring).
    Gradients flow to the student's hidden states, head weight and bias only (the teacher's inputs are constants).
    Under autocast the matmuls run in the autocast dtype, the softmaxes in float32.

    Args:
        student_hidden: (M, H_S) student hidden states predicting the M scored tokens.
        student_weight: (V, H_S) student head weight; ``student_bias`` (V,) or None.
        teacher_hidden: (M, H_T) teacher hidden states at the same positions.
        teacher_weight: (V, H_T) teacher head weight; ``teacher_bias`` (V,) or None.
        weights: (M,) weight of each token's divergence (e.g. ``1 / number of tokens`` for the token mean).
        beta: 0 forward KL, 1 reverse KL, in between the generalized JSD (TRL's convention).
        temperature: both models' logits are divided by it.
        targets: (M,) token ids whose log-probs under both models are returned in the stats (the sampled tokens).
        student_post, teacher_post: ``(scale, softcap)`` each model's forward applies to its head's output
            (``models.lm_head.logit_postprocessing``).
        chunk_size: tokens per chunk; default from ``memory_budget`` (``distillation_chunk_rows``).

    Returns:
        ``DistillationOutput(loss, DistillationStats)``.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if student_hidden.dim() != 2 or teacher_hidden.shape[0] != student_hidden.shape[0]:
        raise ValueError(f"hidden states must be (M, H): {tuple(student_hidden.shape)}, {tuple(teacher_hidden.shape)}")
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"vocabularies differ: student {student_weight.shape[0]}, teacher {teacher_weight.shape[0]}")
    chunk = int(chunk_size) if chunk_size else distillation_chunk_rows(student_weight.shape[0], memory_budget)
    teacher = [t.detach() if t is not None else None for t in (teacher_hidden, teacher_weight, teacher_bias)]
    config = (float(beta), float(temperature), student_post, teacher_post, max(1, chunk), torch.is_grad_enabled())
    loss, stats = _FusedDistillation.apply(
        student_hidden, student_weight, student_bias, *teacher, weights.detach(), targets, config
    )
    return DistillationOutput(loss, DistillationStats(*stats.unbind(0)))
