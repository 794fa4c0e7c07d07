"""The sandbox supervisor (see ``aitraining_pl.environments.sandbox`` for what it does and does not protect).

Run as ``python -I -S sandbox_supervisor.py`` with a JSON spec ``{"code", "tests", "limits"}`` on stdin; prints
one JSON line ``{"passed", "timed_out", "error", "output", "isolation"}``. Standard library only: it runs in
isolated mode without the project on ``sys.path``.
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import json
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

#: Run in the candidate's process (see that file's docstring).
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_candidate.py")) as _source:
    CANDIDATE_SOURCE = _source.read()

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 4, 38, 36
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, AT_RECURSIVE, AT_FDCWD = 0x1, 0x2, 0x8000, -100
MNT_DETACH = 2
SYS_MOUNT_SETATTR = 442 if platform.machine() in ("x86_64", "aarch64", "arm64") else None
NOBODY = 65534
#: The candidate runs the base interpreter (a venv's ``bin/python`` may be a link into a folder closed to others).
INTERPRETER = os.path.realpath(sys.executable)

_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


class _MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]


def prctl(option: int, value: int) -> bool:
    return _LIBC is not None and _LIBC.prctl(option, ctypes.c_ulong(value), 0, 0, 0) == 0


def _unshare(flags: int) -> bool:
    return _LIBC is not None and _LIBC.unshare(flags) == 0


def _mount(source: bytes, target: bytes, fstype, flags: int, data=None) -> bool:
    return _LIBC.mount(source, target, fstype, ctypes.c_ulong(flags), data) == 0


def _interpreter_paths() -> list:
    """What the candidate's interpreter needs: its ``bin/`` folder and its installation (``sys.base_prefix``:
    the standard library, ``lib-dynload``, a shared ``libpython``), outermost folders only."""
    paths = {os.path.dirname(INTERPRETER), os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}
    paths = sorted(p for p in paths if os.path.isdir(p))
    return [p for p in paths if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in paths)]


def _closed_parent(path: str):
    """The outermost parent folder of ``path`` that other users cannot enter, or None."""
    parts = path.strip("/").split("/")
    return next(
        (p for p in ("/" + "/".join(parts[:i]) for i in range(1, len(parts))) if not os.stat(p).st_mode & 1), None
    )


def _expose(paths: list) -> bool:
    """Inside a new mount namespace as root: make each of ``paths`` reachable by other users when a parent folder
    is not (e.g. a pyenv interpreter under ``/root``, a venv's base in a home folder) with a tmpfs over the first
    closed parent and the path bound into it."""
    closed = {p: _closed_parent(p) for p in paths}
    fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p, parent in closed.items() if parent is not None}
    try:
        for parent in sorted({c for c in closed.values() if c is not None}, key=len):
            if not any(parent.startswith(other + "/") for other in closed.values() if other and other != parent):
                if not _mount(b"tmpfs", parent.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755,size=1m"):
                    return False
        for path, fd in fds.items():
            os.makedirs(path, exist_ok=True)
            if not _mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, MS_BIND | MS_REC):
                return False
        return True
    finally:
        for fd in fds.values():
            os.close(fd)


#: Top-level folders the candidate sees as they are: the system's programs, libraries and configuration, and the
#: package stores whose interpreters need other store paths (Nix, Guix). Every other top-level folder (``/home``,
#: ``/root``, ``/opt``, ``/srv``, ``/mnt``, ``/var``, a project's ``/work`` or ``/data``, ...) is an empty tmpfs
#: in its view, with only the interpreter's folders bound back in: it reads no data, checkpoint or code of the run.
SYSTEM_FOLDERS = frozenset(
    ("bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "proc", "sys", "tmp", "run", "nix", "gnu")
)


def _hide_data(paths: list) -> bool:
    """Inside a new mount namespace: an empty tmpfs over every top-level folder outside ``SYSTEM_FOLDERS`` and
    ``/dev/null`` over every top-level file, then each of ``paths`` (the interpreter's folders) that lay under a
    hidden folder bound back at its own path. On any failure the mounts are undone (the candidate then sees the
    read-only root as before) and False is returned."""
    entries = sorted("/" + name for name in os.listdir("/") if name not in SYSTEM_FOLDERS)
    tops = [e for e in entries if os.path.isdir(e) and not os.path.islink(e)]
    files = [e for e in entries if os.path.isfile(e) and not os.path.islink(e)]
    inside = [p for p in paths if any(p == top or p.startswith(top + "/") for top in tops)]
    fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in inside}
    mounted = []
    try:
        for top in tops:
            if not _mount(b"tmpfs", top.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755,size=1m"):
                raise OSError(f"cannot hide {top}")
            mounted.append(top)
        for file in files:
            if not _mount(b"/dev/null", file.encode(), None, MS_BIND):
                raise OSError(f"cannot hide {file}")
            mounted.append(file)
        for path, fd in fds.items():
            os.makedirs(path, exist_ok=True)
            if not _mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, MS_BIND | MS_REC):
                raise OSError(f"cannot bind {path}")
            mounted.append(path)
        return True
    except OSError:
        for folder in reversed(mounted):
            _LIBC.umount2(folder.encode(), MNT_DETACH)
        return False
    finally:
        for fd in fds.values():
            os.close(fd)


#: Folders where other processes put files and Unix sockets: an empty tmpfs over each in the candidate's view.
HIDDEN = ("/tmp", "/var/tmp", "/run", "/var/run", "/dev/shm", "/var/lock")


def _private_scratch(workdir: str, limits: dict, root: bool) -> bool:
    """Inside a new mount namespace: an empty tmpfs over each of ``HIDDEN`` (so no Unix socket or file another
    process left there is reachable), then a tmpfs of ``scratch_bytes`` at ``workdir`` owned by the candidate's
    uid: its files live in memory, are capped in total, and vanish with the namespace (even after kill -9).
    On any failure the mounts are undone and the on-disk ``workdir`` is used as before."""
    mounted = []
    try:
        for folder in HIDDEN:
            if os.path.isdir(folder) and not os.path.islink(folder):
                if not _mount(b"tmpfs", folder.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755,size=64k"):
                    raise OSError(f"cannot hide {folder}")
                mounted.append(folder)
        os.makedirs(workdir, exist_ok=True)
        owner = f",uid={NOBODY},gid={NOBODY}" if root else ""
        options = f"mode=0700,size={max(int(limits['scratch_bytes']), 4096)}{owner}".encode()
        if not _mount(b"tmpfs", workdir.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options):
            raise OSError("cannot mount the scratch tmpfs")
        return True
    except OSError:
        for folder in reversed(mounted):
            _LIBC.umount2(folder.encode(), MNT_DETACH)
        return False


def _mount_setattr(path: bytes, flags: int, set_: int = 0, clear: int = 0) -> bool:
    if SYS_MOUNT_SETATTR is None:
        return False
    attr = _MountAttr(set_, clear, 0, 0)
    return _LIBC.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), ctypes.c_char_p(path), ctypes.c_uint(flags),
        ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
    ) == 0  # fmt: skip


def _enter_namespaces(root: bool) -> list:
    """Put the supervisor in a new PID namespace (its first child is the namespace's init); as a non-root user
    through a new user namespace that maps only the user's own uid and gid."""
    if root:
        return ["pid-namespace"] if _unshare(CLONE_NEWPID) else []
    uid, gid = os.geteuid(), os.getegid()
    if not _unshare(CLONE_NEWUSER | CLONE_NEWPID):
        return []
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as handle:
                handle.write(text)
    except OSError:
        pass
    return ["user-namespace", "pid-namespace"]


def _jail(workdir: str, limits: dict, status_fd: int, root: bool, pidns: bool, nproc: int) -> None:
    """Runs in the forked candidate before ``exec``: namespaces, read-only mounts, rlimits, uid, then reports
    the layers applied on ``status_fd`` (closed before the candidate's code runs)."""
    import resource

    tags = ["no-network"] if _unshare(CLONE_NEWNET) else []
    if _unshare(CLONE_NEWNS) and _mount(b"none", b"/", None, MS_REC | MS_PRIVATE):
        if pidns and _mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC):
            tags.append("private-proc")
        interpreter = _interpreter_paths()
        if _hide_data(interpreter):
            tags.append("private-data")
        if root and _expose(interpreter):
            tags.append("interpreter-exposed")
        if _private_scratch(workdir, limits, root):
            tags.append("private-tmp")
        work = workdir.encode()
        if (
            _mount(work, work, None, MS_BIND)
            and _mount_setattr(b"/", AT_RECURSIVE, set_=MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)
            and _mount_setattr(work, 0, clear=MOUNT_ATTR_RDONLY)
        ):
            tags.append("read-only-root")
    os.chdir(workdir)  # after the bind mount, so the working directory is the writable one
    missing = []
    for limit, value in (
        (resource.RLIMIT_CPU, int(limits["cpu_seconds"])), (resource.RLIMIT_AS, int(limits["memory_bytes"])),
        (resource.RLIMIT_FSIZE, int(limits["file_bytes"])), (resource.RLIMIT_NOFILE, int(limits["open_files"])),
        (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, nproc),
    ):  # fmt: skip
        try:
            hard = resource.getrlimit(limit)[1]
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):  # e.g. RLIMIT_AS on macOS
            missing.append(limit)
    tags.append("rlimits" if not missing else "rlimits-partial")
    if root:  # raises (and the candidate does not start) rather than running it as root
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        tags.append("uid-nobody")
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
    os.write(status_fd, json.dumps(tags).encode())


def _processes_of(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        try:
            count += entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid
        except OSError:
            pass
    return count


def _children() -> list:
    me, pids = os.getpid(), []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                if entry.isdigit() and int(handle.read().rsplit(b")", 1)[1].split()[1]) == me:
                    pids.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return pids


def kill_tree(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (the candidate's; a tool call's in ``tool_worker``), ``pid`` itself and
    every process re-parented to this subreaper (``setsid`` daemons), until no child is left."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass
    give_up = time.monotonic() + 10.0
    while time.monotonic() < give_up:
        for pid in _children():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                time.sleep(0.005)
        except ChildProcessError:
            return


class _Timeout(BaseException):
    """The wall-clock limit passed (a BaseException so that a test's ``except Exception`` does not hide it)."""


class _Gone(BaseException):
    """The candidate exited or broke the protocol."""


class CandidateError(Exception):
    """The candidate raised an exception that is not a built-in one."""


class _Channel:
    """Requests to the candidate and its replies, under the run's deadline and a reply-size cap."""

    def __init__(self, requests: int, replies: int, output: _Output, deadline: float, cap: int):
        self.requests, self.replies, self.output, self.deadline, self.cap = requests, replies, output, deadline, cap
        self.buffer, self.broken = b"", None
        os.set_blocking(requests, False)

    def _wait(self, fd: int, write: bool) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            self.broken = _Timeout
            raise _Timeout()
        watched = self.output.watched() + ([] if write else [fd])
        readable, _, _ = select.select(watched, [fd] if write else [], [], remaining)
        if self.output.fd in readable:
            self.output.pump()

    def send(self, message) -> None:
        data = memoryview((json.dumps(message) + "\n").encode())
        while data:
            self._wait(self.requests, write=True)
            try:
                data = data[os.write(self.requests, data[:65536]) :]
            except BlockingIOError:
                pass
            except OSError:
                self.broken = _Gone
                raise _Gone("the candidate exited")

    def receive(self) -> dict:
        while b"\n" not in self.buffer:
            if len(self.buffer) > self.cap:
                self.broken = _Gone
                raise _Gone("the candidate's reply is larger than the cap")
            self._wait(self.replies, write=False)
            if select.select([self.replies], [], [], 0)[0]:
                chunk = os.read(self.replies, 65536)
                if not chunk:
                    self.broken = _Gone
                    raise _Gone("the candidate exited")
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            reply = json.loads(line)
            return reply if isinstance(reply, dict) else {}
        except ValueError:
            self.broken = _Gone
            raise _Gone("the candidate broke the protocol") from None

    def request(self, **message):
        if self.broken is not None:
            raise self.broken()
        self.send(message)
        reply = self.receive()
        if "ok" in reply:
            return self.decode(reply["ok"])
        cls = getattr(builtins, str(reply.get("raise")), None)
        detail = f"{reply.get('raise')} from the candidate: {str(reply.get('message', ''))[:500]}"
        raise cls(detail) if isinstance(cls, type) and issubclass(cls, Exception) else CandidateError(detail)

    def decode(self, item):
        if isinstance(item, dict) and isinstance(item.get("ref"), int):
            return _Remote(self, item["ref"])
        if isinstance(item, dict) and isinstance(item.get("value"), str):
            return ast.literal_eval(item["value"])
        raise ValueError("the candidate sent a malformed value")

    def encode(self, value) -> dict:
        if isinstance(value, _Remote) and value._channel is self:
            return {"ref": value._ref}
        text = repr(value)
        if type(value) in (float, complex) or ast.literal_eval(text) == value:
            return {"value": text}
        raise TypeError(f"cannot pass {type(value).__name__} to the candidate")


class _Remote:
    """A trusted proxy for one of the candidate's objects: calls, attribute and item reads; no truth value."""

    __slots__ = ("_channel", "_ref")

    def __init__(self, channel: _Channel, ref: int):
        self._channel, self._ref = channel, ref

    def __call__(self, *args, **kwargs):
        encode = self._channel.encode
        return self._channel.request(
            op="call", ref=self._ref, args=[encode(a) for a in args], kwargs={k: encode(v) for k, v in kwargs.items()}
        )

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._channel.request(op="getattr", ref=self._ref, name=name)

    def __getitem__(self, key):
        return self._channel.request(op="getitem", ref=self._ref, key=self._channel.encode(key))

    def __bool__(self):
        raise TypeError("an object of the candidate has no truth value in the sandbox")

    def __repr__(self) -> str:
        return f"<candidate object {self._ref}>"


def _evaluate(channel: _Channel, code: str, tests: list) -> dict:
    """Load the candidate, then run each test statement here, against proxies of the candidate's names."""
    passed = 0
    try:
        channel.send(code)
        loaded = channel.receive()
        if not isinstance(loaded.get("names"), dict):
            return {"passed": 0, "error": f"the candidate raised {loaded.get('raise')} while loading"}
        namespace = {}
        for name, item in loaded["names"].items():
            # the harness's names stay its own: the candidate's ``len`` or ``sorted`` must not answer for the
            # tests, nor a ``__builtins__`` (or any dunder or underscore name) it sends through its reply channel
            if not isinstance(name, str) or not name.isidentifier() or name.startswith("_") or hasattr(builtins, name):
                continue
            try:
                namespace[name] = channel.decode(item)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                pass
        namespace.update({"__builtins__": builtins, "__name__": "__sandbox_test__"})
        for test in tests:
            try:
                exec(compile(test, "<test>", "exec"), namespace)
            except (_Timeout, _Gone):
                raise
            except BaseException:
                continue
            if channel.broken is not None:  # a test that swallowed the candidate's failure does not count
                raise channel.broken()
            passed += 1
    except _Timeout:
        return {"passed": passed, "timed_out": True, "error": "time limit"}
    except _Gone as exc:
        return {"passed": passed, "error": str(exc) or "the candidate exited"}
    return {"passed": passed}


class _Output:
    """The candidate's stdout and stderr, read whenever the supervisor waits; only ``cap`` bytes are kept.
    (No thread: a process that has unshared its PID namespace cannot start one.)"""

    def __init__(self, fd: int, cap: int):
        self.fd, self.cap, self.chunks, self.size, self.closed = fd, cap, [], 0, False

    def watched(self) -> list:
        return [] if self.closed else [self.fd]

    def pump(self) -> bool:
        """Read once (the fd is readable); False at EOF."""
        chunk = os.read(self.fd, 65536)
        if chunk and self.size < self.cap:
            self.chunks.append(chunk[: self.cap - self.size])
            self.size += len(self.chunks[-1])
        self.closed = not chunk
        return bool(chunk)

    def finish(self, seconds: float) -> str:
        """Drain until EOF (every writer is dead) or ``seconds`` pass."""
        end = time.monotonic() + seconds
        while not self.closed and time.monotonic() < end:
            if select.select([self.fd], [], [], max(0.0, end - time.monotonic()))[0]:
                self.pump()
        os.close(self.fd)
        return b"".join(self.chunks).decode("utf-8", "replace")


def _run(spec: dict, workdir: str, root: bool, tags: list, deadline: float) -> dict:
    limits = spec["limits"]
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    out_r, out_w = os.pipe()
    status_r, status_w = os.pipe()
    nproc = _processes_of(NOBODY if root else os.geteuid()) + int(limits["max_processes"])
    pidns = "pid-namespace" in tags
    try:
        child = subprocess.Popen(
            [INTERPRETER, "-I", "-S", "-u", "-c", CANDIDATE_SOURCE, str(req_r), str(rep_w)],
            stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w, pass_fds=(req_r, rep_w), env={},
            start_new_session=True, preexec_fn=lambda: _jail(workdir, limits, status_w, root, pidns, nproc),
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        for fd in (req_r, req_w, rep_r, rep_w, out_r, out_w, status_r, status_w):
            os.close(fd)
        return {"passed": 0, "error": f"could not start the candidate in the sandbox: {exc}"}
    for fd in (req_r, rep_w, out_w, status_w):
        os.close(fd)
    tags += json.loads(os.read(status_r, 4096) or b"[]")
    os.close(status_r)
    output = _Output(out_r, int(limits["output_bytes"]))
    channel = _Channel(req_w, rep_r, output, deadline, int(limits["reply_bytes"]))
    try:
        result = _evaluate(channel, spec["code"], spec["tests"])
    finally:
        kill_tree(child.pid)
        os.close(req_w)
        os.close(rep_r)
    return dict(result, output=output.finish(1.0))


#: Working directories are ``<tmp>/aitraining_pl_code_<supervisor pid>_<random>``.
WORKDIR_PREFIX = "aitraining_pl_code_"


def _remove_stale_workdirs() -> None:
    """Remove the working directories of supervisors that died without cleaning up (the trainer killed with
    kill -9 takes its supervisor with it): those whose supervisor pid is gone."""
    folder = tempfile.gettempdir()
    for name in os.listdir(folder):
        pid = name[len(WORKDIR_PREFIX) :].partition("_")[0]
        if not name.startswith(WORKDIR_PREFIX) or not pid.isdigit():
            continue
        if not _alive(int(pid)):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a killed supervisor nobody has reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def main() -> None:
    spec = json.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    # only the result line goes to the trainer: a test that prints (perhaps the candidate's data) writes nowhere
    result_fd = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    deadline = time.monotonic() + float(spec["limits"]["timeout"])
    tags = ["subreaper"] if prctl(PR_SET_CHILD_SUBREAPER, 1) else []
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    root = os.geteuid() == 0
    tags += _enter_namespaces(root)  # before the next line: a process that is not dumpable cannot write its uid_map
    prctl(PR_SET_DUMPABLE, 0)
    _remove_stale_workdirs()
    workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}_")
    try:
        if root:
            os.chown(workdir, NOBODY, NOBODY)
        result = _run(spec, workdir, root, tags, deadline)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["isolation"] = tags
    with os.fdopen(result_fd, "w") as channel:
        channel.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
