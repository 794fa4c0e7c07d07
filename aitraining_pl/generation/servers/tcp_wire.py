"""The wire protocol of the generation server (``aitraining-pl serve``, ``servers.tcp_server``) and its client
(``generation.servers.client``): the vocabulary both sides share (``PROTOCOL``, ``MODEL_FIELDS``, ``SAMPLED``, the token
and its proof) and the framing of the TCP channel: JSON headers and raw tensor bytes, nothing that runs code when read
(no pickle from the network).

A frame is::

    b"ATPL"                        4 bytes, the magic
    header length                  4 bytes, unsigned, big-endian (at most ``MAX_HEADER`` bytes)
    header                         UTF-8 JSON object with a string "op" and, optionally, "tensors": a list of
                                   {"name": str, "dtype": one of ``DTYPES``, "shape": [int, ...]}
    payload                        each tensor's bytes in order: C order, little-endian, numel * itemsize bytes

A weight push streams one tensor per frame, so neither side holds a second copy of the model (over a collective
weight channel, ``generation.servers.weights``, each frame carries only a ``describe`` entry and the bytes go by
broadcast). ``read_frame``
refuses a wrong magic, an oversized or non-JSON header, a header that is not an object with an ``op``, an
unknown dtype and a negative or non-integer shape with a ``FrameError`` before reading any payload; its ``check``
(the server's) sees the header and the declared tensors before their bytes are read, and the bytes are read in
chunks of at most ``CHUNK``, so a header that declares gigabytes allocates only what has arrived.

**The token.** Every connection proves at ``hello`` that it holds the server's shared secret: the server answers
``hello`` with a ``challenge`` (a random nonce) and the client sends ``auth`` with ``proof(token, nonce, run,
rank)``, an HMAC-SHA256 the server compares with ``hmac.compare_digest``; the token itself never travels. Both
sides find the token in the same places (``TOKEN_ENV``; a token file; on loopback, ``token_path(port)``, which
``vllm-serve`` writes when it generates one). docs/vllm.md, Server mode.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

PROTOCOL = (
    4  #: version of the request/answer vocabulary (``hello`` checks it; 3: the token's challenge at hello; 4: the
)
#: ``logprobs`` request and ``hello``'s role)
#: config fields the server and the policy must share (the weights are loaded by these shapes)
MODEL_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
#: the tensors of a ``samples`` answer: response ids (int64), the sampled tokens' log-probs (float32) and the step of
#: the weights that sampled each token (int64, -1 after the end; a server before in-flight pushes sends none)
SAMPLED = ("response_ids", "sampling_logprobs", "token_versions")
RESUME = "restart the server and resume the run from its last checkpoint with --ckpt_path"
TOKEN_ENV = "AITRAINING_PL_SERVER_TOKEN"  #: the environment variable that holds the server's token

MAGIC = b"ATPL"
MAX_HEADER = 1 << 20  #: largest header (bytes): prompts and samples travel as tensors, not JSON
CHUNK = 1 << 22  #: most bytes of a payload allocated ahead of their arrival
#: the dtypes a frame may carry, by their torch name
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    )
}  # fmt: skip
if sys.byteorder != "little":  # pragma: no cover - the payload is this machine's memory, sent as is
    raise ImportError("the generation server's framing needs a little-endian machine")


class FrameError(ValueError):
    """A frame that breaks the framing above (the connection is not usable after it)."""


#: ``(name, dtype, shape)`` of a tensor a header declares
Entry = tuple[str, torch.dtype, list[int]]


def model_description(config: Any) -> dict[str, Any]:
    """The ``MODEL_FIELDS`` of a transformers config (what ``hello`` answers and the client compares)."""
    return {name: getattr(config, name, None) for name in MODEL_FIELDS}


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def token_path(port: int) -> Path:
    """The owner-only file where ``vllm-serve`` on loopback ``port`` writes the token it generated (and where a
    client on loopback looks for it): under ``$XDG_RUNTIME_DIR/aitraining_pl`` (a per-user folder), else
    ``~/.cache/aitraining_pl``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) if runtime else Path.home() / ".cache"
    return folder / "aitraining_pl" / f"vllm-serve-{port}.token"


def proof(token: str, nonce: str, run: str, rank: int) -> str:
    """The answer to a ``challenge``: HMAC-SHA256 of the nonce, the run and the rank under ``token`` (hex)."""
    message = f"aitraining-pl hello {nonce} {run} {rank}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise FrameError(f"dtype {name} cannot be sent; known: {', '.join(DTYPES)}")
    return name


