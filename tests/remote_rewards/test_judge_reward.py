"""``JudgeReward`` (``reward: {base_url: ..., model: ...}``) against a fake OpenAI-compatible chat server on loopback:
a parseable score is used (normalised or kept), an answer without one or out of range is refused as documented."""

from __future__ import annotations

import re
import threading

import pytest
from reward_servers import LoopbackServer

from aitraining_pl.errors import RewardError
from aitraining_pl.remote_rewards import JudgeReward, parse_judge_score
from aitraining_pl.rewards import build_reward_source, score_responses

KEY = "sk-judge-key-1234"
#: what the fake judge answers to a completion (the last line of the user message)
ANSWERS = {"good": "Clear and correct.\n8", "great": "Rating: 10/10", "vague": "Hard to say.", "wild": "Score: 12"}
PAIRED = threading.Barrier(2)


def chat(hit):
    """An OpenAI chat completion answering with ``ANSWERS[<the completion>]``."""
    completion = hit.body["messages"][-1]["content"].rsplit("\n", 1)[-1]
    if completion.startswith("pair"):  # two rows must be in flight at once (max_concurrency), or this one fails
        try:
            PAIRED.wait(timeout=30)
        except threading.BrokenBarrierError:
            return 500, {"error": "alone"}
        completion = "good"
    message = {"role": "assistant", "content": ANSWERS[completion]}
    return 200, {"object": "chat.completion", "model": hit.body["model"], "choices": [{"index": 0, "message": message}]}


@pytest.fixture(scope="module")
def server():
    server = LoopbackServer({"/v1/chat/completions": chat, "/bad/chat/completions": lambda hit: (200, {"choices": []})})
    yield server
    server.close()


@pytest.fixture(autouse=True)
def key(monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", KEY)


def judge(server, **options):
    spec = {
        "base_url": server.url("/v1"),
        "model": "judge-1",
        "api_key_env": "JUDGE_KEY",
        "template": "Answer: {answer}\n{completion}",
        "retries": 0,
    }
    return build_reward_source({**spec, **options})


def rate(source, *completions):
    return score_responses(source, ["q"] * len(completions), list(completions), [{"answer": "42"}] * len(completions))[
        0
    ]


def test_a_parseable_score_is_used_normalised_or_kept(server):
    source = judge(server, system="You grade answers.", temperature=0.5, max_tokens=32)
    assert isinstance(source, JudgeReward) and KEY not in repr(source)
    assert rate(source, "good", "great") == [0.8, 1.0]  # the last number, (s - 0) / (10 - 0)
    hit = server.hits[-1]
    assert hit.headers["Authorization"] == f"Bearer {KEY}"
    assert hit.body["model"] == "judge-1" and hit.body["temperature"] == 0.5 and hit.body["max_tokens"] == 32
    assert hit.body["messages"][0] == {"role": "system", "content": "You grade answers."}
    assert hit.body["messages"][1]["content"] in ("Answer: 42\ngood", "Answer: 42\ngreat")  # metadata filled in
    assert rate(judge(server, normalize=False), "good") == [8.0]
    assert rate(judge(server, score_pattern=r"(\d+)/10", score_range=[0, 10]), "great") == [1.0]


def test_rows_are_judged_concurrently_in_order(server):
    """Both rows wait for each other at the server: they pass only with two requests in flight."""
    assert rate(judge(server, max_concurrency=2), "pair-a", "pair-b") == [0.8, 0.8]


@pytest.mark.parametrize(
    "completion, why",
    [
        ("vague", r"no score matching .* in the answer to row 1: 'Hard to say\.' \(on_unparseable: error\)"),
        (
            "wild",
            r"the score 12 is outside score_range \[0, 10\] in the answer to row 1: 'Score: 12' "
            r"\(on_unparseable: error\)",
        ),
    ],
)
def test_an_answer_without_a_score_in_range_is_refused_in_one_line(server, completion, why):
    with pytest.raises(RewardError) as info:
        rate(judge(server), "good", completion)
    message = str(info.value)
    assert re.fullmatch(rf"judge 'judge-1' {re.escape(server.url('/v1/chat/completions'))}: {why}", message), message
    assert "\n" not in message and KEY not in message


def test_on_unparseable_zero_scores_zero_with_a_warning(server):
    with pytest.warns(UserWarning, match=r"1 of 3 answers had no score in range \(first: row 1, 'Hard to say\.'\)"):
        assert rate(judge(server, on_unparseable="zero"), "good", "vague", "great") == [0.8, 0.0, 1.0]


def test_a_malformed_completion_or_a_missing_field_is_refused(server):
    with pytest.raises(
        RewardError, match=r"the answer to row 0 has no choices\[0\]\.message\.content: '\{\"choices\": \[\]\}'"
    ):
        rate(judge(server, base_url=server.url("/bad")), "good")
    with pytest.raises(
        RewardError, match=r"template field \{level\} is not prompt, completion or a metadata key of row 0"
    ):
        rate(judge(server, template="{level}: {completion}"), "good")


def test_bad_judge_configs_are_refused_when_built(monkeypatch):
    url = "http://127.0.0.1:9/v1"
    with pytest.raises(RewardError, match="on_unparseable must be 'error' or 'zero', got 'skip'"):
        build_reward_source({"base_url": url, "model": "m", "on_unparseable": "skip"})
    with pytest.raises(RewardError, match=r"score_range must be \[low, high\] with low < high"):
        build_reward_source({"base_url": url, "model": "m", "score_range": [5, 1]})
    with pytest.raises(RewardError, match="JudgeReward needs 'model'"):
        build_reward_source({"base_url": url})
    monkeypatch.delenv("JUDGE_KEY")
    with pytest.raises(RewardError, match=r"reads \$\{JUDGE_KEY\}, which is not set"):
        build_reward_source({"base_url": url, "model": "m", "api_key_env": "JUDGE_KEY"})


@pytest.mark.parametrize(
    "answer, score",
    [("Rating: 7/10", 0.7), ("I give it 8 out of 10.", 0.8), ("Good.\n9", 0.9), ("2 issues; 6 / 10", 0.6)],
)
def test_the_default_pattern_reads_a_score_with_its_scale(answer, score):
    from aitraining_pl.remote_rewards.judge import DEFAULT_SCORE_PATTERN

    assert parse_judge_score(answer, re.compile(DEFAULT_SCORE_PATTERN), (0, 10)) == pytest.approx(score)
    with pytest.raises(ValueError, match="'4/5' is on a scale of 5, not score_range's 10"):
        parse_judge_score("Rating: 4/5", re.compile(DEFAULT_SCORE_PATTERN), (0, 10))


def test_parse_judge_score_reads_the_last_match():
    number = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)")
    assert parse_judge_score("3 of 5 points; overall 4", number, (1, 5)) == 0.75
    assert parse_judge_score("-0.5", number, (-1, 1), normalize=False) == -0.5
    with pytest.raises(ValueError, match="is not a number"):
        parse_judge_score("grade: x", re.compile(r"grade: (\w)"), (0, 1))
