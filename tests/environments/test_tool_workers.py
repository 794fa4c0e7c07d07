"""Tools run in a worker process started fresh (not forked from the trainer), each call in its own process group
that is killed with everything it started (issue 34, part 5): a subprocess, a ``setsid`` daemon, a hung call's
children; a tool using torch while the trainer's thread pool is live; arguments nested 1,100 deep; a tool that cannot
reach the worker."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest
import torch

from aitraining_pl.environments.episode import AssistantTurn
from aitraining_pl.environments.multiturn import ToolEnvironment, calculator
from aitraining_pl.environments.tool_worker import ToolWorker
from aitraining_pl.environments.tools import ToolLimits, call_tool
from aitraining_pl.errors import ConfigError


def starts_sleep() -> str:
    """Start `sleep 300` and return its pid."""
    return str(subprocess.Popen(["sleep", "300"]).pid)


def starts_daemon() -> str:
    """Start a `setsid` daemon and return its pid."""
    daemon = subprocess.Popen(["setsid", "sh", "-c", "echo $$; exec sleep 300"], stdout=subprocess.PIPE)
    return daemon.stdout.readline().decode().strip()


def hangs_with_a_child(path: str) -> str:
    """Start `sleep 300`, write its pid to `path`, then wait for it.

    Args:
        path: where the pid goes.
    """
    child = subprocess.Popen(["sleep", "300"])
    with open(path, "w") as handle:
        handle.write(str(child.pid))
    child.wait()
    return "unreachable"


def hangs_with_a_child_reported(fifo: str) -> str:
    """Start `sleep 300`, write its pid to the named pipe `fifo`, then wait for it.

    Args:
        fifo: where the pid goes.
    """
    child = subprocess.Popen(["sleep", "300"])
    with open(fifo, "w") as handle:
        handle.write(str(child.pid))
    child.wait()
    return "unreachable"


def multiplies() -> str:
    """A matrix product with torch."""
    a = torch.ones(256, 256)
    return str(float((a @ a).sum()))


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("tool", [starts_sleep, starts_daemon])
def test_what_a_tool_starts_does_not_outlive_its_call(tool):
    """Before: the `sleep 300` and the `setsid` daemon a tool started were still running after the call."""
    pid, ok = call_tool(tool, {}, ToolLimits(timeout=30.0))
    assert ok and pid.isdigit() and not _alive(int(pid))


def test_a_call_that_times_out_is_killed_with_its_children(tmp_path):
    """Before: the timeout killed the call's process only; its `sleep 300` went on."""
    path = tmp_path / "pid"
    text, ok = call_tool(hangs_with_a_child, {"path": str(path)}, ToolLimits(timeout=1.0))
    assert not ok and text == "error: the tool did not finish within 1 s"
    assert not _alive(int(path.read_text()))


def test_stopping_the_worker_during_a_call_kills_the_call_and_its_children(tmp_path):
    """At exit (e.g. after SIGTERM stopped a run during a tool call) the worker kills the call in flight and what
    it started before it exits; the caller gets an error message."""
    fifo = tmp_path / "pid"
    os.mkfifo(fifo)
    worker, answer = ToolWorker(), []
    caller = threading.Thread(
        target=lambda: answer.append(worker.call(hangs_with_a_child_reported, {"fifo": str(fifo)}, 300.0, 200))
    )
    caller.start()
    pid = int(fifo.read_text())  # opens when the tool writes: the call and its child run
    worker.stop()
    caller.join()
    assert answer == [("error", "the tool worker process died; it is restarted for the next call")]
    assert not _alive(pid)


def test_a_tool_using_torch_answers_while_the_trainers_thread_pool_is_live():
    """Before: forked from a trainer whose 2-thread torch pool had run, the tool hung until its timeout."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.ones(512, 512)
        assert float((a @ a).sum()) > 0  # the pool is live
        assert call_tool(multiplies, {}, ToolLimits(timeout=20.0)) == (str(256.0**3), True)
    finally:
        torch.set_num_threads(threads)


def test_arguments_nested_1100_deep_are_an_error_message_and_the_episode_goes_on():
    """Before: RecursionError escaped ``step`` and stopped the run (the parser caught only ValueError)."""
    env = ToolEnvironment([calculator], reward=lambda p, r, m: [1.0], tool_format="hermes")
    env.reset("Add.", {})
    nested = "[" * 1100 + "]" * 1100
    raw = '<tool_call>{"name": "calculator", "arguments": {"expression": ' + nested + "}}</tool_call>"
    step = env.step(AssistantTurn(raw, raw, [], True, 0))
    assert not step.done and step.metrics == {"tool_calls": 1.0, "tool_errors": 1.0}
    (message,) = step.messages
    assert message["content"].startswith("error: unparsable tool call (nested too deeply): ")
    assert len(message["content"]) < 300


def test_a_tool_that_cannot_reach_the_worker_is_refused_when_the_environment_is_built():
    with pytest.raises(ConfigError, match="tool '.*<lambda>': tools run in a worker process"):
        ToolEnvironment([lambda expression: expression], reward=lambda p, r, m: [1.0])


def dies_leaving_a_grandchild(path: str) -> str:
    """Fork a grandchild that keeps every descriptor (the result pipe too) and sleeps, write its pid to `path`, then
    end this process without a result.

    Args:
        path: where the grandchild's pid goes.
    """
    grandchild = os.fork()
    if grandchild == 0:
        import time

        time.sleep(300)
        os._exit(0)
    with open(path, "w") as handle:
        handle.write(str(grandchild))
    os._exit(3)


def test_a_tool_that_dies_while_its_grandchild_holds_the_result_pipe_is_noticed_at_once(tmp_path):
    """Before: the worker waited on the result pipe only, which the grandchild kept open, so the death was noticed at
    the call's timeout ("did not finish within 20 s"); now the worker waits on the tool's process as well."""
    path = tmp_path / "pid"
    text, ok = call_tool(dies_leaving_a_grandchild, {"path": str(path)}, ToolLimits(timeout=20.0))
    assert not ok and text == "error: the tool's process died without a result"
    assert not _alive(int(path.read_text()))
