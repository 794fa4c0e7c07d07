"""The HF server answers prompts with images on vLLM's tokens-in route (``/inference/v1/generate``: token ids with
the placeholders unexpanded, images as PNG data URLs), so ``HTTPReplica`` sends a VL policy's rollouts to it as to a
``vllm serve``: greedy responses equal the HF decoder's, the expanded prompt is the trainer's, and the sampled
tokens' log-probs are the policy's own with the images (issue 39)."""

from __future__ import annotations

import pytest
import torch

from aitraining_pl.datamodules.colours import colour_rows
from aitraining_pl.datamodules.prompt import encode_vision_prompt
from aitraining_pl.generation.config import GenerationConfig, VLLMConfig
from aitraining_pl.generation.images import save_model_files
from aitraining_pl.generation.servers.fleet import Fleet
from aitraining_pl.generation.servers.http import HTTPReplica
from aitraining_pl.generation.servers.start import start
from aitraining_pl.models.tokens import padded
from aitraining_pl.models.vision import VisionInputs, image_token_ids, load_processor, load_vision_lm, model_inputs
from aitraining_pl.models.weights import policy_weights
from aitraining_pl.rollout import RolloutEngine


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = load_vision_lm(model_config="tiny-qwen2-vl", dtype="float32", seed=0).eval()
    processor = load_processor("tiny-qwen2-vl")
    folder = tmp_path_factory.mktemp("hf-vl-server")
    save_model_files(model, processor.tokenizer, folder)
    process = start("hf", folder, options=VLLMConfig(), dtype="float32", threads=1, timeout=120)
    backend = Fleet(
        [HTTPReplica(process.url, process.token)], policy_weights, run="run-vl", connect_timeout=60, token_timeout=0.0
    )
    try:
        backend.sync(model, 1)
        yield model, processor, backend
    finally:
        backend.close()
        process.stop()


def batch(processor):
    rows = colour_rows(2, seed=3) + colour_rows(1, seed=4, blank=True)
    encoded = [encode_vision_prompt(processor, r, "prompt", 64, False, "test", i + 1, None) for i, r in enumerate(rows)]
    ids, mask = padded([e["__input_ids"] for e in encoded], processor.tokenizer.pad_token_id, side="left")
    return ids, mask, VisionInputs([e["__vision"] for e in encoded], images=[e["__images"] for e in encoded])


def test_greedy_rollouts_with_images_equal_the_hf_decoder(served):
    model, processor, backend = served
    ids, mask, vision = batch(processor)
    greedy = GenerationConfig(max_new_tokens=6, do_sample=False)
    hf = RolloutEngine(processor.tokenizer, greedy, end_token_ids=[]).sample(model, ids, mask, 2, vision=vision)
    got = RolloutEngine(processor.tokenizer, greedy, end_token_ids=[], backend=backend).sample(
        model, ids, mask, 2, vision=vision
    )
    assert torch.equal(got.response_ids, hf.response_ids)


def test_sampled_log_probs_are_the_policys_with_the_images(served):
    model, processor, backend = served
    ids, mask, vision = batch(processor)
    sampled = GenerationConfig(max_new_tokens=6, temperature=1.0)
    engine = RolloutEngine(processor.tokenizer, sampled, end_token_ids=[], backend=backend)
    first, again = (engine.sample(model, ids, mask, 3, seed=4, vision=vision) for _ in range(2))
    assert torch.equal(first.response_ids, again.response_ids)
    banned = image_token_ids(model)
    with torch.no_grad():
        rows = vision.for_rows(first.group)
        logits = model(**model_inputs(model, first.input_ids, first.attention_mask, rows)).logits.float()
    logits = logits[:, ids.shape[1] - 1 : -1]
    logits[..., banned] = float("-inf")
    own = torch.log_softmax(logits, -1).gather(-1, first.response_ids[..., None])[..., 0] * first.response_mask
    torch.testing.assert_close(first.sampling_logprobs, own, atol=1e-4, rtol=0)
