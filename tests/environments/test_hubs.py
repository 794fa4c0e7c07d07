"""Environment hubs as episodes (``environments.hubs``): a verifiers taskset (one turn) and a multi-turn verifiers
env, an OpenEnv environment in-process and behind its own server on loopback; reset / step and the reward mapping by
hand, then a few GRPO steps with each adapter as ``reward``."""

from __future__ import annotations

import gc
import socket
import threading

import pytest
import torch
from conftest import quiet_trainer
from episode_fixtures import episode_module

from aitraining_pl.environments.episode import AssistantTurn
from aitraining_pl.errors import ConfigError


@pytest.fixture(scope="module")
def vf():
    return pytest.importorskip(
        "verifiers.v1", reason="verifiers is not installed (pip install 'aitraining-pl[verifiers]')"
    )


@pytest.fixture(scope="module")
def openenv():
    return pytest.importorskip(
        "openenv.core", reason="openenv-core is not installed (pip install 'aitraining-pl[openenv]')"
    )


@pytest.fixture(scope="module")
def game(openenv):
    """A guess-the-number OpenEnv ``Environment``: ``(GuessNumber, GuessAction, GuessObservation)``;
    ``reset(secret=...)``; its ``rubric`` scores a step 1 for the secret (done), -0.1 otherwise (hint: ``higher`` /
    ``lower``), written into the observation's ``reward`` as OpenEnv's docs show."""
    from openenv.core.rubrics import Rubric

    class GuessAction(openenv.Action):
        guess: int

    class GuessObservation(openenv.Observation):
        hint: str = ""

    class Found(Rubric):
        def forward(self, action, observation) -> float:
            return 1.0 if observation.done else -0.1

    class GuessNumber(openenv.Environment[GuessAction, GuessObservation, openenv.State]):
        SUPPORTS_CONCURRENT_SESSIONS = True
        closed = 0

        def __init__(self):
            super().__init__(rubric=Found())

        def reset(self, seed=None, episode_id=None, secret: int = 4, **kwargs):
            self._reset_rubric()
            self.secret, self.steps = int(secret), 0
            return GuessObservation(hint="Guess 1-7.")

        def step(self, action, timeout_s=None, **kwargs):
            self.steps += 1
            right = action.guess == self.secret
            hint = "right" if right else "higher" if action.guess < self.secret else "lower"
            observation = GuessObservation(hint=hint, done=right)
            observation.reward = self._apply_rubric(action, observation)
            return observation

        @property
        def state(self):
            return openenv.State(step_count=self.steps)

        def close(self):
            type(self).closed += 1

    return GuessNumber, GuessAction, GuessObservation


@pytest.fixture(scope="module")
def server(game):
    """``game`` behind OpenEnv's own server (FastAPI, uvicorn) on a loopback socket, listening before uvicorn starts
    (so no wait for it): its URL."""
    import uvicorn
    from openenv.core.env_server.http_server import create_app

    app = create_app(game[0], game[1], game[2], max_concurrent_envs=8)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    running = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=running.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    running.should_exit = True
    thread.join(10)
    sock.close()


def _turn(text: str, index: int = 0) -> AssistantTurn:
    return AssistantTurn(text, text, [1], True, index)


def _play(env, prompt, metadata, turns):
    """One episode played by hand: the first messages and each turn's ``EpisodeStep``."""
    episode = env.spawn()
    first = episode.reset(prompt, metadata)
    steps = []
    for i, text in enumerate(turns):
        steps.append(episode.step(_turn(text, i)))
        if steps[-1].done:
            break
    return first, steps


# -- verifiers


def test_verifiers_taskset_plays_one_answer_scored_by_the_tasks_rewards(vf):
    from hub_fixtures import DigitTaskset

    from aitraining_pl.environments import VerifiersEnvironment

    env = VerifiersEnvironment(DigitTaskset(vf.TasksetConfig()))
    assert env.seat == "agent" and env.rows() == [{"prompt": "Guess a digit:", "task": i} for i in range(3)]
    first, (step,) = _play(env, "Guess a digit:", {"task": 1}, ["it is 5"])
    assert first == [{"role": "system", "content": "One digit only."}, {"role": "user", "content": "Guess a digit:"}]
    # trace.reward: correct 1 (weight 1) + plain 5/7 (weight 0.1), on the one turn
    assert step.done and step.messages == [] and step.reward == pytest.approx(1.0 + 0.1 * 5 / 7)
    assert step.metrics == pytest.approx({"replies": 1.0, "reward_correct": 1.0, "reward_plain": 5 / 7})
    _, (wrong,) = _play(env, "Guess a digit:", {}, ["5"])  # no index: the first task with that prompt (secret 3)
    assert wrong.done and wrong.reward == pytest.approx(0.1) and wrong.metrics["reward_correct"] == 0.0
    with pytest.raises(ValueError, match="'task' = 7 is not a task index"):
        env.spawn().reset("Guess a digit:", {"task": 7})


