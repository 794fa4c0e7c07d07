"""Where tool calls run: a worker process of their own, started fresh (not forked from the trainer) and reused.

The trainer starts one worker per process on the first tool call (``ToolWorker``; about a second or two to import
the tools' modules) and sends it each call. The worker is a new interpreter in its own session (so a torch thread
pool live in the trainer cannot hang a tool that uses torch, as it does in a child forked from the trainer), and a
child subreaper (``sandbox_supervisor.prctl``). Each call runs in a child forked from the worker, leading its own
process group, with its output captured and bounded; when the call returns, fails or passes its timeout, the
worker SIGKILLs that group and every process re-parented to it (``sandbox_supervisor.kill_tree``): a subprocess
the tool started, a ``setsid`` daemon, a hung call and its children do not outlive the call. The worker waits on the
call's result pipe and on its process together, so a call that dies is noticed at once, even while a grandchild
keeps the pipe open. The worker ends when
the trainer closes its end or stops it (at exit: a call in flight is killed with its processes first), or when the
trainer dies (its end closes), so it never outlives the trainer for longer than a call.

Tools must be picklable by reference (module-level functions): they are sent to the worker by name and imported
there, with the trainer's ``sys.path``.
"""

from __future__ import annotations

import atexit
import io
import json
import multiprocessing
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

#: seconds past a call's own timeout the trainer waits for the worker's answer before it kills the worker (the first
#: call of a tool also imports its module in the worker, which the call's timeout does not cover)
_BACKSTOP = 120.0
#: seconds ``ToolWorker.stop`` gives the worker to kill a call in flight and exit before it is killed
_STOP = 15.0


def bounded(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} characters cut]"


def as_text(value: Any) -> str:
    """A tool's result as text: strings as they are, JSON where possible, else ``repr``."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return repr(value)


class _CappedWriter(io.TextIOBase):
    """A text stream that keeps its first ``limit`` characters and drops the rest."""

    def __init__(self, limit: int):
        self.parts, self.kept, self.dropped, self.limit = [], 0, 0, limit

    def write(self, text: str) -> int:
        room = self.limit - self.kept
        if room > 0:
            self.parts.append(text[:room])
            self.kept += len(self.parts[-1])
        self.dropped += max(0, len(text) - max(room, 0))
        return len(text)

    def getvalue(self) -> str:
        tail = f"... [{self.dropped} characters cut]" if self.dropped else ""
        return "".join(self.parts) + tail


def _child(fn: Callable, arguments: dict, limit: int, conn) -> None:
    """Run the tool with its output captured: what it prints (first half of ``limit``), then its result."""
    out = _CappedWriter(limit // 2)
    sys.stdout = sys.stderr = out
    try:
        result = as_text(fn(**arguments))
        printed = out.getvalue()
        conn.send(("ok", (printed + "\n" if printed else "") + bounded(result, limit - len(printed))))
    except BaseException as exc:  # noqa: BLE001 - every failure of a tool is a message to the model
        conn.send(("error", bounded(f"{type(exc).__name__}: {exc}", limit)))
    finally:
        conn.close()


def _run_call(channel: Connection, fn: Callable, arguments: dict, timeout: float, limit: int) -> tuple[str, str]:
    """In the worker: one call in a forked child leading its own process group (without the trainer's ``channel``);
    then the group and everything re-parented to the worker is killed."""
    from aitraining_pl.environments.sandbox_supervisor import kill_tree

    receive, send = multiprocessing.Pipe(duplex=False)
    pid = os.fork()
    if pid == 0:  # the call's process
        try:
            os.setpgid(0, 0)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            channel.close()
            receive.close()
            _child(fn, arguments, limit, send)
        finally:
            os._exit(0)
    send.close()
    try:
        if not _result_or_death(receive, pid, timeout):
            return "error", f"the tool did not finish within {timeout:g} s"
        return receive.recv()
    except (EOFError, OSError):
        return "error", "the tool's process died without a result"
    finally:
        receive.close()
        kill_tree(pid)


def _result_or_death(receive: Connection, pid: int, timeout: float) -> bool:
    """Wait until the call's result can be read, its process ``pid`` has ended or ``timeout`` passed; whether the pipe
    has something to read (its end: the process died without a result). A grandchild that kept the pipe open cannot
    hide the process's death: the wait is on the process too (a pidfd, Linux 5.3+; elsewhere on the pipe only)."""
    from multiprocessing.connection import wait

    try:
        process = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return receive.poll(timeout)
    try:
        wait([receive, process], timeout)
        if receive.poll(0):
            return True
        ended = bool(wait([process], 0))
    finally:
        os.close(process)
    if ended:
        raise EOFError("the tool's process ended without a result")
    return False


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)  # through ``_run_call``'s ``finally``: the call in flight and its processes are killed


def serve(fd: int) -> None:
    """The worker's loop: read a pickled ``(fn, arguments, timeout, limit)`` from the trainer's socket ``fd``,
    answer ``(status, text)``; return when the trainer closes its end."""
    from aitraining_pl.environments.sandbox_supervisor import PR_SET_CHILD_SUBREAPER, prctl

    prctl(PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # ``ToolWorker.stop``: a call in flight is killed first
    conn = Connection(fd)
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            fn, arguments, timeout, limit = pickle.loads(request)
        except Exception as err:  # noqa: BLE001 - a tool that cannot be imported here is the call's error
            conn.send(("error", bounded(f"the tool cannot be loaded in its worker: {type(err).__name__}: {err}", 500)))
            continue
        conn.send(_run_call(conn, fn, arguments, timeout, limit))


_BOOT = "import sys; from aitraining_pl.environments.tool_worker import serve; serve(int(sys.argv[1]))"


class ToolWorker:
    """The trainer's end of a worker (see the module docstring): started on the first call, reused, restarted
    after it died or stopped answering. Calls are serialised (one at a time)."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._owner = os.getpid()

    def _start(self) -> Connection:
        if self._owner != os.getpid():  # a forked copy of the trainer: the worker is the parent's, start its own
            self._proc, self._conn, self._owner = None, None, os.getpid()
        if self._proc is None or self._proc.poll() is not None:
            self.stop()
            ours, theirs = socket.socketpair()
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
            theirs.close()
            self._conn = Connection(ours.detach())
        return self._conn

    def call(self, fn: Callable, arguments: dict, timeout: float, limit: int) -> tuple[str, str]:
        """``(status, text)`` of ``fn(**arguments)`` run in the worker: ``ok`` and the bounded output and result,
        or ``error`` and why. Arguments that cannot be pickled raise here (the caller makes them a message)."""
        request = pickle.dumps((fn, arguments, float(timeout), int(limit)))
        with self._lock:
            conn = self._start()
            try:
                conn.send_bytes(request)
                if conn.poll(timeout + _BACKSTOP):
                    return conn.recv()
                why = "did not answer"
            except (EOFError, OSError):
                why = "died"
            self.stop()
            return "error", f"the tool worker process {why}; it is restarted for the next call"

    def stop(self) -> None:
        """End the worker: SIGTERM (it kills a call in flight with its processes, then exits), SIGKILL to its
        process group if it has not exited within ``_STOP`` seconds. A forked copy of the trainer leaves it alone."""
        if self._owner != os.getpid():
            return
        (conn, self._conn), (proc, self._proc) = (self._conn, None), (self._proc, None)  # a call may stop it too
        if conn is not None:
            conn.close()
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(_STOP)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


#: the worker of this process (``tools.call_tool``)
WORKER = ToolWorker()
atexit.register(WORKER.stop)
