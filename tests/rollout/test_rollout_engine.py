"""The rollout engine: end tokens of chat models, no leaking generation config, stop strings at the
prompt/response boundary, G samples per prompt, scoring, and the samplers built on it."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import TINY_LLAMA

import aitraining_pl.rollout.engine as rollout_module
from aitraining_pl.losses import place_scores, token_rewards
from aitraining_pl.models import build_causal_lm, load_causal_lm, load_tokenizer
from aitraining_pl.rewards import RewardError
from aitraining_pl.rollout import (
    GenerationConfig,
    RolloutEngine,
    StopRule,
    end_token_ids,
    response_mask,
    score_rollout,
)

TOY_REWARD = "aitraining_pl.rewards:char_fraction_reward"  # PPO/GRPO/RLOO need a reward source

EOT = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _prompts(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded byte-level prompt ids and mask."""
    tokenizer = load_tokenizer("byte", padding_side="left")
    enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


@pytest.fixture(scope="module")
def chat_policy(tmp_path_factory):
    """A Phi-architecture policy whose turn ends with ``<|im_end|>`` (a special token that is not the tokenizer's
    EOS), listed in its saved ``generation_config.eos_token_id``. Its lm_head has zero weights and a bias, so
    every step samples from one fixed distribution: ``<|im_end|>`` likely, the tokenizer's EOS never."""
    from transformers import AutoConfig, AutoModelForCausalLM, ByT5Tokenizer

    tok = ByT5Tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [EOT]})
    tok.chat_template = CHAT_TEMPLATE
    eot = tok.convert_tokens_to_ids(EOT)
    assert eot != tok.eos_token_id
    config = AutoConfig.for_model(
        "phi",
        vocab_size=392,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.bias.fill_(0.0)
        model.lm_head.bias[[0, 1]] = -30.0  # pad and the tokenizer's EOS: never
        model.lm_head.bias[385:] = -30.0  # ids beyond the tokenizer
        model.lm_head.bias[eot] = 4.0  # about 0.13 per step
    model.generation_config.eos_token_id = [tok.eos_token_id, eot]
    path = tmp_path_factory.mktemp("chat_policy")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), eot


def test_end_token_ids_merge_tokenizer_and_model(byte_tokenizer):
    model = build_causal_lm(TINY_LLAMA)
    assert end_token_ids(byte_tokenizer, model) == [1]
    model.generation_config.eos_token_id = [7, 1, 9]
    assert end_token_ids(byte_tokenizer, model) == [1, 7, 9]
    model.generation_config.eos_token_id = 5
    assert end_token_ids(byte_tokenizer, model) == [1, 5] and end_token_ids(None, model) == [5]


def test_chat_policy_responses_end_at_the_end_of_turn_and_the_score_sits_on_it(chat_policy):
    from aitraining_pl.datamodules.prompt import PromptDataModule
    from aitraining_pl.modules.ppo import PPOModule

    path, eot = chat_policy
    module = PPOModule(
        model_name=path,
        reward=lambda p, r, m: [float(len(x)) + 1.0 for x in r],
        generation=GenerationConfig(max_new_tokens=64, temperature=1.0),
    )
    dm = PromptDataModule(
        prompts=["hi", "what is 2+2?", "name a colour"],
        tokenizer=module.tokenizer,
        batch_size=3,
        use_chat_template=True,
        val_split=0.0,
    )
    dm.setup("fit")
    batch = dm.collate_fn([dm.train_dataset[i] for i in range(3)])
    assert batch["prompts"][0] == "<|user|>hi<|im_end|><|assistant|>"
    torch.manual_seed(0)
    rollout = module.generate(batch["input_ids"], batch["attention_mask"], num_samples=4)
    lengths = rollout.response_mask.sum(1)
    assert rollout.ended.all() and (rollout.response_ids != module.tokenizer.eos_token_id).all()
    last = rollout.response_ids[torch.arange(12), lengths - 1]
    assert (last == eot).all()  # every response ends with the end-of-turn token, included in the mask
    for row, n in zip(rollout.response_ids, lengths.tolist()):
        assert (row[n:] == module.tokenizer.pad_token_id).all() and (row[: n - 1] != eot).all()
    assert not any(EOT in t for t in rollout.texts) and lengths.float().std() > 0
    # with the tokenizer's EOS alone (the old rule), none of these responses would have ended
    assert not response_mask(rollout.response_ids, module.tokenizer.eos_token_id)[1].any()
    scores, _ = module.score(batch["prompts"], batch["metadata"], rollout)
    assert scores.tolist() == [float(len(t)) + 1.0 for t in rollout.texts]
    rewards, _ = token_rewards(
        scores,
        torch.zeros(12, rollout.response_ids.shape[1]),
        torch.zeros(12, rollout.response_ids.shape[1]),
        rollout.response_mask,
        kl_coef=0.1,
    )
    placed = place_scores(scores, rollout.response_mask)
    assert torch.equal(rewards, placed) and (rewards.nonzero()[:, 1] == lengths - 1).all()
    assert (rollout.response_ids[rewards != 0] == eot).all()  # the score sits on the end-of-turn token


