"""An agent's own thread that calls ``os._exit(0)`` stops the run loudly instead of ending it silently with status 0
(issue 52, round 4): ``guarded_call.exits_watched`` turns the exit into ``ExitCalled`` in that thread and the agent
environment raises one ``RewardError`` naming the agent, the thread and the code. Run in a subprocess: before the fix
the process simply ended."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from aitraining_pl.guarded_call import ExitCalled, exits_watched

HELPERS = Path(__file__).parents[1] / "helpers"


@pytest.mark.slow  # a subprocess importing torch, transformers and FastAPI: about 20 s here
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_agent_thread_calling_os_exit_stops_the_run_with_one_line(kind):
    pytest.importorskip("fastapi")
    paths = f"{HELPERS.parents[1]}:{HELPERS.parent}:{HELPERS}"
    env = {**os.environ, "PYTHONPATH": paths, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(HELPERS / "agent_exit_script.py"), kind], capture_output=True,
                         text=True, env=env, timeout=300)  # fmt: skip
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 3 and lines, (run.returncode, run.stdout, run.stderr[-2000:])
    assert lines[-1].startswith("RewardError: agent ") and "('agent-helper') called os._exit(0)" in lines[-1]


def test_exits_watched_leaves_the_main_thread_and_forked_children_alone():
    caught = []
    with exits_watched() as seen:
        worker = threading.Thread(target=lambda: caught.append(_exit_raises(4)), name="helper")
        worker.start()
        worker.join()
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    assert caught == [4] and seen == [("helper", 4)] and status == 7


def _exit_raises(code: int):
    try:
        os._exit(code)
    except ExitCalled as err:
        return err.code
