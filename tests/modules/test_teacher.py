"""The distillation teacher as an object the module holds (``modules.teacher``; issue 40, probe 5): what a teacher
gives is checked before it is used (a served teacher's NaN, a missing or single column, a log-prob above 0 are one
line naming the teacher, never a raw tensor error or a silent broadcast), and a teacher is compared with the student
by its tokenizer, not by its embedding's padded rows."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_LLAMA
from http_fixtures import SPEC, http_hf_server

from aitraining_pl.errors import ConfigError, GenerationServerError
from aitraining_pl.models import build_causal_lm, load_tokenizer
from aitraining_pl.modules.distill import DistillationModule
from aitraining_pl.modules.teacher import LocalTeacher, checked_logprobs
from aitraining_pl.rollout import GenerationConfig

IDS = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
MASK = torch.ones_like(IDS)


@pytest.mark.parametrize(
    "scores, message",
    [
        (torch.full((2, 4), float("nan")), r"8 log-probs that are not finite numbers <= 0 \(first in row 0: nan\)"),
        (torch.full((2, 3), -1.0), r"shape \(2, 3\) for 2 rows of 4 response tokens"),
        (torch.full((2, 1), -1.0), r"shape \(2, 1\) for 2 rows of 4 response tokens"),  # never broadcast
        (torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-1.0, 5.0, -1.0, -1.0]]), r"first in row 1: 5.0"),
        ([[-1.0] * 4] * 2, r"shape \(\) for 2 rows"),
    ],
)
def test_a_teachers_bad_logprobs_are_one_line_naming_it(scores, message):
    with pytest.raises(GenerationServerError, match=message) as err:
        checked_logprobs(scores, IDS, MASK, 5, "teacher server 127.0.0.1:8001")
    assert "\n" not in str(err.value) and str(err.value).startswith("teacher server 127.0.0.1:8001: ")
    padding = MASK.clone()
    padding[1, 7:] = 0  # an ended response: what its padding holds is not looked at
    good = torch.full((2, 4), -1.0)
    good[1, 2:] = float("nan")
    assert checked_logprobs(good, IDS, padding, 5, "teacher") is good


@pytest.mark.parametrize("fault", ["nan", "short"])
def test_a_served_teachers_bad_answer_stops_the_step_in_one_line(fault, monkeypatch):
    """Through the real client and the HF server over HTTP (its answers then spoiled: one entry NaN, or one too
    few): the module's teacher pass refuses the answer in one line naming the server."""
    teacher = build_causal_lm(SPEC, seed=3).float().eval()
    with http_hf_server(SPEC, teacher=teacher) as port:
        url = f"http://127.0.0.1:{port}"
        module = DistillationModule(
            model_config=SPEC,
            tokenizer_name="byte",
            teacher_server={"url": url, "timeout": 10},
            mode="sampled",
            generation=GenerationConfig(max_new_tokens=4, temperature=1.0),
        )
        replica = module.teacher.replica()
        real = replica.call

        def spoiled(method, route, doing, **kwargs):
            out = real(method, route, doing, **kwargs)
            if route == "/v1/completions":
                entries, prompt = out["choices"][0]["prompt_logprobs"], kwargs["json"]["prompt"]
                if fault == "nan":
                    entries[-1][str(prompt[-1])]["logprob"] = float("nan")
                else:
                    entries.pop()
            return out

        monkeypatch.setattr(replica, "call", spoiled)
        with pytest.raises(GenerationServerError) as err:
            module.reference_logprobs(IDS, MASK, 5)
        module.teacher.close()
    line = str(err.value)
    assert "\n" not in line and f"teacher server {url}" in line, line
    assert ("not finite" in line) if fault == "nan" else ("came back for" in line), line


def test_a_teacher_with_padded_embedding_rows_is_the_same_tokenizer(tmp_path):
    """Qwen2.5-7B's 152064 rows against 0.5B's 151936, one tokenizer: here the byte tokenizer's 384 tokens against a
    teacher of 448 rows. Accepted; the full distribution is compared over the rows both have; the module holds the
    teacher (no reference, nothing of it in the module tree)."""
    tokenizer = load_tokenizer("byte")
    folder = tmp_path / "teacher"
    build_causal_lm({**TINY_LLAMA, "vocab_size": 448}, seed=1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    module = DistillationModule(model_config=TINY_LLAMA, teacher_model_name=str(folder), tokenizer_name="byte")
    assert isinstance(module.teacher, LocalTeacher) and module.teacher.rows() == 448 and module.reference is None
    assert not [n for n, _ in module.named_parameters() if "teacher" in n]
    assert all(not p.requires_grad for p in module.teacher.model.parameters())
    ids = torch.randint(3, 380, (2, 10), generator=torch.Generator().manual_seed(1))
    attention, mask = torch.ones_like(ids), torch.ones(2, 6, dtype=torch.long)
    out = module.divergence(ids, attention, 4, mask, module.teacher.hidden(ids, attention, 4, mask))
    assert torch.isfinite(out.loss) and out.loss > 0


def test_another_tokenizer_is_refused_by_its_tokens_and_too_few_rows_by_their_count(tmp_path):
    tokenizer = load_tokenizer("byte")
    tokenizer.add_tokens(["<|teacher|>"])
    folder = tmp_path / "teacher"
    build_causal_lm({**TINY_LLAMA, "vocab_size": 448}, seed=1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with pytest.raises(ConfigError, match=r"tokenizer differs from the student's \(385 vs 384 tokens; tokens in one"):
        DistillationModule(model_config=TINY_LLAMA, teacher_model_name=str(folder), tokenizer_name="byte")
    with pytest.raises(ConfigError, match="has 300 rows, fewer than the student's tokenizer's 384 tokens"):
        DistillationModule(
            model_config=TINY_LLAMA, teacher_model_config={**TINY_LLAMA, "vocab_size": 300}, tokenizer_name="byte"
        )
