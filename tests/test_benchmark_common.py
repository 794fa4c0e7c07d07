"""benchmarks/_common.py: TRL's interpreter from --trl-python / TRL_PYTHON with an error saying how to make one,
and the header (command, date, threads, versions) printed with the figures."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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
