"""``RemoteReward`` (``reward: {url: ...}``) against a reward server on loopback: scores used as sent, or one
``RewardError`` line naming the URL (timeouts after the retries, wrong counts, NaN, 5xx retried, 4xx not), secrets
never shown; and a GRPO run trained through it, stopped before any step by a bad score."""

from __future__ import annotations

import base64
import math

import pytest
import torch
from conftest import TINY_LLAMA, quiet_trainer
from reward_servers import LoopbackServer

from aitraining_pl.errors import RewardError
from aitraining_pl.remote_rewards import RemoteReward, public_url
from aitraining_pl.rewards import build_reward_source, score_responses

SECRET = "s3cr3t-t0ken-value"
PROMPTS, RESPONSES, METADATA = ["p0", "p1"], ["aaa", "bcd"], [{"answer": 1}, {}]


def vowel_share(hit):
    """The reward server's score: a completion's share of vowels; a ``vowels`` component too."""
    scores = [sum(c in "aeiou" for c in row["completion"]) / max(1, len(row["completion"])) for row in hit.body["rows"]]
    return 200, {"scores": scores, "components": {"vowels": scores}}


def fail_first(hit):
    return (500, {"error": "warming up"}) if hit.attempt == 0 else vowel_share(hit)


def hang(server):
    def route(hit):
        server.release.wait(60)  # never answers while the test runs
        return vowel_share(hit)

    return route


ROUTES = {
    "/ok": vowel_share,
    "/flaky": fail_first,
    "/alternate": lambda hit: (
        200,
        {"scores": [float(i % 2) for i in range(len(hit.body["rows"]))]},
    ),  # 0 and 1 in a group
    "/count": lambda hit: (200, {"scores": [0.5]}),
    "/nan": lambda hit: (200, ('{"scores": [%sNaN]}' % ("0.5, " * (len(hit.body["rows"]) - 1))).encode()),
    "/text": lambda hit: (200, {"scores": [0.5, "high"]}),
    "/html": lambda hit: (200, b"<html>oops</html>"),
    "/noscores": lambda hit: (200, {"score": [1, 2]}),
    "/auth": lambda hit: (401, {"error": f"bad token {hit.headers['Authorization'].split()[-1]}"}),
    "/down": lambda hit: (503, {"error": "down"}),
    "/moved": lambda hit: (307, {}, {"Location": "/ok"}),
    "/basic": lambda hit: (200, {"scores": [0.5] * len(hit.body["rows"])}),
}


@pytest.fixture(scope="module")
def server():
    server = LoopbackServer(dict(ROUTES))
    server.routes["/slow"] = hang(server)
    yield server
    server.close()


@pytest.fixture(autouse=True)
def token(monkeypatch):
    monkeypatch.setenv("TEST_REWARD_TOKEN", SECRET)


def remote(server, path, **options):
    spec = {"url": server.url(path), "backoff": 0.0, "headers": {"Authorization": "Bearer ${TEST_REWARD_TOKEN}"}}
    return build_reward_source({**spec, **options})


def failure(source) -> str:
    with pytest.raises(RewardError) as info:
        score_responses(source, PROMPTS, RESPONSES, METADATA)
    message = str(info.value)
    assert "\n" not in message and SECRET not in message, message
    return message


def test_scores_are_used_as_sent_with_the_headers_expanded(server):
    source = remote(server, "/ok")
    assert isinstance(source, RemoteReward) and SECRET not in repr(source)
    scores, components = score_responses(source, PROMPTS, RESPONSES, METADATA)
    assert scores == [1.0, 0.0] and components == {"vowels": [1.0, 0.0]}
    hit = server.hits[-1]
    assert hit.headers["Authorization"] == f"Bearer {SECRET}"  # ${TEST_REWARD_TOKEN} read from the environment
    assert hit.body == {
        "rows": [{"prompt": p, "completion": r, "metadata": m} for p, r, m in zip(PROMPTS, RESPONSES, METADATA)]
    }


def test_a_server_that_does_not_answer_times_out_after_the_retries(server):
    message = failure(remote(server, "/slow", timeout=0.5, retries=2))
    assert message == f"remote reward {server.url('/slow')}: no answer within 0.5 s after 3 attempts (retries: 2)"
    assert server.wait_for("/slow", 3) == 3  # one attempt and two retries, counted by the server


def test_a_5xx_is_retried_and_the_next_answer_used(server):
    before = server.count("/flaky")
    scores, _ = score_responses(remote(server, "/flaky", retries=1), PROMPTS, RESPONSES, METADATA)
    assert scores == [1.0, 0.0] and server.count("/flaky") - before == 2
    message = failure(remote(server, "/down", retries=1))
    assert message.endswith('HTTP 503 after 2 attempts (retries: 1): \'{"error": "down"}\''), message


def test_a_4xx_is_not_retried_and_the_secret_it_echoes_is_masked(server):
    message = failure(remote(server, "/auth", retries=3))
    assert message == f'remote reward {server.url("/auth")}: HTTP 401 (not retried): \'{{"error": "bad token ***"}}\''
    assert server.count("/auth") == 1


@pytest.mark.parametrize(
    "path, why",
    [
        ("/count", "returned 1 scores for 2 responses"),
        ("/nan", 'returned a non-finite score (nan) at index 1 of "scores"'),
        ("/text", "returned 'high' at index 1 of \"scores\", not a number"),
        ("/html", "HTTP 200 but the answer is not JSON: '<html>oops</html>'"),
        ("/noscores", 'the answer has no "scores": \'{"score": [1, 2]}\''),
    ],
)
def test_a_bad_answer_is_one_line_naming_the_url(server, path, why):
    assert failure(remote(server, path)) == f"remote reward {server.url(path)}: {why}"


