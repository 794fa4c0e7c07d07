"""The HF server's tokens-in route with hostile images (issue 52, items 2, 3 and 5): a truncated PNG, an SVG, a
decompression bomb, an image above ``MAX_IMAGE_PIXELS`` and more than ``MAX_IMAGES`` images are 400s naming the
content part, and a VL policy's prompt longer than its context (read from its ``text_config``) is a 400 before
sampling; none of them a 500."""

from __future__ import annotations

import httpx
import pytest
from hostile_images import BOMB, HUGE, SVG, data_url, png_claiming, truncated_png

from aitraining_pl.datamodules.colours import colour_square
from aitraining_pl.generation.config import VLLMConfig
from aitraining_pl.generation.images import data_url as png_url
from aitraining_pl.generation.images import save_model_files
from aitraining_pl.generation.servers.start import start
from aitraining_pl.models.vision import load_processor, load_vision_lm


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = load_vision_lm(model_config="tiny-qwen2-vl", dtype="float32", seed=0).eval()
    processor = load_processor("tiny-qwen2-vl")
    folder = tmp_path_factory.mktemp("hf-vl-limits")
    save_model_files(model, processor.tokenizer, folder)
    process = start("hf", folder, options=VLLMConfig(), dtype="float32", threads=1, timeout=120)
    try:
        yield process, model.config.image_token_id
    finally:
        process.stop()


def _generate(server, urls: list[str], tokens: int = 8) -> httpx.Response:
    process, image = server
    body = {
        "model": "m",
        "token_ids": [image] * len(urls) + [5] * tokens,
        "content_parts": [{"type": "image_url", "url": url} for url in urls],
        "sampling_params": {"max_tokens": 4, "temperature": 0},
    }
    headers = {"Authorization": f"Bearer {process.token}"}
    return httpx.post(process.url + "/inference/v1/generate", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(
    ("data", "kind", "says"),
    [
        (truncated_png(), "png", "unreadable image"),
        (SVG, "svg+xml", "unreadable image"),
        (png_claiming(*BOMB), "png", "DecompressionBombError"),
        (png_claiming(*HUGE), "png", "9000x9000 = 81000000 pixels is larger than max_image_pixels"),
    ],
    ids=["truncated", "svg", "bomb", "81M pixels"],
)
def test_a_bad_or_oversized_image_is_a_400_naming_its_part(server, data, kind, says):
    """Before: the truncated PNG, the SVG and the bomb were 500s (only ValueError was caught); the 81M-pixel image
    was decoded (+1,070 MB)."""
    answer = _generate(server, [data_url(data, kind)])
    assert answer.status_code == 400, answer.text
    assert "content_parts[0]" in answer.text and says in answer.text


def test_more_images_than_max_images_is_a_400_before_any_is_decoded(server):
    from aitraining_pl.datamodules.vision import MAX_IMAGES

    answer = _generate(server, ["data:image/png;base64,AAAA"] * (MAX_IMAGES + 1))
    assert answer.status_code == 400 and f"more than the {MAX_IMAGES}" in answer.text, answer.text


def test_a_vl_prompt_longer_than_the_context_in_text_config_is_a_400(server):
    """Before: the context was read from ``config.max_position_embeddings`` (None for a VL config): no check, a 500
    from ``get_rope_index``."""
    answer = _generate(server, [png_url(colour_square("red", seed=1))], tokens=600)
    assert answer.status_code == 400 and "exceed the model's 512 positions" in answer.text, answer.text


@pytest.mark.parametrize("fields", [{"temperature": float("nan")}, {"stop_token_ids": [10**20]}], ids=["nan", "huge"])
def test_bad_sampling_params_on_the_tokens_in_route_are_422_not_500(server, fields):
    """Issue 52, item 9: the tokens-in route builds its request from ``sampling_params`` itself; a NaN or an id of
    10**20 there was a 500 (pydantic's error raised in the handler), now the 422 that ``/v1/completions`` answers."""
    import json

    process, image = server
    body = {"model": "m", "token_ids": [image, 5, 5], "sampling_params": {"max_tokens": 4, **fields},
            "content_parts": [{"type": "image_url", "url": png_url(colour_square("red", seed=1))}]}  # fmt: skip
    headers = {"Authorization": f"Bearer {process.token}", "content-type": "application/json"}
    answer = httpx.post(process.url + "/inference/v1/generate", content=json.dumps(body), headers=headers, timeout=60)
    assert answer.status_code == 422, answer.text
    assert f"sampling_params.{next(iter(fields))}" in answer.json()["error"]
