"""Every example of the seed document (seed/000_6628e51a4a47723e.txt), changed only in its imports
(``autotrain.trainers.rl`` -> ``aitraining_pl.compat``), the model name (a tiny local model) and, where the seed
says ``"cuda"``, the device; each returns what the document says it returns.

Loop lengths (``num_iterations``, ``max_new_tokens``, ``max_tokens``) are shortened where the seed's values
would only make the test slower; the code paths are the seed's.
"""

from __future__ import annotations

import pytest
import torch

from aitraining_pl.models import build_causal_lm


@pytest.fixture
def tokenizer(byte_tokenizer):
    return byte_tokenizer


@pytest.fixture
def model(tiny_config):
    return build_causal_lm(tiny_config, seed=0)


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="session")
def local_model_name(tmp_path_factory):
    """The seed's "google/gemma-2-2b" / "bert-base-uncased" become this folder: a tiny Llama and its tokenizer."""
    from conftest import TINY_LLAMA

    from aitraining_pl.models import load_tokenizer

    path = tmp_path_factory.mktemp("tiny-model")
    build_causal_lm(TINY_LLAMA, seed=0).save_pretrained(path)
    load_tokenizer("byte").save_pretrained(path)
    return str(path)


# ---------------------------------------------------------------------------------------------- PPO


@pytest.mark.slow
def test_ppo_trainer_example(local_model_name, tokenizer, tmp_path, monkeypatch):
    from aitraining_pl.compat import PPOConfig, PPOTrainer

    monkeypatch.chdir(tmp_path)  # save_every writes checkpoints under ./ppo_output

    config = PPOConfig(
        model_name=local_model_name,
        learning_rate=1e-5,
        batch_size=16,
        mini_batch_size=4,
        gradient_accumulation_steps=1,
        # PPO hyperparameters
        ppo_epochs=4,
        gamma=0.99,  # Discount factor
        lam=0.95,  # GAE lambda
        clip_ratio=0.2,  # PPO clip ratio
        value_clip=0.2,  # Value function clip
        max_grad_norm=1.0,  # Gradient clipping
        # KL penalty
        kl_penalty_coef=0.01,
        kl_target=0.01,
        kl_horizon=10000,  # Horizon for adaptive KL
        # Coefficients
        entropy_coef=0.01,  # Entropy regularization
        value_coef=0.5,  # Value function coefficient
        # Generation
        max_new_tokens=8,  # seed: 128
        temperature=0.7,
        top_p=0.9,
        # Training loop
        num_iterations=100,
        save_every=1,  # seed: 10
        eval_every=5,
        device=None,  # Auto-detected
    )

    def evaluate_response(response):
        return sum(c in "aeiou" for c in response) / max(len(response), 1)

    # Initialize trainer with custom reward function
    def my_reward_fn(prompts, responses, metadata=None):
        rewards = []
        for response in responses:
            score = evaluate_response(response)
            rewards.append(score)
        return rewards

    trainer = PPOTrainer(
        config=config,
        tokenizer=tokenizer,  # Optional, loaded from model if not provided
        reward_fn=my_reward_fn,
    )

    before = [p.detach().clone() for p in trainer.module.policy.parameters()]
    # Train on prompts
    prompts = ["Write a poem about...", "Explain quantum..."]
    metrics = trainer.train(prompts, num_iterations=1)  # seed: 100

    for name in ("train/reward_mean", "train/kl", "train/kl_coef", "train/policy_loss", "train/value_loss"):
        assert len(metrics[name]) == 1, name
    assert 0.0 <= metrics["train/reward_mean"][0] <= 1.0
    assert trainer.module.kl_coef != config.kl_penalty_coef  # the adaptive controller moved it
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.module.policy.parameters()))
    assert [p.name for p in (tmp_path / "ppo_output/checkpoints").iterdir()] == ["step-1.ckpt"]


# ---------------------------------------------------------------------------------------------- DPO


def test_dpo_trainer_examples(local_model_name, tokenizer, tmp_path, monkeypatch):
    from aitraining_pl.compat import DPOConfig, DPOTrainer
    from aitraining_pl.compat.dpo import PreferenceDataset

    monkeypatch.chdir(tmp_path)
    config = DPOConfig(
        model_name=local_model_name,
        learning_rate=1e-6,
        batch_size=8,
        gradient_accumulation_steps=2,
        # DPO hyperparameters
        beta=0.1,  # Temperature parameter
        label_smoothing=0.0,  # For robustness
        reference_free=False,  # Use reference model
        # Training
        num_epochs=1,
        max_grad_norm=1.0,
        warmup_ratio=0.1,
        # Sequence lengths
        max_length=512,
        max_prompt_length=256,
        # Checkpointing
        eval_every=100,
        save_every=500,
        device=None,  # Auto-detected
    )

    # Create dataset from preference pairs
    dataset = PreferenceDataset(
        prompts=["What is AI?", "Explain gravity"],
        chosen=["AI is artificial intelligence...", "Gravity is a force..."],
        rejected=["idk lol", "its like magnets"],
        tokenizer=tokenizer,
        max_length=512,
        max_prompt_length=256,
    )
    eval_dataset = dataset

    # Train
    trainer = DPOTrainer(config=config, tokenizer=tokenizer)
    metrics = trainer.train(dataset, eval_dataset=eval_dataset)
    assert metrics["train/loss"][0] == pytest.approx(0.6931, abs=1e-3)  # log 2: policy equals its reference
    assert metrics["train/rewards/accuracies"] == [0.5]
    assert len(metrics["val/loss"]) == 1 and metrics["val/loss"][0] < metrics["train/loss"][0]
    assert trainer.module.reference is not None

    # Reference-free DPO
    config = DPOConfig(
        model_name=local_model_name,
        reference_free=True,  # No reference model needed
        beta=0.1,
    )
    trainer = DPOTrainer(config=config, tokenizer=tokenizer)
    assert trainer.module.reference is None
    metrics = trainer.train(dataset)
    assert len(metrics["train/loss"]) == 1 and "val/loss" not in metrics


