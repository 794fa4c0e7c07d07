"""RL environments: episode mechanics, multi-objective rewards, preferences, math and code rewards, and the
reward-source protocol."""

from __future__ import annotations

import re

import pytest
import torch

from aitraining_pl.environments import (
    MultiObjectiveRewardEnv,
    PreferenceComparisonEnv,
    TextGenerationEnv,
    create_code_generation_env,
    create_math_problem_env,
    generate_math_problems,
    parse_final_number,
    run_test_cases,
    word_count_reward,
)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_prompt_encoding_drops_the_tokenizers_trailing_eos(byte_tokenizer):
    env = TextGenerationEnv(byte_tokenizer, ["Hi"])
    obs = env.reset()
    assert obs.input_ids.tolist() == [ids(byte_tokenizer, "Hi")]
    assert obs.attention_mask.tolist() == [[1, 1]]


def test_episode_ends_at_eos_with_the_default_reward(byte_tokenizer):
    env = TextGenerationEnv(byte_tokenizer, ["Say: "], max_length=64)
    env.reset()
    for token in ids(byte_tokenizer, "one two"):
        result = env.step(torch.tensor(token))
        assert not result.done and result.reward == 0.0 and result.next_observation is not None
    result = env.step(byte_tokenizer.eos_token_id)
    assert result.done and result.next_observation is None
    assert result.info["stop_reason"] == "eos" and result.info["generated_text"] == "one two"
    assert result.reward == pytest.approx(2 / 50) == word_count_reward("", "one two", "")
    traj = env.trajectory
    assert traj.done and traj.total_reward == pytest.approx(2 / 50) and len(traj.actions) == 8
    with pytest.raises(RuntimeError, match="reset"):
        env.step(5)


def test_chunk_with_eos_in_the_middle_is_cut_there(byte_tokenizer):
    env = TextGenerationEnv(byte_tokenizer, ["Q"], reward_fn=lambda p, g, f: float(len(g)))
    env.reset()
    chunk = ids(byte_tokenizer, "abc") + [byte_tokenizer.eos_token_id] + ids(byte_tokenizer, "zzz")
    result = env.step(chunk)
    assert result.done and result.info["generated_text"] == "abc" and result.reward == 3.0
    assert result.metrics["response_tokens"] == 4.0  # a, b, c and the EOS


def test_stop_sequence_is_searched_in_the_generated_text_only(byte_tokenizer):
    env = TextGenerationEnv(byte_tokenizer, ["First paragraph.\n\nSecond: "], stop_sequences=["\n\n"])
    env.reset()
    result = env.step(ids(byte_tokenizer, "hello"))
    assert not result.done  # the prompt's own "\n\n" does not stop the episode
    result = env.step(ids(byte_tokenizer, " world\n\nignored"))
    assert result.done and result.info["stop_reason"] == "stop_sequence"
    assert result.info["generated_text"] == "hello world"


def test_episode_ends_at_max_length(byte_tokenizer):
    env = TextGenerationEnv(byte_tokenizer, ["abcd"], max_length=10)
    obs = env.reset()
    assert obs.input_ids.shape == (1, 4)
    result = env.step(ids(byte_tokenizer, "0123456789"))
    assert result.done and result.info["stop_reason"] == "max_length"
    assert result.info["generated_text"] == "012345"
    assert "Prompt: abcd" in env.render() and "Generated: 012345" in env.render()


def test_sample_action_is_greedy_at_temperature_zero(byte_tokenizer):
    env = TextGenerationEnv(byte_tokenizer, ["x"], temperature=0.0)
    logits = torch.zeros(384)
    logits[77] = 3.0
    assert int(env.sample_action(logits)) == 77


def test_multi_objective_env_weights_components_and_reports_each(byte_tokenizer):
    env = MultiObjectiveRewardEnv(
        byte_tokenizer,
        ["P: "],
        reward_components={"has_x": lambda p, g, f: float("x" in g), "short": lambda p, g, f: float(len(g) < 3)},
        reward_weights={"has_x": 1.0, "short": 0.25},
    )
    env.reset()
    result = env.step(ids(byte_tokenizer, "xy") + [byte_tokenizer.eos_token_id])
    assert result.metrics["reward_has_x"] == 1.0 and result.metrics["reward_short"] == 1.0
    assert result.reward == pytest.approx(1.25) == result.metrics["reward_total"]
    with pytest.raises(ValueError, match="unknown components"):
        MultiObjectiveRewardEnv(byte_tokenizer, ["p"], {"a": word_count_reward}, {"b": 1.0})


class LengthPreferringModel:
    """Stands in for a RewardModel: anything with predict_rewards(texts, tokenizer, batch_size)."""

    def predict_rewards(self, texts, tokenizer, batch_size=8):
        return torch.tensor([float(len(t)) for t in texts])


