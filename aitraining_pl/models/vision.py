"""Vision-language models: loading, the processor in the tokenizer's place, the frozen vision tower, LoRA on the
language model only, and per-token log-probs of responses with pixel values.

A vision-language (VL) model is any ``AutoModelForImageTextToText`` class (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma 3,
Idefics3 / SmolVLM, LLaVA, ...), loaded from a folder, a hub id or an inline config (``models.vision_presets`` names
tiny random ones). Its processor turns a prompt's text and images into token ids, the image placeholders expanded
to the model's image tokens, and the vision inputs (``pixel_values`` and, by architecture, ``image_grid_thw``,
``pixel_attention_mask``, ``image_sizes``); the text tokenizer the rest of the library uses is the processor's own,
which carries the processor (``processor_of``).

``VisionInputs`` holds the vision inputs of a batch of prompts once; rows (the ``G`` samples of a prompt, a
minibatch of them) select their prompts' inputs (``VisionInputs.rows``) without the prompt-level tensors being
copied for every sample up front.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from aitraining_pl.models.lora import LoRAConfig, base_model

log = logging.getLogger(__name__)

#: processor outputs that are per-token like ``input_ids`` (aligned with it, padded with it): the token types
TOKEN_KEYS = ("mm_token_type_ids", "token_type_ids")
#: processor outputs that are neither text nor per-token: the vision inputs, concatenated over images (dim 0)
TEXT_KEYS = ("input_ids", "attention_mask", *TOKEN_KEYS)
#: the attribute of the base model holding the vision encoder, by architecture family
VISION_TOWERS = ("visual", "vision_tower", "vision_model")


def is_vision_model_type(model_type: str | None) -> bool:
    """Whether transformers loads ``model_type`` with ``AutoModelForImageTextToText``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def vision_source(model_name: str | None, model_config: Any, trust_remote_code: bool = False) -> bool:
    """Whether the policy described by ``model_name`` / ``model_config`` is a VL model: an inline config naming a
    vision preset or a VL ``model_type``, or a folder / hub id whose config is one."""
    from aitraining_pl.models.vision_presets import VISION_PRESETS

    if model_config is not None:
        config = {"preset": model_config} if isinstance(model_config, str) else dict(model_config)
        return config.get("preset") in VISION_PRESETS or is_vision_model_type(config.get("model_type"))
    if model_name is None:
        return False
    try:
        from transformers import AutoConfig

        return is_vision_model_type(
            AutoConfig.from_pretrained(model_name, trust_remote_code=trust_remote_code).model_type
        )
    except Exception:  # noqa: BLE001 - unreadable: the causal-LM loader names the folder or id
        return False


def resolve_vision_config(model_config: Any) -> dict[str, Any]:
    """An inline VL config as a plain dict: a vision preset (``"tiny-qwen2-vl"`` or ``{"preset": ..., overrides}``,
    the overrides merged into ``text_config`` / ``vision_config`` when they are dicts) or a full config dict."""
    from aitraining_pl.models.vision_presets import vision_preset

    config = {"preset": model_config} if isinstance(model_config, str) else dict(model_config)
    preset = config.pop("preset", None)
    if preset is None:
        return config
    base = vision_preset(preset)[1]
    for key, value in config.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return base


def load_vision_lm(
    model_name: str | None = None,
    model_config: Any = None,
    *,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    seed: int = 0,
) -> nn.Module:
    """A VL model (``AutoModelForImageTextToText``) from a folder, a hub id or an inline config (random init), as
    ``models.loading.load_causal_lm`` loads causal LMs (the same code path, errors and seeding)."""
    from aitraining_pl.models.loading import _load

    config = resolve_vision_config(model_config) if model_config is not None else None
    args = (model_name, config, dtype, attn_implementation, trust_remote_code, seed)
    return _load("AutoModelForImageTextToText", *args)


