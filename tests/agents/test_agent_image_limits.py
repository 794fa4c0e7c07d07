"""Bounds of a vision-language policy at the agent endpoint (issue 52, items 2, 3 and 5): its context is read from
its ``text_config`` and checked before sampling (a 20 kB message is a 400, not a 200); an image above
``MAX_IMAGE_PIXELS`` is refused from its header; a decompression bomb is a 400 naming its field; a request with more
than ``MAX_IMAGES`` images is a 400 before any image is decoded."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
import torch
from hostile_images import BOMB, HUGE, SVG, data_url, png_claiming, truncated_png

pytest.importorskip("fastapi")

from aitraining_pl.agents import AgentEndpoint  # noqa: E402
from aitraining_pl.datamodules.colours import colour_square  # noqa: E402
from aitraining_pl.datamodules.vision import MAX_IMAGES  # noqa: E402
from aitraining_pl.models.vision import load_processor, load_vision_lm  # noqa: E402
from aitraining_pl.rollout import GenerationConfig, RolloutEngine  # noqa: E402


@pytest.fixture(scope="module")
def served():
    torch.manual_seed(0)
    processor = load_processor("tiny-qwen2-vl")
    model = load_vision_lm(model_config={"preset": "tiny-qwen2-vl"}).eval()
    engine = RolloutEngine(processor.tokenizer, GenerationConfig(max_new_tokens=4, do_sample=False))
    with AgentEndpoint(engine, model) as endpoint:
        yield endpoint


def _square_url() -> str:
    buffer = io.BytesIO()
    colour_square("red", seed=1).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _call(endpoint, content) -> httpx.Response:
    key = endpoint.open_episode()
    body = {"model": "policy", "messages": [{"role": "user", "content": content}]}
    try:
        return httpx.post(endpoint.base_url + "/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    finally:
        endpoint.finish_episode(key)


def _image(url: str) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "colour?"}]


def test_the_context_of_a_vl_policy_is_read_from_its_text_config(served):
    """Before: ``config.max_position_embeddings``, which a VL config keeps in ``text_config``: None, no check."""
    assert served.context_length == 512


def test_a_20_kb_message_to_a_vl_policy_is_a_400_before_sampling(served):
    """Before: a 200 (a 20,000-token prompt for a 512-position model)."""
    answer = _call(served, "x" * 20_000)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "context_length_exceeded"


def test_an_image_call_that_fits_is_answered(served):
    answer = _call(served, _image(_square_url()))
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize(
    ("data", "kind", "says"),
    [
        (png_claiming(*HUGE), "png", "9000x9000 = 81000000 pixels is larger than max_image_pixels"),
        (png_claiming(*BOMB), "png", "DecompressionBombError"),
        (truncated_png(), "png", "unreadable image"),
        (SVG, "svg+xml", "unreadable image"),
    ],
    ids=["81M pixels", "bomb", "truncated", "svg"],
)
def test_a_bad_or_oversized_image_is_a_400_naming_its_field(served, data, kind, says):
    """Before: the 81M-pixel image was decoded (+1 GB) before anything refused it; the bomb's 400 named no field."""
    answer = _call(served, _image(data_url(data, kind)))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "messages[0].content[0]" and says in error["message"], error


def test_more_images_than_max_images_is_a_400_before_any_is_decoded(served):
    """Before: 1000 images in one request were decoded and sampled (a 200, +522 MB)."""
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    answer = _call(served, [part] * (MAX_IMAGES + 1))
    assert answer.status_code == 400, answer.text
    assert f"more than the {MAX_IMAGES}" in answer.json()["error"]["message"]
