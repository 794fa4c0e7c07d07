"""Server mode of the vLLM backend (``aitraining-pl vllm-serve`` + ``generation.vllm.mode: server``): 2 DDP ranks
on gloo sampling from a server on loopback with rank 0 pushing the weights, the server's greedy and seeded
rollouts equal to the colocated engine's, one clear error when the server dies mid-run, and the framing of the
channel. The tests that start a server are marked ``vllm`` (skipped without vLLM; CI runs them in the vLLM venv);
the framing and client-error tests need no vLLM and run everywhere."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from server_fixtures import SPEC, RecordingEngine, options, serving

from aitraining_pl.errors import GenerationServerError
from aitraining_pl.generation.backend import SampleRequest
from aitraining_pl.generation.config import VLLMConfig
from aitraining_pl.generation.servers.tcp_wire import MAGIC, FrameError, read_frame, send_frame
from aitraining_pl.generation.version import WeightsVersion
from aitraining_pl.models import build_causal_lm

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "helpers" / "vllm_server_ddp_script.py"


# ---------------------------------------------------------------------- a server process
def start_server(log: Path, *argv: str) -> tuple[subprocess.Popen, int]:
    """``aitraining-pl vllm-serve`` on a free loopback port; returns the process and the port it printed."""
    pytest.importorskip("vllm")
    from aitraining_pl.generation.servers.serve import launch

    os.environ.setdefault("PYTHONPATH", str(ROOT))
    return launch(["--model", json.dumps(SPEC), "--tokenizer", "byte", "--port", "0", *argv], log)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # the connected ranks' requests always meet in one batch (each test's connections all sample; a batch waits
    # for every open connection's request, up to this long)
    proc, port = start_server(tmp_path_factory.mktemp("server") / "serve.log", "--batch_wait_ms", "20000")
    yield port
    stop(proc)


# ---------------------------------------------------------------------- (a) DDP ranks + server
@pytest.mark.vllm
@pytest.mark.ddp
@pytest.mark.parametrize("strategy, channel", [("ddp", "tcp"), pytest.param("fsdp", "gloo", marks=pytest.mark.slow)])
def test_two_ranks_sample_their_own_prompts_from_pushed_weights(server, tmp_path, strategy, channel):
    """2 gloo ranks (DDP; FSDP2: every rank gathers each tensor, rank 0 sends it), one server: every rollout of every
    rank is sampled from the policy's current weights (the server's log-probs of the sampled tokens equal the rank's
    policy's, conditioned on the rank's own prompts, to 1e-4 in fp32; the second rollout comes after optimizer
    steps, so rank 0 pushed and rank 1 waited for them); each rollout's requests of the two ranks are drawn by one
    ``generate`` of the server. Rank 0 pushes over the TCP connection (DDP) or by broadcast on a gloo weight
    channel while the other rank gathers the next tensor (FSDP2)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(SCRIPT), str(tmp_path), str(server), strategy, channel]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for rank in ranks:
        records = rank["records"]
        assert [r["step"] for r in records] == [0, 2] and rank["global_step"] == 4  # 2 steps per rollout
        assert all(r["rows"] == 2 * 4 for r in records)  # 2 prompts x G=4 samples back, for this rank's requests
        assert all(r["batched"] == 2 for r in records)  # both ranks' requests in one generate of the server
        assert max(r["gap"] for r in records) < 1e-4, records
    prompts = [{p for r in rank["records"] for p in r["prompts"]} for rank in ranks]
    assert prompts[0].isdisjoint(prompts[1]) and len(prompts[0] | prompts[1]) == 8
    assert all(rank["sharded"] == (strategy == "fsdp") for rank in ranks)
    for name, tensor in ranks[0]["state"].items():  # DDP: the same weights on both ranks
        assert torch.equal(tensor, ranks[1]["state"][name]), name


