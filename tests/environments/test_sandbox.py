"""The code sandbox: one test per known escape from the old runner (issue 13, item 3), each scored as a failure
within the time limit, plus correct and partially correct code scored as before.

The tests use only ``run_test_cases`` / ``TestRunResult.passed`` for the scoring assertions, so the same file
can be run against the old runner to show the escapes (see the issue's closing table).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from aitraining_pl.environments import create_code_generation_env, run_test_cases
from aitraining_pl.environments.sandbox import SUPERVISOR_PATH, SandboxLimits, run_tests

ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(7, 7) == 14"]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the full sandbox is Linux-only")


def _isolation() -> tuple:
    return getattr(run_test_cases("x = 1", ["assert x == 1"], timeout=5.0), "isolation", ())


def _processes_with(marker: str, field: str = "cmdline") -> list:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker in Path(f"/proc/{entry}/{field}").read_bytes().decode("utf-8", "replace"):
                found.append(int(entry))
        except OSError:
            pass
    return found


def _parent(pid: str) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _owner(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


class _Watcher:
    """Samples /proc while a run is in progress: how many processes carry ``marker`` at most."""

    def __init__(self, marker: str, field: str):
        self.marker, self.field, self.most, self.stop = marker, field, 0, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        while not self.stop.is_set():
            self.most = max(self.most, len(_processes_with(self.marker, self.field)))
            self.stop.wait(0.01)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        for pid in _processes_with(self.marker, self.field):  # clean up after a runner that lets them escape
            try:
                os.kill(pid, 9)
            except OSError:
                pass


def test_correct_code_gets_full_reward_and_partial_code_partial_reward(byte_tokenizer):
    full = run_test_cases("def add(a, b):\n    return a + b", ADD_TESTS, timeout=5.0)
    partial = run_test_cases("def add(a, b):\n    return a * 2 if a == b else a - b", ADD_TESTS, timeout=5.0)
    assert (full.passed, full.total, partial.passed, partial.total) == (3, 3, 1, 3)
    env = create_code_generation_env(byte_tokenizer, timeout=5.0)
    good = '```python\ndef add(a, b):\n    """Sum."""\n    return a + b\n```'
    assert env([env.prompts[0]], [good]) == [pytest.approx(2.1)] and env.last_components["tests"] == [1.0]


def test_objects_methods_and_exceptions_work_through_the_proxies():
    code = (
        "class Counter:\n    def __init__(self):\n        self.value = 0\n"
        "    def bump(self):\n        self.value += 1\n        return self\n"
        "def safe_div(a, b):\n    if b == 0:\n        raise ZeroDivisionError('b is 0')\n    return a / b\n"
        "table = {'a': [1, 2]}"
    )  # fmt: skip
    tests = [
        "c = Counter()\nc.bump().bump()\nassert c.value == 2",
        "assert safe_div(1, 4) == 0.25",
        "try:\n    safe_div(1, 0)\nexcept ZeroDivisionError:\n    pass\nelse:\n    raise AssertionError",
        "assert table['a'][1] == 2",
        "assert Counter()",  # an opaque object of the candidate has no truth value: fails
    ]
    assert run_test_cases(code, tests, timeout=5.0).passed == 4


def test_forged_result_line_with_the_runners_nonce_from_the_stack_scores_zero():
    forge = (
        "import json, os, sys\n"
        "def add(a, b):\n    return None\n"
        "secret, frame = '', sys._getframe()\n"
        "while frame is not None:\n"
        "    for v in list(frame.f_locals.values()) + list(frame.f_globals.values()):\n"
        "        if isinstance(v, str) and len(v) == 32 and all(c in '0123456789abcdef' for c in v):\n"
        "            secret = v\n"
        "    frame = frame.f_back\n"
        "line = '\\n' + secret + json.dumps({'passed': 1000, 'loaded': True}) + '\\npassed=1000/3\\n'\n"
        "for fd in range(1, 20):\n"
        "    try:\n        os.write(fd, line.encode())\n    except OSError:\n        pass\n"
        "os._exit(0)\n"
    )  # fmt: skip
    result = run_test_cases(forge, ADD_TESTS, timeout=5.0)
    assert result.passed == 0 and result.total == 3 and 0.0 <= result.fraction <= 1.0


def test_replaced_exec_and_builtins_score_zero():
    code = (
        "import builtins\n"
        "def add(a, b):\n    return 0\n"
        "builtins.exec = lambda *args, **kwargs: None\n"
        "builtins.compile = lambda *args, **kwargs: None\n"
        "builtins.AssertionError = type('Never', (Exception,), {})\n"
    )  # fmt: skip
    assert run_test_cases(code, ADD_TESTS, timeout=5.0).passed == 0


def test_reading_the_tests_from_frames_and_memory_scores_zero():
    """The candidate searches its stack and every object in its process for the test statements to copy the
    expected value: the tests never enter its process."""
    peek = (
        "import ast, gc, re, sys\n"
        "def _candidates():\n"
        "    frame = sys._getframe()\n"
        "    while frame is not None:\n"
        "        yield from frame.f_locals.values()\n"
        "        frame = frame.f_back\n"
        "    yield from gc.get_objects()\n"
        "def add(a, b):\n"
        "    pattern = re.compile(r'add\\(%r, %r\\) == (\\S+)' % (a, b))\n"
        "    for obj in _candidates():\n"
        "        for text in (obj if isinstance(obj, (list, tuple)) else (obj,)):\n"
        "            if isinstance(text, str) and pattern.search(text):\n"
        "                return ast.literal_eval(pattern.search(text).group(1))\n"
        "    return None\n"
    )  # fmt: skip
    assert run_test_cases(peek, ADD_TESTS, timeout=5.0).passed == 0


def test_an_always_equal_object_scores_zero():
    code = "class Anything:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Anything()"
    assert run_test_cases(code, ADD_TESTS, timeout=5.0).passed == 0


def test_shadowing_builtins_that_the_tests_use_scores_zero():
    code = "def add(a, b):\n    return None\nlen = sorted = lambda *args: 3\nisinstance = lambda *args: True"
    tests = ["assert len(add(1, 2)) == 3", "assert sorted(add(1, 2)) == 3", "assert isinstance(add(1, 2), int)"]
    assert run_test_cases(code, tests, timeout=5.0).passed == 0


def test_infinite_loops_time_out_with_zero():
    at_import = run_test_cases("def add(a, b):\n    return a + b\nwhile True:\n    pass", ADD_TESTS, timeout=1.0)
    in_call = run_test_cases("def add(a, b):\n    while True:\n        pass", ADD_TESTS, timeout=1.0)
    assert at_import.timed_out and at_import.passed == 0
    assert in_call.timed_out and in_call.passed == 0


def test_a_setsid_grandchild_is_killed_with_the_run():
    marker = f"sandbox-grandchild-{uuid.uuid4().hex}"
    code = (
        "import os, sys, time\n"
        "def add(a, b):\n    return a + b\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        loop = 'import time\\n# {marker}\\nwhile True:\\n    open(\"beat\", \"a\").write(\"x\")\\n"
        "    time.sleep(0.01)'\n"
        "        os.execv(sys.executable, [sys.executable, '-c', loop])\n"
        "    os._exit(0)\n"
        "time.sleep(60)\n"
    )  # fmt: skip
    with _Watcher(marker, "cmdline") as watcher:
        result = run_test_cases(code, ADD_TESTS, timeout=2.0)
        alive_after = _processes_with(marker)
    assert watcher.most >= 1, "the grandchild never started: the test shows nothing"
    assert result.timed_out and result.passed == 0
    assert alive_after == []


def test_an_output_flood_keeps_the_trainers_memory_bounded():
    """200 MB on stdout and stderr: the trainer's peak RSS grows by less than 100 MB (measured in a fresh
    interpreter, so earlier tests' peaks do not hide the growth)."""
    flood = "import os\nchunk = b'x' * (1 << 20)\nfor fd in (1, 2):\n    for _ in range(100):\n"
    flood += "        os.write(fd, chunk)\n"
    script = (
        "import json, resource, sys\n"
        "from aitraining_pl.environments import run_test_cases\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "r = run_test_cases(sys.argv[1] + 'def add(a, b):\\n    return a + b\\n', sys.argv[2:], timeout=20.0)\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "output = len(getattr(r, 'output', ''))\n"
        "print(json.dumps({'growth_kb': after - before, 'passed': r.passed, 'output': output}))\n"
    )  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    done = subprocess.run(
        [sys.executable, "-c", script, flood, *ADD_TESTS], capture_output=True, text=True, env=env, check=True
    )
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["growth_kb"] < 100 * 1024, measured
    assert measured["output"] <= 4096 and measured["passed"] == 3  # the output is dropped, not the score


