"""``benchmarks/gpu_check.py --dry-run`` (issue 41): every check's code path on the CPU, as the lent GPU machine would
import it: with every installed package that is neither required by the machine's own packages (torch, lightning,
transformers, peft, torchmetrics) nor listed in ``benchmarks/gpu_wheels.txt`` made absent."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: what the lent machine has installed, with everything these require
DEVICE_PACKAGES = ("torch", "lightning", "transformers", "peft", "torchmetrics")

#: run as ``python -c``: packages named in $ABSENT fail to import and ``find_spec`` does not find them
ABSENT_RUNNER = """
import importlib.abc, importlib.util, os, runpy, sys
absent = set(os.environ["ABSENT"].split(","))
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in absent:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: None if name.split(".")[0] in absent else find_spec(name, package)
sys.meta_path.insert(0, Absent())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def required_closure(names) -> set[str]:
    """``names`` and every distribution they require (extras left out), as installed here."""
    seen: set[str] = set()
    stack = [normalised(n) for n in names]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requirements = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        stack += [normalised(re.split(r"[\s;<>=!~\[(]", r, maxsplit=1)[0]) for r in requirements if "extra ==" not in r]
    return seen


def test_dry_run_covers_every_check_with_the_devices_packages_only(tmp_path):
    wheels = [line.split("==")[0] for line in (ROOT / "benchmarks" / "gpu_wheels.txt").read_text().splitlines()]
    allowed = required_closure(DEVICE_PACKAGES) | {normalised(w) for w in wheels if w and not w.startswith("#")}
    allowed.add("aitraining-pl")
    absent = sorted(
        module
        for module, dists in metadata.packages_distributions().items()
        if module.isidentifier() and not any(normalised(d) in allowed for d in dists)
    )
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "ABSENT": ",".join(absent), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", ABSENT_RUNNER, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run"]
    done = subprocess.run([*command, "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checks = json.loads(out.read_text())["checks"]
    assert sorted(checks) == ["clip", "fsdp2", "grpo", "head", "master", "vllm"]
    assert all(c["ok"] for name, c in checks.items() if name != "vllm"), checks
    assert checks["vllm"]["ok"] is None or checks["vllm"]["ok"]  # skipped without vLLM
    assert checks["clip"]["max_rel_diff"] < 0.1 and checks["master"]["changed"] >= 0.99
    table = done.stdout.splitlines()
    assert [line.split()[0] for line in table[-6:]] == list(checks)  # the table: one row per check
