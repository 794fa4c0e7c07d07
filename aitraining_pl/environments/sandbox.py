"""A sandbox for running model-written Python against test statements (Linux; degraded elsewhere).

``run_tests(code, tests, limits)`` starts a *supervisor* (a fresh ``python -I -S sandbox_supervisor.py`` in
its own session) that starts the *candidate* (another fresh interpreter running ``code``) and runs each test
statement itself. Pass/fail is decided only by the supervisor: every name the candidate defines is a proxy
in the test's namespace, calling it sends the call to the candidate over a pipe, and only plain data (numbers,
strings, bytes, ``None`` and lists/tuples/sets/dicts of them, parsed with ``ast.literal_eval``) comes back;
anything else stays an opaque handle that cannot be compared, has no truth value and supports only calls,
attribute and item access. The test statements and their expected values never enter the candidate's
process, and nothing the candidate prints is parsed, so a forged result line, replaced ``exec``/builtins,
an object whose ``__eq__`` is always true or frame inspection cannot raise the score: the candidate can only
return values. Only the supervisor's result line reaches the trainer (the tests' own prints go to
``/dev/null``); the trainer reads it with a byte cap and clamps ``passed`` to ``[0, total]``.

What tests can do: call the candidate's functions and classes with plain-data arguments or its own objects,
read attributes and items, compare returned plain data, and catch the built-in exception types it raises
(other exception types arrive as ``CandidateError``). Test statements share one namespace, in order. A test
cannot pass a callable of its own to the candidate, use an object of the candidate as a truth value or
compare two of its objects, and a name of the candidate that is also a built-in (``len``, ``sorted``, ``max``)
or starts with an underscore (``__builtins__``, ``_helper``) is not visible to the tests: the built-ins and the
harness's own names stay, whatever the candidate sends through its reply channel.

Layers, each applied where the platform allows and reported in ``TestRunResult.isolation``:

- ``subreaper``: the supervisor is a child subreaper (``prctl``), so grandchildren that ``setsid`` and
  double-fork are re-parented to it; at the end it SIGKILLs the candidate's process group and then every
  remaining descendant until none is left. The supervisor itself is not dumpable (``/proc/<pid>/mem``, ``fd``)
  and dies with the trainer, the candidate dies with the supervisor (``PR_SET_PDEATHSIG``).
- ``pid-namespace``: the candidate is PID 1 of a new PID namespace; when it is killed the kernel kills every
  process in it (fork bombs and ``setsid`` grandchildren included). ``private-proc``: it sees only its own
  processes in ``/proc``.
- ``no-network``: a new network namespace with no interfaces but a down loopback.
- ``read-only-root``: a new mount namespace where every mount is read-only except the private working directory
  (``mount_setattr``, Linux >= 5.12).
- ``private-data``: in that mount namespace, an empty tmpfs over every top-level folder but the system's
  (``sandbox_supervisor.SYSTEM_FOLDERS``: ``/usr``, ``/lib*``, ``/bin``, ``/sbin``, ``/etc``, ``/dev``, ``/proc``,
  ``/sys``, ``/tmp``, ``/run``, ``/nix``, ``/gnu``) and ``/dev/null`` over every top-level file, with only the
  interpreter's folders bound back in: the candidate reads none of the run's data, code, checkpoints or home
  folders, nor files such as a container's ``/container_info.json``.
- ``private-tmp``: in that mount namespace, an empty tmpfs over ``/tmp``, ``/var/tmp``, ``/run``, ``/var/run``,
  ``/dev/shm`` and ``/var/lock`` (no Unix socket or file another process put there is reachable), and the
  working directory is a tmpfs of ``scratch_bytes`` (default 64 MiB) owned by the candidate: its files live in
  memory, are capped in total, and vanish with the namespace, even when the trainer is killed with ``kill -9``
  (the empty folder left on disk is removed by the next run once its supervisor's pid is gone).
- ``uid-nobody`` (when the trainer runs as root): the candidate runs as ``nobody`` with no groups, so it can
  neither write the user's files nor read the trainer's or supervisor's memory, and ``RLIMIT_NPROC`` applies.
  ``interpreter-exposed``: an interpreter in a folder closed to other users (``~/.pyenv``, a venv's base in
  a home folder, conda) is bound into the candidate's mount namespace with its whole installation
  (``sys.base_prefix``: standard library, ``lib-dynload``, ``libpython``), so the candidate runs the trainer's
  own Python, not whatever ``/usr/lib/python3.X`` the machine has; without a mount namespace it must be
  executable by ``nobody``, otherwise the candidate does not start: ``CodeGenerationEnv`` then raises
  ``SandboxError`` once when it is built, rather than running the code as root or scoring every test 0.
  As a non-root user the namespaces come from an unprivileged user namespace (``user-namespace``) where the
  kernel allows it; the candidate keeps the user's uid (no capabilities after ``exec``).
- ``rlimits``: CPU seconds, address space, file size, open files, no core dumps, and a process count.
- Always: a fresh private temporary working directory, an empty environment, stdin closed, ``no_new_privs``,
  the candidate's output drained with a byte cap (only the first ``output_bytes`` are kept), a wall-clock limit
  for the whole run.

Not protected against: reading any file the candidate's uid may read (world-readable files, and all of the
user's files when not root); a Unix socket outside the hidden folders whose mode lets that uid connect (e.g. a
``0777`` socket in a home folder); kernel exploits and side channels; CPU and memory contention with the trainer
within the limits; filling ``scratch_bytes`` of memory (without ``private-tmp``: disk in the working directory,
``file_bytes`` per file, with no total cap); and, without the
namespaces (non-root without user namespaces, containers that forbid ``unshare``), network access, writes
anywhere the user may write, and processes that escape a process-group kill before the subreaper sweep. On
macOS and other POSIX systems only the rlimits, the process-group kill and the separate process apply; on
Windows the tests are not run (every test fails with an error). Run untrusted code inside a container or VM
with its network off where these layers are missing. ``limits.timeout`` covers the whole run.

Also not prevented (not a sandbox matter): the candidate sees each call's arguments and may hard-code answers
for them; it can make a run last until the time limit. The tests themselves are trusted code and run in the
supervisor with only the trainer's backstop limit (``timeout`` + 10 s).
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

#: The supervisor script: standard library only, run by path with ``python -I -S``.
SUPERVISOR_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_supervisor.py")


@dataclass
class SandboxLimits:
    """Limits of one sandboxed run.

    Args:
        timeout: wall-clock seconds for the whole run (starting the candidate and every test).
        cpu_seconds: CPU seconds of the candidate (default: ``ceil(timeout) + 1``).
        memory_bytes: address-space limit of the candidate.
        file_bytes: largest file the candidate may write.
        max_processes: processes the candidate may start (added to those its uid already has).
        open_files: file descriptors the candidate may hold.
        output_bytes: candidate output kept (stdout and stderr together); the rest is read and dropped.
        reply_bytes: largest reply (one returned value) the supervisor accepts from the candidate.
        result_bytes: largest result line the trainer reads from the supervisor, besides the kept output.
        scratch_bytes: size of the candidate's working directory, a private tmpfs (in memory) where a mount
            namespace is available; elsewhere only ``file_bytes`` per file applies.
    """

    timeout: float = 5.0
    cpu_seconds: int = 0
    memory_bytes: int = 1 << 30
    file_bytes: int = 1 << 20
    max_processes: int = 32
    open_files: int = 64
    output_bytes: int = 4096
    reply_bytes: int = 1 << 20
    result_bytes: int = 1 << 16
    scratch_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        if self.cpu_seconds <= 0:
            self.cpu_seconds = int(math.ceil(self.timeout)) + 1


@dataclass
class TestRunResult:
    """Outcome of a sandboxed test run: tests passed out of ``total`` (``0 <= passed <= total``), whether the
    time limit hit, an error message, the start of the candidate's output and the isolation layers applied
    (see the ``sandbox`` module docstring)."""

    __test__ = False  # not a pytest class

    passed: int
    total: int
    timed_out: bool = False
    error: str = ""
    output: str = ""
    isolation: tuple[str, ...] = ()

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def _read_capped(fd: int, cap: int, deadline: float) -> tuple[bytes, bool]:
    """Read ``fd`` until EOF, at most ``cap`` bytes kept; returns (data, whether the deadline passed first)."""
    chunks, size = [], 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return b"".join(chunks), True
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks), False
        if size < cap:
            chunks.append(chunk[: cap - size])
            size += len(chunks[-1])


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.kill()
    proc.wait()


def _parse_result(raw: bytes, total: int) -> TestRunResult:
    try:
        data = json.loads(raw.decode("utf-8").strip().splitlines()[-1])
        passed = min(max(int(data["passed"]), 0), total)
        return TestRunResult(
            passed, total, timed_out=bool(data.get("timed_out")), error=str(data.get("error", "")),
            output=str(data.get("output", "")), isolation=tuple(str(t) for t in data.get("isolation", ())),
        )  # fmt: skip
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError):
        return TestRunResult(0, total, error="the sandbox supervisor returned no result")


def run_tests(
    code: str, tests: Sequence[str], limits: SandboxLimits | None = None, python: str | None = None
) -> TestRunResult:
    """Run ``code`` and then each test statement (Python that raises when the test fails) in the sandbox.
    ``python`` runs the supervisor (default: this interpreter); the candidate runs its base interpreter."""
    limits = limits or SandboxLimits()
    tests = [str(t) for t in tests]
    if not tests:
        return TestRunResult(0, 0)
    if os.name != "posix":
        return TestRunResult(0, len(tests), error=f"the code sandbox does not run on {sys.platform}")
    spec = json.dumps({"code": code, "tests": tests, "limits": asdict(limits)}).encode()
    proc = subprocess.Popen(
        [python or sys.executable, "-I", "-S", SUPERVISOR_PATH], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, env={}, start_new_session=True, close_fds=True,
    )  # fmt: skip
    # the supervisor enforces limits.timeout itself; this is the backstop if it hangs
    deadline = time.monotonic() + limits.timeout + 10.0
    try:
        try:
            proc.stdin.write(spec)
            proc.stdin.close()
        except BrokenPipeError:
            pass
        # the result line holds the kept output, JSON-escaped (at most 6 characters a byte)
        raw, late = _read_capped(proc.stdout.fileno(), limits.result_bytes + 6 * limits.output_bytes, deadline)
    finally:
        proc.stdout.close()
        if proc.poll() is None:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
    if late:
        return TestRunResult(0, len(tests), timed_out=True, error="the sandbox supervisor did not finish")
    return _parse_result(raw, len(tests))
