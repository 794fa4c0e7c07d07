"""What a generation server's sampling answer must hold before ``HTTPReplica`` passes it on (issue 52): a JSON object
with its choices, then in each choice as many log-probs as tokens, at most ``max_new_tokens`` tokens, token ids in
the policy's vocabulary, log-probs finite and at most 0 (``LOGPROB_SLACK`` for float rounding), and weights steps no
older than the version asked for. Anything else is ``BadAnswer`` (a ``ReplicaDown``: one line naming the server, and
in a fleet the request goes to another server, as for a dead one). Also the rows of a completion answer
(``choice_tokens``) and their ``SampledTokens`` (``padded_samples``).

**Routes** (an MoE policy's, for routing replay: ``models.routing_replay``) travel as vLLM's completion choices carry
them (``routed_experts``, ``vllm serve --enable-return-routed-experts``): the base64 of a ``.npy`` array (T, layers,
top_k) of unsigned ints, T the prompt's tokens plus the response's minus one (the last token is never fed back).
``encode_routes`` writes it (the HF server), ``decoded_routes`` reads and checks it: at most the bytes that shape
needs (read before decoding), exactly that shape, integer experts below the policy's count; else ``BadAnswer``."""

from __future__ import annotations

import base64
import binascii
import io
import math
from collections.abc import Sequence
from typing import Any

import torch

from aitraining_pl.generation.backend import SampledTokens
from aitraining_pl.generation.servers.replica import ReplicaDown
from aitraining_pl.models.routing_replay import RouteShape, placed_routes, router_rows

#: how far above 0 a log-prob may come back (float rounding of a log-softmax)
LOGPROB_SLACK = 1e-4
#: bytes a ``.npy`` header may take beyond its array's (numpy pads it to 64 bytes; its dict is short)
NPY_HEADER_BYTES = 1024

Row = tuple[list[int], list[float], "list[int] | None"]


class BadAnswer(ReplicaDown):
    """A server answered something that cannot be the answer to the request (see the module docstring)."""


def answer_object(answer: Any, url: str, doing: str) -> dict[str, Any]:
    """``answer`` when it is a JSON object with a ``choices`` list; else ``BadAnswer`` (an HTML page, plain text)."""
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        raise BadAnswer(f"{url}: its answer while {doing} is not a completion (no JSON object with choices)")
    return answer


def checked_rows(rows: Sequence[Any], url: str, doing: str, max_tokens: int, vocab: int | None,
                 step: int | None) -> list[Row]:  # fmt: skip
    """``rows`` of (token ids, log-probs, weights steps or None), each checked against the request (the module
    docstring: ``max_tokens``, ``vocab`` when known, ``step``: the version asked for, when one was); ``BadAnswer``
    naming the server, the choice and what is wrong."""
    out = []
    for i, row in enumerate(rows):
        try:
            tokens, values, versions = row
            tokens, values = [int(t) for t in tokens], [float(v) for v in values]
            versions = None if versions is None else [int(v) for v in versions]
        except (TypeError, ValueError) as err:
            raise BadAnswer(f"{url}: choice {i} of its answer while {doing} cannot be read ({err})") from None
        why = _wrong(tokens, values, versions, max_tokens, vocab, step)
        if why:
            raise BadAnswer(f"{url}: refused its answer while {doing}: choice {i} {why}")
        out.append((tokens, values, versions))
    return out


def _wrong(tokens: list[int], values: list[float], versions: list[int] | None, max_tokens: int, vocab: int | None,
           step: int | None) -> str | None:  # fmt: skip
    if len(values) != len(tokens):
        return f"has {len(values)} log-probs for {len(tokens)} tokens"
    if len(tokens) > max_tokens:
        return f"has {len(tokens)} tokens for max_new_tokens {max_tokens}"
    if vocab is not None and any(not 0 <= t < vocab for t in tokens):
        return f"has token id {next(t for t in tokens if not 0 <= t < vocab)} outside the vocabulary of {vocab}"
    bad = [v for v in values if not (math.isfinite(v) and v <= LOGPROB_SLACK)]
    if bad:
        return f"has log-prob {bad[0]} (log-probs are finite and at most 0)"
    if versions is not None and len(versions) != len(tokens):
        return f"has {len(versions)} weights steps for {len(tokens)} tokens"
    if versions is not None and step is not None and any(v < step for v in versions):
        return f"was sampled by weights of step {min(versions)}, not the step {step} asked for"
    return None


def vocab_of(policy: Any) -> int | None:
    """The rows of ``policy``'s output head: every sampled token id is below it (None when it has no head)."""
    try:
        head = policy.get_output_embeddings()
        return int(head.weight.shape[0])
    except (AttributeError, TypeError, IndexError):
        return None


