"""Token log-probs (and entropy) through the language-model head without ever holding vocabulary-sized logits.

The head (``hidden @ weight.T + bias``), the model's logit post-processing and the log-softmax run over chunks of
positions; the backward pass recomputes each chunk's logits instead of storing them, so the extra memory is one
chunk's logits whatever the number of positions. This is the method of fused linear cross-entropy kernels
(Liger Kernel's ``FusedLinearCrossEntropy``, Hsu et al. 2024, https://arxiv.org/abs/2410.10989; Wijmans et al.
2024, "Cut Your Losses in Large-Vocabulary Language Models", https://arxiv.org/abs/2411.09009), written here in
plain PyTorch. Pure tensor code: no Lightning or transformers imports. Shapes: M positions, H hidden size, V
vocabulary.

The logits of one position are ``y = post(hidden @ weight.T + bias) / temperature`` with
``post(z) = cap * tanh(scale * z / cap)`` when a soft-cap is given, else ``scale * z``. That covers Granite
(``logits_scaling``: ``scale = 1 / logits_scaling``), Cohere (``logit_scale``), FalconH1 (``lm_head_multiplier``)
and Gemma 2/3 (``final_logit_softcapping``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

#: default extra memory for one chunk on a CPU (bytes): the float32 (chunk, V) buffers of one chunk's logits. Each
#: chunk's logits are worked on in place (one buffer; two with the entropy or a soft-cap, three with both), so this
#: budget gives each buffer 48 MiB, about the chunk size of the earlier 256 MiB budget over six buffers (43 MiB
#: each), and above glibc malloc's largest mmap threshold (32 MiB), so a freed buffer goes back to the system instead
#: of staying in the heap (a 64 MiB budget over six buffers, 11 MiB each, raised the DPO benchmark's peak RSS at 32k).
DEFAULT_MEMORY_BUDGET = 96 * 2**20
#: the budget on an accelerator (CUDA and the like): every chunk re-reads the whole (V, H) head in forward and twice
#: in backward, so small chunks make the head's bandwidth the cost. 96 MiB at V = 152k is 82 rows a chunk (a 7B
#: head of 1.1 GB read 100 times for 8k positions); 1 GiB is 883 rows, against a caching allocator that reuses the
#: freed buffers, and still a few percent of a training GPU's memory.
ACCELERATOR_MEMORY_BUDGET = 2**30
#: device type -> default chunk budget (bytes); a device type not listed gets ``ACCELERATOR_MEMORY_BUDGET``
MEMORY_BUDGETS = {"cpu": DEFAULT_MEMORY_BUDGET}
_TEMPORARIES = 2  # float32 (chunk, V) buffers the budget provides for


def device_memory_budget(device: torch.device | str) -> int:
    """Default bytes for one chunk's temporaries on ``device`` (``MEMORY_BUDGETS``, else the accelerator budget)."""
    return MEMORY_BUDGETS.get(torch.device(device).type, ACCELERATOR_MEMORY_BUDGET)


class HeadLogps(NamedTuple):
    logps: torch.Tensor  #: (M,) log-probability of each target, float32 (float64 for float64 inputs)
    entropy: torch.Tensor | None  #: (M,) entropy of each position's distribution in nats, or None


