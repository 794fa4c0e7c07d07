"""The `tinker` client's protobuf bodies, read and written with the client's own generated module
(``tinker.proto.tinker_public_pb2``): the ``/api/v1/forward_backward`` request it sends, and the
``ForwardBackwardOutput`` and ``SampleResponse`` it reads from ``/api/v1/retrieve_future`` when it asks for
``application/x-protobuf``.

Requests are checked here, before any work is queued: only text chunks, dense float32 / int64 tensors of one
dimension, each as long as the datum's tokens, and at most ``limits`` tokens and datums."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from aitraining_pl.losses.tinker import TINKER_LOSS_INPUTS, TINKER_LOSSES, UNSERVED_LOSSES, loss_config

PROTO = "application/x-protobuf"
#: an empty cell of a ``TopkLogprobs`` matrix (the client's ``tinker.types.topk_logprobs.MASK_LOGPROB``)
MASK_LOGPROB = -99999.0


def pb():
    """The client's generated protobuf module (imported lazily: the server extra installs ``tinker``)."""
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400) with one message naming the field."""


@dataclass
class Datum:
    tokens: list[int]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  #: float tensors (N,); ``target_tokens`` int64


@dataclass
class FwdBwd:
    model_id: str
    loss_fn: str
    config: dict[str, float]
    data: list[Datum]
    forward_only: bool


def _tensor(msg, where: str) -> torch.Tensor:
    p = pb()
    dtype = {p.DTYPE_FLOAT32: np.float32, p.DTYPE_INT64: np.int64, p.DTYPE_INT32: np.int32}.get(msg.dtype)
    if dtype is None or msg.WhichOneof("encoding") != "dense":
        raise BadRequest(f"{where}: only dense float32 / int64 tensors are accepted")
    array = np.frombuffer(msg.dense, dtype=dtype)
    shape = list(msg.shape) or [array.size]
    if math.prod(shape) != array.size:
        raise BadRequest(f"{where}: shape {shape} does not match its {array.size} values")
    return torch.from_numpy(array.copy()).reshape(shape)


def read_forward_backward(body: bytes, max_tokens: int, max_datums: int, vocab: int) -> FwdBwd:
    """Parse and check a ``ForwardBackwardRequest`` body (see the module docstring)."""
    p = pb()
    msg = p.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as error:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise BadRequest(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({error})") from None
    if msg.loss_fn in UNSERVED_LOSSES:
        raise BadRequest(f"forward_backward: loss_fn {msg.loss_fn!r} is not served: {UNSERVED_LOSSES[msg.loss_fn]}")
    if msg.loss_fn not in TINKER_LOSSES:
        raise BadRequest(f"forward_backward: unknown loss_fn {msg.loss_fn!r}; built in: {', '.join(TINKER_LOSSES)}")
    given = {k: v.number for k, v in msg.loss_fn_config_v2.items()} or dict(msg.loss_fn_config)
    try:
        config = loss_config(msg.loss_fn, given)
    except ValueError as error:
        raise BadRequest(f"forward_backward: {error}") from None
    if not msg.data:
        raise BadRequest("forward_backward: no data")
    if len(msg.data) > max_datums:
        raise BadRequest(f"forward_backward: {len(msg.data)} datums; this server takes at most {max_datums} a request")
    data, total = [], 0
    for i, datum in enumerate(msg.data):
        data.append(_datum(datum, i, msg.loss_fn, vocab))
        total += len(data[-1].tokens)
    if total > max_tokens:
        raise BadRequest(f"forward_backward: {total} tokens; this server takes at most {max_tokens} a request")
    return FwdBwd(msg.model_id, msg.loss_fn, config, data, msg.forward_only)


def _datum(datum, i: int, loss_fn: str, vocab: int) -> Datum:
    tokens: list[int] = []
    for chunk in datum.model_input:
        if not chunk.HasField("encoded_text"):
            raise BadRequest(f"data[{i}].model_input: only text chunks are served (no images or audio)")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    n = len(tokens)
    if n == 0:
        raise BadRequest(f"data[{i}].model_input is empty")
    inputs = {}
    needed = ("target_tokens", *TINKER_LOSS_INPUTS[loss_fn])
    for name in needed:
        if name not in datum.loss_fn_inputs:
            if name == "weights":  # cross_entropy without weights trains on every target
                inputs[name] = torch.ones(n)
                continue
            raise BadRequest(f"data[{i}].loss_fn_inputs needs {name!r} for loss_fn {loss_fn!r}")
        tensor = _tensor(datum.loss_fn_inputs[name], f"data[{i}].loss_fn_inputs[{name!r}]")
        if tuple(tensor.shape) != (n,):
            raise BadRequest(
                f"data[{i}].loss_fn_inputs[{name!r}] has shape {list(tensor.shape)}; the model input has {n} "
                f"tokens, so it must be [{n}]"
            )
        if name == "target_tokens":
            tensor = tensor.long()
            if int(tensor.min()) < 0 or int(tensor.max()) >= vocab:
                raise BadRequest(f"data[{i}].loss_fn_inputs['target_tokens'] holds ids outside [0, {vocab})")
        else:
            tensor = tensor.float()
            if not torch.isfinite(tensor).all():
                raise BadRequest(f"data[{i}].loss_fn_inputs[{name!r}] holds NaN or infinite values")
        inputs[name] = tensor
    if min(tokens) < 0 or max(tokens) >= vocab:
        raise BadRequest(f"data[{i}].model_input holds token ids outside [0, {vocab})")
    return Datum(tokens, inputs)


def _batched(arrays: list[np.ndarray], dtype) -> object:
    p = pb()
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
    code = p.DTYPE_FLOAT32 if dtype == np.float32 else p.DTYPE_INT64
    return p.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=code)


def write_forward_backward(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A ``ForwardBackwardOutput`` with one ArrayRecord: per datum, each named float32 array (N,)."""
    p = pb()
    record = p.ArrayRecord(num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        record.fields[name].CopyFrom(_batched([o[name].astype(np.float32) for o in outputs], np.float32))
    msg = p.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    return msg.SerializeToString()


def write_sample(sequences: list[dict], prompt_logprobs: list[float] | None, topk=None) -> bytes:
    """A ``SampleResponse``: per sequence its tokens (int32), log-probs (float32) and stop reason; prompt
    log-probs as float32 with NaN where there is none (the first token); ``topk``: the prompt's top-k ``(ids,
    logprobs)`` (P, k) as a ``TopkLogprobs`` (empty cells: id 0, ``MASK_LOGPROB``)."""
    p = pb()
    msg = p.SampleResponse()
    for seq in sequences:
        reason = p.STOP_REASON_STOP if seq["stop_reason"] == "stop" else p.STOP_REASON_LENGTH
        msg.sequences.add(
            stop_reason=reason,
            tokens=np.asarray(seq["tokens"], dtype=np.int32).tobytes(),
            logprobs=np.asarray(seq["logprobs"], dtype=np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if topk is not None:
        ids, logprobs = (np.ascontiguousarray(np.asarray(t)) for t in topk)
        msg.topk_prompt_logprobs.CopyFrom(p.TopkLogprobs(
            token_ids=ids.astype(np.int32).tobytes(), logprobs=logprobs.astype(np.float32).tobytes(),
            k=int(ids.shape[1]), length=int(ids.shape[0])))  # fmt: skip
    return msg.SerializeToString()