# ---------------------------------------------------------------------- (b) equal to the colocated engine
@pytest.mark.vllm
def test_server_rollouts_equal_the_colocated_engines(server):
    """Greedy (with an end-of-turn id that greedy decoding reaches) and seeded sampling: the server's rollout
    equals the colocated engine's for the same weights, token for token, with the same vLLM log-probs; a client
    whose policy has another shape is refused at connection."""
    from architectures import sharpen

    from aitraining_pl.errors import ConfigError
    from aitraining_pl.generation.servers.client import VLLMServerClient
    from aitraining_pl.generation.vllm import VLLMEngine
    from aitraining_pl.models import load_tokenizer
    from aitraining_pl.rollout import GenerationConfig, RolloutEngine

    tokenizer = load_tokenizer("byte", padding_side="left")
    model = sharpen(build_causal_lm(SPEC, seed=0), 4.0).eval()
    texts = ["hello there", "ab", "the quick brown fox"]
    enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    greedy = GenerationConfig(max_new_tokens=16, do_sample=False)
    first = RolloutEngine(tokenizer, greedy).sample(model, ids, mask, 2)
    ends = [1, int(first.response_ids[0, 4])]
    colocated = VLLMEngine(model, tokenizer, VLLMConfig(), max_length=256)
    client = VLLMServerClient(model, options(server))
    try:
        colocated.sync(model)
        client.sync(model)
        for generation, seed in ((greedy, None), (dataclasses.replace(greedy, do_sample=True, temperature=1.0), 7)):
            ours = RolloutEngine(tokenizer, generation, end_token_ids=ends, backend=colocated).sample(
                model, ids, mask, 2, seed=seed
            )
            theirs = RolloutEngine(tokenizer, generation, end_token_ids=ends, backend=client).sample(
                model, ids, mask, 2, seed=seed
            )
            assert torch.equal(theirs.response_ids, ours.response_ids)
            assert torch.equal(theirs.response_mask, ours.response_mask) and theirs.texts == ours.texts
            assert torch.equal(theirs.sampling_logprobs, ours.sampling_logprobs)
            if seed is None:
                assert ours.ended.any() and not ours.ended.all()  # the end rule was exercised
    finally:
        client.close()
        colocated.close()
    other = build_causal_lm({**SPEC, "num_hidden_layers": 3}, seed=0)
    with pytest.raises(ConfigError, match="num_hidden_layers 2 .the policy's: 3"):
        VLLMServerClient(other, options(server))


@pytest.mark.vllm
def test_a_lora_push_and_a_version_that_never_arrives(server):
    """A LoRA policy's push (base weights with the deltas merged on the fly) after optimizer steps: the server's
    log-probs equal the policy's (1e-4, fp32). A rank waiting for weights that rank 0 never pushes gets one line
    after ``server_timeout``."""
    from vllm_fixtures import logp_gap, train_steps

    from aitraining_pl.generation.servers.client import VLLMServerClient
    from aitraining_pl.models import apply_lora, load_tokenizer
    from aitraining_pl.models.lora import LoRAConfig
    from aitraining_pl.rollout import GenerationConfig

    tokenizer = load_tokenizer("byte", padding_side="left")
    model = apply_lora(build_causal_lm(SPEC, seed=1), LoRAConfig(r=4, alpha=8, dropout=0.0))
    train_steps(model)
    client = VLLMServerClient(model, options(server))
    try:
        assert client.sync(model, version=3) and not client.sync(model, version=3)  # once per version
        assert logp_gap(client, model, tokenizer, GenerationConfig(max_new_tokens=8, temperature=1.0)) < 1e-4
    finally:
        client.close()
    waiting = VLLMServerClient(model, options(server, server_timeout=1), rank=1)
    try:
        waiting.sync(model, version=4)  # rank 1 records the version; rank 0 never pushes it
        with pytest.raises(GenerationServerError, match=r"did not arrive within 1 s"):
            logp_gap(waiting, model, tokenizer, GenerationConfig(max_new_tokens=4))
    finally:
        waiting.close()


@pytest.mark.vllm
def test_weights_pushed_by_broadcast_on_a_gloo_weight_channel(server, tmp_path):
    """``weight_channel: gloo``: rank 0 opens a two-member gloo group with the server and each tensor's bytes go by
    broadcast (the frames name them only): after optimizer steps, and after more steps, the server's log-probs equal
    the policy's (1e-4, fp32), and not before the second push. The NCCL channel is the same code on GPU tensors."""
    from vllm_fixtures import logp_gap, train_steps

    from aitraining_pl.generation.servers.client import VLLMServerClient
    from aitraining_pl.models import load_tokenizer
    from aitraining_pl.rollout import GenerationConfig

    tokenizer = load_tokenizer("byte", padding_side="left")
    generation = GenerationConfig(max_new_tokens=8, temperature=1.0)
    model = build_causal_lm(SPEC, seed=2)
    train_steps(model)
    client = VLLMServerClient(model, options(server, weight_channel="gloo"))
    try:
        assert client.group is None  # chosen at the first push, not at setup (issue 38)
        assert client.sync(model, version=3)
        assert client.group is not None and client.group.backend == "gloo"
        assert logp_gap(client, model, tokenizer, generation) < 1e-4
        train_steps(model)
        assert logp_gap(client, model, tokenizer, generation) > 1e-2  # the server holds version 3
        assert client.sync(model, version=6)
        assert logp_gap(client, model, tokenizer, generation) < 1e-4
    finally:
        client.close()