def test_an_oversized_answer_is_refused_without_reading_it_whole(server, monkeypatch):
    from aitraining_pl.remote_rewards import transport

    monkeypatch.setattr(transport, "MAX_ANSWER_BYTES", 1 << 20)
    server.routes["/huge"] = lambda hit: (200, b'{"scores": [' + b"1, " * (1 << 20) + b"1]}")
    message = failure(remote(server, "/huge"))
    assert (
        message == f"remote reward {server.url('/huge')}: HTTP 200 with an answer of more than 1 MiB (read no further)"
    )


def test_a_refused_connection_is_retried_then_named():
    closed = LoopbackServer({})
    url = closed.url("/score")
    closed.close()
    message = failure(build_reward_source({"url": url, "retries": 1, "backoff": 0.0}))
    assert message.startswith(f"remote reward {url}: connection failed (") and message.endswith(
        "after 2 attempts (retries: 1)"
    )


def test_bad_configs_are_refused_when_built(monkeypatch):
    monkeypatch.delenv("TEST_REWARD_TOKEN")
    with pytest.raises(RewardError, match=r"header 'Authorization' reads \$\{TEST_REWARD_TOKEN\}, which is not set"):
        build_reward_source({"url": "http://127.0.0.1:9/score", "headers": {"Authorization": "${TEST_REWARD_TOKEN}"}})
    with pytest.raises(RewardError, match="unknown option 'retry' for RemoteReward; the options are url, timeout"):
        build_reward_source({"url": "http://127.0.0.1:9/score", "retry": 2})
    with pytest.raises(RewardError, match="retries must be an integer >= 0, got -1"):
        build_reward_source({"url": "http://127.0.0.1:9/score", "retries": -1})
    for url in ("ftp://127.0.0.1/score", "http://127.0.0.1:port/score"):
        with pytest.raises(RewardError, match="the url must be http"):
            build_reward_source({"url": url})
    with pytest.warns(UserWarning, match="header 'X-Api-Key' is written in the config"):
        build_reward_source({"url": "http://127.0.0.1:9/score", "headers": {"X-Api-Key": "literal-key"}})


def test_a_redirect_is_not_followed(server):
    """The secret headers go to the configured URL only."""
    before = server.count("/ok")
    assert failure(remote(server, "/moved")) == f"remote reward {server.url('/moved')}: HTTP 307 (not retried): '{{}}'"
    assert server.count("/ok") == before


def test_credentials_in_the_url_are_sent_as_basic_auth(server):
    url = server.url("/basic").replace("http://", "http://user:pa%3Ass@")
    with pytest.warns(UserWarning, match="the url holds a password"):
        source = build_reward_source({"url": url})
    assert score_responses(source, ["p"], ["r"], [{}])[0] == [0.5]
    assert server.hits[-1].headers["Authorization"] == "Basic " + base64.b64encode(b"user:pa:ss").decode()


def test_urls_are_printed_without_credentials_or_query():
    assert public_url("https://user:pw@example.org:8443/score?key=abc#x") == "https://example.org:8443/score"
    with pytest.warns(UserWarning, match="the url holds a password"):
        source = build_reward_source({"url": "http://user:pw@127.0.0.1:9/score?key=abc", "retries": 0})
    with pytest.raises(RewardError) as info:
        score_responses(source, ["p"], ["r"], [{}])
    assert "pw" not in str(info.value) and "abc" not in str(info.value)


@pytest.mark.slow
def test_grpo_trains_through_the_reward_server_and_a_bad_score_stops_it_before_a_step(server, tmp_path, byte_tokenizer):
    from aitraining_pl.datamodules.prompt import PromptDataModule
    from aitraining_pl.modules.critic_free import GRPOModule
    from aitraining_pl.rollout import GenerationConfig

    def run(path):
        module = GRPOModule(
            model_config=TINY_LLAMA,
            tokenizer_name="byte",
            reward={
                "url": server.url(path),
                "backoff": 0.0,
                "headers": {"Authorization": "Bearer ${TEST_REWARD_TOKEN}"},
            },
            num_generations=2,
            generation=GenerationConfig(max_new_tokens=4, temperature=1.0, top_p=1.0),
            mini_batch_size=4,
            learning_rate=1e-2,
            seed=0,
        )
        assert module.hparams.reward["headers"] == {"Authorization": "Bearer ${TEST_REWARD_TOKEN}"}  # not the secret
        before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
        trainer = quiet_trainer(tmp_path, limit_train_batches=1)
        dm = PromptDataModule(prompts=["ab", "cd"], tokenizer=byte_tokenizer, batch_size=2)
        return module, before, trainer, dm

    module, before, trainer, dm = run("/alternate")
    trainer.fit(module, dm)
    assert server.count("/alternate") >= 1 and trainer.global_step == 1
    assert math.isfinite(float(trainer.callback_metrics["train/reward_mean"]))
    assert any(not torch.equal(p, before[n]) for n, p in module.policy.named_parameters())

    module, before, trainer, dm = run("/nan")
    with pytest.raises(RewardError, match="non-finite score"):
        trainer.fit(module, dm)
    assert trainer.global_step == 0
    assert all(torch.equal(p, before[n]) for n, p in module.policy.named_parameters())
