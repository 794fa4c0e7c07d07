"""Reward models in the standard ``AutoModelForSequenceClassification`` layout (transformers, TRL, vLLM).

``RewardModel.save_pretrained`` writes ``config.json`` + ``model.safetensors`` as the trunk's own
``<Arch>ForSequenceClassification`` with one label whose logit is the model's reward (``score``: output 0 of
the head, or the weighted combination of a multi-objective model, divided by ``temperature``), so
``AutoModelForSequenceClassification.from_pretrained(folder)`` and TRL's reward-model loading need nothing of
this project. The project's extras lie beside: ``reward_config.json`` (pooling, temperature, objectives, and the
``standard`` section below) and ``reward_head.safetensors`` (the full head: every output, its bias, and any trunk
tensor the standard layout replaced), from which ``load_reward_model`` rebuilds the model exactly.

Which settings the standard layout represents (checked numerically at export, recorded in
``reward_config.json["standard"]`` as ``exact`` / ``max_abs_difference`` / ``score_offset``):

- decoders (Llama, Qwen2, Mistral, Gemma, GPT-2, ...; the class has a bias-free ``score`` head on the rightmost
  non-pad token): ``pooling_strategy="last"``; temperature, multi-objective weights and extra outputs fold
  into the ``score`` weight. The head's bias has no place there: the standard logit is the reward minus the
  constant ``score_offset`` (Bradley-Terry probabilities, rankings and whitened PPO rewards are unchanged;
  a model built with ``RewardModelConfig(head_bias=False)`` is exact). The class pools by token id, not by
  the attention mask, so it matches only when the tokenizer's pad id differs from EOS (recorded as a reason
  when not).
- BERT-style encoders (the class reads the ``[CLS]`` state through ``pooler`` = tanh(dense) then
  ``classifier``): ``pooling_strategy="cls"``. Our model reads ``[CLS]`` directly, so the pooler is written
  in its linear range: row 0 is ``eps * w`` (``eps = 1e-4``) and the classifier multiplies by ``1 / eps``,
  giving ``tanh(eps * r) / eps = r (1 - (eps r)^2 / 3)``, a relative error under 3e-6 for |r| < 30 (float32
  rounding). Fine-tuning such an export further should re-initialise its pooler.
- anything else (``mean`` pooling, other classification heads, a probe difference over tolerance): no
  standard layout; the folder keeps the project's own format (``trunk.*`` / ``head.*`` keys), which only
  ``load_reward_model`` reads, and ``standard`` is ``null`` with the reason logged.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aitraining_pl.models.lora import base_model
from aitraining_pl.models.tokens import padded
from aitraining_pl.models.training import eval_mode
from aitraining_pl.models.trunk_positions import _probe_ids

log = logging.getLogger(__name__)

#: the project's extras beside a standard folder: the full head and any trunk tensor the layout replaced.
EXTRAS_FILE = "reward_head.safetensors"
#: slope of the linearised BERT pooler (module docstring).
POOLER_EPS = 1e-4
_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6}


def score_linear(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, b)``, float32, with ``model.score(x) == pooled(x) @ w + b`` in eval mode: head row 0 (or the
    objective-weighted rows of a multi-objective model) and its bias, divided by ``temperature``."""
    weight = model.head.weight.detach().float()
    bias = model.head.bias.detach().float() if model.head.bias is not None else torch.zeros(weight.shape[0])
    combo = getattr(model, "objective_weights", None)
    if combo is None:
        combo = torch.zeros(weight.shape[0])
        combo[0] = 1.0
    combo = combo.detach().float().to(weight.device)
    temperature = float(model.config.temperature)
    return combo @ weight / temperature, (combo @ bias.to(weight.device)) / temperature


def _layout(standard: nn.Module, pooling: str) -> str | None:
    """``score`` (decoder, last non-pad token), ``tanh_pooler`` (BERT-style) or ``None`` (not representable)."""
    if pooling == "last" and isinstance(getattr(standard, "score", None), nn.Linear):
        return "score"
    pooler = getattr(standard.base_model, "pooler", None)
    if (
        pooling == "cls"
        and isinstance(getattr(standard, "classifier", None), nn.Linear)
        and isinstance(getattr(pooler, "dense", None), nn.Linear)
        and isinstance(getattr(pooler, "activation", None), nn.Tanh)
    ):
        return "tanh_pooler"
    return None


def _write_head(standard: nn.Module, layout: str, w: torch.Tensor, b: torch.Tensor) -> tuple[float, list[str]]:
    """Put the reward's linear map into ``standard``'s head; returns the constant it cannot hold and the
    names of the trunk tensors it replaced."""
    with torch.no_grad():
        if layout == "score":
            head = standard.score
            head.weight.copy_(w[None].to(head.weight))
            if head.bias is not None:
                head.bias.copy_(b.reshape(1).to(head.bias))
                return 0.0, []
            return float(b), []
        dense, classifier = standard.base_model.pooler.dense, standard.classifier
        dense.weight.zero_(), dense.bias.zero_(), classifier.weight.zero_(), classifier.bias.zero_()
        dense.weight[0] = (POOLER_EPS * w).to(dense.weight)
        dense.bias[0] = (POOLER_EPS * b).to(dense.bias)
        classifier.weight[0, 0] = 1.0 / POOLER_EPS
    return 0.0, ["pooler.dense.weight", "pooler.dense.bias"]


