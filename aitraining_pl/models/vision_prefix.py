"""Log-probs of responses to prompts with images, each prompt run once: the prompt (its image tokens included)
through the vision-language model once, its KV cache (with gradients) selected for every row that answers it,
the responses run as a continuation of that cache.

Rows with images cannot be packed (``models.vision_scoring``), so without this every row runs its whole prompt:
a DPO pair twice, a GRPO group ``G`` times (policy and reference). Here the prompts' activations are computed and
stored once; the rows hold only their responses' (and the selected keys and values, which the padded rows hold
too). Positions continue where the prompt's ended, as ``generation.hf.vision_decoding`` continues them: for the Qwen VL
family's multimodal RoPE the model's ``rope_deltas`` shift the text positions after the images, for the others
the count of the prompt's real tokens. The LM head runs fused on the scored positions (``_head_scores``).

``shared_prompt_scores`` takes the scoring rows' layout (``vision_token_scores``' arguments) and returns None
where the rows do not share prompts or do not fit (each row one run of real tokens, a non-empty prompt before its
first scored token); ``vision_token_scores`` then runs the rows whole. Whether the shared prompt reproduces the
rows' own forward is checked once per model, as ``vision_scoring_path`` checks the head path.
"""

from __future__ import annotations

import inspect
import logging
from typing import NamedTuple

import torch
from torch import nn

from aitraining_pl.models.lora import base_model
from aitraining_pl.models.scoring import TokenScores, _head_scores
from aitraining_pl.models.vision import VisionInputs, model_inputs, uses_mrope

log = logging.getLogger(__name__)

#: the prompt work the shared prompt must save to pay for its second model call (the responses' continuation): the
#: prompt tokens no longer run times the text model's hidden size squared, per layer. Measured on a 2-core CPU with
#: ``benchmarks/vlm_vs_trl.py``: the tiny Qwen2-VL (width 32) gained 15 to 19% in GRPO (4 x 8 rows: 392 tokens
#: saved, 4e5) and lost 11% in DPO (8 pairs: 112 tokens, 1.1e5), the small one (width 256) gained in both (DPO: 7e6).
#: Any model of real width (1,000 and more) passes it with one token saved.
SHARING_THRESHOLD = 2**18


class PrefixScores(NamedTuple):
    """What ``prefix_shared_logps`` returns; (N, R) tensors are per response token, 0 where not scored."""

    logps: torch.Tensor  #: log-probs of the scored response tokens
    entropy: torch.Tensor | None  #: entropies of the distributions predicting them (``with_entropy``)
    hidden: torch.Tensor | None  #: (M, H) last hidden states predicting them, row-major (``with_hidden``)


def _cache_of(out) -> object:
    cache = out.get("cache")
    return out.get("past_key_values") if cache is None else cache


def prefix_shared_logps(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    vision: VisionInputs,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    group: torch.Tensor,
    scored: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_hidden: bool = False,
) -> PrefixScores:
    """Per-token log-probs of N right-padded responses (N, R), row n answering the left-padded prompt
    ``group[n]`` of ``prompt_ids`` (B, P) with that prompt's images (``vision``: one entry per prompt).

    Each prompt runs through the VL model once (``model_inputs``: its image features, token types and positions);
    its KV cache is selected for the rows (``group``) and the responses continue it (attention mask: the prompt's
    then the response's, positions continuing the prompt's). Gradients flow through the cache into the prompt's
    activations, accumulated over its rows. ``scored`` (N, R): the response tokens to score (default
    ``response_mask``); entry [n, t] of the result is for ``response_ids[n, t]``, predicted from the prompt's last
    hidden state (t = 0) or the response's token t - 1.
    """
    lm = base_model(model)
    base = lm.model
    scored = response_mask if scored is None else scored
    group = group.to(prompt_ids.device)
    kwargs = model_inputs(model, prompt_ids, prompt_mask, vision)
    mrope = uses_mrope(model) and "position_ids" not in kwargs  # M-RoPE positions the model computes from images
    if mrope:
        base.rope_deltas = None  # deltas of an earlier batch would be reused
    cache_name = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    out = base(**kwargs, use_cache=True)
    cache = _cache_of(out)
    lengths = prompt_mask.sum(1)[group]
    positions = lengths[:, None] + torch.arange(response_ids.shape[1], device=lengths.device)
    if mrope:
        deltas = base.rope_deltas.to(positions.device)[group]
        base.rope_deltas = None
        positions = (positions + deltas).unsqueeze(0).expand(3, -1, -1)
    last = out.last_hidden_state[:, -1][group]  # predicts each row's first response token
    cache.batch_select_indices(group)
    mask = torch.cat([prompt_mask[group], response_mask.to(prompt_mask.dtype)], 1)
    cont = {"input_ids": response_ids, "attention_mask": mask, "position_ids": positions, cache_name: cache}
    hidden = base(**cont, use_cache=True).last_hidden_state
    hidden = torch.cat([last.unsqueeze(1), hidden[:, :-1]], 1)
    rows, cols = torch.nonzero(scored, as_tuple=True)
    token = _head_scores(lm.get_output_embeddings(), lm.config.get_text_config(), hidden[rows, cols],
                         response_ids[rows, cols], temperature, with_entropy)  # fmt: skip
    place = lambda values: values.new_zeros(scored.shape).index_put((rows, cols), values)  # noqa: E731
    return PrefixScores(
        place(token.logps), place(token.entropy) if with_entropy else None, hidden[rows, cols] if with_hidden else None
    )


