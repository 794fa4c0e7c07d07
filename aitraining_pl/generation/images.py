"""A vision-language prompt's images for an engine that encodes them itself (vLLM, colocated or served).

The rollout engine's prompt ids are the trainer's: each image placeholder already expanded by the model's processor
into one image token per image feature (``datamodules.vision``), and those are the ids the trainer scores. vLLM 0.32
expands placeholders itself (``BaseMultiModalProcessor._apply_prompt_updates``: Qwen2-VL's ``<|image_pad|>`` becomes
``grid_t * grid_h * grid_w / merge_size**2`` copies, whatever follows it), so it is given each prompt with every run of
the image token collapsed to one (``PromptImages.unexpanded``) and the prompt's images, and it expands them back. The
prompt it expanded must be the trainer's token for token (``check_expanded``; a different image processor setting
would give another count): what is trained on is what was sampled. Image and video tokens are never sampled
(``banned_ids``, as the HF decoder bans them: ``generation.hf.vision_decoding.image_token_ids``).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aitraining_pl.errors import GenerationServerError

#: the logit bias that bans a token (vLLM clamps a bias to [-100, 100]; e**-100 is nothing next to a real logit)
BANNED = -100.0


@dataclass
class PromptImages:
    """The images of a batch of prompts (``images[i]``: prompt ``i``'s RGB PIL images or ``EncodedImage``s, in
    order), the token that stands for one image feature in the expanded prompt ids (``placeholder_id``) and the ids
    never sampled."""

    images: list[list[Any]]
    placeholder_id: int
    banned_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, model: Any, images: Sequence[Sequence[Any]]) -> PromptImages:
        """The images of a VL ``model``'s prompts, with its image token and the tokens it never samples."""
        from aitraining_pl.models.lora import base_model
        from aitraining_pl.models.vision import image_token_ids

        config = base_model(model).config
        token = getattr(config, "image_token_id", None)
        token = getattr(config, "image_token_index", None) if token is None else token
        return cls([list(row) for row in images], int(token), tuple(image_token_ids(model)))

    def part(self, start: int, stop: int) -> PromptImages:
        """The images of prompts ``start .. stop``."""
        return PromptImages(self.images[start:stop], self.placeholder_id, self.banned_ids)

    def unexpanded(self, ids: Sequence[int]) -> list[int]:
        """``ids`` with each run of the image token collapsed to one (the placeholder form vLLM expands)."""
        token = self.placeholder_id
        return [int(t) for i, t in enumerate(ids) if not (t == token and i > 0 and ids[i - 1] == token)]

    def logit_bias(self) -> dict[int, float] | None:
        """vLLM's ``logit_bias`` that bans ``banned_ids`` (None: nothing banned)."""
        return {int(t): BANNED for t in self.banned_ids} or None


def data_url(image: Any) -> str:
    """An image as a ``data:image/png;base64,`` URL (PNG: lossless, the server decodes the same pixels)."""
    from aitraining_pl.datamodules.vision import as_rgb

    buffer = io.BytesIO()
    as_rgb(image).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def check_expanded(expected: Sequence[int], got: Sequence[int] | None, where: str, index: int) -> None:
    """A ``GenerationServerError`` when the engine expanded prompt ``index``'s images into other ids than the
    trainer's (its image processor differs from the trainer's: another resolution, another patch merge)."""
    if got is not None and list(got) != list(expected):
        raise GenerationServerError(
            where,
            f"prompt {index}: the engine expanded its images into {len(got)} prompt tokens, the trainer's processor "
            f"into {len(expected)}; give both the same image processor settings (min/max pixels, patch size)",
        )


