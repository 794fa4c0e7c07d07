"""A visual task only an image can solve, for vision-language RL: which colour is the square?

Each generated image shows one square, red, green or blue, at a random place on a black background; the prompt is
``"colour?"`` after the image and the answer is the colour's first letter (``r``, ``g`` or ``b``, one byte-level
token). ``colour_reward`` scores 1 for a response that starts with the right letter, else 0. With ``blank`` images
(all black) nothing tells the colours apart, so no policy beats chance (1/3): a run that learns with the squares and
stays at chance with blank images shows that the images flow into the model. ``ColourSquaresDataModule`` makes the
rows in memory (``configs/quickstart/vlm_grpo.yaml``).
"""

from __future__ import annotations

import random
from typing import Any

from aitraining_pl.datamodules.prompt import PromptDataModule

#: the colours and their RGB values; the answer is the name's first letter
COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}


def colour_square(colour: str | None, size: int = 56, seed: int = 0):
    """A ``size`` x ``size`` RGB image, black, with a square of half its side in ``colour`` at a random place
    (``seed``); all black for ``colour=None``."""
    import numpy as np
    from PIL import Image

    pixels = np.zeros((size, size, 3), dtype=np.uint8)
    if colour is not None:
        rng, side = random.Random(seed), size // 2
        top, left = rng.randrange(size - side + 1), rng.randrange(size - side + 1)
        pixels[top : top + side, left : left + side] = COLOURS[colour]
    return Image.fromarray(pixels)


def colour_rows(n: int, seed: int = 0, blank: bool = False, size: int = 56) -> list[dict[str, Any]]:
    """``n`` rows ``{"prompt", "images", "colour"}``, the colours in turn (balanced), each image with its own square
    (``blank``: every image black)."""
    names = list(COLOURS)
    rows = []
    for i in range(n):
        colour = names[i % len(names)]
        image = colour_square(None if blank else colour, size, seed * 100_003 + i)
        rows.append({"prompt": "colour?", "images": [image], "colour": colour})
    return rows


def colour_reward(prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]:
    """1.0 where the response starts with the first letter of the row's ``colour``, else 0.0."""
    return [float(r.strip()[:1] == m["colour"][0]) for r, m in zip(responses, metadata)]


class ColourSquaresDataModule(PromptDataModule):
    """``PromptDataModule`` over generated colour-square prompts (``colour_rows``): ``num_prompts`` training rows
    and ``num_val_prompts`` held-out ones (another seed).

    Args:
        num_prompts: training prompts.
        num_val_prompts: held-out prompts (0 for none).
        blank: all-black images (the control run: nothing to see).
        tokenizer: the VL model's tokenizer (its processor's; the CLI links it from the model).
        batch_size: prompts per iteration.
        seed: seed of the squares' places and of the prompt order.
    """

    def __init__(
        self,
        num_prompts: int = 48,
        num_val_prompts: int = 24,
        blank: bool = False,
        tokenizer: Any = None,
        batch_size: int = 8,
        seed: int = 0,
    ):
        rows = colour_rows(num_prompts + num_val_prompts, seed, blank)
        super().__init__(
            prompts=[r.pop("prompt") for r in rows],
            metadata=rows,
            metadata_columns=["colour"],
            tokenizer=tokenizer,
            batch_size=batch_size,
            seed=seed,
            val_split=num_val_prompts / (num_prompts + num_val_prompts) if num_val_prompts else 0.0,
            max_prompt_length=64,
        )