def test_environment_rollout_ends_at_the_models_end_of_turn(chat_policy):
    from aitraining_pl.environments import TextGenerationEnv

    path, eot = chat_policy
    tok, model = load_tokenizer(path), load_causal_lm(path)
    env = TextGenerationEnv(tok, ["<|user|>hi<|im_end|><|assistant|>"], max_length=200)
    traj = env.rollout(model, generator=torch.Generator().manual_seed(0))
    actions = torch.cat(traj.actions).tolist()
    assert traj.done and actions[-1] == eot and eot not in actions[:-1] and len(traj.logprobs) == len(actions)
    # the kept log-probs are those of the fixed distribution at temperature 1
    expected = torch.log_softmax(model.lm_head.bias.detach(), -1)[actions]
    torch.testing.assert_close(torch.stack(traj.logprobs), expected, atol=1e-5, rtol=0)


def test_checkpoint_generation_config_does_not_change_what_is_sampled(tmp_path, byte_tokenizer):
    plain = build_causal_lm(TINY_LLAMA, seed=0)
    plain.save_pretrained(tmp_path / "plain")
    plain.generation_config.update(
        do_sample=True, repetition_penalty=5.0, top_k=3, temperature=0.1, no_repeat_ngram_size=1
    )
    plain.save_pretrained(tmp_path / "tuned")
    a, b = load_causal_lm(str(tmp_path / "plain")), load_causal_lm(str(tmp_path / "tuned"))
    assert b.generation_config.repetition_penalty == 5.0 and b.generation_config.top_k == 3
    ids, mask = _prompts(["hello there", "a"])
    engine = RolloutEngine(byte_tokenizer, GenerationConfig(max_new_tokens=12, temperature=1.0))
    ra = engine.sample(a, ids, mask, num_samples=3, seed=7)
    rb = engine.sample(b, ids, mask, num_samples=3, seed=7)
    assert torch.equal(ra.response_ids, rb.response_ids) and ra.texts == rb.texts
    assert b.generation_config.repetition_penalty == 5.0  # the model's own config is back after sampling
    # the same settings through a plain generate() do change the samples (so the comparison above means something)
    outs = []
    for model in (a, b):
        torch.manual_seed(7)
        kwargs = dict(do_sample=True, temperature=1.0, max_new_tokens=12, pad_token_id=0)
        outs.append(model.generate(input_ids=ids, attention_mask=mask, **kwargs))
    assert not torch.equal(outs[0], outs[1])
    # with an untruncated config, the engine samples from softmax(logits / T): its per-step log-probs say so
    ra = engine.sample(a, ids, mask, seed=7, with_logprobs=True)
    torch.testing.assert_close(ra.sampling_logprobs, ra.logprobs)