def _standard_config(trunk_config, pad_token_id: int | None):
    config = copy.deepcopy(trunk_config)
    config.num_labels = 1
    config.id2label, config.label2id = {0: "reward"}, {"reward": 0}
    config.problem_type = "regression"
    text = getattr(config, "get_text_config", lambda: config)() or config
    if getattr(text, "pad_token_id", None) is None and pad_token_id is not None:
        text.pad_token_id = pad_token_id
    return config


@torch.no_grad()
def _probe_difference(model: nn.Module, standard: nn.Module, offset: float) -> float:
    """Max |standard logit + offset - model.score| on a right-padded probe batch of random tokens (``model`` on
    its device, ``standard`` on the CPU)."""
    text = getattr(standard.config, "get_text_config", lambda: standard.config)() or standard.config
    seqs, _ = _probe_ids(text, next(model.parameters()).device, torch.Generator().manual_seed(1))
    pad = text.pad_token_id if text.pad_token_id is not None else 0
    ids, mask = padded(seqs, pad, "right")
    ours = model.score(ids, mask).float().cpu()
    theirs = standard(input_ids=ids.cpu(), attention_mask=mask.cpu()).logits[:, 0].float() + offset
    return float((ours - theirs).abs().max())


def build_standard(
    model: nn.Module, trunk_state: dict[str, torch.Tensor], tokenizer=None
) -> tuple[nn.Module, dict] | None:
    """The ``AutoModelForSequenceClassification`` equal to ``model``'s reward and its ``standard`` record
    (``reward_config.json``), or ``None`` where the layout cannot represent it (module docstring).

    ``trunk_state``: the trunk's plain weights (LoRA merged), keys without the ``trunk.`` prefix."""
    from transformers import AutoModelForSequenceClassification

    base = base_model(model.trunk)
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    config = _standard_config(base.config, pad)
    dtype = next(base.parameters()).dtype
    try:  # on the CPU, in the trunk's dtype: the export does not double the accelerator's memory
        with torch.random.fork_rng(devices=[]):
            standard = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    except (ValueError, KeyError) as err:  # no sequence-classification class for this trunk
        log.warning("reward model: no AutoModelForSequenceClassification for %s (%s)", type(base).__name__, err)
        return None
    layout = _layout(standard, model.config.pooling_strategy)
    if layout is None:
        log.warning("reward model: %s pooling on %s has no standard layout; writing the project's format only",
                    model.config.pooling_strategy, type(standard).__name__)  # fmt: skip
        return None
    standard.to(dtype=dtype).eval()
    missing, unexpected = standard.base_model.load_state_dict(trunk_state, strict=False)
    w, b = score_linear(model)
    offset, replaced = _write_head(standard, layout, w, b)
    if unexpected or set(missing) - set(replaced):
        log.warning("reward model: trunk weights do not fit %s (missing %s, unexpected %s)",
                    type(standard).__name__, sorted(missing)[:3], unexpected[:3])  # fmt: skip
        return None
    with eval_mode(model):
        difference = _probe_difference(model, standard, offset)
    scale = max(1.0, float(w.abs().sum() + b.abs()))
    if difference > _TOLERANCE.get(dtype, 3e-2) * scale:
        log.warning("reward model: the %s layout differs from the model by %.3g on a probe; writing the "
                    "project's format only", type(standard).__name__, difference)  # fmt: skip
        return None
    reasons = []
    if offset != 0.0:
        reasons.append("the head's bias: standard logits are the rewards minus score_offset")
    if layout == "tanh_pooler":
        reasons.append(f"linearised tanh pooler (eps={POOLER_EPS}): equal up to a relative (eps * reward)^2 / 3")
    text = getattr(config, "get_text_config", lambda: config)() or config
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if layout == "score" and eos is not None and eos == text.pad_token_id:
        reasons.append("pad id == EOS id: the class pools the last token that is not EOS")
    record = {
        "architecture": type(standard).__name__, "layout": layout, "base_model_prefix": standard.base_model_prefix,
        "replaced_trunk_tensors": replaced, "score_offset": offset, "max_abs_difference": difference,
        "exact": not reasons, "reasons": reasons,
    }  # fmt: skip
    return standard, record


def save_standard(model: nn.Module, path: Path, state: dict[str, torch.Tensor], tokenizer=None) -> dict | None:
    """Write the standard folder (``config.json``, ``model.safetensors``) and ``reward_head.safetensors`` for
    ``model`` whose plain weights are ``state`` (``trunk.*`` / ``head.*``); returns the ``standard`` record,
    or ``None`` (nothing written) when the layout cannot represent the model."""
    from safetensors.torch import save_file

    trunk_state = {k[len("trunk.") :]: v for k, v in state.items() if k.startswith("trunk.")}
    built = build_standard(model, trunk_state, tokenizer)
    if built is None:
        return None
    standard, record = built
    standard.save_pretrained(str(path), safe_serialization=True)
    extras = {k: v for k, v in state.items() if not k.startswith("trunk.")}
    extras.update({f"trunk.{name}": state[f"trunk.{name}"] for name in record["replaced_trunk_tensors"]})
    save_file({k: v.contiguous().cpu() for k, v in extras.items()}, str(path / EXTRAS_FILE), metadata={"format": "pt"})
    return record


def read_standard_state(path: Path, record: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Plain ``trunk.*`` / ``head.*`` weights of a standard folder (inverse of ``save_standard``)."""
    from safetensors.torch import load_file

    prefix = record["base_model_prefix"] + "."
    index = path / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.is_file():  # sharded
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    weights = {k: v for name in files for k, v in load_file(str(path / name)).items()}
    state = {f"trunk.{k[len(prefix) :]}": v for k, v in weights.items() if k.startswith(prefix)}
    state.update(load_file(str(path / EXTRAS_FILE)))
    return state