# ---------------------------------------------------------------------------------------------- reward models


def test_reward_model_examples(local_model_name, tokenizer, tmp_path, monkeypatch):
    from aitraining_pl.compat import (
        MultiObjectiveRewardModel,
        PairwiseRewardModel,
        RewardModel,
        RewardModelConfig,
        RewardModelTrainer,
    )

    monkeypatch.chdir(tmp_path)
    config = RewardModelConfig(
        model_name=local_model_name,
        num_labels=1,
        pooling_strategy="last",  # "mean", "last", or "cls"
        dropout_prob=0.1,
        temperature=1.0,  # Temperature scaling for rewards
        # LoRA settings
        use_lora=True,
        lora_rank=8,
        lora_alpha=16,
        lora_dropout=0.1,
        # Training
        learning_rate=1e-4,
        warmup_steps=100,
        gradient_accumulation_steps=1,
    )

    model = RewardModel(config)

    trainer = RewardModelTrainer(
        model=model,
        tokenizer=tokenizer,
        config=config,
        device=None,  # Auto-detected
    )

    trainer.train_on_preferences(
        chosen_texts=["Good response 1", "Good response 2"],
        rejected_texts=["Bad response 1", "Bad response 2"],
        num_epochs=3,
        batch_size=8,
    )
    scores = model.predict_rewards(["Good response 1", "Bad response 1"], tokenizer)

    # Save/load
    trainer.save_model("reward_model.pt")
    trainer.load_model("reward_model.pt")
    assert model.predict_rewards(["Good response 1", "Bad response 1"], tokenizer) == pytest.approx(scores, abs=1e-5)
    reloaded = RewardModel.from_pretrained("reward_model.pt")
    assert reloaded.predict_rewards(["Good response 1", "Bad response 1"], tokenizer) == pytest.approx(scores, abs=1e-5)

    ids = torch.tensor([encode(tokenizer, "good answer"), encode(tokenizer, "bad answer!")])
    input_ids_a, attention_mask_a = ids[:1], torch.ones_like(ids[:1])
    input_ids_b, attention_mask_b = ids[1:], torch.ones_like(ids[1:])
    labels = torch.tensor([1.0])

    model = PairwiseRewardModel(config)

    # Forward pass compares two inputs
    preference_score = model.forward_pair(
        input_ids_a, attention_mask_a,
        input_ids_b, attention_mask_b,
    )  # fmt: skip

    # Bradley-Terry loss for training
    loss = model.compute_bradley_terry_loss(
        input_ids_a, attention_mask_a,
        input_ids_b, attention_mask_b,
        labels,  # 1 if A preferred, 0 if B preferred
    )  # fmt: skip
    assert preference_score.shape[0] == 1 and loss.dim() == 0 and loss.item() > 0

    model = MultiObjectiveRewardModel(
        config=config,
        num_objectives=3,
        objective_weights=[0.5, 0.3, 0.2],  # Helpfulness, safety, honesty
    )
    input_ids, attention_mask = ids, torch.ones_like(ids)
    target_rewards = torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, 0.5]])

    # Get all objectives
    outputs = model(input_ids, attention_mask, return_all_objectives=True)
    # outputs["rewards"] shape: (batch_size, 3)
    # outputs["combined_reward"] shape: (batch_size, 1)
    assert outputs["rewards"].shape == (2, 3) and outputs["combined_reward"].shape == (2, 1)

    # Multi-objective loss
    loss, per_objective_losses = model.compute_multi_objective_loss(
        input_ids, attention_mask,
        target_rewards,      # Shape: (batch_size, num_objectives)
        objective_mask=None, # Optional: which objectives to train
    )  # fmt: skip
    assert loss.dim() == 0 and len(per_objective_losses) == 3


# ---------------------------------------------------------------------------------------------- PPO model


def test_ppo_model_wraps_a_base_model_with_a_value_head(model):
    from aitraining_pl.compat import PPOModel, ValueHead

    ppo_model = PPOModel(model)
    assert isinstance(ppo_model.value_head, ValueHead) and ppo_model.base_model is model
    out = ppo_model(torch.tensor([[5, 6, 7]]))
    assert out.values.shape == (1, 3) and out.logits.shape == (1, 3, 384)