def load_processor(name: str, *, trust_remote_code: bool = False):
    """The processor of a VL model from a folder or hub id (``AutoProcessor``, slow image processors: no
    torchvision needed), or a vision preset's (``"tiny-qwen2-vl"``); its tokenizer carries it (``processor_of``)
    and pads with its EOS when it has no pad token."""
    from aitraining_pl.models.loading import from_pretrained
    from aitraining_pl.models.vision_presets import VISION_PRESETS, vision_preset

    if name in VISION_PRESETS:
        processor = vision_preset(name)[0]
    else:
        from transformers import AutoProcessor

        processor = from_pretrained(
            AutoProcessor.from_pretrained, name, "processor", trust_remote_code=trust_remote_code, use_fast=False
        )
    tokenizer = processor.tokenizer
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer._aitraining_processor = processor
    return processor


def processor_of(tokenizer: Any):
    """The processor a VL model's tokenizer belongs to (``load_processor``), or None for a text tokenizer."""
    return getattr(tokenizer, "_aitraining_processor", None)


# ---------------------------------------------------------------------------------------------- the model's parts
def image_token_ids(model: torch.nn.Module) -> list[int]:
    """The ids of the tokens that stand for images and videos in ``model``'s prompts (its config's ``*_token_id``
    and ``*_token_index`` naming an image, a video or a vision span), never sampled: a sampled one would be a
    placeholder without features."""
    config = base_model(model).config
    names = [k for k in vars(config) if k.endswith(("_token_id", "_token_index")) and ("image" in k or "video" in k
             or "vision" in k or k.startswith(("boi", "eoi")))]  # fmt: skip
    vocab = config.get_text_config().vocab_size
    return sorted({int(getattr(config, k)) for k in names if isinstance(getattr(config, k), int)} & set(range(vocab)))


def is_vision_name(name: str | None) -> bool:
    """Whether ``name`` is a vision preset's processor (``"tiny-qwen2-vl"``)."""
    from aitraining_pl.models.vision_presets import VISION_PRESETS

    return name in VISION_PRESETS


def is_vision_model(model: nn.Module | None) -> bool:
    """Whether ``model`` (through a ``peft`` wrapper) is a VL model."""
    if model is None:
        return False
    return is_vision_model_type(getattr(getattr(base_model(model), "config", None), "model_type", None))


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision encoder of a VL model (``visual``, ``vision_tower`` or ``vision_model`` of its base model)."""
    base = getattr(base_model(model), "model", None)
    for name in VISION_TOWERS:
        tower = getattr(base, name, None)
        if isinstance(tower, nn.Module):
            return tower
    return None


def freeze_vision_tower(model: nn.Module) -> int:
    """No gradients for the vision encoder of ``model`` (its projector into the language model still trains);
    returns the number of parameters frozen."""
    tower = vision_tower(model)
    frozen = 0
    for param in tower.parameters() if tower is not None else ():
        frozen += param.numel() if param.requires_grad else 0
        param.requires_grad_(False)
    return frozen


def language_model_lora(model: nn.Module, lora: LoRAConfig) -> LoRAConfig:
    """``lora`` for a VL model: ``all-linear`` becomes every linear layer of the language model (the vision tower
    and projector get no adapters; peft's ``all-linear`` would put them everywhere but the output head)."""
    if lora.target_modules != "all-linear":
        return lora
    base = getattr(base_model(model), "model", None)
    language = base.get_decoder() if hasattr(base, "get_decoder") else None
    prefix = next((f"{name}." for name, module in model.named_modules() if module is language), None)
    if prefix is None:
        raise ValueError(f"cannot find the language model of {type(base_model(model)).__name__} for its LoRA adapters")
    targets = sorted(
        name for name, module in model.named_modules() if isinstance(module, nn.Linear) and name.startswith(prefix)
    )
    from dataclasses import replace

    return replace(lora, target_modules=targets)


# ---------------------------------------------------------------------------------------------- vision inputs
def _cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors))


