"""Sequence scoring: log-probs of given tokens under a causal LM, padded or packed (``models.packing``).

Used by every module that scores sequences (DPO, PPO and the online-RL family). ``token_logps`` gives the
per-token log-probs of the scored tokens, ``completion_logps`` their sums per row. Three paths, fastest first:

- ``packed``: the rows' real tokens in one row, attention block by block, the LM head only on scored positions;
- ``head``: padded rows through the decoder, the LM head only on scored positions (no (B, L, V) logits);
- ``forward``: the model's own ``forward`` (full logits), always exact.

A fast path is used for a model only where it is proven exact for that model: ``scoring_path`` runs a small
probe batch once per model through each fast path and through the model's own forward, and falls back (packed
-> head -> forward) where they differ beyond a float tolerance or the fast path raises, with one INFO line
saying which path and why. The logit post-processing transformers models do in ``forward`` (Gemma 2/3
``final_logit_softcapping``, Granite ``logits_scaling``, Cohere ``logit_scale``, FalconH1
``lm_head_multiplier``) is applied by ``head_logits``, so those models keep the fast paths.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from aitraining_pl.losses import SequenceLogps
from aitraining_pl.models.lm_head import (  # noqa: F401 - head_logits and TokenScores, also importable from here
    TokenScores,
    head_logits,
    head_scores,
    logits_scores,
)
from aitraining_pl.models.lora import base_model
from aitraining_pl.models.packing import (  # noqa: F401 - the packing helpers, also importable from here
    PACKING_THRESHOLD,
    PackedBatch,
    can_pack,
    is_contiguous,
    pack_batch,
    pack_rows,
    packed_attention,
    packing_pays,
    prompt_lengths,
    supports_packing,
)
from aitraining_pl.models.sequence_parallel import active_group, sequence_parallel_scores
from aitraining_pl.models.sharding import as_forward
from aitraining_pl.models.tokens import padded
from aitraining_pl.models.training import eval_mode
from aitraining_pl.models.vision import VisionInputs
from aitraining_pl.models.vision_scoring import vision_token_scores

log = logging.getLogger(__name__)


def _decoder_and_head(model: nn.Module):
    """(decoder, lm head, config) of a transformers causal LM (through a ``peft`` wrapper), or Nones."""
    lm = base_model(model)
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if decoder is lm or not isinstance(decoder, nn.Module) or not isinstance(head, nn.Module):
        decoder = head = None
    return decoder, head, getattr(lm, "config", None)


@dataclass(frozen=True)
class ScoringPath:
    """Which paths ``token_logps`` may take for a model (see the module docstring)."""

    packed: bool  #: packed attention is exact for this model
    head: bool  #: the decoder plus head-only log-probs are exact for this model
    reason: str  #: why the fastest path is not taken (empty when it is)

    @property
    def name(self) -> str:
        return "packed" if self.packed else "head" if self.head else "forward"


def _run(model: nn.Module, path: str, *args: Any) -> TokenScores:
    """``_scores``; the fast paths call the decoder and the head directly, which FSDP's forward hooks would not
    see, so under FSDP2 they run as a forward of ``model`` (``models.sharding.as_forward``)."""
    if path == "forward":
        return _scores(model, path, *args)
    return as_forward(model, _scores, model, path, *args)


def _scores(
    model: nn.Module,
    path: str,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scored: torch.Tensor,
    position_ids: torch.Tensor | None,
    packed: PackedBatch | None,
    temperature: float,
    with_entropy: bool = False,
    with_hidden: bool = False,
) -> TokenScores:
    """Scores along ``path``: entry [b, t] of (B, L - 1) is for token t + 1 where ``scored[b, t]``, else 0."""
    decoder, head, config = _decoder_and_head(model)
    split = path == "packed" and active_group() is not None  # the row split over the sequence-parallel group
    if split:
        score_head = lambda h, t: head_scores(head, config, h, t, temperature, with_entropy)  # noqa: E731
        token, hidden = sequence_parallel_scores(decoder, config, packed, score_head, with_hidden)
        rows, cols = packed.sequences, packed.columns - 1
    elif path == "packed":
        with packed_attention(config, packed.plan):
            hidden = decoder(
                input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False, packed_plan=packed.plan
            ).last_hidden_state[0, packed.sources]
        targets, rows, cols = packed.targets, packed.sequences, packed.columns - 1
    else:
        rows, cols = torch.nonzero(scored, as_tuple=True)
        targets = input_ids[rows, cols + 1]
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if path == "head":
            hidden = decoder(**kwargs).last_hidden_state[rows, cols]
        else:
            out = model(**kwargs, output_hidden_states=with_hidden)
            hidden = out.hidden_states[-1][rows, cols] if with_hidden else None
            token = logits_scores(out.logits[rows, cols], targets, temperature, with_entropy)
    if path != "forward" and not split:
        token = head_scores(head, config, hidden, targets, temperature, with_entropy)
    place = lambda values: values.new_zeros(scored.shape).index_put((rows, cols), values)  # noqa: E731
    entropy = place(token.entropy) if with_entropy else None
    return TokenScores(place(token.logps), entropy, hidden if with_hidden else None, (rows, cols))


def _probe_batch(config: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """Two right-padded pairs (prompt lengths 3 and 2, completions of different lengths), chosen rows first."""
    generator = torch.Generator().manual_seed(0)
    vocab = int(getattr(config, "vocab_size", 0) or 2)
    pairs = [(3, 2, 4), (2, 3, 1)]  # (prompt, chosen, rejected) lengths
    prompts = [torch.randint(min(3, vocab - 1), vocab, (p,), generator=generator) for p, _, _ in pairs]
    rows = [
        (prompt, torch.randint(min(3, vocab - 1), vocab, (n,), generator=generator))
        for k in (1, 2)
        for prompt, lengths in zip(prompts, pairs)
        for n in [lengths[k]]
    ]
    ids, attention = padded([torch.cat(row) for row in rows], 0, device=device)
    completion, _ = padded([[0] * len(p) + [1] * len(c) for p, c in rows], 0, device=device)
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def _matches(model: nn.Module, path: str, batch: dict[str, torch.Tensor], want: torch.Tensor) -> str:
    """'' when ``path`` reproduces ``want`` on the probe batch, else why not."""
    scored = batch["completion_mask"][:, 1:].bool()
    packed = pack_batch(batch, share_prompt=True) if path == "packed" else None
    try:
        got = _run(model, path, batch["input_ids"], batch["attention_mask"], scored, None, packed, 1.0).logps
    except Exception as err:  # noqa: BLE001 - any failure of a fast path means: do not use it
        return f"the {path} path raised {type(err).__name__}: {err}"
    tolerance = 5e-2 if next(model.parameters()).dtype in (torch.float16, torch.bfloat16) else 1e-4
    if want.is_cuda and torch.get_float32_matmul_precision() != "highest":  # TF32 matmuls: ~1e-3 relative
        tolerance = max(tolerance, 1e-2)
    difference = float((got - want).abs().max())
    if not difference <= tolerance * (1 + float(want.abs().max())):
        return f"the {path} path differs from the model's forward by {difference:.3g}"
    return ""


def _probe(model: nn.Module) -> ScoringPath:
    decoder, head, config = _decoder_and_head(model)
    if decoder is None:
        return ScoringPath(False, False, "no separable decoder and LM head")
    device = next(model.parameters()).device
    batch = _probe_batch(config, device)
    # autocast off: the paths are compared in the parameters' own dtype, not in an enclosing bf16 autocast
    with eval_mode(model), torch.no_grad(), torch.autocast(device.type, enabled=False):
        scored = batch["completion_mask"][:, 1:].bool()
        want = _run(model, "forward", batch["input_ids"], batch["attention_mask"], scored, None, None, 1.0).logps
        head_reason = _matches(model, "head", batch, want)
        if not supports_packing(config):
            packed_reason = (
                f"{type(config).__name__} (attention {getattr(config, '_attn_implementation', None)!r}, "
                "sliding windows, soft-capping or non-attention layers) cannot run packed"
            )
        else:
            packed_reason = _matches(model, "packed", batch, want)
    return ScoringPath(not packed_reason, not head_reason, "; ".join(r for r in (packed_reason, head_reason) if r))


def scoring_path(model: nn.Module) -> ScoringPath:
    """The paths proven exact for ``model`` (probed once per model, attention implementation and dtype)."""
    lm = base_model(model)
    config = getattr(lm, "config", None)
    key = (getattr(config, "_attn_implementation", None), next(lm.parameters()).dtype)
    cache = lm.__dict__.setdefault("_aitraining_scoring_paths", {})
    if key not in cache:
        cache[key] = path = _probe(model)
        log.info(
            "%s: log-probs run on the %s path%s",
            type(lm).__name__,
            path.name,
            f" ({path.reason})" if path.reason else " (exact on the probe batch)",
        )
    return cache[key]


def token_scores(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scored: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    packed: PackedBatch | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_hidden: bool = False,
    vision: VisionInputs | None = None,
) -> TokenScores:
    """Per-token log-probs (and entropies, hidden states) of the scored tokens of each row, through the fastest
    path exact for ``model``; the head runs fused (``models.lm_head``), so no (tokens x vocabulary) logits are
    held where the head allows it. The one scoring entry for text and images: rows with images (``vision``) go to
    ``models.vision_scoring`` (padded rows, each shared prompt run once), every other row through the text paths.

    Args:
        model: a transformers causal LM (optionally wrapped by ``peft``).
        input_ids: (B, L) tokens.
        attention_mask: (B, L), right or left padded.
        scored: (B, L) which tokens to score (token t is predicted from position t - 1; column 0 never is).
        position_ids: (B, L) positions, e.g. for left-padded rows (default: the model's own).
        packed: the batch packed by ``pack_batch`` / ``pack_rows`` (its scored tokens must be ``scored``'s); used
            where the packed path is exact for the model, else the rows run padded.
        temperature: logits are divided by it (the sampling temperature of a rollout).
        with_entropy: also the entropy of each scored token's predicting distribution (differentiable).
        with_hidden: also the last hidden states at the positions predicting the scored tokens (a value head's
            input).
        vision: each row's images (``models.vision.VisionInputs``) for a VL model; such rows are never packed
            (``packed`` must be None) and take the positions the model lays out for its images.

    Returns:
        ``TokenScores``: (B, L - 1) entries [b, t] for token t + 1 where ``scored[b, t + 1]``, else 0.
    """
    if vision is not None:
        if packed is not None:
            raise ValueError("rows with images cannot be packed: pass packed=None with vision")
        return vision_token_scores(model, input_ids, attention_mask, scored, vision, temperature, with_entropy,
                                   with_hidden)  # fmt: skip
    path = scoring_path(model)
    if packed is None and path.packed and attention_mask is not None and active_group() is not None:
        packed = _packed_rows(input_ids, attention_mask, scored)  # split over the sequence-parallel group
    name = "packed" if packed is not None and path.packed else "head" if path.head else "forward"
    return _run(
        model,
        name,
        input_ids,
        attention_mask,
        scored[:, 1:].bool(),
        position_ids,
        packed,
        temperature,
        with_entropy,
        with_hidden,
    )


def _packed_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, scored: torch.Tensor) -> PackedBatch | None:
    """The rows packed one block each (``pack_rows``) where each row's real tokens are one run and every scored
    token follows a real one, else None (the rows then run padded, whole on every rank)."""
    real = attention_mask.bool()
    column = torch.arange(real.shape[1], device=real.device)
    first, count = real.long().argmax(1, keepdim=True), real.sum(1, keepdim=True)
    one_run = torch.equal(real, (column >= first) & (column < first + count))
    if not one_run or not bool((real[:, :-1] | ~scored.bool()[:, 1:]).all()):
        return None
    return pack_rows({"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": scored})


def token_logps(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scored: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    packed: PackedBatch | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """(B, L - 1) log-probs of ``token_scores``: entry [b, t] is log p(input_ids[b, t + 1]) where
    ``scored[b, t + 1]``, else 0."""
    return token_scores(model, input_ids, attention_mask, scored, position_ids, packed, temperature).logps


def completion_logps(
    model: nn.Module, batch: dict[str, torch.Tensor], padding_free: bool = False, share_prompt: bool = False
) -> SequenceLogps:
    """Summed completion-token log-probs of every row of ``batch`` (chosen rows, then rejected rows).

    The language-model head runs only on positions whose next token is a completion token, so the
    (rows, length, vocabulary) logits tensor is never built. ``padding_free`` runs the real tokens packed in
    one row (``pack_batch``, ``models.packing``): no work on padding. ``share_prompt`` (packed too) holds each
    pair's prompt once. Each falls back (``token_logps``): to padded rows for a model where packing is not
    exact or a batch that cannot pack (``can_pack``), to the model's own forward where head-only log-probs
    are not exact.

    Args:
        model: a transformers causal LM (optionally wrapped by ``peft``).
        batch: ``input_ids``, ``attention_mask``, ``completion_mask``, each (2B, L); for a VL model ``vision``, the
            rows' images (``models.vision.VisionInputs``: then padded rows, not packed).
        padding_free: pack the rows' real tokens into one row.
        share_prompt: pack each pair as one sequence holding its prompt once.

    Returns:
        ``SequenceLogps(logps (2B,), lengths (2B,))``.
    """
    packed, vision = None, batch.get("vision")  # a VL model's rows carry their images: padded, never packed
    if vision is None and (padding_free or share_prompt) and scoring_path(model).packed:
        if share_prompt and can_pack(batch, share_prompt=True):
            packed = pack_batch(batch, share_prompt=True)
        elif can_pack(batch):  # prompts differ within a pair: still packed, one block per row
            packed = pack_batch(batch)
    args = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    token = token_scores(model, *args, packed=packed, vision=vision).logps
    lengths = batch["completion_mask"][:, 1:].sum(-1).to(token.dtype)
    return SequenceLogps(token.sum(-1), lengths)
