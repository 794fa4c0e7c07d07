"""A stranger's idle connections cannot take the agent endpoint's file descriptors (issue 52, round 4): the cap on
open connections sits below what the process may open, and connections that never showed an episode's key are the
first to be closed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from aitraining_pl.agents import server as agent_server  # noqa: E402

HELPERS = Path(__file__).parents[1] / "helpers"


def test_the_connection_cap_sits_below_the_open_files_limit(monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda kind: (1024, 1024))
    assert agent_server.connection_cap() == (1024 - 256) // 2  # before: 2048, twice what the process could open
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (256, 256))
    assert agent_server.connection_cap() == (256 - 64) // 2
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert agent_server.connection_cap() == agent_server.MAX_CONNECTIONS


@pytest.mark.slow  # a subprocess importing torch, transformers and FastAPI: about 20 s here
def test_an_episode_call_goes_through_while_a_stranger_holds_more_connections_than_the_process_can_open():
    """Before: 400 idle connections against a process limited to 384 files exhausted its descriptors, and the
    episode's own call failed (``Too many open files``, or no answer until the stranger let go)."""
    env = {
        "PYTHONPATH": f"{HELPERS.parents[1]}:{HELPERS.parent}:{HELPERS}",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    script = subprocess.Popen(
        [sys.executable, str(HELPERS / "endpoint_fd_script.py"), "384"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**os.environ, **env},
    )  # fmt: skip
    strangers = []
    try:
        port = int(script.stdout.readline())
        strangers = [socket.create_connection(("127.0.0.1", port)) for _ in range(400)]
        script.stdin.write("go\n")
        script.stdin.flush()
        assert script.stdout.readline().strip() == "200"
    finally:
        for sock in strangers:
            sock.close()
        script.kill()
        script.wait()
