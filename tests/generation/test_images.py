"""``generation.images``: the placeholder form vLLM expands, its inverse, the check of vLLM's expansion, and the
rollout engine's one line for images that were not kept (issue 39)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from aitraining_pl.errors import ConfigError, GenerationServerError
from aitraining_pl.generation.config import GenerationConfig
from aitraining_pl.generation.images import PromptImages, check_expanded, data_url, expand, image_from_url
from aitraining_pl.models.vision import VisionInputs
from aitraining_pl.rollout import RolloutEngine

PAD = 9  #: the image token


def test_runs_of_the_image_token_collapse_to_one_and_expand_back():
    images = PromptImages([[None, None]], PAD, (7, 8, 9))
    ids = [1, 7, PAD, PAD, PAD, PAD, 8, 2, 7, PAD, PAD, 8, 3]
    short = images.unexpanded(ids)
    assert short == [1, 7, PAD, 8, 2, 7, PAD, 8, 3]
    assert expand(short, PAD, [4, 2]) == ids
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        expand(short, PAD, [4])
    assert images.logit_bias() == {7: -100.0, 8: -100.0, 9: -100.0}
    assert PromptImages([[None]], PAD).logit_bias() is None


def test_an_expansion_other_than_the_trainers_is_one_line():
    check_expanded([1, PAD, PAD], [1, PAD, PAD], "engine", 0)
    check_expanded([1, PAD, PAD], None, "engine", 0)  # a server that does not say
    with pytest.raises(GenerationServerError, match="prompt 3: the engine expanded its images into 4 prompt tokens"):
        check_expanded([1, PAD, PAD], [1, PAD, PAD, PAD], "engine", 3)


def test_images_travel_as_lossless_data_urls():
    image = Image.new("RGB", (5, 3), (10, 200, 30))
    image.putpixel((2, 1), (1, 2, 3))
    back = image_from_url(data_url(image))
    assert back.size == (5, 3) and list(back.getdata()) == list(image.getdata())
    with pytest.raises(ValueError, match="nothing is fetched"):
        image_from_url("http://example.com/a.png")


class _Served:
    location = "server"

    def sample(self, request):  # pragma: no cover - refused before
        raise AssertionError


def test_images_not_kept_are_refused_on_a_backend_that_encodes_images_itself():
    vision = VisionInputs([{"pixel_values": torch.zeros(4, 3)}])  # pixel values only
    engine = RolloutEngine(None, GenerationConfig(max_new_tokens=2), end_token_ids=[], backend=_Served())
    with pytest.raises(ConfigError, match="images were not kept"):
        engine.sample(torch.nn.Linear(1, 1), torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3), vision=vision)
