"""Token-by-token sampling of one sequence with a KV cache, returning per-token log-probs."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

import torch

#: temperatures at or below this sample greedily (argmax).
GREEDY_TEMPERATURE = 1e-4


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k then nucleus (top-p, Holtzman et al. 2020) filtering: removed entries become ``-inf``.

    Args:
        logits: (V,) or (B, V) scores (already divided by the temperature).
        top_k: keep the ``top_k`` highest (0 keeps all).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p`` (1.0 keeps all).
    """
    logits = logits.clone()
    if top_k and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens before it already reach top_p (the first token always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits[drop] = float("-inf")
    return logits


def _stop_sequences(stop: Optional[Sequence[Union[int, Sequence[int]]]]) -> List[List[int]]:
    return [[int(s)] if isinstance(s, int) or (torch.is_tensor(s) and s.dim() == 0) else [int(t) for t in s] for s in (stop or [])]


def _cache_argument(model: Any) -> str:
    """The KV-cache keyword of the model's forward: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    import inspect

    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _lm_step(model: Any, input_ids: torch.Tensor, cache: Any, cache_arg: str) -> tuple[torch.Tensor, Any]:
    """Next-token logits (V,) after ``input_ids`` (1, n) and the updated cache."""
    out = model(input_ids=input_ids, use_cache=True, **({cache_arg: cache} if cache is not None else {}))
    new_cache = getattr(out, "cache", None)
    if new_cache is None:
        new_cache = getattr(out, "past_key_values", None)
    return out.logits[0, -1].float(), new_cache


@torch.no_grad()
def sample_with_cache(
    model: Any,
    prompt: Sequence[int],
    max_tokens: int = 100,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop: Optional[Sequence[Union[int, Sequence[int]]]] = None,
    generator: Optional[torch.Generator] = None,
    device: Optional[torch.device] = None,
) -> Dict[str, Any]:
    """Sample up to ``max_tokens`` after ``prompt`` from a transformers causal LM, reusing its KV cache.

    The prompt is read in one forward pass, then each new token costs one forward pass of length 1.
    Sampling stops after a token (or token sequence) in ``stop``; the stop tokens are included.

    Returns:
        ``tokens`` (new token ids), ``logprobs`` (log-prob of each new token under the model itself, i.e.
        temperature 1 and no filtering, what training losses compute), ``sampling_logprobs`` (under the
        distribution actually sampled from; 0.0 for greedy steps), ``prompt`` (the prompt ids) and
        ``stop_reason`` (``"stop"`` or ``"length"``).
    """
    stops = _stop_sequences(stop)
    device = device or next(model.parameters()).device
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    if ids.shape[1] == 0:
        raise ValueError("sample() needs a non-empty prompt")
    cache_arg = _cache_argument(model)
    logits, cache = _lm_step(model, ids, None, cache_arg)
    tokens: List[int] = []
    logprobs: List[float] = []
    sampling_logprobs: List[float] = []
    reason = "length"
    for _ in range(max_tokens):
        if temperature <= GREEDY_TEMPERATURE:
            token, sampled_logp = int(logits.argmax()), 0.0
        else:
            dist = torch.log_softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
            token = int(torch.multinomial(dist.exp(), 1, generator=generator))
            sampled_logp = float(dist[token])
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
        sampling_logprobs.append(sampled_logp)
        if any(tokens[-len(s):] == s for s in stops if s):
            reason = "stop"
            break
        logits, cache = _lm_step(model, torch.tensor([[token]], device=device), cache, cache_arg)
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        "sampling_logprobs": sampling_logprobs,
        "prompt": list(int(t) for t in prompt),
        "stop_reason": reason,
    }