def test_a_stop_string_across_the_prompt_boundary_neither_stops_generation_nor_the_mask(byte_tokenizer):
    greedy = GenerationConfig(max_new_tokens=10, do_sample=False)
    ids, mask = _prompts(["tell me about x"])
    for seed in range(20):  # a random model whose greedy response does not repeat its first token's text
        model = build_causal_lm(TINY_LLAMA, seed=seed)
        free = RolloutEngine(byte_tokenizer, greedy).sample(model, ids, mask).response_ids[0].tolist()
        stop = "x" + byte_tokenizer.decode(free[:1])  # the prompt's last character + the first response token's text
        if stop not in byte_tokenizer.decode(free) and len(free) == 10 and 1 not in free:
            break
    assert stop not in byte_tokenizer.decode(free) and len(free) == 10
    # transformers' own stop strings look at the whole sequence and stop after one token
    hf = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=10,
        pad_token_id=0,
        stop_strings=[stop],
        tokenizer=byte_tokenizer,
    )
    assert hf.shape[1] - ids.shape[1] == 1
    config = GenerationConfig(max_new_tokens=10, do_sample=False, stop_strings=[stop])
    rollout = RolloutEngine(byte_tokenizer, config).sample(model, ids, mask)
    assert rollout.response_ids[0].tolist() == free
    assert rollout.response_mask.tolist() == [[1] * 10] and not rollout.ended.any()
    # a stop string inside the response: generation and mask both end on the token that completes it
    inside = byte_tokenizer.decode(free[2:4])
    config = GenerationConfig(max_new_tokens=10, do_sample=False, stop_strings=[inside])
    rollout = RolloutEngine(byte_tokenizer, config).sample(model, ids, mask)
    end = StopRule(byte_tokenizer, [inside]).ends(torch.tensor([free])).item()
    assert rollout.response_ids.shape[1] == end + 1 and rollout.response_ids[0].tolist() == free[: end + 1]
    assert rollout.response_mask.sum().item() == end + 1 and rollout.ended.all()


def test_generation_and_mask_agree_on_sampled_stops(byte_tokenizer):
    model = build_causal_lm(TINY_LLAMA, seed=1)
    ids, mask = _prompts(["ab", "hello world", "q"])
    config = GenerationConfig(max_new_tokens=16, temperature=1.0, stop_strings=["a", "e", "o", "zz"])
    rollout = RolloutEngine(byte_tokenizer, config).sample(model, ids, mask, num_samples=8, seed=3)
    lengths, R = rollout.response_mask.sum(1), rollout.response_ids.shape[1]
    assert rollout.ended.any() and (~rollout.ended).any() or R < 16
    for row, n, ended in zip(rollout.response_ids.tolist(), lengths.tolist(), rollout.ended.tolist()):
        assert all(t == 0 for t in row[n:])  # generation stopped where the mask ends
        text = byte_tokenizer.decode(row[:n])
        assert ended == any(s in text for s in config.stop_strings) or 1 in row[:n]
        assert not any(s in byte_tokenizer.decode(row[: n - 1]) for s in config.stop_strings)


def test_samples_per_prompt_are_grouped_and_scored_with_their_prompt(byte_tokenizer):
    model = build_causal_lm(TINY_LLAMA, seed=0)
    texts = ["first prompt", "2nd", "third one"]
    ids, mask = _prompts(texts)
    engine = RolloutEngine(byte_tokenizer, GenerationConfig(max_new_tokens=6, temperature=1.0))
    rollout = engine.sample(model, ids, mask, num_samples=4, seed=0)
    G = 4
    assert rollout.group.tolist() == [0] * G + [1] * G + [2] * G and rollout.num_samples == G
    for i in range(3):
        rows = slice(i * G, i * G + G)
        assert (rollout.prompt_ids[rows] == ids[i]).all() and (rollout.prompt_mask[rows] == mask[i]).all()
    assert len({tuple(r) for r in rollout.response_ids[:G].tolist()}) > 1  # the samples differ
    assert torch.equal(rollout.input_ids, torch.cat([rollout.prompt_ids, rollout.response_ids], 1))
    assert torch.equal(rollout.attention_mask[:, ids.shape[1] :], rollout.response_mask)

    def source(prompts, responses, metadata):
        return [len(p) + m["bonus"] for p, m in zip(prompts, metadata)]

    metadata = [{"bonus": 0.5}, {"bonus": 1.5}, {"bonus": 2.5}]
    scores, _ = score_rollout(source, texts, metadata, rollout, missing_eos_penalty=10.0)
    rows = zip(rollout.group.tolist(), rollout.ended.tolist())
    expected = [len(texts[g]) + metadata[g]["bonus"] - 10.0 * (not e) for g, e in rows]
    assert scores.tolist() == pytest.approx(expected)
    with pytest.raises(RewardError, match="returned 1 scores for 12"):
        score_rollout(lambda p, r, m: [1.0], texts, metadata, rollout)