def test_preference_env_with_a_reward_model(byte_tokenizer):
    env = PreferenceComparisonEnv(byte_tokenizer, ["Q: "], preference_model=LengthPreferringModel())
    obs = env.reset()
    first = env.step(ids(byte_tokenizer, "short"))
    assert not first.done and first.reward == 0.0
    assert torch.equal(first.next_observation.input_ids, obs.input_ids)  # the second response starts afresh
    second = env.step(ids(byte_tokenizer, "much longer answer"))
    assert second.done and second.info["source"] == "model"
    assert second.reward == pytest.approx(torch.sigmoid(torch.tensor(5.0 - 18.0)).item())
    assert second.info["chosen"] == "much longer answer" and second.info["rejected"] == "short"
    assert env.preference_pairs() == {"prompts": ["Q: "], "chosen": ["much longer answer"], "rejected": ["short"]}
    assert env(["Q: "], ["abc"]) == [6.0]  # as a reward source: the model's reward of prompt + response


def test_preference_env_human_feedback_wins_and_may_defer(byte_tokenizer):
    calls = []

    def feedback(prompt, a, b):
        calls.append((prompt, a, b))
        return None if a == "defer" else 1.0

    env = PreferenceComparisonEnv(byte_tokenizer, ["Q"], LengthPreferringModel(), feedback)
    env.reset()
    env.step(ids(byte_tokenizer, "a"))
    result = env.step(ids(byte_tokenizer, "bbbb"))
    assert result.reward == 1.0 and result.info["source"] == "human" and result.info["chosen"] == "a"
    env.reset()
    env.step(ids(byte_tokenizer, "defer"))
    assert env.step(ids(byte_tokenizer, "x")).info["source"] == "model"
    assert calls == [("Q", "a", "bbbb"), ("Q", "defer", "x")]
    with pytest.raises(ValueError, match="preference_model"):
        PreferenceComparisonEnv(byte_tokenizer, ["Q"])


def test_math_problems_are_seeded_and_their_answers_are_right():
    problems = generate_math_problems(300, seed=7)
    assert problems == generate_math_problems(300, seed=7) != generate_math_problems(300, seed=8)
    assert {p.operation for p in problems} == {"add", "sub", "mul", "div", "two_step"}
    for p in problems:
        assert p.answer == eval(p.expression) >= 0  # the expression was built from the operands in the text
        numbers = [int(n) for n in re.findall(r"\d+", p.prompt.split("Finish")[0])]
        assert all(int(n) in numbers for n in re.findall(r"\d+", p.expression) if n != "0")


def test_math_env_rewards_correct_answers_one_and_wrong_ones_zero(byte_tokenizer):
    env = create_math_problem_env(byte_tokenizer, num_problems=200, seed=3)
    assert env.reward_weights == {"correctness": 1.0, "formatting": 0.1}
    answers = [env.metadata_for(p)["answer"] for p in env.prompts]
    right = env(env.prompts, [f"Let me think: 2 + 2.\nAnswer: {a}" for a in answers])
    assert right == pytest.approx([1.1] * 200)
    assert env.last_components["correctness"] == [1.0] * 200
    wrong = env(env.prompts, [f"Answer: {a + 1}" for a in answers])
    assert env.last_components["correctness"] == [0.0] * 200 and wrong == pytest.approx([0.1] * 200)
    unformatted = env(env.prompts, [f"it is {a}" for a in answers])
    assert unformatted == pytest.approx([1.0] * 200)  # correct final number, no Answer: line
    # the episode path gives the same reward as the reward-source path
    obs = env.reset()
    result = env.step(ids(byte_tokenizer, f"Answer: {obs.metadata['answer']}") + [byte_tokenizer.eos_token_id])
    assert result.reward == pytest.approx(1.1) and result.metrics["reward_correctness"] == 1.0
    assert parse_final_number("costs 1,250.5 then -3") == -3.0 and parse_final_number("none") is None


def test_math_env_as_reward_source_uses_metadata_for_unknown_prompts(byte_tokenizer):
    env = create_math_problem_env(byte_tokenizer, num_problems=2)
    assert env(["What is 2+3?"], ["Answer: 5"], [{"answer": 5}]) == pytest.approx([1.1])
    with pytest.raises(ValueError, match="no known answer"):
        env(["What is 2+3?"], ["Answer: 5"], [{}])


GOOD_ADD = '```python\ndef add(a, b):\n    """Sum of a and b."""\n    return a + b\n```'


def test_code_env_syntax_style_and_tests(byte_tokenizer):
    env = create_code_generation_env(byte_tokenizer, timeout=5.0)
    prompt = env.prompts[0]  # add(a, b)
    rewards = env([prompt, prompt, prompt], [GOOD_ADD, "def add(a, b):\n\treturn a - b\n", "def add(a, b) return"])
    good, wrong, broken = (dict(zip(env.last_components, col)) for col in zip(*env.last_components.values()))
    assert good == {"syntax": 1.0, "style": 1.0, "tests": 1.0, "analysis_failed": 0.0}
    assert rewards[0] == pytest.approx(2.1)
    assert wrong["syntax"] == 1.0 and wrong["tests"] == pytest.approx(1 / 3) and wrong["style"] < 1.0
    assert broken == {"syntax": 0.0, "style": 0.0, "tests": 0.0, "analysis_failed": 0.0} and rewards[2] == 0.0


