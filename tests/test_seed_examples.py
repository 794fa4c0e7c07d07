"""Every example of the seed document (seed/000_6628e51a4a47723e.txt), changed only in its imports
(``autotrain.trainers.rl`` -> ``aitraining_pl``), the model name (a tiny local model) and, where the seed
says ``"cuda"``, the device; each returns what the document says it returns.

Loop lengths (``num_iterations``, ``max_new_tokens``, ``max_tokens``) are shortened where the seed's values
would only make the test slower; the code paths are the seed's.
"""

from __future__ import annotations

import torch
import pytest

from aitraining_pl.models import build_causal_lm


@pytest.fixture
def tokenizer(byte_tokenizer):
    return byte_tokenizer


@pytest.fixture
def model(tiny_config):
    return build_causal_lm(tiny_config, seed=0)


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------- PPO model


def test_ppo_model_wraps_a_base_model_with_a_value_head(model):
    from aitraining_pl import PPOModel, ValueHead

    ppo_model = PPOModel(model)
    assert isinstance(ppo_model.value_head, ValueHead) and ppo_model.base_model is model
    out = ppo_model(torch.tensor([[5, 6, 7]]))
    assert out.values.shape == (1, 3) and out.logits.shape == (1, 3, 384)


# ---------------------------------------------------------------------------------------------- RL environments


def test_environment_dataclasses(tokenizer):
    from aitraining_pl.environments import Observation, StepResult, Trajectory

    obs = Observation(input_ids=torch.tensor([[1, 2]]), attention_mask=torch.ones(1, 2), prompt="p", metadata={})
    result = StepResult(reward=1.0, done=True, next_observation=None, info={}, metrics={"m": 1.0})
    traj = Trajectory([obs], [torch.tensor([3])], [1.0], [torch.tensor([-0.1])], True, 1.0, {})
    assert result.next_observation is None and traj.total_reward == 1.0 and traj.observations[0].prompt == "p"


def test_text_generation_env_example(tokenizer):
    from aitraining_pl import TextGenerationEnv

    def my_reward_function(prompt, generated, full_text):
        return float(len(generated))

    env = TextGenerationEnv(
        tokenizer=tokenizer,
        prompts=["Write a story about...", "Explain how..."],
        max_length=512,
        reward_fn=my_reward_function,  # Optional, default is length-based
        stop_sequences=["</s>", "\n\n"],
        temperature=1.0,
    )

    # Reset and step
    observation = env.reset()
    action_token = torch.tensor(encode(tokenizer, "A")[0])
    result = env.step(action_token)
    # result.reward, result.done, result.next_observation
    assert observation.prompt == "Write a story about..." and not result.done and result.reward == 0.0
    assert result.next_observation.input_ids.shape[1] == observation.input_ids.shape[1] + 1
    result = env.step(encode(tokenizer, " dog.\n\nThe end"))
    assert result.done and result.reward == 6.0  # "A dog." then the stop sequence

    # Render current state
    print(env.render())
    assert "A dog." in env.render()


def test_multi_objective_env_example(tokenizer):
    from aitraining_pl import MultiObjectiveRewardEnv

    prompts = ["What is 6 * 7?"]

    def is_correct(generated):
        return "42" in generated

    def properly_formatted(generated):
        return generated.startswith("Answer:")

    def correctness_reward(prompt, generated, full_text):
        return 1.0 if is_correct(generated) else 0.0

    def formatting_reward(prompt, generated, full_text):
        return 0.5 if properly_formatted(generated) else 0.0

    env = MultiObjectiveRewardEnv(
        tokenizer=tokenizer,
        prompts=prompts,
        reward_components={
            "correctness": correctness_reward,
            "formatting": formatting_reward,
        },
        reward_weights={
            "correctness": 1.0,
            "formatting": 0.1,
        },
    )

    env.reset()
    action = encode(tokenizer, "Answer: 42") + [tokenizer.eos_token_id]
    # Step returns component rewards in metrics
    result = env.step(action)
    # result.metrics["reward_correctness"], result.metrics["reward_formatting"]
    assert result.metrics["reward_correctness"] == 1.0 and result.metrics["reward_formatting"] == 0.5
    assert result.reward == pytest.approx(1.05)


def test_preference_comparison_env_example(tokenizer, tiny_config):
    from aitraining_pl import PreferenceComparisonEnv, RewardModel, RewardModelConfig

    prompts = ["Say something nice: "]
    preference_model = RewardModel(RewardModelConfig(model_config=tiny_config, tokenizer_name="byte"))
    feedback_calls = []

    def feedback_fn(prompt, response_a, response_b):
        feedback_calls.append(prompt)
        return None  # no human available: defer to the preference model

    env = PreferenceComparisonEnv(
        tokenizer=tokenizer,
        prompts=prompts,
        preference_model=preference_model,  # Optional
        human_feedback_fn=feedback_fn,  # Optional callback
        max_length=512,
    )

    response1_tokens = encode(tokenizer, "You are great.")
    response2_tokens = encode(tokenizer, "Meh.")
    # Generates pairs of responses and computes preference
    observation = env.reset()
    result1 = env.step(response1_tokens)  # First response
    result2 = env.step(response2_tokens)  # Second response, computes preference
    assert observation.prompt == prompts[0] and not result1.done and result2.done
    r1, r2 = preference_model.predict_rewards([prompts[0] + "You are great.", prompts[0] + "Meh."], tokenizer, 2)
    assert result2.reward == pytest.approx(torch.sigmoid(torch.tensor(r1 - r2)).item(), abs=1e-5)
    assert feedback_calls == prompts and len(env.comparisons) == 1


