"""The colocated vLLM engine's device decisions (issue 41), with vLLM itself replaced by a recorder of the keyword
arguments and calls it gets, on a stub GPU: its dtype from the trainer's precision, ``max_model_len`` from the
prompt budget and ``max_new_tokens``, sleep at level 2 (wake the weights, load them, then wake the KV cache, with
``empty_cache`` before each wake), and sampling outside the trainer's autocast. The real vLLM's signatures for the
same keywords are checked in ``tests/generation/test_vllm_api.py``."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import peft  # noqa: F401 - imported before the stub GPU: bitsandbytes, which peft imports, reads the device then
import pytest
import torch
from conftest import TINY_LLAMA, quiet_trainer

from aitraining_pl.datamodules import PromptDataModule
from aitraining_pl.generation.backend import BackendContext, SampleRequest, StopRule
from aitraining_pl.generation.config import GenerationConfig, VLLMConfig
from aitraining_pl.generation.vllm import VLLMEngine
from aitraining_pl.models import build_causal_lm, load_tokenizer

POLICY = {**TINY_LLAMA, "hidden_size": 64, "num_attention_heads": 2}


class FakeLLM:
    """Records how the engine builds and drives vLLM's ``LLM``; ``generate`` answers two tokens per sample."""

    built: list[FakeLLM] = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []
        FakeLLM.built.append(self)

    def sleep(self, level: int = 1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, kwargs=None):
        self.calls.append((method, len(list(kwargs["weights_iterator"]))))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(("generate", torch.is_autocast_enabled("cpu")))
        samples = [SimpleNamespace(token_ids=[5, 6], logprobs=None) for _ in range(params[0].n)]
        return [SimpleNamespace(outputs=samples, num_cached_tokens=0) for _ in prompts]


@pytest.fixture
def fake_vllm(monkeypatch):
    """``vllm`` as the recorder, and a (stub) CUDA device whose ``empty_cache`` calls are recorded."""
    module, inputs = types.ModuleType("vllm"), types.ModuleType("vllm.inputs")
    module.LLM, module.SamplingParams, module.inputs = FakeLLM, lambda **kw: SimpleNamespace(**kw), inputs
    inputs.TokensPrompt = dict
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: FakeLLM.built[-1].calls.append(("empty_cache",)))
    FakeLLM.built = []
    return FakeLLM


def engine(precision=None, max_prompt_length=None, **options) -> VLLMEngine:
    generation = GenerationConfig(max_new_tokens=32, backend="vllm", vllm=VLLMConfig(**options))
    context = BackendContext(
        build_causal_lm(POLICY), load_tokenizer("byte"), precision=precision, max_prompt_length=max_prompt_length
    )
    return VLLMEngine.from_context(generation, context)


@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16-mixed", "bfloat16"), ("16-mixed", "float16"), ("32-true", "float32")]
)
def test_dtype_comes_from_the_trainers_precision(fake_vllm, precision, dtype):
    """A float32 policy (inline config, or master weights) samples in the trainer's compute dtype."""
    engine(precision).close()
    assert fake_vllm.built[-1].kwargs["dtype"] == dtype


def test_max_model_len_is_the_prompt_budget_plus_new_tokens_unless_set(fake_vllm):
    for options, expected in (({}, 100 + 32), ({"max_model_len": 512}, 512)):
        engine("bf16-mixed", 100, **options).close()
        assert fake_vllm.built[-1].kwargs["max_model_len"] == expected


def test_sleep_level_2_wakes_the_weights_loads_them_then_wakes_the_kv_cache(fake_vllm):
    vllm_engine = engine("bf16-mixed", 16, sleep=True)
    policy = build_causal_lm(POLICY)
    vllm_engine.sync(policy, version=0)
    vllm_engine.sleep()
    llm = fake_vllm.built[-1]
    llm.calls.clear()
    assert vllm_engine.sync(policy, version=0)  # the same version, but level 2 dropped the weights: loaded again
    vllm_engine.sample(
        SampleRequest(torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3), GenerationConfig(), [1], StopRule(), 0)
    )
    tensors = len(policy.state_dict())
    assert llm.calls == [
        ("empty_cache",), ("wake_up", ["weights"]), ("reload_weights", tensors), ("empty_cache",),
        ("wake_up", ["kv_cache"]), ("reset_prefix_cache",), ("generate", False),
    ]  # fmt: skip
    vllm_engine.sleep()
    assert llm.calls[-1] == ("sleep", 2)
    vllm_engine.close()


def test_sampling_runs_outside_the_trainers_autocast(fake_vllm):
    vllm_engine = engine("bf16-mixed", 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        vllm_engine.sample(
            SampleRequest(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3), GenerationConfig(), [1], StopRule(), 0)
        )
    assert fake_vllm.built[-1].calls[-1] == ("generate", False)
    vllm_engine.close()


def test_a_grpo_run_gives_the_engine_its_precision_and_prompt_budget(fake_vllm, tmp_path, monkeypatch):
    from aitraining_pl.modules import GRPOModule

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the trainer on the CPU (vLLM's CPU path)
    module = GRPOModule(
        model_config=POLICY, tokenizer_name="byte", reward=lambda p, r, m: [float(len(x)) for x in r],
        generation=GenerationConfig(max_new_tokens=4, backend="vllm"), num_generations=2, mini_batch_size=4,
    )  # fmt: skip
    data = PromptDataModule(prompts=["hello", "a longer prompt"], tokenizer=load_tokenizer("byte"), batch_size=2,
                            max_prompt_length=24)  # fmt: skip
    quiet_trainer(tmp_path, limit_train_batches=1, precision="bf16-mixed").fit(module, data)
    kwargs = fake_vllm.built[0].kwargs
    assert (kwargs["dtype"], kwargs["max_model_len"]) == ("bfloat16", 24 + 4)