def test_verifiers_multi_turn_env_answers_each_turn_and_its_rewards_sum_with_their_weights(vf):
    from aitraining_pl.environments import VerifiersEnvironment

    env = VerifiersEnvironment("hub_fixtures")  # the environment package's id, loaded as verifiers loads it
    assert type(env.env).__name__ == "HigherLower" and env.seat == "player" and env.limits.max_turns == 4
    first, steps = _play(env, "ignored", {"task": 0}, ["1", "5", "3"])  # secret 3
    assert first[-1] == {"role": "user", "content": "Guess a digit:"}
    assert [s.messages for s in steps[:2]] == [[{"role": "user", "content": hint}] for hint in ("higher", "lower")]
    assert [s.reward for s in steps[:2]] == [0.0, 0.0] and not any(s.done for s in steps[:2])
    last = steps[2]
    # correct 1 (weight 1) + plain 1 (weight 0.1) + speed 1/3 (weight 0.5): verifiers' trace.reward, on the last turn
    assert last.done and last.reward == pytest.approx(1.0 + 0.1 + 0.5 / 3)
    expected = {"replies": 3.0, "finished": 1.0, "reward_correct": 1.0, "reward_plain": 1.0, "reward_speed": 1 / 3}
    assert last.metrics == pytest.approx(expected)


def test_verifiers_turn_limit_truncates_and_a_trace_stop_ends_the_exchange(vf):
    from aitraining_pl.environments import VerifiersEnvironment

    env = VerifiersEnvironment("hub_fixtures", max_turns=2)
    _, steps = _play(env, "", {"task": 0}, ["1", "5"])
    # the env's third message is refused by the limit: scored (speed 1/3, plain, not correct), not done: truncated
    assert not steps[1].done and steps[1].messages == [{"role": "user", "content": "lower"}]
    assert steps[1].reward == pytest.approx(0.5 / 3 + 0.1) and steps[1].metrics["finished"] == 0.0

    _, steps = _play(VerifiersEnvironment("hub_fixtures"), "", {"task": 0}, ["?", "2"])
    # the task's @vf.stop `gave_up` fires before the second turn: the exchange ends, scored
    assert len(steps) == 1 and steps[0].done and steps[0].reward == pytest.approx(0.5 / 2)


def test_verifiers_refuses_bad_envs_and_seats_and_a_dropped_episode_ends_its_run(vf):
    from hub_fixtures import DigitTaskset, HigherLowerConfig, UserSim

    from aitraining_pl.environments import VerifiersEnvironment

    with pytest.raises(ConfigError, match="VerifiersEnvironment: seat: 'user' is not one of the env's seats"):
        VerifiersEnvironment("hub_fixtures", seat="user")
    with pytest.raises(ConfigError, match="env 'no_such_environment': taskset 'no_such_environment' not found"):
        VerifiersEnvironment("no_such_environment")
    with_tools = type("WithTools", (DigitTaskset,), {"toolsets": classmethod(lambda cls, config: ["a Toolset"])})
    with pytest.raises(ConfigError, match="tool servers"):
        VerifiersEnvironment(with_tools(vf.TasksetConfig()))
    env = VerifiersEnvironment(UserSim(HigherLowerConfig(taskset={"id": "hub_fixtures"})))
    with pytest.raises(ValueError, match="Env.run uses seat 'user'; only the policy's seat 'player' is played"):
        env.spawn().reset("", {"task": 0})

    episode = VerifiersEnvironment("hub_fixtures").spawn()
    episode.reset("", {"task": 0})
    episode.step(_turn("1"))  # the env waits for a second turn that a token limit never lets come
    running = episode.episode
    del episode
    gc.collect()
    with pytest.raises(Exception) as cancelled:
        running.result(timeout=10)
    assert running.cancelled(), cancelled.value