def test_writes_outside_the_working_directory_fail(tmp_path):
    isolation = _isolation()
    if not {"read-only-root", "uid-nobody"} & set(isolation):
        pytest.skip(f"no filesystem isolation on this platform ({isolation})")
    tmp_path.chmod(0o777)  # even a folder open to every user is not writable from the sandbox
    marker = uuid.uuid4().hex
    targets = [tmp_path / "escaped.txt", Path("/tmp") / f"escaped-{marker}"]
    targets.append(Path(__file__).parent / f"escaped-{marker}")
    code = (
        "import os\n"
        f"targets = {[str(t) for t in targets]!r}\n"
        "written = []\n"
        "for target in targets + [os.path.expanduser('~/escaped-' + targets[1][-32:])]:\n"
        "    try:\n"
        "        with open(target, 'w') as handle:\n            handle.write('escaped')\n"
        "        written.append(target)\n"
        "    except OSError:\n"
        "        pass\n"
        "with open('inside.txt', 'w') as handle:\n    handle.write('ok')\n"
        "inside = open('inside.txt').read()\n"
    )  # fmt: skip
    result = run_test_cases(code, ["assert inside == 'ok'", "assert written == []"], timeout=5.0)
    try:
        assert [t for t in targets if t.exists()] == [] and result.passed == 2
    finally:
        for target in targets:
            target.unlink(missing_ok=True)


