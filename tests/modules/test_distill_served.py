"""A served teacher (``DistillationModule(teacher_server=...)``) over HTTP (``{url: ...}``,
``servers.teacher.HTTPTeacher``): the HF server with a teacher's fixed weights answers vLLM's ``prompt_logprobs`` equal
to the local teacher's, refuses pushes, and a distillation run trains through it (the one-token bandit's student
reaches the teacher); a 401, a server gone, a short answer and a NaN are each one line; the frame protocol's
``{host, port}`` is one line naming what replaced it."""

from __future__ import annotations

import pytest
import torch
from http_fixtures import SPEC, http_hf_server

from aitraining_pl.errors import ConfigError, GenerationServerError
from aitraining_pl.generation.servers.http import HTTPReplica
from aitraining_pl.generation.servers.teacher import HTTPTeacher
from aitraining_pl.generation.version import WeightsVersion
from aitraining_pl.models import build_causal_lm
from aitraining_pl.modules.distill import LocalTeacher
from aitraining_pl.modules.teacher import checked_logprobs


def rows():
    """Two left-padded prompts of 5 columns with responses of 4 (the second ended early: right padding)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding of the prompt
    mask[1, 7:] = 0  # a response that ended
    return ids, mask


def test_a_served_teacher_needs_sampled_mode():
    from aitraining_pl.modules.distill import check_teacher_server

    with pytest.raises(ConfigError, match="mode: sampled"):
        check_teacher_server({"url": "http://127.0.0.1:8000"}, "full")
    with pytest.raises(ConfigError, match="keys among"):
        check_teacher_server({"uri": "http://127.0.0.1:8000"}, "sampled")
    with pytest.raises(ConfigError, match="not url and launch"):
        check_teacher_server({"url": "http://127.0.0.1:8000", "launch": "hf"}, "sampled")
    with pytest.raises(ConfigError) as gone:  # the frame protocol's form: one line naming what replaced it
        check_teacher_server({"port": 8000}, "sampled")
    assert str(gone.value) == (
        "DistillationModule.teacher_server.host / port: named a teacher on the frame protocol of `aitraining-pl serve "
        "--teacher`, which was removed: give url (a `vllm serve` or the HF server with --teacher, e.g. "
        "http://127.0.0.1:8000) or launch: vllm | hf (docs/distillation.md)"
    )
    with pytest.raises(ConfigError, match="teacher_server.launch: vllm or hf"):
        check_teacher_server({"launch": "sglang"}, "sampled")
    with pytest.raises(ConfigError, match="teacher_server.devices: .* give launch too"):
        check_teacher_server({"url": "http://127.0.0.1:8000", "devices": ["1"]}, "sampled")
    with pytest.raises(ConfigError, match=r"teacher_server.url: 'x' is not a URL"):
        check_teacher_server({"url": "x"}, "sampled")


def test_the_module_scores_with_a_served_teacher_in_sampled_mode_only(hf_teacher):
    """``DistillationModule(teacher_server={url: ...})``: the teacher's slot holds an ``HTTPTeacher`` (no teacher
    weights in this process), whose scores equal the local teacher's; ``mode: full`` and a sampling temperature other
    than 1 are refused before training."""
    from aitraining_pl.modules.distill import DistillationModule
    from aitraining_pl.rollout import GenerationConfig

    url, teacher = hf_teacher
    ids, mask = rows()
    kw = dict(model_config=SPEC, tokenizer_name="byte", teacher_server={"url": url, "timeout": 10})
    module = DistillationModule(mode="sampled", generation=GenerationConfig(max_new_tokens=4, temperature=1.0), **kw)
    assert isinstance(module.teacher, HTTPTeacher) and "teacher" not in dict(module.named_modules())
    got = module.reference_logprobs(ids, mask, 5)
    local = LocalTeacher(teacher).token_logprobs(ids, mask, 5, 1.0)
    assert float((got - local)[mask[:, 5:].bool()].abs().max()) < 1e-4
    module.teacher.close()
    with pytest.raises(ConfigError, match="generation.temperature 1, not 0.7"):
        DistillationModule(mode="sampled", generation=GenerationConfig(temperature=0.7), **kw)
    with pytest.raises(ConfigError, match="mode: sampled"):
        DistillationModule(mode="full", **kw)


# ---------------------------------------------------------------------- over HTTP (the engine's routes)
@pytest.fixture(scope="module")
def hf_teacher():
    """The HF server serving a teacher's fixed weights (``--teacher``) over HTTP: (its URL, the teacher)."""
    teacher = build_causal_lm(SPEC, seed=3).float().eval()
    with http_hf_server(SPEC, teacher=teacher) as port:
        yield f"http://127.0.0.1:{port}", teacher


