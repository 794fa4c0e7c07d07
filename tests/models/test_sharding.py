"""``models.sharding`` in one process: FSDP2 over a 1-rank gloo group still turns parameters into ``DTensor``s and
runs its hooks, so scoring that bypassed them (the decoder and head called directly) would fail or differ here.
The 2-process runs are in ``test_fsdp.py``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from architectures import MATRIX, build_sharpened, names, spec
from conftest import TINY_LLAMA

from aitraining_pl.models.scoring import token_scores
from aitraining_pl.models.sharding import as_forward, full_weights, gathered, is_sharded, shard, transformer_blocks

#: architectures whose scoring runs sharded here (fast path, soft-capped head, scaled head, a hybrid with Mamba)
SHARDED = ["llama", "qwen2", "gemma2", "granite", "gpt_neox", "gpt2", "falcon_h1"]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from torch.distributed.device_mesh import init_device_mesh

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.mark.parametrize("model_type", sorted(names(MATRIX)))
def test_transformer_blocks_are_the_decoder_layers(model_type):
    model = build_sharpened(model_type)
    layers = spec(model_type).get("num_hidden_layers", spec(model_type).get("n_layer"))
    blocks = transformer_blocks(model)
    assert len(blocks) == layers
    assert len({type(b) for b in blocks}) == 1


def _batch(vocab: int):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (3, 10), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding
    scored = mask.clone()
    scored[:, :4] = 0
    return ids, mask, scored


@pytest.mark.parametrize("model_type", SHARDED)
def test_sharded_scoring_and_gradients_equal_the_plain_model(mesh, model_type):
    plain = build_sharpened(model_type).float().eval()  # eval: no dropout (gpt_neox, gpt2)
    sharded = shard(copy.deepcopy(plain), mesh)
    assert is_sharded(sharded) and not is_sharded(plain)
    ids, mask, scored = _batch(plain.config.vocab_size)
    want = token_scores(plain, ids, mask, scored, with_entropy=True)
    got = token_scores(sharded, ids, mask, scored, with_entropy=True)
    torch.testing.assert_close(got.logps, want.logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.entropy, want.entropy, atol=1e-5, rtol=1e-5)
    (want.logps.sum() + want.entropy.sum()).backward()
    (got.logps.sum() + got.entropy.sum()).backward()
    grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    sharded_grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters() if p.grad is not None}
    assert grads.keys() == sharded_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(sharded_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_generation_inside_gathered_equals_the_plain_model(mesh):
    from aitraining_pl.models import build_causal_lm

    plain = build_causal_lm(TINY_LLAMA, seed=0).eval()
    sharded = shard(copy.deepcopy(plain), mesh).eval()
    prompt = torch.tensor([[5, 6, 7, 8]])
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    want = plain.generate(prompt, **options)
    with gathered(sharded):
        got = sharded.generate(prompt, **options)
        assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in sharded.parameters())
    assert torch.equal(got, want)
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in sharded.parameters())  # resharded


def test_full_weights_swaps_in_full_tensors_and_puts_the_shards_back(mesh):
    from aitraining_pl.models import build_causal_lm

    plain = build_causal_lm({**TINY_LLAMA, "tie_word_embeddings": True}, seed=0)
    sharded = shard(copy.deepcopy(plain), mesh)
    before = [id(p) for p in sharded.parameters()]
    with full_weights(sharded):
        state = sharded.state_dict()
        assert sharded.lm_head.weight is sharded.model.embed_tokens.weight  # ties kept
    for name, value in plain.state_dict().items():
        assert torch.equal(state[name], value), name
    assert [id(p) for p in sharded.parameters()] == before


def test_as_forward_is_a_plain_call_without_sharding():
    assert as_forward(torch.nn.Linear(2, 2), lambda x: x + 1, 1) == 2


def test_configure_model_does_nothing_without_a_model_parallel_strategy():
    from aitraining_pl.modules.dpo import DPOModule

    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte")
    module.configure_model()
    assert not is_sharded(module)


def test_fsdp1_is_refused_with_the_fsdp2_name():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from aitraining_pl.errors import ConfigError
    from aitraining_pl.modules.dpo import DPOModule

    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte")
    module._trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(ConfigError, match="use fsdp2"):
        module.configure_model()


@pytest.mark.parametrize(
    ("given", "expected"),
    [(None, "cpu:gloo,cuda:nccl"), ("nccl", "cpu:gloo,cuda:nccl"), ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl")],
)
def test_cpu_offload_gives_the_process_group_a_cpu_side(monkeypatch, given, expected):
    """On a (stub) CUDA device Lightning would start NCCL alone; the host shards of ``fsdp2_cpu_offload`` need gloo
    for the clip's all-reduce and their gathers. Without offload the backend is left to Lightning."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from aitraining_pl.strategies import FSDP2Strategy

    monkeypatch.setattr(ModelParallelStrategy, "setup_environment", lambda self: None)  # no process group here
    for offload, backend in ((True, expected), (False, given or "nccl")):
        strategy = FSDP2Strategy(cpu_offload=offload, process_group_backend=given)
        strategy.parallel_devices = [torch.device("cuda", 0)]
        strategy.setup_environment()
        assert strategy._get_process_group_backend() == backend


def test_offloaded_shards_are_gathered_on_the_mesh_device(mesh, monkeypatch):
    """``full_weights`` under CPU offload on a (stub) accelerator: every shard is moved to the mesh's device before
    ``full_tensor`` (the gather runs there), and the full weights come back to the host."""
    from torch.distributed.tensor import DTensor

    from aitraining_pl.models import build_causal_lm, sharding

    sharded = shard(build_causal_lm(TINY_LLAMA, seed=0), mesh)
    gathered_on: list[str] = []

    def gather(self):
        gathered_on.append(self.to_local().device.type)
        return torch.zeros(self.shape)  # what the device would send back

    monkeypatch.setattr(sharding, "mesh_device", lambda mesh: torch.device("meta"))
    monkeypatch.setattr(DTensor, "full_tensor", gather)
    with full_weights(sharded):
        devices = {p.device.type for p in sharded.parameters()}
    monkeypatch.undo()
    assert set(gathered_on) == {"meta"} and len(gathered_on) == len(list(sharded.parameters()))
    assert devices == {"cpu"}


def test_cpu_offload_is_decided_by_the_strategys_device_not_the_modules(mesh, monkeypatch):
    """``configure_model`` runs before Lightning moves the module to its device: on a (stub) GPU the parameters are
    still on the CPU there, so the offload check reads the strategy's root device; on a CPU offload is refused."""
    from types import SimpleNamespace

    import aitraining_pl.modules.base as base
    from aitraining_pl.errors import ConfigError
    from aitraining_pl.modules.dpo import DPOModule

    sharded: list[bool] = []
    monkeypatch.setattr(base, "shard", lambda network, mesh, precision, offload: sharded.append(offload))
    monkeypatch.setattr(base, "DTensor", torch.Tensor)  # every parameter counts as sharded (shard is stubbed)
    for device in ("cuda", "cpu"):
        module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte")
        strategy = SimpleNamespace(cpu_offload=True, root_device=torch.device(device))
        module._trainer, module._device_mesh = SimpleNamespace(strategy=strategy, precision="bf16-mixed"), mesh
        if device == "cpu":
            with pytest.raises(ConfigError, match="cpu_offload"):
                module.configure_model()
        else:
            module.configure_model()
            assert sharded == [True, True]  # the policy and the frozen reference
