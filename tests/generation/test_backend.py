"""The generation-backend seam (``aitraining_pl.generation.backend``, ``registry.BACKENDS``): every backend has the
protocol's methods, and a new backend is one class plus one registry line, reached by ``generation.backend``."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_LLAMA

from aitraining_pl.generation.backend import GenerationBackend, SampledTokens
from aitraining_pl.generation.config import GenerationConfig
from aitraining_pl.generation.hf.backend import HFBackend
from aitraining_pl.generation.registry import BACKEND_NAMES, BACKENDS, backend_class, resolve_backend
from aitraining_pl.validation import HyperparameterError

PROTOCOL = ("sample", "sync", "sleep", "close", "location", "from_context")


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_registered_backend_has_the_protocol(name):
    """Checked on the classes (building a vLLM engine needs vLLM): the protocol's members and a constructor from
    the generation config and the run's context."""
    cls = backend_class(name)
    assert all(hasattr(cls, member) for member in PROTOCOL), name
    assert cls.location in ("policy", "colocated", "server")
    assert resolve_backend(GenerationConfig(backend=name.removesuffix("-server"))) in BACKENDS


def test_a_backend_module_is_imported_only_when_chosen():
    """The registry names each backend ``"module:Class"``: the rollout engine, the registry and the factory import no
    backend's module (vLLM's engine, a server client) until that backend is chosen."""
    import subprocess
    import sys

    code = (
        "import sys; import aitraining_pl.rollout, aitraining_pl.modules.online; "
        "from aitraining_pl.generation.registry import backend_class; "
        "before = sorted(m for m in ('aitraining_pl.generation.vllm',) "
        "if m in sys.modules); backend_class('vllm'); print(before, 'aitraining_pl.generation.vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "True"], out
    assert all(isinstance(entry, str) and ":" in entry for entry in BACKENDS.values())


class FixedBackend:
    """A backend that answers every prompt with the same tokens (the ``sglang`` of this test)."""

    location = "server"
    built: list = []

    def __init__(self, tokens: list[int]):
        self.tokens, self.synced, self.asleep, self.closed = tokens, [], 0, False

    @classmethod
    def from_context(cls, generation, context):
        backend = cls([70, 71, 2])
        cls.built.append((context.rank, context.run is not None, backend))
        return backend

    def sample(self, request):
        rows = request.prompt_ids.shape[0] * request.num_samples
        logps = torch.full((rows, len(self.tokens)), -0.5)
        return SampledTokens(torch.tensor([self.tokens] * rows), sampling_logprobs=logps)

    def sync(self, policy, version=None):
        self.synced.append(version)
        return True

    def sleep(self):
        self.asleep += 1

    def close(self):
        self.closed = True

    def stats(self):
        return {}


def test_a_new_backend_is_one_class_and_one_registry_line(monkeypatch, tmp_path):
    """Registered under a name, the class is what ``generation.backend: <name>`` builds at setup; the online
    module's rollouts come from it, synced at each rollout with the optimizer step and put to sleep after; it is
    closed at teardown. An unregistered name is refused before any model loads."""
    from aitraining_pl.modules.critic_free import GRPOModule

    monkeypatch.setitem(BACKENDS, "fixed", FixedBackend)
    monkeypatch.setattr("aitraining_pl.generation.registry.BACKEND_NAMES", sorted({*BACKEND_NAMES, "fixed"}))
    assert isinstance(FixedBackend([1]), GenerationBackend)
    module = GRPOModule(
        model_config=TINY_LLAMA,
        tokenizer_name="byte",
        reward=lambda p, r, m: [1.0] * len(r),
        num_generations=2,
        generation=GenerationConfig(backend="fixed", max_new_tokens=3),
    )

    class Strategy:
        broadcast = staticmethod(lambda value: value)

    trainer = type("T", (), {"strategy": Strategy, "precision": "32-true"})
    monkeypatch.setattr(type(module), "trainer", property(lambda self: trainer()))
    module.setup("fit")
    backend = module.backend
    assert isinstance(backend, FixedBackend) and FixedBackend.built[-1][:2] == (0, True)
    ids = torch.tensor([[0, 0, 104, 105], [0, 106, 107, 108]])
    rollout = module.generate(ids, (ids > 0).long(), num_samples=2)
    assert rollout.response_ids.tolist() == [[70, 71, 2]] * 4
    assert rollout.sampling_logprobs.eq(-0.5).all() and backend.synced == [0] and backend.asleep == 1
    module.teardown("fit")
    assert backend.closed and isinstance(module.backend, HFBackend)
    with pytest.raises(HyperparameterError, match="generation.backend"):
        GenerationConfig(backend="sglang").validate("generation")
