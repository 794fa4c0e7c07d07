"""Per-token log-probs of given tokens under a vision-language model, with each row's images.

Two paths, as ``models.scoring`` has for text: ``head`` runs the VL base model (vision encoder, projector, language
model) to its last hidden states and the LM head fused on the scored positions only (no (B, L, V) logits);
``forward`` is the model's own forward (full logits), always exact. ``vision_scoring_path`` compares the two once
per model on the first batch it scores and falls back to ``forward`` where they differ, with one INFO line.
Packing is not used: image tokens and their positions (M-RoPE) are laid out per row by the model. Rows that share
a prompt (a DPO pair, a GRPO group) run it once on the head path (below: the prompt's KV cache continued by each
row's response).

**The shared prompt.** Rows with images cannot be packed, so without it every row runs its whole prompt: a DPO pair
twice, a GRPO group ``G`` times (policy and reference). ``prefix_shared_logps`` runs each prompt (its image tokens
included) through the VL model once, selects its KV cache (with gradients) for every row that answers it and runs
the responses as a continuation of that cache: the prompts' activations are computed and stored once, the rows hold
only their responses' (and the selected keys and values, which the padded rows hold too). Positions continue where
the prompt's ended, as ``generation.hf.vision_decoding`` continues them: for the Qwen VL family's multimodal RoPE the
model's ``rope_deltas`` shift the text positions after the images, for the others the count of the prompt's real
tokens. The LM head runs fused on the scored positions (``head_scores``).

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

from aitraining_pl.models.lm_head import TokenScores, head_scores, logits_scores
from aitraining_pl.models.lora import base_model
from aitraining_pl.models.training import eval_mode
from aitraining_pl.models.vision import VisionInputs, image_token_ids, model_inputs, uses_mrope

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
        token = head_scores(lm.get_output_embeddings(), lm.config.get_text_config(), hidden, targets, temperature,
                             with_entropy)  # fmt: skip
    else:
        out = model(**kwargs, output_hidden_states=with_hidden)
        hidden = out.hidden_states[-1][rows, cols] if with_hidden else None
        token = logits_scores(out.logits[rows, cols], targets, temperature, with_entropy)
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
        shared = shared_prompt_scores(model, input_ids, attention_mask, scored, vision, temperature, with_entropy,
                                      with_hidden)  # fmt: skip
        if shared is not None:
            return shared
    return _scores(model, path, input_ids, attention_mask, shifted, vision, temperature, with_entropy, with_hidden)


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
    token = head_scores(lm.get_output_embeddings(), lm.config.get_text_config(), hidden[rows, cols],
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