@pytest.mark.vllm
def test_a_refused_push_leaves_the_real_engine_on_its_weights(server):
    """On the real engine (the module's one server): a push with a NaN weight, then one with a wrong shape, are
    each refused with one line before vLLM loads anything (before: NaN log-probs until a restart, and the next
    correct push failed with ``load: AssertionError``); the engine samples from the last good weights, and the
    next correct push loads."""
    from vllm_fixtures import logp_gap, train_steps

    from aitraining_pl.generation.servers.client import VLLMServerClient
    from aitraining_pl.models import load_tokenizer
    from aitraining_pl.rollout import GenerationConfig

    tokenizer = load_tokenizer("byte", padding_side="left")
    generation = GenerationConfig(max_new_tokens=8, temperature=1.0)
    model = build_causal_lm(SPEC, seed=4)
    client = VLLMServerClient(model, options(server))
    try:
        assert client.sync(model, version=1)
        good = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        name = "model.layers.0.mlp.up_proj.weight"
        for step, (bad, why) in enumerate(
            [
                (good[name].clone().fill_(float("nan")), r"has 8192 non-finite values"),
                (good[name][:, :-1], "has shape"),
            ],
            2,
        ):
            with pytest.raises(GenerationServerError, match=f"the server refused: load: '{name}' {why}"):
                _push(client, str(WeightsVersion(client.run, step)), {**good, name: bad.contiguous()})
        assert logp_gap(client, model, tokenizer, generation) < 1e-4  # still version 1, finite
        train_steps(model)
        assert client.sync(model, version=5)
        assert logp_gap(client, model, tokenizer, generation) < 1e-4
    finally:
        client.close()


def _push(client, version: str, tensors: dict) -> None:
    """``tensors`` pushed as ``version`` over ``client``'s connection, frame by frame (as ``sync`` does)."""
    send_frame(client.sock, {"op": "load", "version": version, "via": "frames"})
    for name, tensor in tensors.items():
        send_frame(client.sock, {"op": "weight"}, {name: tensor})
    send_frame(client.sock, {"op": "end", "count": len(tensors)})
    client.answer(f"pushing {version}")


def test_the_gloo_weight_channel_carries_every_tensor_exactly_and_a_broken_push_is_one_line():
    """A ``GenerationServer`` (its engine replaced by a recorder; no vLLM needed) and a client with ``weight_channel:
    gloo``: every tensor of the state dict arrives bit for bit by broadcast, under its name; when the server drops
    the connection in the middle of the next push, the client stops with one ``GenerationServerError`` line."""
    from aitraining_pl.generation.servers.client import VLLMServerClient

    model = build_causal_lm(SPEC, seed=3)
    engine = RecordingEngine(fail_at=1)
    with serving(engine, model) as port:
        client = VLLMServerClient(model, options(port, weight_channel="gloo", server_timeout=20))
        try:
            assert client.sync(model, version=1)
            state = model.state_dict()
            assert list(engine.pushes[0]) == list(state)
            for name, tensor in state.items():
                assert torch.equal(engine.pushes[0][name], tensor), name
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
            with pytest.raises(GenerationServerError) as caught:
                client.sync(model, version=2)
            message = str(caught.value)
            assert "\n" not in message and "while pushing the weights of version 2" in message, message
            assert "resume the run from its last checkpoint" in message, message
        finally:
            client.close()


def test_the_weight_channel_setting_resolves_per_device():
    """``auto`` is ``tcp`` unless the policy and the server are both on GPUs; ``nccl`` with a CPU side is one
    ``ConfigError`` line; an unknown name is refused by the ranges. No vLLM needed."""
    from aitraining_pl.errors import ConfigError, HyperparameterError
    from aitraining_pl.generation.servers.client import weight_channel
    from aitraining_pl.validation import check_arguments

    model = build_causal_lm(SPEC)
    assert weight_channel("auto", model, "cuda") == "tcp" and weight_channel("auto", model, "cpu") == "tcp"
    assert weight_channel("gloo", model, "cpu") == "gloo" and weight_channel("tcp", model, "cuda") == "tcp"
    with pytest.raises(ConfigError, match="nccl needs GPUs on both sides .the policy on cpu, the server on cuda"):
        weight_channel("nccl", model, "cuda")
    with pytest.raises(HyperparameterError, match="weight_channel"):
        check_arguments(VLLMConfig.argument_ranges, {"weight_channel": "mpi"}, "VLLMConfig")