def test_the_hf_servers_prompt_logprobs_equal_the_local_teachers(hf_teacher):
    """``HTTPTeacher`` through ``/v1/completions`` with ``prompt_logprobs: 0`` (the rows' own token ids, unpadded):
    the local teacher's log-probs on every response token, 0 on the padding; temperature 0.7 is refused; the server
    refuses pushes (a teacher's weights are fixed) and keeps serving the same scores."""
    url, teacher = hf_teacher
    ids, mask = rows()
    local = LocalTeacher(teacher).token_logprobs(ids, mask, 5, 1.0)
    served = HTTPTeacher(url, timeout=30)
    got = served.token_logprobs(ids, mask, 5, 1.0)
    assert got.dtype == torch.float32 and got.shape == local.shape
    response = mask[:, 5:].bool()
    diff = float((got - local)[response].abs().max())
    print(f"served over HTTP (HF server) vs local teacher: max |diff| {diff:.2e}")
    assert diff < 1e-5 and float(got[~response].abs().max()) == 0
    with pytest.raises(ConfigError, match="temperature 1 .* not 0.7"):
        served.token_logprobs(ids, mask, 5, 0.7)
    pusher = HTTPReplica(url, "test-token")
    zeros = {k: torch.zeros_like(v) for k, v in teacher.state_dict().items()}
    with pytest.raises(GenerationServerError, match="fixed weights"):
        pusher.push(zeros.items(), WeightsVersion("run", 1))
    pusher.close()
    assert torch.equal(served.token_logprobs(ids, mask, 5, 1.0), got)
    served.close()


def test_a_failing_http_teacher_is_one_line(hf_teacher, monkeypatch):
    """A wrong token (401), a short answer and an entry under another token id are each one ``GenerationServerError``
    line naming the teacher's URL; a NaN is refused by the module's check; a server gone too."""
    from aitraining_pl.generation.servers.auth import TOKEN_ENV

    url, _ = hf_teacher
    ids, mask = rows()
    monkeypatch.setenv(TOKEN_ENV, "wrong")
    with pytest.raises(GenerationServerError, match=rf"^teacher server {url}: it refused the run's token \(401\)"):
        HTTPTeacher(url, timeout=30).token_logprobs(ids, mask, 5, 1.0)
    monkeypatch.setenv(TOKEN_ENV, "test-token")
    teacher = HTTPTeacher(url, timeout=30)
    real = teacher.replica().call

    def answer(change):
        def call(method, route, doing, **kwargs):
            out = real(method, route, doing, **kwargs)
            if route == "/v1/completions":
                change(out["choices"][0]["prompt_logprobs"], kwargs["json"]["prompt"])
            return out

        return call

    for change, line in [
        (lambda entries, prompt: entries.pop(), "8 prompt log-probs came back for 9 tokens"),
        (lambda entries, prompt: entries.__setitem__(6, {"7": {"logprob": -1.0}}), "no log-prob of the given token"),
    ]:
        monkeypatch.setattr(teacher.replica(), "call", answer(change))
        with pytest.raises(GenerationServerError, match=f"^teacher server {url}: ") as failed:
            teacher.token_logprobs(ids[:1], mask[:1], 5, 1.0)
        assert line in str(failed.value) and "\n" not in str(failed.value), str(failed.value)

    def nan(entries, prompt):
        entries[6][str(prompt[6])]["logprob"] = float("nan")

    monkeypatch.setattr(teacher.replica(), "call", answer(nan))
    scores = teacher.token_logprobs(ids[:1], mask[:1], 5, 1.0)
    with pytest.raises(GenerationServerError, match="not finite numbers <= 0"):
        checked_logprobs(scores, ids[:1], mask[:1], 5, f"teacher server {url}")
    gone = HTTPTeacher("http://127.0.0.1:9", timeout=5)  # nothing listens on the discard port
    with pytest.raises(GenerationServerError, match=r"^teacher server http://127.0.0.1:9: cannot reach the server"):
        gone.token_logprobs(ids, mask, 5, 1.0)


