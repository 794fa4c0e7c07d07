"""The only generation server dies mid-sampling (issue 48: a single server is a fleet of one, and its failure is the
fleet's one line, no longer a ``TypeError``): through the ``Fleet`` over a stand-in killed mid-request, and through
``aitraining-pl fit`` with ``generation.server: connect`` to a real HF server over HTTP that is SIGKILLed when the
first rollout is asked of it: exit status 2 and one line naming the server, what was being done and how to go on."""

from __future__ import annotations

import os
import signal
import threading
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from standin import StandInReplica

from aitraining_pl.errors import GenerationServerError
from aitraining_pl.generation.backend import SampleRequest
from aitraining_pl.generation.config import GenerationConfig, VLLMConfig
from aitraining_pl.generation.servers.auth import TOKEN_ENV
from aitraining_pl.generation.servers.fleet import Fleet
from aitraining_pl.generation.servers.http import HTTPReplica
from aitraining_pl.generation.servers.start import start
from aitraining_pl.models import build_causal_lm
from aitraining_pl.rollout import StopRule

ROOT = Path(__file__).resolve().parents[3]
WEIGHTS = [("w", torch.zeros(4))]
RESUME = "a run that had started resumes from its last checkpoint with --ckpt_path"


def test_the_only_server_killed_mid_sampling_is_one_line():
    """A fleet of one whose server is killed while it generates: one ``GenerationServerError`` naming the server and
    the replica's own reason, no "its requests go to the others" warning (there are none), and a push afterwards
    says the same."""
    only = StandInReplica("standin://only", token_seconds=0.01)
    fleet = Fleet([only], weights=lambda policy: iter(WEIGHTS), run="run")
    fleet.push(WEIGHTS, 0)
    ids = torch.tensor([[5, 6], [0, 7]])
    request = SampleRequest(ids, (ids > 0).long(), GenerationConfig(max_new_tokens=3), [0], StopRule(), 0, 2, 7)
    threading.Timer(0.03, only.kill).start()  # mid-request (it takes 0.12 s)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(GenerationServerError) as died:
        warnings.simplefilter("always")
        fleet.sample(request)
    line = f"generation server standin://only: connection refused; start it again; {RESUME}"
    assert str(died.value) == line
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    with pytest.raises(GenerationServerError) as push:
        fleet.push(WEIGHTS, 1)
    assert str(push.value) == line
    assert fleet.stats()["fleet/servers_up"].item() == 0.0


@pytest.fixture()
def hf_server(tmp_path):
    """The HF server (a child process, over HTTP) for the GRPO quickstart's policy (the tiny-llama preset, bytes)."""
    folder = tmp_path / "server"
    folder.mkdir()
    build_causal_lm({"preset": "tiny-llama"}).config.save_pretrained(folder)
    transformers.ByT5Tokenizer().save_pretrained(folder)
    process = start("hf", folder, options=VLLMConfig(), dtype="float32", threads=1, timeout=120)
    yield process
    process.stop()


@pytest.mark.slow
def test_the_only_server_killed_mid_sampling_ends_fit_with_one_line(hf_server, tmp_path, monkeypatch, capsys):
    """``aitraining-pl fit`` (the GRPO quickstart) with ``generation.server: connect``: the trainer pushes its
    weights, then the server is SIGKILLed as the first rollout's completion request is sent. The command exits with
    status 2 and prints one line: the server, what was being done and why, and how to go on (before this issue: a
    ``TypeError`` from the single-server backend)."""
    from aitraining_pl.cli import main

    call = HTTPReplica.call

    def killed_at_the_first_completion(replica, method, route, doing, *args, **kwargs):
        if route == "/v1/completions" and hf_server.process is not None:
            hf_server.process.send_signal(signal.SIGKILL)
            hf_server.process.wait(30)
        return call(replica, method, route, doing, *args, **kwargs)

    monkeypatch.setattr(HTTPReplica, "call", killed_at_the_first_completion)
    monkeypatch.setenv(TOKEN_ENV, hf_server.token)
    monkeypatch.chdir(tmp_path)
    port = hf_server.url.rpartition(":")[2]
    argv = ["fit", "--config", str(ROOT / "configs/quickstart/grpo.yaml"),
            "--data.init_args.data_path", str(ROOT / "aitraining_pl/data/quickstart_prompts.jsonl"),
            "--model.init_args.generation.server", "connect",
            "--model.init_args.generation.vllm.server_port", port,
            "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false"]  # fmt: skip
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("aitraining-pl:")]
    print(*lines, sep="\n")
    assert exited.value.code == 2 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith(
        f"aitraining-pl: generation server error: generation server {hf_server.url}: cannot reach the server while "
        "sampling"
    ), lines[0]
    assert lines[0].endswith(f"; start it again; {RESUME}"), lines[0]
    assert "Traceback" not in err and "TypeError" not in err
    assert os.environ[TOKEN_ENV] not in err  # never the token