def test_code_the_parser_cannot_analyse_scores_the_minimum_and_is_counted(byte_tokenizer):
    """Issue 26, item 2: ``x = ---...1`` made the syntax and style rewards raise RecursionError (2,989
    characters) or MemoryError (200k), which stopped the run as a RewardError. Now: 0 and a counted metric."""
    from aitraining_pl.rewards import score_responses

    env = create_code_generation_env(byte_tokenizer, timeout=5.0)
    prompt = env.prompts[0]
    deep = ["x = " + "-" * 2989 + "1", "x = " + "-" * 200_000 + "1", "x = " + "(" * 5000 + "1" + ")" * 5000]
    scores, components = score_responses(env, [prompt] * 4, [*deep, GOOD_ADD], [{}] * 4)
    assert scores[:3] == [0.0, 0.0, 0.0] and scores[3] == pytest.approx(2.1)
    assert components["syntax"][:3] == components["style"][:3] == [0.0, 0.0, 0.0]
    assert components["analysis_failed"][:2] == [1.0, 1.0] and components["analysis_failed"][3] == 0.0


def test_code_runner_time_limit_network_and_environment(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "do-not-leak")
    result = run_test_cases("while True:\n    pass", ["assert True"], timeout=1.0)
    assert result.timed_out and result.passed == 0
    network = (
        "import socket\ntry:\n    socket.create_connection(('10.0.0.1', 80), timeout=1)\n    r = 'open'\n"
        "except OSError as e:\n    r = str(e)"
    )
    assert run_test_cases(network, ["assert 'disabled' in r"], timeout=5.0).passed == 1
    probe = "import os\nenv = dict(os.environ)\ncwd = os.getcwd()"
    checks = [
        "assert 'SECRET_TOKEN' not in env",
        "assert set(env) <= {'LC_CTYPE'}",
        "assert 'aitraining_pl_code_' in cwd",
    ]
    assert run_test_cases(probe, checks, timeout=5.0).passed == 3
    assert run_test_cases("x = 1", ["assert x == 1", "assert x == 2"], timeout=5.0).passed == 1


def test_an_environment_named_by_import_path_is_a_ppo_reward_source():
    from aitraining_pl.rewards import build_reward_source, score_responses

    source = build_reward_source("aitraining_pl.environments.MathProblemEnv")
    prompt = source.prompts[0]
    answer = source.metadata_for(prompt)["answer"]
    scores, components = score_responses(source, [prompt, prompt], [f"Answer: {answer}", "no idea"], [{}, {}])
    assert scores == pytest.approx([1.1, 0.0])
    assert components == {"correctness": [1.0, 0.0], "formatting": [1.0, 0.0]}
    # with the answer in the prompt data's metadata, any prompt works
    scores, _ = score_responses(source, ["2+2?"], ["4"], [{"answer": 4}])
    assert scores == [1.0]


def test_rollout_plays_an_episode_with_a_model(byte_tokenizer, tiny_config):
    from aitraining_pl.models import build_causal_lm

    model = build_causal_lm(tiny_config, seed=0)
    env = MultiObjectiveRewardEnv(byte_tokenizer, ["2+2="], {"len": lambda p, g, f: float(len(g))}, max_length=12)
    traj = env.rollout(model, generator=torch.Generator().manual_seed(0))
    assert traj.done and len(traj.actions) == len(traj.logprobs) == len(traj.rewards) >= 1
    assert all(lp.item() <= 0 for lp in traj.logprobs) and len(traj.actions) <= 8
    assert traj.total_reward == traj.rewards[-1] == traj.metrics["reward_total"] == traj.metrics["reward_len"]


@pytest.mark.slow
def test_ppo_quickstart_variant_with_the_math_environment_as_reward_source(tmp_path):
    """configs/quickstart/ppo_math.yaml runs a PPO iteration through the CLI and logs each reward component."""
    import csv
    from pathlib import Path

    from aitraining_pl.cli import main

    root = Path(__file__).resolve().parents[2]
    main([
        "fit", "--config", str(root / "configs/quickstart/ppo_math.yaml"),
        "--data.init_args.data_path", str(root / "aitraining_pl/data/math_prompts.jsonl"),
        "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.limit_train_batches", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    ])  # fmt: skip
    (metrics_file,) = tmp_path.glob("csv/version_*/metrics.csv")
    rows = [r for r in csv.DictReader(metrics_file.open()) if r.get("train/reward_mean")]
    assert len(rows) == 1
    for row in rows:  # the PPO score is the environment's weighted sum of its components
        correctness, formatting = float(row["train/reward/correctness"]), float(row["train/reward/formatting"])
        assert float(row["train/reward_mean"]) == pytest.approx(correctness + 0.1 * formatting, abs=1e-5)
        assert 0.0 <= correctness <= 1.0 and 0.0 <= formatting <= 1.0
