"""The wire protocol of the generation server (``generation/servers/tcp_wire.py``): what a frame may make the
reader allocate before its bytes arrive, the server's ``check`` before any payload, and the token's proof and
file. No vLLM needed."""

from __future__ import annotations

import socket
import struct
import tracemalloc

import pytest
import torch

from aitraining_pl.generation.servers import tcp_wire as wire
from aitraining_pl.generation.servers.tcp_wire import MAGIC, FrameError, read_frame, send_frame


def declare(sock: socket.socket, shape: list[int], dtype: str = "float32") -> None:
    """A ``weight`` header that declares one tensor of ``shape`` (and none of its bytes)."""
    header = f'{{"op": "weight", "tensors": [{{"name": "w", "dtype": "{dtype}", "shape": {shape}}}]}}'.encode()
    sock.sendall(MAGIC + struct.pack(">I", len(header)) + header)


def test_a_declared_payload_is_not_allocated_before_its_bytes_arrive():
    """A ~100-byte header that declares 512 MiB followed by 16 bytes: the reader holds about what arrived (one
    ``CHUNK``), not 512 MiB (before: ``bytearray(size)`` up front, 512 MiB per such header)."""
    a, b = socket.socketpair()
    try:
        declare(a, [128 << 20])
        a.sendall(b"\0" * 16)
        a.close()
        tracemalloc.start()
        try:
            with pytest.raises(ConnectionError, match="mid-frame"):
                read_frame(b)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 * wire.CHUNK, f"{peak / 2**20:.0f} MiB allocated for 16 bytes"
    finally:
        b.close()


def test_a_payload_in_many_chunks_arrives_whole():
    """A tensor larger than ``CHUNK`` is read chunk by chunk, bit for bit."""
    a, b = socket.socketpair()
    tensor = torch.randn(wire.CHUNK // 4 * 2 + 3)
    try:
        sender = __import__("threading").Thread(target=send_frame, args=(a, {"op": "weight"}, {"w": tensor}))
        sender.start()
        header, got = read_frame(b)
        sender.join()
        assert header == {"op": "weight"} and torch.equal(got["w"], tensor)
    finally:
        a.close()
        b.close()


def test_check_refuses_a_frame_before_its_payload_is_read():
    """``read_frame``'s ``check`` sees the header and the declared tensors before any payload byte is read."""
    a, b = socket.socketpair()
    seen = []

    def check(header, entries):
        seen.append((header["op"], entries))
        raise FrameError("not this one")

    try:
        declare(a, [2, 3])
        with pytest.raises(FrameError, match="not this one"):
            read_frame(b, check)
        assert seen == [("weight", [("w", torch.float32, [2, 3])])]
        b.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing of the (unsent) payload was waited for
            b.recv(1)
    finally:
        a.close()
        b.close()


def test_a_header_over_the_callers_limit_is_refused_unread():
    a, b = socket.socketpair()
    try:
        a.sendall(MAGIC + struct.pack(">I", 5000))
        with pytest.raises(FrameError, match="header of 5000 bytes is over the 4096-byte limit"):
            read_frame(b, max_header=4096)
    finally:
        a.close()
        b.close()


def test_the_proof_binds_the_token_the_nonce_the_run_and_the_rank():
    base = wire.proof("secret", "n1", "run", 0)
    assert len(base) == 64 and base == wire.proof("secret", "n1", "run", 0)
    others = [("other", "n1", "run", 0), ("secret", "n2", "run", 0), ("secret", "n1", "run2", 0)]
    others.append(("secret", "n1", "run", 1))
    assert all(wire.proof(*args) != base for args in others)
    assert "secret" not in base


def test_the_token_file_is_per_user_and_named_by_port(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert wire.token_path(8123) == tmp_path / "aitraining_pl" / "vllm-serve-8123.token"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert wire.token_path(8000) == tmp_path / "home" / ".cache" / "aitraining_pl" / "vllm-serve-8000.token"


@pytest.mark.parametrize(
    "host, loopback",
    [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("localhost", True), ("0.0.0.0", False),
     ("10.0.0.5", False), ("gpu-node-3", False)],
)  # fmt: skip
def test_loopback_hosts(host, loopback):
    assert wire.is_loopback(host) is loopback