class _Layout(NamedTuple):
    prompt_ids: torch.Tensor  #: (B, P) the distinct prompts, left padded
    prompt_mask: torch.Tensor
    vision: VisionInputs  #: one entry per distinct prompt
    response_ids: torch.Tensor  #: (N, R) each row's tokens from its first scored one, right padded
    response_mask: torch.Tensor
    scored: torch.Tensor  #: (N, R)
    group: torch.Tensor  #: (N,) the distinct prompt of each row
    start: torch.Tensor  #: (N,) the column of each row's first response token


def _layout(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    scored: torch.Tensor,
    vision: VisionInputs,
    threshold: float = SHARING_THRESHOLD,
) -> _Layout | None:
    """The rows (N, L) (``scored`` unshifted) as distinct prompts and responses, or None where they share no
    prompt (same images, same tokens), save less prompt work than ``threshold`` or do not fit: a row's real tokens
    not one run, no prompt token before its first scored token, or an image token after it."""
    from aitraining_pl.models.vision import image_token_ids

    device = input_ids.device
    real = attention_mask.bool()
    hits = scored.bool() & real
    count = real.sum(1)
    first = real.int().argmax(1)
    end = first + count
    columns = torch.arange(real.shape[1], device=device)
    if not bool((((columns >= first[:, None]) & (columns < end[:, None])) == real).all()) or not bool(count.all()):
        return None
    start = torch.where(hits.any(1), hits.int().argmax(1), end)
    if not bool((start > first).all()) or not bool((end > start).any()):
        return None
    banned = image_token_ids(model)
    after = columns[None] >= start[:, None]
    if banned and bool((torch.isin(input_ids, torch.tensor(banned, device=device)) & after & real).any()):
        return None  # images after the prompt (an episode's later turns): the rows run whole
    pad = next(i for i in range(len(banned) + 1) if i not in banned)  # never an image token (counted as one)
    keys, representative, group = {}, [], []
    ids, owners = input_ids.tolist(), vision.prompt_of()
    for n, (a, b) in enumerate(zip(first.tolist(), start.tolist())):
        key = (owners[n], tuple(ids[n][a:b]))
        if key not in keys:
            keys[key] = len(representative)
            representative.append(n)
        group.append(keys[key])
    if len(representative) == len(group):
        return None  # every row its own prompt: nothing shared
    saved = int((start - first).sum()) - sum(int(start[n] - first[n]) for n in representative)
    if saved * base_model(model).config.get_text_config().hidden_size ** 2 < threshold:
        return None  # too little prompt work saved to pay for the second call
    rep = torch.tensor(representative, device=device)
    lengths = (start - first)[rep]
    width = int(lengths.max())
    offset = torch.arange(width, device=device) - width  # left padded: the last column is the prompt's last token
    at = start[rep, None] + offset
    prompt_mask = offset >= -lengths[:, None]
    prompt_ids = input_ids[rep].gather(1, at.clamp_min(0)).masked_fill(~prompt_mask, pad)
    sizes = end - start
    steps = torch.arange(int(sizes.max()), device=device)
    at = (start[:, None] + steps).clamp_max(real.shape[1] - 1)
    response_mask = steps < sizes[:, None]
    response_ids = input_ids.gather(1, at).masked_fill(~response_mask, pad)
    marks = hits.gather(1, at) & response_mask
    prompt_vision = vision.for_rows(torch.tensor([owners[n] for n in representative]))
    group = torch.tensor(group, device=device)
    dtype = attention_mask.dtype
    return _Layout(prompt_ids, prompt_mask.to(dtype), prompt_vision, response_ids, response_mask.to(dtype), marks,
                   group, start)  # fmt: skip


