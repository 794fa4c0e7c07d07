"""Images through the agent endpoint: an ``openai`` client's ``image_url`` part (a data URL) reaches a tiny random
Qwen2-VL as the processor's image tokens and pixel values; the greedy answer equals the HF decoder's on the same
prompt and image; the recorded rollout keeps the images and GRPO trains on it; other URLs, and images for a
text-only policy, get a 400 naming the field."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from conftest import TINY_LLAMA, quiet_trainer

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from aitraining_pl.agents import AgentEndpoint, AgentEnvironment  # noqa: E402
from aitraining_pl.agents.recording import split_sequences  # noqa: E402
from aitraining_pl.datamodules.colours import colour_reward, colour_square  # noqa: E402
from aitraining_pl.datamodules.formats import prompt_text  # noqa: E402
from aitraining_pl.datamodules.prompt import PromptDataModule  # noqa: E402
from aitraining_pl.datamodules.vision import encode_with_images, image_placeholder  # noqa: E402
from aitraining_pl.generation.hf.vision_decoding import sample_with_images  # noqa: E402
from aitraining_pl.models import build_causal_lm, load_tokenizer  # noqa: E402
from aitraining_pl.models.tokens import with_bos  # noqa: E402
from aitraining_pl.models.vision import VisionInputs, load_processor, load_vision_lm, merge_vision  # noqa: E402
from aitraining_pl.rollout import GenerationConfig, RolloutEngine  # noqa: E402

GREEDY = GenerationConfig(max_new_tokens=6, do_sample=False)


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(url: str, text: str = "colour?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def served():
    torch.manual_seed(0)
    processor = load_processor("tiny-qwen2-vl")
    model = load_vision_lm(model_config={"preset": "tiny-qwen2-vl"}).eval()
    with AgentEndpoint(RolloutEngine(processor.tokenizer, GREEDY), model) as endpoint:
        yield endpoint, processor, model


def test_an_image_url_part_is_answered_as_the_hf_decoder_answers_the_prompt_and_image(served):
    endpoint, processor, model = served
    square = colour_square("green", seed=4)
    key = endpoint.open_episode()
    with openai.OpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0) as client:
        reply = client.chat.completions.create(model="policy", messages=image_message(data_url(square)))
    (record,) = endpoint.finish_episode(key)
    # the same prompt through the processor itself: the chat rendered with the placeholder, then expanded
    tokenizer = processor.tokenizer
    text = prompt_text(tokenizer, [{"role": "user", "content": image_placeholder(processor) + "colour?"}], True)
    ids, vision = encode_with_images(processor, text, [square])
    ids = with_bos(ids, tokenizer)
    assert record.prompt_ids == ids and (torch.tensor(ids) == model.config.image_token_id).sum() == 4
    assert torch.equal(record.images[0]["pixel_values"], vision["pixel_values"])  # kept for the trainer
    prompt = torch.tensor([ids])
    want = sample_with_images(model, prompt, torch.ones_like(prompt), VisionInputs([vision]), GREEDY, [1], None, 0)
    want = want.response_ids[0].tolist()
    assert record.completion_ids == want[: len(record.completion_ids)] and record.completion_ids
    assert record.ended == (1 in want) and reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == tokenizer.decode(record.completion_ids, skip_special_tokens=True)


def test_a_call_that_extends_the_last_one_with_another_image_keeps_both_images_in_order(served):
    endpoint, processor, model = served
    first, second = colour_square("red", seed=1), colour_square("blue", seed=2)
    key = endpoint.open_episode()
    with openai.OpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0) as client:
        messages = image_message(data_url(first))
        answer = client.chat.completions.create(model="policy", messages=messages).choices[0].message
        messages += [answer.model_dump(exclude_none=True), *image_message(data_url(second), "and now?")]
        client.chat.completions.create(model="policy", messages=messages)
    one, two = endpoint.finish_episode(key)
    assert two.prompt_ids[: len(one.prompt_ids) + len(one.completion_ids)] == one.prompt_ids + one.completion_ids
    assert len(two.images) == 2 and torch.equal(two.images[0]["pixel_values"], one.images[0]["pixel_values"])
    (sequence,) = split_sequences([one, two])  # one training row, both images in order
    assert len(sequence.images) == 2 and (torch.tensor(sequence.all_ids) == model.config.image_token_id).sum() == 8
    prompt = torch.tensor([two.prompt_ids])
    vision = VisionInputs([merge_vision(two.images)])
    want = sample_with_images(model, prompt, torch.ones_like(prompt), vision, GREEDY, [1], None, 0).response_ids[0]
    assert two.completion_ids == want.tolist()[: len(two.completion_ids)]


def test_calls_with_and_without_images_sampled_together_answer_as_each_alone(served, monkeypatch):
    import threading

    endpoint, _, model = served
    monkeypatch.setattr(endpoint, "batch_window", 2.0)  # both calls in one batch (the sampler waits for both)
    real, batches = endpoint._sample, []

    def sample(settings, prompts, images):
        batches.append([len(i) for i in images])
        return real(settings, prompts, images)

    monkeypatch.setattr(endpoint, "_sample", sample)
    keys = [endpoint.open_episode(), endpoint.open_episode()]
    messages = [image_message(data_url(colour_square("blue", seed=3))), [{"role": "user", "content": "a longer text"}]]

    def call(key, conversation):
        with openai.OpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0) as client:
            client.chat.completions.create(model="policy", messages=conversation)

    threads = [threading.Thread(target=call, args=pair) for pair in zip(keys, messages)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert batches == [[1, 0]]  # one batch: the call with its image and the call without
    for key in keys:
        (record,) = endpoint.finish_episode(key)
        prompt = torch.tensor([record.prompt_ids])
        vision = VisionInputs([merge_vision(record.images)])
        alone = sample_with_images(model, prompt, torch.ones_like(prompt), vision, GREEDY, [1], None, 0)
        assert record.completion_ids == alone.response_ids[0].tolist()[: len(record.completion_ids)]


@pytest.mark.parametrize(
    ("url", "param"),
    [
        ("https://example.com/a.png", "messages[0].content[0].image_url.url"),
        ("file:///tmp/a.png", "messages[0].content[0].image_url.url"),
        ("data:image/png;base64,bm90IGFuIGltYWdl", "messages[0].content[0]"),  # not an image
    ],
)
def test_a_url_that_is_not_an_image_data_url_is_refused_naming_the_field(served, url, param):
    endpoint, *_ = served
    key = endpoint.open_episode()
    with openai.OpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="policy", messages=image_message(url))
    assert refused.value.body["param"] == param and endpoint.finish_episode(key) == []


def test_a_text_only_policy_refuses_an_image_part_naming_the_field():
    tokenizer, model = load_tokenizer("byte", padding_side="left"), build_causal_lm(dict(TINY_LLAMA), seed=0).eval()
    url = data_url(colour_square("red"))
    with AgentEndpoint(RolloutEngine(tokenizer, GREEDY), model) as endpoint:
        key = endpoint.open_episode()
        with openai.OpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as refused:
                history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]
                client.chat.completions.create(model="m", messages=[*history, *image_message(url)])
    assert refused.value.body["param"] == "messages[2].content[0]" and "text-only" in refused.value.body["message"]


def colour_agent(client, prompt, metadata):
    """Shows the policy a square of the row's colour and rewards naming it."""
    url = data_url(colour_square(metadata["colour"], seed=len(metadata["colour"])))
    answer = client.chat.completions.create(model="policy", messages=image_message(url, prompt))
    return colour_reward([prompt], [answer.choices[0].message.content or ""], [metadata])[0]