def test_truncated_sampling_warns_once(monkeypatch, byte_tokenizer):
    monkeypatch.setattr(rollout_module, "_TRUNCATION_WARNED", set())
    with pytest.warns(UserWarning, match="untruncated softmax"):
        RolloutEngine(byte_tokenizer, GenerationConfig(top_p=0.9))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RolloutEngine(byte_tokenizer, GenerationConfig(top_p=0.9))  # once per setting
        RolloutEngine(byte_tokenizer, GenerationConfig())  # top_p defaults to 1.0: no truncation, no warning
    with pytest.raises(ValueError, match="temperature"):
        RolloutEngine(byte_tokenizer, GenerationConfig(temperature=0.0))


def test_pipeline_sampling_logprobs_are_of_the_truncated_distribution(tiny_config, byte_tokenizer):
    from aitraining_pl.compat.forward_backward import ForwardBackwardPipeline, filter_logits

    model = build_causal_lm(tiny_config, seed=0)
    prompt = byte_tokenizer("Once upon", add_special_tokens=False)["input_ids"]
    with ForwardBackwardPipeline(model, device="cpu") as pipe:
        out = pipe.sample(prompt, max_tokens=10, temperature=0.7, top_k=20, top_p=0.8, seed=1)
    tokens = torch.tensor(out["tokens"])
    logits = model(torch.tensor([prompt + out["tokens"]])).logits[0, len(prompt) - 1 : -1].detach()
    expected = torch.log_softmax(filter_logits(logits / 0.7, top_k=20, top_p=0.8), -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out["sampling_logprobs"]), expected, atol=1e-4, rtol=0)
    assert (expected > torch.log_softmax(logits / 0.7, -1).gather(1, tokens[:, None])[:, 0]).all()


def test_the_three_samplers_call_the_engine(monkeypatch, tiny_config, byte_tokenizer):
    from aitraining_pl.compat.forward_backward import ForwardBackwardPipeline
    from aitraining_pl.environments import TextGenerationEnv
    from aitraining_pl.generation.hf import backend as backend_module
    from aitraining_pl.modules.ppo import PPOModule

    calls = []
    real = backend_module.sample_responses

    def spy(*args, **kwargs):
        calls.append(args[1].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(backend_module, "sample_responses", spy)
    model = build_causal_lm(tiny_config, seed=0)
    with ForwardBackwardPipeline(model, device="cpu") as pipe:
        pipe.sample([70, 71], max_tokens=3)
    TextGenerationEnv(byte_tokenizer, ["hi"], max_length=6).rollout(model)
    module = PPOModule(
        reward=TOY_REWARD, model_config=TINY_LLAMA, tokenizer_name="byte", generation=GenerationConfig(max_new_tokens=3)
    )
    ids, mask = _prompts(["a", "bc"])
    module.generate(ids, mask, num_samples=2)
    assert calls == [1, 1, 2]  # the distinct prompts (each is decoded once for its samples)


def test_a_rollout_batch_is_made_from_a_rollout_by_one_function():
    """``RolloutBatch.from_rollout``: the rollout's rows, masks and what the sampler knew, with the scores given;
    keywords set the other fields or replace the copied ones."""
    from aitraining_pl.rollout import Rollout, RolloutBatch

    ids, mask = torch.tensor([[0, 5], [6, 7]]), torch.tensor([[0, 1], [1, 1]])
    response, response_mask = torch.tensor([[8, 2], [9, 0]]), torch.tensor([[1, 1], [1, 0]])
    logps, versions = torch.full((2, 2), -0.5), torch.tensor([[3, 3], [3, -1]])
    group, ended = torch.tensor([0, 0]), torch.tensor([True, False])
    rollout = Rollout(ids, mask, response, response_mask, ended, ["a", "b"], group, None, logps, versions)
    batch = RolloutBatch.from_rollout(rollout, torch.tensor([1.0, 0.0]), {"c": [1.0, None]})
    assert batch.input_ids.tolist() == [[0, 5, 8, 2], [6, 7, 9, 0]] and batch.prompt_length == 2
    assert batch.attention_mask.tolist() == [[0, 1, 1, 1], [1, 1, 1, 0]] and batch.mask is response_mask
    assert batch.texts == ["a", "b"] and batch.ended is ended and batch.group is group
    assert batch.sampling_logprobs is logps and batch.token_versions is versions
    assert batch.components == {"c": [1.0, None]}
    plain = RolloutBatch.from_rollout(rollout, torch.zeros(2), token_versions=None, episode=torch.tensor([0, 1]))
    assert plain.components == {} and plain.token_versions is None and plain.episode.tolist() == [0, 1]
