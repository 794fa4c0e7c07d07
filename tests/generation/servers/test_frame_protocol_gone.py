"""The frame protocol of ``aitraining-pl serve`` is gone (issue 48; it was added after 0.1.0 and never released):
each of its settings is one line naming what replaced it, before anything runs."""

from __future__ import annotations

import pytest

from aitraining_pl.errors import HyperparameterError
from aitraining_pl.generation.config import FRAME_PROTOCOL_GONE, GenerationConfig, check_server


@pytest.mark.parametrize("vllm", [{"protocol": "tcp"}, {"weight_channel": "nccl"}])
def test_the_frame_protocols_options_are_one_line(vllm):
    with pytest.raises(HyperparameterError) as gone:
        GenerationConfig(vllm=vllm).validate("GRPOModule.generation")
    name = next(iter(vllm))
    assert str(gone.value) == (
        f"GRPOModule.generation.vllm.{name}: unknown {name} {vllm[name]!r}; must be one of "
        f"{repr('http') if name == 'protocol' else repr('auto')} ({FRAME_PROTOCOL_GONE})"
    )
    assert "\n" not in str(gone.value) and "vllm-serve" in str(gone.value) and "hf_routes" in str(gone.value)


def test_a_tcp_url_is_one_line():
    for server in ("tcp://127.0.0.1:8000", {"urls": ["http://127.0.0.1:8000", "tcp://127.0.0.1:8001"]}):
        with pytest.raises(HyperparameterError, match="the frame protocol of `aitraining-pl serve` was removed"):
            check_server(GenerationConfig(server=server).server, "GRPOModule.generation.server")


def test_aitraining_pl_serve_exits_2_with_one_line(capsys):
    from aitraining_pl.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--engine", "hf", "--model", "tiny-llama"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err == f"aitraining-pl serve: {FRAME_PROTOCOL_GONE}\n"