@dataclass
class VisionInputs:
    """The vision inputs of B prompts, each prompt's once (processor outputs concatenated over its images), and
    which prompt each row answers.

    ``prompts[i]`` maps a processor key (``pixel_values``, ``image_grid_thw``, ...) to prompt ``i``'s tensor;
    ``group`` (N,) is the prompt of each row (every prompt once by default; a rollout's ``Rollout.group``);
    ``images[i]``: prompt ``i``'s images as read (RGB PIL images, or ``datamodules.vision.EncodedImage``s decoded on
    use), for an engine that encodes them itself (vLLM), or None where they were not kept.
    """

    prompts: list[dict[str, torch.Tensor]]
    group: torch.Tensor | None = None
    cache: dict = field(default_factory=dict, repr=False)
    images: list[list[Any]] | None = field(default=None, repr=False)

    @classmethod
    def from_processor(cls, outputs: Sequence[Mapping[str, Any]]) -> VisionInputs:
        """From one processor output per prompt (their text keys dropped)."""
        return cls([{k: torch.as_tensor(v) for k, v in out.items() if k not in TEXT_KEYS} for out in outputs])

    def __len__(self) -> int:
        return len(self.group) if self.group is not None else len(self.prompts)

    def for_rows(self, group: torch.Tensor) -> VisionInputs:
        """The same prompts' inputs for rows answering ``group`` (N,) (no tensor copied)."""
        return VisionInputs(self.prompts, group.cpu(), self.cache, self.images)

    def prompt_of(self, rows: torch.Tensor | None = None) -> list[int]:
        """The prompt of each of ``rows`` (default: every row)."""
        group = self.group if self.group is not None else torch.arange(len(self.prompts))
        return (group if rows is None else group[rows.cpu()]).tolist()

    def rows(self, rows: torch.Tensor | None = None, device: torch.device | str | None = None) -> VisionInputs:
        """The inputs of ``rows`` only (as a ``VisionInputs`` whose rows are those)."""
        group = torch.tensor(self.prompt_of(rows), dtype=torch.long)
        return VisionInputs(self.prompts, group, self.cache, self.images)

    def kwargs(self, device: torch.device | str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The model's keyword arguments for these rows: each row's prompt's tensors, concatenated in row order
        (pixel values in ``dtype``, e.g. the model's); a row without images (``{}``) adds none."""
        picked = [p for p in (self.prompts[i] for i in self.prompt_of()) if p]
        if not picked:
            return {}
        out = {}
        for key in picked[0]:
            value = _cat([p[key] for p in picked]).to(device)
            out[key] = value.to(dtype) if dtype is not None and value.is_floating_point() else value
        return out

    def to_dict(self) -> dict[str, Any]:
        """A plain form (tensors and lists) for a checkpoint."""
        return {"prompts": self.prompts, "group": self.group}


def merge_vision(parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The vision inputs of one sequence whose images came in ``parts`` (processor outputs, each of one or more
    images, in the order of their image tokens), as the processor gives them for one prompt with all those images:
    each key concatenated over the images (dim 0; dim 1 for Idefics3's (1, images, ...) ``pixel_values`` and
    ``pixel_attention_mask``). Parts without images ({}) add nothing."""
    parts = [p for p in parts if p]
    if len(parts) <= 1:
        return dict(parts[0]) if parts else {}
    batched = parts[0].get("pixel_values") is not None and parts[0]["pixel_values"].dim() == 5
    dims = {k: 1 if batched and k in ("pixel_values", "pixel_attention_mask") else 0 for k in parts[0]}
    return {k: torch.cat([p[k] for p in parts], dims[k]) for k in parts[0]}


def token_types(model: nn.Module, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-token type ids a VL model reads beside ``input_ids`` (1 on image tokens): ``mm_token_type_ids``
    (the Qwen VL family's M-RoPE positions) or ``token_type_ids`` (Gemma 3's bidirectional attention on images);
    {} for the others. Derived from the ids, so they follow any padding or concatenation of the rows."""
    config = base_model(model).config
    image = getattr(config, "image_token_id", None)
    if image is None:
        image = getattr(config, "image_token_index", None)
    model_type = config.model_type
    if model_type.startswith("qwen"):
        return {"mm_token_type_ids": (input_ids == image).long()}
    if model_type.startswith("gemma3"):
        return {"token_type_ids": (input_ids == image).long()}
    return {}


def uses_mrope(model: nn.Module) -> bool:
    """Whether the model's positions are multimodal RoPE positions it computes itself (the Qwen VL family)."""
    return "mm_token_type_ids" in token_types(base_model(model), torch.zeros(1, 1, dtype=torch.long))


#: the vision inputs the encoders read (the others, such as ``image_grid_thw``, also place the image tokens)
PIXEL_KEYS = ("pixel_values", "pixel_attention_mask", "image_sizes")


def _images_per_prompt(prompt: dict[str, torch.Tensor]) -> int:
    if not prompt:
        return 0
    if "image_grid_thw" in prompt:
        return int(prompt["image_grid_thw"].shape[0])
    pixels = prompt["pixel_values"]
    return int(pixels.shape[1] if pixels.dim() == 5 else pixels.shape[0])


def encoder_outputs(model: nn.Module, vision: VisionInputs, device, dtype) -> dict[str, Any] | None:
    """The image features of ``vision``'s rows as the model's ``mm_encoder_outputs``, computed once per prompt (and
    kept with ``vision`` for its other rows: the ``G`` samples, every minibatch, the reference), where every
    parameter between the pixels and the language model is frozen (``freeze_vision_tower`` with the projector inside
    the tower, as in the Qwen VL family) and the model takes precomputed features; else None (the rows run their
    pixel values)."""
    import inspect

    from transformers.modeling_outputs import BaseModelOutputWithPooling

    base = getattr(base_model(model), "model", None)
    if base is None or "mm_encoder_outputs" not in inspect.signature(base.forward).parameters:
        return None
    language = base.get_decoder() if hasattr(base, "get_decoder") else None
    text = {id(p) for p in language.parameters()} if language is not None else set()
    if any(p.requires_grad for p in base.parameters() if id(p) not in text):
        return None  # the encoder or its projector trains: features per row, with their gradients
    if getattr(base.config, "vision_config", None) is not None and getattr(
        base.config.vision_config, "deepstack_visual_indexes", None
    ):
        return None  # Qwen3-VL's deepstack features are not split per image
    key = ("features", id(base), dtype, str(device))
    if not any(vision.prompts[i] for i in vision.prompt_of()):
        return None  # these rows have no images
    if key not in vision.cache:
        every = VisionInputs(vision.prompts).kwargs(device, dtype)
        inputs = {k: v for k, v in every.items() if k in PIXEL_KEYS or k == "image_grid_thw"}
        with torch.no_grad():
            pooled = base.get_image_features(**inputs, return_dict=True).pooler_output
        counts = [_images_per_prompt(p) for p in vision.prompts]
        if isinstance(pooled, (tuple, list)):
            starts = [sum(counts[:i]) for i in range(len(counts))]
            vision.cache[key] = [tuple(pooled[s : s + n]) for s, n in zip(starts, counts)]
        else:
            vision.cache[key] = list(torch.split(pooled, counts))
    per_prompt = [vision.cache[key][i] for i in vision.prompt_of()]
    features = tuple(x for p in per_prompt for x in p) if isinstance(per_prompt[0], tuple) else _cat(per_prompt)
    return {"image": BaseModelOutputWithPooling(pooler_output=features)}


def model_inputs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, vision: VisionInputs
) -> dict[str, Any]:
    """Keyword arguments of ``model``'s forward for rows ``input_ids`` with their images: the vision inputs (the
    prompts' image features computed once, ``encoder_outputs``, where the encoder is frozen), the token types and
    the positions (``None`` for M-RoPE models given images, which compute theirs from the mask and the image grids;
    else counted over the real tokens, as ``generate`` counts left-padded rows)."""
    from aitraining_pl.losses import positions_from_mask

    dtype = next(p for p in base_model(model).parameters()).dtype
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, **token_types(model, input_ids)}
    pixels = vision.kwargs(input_ids.device, dtype)
    kwargs.update(pixels)
    encoded = encoder_outputs(model, vision, input_ids.device, dtype) if pixels else None
    if encoded is not None:  # the prompts' features, computed once, for every row
        kwargs = {k: v for k, v in kwargs.items() if k not in PIXEL_KEYS}
        kwargs["mm_encoder_outputs"] = encoded
    if not uses_mrope(model) or not pixels:  # M-RoPE without images: text positions, counted over the real tokens
        kwargs["position_ids"] = positions_from_mask(attention_mask)
    return kwargs
