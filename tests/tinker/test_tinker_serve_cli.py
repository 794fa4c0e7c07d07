"""``aitraining-pl tinker-serve``: registered in the command, and its API keys: a new owner-only ``tml-`` key when
none is given, keys from a file, and one line refusing a key the tinker client would refuse."""

from __future__ import annotations

import os
import stat

import pytest

from aitraining_pl.cli import main
from aitraining_pl.tinker.serve import api_keys


def test_registered_with_its_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["tinker-serve", "--help"])
    assert exit_info.value.code == 0
    assert "--model" in capsys.readouterr().out


def test_api_keys(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("AITRAINING_PL_SERVER_TOKEN", raising=False)
    monkeypatch.delenv("AITRAINING_PL_SERVER_TOKEN_FILE", raising=False)
    (key,) = api_keys(None, str(tmp_path))
    assert key.startswith("tml-") and key not in capsys.readouterr().out
    assert stat.S_IMODE(os.stat(tmp_path / "api_key").st_mode) == 0o600
    (tmp_path / "keys").write_text("tml-one\n\ntml-two\n")
    assert api_keys(str(tmp_path / "keys"), str(tmp_path)) == ["tml-one", "tml-two"]
    (tmp_path / "bad").write_text("tml-one\nsecret\n")
    with pytest.raises(SystemExit, match=r"must start with 'tml-'.*\[1\]"):
        api_keys(str(tmp_path / "bad"), str(tmp_path))
