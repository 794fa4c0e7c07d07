"""The package's layers (docs/architecture.md, CONTRIBUTING.md): a module imports only from its own layer or the layers
below it, the core never imports the seed-compatibility layer, and ``losses`` is pure tensor code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "aitraining_pl"

#: dotted component below ``aitraining_pl`` -> layer number; a sub-package (``generation.vllm``) may have a floor of
#: its own above its package's, and a file belongs to the longest component that names it
LAYERS = {
    "losses": 1,
    "errors": 1,  # the typed user errors: no project imports
    "guarded_call": 1,  # calling user code with a timeout (reward sources): no project imports
    "models": 2,
    "optim": 2,
    "validation": 2,  # the hyperparameter range table
    "datamodules": 3,
    # within layer 3 the generation side is ordered by role: what every engine shares, then the engines and the
    # servers, then the rollout side on top of them, then the environments that drive it (so no backend imports
    # the rollout engine, and the shared core imports no engine)
    "generation": 3.0,  # GenerationConfig (a leaf), the backend protocol, WeightsVersion, the registry and factory
    "generation.vllm": 3.1,  # the colocated vLLM engine
    "generation.servers": 3.1,  # the server client, weight sync, the HF server, the launcher, the serve command
    "rollout": 3.2,  # the rollout engine, the asynchronous pipeline
    "vllm_backend": 3.1,  # deprecated re-export of the old paths, for one release (nothing in the package imports it)
    "rewards": 3,
    "remote_rewards": 3,  # reward sources over HTTP (a reward server, an LLM judge)
    "callbacks": 3,
    "strategies": 3,
    "environments": 3.3,
    "data": 3.4,  # scripts that build the shipped data (they use the environments and the agents)
    "agents": 3.4,  # the OpenAI-compatible endpoint and AgentEnvironment (on the environments and the engine)
    "modules": 4,
    "cli": 5,
    "cli_help": 5,  # the command's overview, --version and nested help
    "cli_errors": 5,  # the command's error translation (one-line user errors, SIGTERM)
    "tinker": 5,  # tinker-serve: the tinker client's protocol on the core's losses and the rollout engine
    # the seed's API (compatibility layer): on top, nothing below imports it
    "compat": 6,
    "facades": 6,
    "dpo": 6,
    "reward_trainer": 6,
    "forward_backward": 6,
}
COMPAT = 6
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def test_architecture_page_lists_every_layer():
    """docs/architecture.md names every component of ``LAYERS`` in its layer table (and only real files)."""
    text = ARCHITECTURE.read_text()
    for component in LAYERS:
        assert f"`{component}" in text, f"docs/architecture.md does not place {component}"
    folders = "losses|models|modules|environments|datamodules|callbacks|generation|generation/servers|rollout"
    files = rf"`((?:{folders})/[a-z_]+\.py)`"
    for path in re.findall(files, text):
        assert (PACKAGE / path).is_file(), f"docs/architecture.md names {path}, which does not exist"


def _layer_of(parts: list[str]) -> str | None:
    """The longest component of ``LAYERS`` that the dotted ``parts`` (below ``aitraining_pl``) start with."""
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in LAYERS:
            return ".".join(parts[:end])
    return None


def _component(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return _layer_of(parts) or parts[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path`` (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ["aitraining_pl", *path.relative_to(PACKAGE).with_suffix("").parts]
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            if name == "aitraining_pl":  # from aitraining_pl import x: x is the component
                found[-1:] = [(node.lineno, f"aitraining_pl.{alias.name}") for alias in node.names]
    return found


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_respect_the_layers(path):
    component = _component(path)
    assert component in LAYERS, f"{component} has no layer: add it to LAYERS (and CONTRIBUTING.md)"
    layer = LAYERS[component]
    for line, name in _imports(path):
        parts = name.split(".")
        if parts[0] != "aitraining_pl" or len(parts) < 2:
            continue
        target = LAYERS.get(_layer_of(parts[1:]) or "")
        assert target is not None, f"{path.name}:{line} imports unknown component {name}"
        assert target <= layer, f"{path.relative_to(PACKAGE)}:{line} (layer {layer}) imports {name} (layer {target})"
        if layer < COMPAT:
            assert target < COMPAT, f"{path.relative_to(PACKAGE)}:{line}: the core imports the compat layer ({name})"


def test_nothing_in_the_package_imports_the_deprecated_vllm_backend():
    """``vllm_backend`` only re-exports the generation side's old paths (for users, with a warning)."""
    for path in SOURCES:
        if _component(path) != "vllm_backend":
            for line, name in _imports(path):
                assert not name.startswith("aitraining_pl.vllm_backend"), f"{path.relative_to(PACKAGE)}:{line}"


@pytest.mark.parametrize("path", sorted((PACKAGE / "losses").rglob("*.py")), ids=lambda p: p.name)
def test_losses_are_pure_tensor_code(path):
    allowed = {"torch", "math", "typing", "dataclasses", "__future__", "collections", "functools", "aitraining_pl"}
    allowed.add("heapq")  # the standard library's heap (Karmarkar-Karp's differencing, losses/micro_batches.py)
    for line, name in _imports(path):
        assert name.split(".")[0] in allowed, f"losses/{path.name}:{line} imports {name}"
