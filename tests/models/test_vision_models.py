"""Vision-language models on a matrix of tiny random configs (``models.vision_presets``): loading, the frozen
vision tower, LoRA on the language model only, and per-token log-probs with pixel values equal to the model's own
forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from aitraining_pl.models.vision import (
    VisionInputs,
    freeze_vision_tower,
    is_vision_model,
    language_model_lora,
    load_processor,
    load_vision_lm,
    vision_source,
    vision_tower,
)
from aitraining_pl.models.vision_presets import VISION_PRESETS, vision_preset
from aitraining_pl.models.vision_scoring import vision_token_scores

MATRIX = list(VISION_PRESETS)


def _image(seed: int, size=(40, 48)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8))


def _rows(name: str):
    """Two prompts with one image each and responses of different lengths, right padded: the processor's batch
    and the ``VisionInputs`` built one prompt at a time (as the data modules build them)."""
    processor = load_processor(name)
    placeholder = vision_preset(name)[2]
    texts = [placeholder + "colour? red", placeholder + "what? a green square"]
    images = [[_image(0)], [_image(1)]]
    batch = processor(text=texts, images=images, return_tensors="pt", padding=True)
    singles = [processor(text=[t], images=[i], return_tensors="pt") for t, i in zip(texts, images)]
    return batch, VisionInputs.from_processor(singles), processor


@pytest.mark.parametrize("name", MATRIX)
def test_logps_with_pixel_values_equal_the_models_forward(name):
    model = load_vision_lm(model_config={"preset": name}).eval()
    with torch.no_grad():  # Gemma 3 initialises its image projection to zeros: every image would look the same
        for param in model.parameters():
            if param.dim() >= 2 and not param.any():
                param.normal_(0, 0.02)
    assert is_vision_model(model) and vision_source(None, {"preset": name})
    batch, vision, _ = _rows(name)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    scored = mask.clone()
    scored[:, :6] = 0  # the responses: every real token after the first six
    with torch.no_grad():
        logits = model(**batch).logits.float()
        want = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1) * scored[:, 1:]
        got = vision_token_scores(model, ids, mask, scored, vision).logps
        blank = VisionInputs([{k: torch.full_like(v, 0.5) if v.is_floating_point() else v for k, v in p.items()}
                              for p in vision.prompts])  # fmt: skip
        other = vision_token_scores(model, ids, mask, scored, blank).logps
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert (other - want).abs().max() > 1e-4  # the images flow into the log-probs


@pytest.mark.parametrize("name", MATRIX)
def test_vision_tower_frozen_and_lora_on_the_language_model_only(name):
    from aitraining_pl.models import LoRAConfig
    from aitraining_pl.models.lora import apply_lora

    model = load_vision_lm(model_config=name)
    tower = vision_tower(model)
    assert tower is not None and freeze_vision_tower(model) > 0
    assert not any(p.requires_grad for p in tower.parameters())
    peft_model = apply_lora(model, language_model_lora(model, LoRAConfig(r=2)))
    adapted = {n for n, p in peft_model.named_parameters() if "lora_" in n}
    language = "text_model" if "idefics" in name or "smolvlm" in name else "language_model"
    assert adapted and all(f".{language}." in n for n in adapted)


@pytest.mark.parametrize("name", MATRIX)
def test_greedy_decoding_with_images_equals_the_models_forward(name):
    """The KV-cache decoder with images (prefill once per prompt, the cache repeated for 2 samples, left padding)
    draws what greedy decoding by the model's full forward draws (image tokens never drawn)."""
    from aitraining_pl.datamodules.io import pad_sequences
    from aitraining_pl.datamodules.vision import encode_with_images, image_placeholder
    from aitraining_pl.generation.config import GenerationConfig
    from aitraining_pl.generation.hf.vision_decoding import sample_with_images
    from aitraining_pl.models.vision import image_token_ids, model_inputs

    model = load_vision_lm(model_config=name).eval()
    processor = load_processor(name)
    placeholder = image_placeholder(processor)
    encoded = [encode_with_images(processor, placeholder + t, [_image(i)]) for i, t in enumerate(["a?", "colour?"])]
    ids = pad_sequences([e[0] for e in encoded], 0, side="left")
    mask = pad_sequences([[1] * len(e[0]) for e in encoded], 0, side="left")
    generation = GenerationConfig(max_new_tokens=4, do_sample=False)
    drawn = sample_with_images(model, ids, mask, VisionInputs([e[1] for e in encoded]), generation, [], None, 0, 2)
    for b, (prompt, vision) in enumerate(encoded):
        sequence, want = torch.tensor([prompt]), []
        for _ in range(drawn.response_ids.shape[1]):
            kwargs = model_inputs(model, sequence, torch.ones_like(sequence), VisionInputs([vision]))
            with torch.no_grad():
                logits = model(**kwargs).logits[0, -1]
                logits[image_token_ids(model)] = float("-inf")  # never sampled
                token = logits.argmax().view(1, 1)
            want.append(int(token))
            sequence = torch.cat([sequence, token], 1)
        assert drawn.response_ids[2 * b].tolist() == want == drawn.response_ids[2 * b + 1].tolist()