@pytest.mark.slow
def test_the_bandit_student_reaches_an_http_teacher(tmp_path):
    """``teacher_server: {url: ...}`` (the HF server with the teacher's weights): sampled-token distillation of the
    one-token bandit reaches the teacher (TV < 0.05), as with the teacher in this process (``test_distill``), and
    the module holds no teacher weights."""
    import lightning.pytorch as pl
    from bandit import POLICY, word_tokenizer
    from conftest import quiet_trainer

    from aitraining_pl.datamodules.prompt import PromptDataModule
    from aitraining_pl.models import load_tokenizer
    from aitraining_pl.modules.distill import DistillationModule
    from aitraining_pl.rollout import GenerationConfig

    config = {**POLICY, "initializer_range": 0.25}
    teacher = build_causal_lm(config, seed=1).float().eval()
    folder = word_tokenizer(tmp_path / "tokenizer")
    tokenizer = load_tokenizer(folder)
    prompt = tokenizer("a", return_tensors="pt", add_special_tokens=False)["input_ids"]
    with http_hf_server(config, teacher=teacher, tokenizer=folder) as port:
        pl.seed_everything(0)
        module = DistillationModule(
            model_config=POLICY, tokenizer_name=folder, teacher_server={"url": f"http://127.0.0.1:{port}"},
            mode="sampled", num_generations=8, advantage="rloo", learning_rate=0.03, mini_batch_size=64,
            generation=GenerationConfig(max_new_tokens=1, temperature=1.0, top_p=1.0),
        )  # fmt: skip
        assert isinstance(module.teacher, HTTPTeacher)
        before = next_token(module.policy, prompt)
        dm = PromptDataModule(prompts=["a"] * (8 * STEPS), tokenizer=tokenizer, batch_size=8)
        quiet_trainer(tmp_path, max_epochs=1).fit(module, dm)
        module.teacher.close()
    target = next_token(teacher, prompt)
    tv_before, tv = total_variation(before, target), total_variation(next_token(module.policy, prompt), target)
    print(f"sampled through an HTTP teacher: TV {tv_before:.4f} -> {tv:.4f}")
    assert tv < 0.05 < tv_before
    assert set(module.state_dict()) == {f"model.{k}" for k in module.policy.state_dict()}  # the student only


STEPS = 30


def next_token(model, prompt):
    with torch.no_grad():
        return torch.softmax(model(input_ids=prompt).logits[0, -1].double(), -1)


def total_variation(p, q):
    return float((p - q).abs().sum() / 2)


def test_the_trainer_launches_an_hf_teacher_server(tmp_path):
    """``teacher_server: {launch: hf}``: the module starts the HF server for ``teacher_model_name`` (a folder: its own
    weights, ``--teacher``) at the first scoring; its log-probs equal the local teacher's, and ``teardown`` stops it
    (its folder, token included, gone)."""
    import transformers

    from aitraining_pl.modules.distill import DistillationModule
    from aitraining_pl.rollout import GenerationConfig

    teacher = build_causal_lm(SPEC, seed=3).float().eval()
    folder = tmp_path / "teacher"
    teacher.save_pretrained(folder)
    transformers.ByT5Tokenizer().save_pretrained(folder)
    module = DistillationModule(
        model_config=SPEC, tokenizer_name="byte", teacher_model_name=str(folder), mode="sampled",
        teacher_server={"launch": "hf", "timeout": 120}, generation=GenerationConfig(max_new_tokens=4, temperature=1.0),
    )  # fmt: skip
    ids, mask = rows()
    try:
        got = module.reference_logprobs(ids, mask, 5)
        server = module.teacher.server
        assert server is not None and module.teacher.url.startswith("http://127.0.0.1:")
        local = LocalTeacher(teacher).token_logprobs(ids, mask, 5, 1.0)
        assert float((got - local)[mask[:, 5:].bool()].abs().max()) < 1e-5
    finally:
        module.teardown("fit")
    assert module.teacher.server is None and server.process is None and not server.folder.exists()
