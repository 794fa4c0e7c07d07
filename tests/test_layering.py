"""The package's layers, read from their one home, the layer table of docs/architecture.md: a file imports only from
its own layer or the layers below it, the core never imports the seed-compatibility layer, ``losses`` is pure tensor
code, and no two files of the package import each other, directly or through others.

What counts as an import (``imports``): every ``import`` / ``from ... import`` statement of a file, wherever it sits:
at the top, inside a function (a lazy import is still a dependency between the two files, only hidden from the
interpreter's import order) or under ``if TYPE_CHECKING:``. ``from package import name`` is an import of the file
``package/name.py`` where that file exists, else of ``package/__init__.py``. Imports by string (``importlib``, the
backend registry's ``"module:Class"`` names) are not imports of a file and do not count."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "aitraining_pl"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
COMPAT = 6


def layer_table(text: str) -> dict[str, float]:
    """Dotted component below ``aitraining_pl`` -> layer number, from the table under ``## Layers`` of
    docs/architecture.md: its first column is the layer, its second the components (``name/`` a folder, ``name.py``
    a file; a note after a component, like ``(deprecated)``, is ignored)."""
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not re.fullmatch(r"\d+(\.\d+)?", cells[0]):
            continue
        for name in re.findall(r"`([a-z_/]+(?:\.py)?)`", cells[1]):
            layers[name.removesuffix("/").removesuffix(".py").replace("/", ".")] = float(cells[0])
    return layers


LAYERS = layer_table(ARCHITECTURE.read_text())


def test_the_layer_table_is_read_and_names_real_files():
    """The table gives a layer to each part of the package (so the checks below check something), every component it
    names exists, and every file it names in its descriptions exists."""
    assert {"losses", "models", "generation", "generation.servers", "rollout", "modules", "compat"} <= set(LAYERS)
    assert LAYERS["losses"] < LAYERS["models"] < LAYERS["generation"] < LAYERS["rollout"] < LAYERS["modules"] < COMPAT
    for component in LAYERS:
        path = PACKAGE.joinpath(*component.split("."))
        assert path.is_dir() or path.with_suffix(".py").is_file(), f"docs/architecture.md places {component}: no such"
    text = ARCHITECTURE.read_text()
    folders = (
        "losses|models|modules|environments|datamodules|callbacks|generation|generation/servers|generation/hf|rollout"
    )
    for path in re.findall(rf"`((?:{folders})/[a-z_]+\.py)`", text):
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


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, package: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every import in ``path``, wherever it sits (module docstring), relative imports
    resolved; ``from x import y`` gives ``x.y`` where that is a file of ``package``, else ``x``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_name(path, package).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                name = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            for alias in node.names:
                sub = f"{name}.{alias.name}"
                is_file = package.parent.joinpath(*sub.split(".")).with_suffix(".py").is_file()
                is_folder = package.parent.joinpath(*sub.split(".")).is_dir()
                found.append((node.lineno, sub if is_file or is_folder else name))
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    """Each file of ``package`` (dotted name; a package's ``__init__.py`` under the package's name) -> the files of
    ``package`` it imports (``imports``: the most specific file a name resolves to)."""
    files = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        targets = set()
        for _, imported in imports(path, package):
            while imported and imported not in files:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def import_cycles(package: Path) -> list[list[str]]:
    """The import cycles between the files of ``package``: the strongly connected components of ``import_graph``
    with more than one file (Tarjan's algorithm), each sorted; one component holds every cycle through its files."""
    graph = import_graph(package)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):  # iterative Tarjan: no recursion limit on deep import chains
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


def test_no_import_cycle_between_the_packages_files():
    """No file of the package imports, directly or through others, a file that imports it, counting the imports
    inside functions (module docstring)."""
    cycles = import_cycles(PACKAGE)
    assert not cycles, "import cycles between files: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle_hidden_in_a_function(tmp_path):
    """The check is not vacuous: two files that import each other, one of them only inside a function (the lazy
    import that hides a cycle from the interpreter), and a third file through a package's ``from . import``, are
    found as one cycle; a file importing a name of a package's ``__init__`` is an import of that ``__init__``."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.a import A\n")
    (package / "a.py").write_text("from pkg.sub import b\n\nA = 1\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def f():\n    from .c import C\n    return C\n")
    (package / "sub" / "c.py").write_text("from ..a import A\n\nC = A\n")
    (package / "d.py").write_text("from pkg import A\n")
    assert import_cycles(package) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]
    assert import_graph(package)["pkg.d"] == {"pkg"}


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_respect_the_layers(path):
    if path == PACKAGE / "__init__.py":  # the package's front door re-exports every layer (lazily)
        return
    component = _component(path)
    assert component in LAYERS, f"{component} has no layer: add it to the table of docs/architecture.md"
    layer = LAYERS[component]
    for line, name in imports(path):
        parts = name.split(".")
        if parts[0] != "aitraining_pl":
            continue
        assert len(parts) > 1, f"{path.relative_to(PACKAGE)}:{line} imports the package's front door (every layer)"
        target = LAYERS.get(_layer_of(parts[1:]) or "")
        assert target is not None, f"{path.name}:{line} imports unknown component {name}"
        assert target <= layer, f"{path.relative_to(PACKAGE)}:{line} (layer {layer}) imports {name} (layer {target})"
        if layer < COMPAT:
            assert target < COMPAT, f"{path.relative_to(PACKAGE)}:{line}: the core imports the compat layer ({name})"


@pytest.mark.parametrize("path", sorted((PACKAGE / "losses").rglob("*.py")), ids=lambda p: p.name)
def test_losses_are_pure_tensor_code(path):
    allowed = {"torch", "math", "typing", "dataclasses", "__future__", "collections", "functools", "aitraining_pl"}
    allowed.add("heapq")  # the standard library's heap (Karmarkar-Karp's differencing, losses/micro_batches.py)
    for line, name in imports(path):
        assert name.split(".")[0] in allowed, f"losses/{path.name}:{line} imports {name}"