@pytest.mark.vllm
def test_greedy_episodes_on_the_server_equal_the_colocated_engines(server):
    """Multi-turn episodes (the guessing game) sampled turn by turn on the server equal the colocated engine's:
    tokens, masks, rewards, transcripts and vLLM's log-probs."""
    from architectures import sharpen
    from episode_fixtures import SECRETS, assert_same_episodes, prompt_tensors

    from aitraining_pl.environments.episode_rollout import sample_episodes
    from aitraining_pl.environments.multiturn import GuessingGame
    from aitraining_pl.generation.servers.client import VLLMServerClient
    from aitraining_pl.generation.vllm import VLLMEngine
    from aitraining_pl.models import load_tokenizer
    from aitraining_pl.rollout import GenerationConfig, RolloutEngine

    tokenizer = load_tokenizer("byte", padding_side="left")
    model = sharpen(build_causal_lm(SPEC, seed=0), 4.0).eval()
    texts = ["Guess 1-7:", "Go", "Guess a digit!"]
    ids, mask = prompt_tensors(tokenizer, texts)
    generation, game = GenerationConfig(max_new_tokens=6, do_sample=False), GuessingGame(max_turns=3)
    rollouts = []
    colocated = VLLMEngine(model, tokenizer, VLLMConfig(), max_length=512)
    for backend in (colocated, VLLMServerClient(model, options(server))):
        try:
            backend.sync(model)
            engine = RolloutEngine(tokenizer, generation, backend=backend)
            rollouts.append(sample_episodes(engine, model, game, texts, SECRETS, ids, mask, 2))
        finally:
            backend.close()
    colocated, served = rollouts
    assert max(colocated.episodes.metrics["turns"]) >= 2
    assert_same_episodes(colocated, served)
    assert torch.equal(served.sampling_logprobs, colocated.sampling_logprobs)


@pytest.mark.vllm
def test_two_ranks_requests_are_served_in_one_generate_with_the_rows_each_gets_alone(server):
    """Two ranks' seeded requests sent at once (other prompts, samples per prompt, seeds, lengths and top-k) are
    drawn by one ``generate`` of the server (``batched``: 2), and each gets exactly the rows it gets alone:
    the same tokens and log-probs (a seeded request's samples do not depend on what it is batched with)."""
    from concurrent.futures import ThreadPoolExecutor

    from aitraining_pl.generation.backend import StopRule
    from aitraining_pl.generation.servers.client import VLLMServerClient
    from aitraining_pl.models import load_tokenizer
    from aitraining_pl.rollout import GenerationConfig

    tokenizer = load_tokenizer("byte", padding_side="left")
    model = build_causal_lm(SPEC, seed=2)
    sampling = GenerationConfig(max_new_tokens=8, temperature=1.0)
    requests = [  # each rank's: prompts, samples per prompt, seed, generation
        (["hello there", "ab"], 3, 7, sampling),
        (["the quick brown fox", "x", "yes"], 2, 11, dataclasses.replace(sampling, max_new_tokens=5, top_k=20)),
    ]

    def draw(client, texts, samples, seed, generation):
        enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        sampled = client.sample(SampleRequest(ids, mask, generation, [1], StopRule(), 0, samples, seed))
        return sampled, client.batched

    ranks = [VLLMServerClient(model, options(server), rank=0, run="batching")]
    try:
        ranks[0].sync(model, version=1)
        alone = [draw(ranks[0], *request) for request in requests]  # the only connection: served alone
        ranks.append(VLLMServerClient(model, options(server), rank=1, run="batching"))
        ranks[1].sync(model, version=1)
        with ThreadPoolExecutor(2) as pool:
            batched = list(pool.map(lambda args: draw(*args), [(c, *r) for c, r in zip(ranks, requests)]))
    finally:
        for client in ranks:
            client.close()
    assert [n for _, n in alone] == [1, 1] and [n for _, n in batched] == [2, 2]
    for (ours, _), (theirs, _), (texts, samples, _, _) in zip(alone, batched, requests):
        assert ours.response_ids.shape[0] == len(texts) * samples
        assert torch.equal(theirs.response_ids, ours.response_ids)
        assert torch.equal(theirs.sampling_logprobs, ours.sampling_logprobs)
    assert not torch.equal(alone[0][0].response_ids[0], alone[0][0].response_ids[1])  # sampled, not greedy