def test_builtin_environments_example(tokenizer):
    from aitraining_pl import create_code_generation_env, create_math_problem_env

    # Math problem solving (correctness + formatting rewards)
    math_env = create_math_problem_env(tokenizer)

    # Code generation (syntax + style rewards)
    code_env = create_code_generation_env(tokenizer)

    assert set(math_env.reward_components) == {"correctness", "formatting"}
    assert {"syntax", "style"} <= set(code_env.reward_components)
    obs = math_env.reset()
    assert math_env.step(encode(tokenizer, f"Answer: {obs.metadata['answer']}") + [1]).reward == pytest.approx(1.1)


# ---------------------------------------------------------------------------------------------- forward-backward


def test_forward_backward_pipeline_examples(model, tokenizer, tmp_path, monkeypatch):
    from aitraining_pl import ForwardBackwardPipeline

    monkeypatch.chdir(tmp_path)
    input_ids = torch.tensor([encode(tokenizer, "hello world, hello")] * 2)
    attention_mask = torch.ones_like(input_ids)
    labels = input_ids.clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    # Low-level pipeline
    pipeline = ForwardBackwardPipeline(
        model=model,
        device="cpu",
        max_workers=2,  # Thread pool size
        gradient_accumulation_steps=4,
    )

    for _ in range(3):  # the seed queues one; four fill the accumulation window
        pipeline.forward_backward(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    # Queue forward-backward pass
    future = pipeline.forward_backward(
        input_ids=input_ids,
        attention_mask=attention_mask,
        labels=labels,
        loss_fn="cross_entropy",
    )

    # Get result (blocks until complete)
    result = future.result()
    print(f"Loss: {result.loss}")
    assert result.loss > 0

    # Queue optimizer step
    optim_future = pipeline.optim_step(
        optimizer=optimizer,
        scheduler=scheduler,  # Optional
        max_grad_norm=1.0,
    )
    optim_result = optim_future.result()
    assert optim_result.applied and optim_result.step == 1

    # Custom loss function
    def custom_loss_fn(model, inputs, outputs, **kwargs):
        # Your custom loss computation
        logits = outputs.logits
        loss_tensor = logits.float().logsumexp(-1).mean() * kwargs["my_param"] / 42
        return loss_tensor  # Must be scalar

    future = pipeline.forward_backward_custom(
        input_ids=input_ids,
        custom_loss_fn=custom_loss_fn,
        attention_mask=attention_mask,  # Optional
        my_param=42,  # Passed to loss function via kwargs
    )
    assert future.result().loss > 0

    # Save checkpoint
    checkpoint_info = pipeline.save_state("checkpoint_1000")
    # Returns: {"path": ..., "model_path": ..., "optimizer_path": ..., "state_path": ...}
    assert set(checkpoint_info) == {"path", "model_path", "optimizer_path", "state_path"}

    # Load checkpoint
    pipeline.load_state("checkpoints/checkpoint_1000")

    prompt_tokens = encode(tokenizer, "Once")
    samples = pipeline.sample(
        prompt=prompt_tokens,  # List[int] or Tensor
        max_tokens=20,
        temperature=0.7,
        top_k=50,
        top_p=0.9,
        stop=[tokenizer.eos_token_id],
    )

    print(f"Generated: {samples['tokens']}")
    print(f"Logprobs: {samples['logprobs']}")
    print(f"Prompt: {samples['prompt']}")
    assert len(samples["tokens"]) == len(samples["logprobs"]) <= 20 and samples["prompt"] == prompt_tokens
    pipeline.shutdown()


def test_async_training_client_example(model, tiny_config, tokenizer):
    from aitraining_pl.forward_backward import AsyncTrainingClient

    reference_model = build_causal_lm(tiny_config, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {"input_ids": torch.tensor([encode(tokenizer, "abc def")]), "labels": torch.tensor([encode(tokenizer, "abc def")])}

    client = AsyncTrainingClient(
        model=model,
        reference_model=reference_model,  # For PPO/DPO
        device="cpu",
        gradient_accumulation_steps=4,
    )

    # Training step
    fwd_future = client.forward_backward(batch, loss_fn="cross_entropy")
    optim_future = client.optim_step(optimizer, max_grad_norm=1.0)

    # Forward only (for reference model)
    ref_future = client.forward(batch, use_reference=True)

    assert fwd_future.result().loss > 0 and not optim_future.result().applied  # 1 of 4 micro-batches so far
    assert ref_future.result().logprobs.shape == (1, 6)

    # Clean up
    client.shutdown()