def test_a_missing_hub_package_is_one_line_naming_its_extra():
    from aitraining_pl.environments.hubs.common import require

    with pytest.raises(ConfigError) as err:
        require("aitraining_pl_no_such_hub", "verifiers", "VerifiersEnvironment")
    assert "pip install 'aitraining-pl[verifiers]'" in str(err.value) and "\n" not in str(err.value)


# -- OpenEnv


def _check_guessing(env):
    first, steps = _play(env, "Play.", {"reset": {"secret": 3}}, ["x", "2", '{"guess": 5}', "3"])
    assert first == [{"role": "user", "content": "Play.\n\nGuess 1-7."}]
    invalid, higher, lower, right = steps
    assert invalid.messages[0]["content"].startswith("error: ") and invalid.metrics == {"invalid_actions": 1.0}
    assert invalid.reward == 0.0 and not invalid.done
    assert higher.messages == [{"role": "user", "content": "higher"}] and higher.reward == pytest.approx(-0.1)
    assert lower.messages == [{"role": "user", "content": "lower"}] and lower.reward == pytest.approx(-0.1)
    assert right.done and right.reward == 1.0 and right.messages == []


def test_openenv_environment_in_process_steps_with_its_rewards(game):
    from aitraining_pl.environments import OpenEnvEnvironment

    env = OpenEnvEnvironment(game[0]())
    _check_guessing(env)
    assert game[0].closed == 1  # the episode's copy, closed when done
    first, _ = _play(env, "", {}, [])  # no reset arguments: the environment's defaults
    assert first == [{"role": "user", "content": "Guess 1-7."}]
    assert "guess: Input should be a valid integer" in _play(env, "", {}, ["x"])[1][0].messages[0]["content"]


def test_openenv_environment_through_its_server_on_loopback(game, server):
    from aitraining_pl.environments import OpenEnvEnvironment

    env = OpenEnvEnvironment(server)  # a GenericEnvClient per episode; actions follow the server's /schema
    _check_guessing(env)
    assert env.schema["required"] == ["guess"]

    async def connect():  # a client factory that awaits (as EnvClient.from_env does), the Action class given
        from openenv import GenericEnvClient

        return GenericEnvClient(base_url=server)

    _check_guessing(OpenEnvEnvironment(connect, action_type=game[1]))


# -- training


def _fit(module, tmp_path, prompts, metadata, steps):
    from aitraining_pl.datamodules.prompt import PromptDataModule

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = quiet_trainer(tmp_path, max_steps=steps)
        trainer.fit(module, datamodule=PromptDataModule(prompts=prompts, metadata=metadata, batch_size=2))
    finally:
        torch.set_num_threads(threads)
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("hub", ["verifiers", "openenv"])
def test_grpo_trains_on_a_hub_environment(request, tmp_path, hub):
    from aitraining_pl.environments import OpenEnvEnvironment, VerifiersEnvironment

    if hub == "verifiers":  # as a YAML `reward:` gives it
        request.getfixturevalue("vf")
        env = {"class_path": "aitraining_pl.environments.VerifiersEnvironment", "init_args": {"env": "hub_fixtures"}}
        rows = VerifiersEnvironment("hub_fixtures").rows() * 2
        prompts, metadata, metric = [r["prompt"] for r in rows], [{"task": r["task"]} for r in rows], "reward_correct"
    else:
        env = OpenEnvEnvironment(request.getfixturevalue("game")[0](), max_turns=3)
        prompts, metadata, metric = ["Play."] * 6, [{"reset": {"secret": 1 + i}} for i in range(6)], "invalid_actions"
    torch.manual_seed(0)
    module = episode_module(env, num_generations=4, mini_batch_size=8)
    seen = []
    make_experience = module.make_experience
    module.make_experience = lambda rollout: seen.append(rollout) or make_experience(rollout)
    assert isinstance(module.reward_source, (VerifiersEnvironment, OpenEnvEnvironment))
    before = [p.detach().clone() for p in module.policy.parameters()]
    trainer = _fit(module, tmp_path, prompts, metadata, steps=3)
    assert len(seen) == 3 and all(torch.isfinite(r.scores).all() for r in seen)
    assert all(torch.equal(r.token_scores.sum(1), r.scores) for r in seen)  # the turn rewards sum to the return
    assert any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))
    logged = trainer.callback_metrics
    assert "train/reward_mean" in logged and f"train/episode/{metric}" in logged and "train/episode/turns" in logged