def chunk_rows(vocab_size: int, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> int:
    """Positions per chunk so that one chunk's float32 temporaries fit ``memory_budget`` bytes (at least 1)."""
    return max(1, int(memory_budget) // (_TEMPORARIES * 4 * int(vocab_size)))


def _logits(z: torch.Tensor, scale: float, softcap: float | None, temperature: float, keep_z: bool) -> torch.Tensor:
    """Post-processed logits ``y`` from the raw head output ``z`` (float32 or float64), written over ``z`` unless
    ``keep_z`` (then into one new buffer)."""
    if keep_z:
        y = z * scale if scale != 1.0 else z.clone()
    else:
        y = z.mul_(scale) if scale != 1.0 else z
    if softcap:
        y.div_(softcap).tanh_().mul_(softcap)
    return y.div_(temperature) if temperature != 1.0 else y


def _logsumexp_(y: torch.Tensor) -> torch.Tensor:
    """(C,) ``logsumexp`` over the last dimension of ``y`` (C, V), as ``torch.logsumexp`` computes it (max, then
    the log of the sum of shifted exponentials), but overwriting ``y`` instead of allocating (C, V) temporaries."""
    top = y.amax(-1, keepdim=True)
    top.masked_fill_(~torch.isfinite(top), 0.0)  # an all -inf (or +inf) row: no shift, as torch.logsumexp
    return y.sub_(top).exp_().sum(-1).log_().add_(top.squeeze(-1))


def _chunk_stats(y: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
    """(logps, logsumexp, entropy or None) of one chunk's post-processed logits ``y`` (C, V), which it overwrites:
    with the entropy ``y`` holds the chunk's log-probabilities ``log_softmax`` afterwards.

    One (C, V) buffer, ``y`` itself, without the entropy; a second one with it."""
    target = y.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        lse = _logsumexp_(y)
        return target - lse, lse, None
    work = y.clone()
    lse = _logsumexp_(work)
    log_p = y.sub_(lse.unsqueeze(-1))
    return target - lse, lse, _entropy_(log_p, torch.exp(log_p, out=work))


def _entropy_(log_p: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``-sum p log p`` from log-probabilities and probabilities (no ``lse - E[y]`` cancellation for large logits);
    overwrites ``p``."""
    return p.mul_(log_p).sum(-1).neg_()


def _grad_raw(y, z, targets, lse, entropy, g_logp, g_ent, scale, softcap, temperature, normalized=False):
    """d(loss)/dz of one chunk: chain rule through log-softmax / entropy, temperature, soft-cap and scale.

    ``entropy`` (C,) is the forward's (used only with ``g_ent``). Works in place: the gradient is written over
    ``y`` (C, V), a second buffer holds the probabilities when the entropy has a gradient, and the soft-cap's
    derivative is written over ``z`` (a tensor of its own then). ``normalized``: ``y`` already holds the
    log-probabilities (the forward's, kept for a single chunk)."""
    log_p = y if normalized else y.sub_(lse.unsqueeze(-1))
    if g_ent is None:  # dlogp_t/dl = onehot(t) - p, times g_logp
        grad = log_p.exp_().mul_(-g_logp.unsqueeze(-1)) if g_logp is not None else log_p.zero_()
    else:  # dH/dl = -p * (log p + H): grad = -p * (g_logp + g_ent * (log p + H)) + onehot(t) * g_logp
        p = log_p.exp()
        grad = log_p.add_(entropy.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1))
        if g_logp is not None:
            grad.add_(g_logp.unsqueeze(-1))
        grad = grad.mul_(p).neg_()
        del p
    if g_logp is not None:
        grad.scatter_add_(-1, targets.unsqueeze(-1), g_logp.unsqueeze(-1))
    if temperature != 1.0:
        grad /= temperature
    if softcap:  # d(cap tanh(y / cap))/dy = 1 - tanh^2
        grad *= z.mul_(scale / softcap).tanh_().square_().neg_().add_(1)
    if scale != 1.0:
        grad *= scale
    return grad


def _accumulate(grad_w: torch.Tensor, grad: torch.Tensor, low: torch.Tensor | None, h: torch.Tensor) -> None:
    """``grad_w += grad.T @ h`` with no rounding below ``grad_w``'s float32 (float64) between chunks.

    ``grad`` (C, V) is the chunk's float32 (float64) logit gradient, ``low`` the same in the compute dtype (or None
    off CUDA), ``h`` (C, H) the hidden states in the compute dtype. In ``grad_w``'s dtype the product goes straight
    into it. A bfloat16 / float16 ``h`` on CUDA runs the
    product in its own dtype and accumulates it in float32 in the same kernel (``addmm``'s ``out_dtype``: no (V, H)
    temporary, no per-chunk rounding); elsewhere (CPU, no such kernel) in float32."""
    if h.dtype == grad_w.dtype:
        grad_w.addmm_(grad.t(), h)
        return
    if h.device.type == "cuda":
        try:
            torch.ops.aten.addmm.dtype_out(grad_w, low.t(), h, grad_w.dtype, out=grad_w)
            return
        except (RuntimeError, NotImplementedError):  # a torch without the mixed-dtype kernel: the float32 path
            pass
    grad_w.addmm_(grad.to(grad_w.dtype).t(), h.to(grad_w.dtype))


class _FusedHeadLogps(torch.autograd.Function):
    """The forward keeps the log-probabilities of a single chunk (all positions within ``chunk``, with the entropy,
    no soft-cap) for the backward, which then does not run the head again: the buffer the backward would have
    recomputed, held from the forward instead (within the one chunk's budget). More chunks are recomputed."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, softcap, temperature, chunk, with_entropy):
        logps, lses, entropies = [], [], []
        compute_dtype = hidden.dtype
        keep = hidden.shape[0] <= chunk and with_entropy and not softcap and any(ctx.needs_input_grad[:3])
        ctx.log_p = None
        for start in range(0, hidden.shape[0], chunk):
            raw = F.linear(hidden[start : start + chunk], weight, bias)  # autocast picks the matmul dtype
            compute_dtype = raw.dtype
            z = raw.to(torch.promote_types(raw.dtype, torch.float32))  # logsumexp in float32 at least
            del raw
            lp, lse, ent = _chunk_stats(
                _logits(z, scale, softcap, temperature, keep_z=False), targets[start : start + chunk], with_entropy
            )
            logps.append(lp), lses.append(lse), entropies.append(ent)
            if keep:
                ctx.log_p = z  # the chunk's log-probabilities (``_chunk_stats``)
            del z  # before the next chunk's buffer is allocated
        acc = torch.promote_types(hidden.dtype, torch.float32)
        logps = torch.cat(logps) if logps else hidden.new_zeros(0, dtype=acc)
        lse = torch.cat(lses) if lses else hidden.new_zeros(0, dtype=acc)
        entropy = torch.cat(entropies) if with_entropy and entropies else hidden.new_zeros(0, dtype=acc)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy if with_entropy else None)
        ctx.config = (scale, softcap, temperature, chunk, with_entropy, compute_dtype)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, g_logps, g_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        scale, softcap, temperature, chunk, with_entropy, dtype = ctx.config
        if not with_entropy:
            g_entropy = None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = None  # the first chunk's product, or zeros where it cannot be (``_accumulate``)
        saved, ctx.log_p = ctx.log_p, None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            w, b = weight.to(dtype), bias.to(dtype) if bias is not None else None
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                h = hidden[rows].to(dtype)
                if saved is None:
                    z = F.linear(h, w, b).to(torch.promote_types(dtype, torch.float32))
                    y = _logits(z, scale, softcap, temperature, keep_z=bool(softcap))
                else:  # the forward's log-probabilities of the only chunk
                    z, y, saved = None, saved, None
                grad = _grad_raw(
                    y,
                    z,
                    targets[rows],
                    lse[rows],
                    None if g_entropy is None else entropy[rows],
                    None if g_logps is None else g_logps[rows],
                    None if g_entropy is None else g_entropy[rows],
                    scale,
                    softcap,
                    temperature,
                    normalized=z is None,
                )
                del y, z
                low = grad.to(dtype) if need_h or (need_w and h.is_cuda) else None  # the compute dtype's copy
                if need_h:
                    grad_h[rows] = low @ w
                if need_w and grad_w is None and h.dtype == acc:  # straight into a new buffer, not zeros + it
                    grad_w = grad.t() @ h
                elif need_w:
                    if grad_w is None:
                        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
                    _accumulate(grad_w, grad, low, h)
                if need_b:
                    grad_b += grad.sum(0).to(acc)
                del grad, low  # before the next chunk's buffer is allocated
        if need_w and grad_w is None:  # no positions
            grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def fused_head_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
) -> HeadLogps:
    """Log-probabilities of ``targets`` (and entropies) under ``post(hidden @ weight.T + bias) / temperature``.

    Equal to ``log_softmax(logits)[target]`` on the full logits, but computed ``chunk_size`` positions at a time
    with a backward pass that recomputes each chunk's logits: no (M, V) tensor is ever stored. Gradients flow to
    ``hidden``, ``weight`` and ``bias`` and through them to whatever produced them (tied embeddings, a LoRA-merged
    head ``W + s * B @ A``). Under autocast the matmul runs in the autocast dtype and each chunk's logsumexp in
    float32.

    Args:
        hidden: (M, H) hidden states of the scored positions.
        weight: (V, H) head weight.
        targets: (M,) token ids to score.
        bias: (V,) head bias, or None.
        scale: multiplier applied to the raw logits (Cohere ``logit_scale``, FalconH1 ``lm_head_multiplier``,
            ``1 / logits_scaling`` for Granite).
        softcap: ``cap`` of the ``cap * tanh(logits / cap)`` soft-cap (Gemma 2/3 ``final_logit_softcapping``).
        temperature: sampling temperature dividing the post-processed logits.
        with_entropy: also return each position's entropy (differentiable).
        chunk_size: positions per chunk; default from ``memory_budget`` (``chunk_rows``).
        memory_budget: bytes allowed for one chunk's temporaries when ``chunk_size`` is not given (default:
            ``device_memory_budget(hidden.device)``, 96 MiB on a CPU, 1 GiB on an accelerator).

    Returns:
        ``HeadLogps(logps (M,), entropy (M,) or None)``, float32 (float64 for float64 inputs).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be (M, H) and targets (M,), got {tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if not chunk_size:
        chunk_size = chunk_rows(weight.shape[0], memory_budget or device_memory_budget(hidden.device))
    logps, entropy = _FusedHeadLogps.apply(
        hidden,
        weight,
        bias,
        targets,
        float(scale),
        softcap and float(softcap),
        float(temperature),
        max(1, int(chunk_size)),
        with_entropy,
    )
    return HeadLogps(logps, entropy if with_entropy else None)
