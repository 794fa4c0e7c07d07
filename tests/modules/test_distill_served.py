"""A served teacher (``DistillationModule(teacher_server=...)``, ``servers.client.ServedTeacher``): the teacher's
log-probs through the real client, wire and server (a stand-in engine scoring with a local HF model; no vLLM) equal
the local teacher's, and a lost or absent teacher server is one clear line."""

from __future__ import annotations

import socket

import pytest
import torch
from server_fixtures import SPEC, ScoringEngine, serving

from aitraining_pl.errors import ConfigError, GenerationServerError
from aitraining_pl.generation.config import VLLMConfig
from aitraining_pl.generation.servers.client import ServedTeacher
from aitraining_pl.models import build_causal_lm
from aitraining_pl.modules.distill import LocalTeacher


def rows():
    """Two left-padded prompts of 5 columns with responses of 4 (the second ended early: right padding)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding of the prompt
    mask[1, 7:] = 0  # a response that ended
    return ids, mask


def teacher_options(port, timeout=10.0):
    return VLLMConfig(mode="server", server_port=port, server_timeout=timeout)


def test_served_logprobs_equal_the_local_teachers_and_a_lost_server_is_one_line():
    teacher = build_causal_lm(SPEC, seed=3).float().eval()
    ids, mask = rows()
    local = LocalTeacher(teacher).token_logprobs(ids, mask, 5, 1.0)
    with serving(ScoringEngine(teacher), teacher) as port:
        served = ServedTeacher(teacher_options(port))
        got = served.token_logprobs(ids, mask, 5, 1.0)
        assert got.dtype == torch.float32 and got.shape == local.shape
        response = mask[:, 5:].bool()
        diff = float((got - local)[response].abs().max())
        print(f"served vs local teacher: max |diff| {diff:.2e}")
        assert diff < 1e-4
        with pytest.raises(GenerationServerError, match="temperature 0.7"):
            served.token_logprobs(ids, mask, 5, 0.7)  # refused: vLLM's prompt log-probs are at temperature 1
        assert float((served.token_logprobs(ids, mask, 5, 1.0) - got).abs().max()) == 0  # still usable
        served.sock.shutdown(socket.SHUT_RDWR)  # the connection is gone mid-run (a server that died)
    with pytest.raises(GenerationServerError) as lost:
        served.token_logprobs(ids, mask, 5, 1.0)
    line = str(lost.value)
    assert "\n" not in line and f"teacher server 127.0.0.1:{port}" in line, line
    with pytest.raises(GenerationServerError, match=f"teacher server 127.0.0.1:{port}: could not connect"):
        ServedTeacher(teacher_options(port, timeout=1.0)).token_logprobs(ids, mask, 5, 1.0)  # nothing listening


def test_a_served_teacher_needs_sampled_mode():
    from aitraining_pl.modules.distill import check_teacher_server

    with pytest.raises(ConfigError, match="mode: sampled"):
        check_teacher_server({"port": 8000}, "full")
    with pytest.raises(ConfigError, match="keys among"):
        check_teacher_server({"url": "x"}, "sampled")


def test_the_module_scores_with_a_served_teacher_in_sampled_mode_only():
    """``DistillationModule(teacher_server=...)``: the teacher's slot holds a ``ServedTeacher`` (no teacher weights in
    this process), whose scores equal the local teacher's; ``mode: full`` and a sampling temperature other than 1
    are refused before training."""
    from aitraining_pl.modules.distill import DistillationModule
    from aitraining_pl.rollout import GenerationConfig

    teacher = build_causal_lm(SPEC, seed=3).float().eval()
    ids, mask = rows()
    with serving(ScoringEngine(teacher), teacher) as port:
        kw = dict(model_config=SPEC, tokenizer_name="byte", teacher_server={"port": port, "timeout": 10})
        module = DistillationModule(
            mode="sampled", generation=GenerationConfig(max_new_tokens=4, temperature=1.0), **kw
        )
        assert isinstance(module.teacher, ServedTeacher) and "teacher" not in dict(module.named_modules())
        got = module.reference_logprobs(ids, mask, 5)
        local = LocalTeacher(teacher).token_logprobs(ids, mask, 5, 1.0)
        assert float((got - local)[mask[:, 5:].bool()].abs().max()) < 1e-4
        module.teacher.close()
        with pytest.raises(ConfigError, match="generation.temperature 1, not 0.7"):
            DistillationModule(mode="sampled", generation=GenerationConfig(temperature=0.7), **kw)
        with pytest.raises(ConfigError, match="mode: sampled"):
            DistillationModule(mode="full", **kw)