def test_grpo_trains_on_the_recorded_calls_with_their_images(tmp_path):
    from aitraining_pl.modules.critic_free import GRPOModule

    torch.manual_seed(0)
    env = AgentEnvironment(colour_agent, max_sequences=1)
    module = GRPOModule(
        model_config={"preset": "tiny-qwen2-vl-colours"},
        tokenizer_name="tiny-qwen2-vl-colours",
        reward=env,
        generation={"max_new_tokens": 1, "temperature": 1.0},
        num_generations=4,
        learning_rate=0.01,
        mini_batch_size=16,
        kl_coef=0.0,
    )
    colours = ["red", "green", "blue", "red"]
    data = PromptDataModule(prompts=["colour?"] * 4, metadata=[{"colour": c} for c in colours],
                            metadata_columns=["colour"], tokenizer=module.tokenizer, batch_size=4)  # fmt: skip
    before = {k: v.clone() for k, v in module.policy.model.language_model.state_dict().items()}
    images, scores = [], module.response_scores

    def spied(*args, vision=None, **kwargs):  # the log-prob passes get each row's images
        images.append(None if vision is None else [p["image_grid_thw"].shape[0] for p in vision.rows().prompts])
        return scores(*args, vision=vision, **kwargs)

    module.response_scores = spied
    try:
        quiet_trainer(tmp_path, max_steps=1, limit_val_batches=0).fit(module, data)
    finally:
        env.close()
    after = module.policy.model.language_model.state_dict()
    assert any(not torch.equal(v, after[k]) for k, v in before.items())
    assert module.last_episodes.metrics["calls"] == [1.0] * 16
    assert images and all(counts is not None and set(counts) == {1} for counts in images)  # one image per row
