"""benchmarks/_common.py: TRL's interpreter from --trl-python / TRL_PYTHON with an error saying how to make one,
and the header (command, date, threads, versions) printed with the figures."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _common  # noqa: E402


def _parse(argv, monkeypatch, env=None):
    monkeypatch.delenv("TRL_PYTHON", raising=False)
    if env is not None:
        monkeypatch.setenv("TRL_PYTHON", env)
    parser = argparse.ArgumentParser(prog="bench")
    _common.add_trl_python(parser)
    args = parser.parse_args(argv)
    _common.require_trl_python(parser, args)
    return args


def test_a_missing_trl_interpreter_is_a_usage_error_that_says_how_to_make_one(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse([], monkeypatch)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "TRL's interpreter is missing" in err and "python -m venv" in err and "TRL_PYTHON" in err
    with pytest.raises(SystemExit):
        _parse(["--trl-python", "/no/such/python"], monkeypatch)
    assert "is not an executable file" in capsys.readouterr().err


def test_the_interpreter_comes_from_the_argument_or_the_environment(monkeypatch):
    assert _parse(["--trl-python", sys.executable], monkeypatch).trl_python == sys.executable
    assert _parse([], monkeypatch, env=sys.executable).trl_python == sys.executable
    assert _parse(["--skip-trl"], monkeypatch).trl_python is None


def test_the_header_names_command_date_threads_and_versions(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench.py", "--threads", "3"])
    _common.print_header(3, trl_python=sys.executable, size="3m")
    line = json.loads(capsys.readouterr().out)
    assert line["header"] is True and line["threads"] == 3 and line["size"] == "3m"
    assert line["command"].endswith("bench.py --threads 3") and line["date"].endswith("Z")
    assert {"torch", "transformers", "lightning"} <= set(line["versions"])
    assert "torch" in line["trl_versions"]  # read from the other interpreter (here the same one)


class _Clock:
    """A fake ``time.perf_counter`` that only moves when the test moves it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_split_charges_the_parts_of_a_step_and_the_rest_to_rest(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(_common, "time", SimpleNamespace(perf_counter=clock))
    split = _common.Split(warmup=1, parts=("a", "b"))
    work = split.timed("a", lambda seconds: setattr(clock, "now", clock.now + seconds))
    for seconds in (100.0, 2.0):  # the first step is warm-up
        split.step_start()
        work(seconds)
        clock.now += 1.0  # untimed
        split.add("b", 0.5)
        split.step_end()
    assert split.step_split() == {"a": 2.0, "b": 0.5, "rest": 0.5}
    assert split.rate(6) == 2.0  # 6 units in a 3-second steady-state step


def test_module_function_and_optimizer_hooks_time_forward_backward_and_update_apart(monkeypatch):
    """A decoder (1 s forward, 10 s backward), a head function (2 s, 20 s) and an optimizer whose update takes 100 s
    after a closure running forward and backward, as Lightning's does: each part gets its own seconds."""
    import torch

    clock = _Clock()
    monkeypatch.setattr(_common, "time", SimpleNamespace(perf_counter=clock))

    def advancing(forward_s, backward_s):
        class Advance(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                clock.now += forward_s
                return x * 2

            @staticmethod
            def backward(ctx, grad):
                clock.now += backward_s
                return grad * 2

        return Advance

    slow_identity = advancing(0.0, 10.0)

    class Embedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.weight

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = Embedding()

        def forward(self, x):
            clock.now += 1.0
            return slow_identity.apply(self.embed(x))

    decoder, head = Decoder(), advancing(2.0, 20.0)
    split = _common.Split(warmup=0, parts=("blocks", "head", "optimizer"))
    _common.time_module(split, "blocks", decoder, until=decoder.embed)
    _common.time_autograd_function(split, "head", head)
    handles = _common.time_optimizer(split)
    optimizer = torch.optim.SGD(decoder.parameters(), lr=0.1)
    optimizer.register_step_post_hook(lambda *a: setattr(clock, "now", clock.now + 100.0))  # the "update"
    try:

        def closure():
            optimizer.zero_grad()
            loss = head.apply(decoder(torch.ones(3))).sum()
            loss.backward()
            clock.now += 5.0  # e.g. gradient clipping: the rest
            return loss

        split.step_start()
        optimizer.step(closure=closure)
        split.step_end()
    finally:
        for handle in handles:
            handle.remove()
    assert split.step_split() == {"blocks": 11.0, "head": 22.0, "optimizer": 100.0, "rest": 5.0}


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux's /proc")
def test_a_childs_peak_rss_is_its_own_not_its_parents():
    """``ru_maxrss`` survives ``execve``: a child of a parent holding 200 MB reports 200 MB; ``peak_rss_mb`` (VmHWM)
    reports what the child itself used."""
    import subprocess

    ballast = bytearray(200 * 1024 * 1024)  # noqa: F841 - resident in this (the parent) process
    ballast[::4096] = b"x" * len(ballast[::4096])
    assert _common.peak_rss_mb() >= 200
    code = (
        f"import resource, sys; sys.path.insert(0, {str(Path(_common.__file__).parent)!r}); import _common; "
        "print(_common.peak_rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    )
    ours, inherited = map(float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                check=True).stdout.split())  # fmt: skip
    assert ours < 150 <= inherited
