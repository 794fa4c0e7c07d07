"""Position ids for reward trunks, decided by probing the trunk itself rather than by an architecture list.

A reward model reads a padded batch, but its score must equal the one the trunk gives each sequence alone.
How a trunk turns a padded row into positions differs by architecture:

- BERT, ELECTRA, DeBERTa, GPT-2, Llama, Qwen2, ... count positions from 0 at the first token of the
  tensor, so a left-padded row needs explicit position ids counted over real tokens (``mask`` mode);
- RoBERTa, XLM-R and every encoder that derives positions from ``input_ids`` (they start at
  ``padding_idx + 1`` and skip pad tokens) compute them correctly themselves and must get none (``none``);
- trunks that count from the first column but take no ``position_ids`` (DistilBERT before transformers 5,
  custom trunks) are only exact on right-padded rows, so the batch is right-aligned for their forward and
  the hidden states moved back (``right_align``).

``choose_position_mode`` runs the trunk once (eval mode, no grad, autocast off) on a left-padded and a
right-padded batch of short random sequences and keeps the first mode, in the order ``mask``, ``none``,
``right_align``, whose hidden states at every real token equal the trunk's own forward on each unpadded
sequence (relative tolerance 1e-4 in float32, 3e-2 in half precision) and are not clearly further from it
than the best mode's (at most 4 x the best difference + 1e-6, or + 1e-3 in half precision, so that a wrong
mode cannot pass on rounding noise in bfloat16). If no mode is exact the closest is kept and a warning gives
the difference; a trunk the probe cannot run gets ``mask`` (``none`` if it takes no position ids) and a
warning. Pooling stays mask-based in every mode. The probe draws its tokens from its own generator, so it
leaves the global random state untouched.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from aitraining_pl.losses import positions_from_mask
from aitraining_pl.models.tokens import padded
from aitraining_pl.models.training import eval_mode

log = logging.getLogger(__name__)

POSITION_MODES = ("mask", "none", "right_align")
_PROBE_LENGTHS = (6, 3, 1)


def _leading_pads(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) number of 0s before each row's first real token."""
    return (attention_mask.to(torch.long).cumsum(-1) == 0).sum(-1)


def trunk_hidden(
    trunk: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, mode: str, *, use_cache: bool
) -> torch.Tensor:
    """(B, T, H) last hidden states of ``trunk`` with positions handled as ``mode`` says (module docstring).

    In ``right_align`` mode each row is rotated so its real tokens come first (a contiguous mask is
    assumed, as left/right padding gives), and the hidden states are rotated back, so they line up with
    ``attention_mask`` as given."""
    kwargs = {"use_cache": False} if use_cache else {}
    if mode == "mask":
        kwargs["position_ids"] = positions_from_mask(attention_mask)
    if mode != "right_align":
        return trunk(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
    width = input_ids.shape[1]
    steps = torch.arange(width, device=input_ids.device)
    lead = _leading_pads(attention_mask).unsqueeze(-1)
    forward_idx, back_idx = (steps + lead) % width, (steps - lead) % width
    hidden = trunk(
        input_ids=input_ids.gather(1, forward_idx), attention_mask=attention_mask.gather(1, forward_idx), **kwargs
    ).last_hidden_state
    return hidden.gather(1, back_idx.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


def _probe_ids(config, device: torch.device, generator: torch.Generator) -> tuple[list[torch.Tensor], int]:
    """Random token sequences avoiding special ids, and the pad id the trunk's config names (0 if none)."""
    text = getattr(config, "get_text_config", lambda: config)() or config
    vocab = int(getattr(text, "vocab_size", None) or getattr(config, "vocab_size"))
    specials = set()
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id", "mask_token_id"):
        value = getattr(text, key, None)
        specials.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
    low = max(specials) + 1 if specials and max(specials) + 1 < vocab - 16 else 0
    pool = torch.tensor([i for i in range(low, vocab) if i not in specials][:4096])
    seqs = [pool[torch.randint(len(pool), (n,), generator=generator)].to(device) for n in _PROBE_LENGTHS]
    pad = getattr(text, "pad_token_id", None)
    return seqs, int(pad if pad is not None else 0)


def probe_position_errors(trunk: nn.Module, modes: tuple[str, ...], *, use_cache: bool) -> dict[str, float]:
    """Mode -> max relative difference of the hidden states on padded probe batches from the trunk's own
    forward on each unpadded sequence (runs in eval mode; the trunk's train/eval flags are restored)."""
    param = next(trunk.parameters())
    generator = torch.Generator().manual_seed(0)
    seqs, pad = _probe_ids(trunk.config, param.device, generator)
    with eval_mode(trunk), torch.no_grad(), torch.autocast(param.device.type, enabled=False):
        kwargs = {"use_cache": False} if use_cache else {}
        refs = [trunk(input_ids=s[None], attention_mask=torch.ones_like(s)[None], **kwargs).last_hidden_state[0]
                for s in seqs]  # fmt: skip
        scale = max(float(r.float().abs().max()) for r in refs) or 1.0
        errors = {}
        for mode in modes:
            worst = 0.0
            for side in ("left", "right"):
                ids, mask = padded(seqs, pad, side)
                hidden = trunk_hidden(trunk, ids, mask, mode, use_cache=use_cache)
                for row, ref in enumerate(refs):
                    got = hidden[row][mask[row].bool()]
                    worst = max(worst, float((got.float() - ref.float()).abs().max()) / scale)
            errors[mode] = worst
    return errors


def choose_position_mode(trunk: nn.Module, *, takes_positions: bool, use_cache: bool) -> tuple[str, dict[str, float]]:
    """The position mode for ``trunk`` (module docstring) and the probe's relative error of each mode tried."""
    modes = POSITION_MODES if takes_positions else tuple(m for m in POSITION_MODES if m != "mask")
    try:
        errors = probe_position_errors(trunk, modes, use_cache=use_cache)
    except Exception as err:  # a trunk the probe cannot drive: positions from the mask where it takes them
        log.warning("reward trunk %s: position probe failed (%s); using %r", type(trunk).__name__, err, modes[0])
        return modes[0], {}
    full = next(trunk.parameters()).dtype == torch.float32
    tol, noise = (1e-4, 1e-6) if full else (3e-2, 1e-3)
    best, name = min(errors.values()), type(trunk).__name__
    for mode in modes:  # exact, and not clearly worse than the best (half precision blurs "exact")
        if errors[mode] <= tol and errors[mode] <= 4 * best + noise:
            log.info("reward trunk %s: position mode %r (probe differences %s)", name, mode, errors)
            return mode, errors
    mode = min(errors, key=errors.get)
    log.warning(
        "reward trunk %s: no position handling reproduces its unpadded forward on padded batches (relative "
        "differences %s); using %r, the closest", name, errors, mode,
    )  # fmt: skip
    return mode, errors
