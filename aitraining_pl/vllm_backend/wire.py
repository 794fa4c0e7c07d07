"""The framing of the generation server's TCP channel (``aitraining-pl vllm-serve`` and its client): JSON headers
and raw tensor bytes, nothing that runs code when read (no pickle from the network).

A frame is::

    b"ATPL"                        4 bytes, the magic
    header length                  4 bytes, unsigned, big-endian (at most ``MAX_HEADER`` bytes)
    header                         UTF-8 JSON object with a string "op" and, optionally, "tensors": a list of
                                   {"name": str, "dtype": one of ``DTYPES``, "shape": [int, ...]}
    payload                        each tensor's bytes in order: C order, little-endian, numel * itemsize bytes

A weight push streams one tensor per frame, so neither side holds a second copy of the model (over a collective
weight channel, ``vllm_backend.weight_group``, each frame carries only a ``describe`` entry and the bytes go by
broadcast). ``read_frame``
refuses a wrong magic, an oversized or non-JSON header, a header that is not an object with an ``op``, an
unknown dtype and a negative or non-integer shape with a ``FrameError`` before reading any payload.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
from collections.abc import Mapping
from typing import Any

import torch

MAGIC = b"ATPL"
MAX_HEADER = 1 << 20  #: largest header (bytes): prompts and samples travel as tensors, not JSON
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
    """``size`` bytes from ``sock``; ``ConnectionError`` when the peer closes first."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
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


def read_frame(sock: socket.socket) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One frame from ``sock``: its header (without ``tensors``) and its tensors by name."""
    start = _read_exact(sock, 8)
    if bytes(start[:4]) != MAGIC:
        raise FrameError(f"bad magic {bytes(start[:4])!r} (expected {MAGIC!r}): not this project's framing")
    (length,) = struct.unpack(">I", start[4:])
    if length > MAX_HEADER:
        raise FrameError(f"header of {length} bytes is over the {MAX_HEADER}-byte limit")
    header, entries = parse_header(bytes(_read_exact(sock, length)))
    tensors = {}
    for name, dtype, shape in entries:
        numel = 1
        for d in shape:
            numel *= d
        size = numel * torch.empty((), dtype=dtype).element_size()
        raw = _read_exact(sock, size)
        data = torch.frombuffer(raw, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        tensors[name] = data.view(dtype).reshape(shape)
    return header, tensors
