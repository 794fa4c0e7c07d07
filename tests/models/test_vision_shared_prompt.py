"""Rows with images that share a prompt run it once (``models.vision_scoring.shared_prompt_scores``): the same
log-probs, entropies, hidden states and gradients as every row run whole, on the matrix of tiny VL models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from aitraining_pl.datamodules.io import pad_sequences
from aitraining_pl.models.vision import (
    VisionInputs,
    freeze_vision_tower,
    image_token_ids,
    load_processor,
    load_vision_lm,
)
from aitraining_pl.models.vision_presets import VISION_PRESETS
from aitraining_pl.models.vision_scoring import _scores, shared_prompt_scores, vision_token_scores

MATRIX = list(VISION_PRESETS)


def _image(seed: int, size=(40, 48)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8))


def _model(name: str):
    model = load_vision_lm(model_config=name)
    with torch.no_grad():  # Gemma 3 initialises its image projection to zeros: every image would look the same
        for param in model.parameters():
            if param.dim() >= 2 and not param.any():
                param.normal_(0, 0.02)
    freeze_vision_tower(model)
    return model.train()


def _prompts(name: str, model):
    from aitraining_pl.datamodules.vision import encode_with_images, image_placeholder

    processor = load_processor(name)
    placeholder = image_placeholder(processor)
    encoded = [encode_with_images(processor, placeholder + t, [_image(i)]) for i, t in enumerate(["a?", "colour?"])]
    banned = set(image_token_ids(model))
    vocab = model.config.get_text_config().vocab_size
    text = [i for i in range(3, min(40, vocab)) if i not in banned]
    return [e[0] for e in encoded], VisionInputs([e[1] for e in encoded]), text


def _dpo_rows(name: str, model):
    """Two pairs in DPO's layout: chosen rows then rejected rows, right padded, responses of 3 to 6 tokens."""
    prompts, vision, text = _prompts(name, model)
    responses = [text[:3], text[5:11], text[2:7], text[9:13]]  # chosen 0, chosen 1, rejected 0, rejected 1
    group = torch.tensor([0, 1, 0, 1])
    rows = [prompts[g] + r for g, r in zip(group.tolist(), responses)]
    ids = pad_sequences(rows, 0)
    mask = pad_sequences([[1] * len(r) for r in rows], 0)
    scored = pad_sequences([[0] * len(prompts[g]) + [1] * len(r) for g, r in zip(group.tolist(), responses)], 0)
    return ids, mask, scored, vision.for_rows(group)


def _rollout_rows(name: str, model, samples: int = 3):
    """Two prompts x ``samples`` in a rollout's layout: left-padded prompts, right-padded responses (one empty)."""
    prompts, vision, text = _prompts(name, model)
    width = max(map(len, prompts))
    group = torch.arange(2).repeat_interleave(samples)
    responses = [text[i : i + 1 + 2 * i % 5] for i in range(len(group))]
    responses[-1] = []
    length = max(map(len, responses))
    ids = pad_sequences([[0] * (width - len(prompts[g])) + prompts[g] + r + [0] * (length - len(r))
                         for g, r in zip(group.tolist(), responses)], 0)  # fmt: skip
    mask = pad_sequences([[0] * (width - len(prompts[g])) + [1] * (len(prompts[g]) + len(r)) + [0] * (length - len(r))
                          for g, r in zip(group.tolist(), responses)], 0)  # fmt: skip
    scored = mask.clone()
    scored[:, :width] = 0
    return ids, mask, scored, vision.for_rows(group)


def _grads(model, logps):
    model.zero_grad()
    weights = torch.linspace(0.5, 1.5, logps.numel()).view_as(logps)
    (logps * weights).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout", ["dpo", "rollout"])
@pytest.mark.parametrize("name", MATRIX)
def test_shared_prompt_equals_every_row_run_whole(name, layout):
    model = _model(name)
    ids, mask, scored, vision = (_dpo_rows if layout == "dpo" else _rollout_rows)(name, model)
    want = _scores(model, "head", ids, mask, scored[:, 1:].bool(), vision, 0.7, True, True)
    want_grads = _grads(model, want.logps)
    got = shared_prompt_scores(model, ids, mask, scored, vision, 0.7, True, True, threshold=0)
    if got is None:
        pytest.skip(f"{name}: the shared prompt is not exact for this model (the rows run whole)")
    got_grads = _grads(model, got.logps)
    torch.testing.assert_close(got.logps, want.logps, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.entropy, want.entropy, atol=1e-5, rtol=1e-4)
    assert [t.tolist() for t in got.index] == [t.tolist() for t in want.index]
    torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=1e-4)
    assert got_grads.keys() == want_grads.keys() and got_grads
    for key in want_grads:
        # float rounding only: the rows' gradients into the prompt are summed in another order (threads)
        scale = float(want_grads[key].abs().max())
        torch.testing.assert_close(got_grads[key], want_grads[key], atol=1e-4 * scale + 1e-7, rtol=1e-4, msg=key)
    # through the scoring seam (rows run whole here: the tiny models save too little), the same result
    seam = vision_token_scores(model, ids, mask, scored, vision, 0.7)
    torch.testing.assert_close(seam.logps, want.logps, atol=1e-5, rtol=1e-4)


#: the architectures the shared prompt must be exact for (the others may fall back to whole rows)
EXACT = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-llava"]


@pytest.mark.parametrize("name", EXACT)
def test_shared_prompt_is_taken_where_exact(name):
    model = _model(name)
    ids, mask, scored, vision = _dpo_rows(name, model)
    assert shared_prompt_scores(model, ids, mask, scored, vision, threshold=0) is not None


def test_rows_with_their_own_prompts_run_whole():
    model = _model("tiny-qwen2-vl")
    ids, mask, scored, vision = _dpo_rows("tiny-qwen2-vl", model)
    assert shared_prompt_scores(model, ids[:2], mask[:2], scored[:2], vision.rows(torch.arange(2)), threshold=0) is None


def test_rows_with_an_image_after_the_prompt_run_whole():
    """An episode's later turn with an image: its tokens are not the prompt's, so the rows run whole."""
    model = _model("tiny-qwen2-vl")
    ids, mask, scored, vision = _dpo_rows("tiny-qwen2-vl", model)
    first = int(torch.nonzero(scored[0])[0])
    ids[0, first + 1] = image_token_ids(model)[0]
    assert shared_prompt_scores(model, ids, mask, scored, vision, threshold=0) is None


def test_the_prompt_is_shared_only_where_it_saves_enough():
    """Two pairs of the tiny Qwen2-VL (width 32) save too little prompt work to pay for the second call."""
    from aitraining_pl.models.vision_scoring import SHARING_THRESHOLD

    model = _model("tiny-qwen2-vl")
    ids, mask, scored, vision = _dpo_rows("tiny-qwen2-vl", model)
    assert shared_prompt_scores(model, ids, mask, scored, vision) is None
    width = model.config.get_text_config().hidden_size
    saved = int(scored.int().argmax(1)[2:].sum())  # the rejected rows' prompts, right padded
    assert shared_prompt_scores(model, ids, mask, scored, vision, threshold=saved * width**2) is not None
    assert saved * width**2 < SHARING_THRESHOLD