def check_outputs(expected: Sequence[Sequence[int]], outputs: Sequence[Any], where: str) -> None:
    """``check_expanded`` on each of one request's vLLM ``RequestOutput``s (``expected``: its prompts' trainer ids;
    a greedy request's prompts come once per sample)."""
    repeat = len(outputs) // max(1, len(expected))
    for i, out in enumerate(outputs):
        check_expanded(expected[i // repeat], out.prompt_token_ids, where, i // repeat)


def input_norm(image_processor: Any) -> tuple[float, list[float], list[float]]:
    """(rescale factor, mean, std) of ``image_processor``, as vLLM reads them from a processor config."""
    rescale = float(getattr(image_processor, "rescale_factor", 1 / 255)) if image_processor.do_rescale else 1.0
    normalize = image_processor.do_normalize
    mean = [float(v) for v in image_processor.image_mean] if normalize else [0.0] * 3
    std = [float(v) for v in image_processor.image_std] if normalize else [1.0] * 3
    return rescale, mean, std


def reset_input_norms(norm: tuple[float, list[float], list[float]], model: Any) -> int:
    """Set the image normalisation vLLM 0.32 folds into the vision tower (``FusedMMInputNorm``: ``weight`` =
    rescale / std, ``bias`` = -mean / std, buffers made from the processor config) from ``norm`` (``input_norm``).
    ``load_format="dummy"`` fills those buffers with random values and no weight load reaches them (they are in no
    checkpoint), so an engine built with dummy weights sets them again (run in vLLM's worker, ``apply_model``).
    Returns how many were set."""
    import torch

    rescale, mean, std = (torch.tensor(v, dtype=torch.float32) for v in norm)
    count = 0
    for module in model.modules():
        if type(module).__name__ == "FusedMMInputNorm":
            module.weight.copy_((rescale / std).to(module.weight))
            module.bias.copy_((-mean / std).to(module.bias))
            count += 1
    return count


def save_processor(tokenizer: Any, folder: Any) -> bool:
    """Write a VL model's image processor and tokenizer into ``folder`` (a vLLM engine's or server's model folder:
    vLLM runs the processor itself); False for a text model's tokenizer (nothing written)."""
    from aitraining_pl.models.vision import processor_of

    processor = processor_of(tokenizer)
    if processor is None:
        return False
    processor.image_processor.save_pretrained(folder)  # the processor's own save needs its (torchvision) video one
    processor.tokenizer.save_pretrained(folder)
    return True


def save_model_files(policy: Any, tokenizer: Any, folder: Any) -> None:
    """A launched server's model folder: the policy's config naming its class (vLLM picks its model by
    ``architectures``; a config built inline has none, and a VL one would be served as a pooling model), its
    tokenizer and, for a VL model, its image processor (``save_processor``); no weights (they are pushed)."""
    import copy

    from aitraining_pl.models.lora import base_model

    model = base_model(policy)
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    save_processor(tokenizer, folder)


def image_from_url(url: str, field: str = "image", max_image_pixels: int | None = None) -> Any:
    """An RGB PIL image from a ``data:image/...;base64,`` URL (a ``ValueError`` naming ``field`` for anything else,
    nothing is fetched; for an unreadable, truncated or bomb image; for one of more than ``max_image_pixels`` pixels
    (default ``datamodules.vision.MAX_IMAGE_PIXELS``), refused from its header before it is decoded)."""
    from aitraining_pl.datamodules.vision import MAX_IMAGE_PIXELS, load_image

    if not str(url).startswith("data:image/"):
        raise ValueError(f"{field}: images must be data:image/...;base64, URLs (nothing is fetched)")
    limit = MAX_IMAGE_PIXELS if max_image_pixels is None else max_image_pixels
    return load_image(str(url), "the request", None, field, limit)


def expand(ids: Sequence[int], token: int, counts: Sequence[int]) -> list[int]:
    """``ids`` with the ``i``-th ``token`` repeated ``counts[i]`` times (``PromptImages.unexpanded``'s inverse); a
    ``ValueError`` when ``ids`` holds another number of ``token`` than of ``counts``."""
    if sum(int(t) == token for t in ids) != len(counts):
        raise ValueError(f"{sum(int(t) == token for t in ids)} image placeholders for {len(counts)} images")
    out, images = [], iter(counts)
    for t in ids:
        out += [int(t)] * next(images) if int(t) == token else [int(t)]
    return out


def generate_body(completion: dict[str, Any], images: PromptImages, index: int) -> dict[str, Any]:
    """The body of vLLM's tokens-in route ``/inference/v1/generate`` (``vllm serve --enable-scale-out``) for the
    ``/v1/completions`` body ``completion`` of prompt ``index`` of ``images``' prompts: its token ids unexpanded,
    its images as PNG data URLs (``content_parts``), the same sampling fields as vLLM ``SamplingParams`` (image
    tokens banned), and the expanded prompt asked back (``return_token_ids``, checked by ``check_expanded``)."""
    skip = ("model", "prompt", "return_tokens_as_token_ids")
    sampling = {k: v for k, v in completion.items() if k not in skip and v is not None}
    sampling.update(logit_bias=images.logit_bias(), detokenize=bool(completion.get("stop")))
    return {
        "model": completion["model"],
        "token_ids": images.unexpanded(completion["prompt"]),
        "content_parts": [{"type": "image_url", "url": data_url(image)} for image in images.images[index]],
        "sampling_params": sampling,
        "return_token_ids": True,
    }


def generate_choices(answer: dict[str, Any]) -> list[tuple[list[int], list[float], None]]:
    """Each choice of a ``/inference/v1/generate`` answer as (token ids, their log-probs, no versions)."""
    rows = []
    for choice in sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0)):
        tokens = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        values = [float(step.get("logprob") or 0.0) for step in content]
        rows.append((tokens, values + [0.0] * (len(tokens) - len(values)), None))
    return rows