# ---------------------------------------------------------------------------------------------- RL environments


def test_environment_dataclasses(tokenizer):
    from aitraining_pl.compat.environments import Observation, StepResult, Trajectory

    obs = Observation(input_ids=torch.tensor([[1, 2]]), attention_mask=torch.ones(1, 2), prompt="p", metadata={})
    result = StepResult(reward=1.0, done=True, next_observation=None, info={}, metrics={"m": 1.0})
    traj = Trajectory([obs], [torch.tensor([3])], [1.0], [torch.tensor([-0.1])], True, 1.0, {})
    assert result.next_observation is None and traj.total_reward == 1.0 and traj.observations[0].prompt == "p"


def test_text_generation_env_example(tokenizer):
    from aitraining_pl.compat import TextGenerationEnv

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
    from aitraining_pl.compat import MultiObjectiveRewardEnv

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
    from aitraining_pl.compat import PreferenceComparisonEnv, RewardModel, RewardModelConfig

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
    from aitraining_pl.compat import create_code_generation_env, create_math_problem_env

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
    from aitraining_pl.compat import ForwardBackwardPipeline

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
    from aitraining_pl.compat.forward_backward import AsyncTrainingClient

    reference_model = build_causal_lm(tiny_config, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {
        "input_ids": torch.tensor([encode(tokenizer, "abc def")]),
        "labels": torch.tensor([encode(tokenizer, "abc def")]),
    }

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


def test_reward_trainer_load_model_restores_the_rewards_of_a_lora_model(local_model_name, tokenizer, tmp_path):
    from aitraining_pl.compat import RewardModel, RewardModelConfig, RewardModelTrainer

    config = RewardModelConfig(model_name=local_model_name, use_lora=True, learning_rate=1e-2, warmup_steps=0)
    model = RewardModel(config)
    trainer = RewardModelTrainer(model=model, tokenizer=tokenizer, config=config, device="cpu")
    trainer.train_on_preferences(
        ["Good response 1", "Good response 2"], ["Bad response 1", "Bad response 2"], num_epochs=3
    )
    scores = model.predict_rewards(["Good response 1", "Bad response 1"], tokenizer)
    trainer.save_model(str(tmp_path / "rm"))
    trainer.load_model(str(tmp_path / "rm"))
    assert model.predict_rewards(["Good response 1", "Bad response 1"], tokenizer) == pytest.approx(scores, abs=1e-4)


# ---------------------------------------------------------------------------------------------- beyond the seed


@pytest.mark.slow
def test_ppo_trainer_with_an_environment_as_reward_fn_and_validation(tiny_config, tokenizer, tmp_path):
    from aitraining_pl.compat import PPOConfig, PPOTrainer, create_math_problem_env

    env = create_math_problem_env(tokenizer, num_problems=8)
    config = PPOConfig(
        model_config=tiny_config, tokenizer_name="byte", batch_size=4, mini_batch_size=4, ppo_epochs=1,
        max_new_tokens=4, save_every=0, eval_every=1, device="cpu", output_dir=str(tmp_path),
    )  # fmt: skip
    trainer = PPOTrainer(config, reward_fn=env)
    metadata = [env.metadata_for(p) for p in env.prompts]
    metrics = trainer.train(env.prompts, num_iterations=2, metadata=metadata, eval_prompts=env.prompts[:4])
    assert len(metrics["train/reward/correctness"]) == len(metrics["train/reward/formatting"]) == 2
    assert len(metrics["val/reward_mean"]) == 2  # validated after each iteration
    assert not (tmp_path / "checkpoints").exists()  # save_every=0: no checkpoints


def test_dpo_trainer_on_pairs_collected_by_the_preference_environment(tiny_config, tokenizer):
    from aitraining_pl.compat import DPOConfig, DPOTrainer, PreferenceComparisonEnv

    class LongerIsBetter:
        def predict_rewards(self, texts, tokenizer, batch_size=8):
            return [float(len(t)) for t in texts]

    env = PreferenceComparisonEnv(tokenizer, ["Q1: ", "Q2: "], preference_model=LongerIsBetter())
    for i in range(8):
        env.reset()
        env.step(encode(tokenizer, "short" if i % 2 else "a much longer answer"))
        env.step(encode(tokenizer, "a much longer answer" if i % 2 else "short"))
    pairs = env.preference_pairs()
    assert pairs["chosen"] == ["a much longer answer"] * 8 and len(pairs["prompts"]) == 8
    config = DPOConfig(
        model_config=tiny_config,
        tokenizer_name="byte",
        learning_rate=1e-3,
        batch_size=4,
        gradient_accumulation_steps=1,
        save_every=0,
        device="cpu",
    )
    trainer = DPOTrainer(config)
    metrics = trainer.train(pairs)
    assert len(metrics["train/loss"]) == 2 and metrics["train/loss"][1] < metrics["train/loss"][0]