def describe(name: str, tensor: torch.Tensor) -> dict[str, Any]:
    """The header entry of a tensor: its name, dtype and shape."""
    return {"name": name, "dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape)}


def parse_entry(entry: Any) -> tuple[str, torch.dtype, list[int]]:
    """``(name, dtype, shape)`` of a header entry (``describe``); ``FrameError`` when malformed."""
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise FrameError(f"tensor entry {entry!r} has no string name")
    dtype, shape = entry.get("dtype"), entry.get("shape")
    if dtype not in DTYPES:
        raise FrameError(f"tensor {entry['name']!r}: unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise FrameError(f"tensor {entry['name']!r}: shape {shape!r} is not a list of non-negative integers")
    return entry["name"], DTYPES[dtype], shape


def _raw(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` (C order) without a copy when it is already contiguous on the CPU."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def encode(header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None) -> list[bytes | memoryview]:
    """The pieces of one frame (``socket.sendall`` each in turn): ``header`` plus ``tensors`` in order."""
    tensors = dict(tensors or {})
    entries = [describe(k, t) for k, t in tensors.items()]
    text = json.dumps({**header, "tensors": entries} if entries else dict(header)).encode()
    if len(text) > MAX_HEADER:
        raise FrameError(f"header of {len(text)} bytes is over the {MAX_HEADER}-byte limit")
    return [MAGIC + struct.pack(">I", len(text)) + text, *(_raw(t) for t in tensors.values())]


def send_frame(sock: socket.socket, header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None):
    for piece in encode(header, tensors):
        sock.sendall(piece)


def _read_exact(sock: socket.socket, size: int) -> bytearray:
    """``size`` bytes from ``sock``, allocated ``CHUNK`` by ``CHUNK`` as they arrive (a peer that declares more
    than it sends costs no memory); ``ConnectionError`` when the peer closes first."""
    buffer = bytearray(min(size, CHUNK))
    got = 0
    while got < size:
        if got == len(buffer):
            buffer.extend(bytes(min(size - got, CHUNK)))
        n = sock.recv_into(memoryview(buffer)[got:], len(buffer) - got)
        if n == 0:
            raise ConnectionError("the connection was closed" + (" mid-frame" if got else ""))
        got += n
    return buffer


def parse_header(text: bytes) -> tuple[dict[str, Any], list[tuple[str, torch.dtype, list[int]]]]:
    """The header object and its ``(name, dtype, shape)`` tensor entries; ``FrameError`` when malformed."""
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise FrameError(f"the header is not UTF-8 JSON ({error})") from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise FrameError('the header is not a JSON object with a string "op"')
    entries = header.pop("tensors", [])
    if not isinstance(entries, list):
        raise FrameError('"tensors" is not a list')
    return header, [parse_entry(entry) for entry in entries]


def nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape``."""
    numel = 1
    for d in shape:
        numel *= d
    return numel * torch.empty((), dtype=dtype).element_size()


def _skip(sock: socket.socket, size: int) -> None:
    """Read ``size`` bytes from ``sock`` and drop them (at most ``CHUNK`` held at a time)."""
    scratch = memoryview(bytearray(min(size, CHUNK)))
    while size > 0:
        n = sock.recv_into(scratch, min(size, len(scratch)))
        if n == 0:
            raise ConnectionError("the connection was closed mid-frame")
        size -= n


def read_frame(
    sock: socket.socket,
    check: Callable[[dict[str, Any], list[Entry]], bool | None] | None = None,
    max_header: int = MAX_HEADER,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One frame from ``sock``: its header (without ``tensors``) and its tensors by name. ``check(header,
    entries)`` runs before any payload is read: it raises ``FrameError`` to refuse the frame (the connection is
    then out of step), or returns False to have the payload read and dropped (no tensors returned). A header
    longer than ``max_header`` bytes is refused before it is read."""
    start = _read_exact(sock, 8)
    if bytes(start[:4]) != MAGIC:
        raise FrameError(f"bad magic {bytes(start[:4])!r} (expected {MAGIC!r}): not this project's framing")
    (length,) = struct.unpack(">I", start[4:])
    if length > max_header:
        raise FrameError(f"header of {length} bytes is over the {max_header}-byte limit")
    header, entries = parse_header(bytes(_read_exact(sock, length)))
    keep = check is None or check(header, entries) is not False
    tensors = {}
    for name, dtype, shape in entries:
        size = nbytes(dtype, shape)
        if not keep:
            _skip(sock, size)
            continue
        raw = _read_exact(sock, size)
        data = torch.frombuffer(raw, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        tensors[name] = data.view(dtype).reshape(shape)
    return header, tensors