# ---------------------------------------------------------------------- (c) the server dies mid-run
class KillAfterFirstBatch(pl.Callback):
    """Kills the server process after the first training batch."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            self.proc.kill()
            self.proc.wait(30)


@pytest.mark.vllm
@pytest.mark.parametrize("channel", ["tcp", pytest.param("gloo", marks=pytest.mark.slow)])
def test_the_server_killed_mid_run_gives_one_clear_error_and_the_run_resumes(tmp_path, channel):
    """A GRPO run whose server is killed after its first iteration stops with one ``GenerationServerError``
    line naming host:port, what was being done and the resume; a new connection then gets the refused line. The
    run resumed from its last checkpoint on a restarted server pushes the resumed weights before its first
    rollout (the server's log-probs equal the policy's from the first resumed iteration on) and finishes. The
    same with the weights pushed on a gloo weight channel (the push then fails on the TCP connection or in the
    broadcast, whichever meets the dead server first)."""
    from conftest import quiet_trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from aitraining_pl.cli_errors import _user_error, format_error
    from aitraining_pl.datamodules.prompt import PromptDataModule
    from aitraining_pl.generation.servers.client import VLLMServerClient
    from aitraining_pl.modules.critic_free import GRPOModule
    from aitraining_pl.rollout import GenerationConfig

    def run(port: int, callback: pl.Callback, ckpt_path: str | None = None) -> GRPOModule:
        module = GRPOModule(
            model_config=SPEC,
            tokenizer_name="byte",
            reward="aitraining_pl.rewards:char_fraction_reward",
            num_generations=2,
            generation=GenerationConfig(
                max_new_tokens=4, backend="vllm", vllm=dataclasses.asdict(options(port, weight_channel=channel))
            ),
            mini_batch_size=4,
            learning_rate=0.01,
        )
        data = PromptDataModule(prompts=[f"prompt {i}" for i in range(6)], tokenizer="byte", batch_size=2)
        checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
        trainer = quiet_trainer(tmp_path, enable_checkpointing=True, callbacks=[callback, checkpoints])
        trainer.fit(module, data, ckpt_path=ckpt_path)
        return module

    proc, port = start_server(tmp_path / "serve.log")
    try:
        with pytest.raises(GenerationServerError) as caught:
            run(port, KillAfterFirstBatch(proc))
    finally:
        stop(proc)
    line = format_error(_user_error(caught.value))
    assert "\n" not in line, line
    assert line.startswith(f"aitraining-pl: generation server error: vLLM server 127.0.0.1:{port}: "), line
    assert "connection was lost" in line or "weight channel broke" in line, line
    assert "while pushing the weights of version 1" in line, line
    assert "resume the run from its last checkpoint with --ckpt_path" in line, line
    with pytest.raises(GenerationServerError, match=f"127.0.0.1:{port}: could not connect for 1 s"):
        VLLMServerClient(build_causal_lm(SPEC), options(port, server_timeout=1))

    proc, port = start_server(tmp_path / "serve2.log")
    gaps = Gaps()
    try:
        module = run(port, gaps, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    finally:
        stop(proc)
    assert module.global_step > 1 and gaps.steps[0] == 1, gaps.steps  # resumed after the first step
    assert max(gaps.gaps) < 1e-4, gaps.gaps


class Gaps(pl.Callback):
    """The step count and the largest sampler/trainer log-prob gap of each training batch."""

    def __init__(self):
        self.steps, self.gaps = [], []

    def on_train_batch_start(self, trainer, *args):
        self.steps.append(trainer.global_step)

    def on_train_batch_end(self, trainer, *args):
        self.gaps.append(float(trainer.callback_metrics["train/sampling/logp_gap/max"]))


def test_a_silent_server_times_out_with_one_line():
    """A server that accepts the connection and never answers: the client gives up after ``server_timeout``
    (plus the grace it leaves the server to answer itself) with one line naming the timeout. No vLLM needed."""
    from aitraining_pl.generation.servers.client import VLLMServerClient

    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    config = options(listener.getsockname()[1], server_timeout=0.5)
    try:
        with pytest.raises(GenerationServerError, match=r"no answer within 0.5 s .* while connecting; restart"):
            VLLMServerClient(build_causal_lm(SPEC), config)
    finally:
        listener.close()


# ---------------------------------------------------------------------- (d) the framing
def test_frames_round_trip_tensors_of_several_dtypes():
    a, b = socket.socketpair()
    tensors = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "f16": torch.randn(2, 2, 2).to(torch.float16),
        "i64": torch.arange(-3, 9).view(3, 4),
        "bool": torch.tensor([True, False, True]),
        "u8": torch.arange(256, dtype=torch.uint8),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 7, dtype=torch.int32),
        "strided": torch.arange(12.0).view(3, 4).t(),  # not contiguous: sent in C order
    }
    try:
        send_frame(a, {"op": "weight", "note": "é"}, tensors)
        send_frame(a, {"op": "end"})
        header, got = read_frame(b)
        assert header == {"op": "weight", "note": "é"} and list(got) == list(tensors)
        for name, tensor in tensors.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
        assert read_frame(b) == ({"op": "end"}, {})
    finally:
        a.close()
        b.close()


def raw_frame(header: bytes, magic: bytes = MAGIC, length: int | None = None) -> bytes:
    return magic + struct.pack(">I", len(header) if length is None else length) + header


@pytest.mark.parametrize(
    "frame, message",
    [
        (raw_frame(b'{"op": "x"}', magic=b"GET "), "bad magic"),
        (raw_frame(b"", length=1 << 30), "over the"),
        (raw_frame(b"\xff\xfe"), "not UTF-8 JSON"),
        (raw_frame(b"[1, 2]"), 'string "op"'),
        (raw_frame(b'{"tensors": []}'), 'string "op"'),
        (raw_frame(b'{"op": "w", "tensors": [{"name": "x", "dtype": "object", "shape": [1]}]}'), "unknown dtype"),
        (raw_frame(b'{"op": "w", "tensors": [{"name": "x", "dtype": "float32", "shape": [-1]}]}'), "non-negative"),
        (raw_frame(b'{"op": "w", "tensors": [{"name": "x", "dtype": "float32", "shape": [1.5]}]}'), "non-negative"),
        (raw_frame(b'{"op": "w", "tensors": {"x": 1}}'), "not a list"),
    ],
)
def test_a_malformed_frame_is_refused(frame, message):
    a, b = socket.socketpair()
    try:
        a.sendall(frame)
        with pytest.raises(FrameError, match=message):
            read_frame(b)
    finally:
        a.close()
        b.close()


def test_a_frame_cut_short_is_a_connection_error():
    a, b = socket.socketpair()
    a.sendall(raw_frame(b'{"op": "w", "tensors": [{"name": "x", "dtype": "float32", "shape": [4]}]}') + b"\0" * 8)
    a.close()
    with pytest.raises(ConnectionError, match="mid-frame"):
        read_frame(b)
    b.close()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_serve_without_vllm_is_one_line_naming_the_extra(capsys):
    from aitraining_pl.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["vllm-serve", "--model", "tiny-llama", "--tokenizer", "byte"])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and "\n" not in err and "pip install -e '.[vllm]'" in err, err


@pytest.mark.vllm
def test_a_served_teachers_logprobs_equal_the_local_teachers(server):
    """The ``logprobs`` request on a real engine (the module's server, holding pushed weights, stands in for a
    ``--teacher`` one): a ``ServedTeacher`` (a scorer: it joins no run, so the pushing client stays connected) gets
    the same per-token log-probs as the local teacher, to 1e-4 in fp32; temperature 0.7 is refused in one line."""
    from aitraining_pl.generation.servers.client import ServedTeacher, VLLMServerClient
    from aitraining_pl.modules.distill import LocalTeacher

    teacher = build_causal_lm(SPEC, seed=5).float().eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 250, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, 10:] = 0
    pusher = VLLMServerClient(teacher, options(server))
    served = ServedTeacher(VLLMConfig(mode="server", server_port=server, server_timeout=60))
    try:
        pusher.sync(teacher)
        got = served.token_logprobs(ids, mask, 6, 1.0)
        local = LocalTeacher(teacher).token_logprobs(ids, mask, 6, 1.0)
        diff = float((got - local)[mask[:, 6:].bool()].abs().max())
        print(f"served (vLLM) vs local teacher: max |diff| {diff:.2e}")
        assert diff < 1e-4
        with pytest.raises(GenerationServerError, match="temperature 0.7"):
            served.token_logprobs(ids, mask, 6, 0.7)
    finally:
        served.close()
        pusher.close()