def _shared(model, layout: _Layout, shape, temperature: float, with_entropy: bool, with_hidden: bool) -> TokenScores:
    out = prefix_shared_logps(model, layout.prompt_ids, layout.prompt_mask, layout.vision, layout.response_ids,
                              layout.response_mask, layout.group, layout.scored, temperature, with_entropy,
                              with_hidden)  # fmt: skip
    rows, t = torch.nonzero(layout.scored, as_tuple=True)
    cols = layout.start[rows] + t - 1  # token start + t, predicted from the position before it
    place = lambda values: values.new_zeros(shape).index_put((rows, cols), values[rows, t])  # noqa: E731
    entropy = place(out.entropy) if with_entropy else None
    return TokenScores(place(out.logps), entropy, out.hidden, (rows, cols))


def _probe_exact(model, input_ids, attention_mask, scored, vision, layout: _Layout) -> str:
    """'' where the shared prompt reproduces the rows' own head-path log-probs on this batch, else why not."""
    from aitraining_pl.models.training import eval_mode
    from aitraining_pl.models.vision_scoring import _scores

    key = next(base_model(model).parameters()).dtype
    device = input_ids.device
    with eval_mode(model), torch.no_grad(), torch.autocast(device.type, enabled=False):
        want = _scores(model, "head", input_ids, attention_mask, scored[:, 1:].bool(), vision, 1.0, False, False)
        try:
            got = _shared(model, layout, want.logps.shape, 1.0, False, False).logps
        except Exception as err:  # noqa: BLE001 - any failure of the shared path means: do not use it
            return f"the shared prompt raised {type(err).__name__}: {err}"
    tolerance = 5e-2 if key in (torch.float16, torch.bfloat16) else 1e-4
    difference = float((got - want.logps).abs().max())
    if not difference <= tolerance * (1 + float(want.logps.abs().max())):
        return f"the shared prompt differs from the rows' forward by {difference:.3g}"
    return ""


def shared_prompt_scores(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    scored: torch.Tensor,
    vision: VisionInputs,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_hidden: bool = False,
    threshold: float = SHARING_THRESHOLD,
) -> TokenScores | None:
    """``vision_token_scores``' result for rows that share prompts (``scored`` unshifted), each distinct prompt
    run once (``prefix_shared_logps``); None where the rows share none, save less prompt work than ``threshold``
    (``SHARING_THRESHOLD``), do not fit (``_layout``), the model trains
    with gradient checkpointing (no cache) or the shared prompt is not exact for the model (checked once per model
    and dtype on the first batch that shares prompts, with one INFO line)."""
    lm = base_model(model)
    decoder = lm.model.get_decoder() if hasattr(getattr(lm, "model", None), "get_decoder") else None
    if decoder is None:
        return None
    layers = [decoder, *getattr(decoder, "layers", ())]
    if lm.training and any(getattr(layer, "gradient_checkpointing", False) is True for layer in layers):
        return None  # no cache while checkpointing
    layout = _layout(model, input_ids, attention_mask, scored, vision, threshold)
    if layout is None:
        return None
    cache = lm.__dict__.setdefault("_aitraining_shared_prompt", {})
    key = next(lm.parameters()).dtype
    if key not in cache:
        reason = _probe_exact(model, input_ids, attention_mask, scored, vision, layout)
        cache[key] = not reason
        log.info("%s: rows with images share their prompt's forward%s", type(lm).__name__,
                 f": no ({reason})" * bool(reason))  # fmt: skip
    if not cache[key]:
        return None
    shape = (input_ids.shape[0], input_ids.shape[1] - 1)
    return _shared(model, layout, shape, temperature, with_entropy, with_hidden)