def test_reads_outside_the_system_folders_fail(tmp_path):
    """The run's own files (this checkout, the home folder, a top-level file such as a container's credentials)
    are not readable: every top-level folder outside the system's is an empty tmpfs in the candidate's view."""
    from aitraining_pl.environments.sandbox_supervisor import SYSTEM_FOLDERS

    isolation = _isolation()
    if "private-data" not in isolation:
        pytest.skip(f"no mount namespace on this platform ({isolation})")
    here = Path(__file__).resolve()
    if here.parts[1] in SYSTEM_FOLDERS:
        pytest.skip(f"this checkout lies in a system folder ({here.parts[1]})")
    code = (
        "import os\n"
        "def readable(path):\n"
        "    try:\n"
        "        with open(path, 'rb') as handle:\n            return len(handle.read(1)) > 0\n"
        "    except OSError:\n"
        "        return False\n"
        f"source = readable({str(here)!r})\n"
        f"listed = os.path.isdir({str(here.parent)!r}) and len(os.listdir({str(here.parent)!r})) > 0\n"
        "tops = [e for e in os.listdir('/') if os.path.isfile('/' + e) and readable('/' + e)]\n"
        "system = readable('/etc/hostname') or readable('/usr/lib/os-release') or readable('/etc/os-release')\n"
    )  # fmt: skip
    tests = ["assert source is False", "assert listed is False", "assert tops == []", "assert system is True"]
    result = run_test_cases(code, tests, timeout=5.0)
    assert result.passed == 4, result