def choice_tokens(choice: dict[str, Any]) -> tuple[list[int], list[float], list[int] | None]:
    """The token ids, log-probs and (from the HF server, whose pushes may land mid-response) the weights step of
    each token of one completion choice (``token_id:<id>`` tokens)."""
    logprobs = choice.get("logprobs") or {}
    tokens = [int(str(t).rpartition(":")[2]) for t in logprobs.get("tokens") or []]
    values = [float(v) if v is not None else 0.0 for v in logprobs.get("token_logprobs") or []]
    versions = choice.get("token_versions")
    return tokens, values, versions if isinstance(versions, list) else None


def padded_samples(rows: Sequence[tuple], pad_token_id: int, prompt_mask: torch.Tensor | None = None) -> SampledTokens:
    """``rows`` of (ids, log-probs, steps[, routes]) as ``SampledTokens`` right padded with ``pad_token_id`` (log-probs
    0 and steps -1 there; ``token_versions`` only when every row has its steps); with ``prompt_mask`` (N, P), the
    rows' prompts', their routes (``decoded_routes``) in the decoder's layout (``models.routing_replay.placed_routes``;
    ``routes`` only when every row has them)."""
    length = max((len(ids) for ids, *_ in rows), default=0)
    ids = torch.full((len(rows), length), int(pad_token_id), dtype=torch.long)
    logps = torch.zeros(len(rows), length)
    steps = torch.full((len(rows), length), -1, dtype=torch.long)
    for row, (tokens, values, versions, *_) in enumerate(rows):
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        logps[row, : len(tokens)] = torch.tensor(values, dtype=torch.float32)
        if versions is not None:
            steps[row, : len(versions)] = torch.tensor(versions, dtype=torch.long)
    known = bool(rows) and all(row[2] is not None for row in rows)
    routes = None
    if prompt_mask is not None:
        routes = placed_routes([row[3] if len(row) > 3 else None for row in rows], prompt_mask, length)
    return SampledTokens(ids, sampling_logprobs=logps, token_versions=steps if known else None, routes=routes)


def encode_routes(routes: torch.Tensor) -> str:
    """(T, layers, top_k) experts (none below 0) as a choice's ``routed_experts`` (see the module docstring):
    uint8 below 256 experts, else uint16, as vLLM writes them."""
    import numpy as np

    dtype = np.uint8 if routes.numel() == 0 or int(routes.max()) < 256 else np.uint16
    with io.BytesIO() as buffer:
        np.save(buffer, routes.cpu().numpy().astype(dtype), allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii")


def decoded_routes(text: Any, tokens: int, shape: RouteShape, where: str) -> torch.Tensor:
    """The (``tokens``, routers, top_k) int16 routes of a choice's ``routed_experts`` ``text`` for a policy of
    ``shape`` (``models.routing_replay.RouteShape``): one entry per router, or one per decoder layer (vLLM's: every
    layer, the dense ones too), of which the routers' layers are kept; ``BadAnswer`` starting with ``where`` (the
    server, the choice) naming what is wrong."""
    import numpy as np

    depth = max(shape.layers) + 1
    want = (tokens, len(shape.layers), shape.top_k)
    limit = 4 * ((tokens * max(depth, len(shape.layers)) * shape.top_k * 8 + NPY_HEADER_BYTES) // 3 + 1)
    if not isinstance(text, str) or len(text) > limit:
        size = f"{len(text)} characters" if isinstance(text, str) else type(text).__name__
        raise BadAnswer(f"{where} has routed_experts of {size}, not the base64 .npy of {want} (at most {limit})")
    try:
        array = np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    except (ValueError, OSError, EOFError, binascii.Error) as err:
        raise BadAnswer(f"{where} has routed_experts that are not a base64 .npy array ({err})") from None
    if array.ndim == 3 and array.dtype.kind in "iu":
        array = router_rows(torch.from_numpy(array.astype(np.int32)), shape).numpy()
    if array.shape != want or array.dtype.kind not in "iu":
        raise BadAnswer(f"{where} has routed_experts of shape {array.shape} ({array.dtype}), not {want} of ints "
                        "(prompt tokens + response tokens - 1, MoE layers, top_k)")  # fmt: skip
    if array.size and (int(array.min()) < 0 or int(array.max()) >= shape.experts):
        raise BadAnswer(
            f"{where} has expert {int(array.max())} or {int(array.min())} outside the {shape.experts} experts"
        )
    return torch.from_numpy(array.astype(np.int16))
