"""The old ``aitraining_pl.vllm_backend`` paths, kept for one release: each still imports what it held, from the
module that now holds it, and warns once (``DeprecationWarning``) naming that module."""

from __future__ import annotations

import json
import subprocess
import sys

from aitraining_pl.generation.servers import tcp_wire
from aitraining_pl.vllm_backend import MOVED

#: run in a fresh process (the warnings of a first import are the ones a user sees): each old path imported twice
CHECK = """
import importlib, json, sys, warnings
from aitraining_pl.vllm_backend import MOVED
warnings.simplefilter("always")
report = {}
with warnings.catch_warnings(record=True) as caught:
    import aitraining_pl.vllm_backend
for old, new in MOVED.items():
    with warnings.catch_warnings(record=True) as each:
        first = importlib.import_module("aitraining_pl.vllm_backend." + old)
        second = importlib.import_module("aitraining_pl.vllm_backend." + old)
    module = importlib.import_module(new)
    same = first is module and second is module and module.__spec__.name == new
    report[old] = [same, [str(w.message) for w in each if w.category is DeprecationWarning]]
print(json.dumps(report))
"""


def test_each_old_submodule_is_the_new_module_and_warns_once():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    assert sorted(report) == sorted(MOVED)
    for old, (same, messages) in report.items():
        assert same, old
        assert len(messages) == 1, (old, messages)  # the first import warns, the second does not
        assert f"aitraining_pl.vllm_backend.{old} is deprecated" in messages[0] and MOVED[old] in messages[0]


def test_importing_the_package_warns_naming_the_new_one():
    code = "import warnings; warnings.simplefilter('error'); import aitraining_pl.vllm_backend"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode != 0 and "DeprecationWarning: aitraining_pl.vllm_backend is deprecated" in run.stderr
    assert "aitraining_pl.generation" in run.stderr


def test_the_old_names_still_work():
    """What users imported from the old paths: the package's config names, the engine, the client, the command."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from aitraining_pl.generation.config import VLLMConfig
        from aitraining_pl.generation.servers import client, serve
        from aitraining_pl.generation.vllm import VLLMEngine
        from aitraining_pl.vllm_backend import VLLMConfig as OldConfig
        from aitraining_pl.vllm_backend import wire
        from aitraining_pl.vllm_backend.client import VLLMServerClient
        from aitraining_pl.vllm_backend.engine import SampleRequest, policy_weights
        from aitraining_pl.vllm_backend.engine import VLLMEngine as OldEngine
        from aitraining_pl.vllm_backend.serve import main

    assert OldConfig is VLLMConfig and OldEngine is VLLMEngine and VLLMServerClient is client.VLLMServerClient
    assert main is serve.main and wire is tcp_wire and callable(policy_weights)
    assert SampleRequest.__module__ == "aitraining_pl.generation.backend"