def test_a_fork_bomb_is_bounded_and_killed():
    isolation = _isolation()
    if os.geteuid() == 0 and "uid-nobody" not in isolation:
        pytest.skip("running as root without the uid drop: RLIMIT_NPROC would not apply")
    name = "bomb" + uuid.uuid4().hex[:11]
    code = (
        "import ctypes, os\n"
        f"ctypes.CDLL(None).prctl(15, b'{name}', 0, 0, 0)\n"
        "def add(a, b):\n    return a + b\n"
        "while True:\n"
        "    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )  # fmt: skip
    uid = 65534 if os.geteuid() == 0 else os.geteuid()
    already = sum(1 for e in os.listdir("/proc") if e.isdigit() and _owner(e) == uid)  # e.g. a concurrent run
    with _Watcher(name, "comm") as watcher:
        result = run_test_cases(code, ADD_TESTS, timeout=2.0)
        alive_after = _processes_with(name, "comm")
    assert result.passed == 0 and result.timed_out
    # RLIMIT_NPROC is per uid: limits.max_processes (32) more than the uid had, the candidate included
    assert 1 <= watcher.most <= 32 + already, (watcher.most, already)
    assert alive_after == []


def test_the_trainer_clamps_what_the_supervisor_reports():
    from aitraining_pl.environments.sandbox import _parse_result

    assert _parse_result(b'{"passed": 1000}\n', 3).passed == 3
    assert _parse_result(b'{"passed": -5}\n', 3).passed == 0
    assert _parse_result(b"garbage", 3).passed == 0


def _unprivileged_python() -> list:
    """``setpriv`` to ``nobody`` plus an interpreter that user can run, or [] (then the test is skipped)."""
    setpriv, python = shutil.which("setpriv"), "/usr/bin/python3"
    if os.geteuid() != 0 or setpriv is None or not os.path.exists(python):
        return []
    command = [setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", python, "-I", "-S"]
    probe = subprocess.run([*command, "-c", "import json"], capture_output=True, check=False)
    return command if probe.returncode == 0 else []


def test_the_supervisor_run_by_an_unprivileged_user_still_isolates_and_scores():
    """The path a non-root CI runner takes: user namespaces where the kernel allows them, else rlimits only."""
    from dataclasses import asdict

    from aitraining_pl.environments.sandbox import SUPERVISOR_PATH, SandboxLimits, _parse_result

    command = _unprivileged_python()
    if not command:
        pytest.skip("needs root, setpriv and a system python3 that nobody can run")
    marker = uuid.uuid4().hex
    code = (
        "def add(a, b):\n    return a + b\n"
        f"try:\n    open('/tmp/escaped-{marker}', 'w').write('x')\n    wrote = True\n"
        "except OSError:\n    wrote = False\n"
    )  # fmt: skip
    tests = [*ADD_TESTS, "assert wrote is False"]
    spec = json.dumps({"code": code, "tests": tests, "limits": asdict(SandboxLimits(timeout=5.0))})
    # the checkout may sit in a folder that user cannot enter (e.g. a 0700 temporary clone): run a readable copy
    folder = Path(tempfile.mkdtemp(prefix="sandbox-supervisor-"))
    folder.chmod(0o755)
    for name in ("sandbox_supervisor.py", "sandbox_candidate.py"):
        shutil.copy(Path(SUPERVISOR_PATH).with_name(name), folder / name)
        (folder / name).chmod(0o644)
    try:
        done = subprocess.run(
            [*command, str(folder / "sandbox_supervisor.py")], input=spec.encode(), capture_output=True, check=False
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = _parse_result(done.stdout, len(tests))
    escaped = Path(f"/tmp/escaped-{marker}")
    protected = "read-only-root" in result.isolation
    escaped.unlink(missing_ok=True)
    assert result.passed == (4 if protected else 3), result
    assert "uid-nobody" not in result.isolation and "rlimits" in result.isolation


def test_a_forged_builtins_sent_through_the_candidates_own_reply_channel_scores_zero():
    """Issue 26, item 1: the candidate reaches ``_serve``'s reply channel with ``sys._getframe``, sends a names
    message with a ``__builtins__`` of its making (``abs``/``len`` that always satisfy the tests) and serves
    calls itself. Dunder and underscore names are the harness's: the tests keep the real built-ins."""
    forge = (
        "import builtins, json, sys\n"
        "def add(a, b):\n    return 0\n"
        "class Fake:\n"
        "    def __getitem__(self, name):\n"
        "        fake = {'abs': lambda x: 0, 'len': lambda x: 3, 'isinstance': lambda *a: True}\n"
        "        return fake[name] if name in fake else getattr(builtins, name)\n"
        "serve = sys._getframe(1).f_locals\n"
        "send, encode, decode, handles = serve['send'], serve['encode'], serve['decode'], serve['handles']\n"
        "send({'names': {'__builtins__': encode(Fake()), '_helper': encode(Fake()), 'add': encode(add)}})\n"
        "for line in serve['requests']:\n"
        "    request = json.loads(line)\n"
        "    try:\n"
        "        target = handles[request['ref']]\n"
        "        if request['op'] == 'call':\n"
        "            result = target(*[decode(a) for a in request['args']])\n"
        "        elif request['op'] == 'getattr':\n"
        "            result = getattr(target, request['name'])\n"
        "        else:\n"
        "            result = target[decode(request['key'])]\n"
        "        send({'ok': encode(result)})\n"
        "    except BaseException as exc:\n"
        "        send({'raise': type(exc).__name__, 'message': str(exc)})\n"
    )  # fmt: skip
    tests = [
        "assert add(2, 3) == 5",
        "assert abs(add(2, 3) - 5) < 1e-9",
        "assert len(str(add(100, 23))) == 3",
        "assert isinstance(add(1, 1), str)",
    ]
    result = run_test_cases(forge, tests, timeout=5.0)
    assert result.passed == 0, result


def _base_stdlib() -> str:
    import sysconfig

    return os.path.realpath(sysconfig.get_paths()["stdlib"])


def test_the_candidate_uses_the_trainers_base_interpreter_and_its_stdlib(tmp_path):
    """Issue 26, item 3: an interpreter outside ``/usr`` (this venv's base, a fresh ``python -m venv`` in a
    folder closed to other users) gets its standard library exposed in the jail: correct code scores, and with
    the trainer's own stdlib (not whatever ``/usr/lib/python3.X`` the machine happens to have)."""
    venv = tmp_path / "closed" / "venv"
    (tmp_path / "closed").mkdir(mode=0o700)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    code = "import os\ndef add(a, b):\n    return a + b\nstdlib = os.path.realpath(os.path.dirname(os.__file__))"
    tests = [*ADD_TESTS, f"assert stdlib == {_base_stdlib()!r}"]
    for python in (None, str(venv / "bin" / "python")):
        result = run_tests(code, tests, SandboxLimits(timeout=5.0), python=python)
        assert result.passed == 4, (python, result)


def test_a_unix_socket_listening_in_tmp_is_unreachable(tmp_path):
    """Issue 26, item 6: a mode-0777 Unix socket in /tmp (and in /dev/shm) that a process outside listens on;
    the candidate reaches for it with the raw ``_socket`` module."""
    import socket

    paths = [f"/tmp/sandbox-{uuid.uuid4().hex}.sock", f"/dev/shm/sandbox-{uuid.uuid4().hex}.sock"]
    listeners = []
    for path in paths:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        os.chmod(path, 0o777)
        listener.listen(4)
        listener.setblocking(False)
        listeners.append(listener)
    code = (
        "import _socket\n"
        f"reached = []\nfor path in {paths!r}:\n"
        "    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)\n"
        "    try:\n        s.connect(path)\n        reached.append(path)\n    except OSError:\n        pass\n"
    )  # fmt: skip
    try:
        result = run_test_cases(code, ["assert reached == []"], timeout=5.0)
        accepted = []
        for listener in listeners:
            try:
                accepted.append(listener.accept())
            except BlockingIOError:
                pass
    finally:
        for listener, path in zip(listeners, paths):
            listener.close()
            os.unlink(path)
    if "read-only-root" not in result.isolation:
        pytest.skip(f"no mount namespace on this platform ({result.isolation})")
    assert result.passed == 1 and accepted == []


def test_the_scratch_space_is_capped_and_a_killed_trainer_leaves_no_work_dir():
    """Issue 26, item 10: 1 MB files until the disk is full stop at ``scratch_bytes``; a trainer killed with
    kill -9 in the middle of a run leaves at most an empty folder, removed by the next run."""
    fill = (
        "import os\nwritten = 0\n"
        "try:\n    for i in range(64):\n"
        "        with open(f'f{i}', 'wb') as handle:\n            handle.write(b'x' * (1 << 20))\n"
        "        written += 1 << 20\nexcept OSError:\n    pass\n"
    )  # fmt: skip
    result = run_tests(fill, ["assert written <= 8 << 20"], SandboxLimits(timeout=10.0, scratch_bytes=8 << 20))
    if "private-tmp" not in result.isolation:
        pytest.skip(f"no mount namespace on this platform ({result.isolation})")
    assert result.passed == 1, result
    name = "filled" + uuid.uuid4().hex[:9]
    trainer = (  # the sandbox module alone (standard library only): starts in a fraction of the package's time
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('sandbox', sys.argv[2])\n"
        "sandbox = sys.modules['sandbox'] = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(sandbox)\n"
        "sandbox.run_tests(sys.argv[1], ['pass'], sandbox.SandboxLimits(timeout=30.0))"
    )
    fill += f"import ctypes, time\nctypes.CDLL(None).prctl(15, b'{name}', 0, 0, 0)\ntime.sleep(60)\n"
    module = Path(SUPERVISOR_PATH).with_name("sandbox.py")
    proc = subprocess.Popen([sys.executable, "-c", trainer, fill, str(module)])
    folder = Path(tempfile.gettempdir())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not _processes_with(name, "comm"):
        time.sleep(0.05)
    assert _processes_with(name, "comm"), "the candidate never filled its scratch space: the test shows nothing"
    mine = [p for p in folder.glob("aitraining_pl_code_*") if _parent(p.name.split("_")[3]) == proc.pid]
    assert len(mine) == 1, mine
    proc.kill()
    proc.wait()
    pids = [p.name.split("_")[3] for p in mine]
    deadline = time.monotonic() + 5  # the supervisor and the candidate die with it (PR_SET_PDEATHSIG)
    while time.monotonic() < deadline and any(
        Path(f"/proc/{pid}/cmdline").read_bytes() for pid in pids if Path(f"/proc/{pid}").exists()
    ):
        time.sleep(0.05)
    assert sum(f.stat().st_size for f in mine[0].rglob("*") if f.is_file()) == 0, list(mine[0].iterdir())
    run_test_cases("x = 1", ["assert x == 1"], timeout=5.0)
    assert [p for p in mine if p.exists()] == []


def test_a_candidate_that_cannot_start_is_one_sandbox_error_when_the_environment_is_built(monkeypatch, byte_tokenizer):
    """Issue 26, item 3: where the candidate cannot start (here: a real sandbox whose address-space limit is too
    small for an interpreter), building the code environment fails once with ``SandboxError``, instead of
    every test scoring 0 with at most a warning."""
    from aitraining_pl.environments import code_generation
    from aitraining_pl.errors import SandboxError

    def starved(code, tests, limits=None):
        return run_tests(code, tests, SandboxLimits(timeout=5.0, memory_bytes=4 << 20))

    code_generation.check_sandbox.cache_clear()
    monkeypatch.setattr(code_generation, "run_tests", starved)
    try:
        with pytest.raises(SandboxError, match=r"the candidate cannot run `x = 1`") as caught:
            create_code_generation_env(byte_tokenizer, timeout=5.0)
        assert "\n" not in str(caught.value)
        assert create_code_generation_env(byte_tokenizer, test_cases=[[]] * 6) is not None  # no tests: no check
    finally:
        code_generation.check_sandbox.cache_clear()
