"""The chunked head (``fused_head_logps``) against the unchunked computation, and what it saves for backward."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from aitraining_pl.losses import chunk_rows, fused_head_logps
from aitraining_pl.losses import fused_head as fused_head_module
from aitraining_pl.losses.fused_head import _TEMPORARIES, DEFAULT_MEMORY_BUDGET, device_memory_budget

M, H, V = 50, 16, 97  # 50 positions in chunks of 7: the last chunk is short
POST = {  # name: (scale, softcap, temperature)
    "plain": (1.0, None, 1.0),
    "granite_divide": (1 / 4.0, None, 1.0),
    "cohere_multiply": (0.0625, None, 1.0),
    "falcon_multiplier": (2.5, None, 1.0),
    "gemma_softcap": (1.0, 5.0, 1.0),
    "scale_softcap_temperature": (1.5, 4.0, 0.7),
    "temperature": (1.0, None, 1.3),
}


def reference(hidden, weight, targets, bias=None, scale=1.0, softcap=None, temperature=1.0):
    """The unchunked computation: full (M, V) logits, then log-softmax and entropy ``-sum p log p`` in float32."""
    logits = F.linear(hidden, weight, bias).float() * scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    log_p = F.log_softmax(logits / temperature, dim=-1)
    return log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def _inputs(seed=0, bias=True, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(M, H, generator=g) * spread).requires_grad_()
    weight = torch.randn(V, H, generator=g).requires_grad_()
    b = torch.randn(V, generator=g).requires_grad_() if bias else None
    targets = torch.randint(0, V, (M,), generator=g)
    upstream = torch.randn(M, generator=g), torch.randn(M, generator=g)
    return hidden, weight, b, targets, upstream


def _values_and_grads(fn, leaves, upstream):
    """Both outputs, and the gradients of ``sum(u1 * logps) + sum(u2 * entropy)`` w.r.t. ``leaves``."""
    logps, entropy = fn()
    loss = (logps * upstream[0]).sum() + (entropy * upstream[1]).sum()
    return (logps.detach(), entropy.detach()), torch.autograd.grad(loss, leaves)


def _assert_close(a, b, rtol=1e-4, atol=1e-5):
    """Close to float32 tolerance; ``atol`` relative to the largest entry (sums over positions reorder)."""
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol * max(1.0, float(y.abs().max())))


@pytest.mark.parametrize("post", list(POST))
def test_equals_unchunked_values_and_gradients(post):
    scale, softcap, temperature = POST[post]
    hidden, weight, bias, targets, upstream = _inputs()
    leaves = (hidden, weight, bias)

    def fused():
        return fused_head_logps(
            hidden,
            weight,
            targets,
            bias,
            scale=scale,
            softcap=softcap,
            temperature=temperature,
            with_entropy=True,
            chunk_size=7,
        )

    def ref():
        return reference(hidden, weight, targets, bias, scale, softcap, temperature)

    values, grads = _values_and_grads(fused, leaves, upstream)
    ref_values, ref_grads = _values_and_grads(ref, leaves, upstream)
    _assert_close(values, ref_values)
    _assert_close(grads, ref_grads)
    if softcap:  # the soft-cap is active: the capped logits differ from the uncapped ones
        raw = F.linear(hidden, weight, bias) * scale
        assert raw.abs().max() > softcap


def test_gradcheck_float64_every_post_processing_at_once():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 4, dtype=torch.float64, generator=g).requires_grad_()
    weight = torch.randn(11, 4, dtype=torch.float64, generator=g).requires_grad_()
    bias = torch.randn(11, dtype=torch.float64, generator=g).requires_grad_()
    targets = torch.randint(0, 11, (5,), generator=g)

    def fn(h, w, b):
        out = fused_head_logps(
            h, w, targets, b, scale=1.7, softcap=2.0, temperature=0.8, with_entropy=True, chunk_size=2
        )
        return out.logps, out.entropy

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


@pytest.mark.parametrize("use", ["logps", "entropy"])
def test_gradient_of_one_output_alone(use):
    hidden, weight, bias, targets, _ = _inputs(seed=2)
    out = fused_head_logps(hidden, weight, targets, bias, with_entropy=True, chunk_size=9)
    ref = dict(zip(["logps", "entropy"], reference(hidden, weight, targets, bias)))
    grads = torch.autograd.grad(getattr(out, use).sum(), (hidden, weight, bias))
    _assert_close(grads, torch.autograd.grad(ref[use].sum(), (hidden, weight, bias)))


def test_without_entropy_returns_none_and_same_logps():
    hidden, weight, _, targets, _ = _inputs(seed=3, bias=False)
    out = fused_head_logps(hidden, weight, targets, chunk_size=13)
    assert out.entropy is None
    torch.testing.assert_close(out.logps, reference(hidden, weight, targets)[0])
    grads = torch.autograd.grad(out.logps.sum(), (hidden, weight))
    _assert_close(grads, torch.autograd.grad(reference(hidden, weight, targets)[0].sum(), (hidden, weight)))


def test_tied_head_gradients_reach_the_embedding():
    """The head weight is the input embedding: both uses contribute to its gradient."""
    g = torch.Generator().manual_seed(4)
    embedding = torch.randn(V, H, generator=g).requires_grad_()
    mix = torch.randn(H, H, generator=g).requires_grad_()
    ids, targets = torch.randint(0, V, (M,), generator=g), torch.randint(0, V, (M,), generator=g)
    upstream = torch.randn(M, generator=g), torch.randn(M, generator=g)

    def run(fused):
        hidden = torch.tanh(embedding[ids] @ mix)
        if fused:
            out = fused_head_logps(hidden, embedding, targets, with_entropy=True, chunk_size=8)
            return out.logps, out.entropy
        return reference(hidden, embedding, targets)

    values, grads = _values_and_grads(lambda: run(True), (embedding, mix), upstream)
    ref_values, ref_grads = _values_and_grads(lambda: run(False), (embedding, mix), upstream)
    _assert_close(values, ref_values)
    _assert_close(grads, ref_grads)


def test_lora_head_non_leaf_weight():
    """``W0 + s * B @ A`` with a frozen W0: gradients flow through the merged weight to A and B."""
    hidden, base, _, targets, upstream = _inputs(seed=5, bias=False)
    base = base.detach()
    g = torch.Generator().manual_seed(6)
    lora_a = (torch.randn(4, H, generator=g) * 0.1).requires_grad_()
    lora_b = (torch.randn(V, 4, generator=g) * 0.1).requires_grad_()

    def run(fused):
        weight = base + 2.0 * lora_b @ lora_a
        if fused:
            out = fused_head_logps(hidden, weight, targets, with_entropy=True, chunk_size=11)
            return out.logps, out.entropy
        return reference(hidden, weight, targets)

    leaves = (hidden, lora_a, lora_b)
    values, grads = _values_and_grads(lambda: run(True), leaves, upstream)
    ref_values, ref_grads = _values_and_grads(lambda: run(False), leaves, upstream)
    _assert_close(values, ref_values)
    _assert_close(grads, ref_grads)
    assert all(g.abs().sum() > 0 for g in grads)


def test_bf16_autocast_matches_unchunked():
    """Under bf16 autocast the matmul runs in bf16 and the logsumexp in float32; gradients keep the inputs' dtype."""
    hidden, weight, bias, targets, upstream = _inputs(seed=7, spread=1.0)
    leaves = (hidden, weight, bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        values, grads = _values_and_grads(
            lambda: fused_head_logps(
                hidden, weight, targets, bias, scale=0.5, softcap=6.0, with_entropy=True, chunk_size=6
            ),
            leaves,
            upstream,
        )
        ref_values, ref_grads = _values_and_grads(
            lambda: reference(hidden, weight, targets, bias, 0.5, 6.0), leaves, upstream
        )
    assert values[0].dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    _assert_close(values, ref_values, rtol=2e-2, atol=2e-2)
    _assert_close(grads, ref_grads, rtol=5e-2, atol=5e-2)
    fp32_values, _ = _values_and_grads(lambda: reference(hidden, weight, targets, bias, 0.5, 6.0), leaves, upstream)
    _assert_close(values, fp32_values, rtol=5e-2, atol=5e-2)  # bf16 rounding only, not a different function


def test_chunk_size_from_memory_budget():
    assert chunk_rows(32000, memory_budget=32000 * 4 * 2 * 10) == 10  # two float32 buffers of 10 rows
    assert chunk_rows(152000, memory_budget=1) == 1
    hidden, weight, bias, targets, _ = _inputs(seed=8)
    budgeted = fused_head_logps(hidden, weight, targets, bias, memory_budget=V * 4 * 2 * 3)  # 3 positions a chunk
    torch.testing.assert_close(budgeted.logps, reference(hidden, weight, targets, bias)[0])


class _Matmuls(TorchDispatchMode):
    """Counts the matrix products run (one per chunk in a no-grad forward)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def test_chunk_budget_per_device(monkeypatch):
    """96 MiB on a CPU, 1 GiB on CUDA (a stub device: only its type is read), and the default chunk follows the
    budget of the hidden states' device."""
    assert device_memory_budget("cpu") == DEFAULT_MEMORY_BUDGET == 96 * 2**20
    assert device_memory_budget(torch.device("cuda", 1)) == 2**30
    assert chunk_rows(152_000, device_memory_budget("cpu")) == 82
    assert chunk_rows(152_000, device_memory_budget("cuda")) == 883
    hidden, weight, bias, targets, _ = _inputs(seed=8)
    monkeypatch.setitem(fused_head_module.MEMORY_BUDGETS, "cpu", V * 4 * _TEMPORARIES * 7)  # 7 positions a chunk
    with torch.no_grad(), _Matmuls() as matmuls:
        logps = fused_head_logps(hidden, weight, targets, bias).logps
    assert matmuls.calls == -(-M // 7)
    torch.testing.assert_close(logps, reference(hidden, weight, targets, bias)[0])


def test_weight_gradient_accumulates_in_float32():
    """bf16 autocast over many chunks: the head's weight gradient is the float64 gradient of a plain log-softmax
    over the same bf16 logits to float32 precision. Each chunk's product rounded to bf16 before it is added (the
    earlier code) is off by about 2e-3."""
    g = torch.Generator().manual_seed(11)
    rows, chunk = 256, 4
    hidden = torch.randn(rows, H, generator=g)
    weight = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
    targets, upstream = torch.randint(0, V, (rows,), generator=g), torch.randn(rows, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logps = fused_head_logps(hidden, weight, targets, chunk_size=chunk).logps
    (grad,) = torch.autograd.grad((logps * upstream).sum(), weight)
    h, w = hidden.bfloat16(), weight.detach().bfloat16()
    logits = torch.cat([F.linear(h[i : i + chunk], w) for i in range(0, rows, chunk)]).double().requires_grad_()
    (dz,) = torch.autograd.grad((F.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0] * upstream).sum(), logits)
    want = dz.t() @ h.double()
    assert grad.dtype == torch.float32
    assert float((grad.double() - want).norm() / want.norm()) < 1e-5


def test_rejects_bad_shapes():
    hidden, weight, _, targets, _ = _inputs()
    with pytest.raises(ValueError, match="targets"):
        fused_head_logps(hidden, weight, targets[:-1])


def _saved_shapes(run):
    """Shapes and data pointers of every tensor saved for backward while ``run()`` builds its graph."""
    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.data_ptr()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return saved


def test_no_vocabulary_sized_tensor_saved_for_backward():
    """Structural memory test (times nothing): at a 32k vocabulary the only saved tensor with a vocabulary-sized
    dimension is the head weight itself; the unchunked computation saves (M, V) logits, which the check catches."""
    vocab, rows = 32000, 300
    g = torch.Generator().manual_seed(9)
    body = torch.nn.Linear(H, H)
    weight = torch.nn.Parameter(torch.randn(vocab, H, generator=g) * 0.1)
    x, targets = torch.randn(rows, H, generator=g), torch.randint(0, vocab, (rows,), generator=g)

    def fused():
        out = fused_head_logps(torch.tanh(body(x)), weight, targets, with_entropy=True, chunk_size=64)
        return out.logps.sum() + out.entropy.sum()

    def offenders(shapes):
        return [shape for shape, ptr in shapes if vocab in shape and ptr != weight.data_ptr()]

    saved = _saved_shapes(fused)
    assert saved and offenders(saved) == []
    assert not any(rows in shape and vocab in shape for shape, _ in saved)
    assert offenders(_saved_shapes(lambda: reference(torch.tanh(body(x)), weight, targets)[0].sum()))


class _LiveBuffers(TorchDispatchMode):
    """Counts the (rows, vocab) tensors alive at once (rows > 1) that operators allocate, views and in-place
    results aside: the chunk's logits buffers, whatever names they go by."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.live, self.peak = vocab, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):  # a view, or an in-place / out= result
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] > 1 and t.shape[1] == self.vocab:
                self.live[id(t)] = weakref.finalize(t, self.live.pop, id(t), None)
                self.peak = max(self.peak, len(self.live))
        return out


@pytest.mark.parametrize(("with_entropy", "buffers"), [(False, 1), (True, 2)])
def test_each_chunk_is_worked_on_in_place(with_entropy, buffers):
    """Structural memory test (times nothing): forward and backward hold at most one float32 (chunk, V) buffer at
    a time without the entropy, two with it (``_TEMPORARIES``), whatever the chunk count."""
    vocab, rows, chunk = 4000, 64, 16
    g = torch.Generator().manual_seed(10)
    hidden = torch.randn(rows, H, generator=g).requires_grad_()
    weight = (torch.randn(vocab, H, generator=g) * 0.1).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g)
    counter = _LiveBuffers(vocab)
    with counter:
        out = fused_head_logps(hidden, weight, targets, with_entropy=with_entropy, chunk_size=chunk)
        loss = out.logps.sum() + (out.entropy.sum() if with_entropy else 0)
        loss.backward()
    assert counter.peak == buffers <= _TEMPORARIES
    with _LiveBuffers(vocab) as unchunked:  # the counter sees the (M, V) logits and their softmax temporaries
        reference(hidden, weight, targets)[0].sum().backward()
    assert unchunked.peak > buffers


@pytest.mark.parametrize("post", ["plain", "temperature", "gemma_softcap"])
def test_a_single_chunk_keeps_its_log_probs_for_backward(post, monkeypatch):
    """All positions in one chunk, with the entropy: the backward uses the forward's log-probabilities instead of
    running the head again (one head matmul in all, against two with more chunks or a soft-cap, whose derivative
    needs the raw logits), with the same values and gradients as the unchunked computation, and no more (chunk, V)
    buffers alive at once than before (two; three with the soft-cap)."""
    scale, softcap, temperature = POST[post]
    hidden, weight, bias, targets, upstream = _inputs()
    calls = []
    linear = F.linear
    monkeypatch.setattr(F, "linear", lambda *a, **k: calls.append(1) or linear(*a, **k))

    def fused(chunk):
        return lambda: fused_head_logps(
            hidden, weight, targets, bias, scale=scale, softcap=softcap, temperature=temperature, with_entropy=True,
            chunk_size=chunk,
        )  # fmt: skip

    leaves = (hidden, weight, bias)
    values, grads = _values_and_grads(fused(M), leaves, upstream)
    assert len(calls) == (2 if softcap else 1)
    calls.clear()
    _values_and_grads(fused(M - 1), leaves, upstream)
    assert len(calls) == 4  # two chunks, each run again in backward
    monkeypatch.setattr(F, "linear", linear)
    ref_values, ref_grads = _values_and_grads(
        lambda: reference(*leaves[:2], targets, bias, *POST[post]), leaves, upstream
    )
    _assert_close(values, ref_values)
    _assert_close(grads, ref_grads)
    with _LiveBuffers(V) as counter:
        out = fused(M)()
        (out.logps.sum() + out.entropy.sum()).backward()
    assert counter.peak == _TEMPORARIES + bool(softcap)  # the soft-cap's raw logits: a third, as before
