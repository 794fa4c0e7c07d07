"""Per-token log-probs of given tokens under a vision-language model, with each row's images.

Two paths, as ``models.scoring`` has for text: ``head`` runs the VL base model (vision encoder, projector, language
model) to its last hidden states and the LM head fused on the scored positions only (no (B, L, V) logits);
``forward`` is the model's own forward (full logits), always exact. ``vision_scoring_path`` compares the two once
per model on the first batch it scores and falls back to ``forward`` where they differ, with one INFO line.
Packing is not used: image tokens and their positions (M-RoPE) are laid out per row by the model. Rows that share
a prompt (a DPO pair, a GRPO group) run it once on the head path (``models.vision_prefix``: the prompt's KV cache
continued by each row's response).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from aitraining_pl.models.lora import base_model
from aitraining_pl.models.scoring import TokenScores, _head_scores, _logits_scores
from aitraining_pl.models.training import eval_mode
from aitraining_pl.models.vision import VisionInputs, model_inputs

log = logging.getLogger(__name__)


def _scores(
    model: nn.Module,
    path: str,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    scored: torch.Tensor,
    vision: VisionInputs,
    temperature: float,
    with_entropy: bool,
    with_hidden: bool,
) -> TokenScores:
    """Entry [b, t] of (B, L - 1) is for token t + 1 where ``scored[b, t]`` (already shifted), else 0."""
    rows, cols = torch.nonzero(scored, as_tuple=True)
    targets = input_ids[rows, cols + 1]
    kwargs = {**model_inputs(model, input_ids, attention_mask, vision), "use_cache": False}
    lm = base_model(model)
    hidden = None
    if path == "head":
        hidden = lm.model(**kwargs).last_hidden_state[rows, cols]
        token = _head_scores(lm.get_output_embeddings(), lm.config.get_text_config(), hidden, targets, temperature,
                             with_entropy)  # fmt: skip
    else:
        out = model(**kwargs, output_hidden_states=with_hidden)
        hidden = out.hidden_states[-1][rows, cols] if with_hidden else None
        token = _logits_scores(out.logits[rows, cols], targets, temperature, with_entropy)
    place = lambda values: values.new_zeros(scored.shape).index_put((rows, cols), values)  # noqa: E731
    entropy = place(token.entropy) if with_entropy else None
    return TokenScores(place(token.logps), entropy, hidden if with_hidden else None, (rows, cols))


def vision_scoring_path(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, scored: torch.Tensor, vision: VisionInputs
) -> str:
    """``head`` where the head path reproduces the model's forward on (the first two rows of) this batch, else
    ``forward``; decided once per model and dtype."""
    lm = base_model(model)
    key = next(lm.parameters()).dtype
    cache = lm.__dict__.setdefault("_aitraining_vision_paths", {})
    if key in cache:
        return cache[key]
    n = min(2, input_ids.shape[0])
    probe = (input_ids[:n], attention_mask[:n], scored[:n], vision.rows(torch.arange(n)))
    device = input_ids.device
    reason = ""
    with eval_mode(model), torch.no_grad(), torch.autocast(device.type, enabled=False):
        want = _scores(model, "forward", *probe, 1.0, False, False).logps
        try:
            got = _scores(model, "head", *probe, 1.0, False, False).logps
            tolerance = 5e-2 if key in (torch.float16, torch.bfloat16) else 1e-4
            difference = float((got - want).abs().max())
            if not difference <= tolerance * (1 + float(want.abs().max())):
                reason = f"the head path differs from the model's forward by {difference:.3g}"
        except Exception as err:  # noqa: BLE001 - any failure of the fast path means: do not use it
            reason = f"the head path raised {type(err).__name__}: {err}"
    cache[key] = path = "forward" if reason else "head"
    log.info("%s: log-probs with images run on the %s path%s", type(lm).__name__, path, f" ({reason})" * bool(reason))
    return path


def vision_token_scores(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    scored: torch.Tensor,
    vision: VisionInputs,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_hidden: bool = False,
) -> TokenScores:
    """``models.scoring.token_scores`` for a VL model: the rows ``input_ids`` (B, L) with their images (``vision``,
    one entry per row), through the fastest path exact for the model. Arguments and result as ``token_scores``
    (``scored`` unshifted: token t is predicted from position t - 1)."""
    shifted = scored[:, 1:].bool()
    path = vision_scoring_path(model, input_ids, attention_mask, shifted, vision)
    if path == "head":  # rows that share a prompt (a DPO pair, a GRPO group): the prompt runs once
        from aitraining_pl.models.vision_prefix import shared_prompt_scores

        shared = shared_prompt_scores(model, input_ids, attention_mask, scored, vision, temperature, with_entropy,
                                      with_hidden)  # fmt: skip
        if shared is not None:
            return shared
    return _scores(model, path, input_ids, attention_mask, shifted, vision, temperature, with_entropy, with_hidden)
