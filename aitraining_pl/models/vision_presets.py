"""Tiny vision-language models and processors built offline, for tests and the quickstart recipes.

A preset is a processor (an image processor of the architecture's own class, PIL backend, with small image sizes,
and the byte-level ``ByT5Tokenizer`` with the architecture's image special tokens added) and the inline config of a
random model of that architecture whose vocabulary and image token ids match the processor: ``processor_name:
tiny-qwen2-vl`` and ``model_config: {preset: tiny-qwen2-vl}`` in a recipe. Nothing is downloaded and torchvision
is not needed (the PIL image processors; no video processor).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

#: the text model of every preset: 2 layers, hidden size 32, 2 heads over 1 key/value head
TEXT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 512,
    "head_dim": 16,
}
QWEN_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]


@contextlib.contextmanager
def _no_video_processor() -> Iterator[None]:
    """Let a processor be built with ``video_processor=None`` (transformers checks the class of every argument,
    and the video processors' base class needs torchvision)."""
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: (
        None if arg is None else check(self, name, arg)
    )
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def _byte_tokenizer(tokens: list[str], **attributes: str):
    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer(extra_ids=0)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    for name, value in attributes.items():
        setattr(tokenizer, name, value)
    return tokenizer


def _fast_byte_tokenizer(tokens: list[str]):
    """A fast (Rust ``tokenizers``) byte-level tokenizer: pad 0, EOS 1, unk 2, then the 256 bytes and ``tokens``;
    the processors that map characters to tokens (Idefics3) need a fast one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<unk>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(specials + sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    return tokenizer


#: the characters of the colour task's words (``datamodules.colours``): ``colour? red green blue``
COLOUR_CHARACTERS = "bcdeglnoru ?"


def _char_tokenizer(tokens: list[str], characters: str = COLOUR_CHARACTERS):
    """A fast character-level tokenizer over ``characters`` (pad 0, EOS 1, unk 2, then the characters and
    ``tokens``): with the colour task's 12 characters a vocabulary of 19, where the byte tokenizer has 263, so a
    random policy says a colour's letter one time in five instead of one in ninety."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "</s>", "<unk>", *characters])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    return tokenizer


def _ids(tokenizer, **tokens: str) -> dict[str, int]:
    return {key: tokenizer.convert_tokens_to_ids(token) for key, token in tokens.items()}


def _qwen(model_type: str, processor_class: str, patch: int, vision: dict[str, Any], chars: bool = False):
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = _char_tokenizer(QWEN_TOKENS) if chars else _byte_tokenizer(QWEN_TOKENS)
    side = patch * 4  # a 4 x 4 patch grid, merged 2 x 2: 4 image tokens per image
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=side * side, max_pixels=side * side, patch_size=patch, merge_size=2, temporal_patch_size=2
    )
    with _no_video_processor():
        processor = getattr(transformers, processor_class)(
            image_processor=image_processor, tokenizer=tokenizer, video_processor=None
        )
    ids = _ids(
        tokenizer,
        image_token_id="<|image_pad|>",
        vision_start_token_id="<|vision_start|>",
        video_token_id="<|video_pad|>",
        vision_end_token_id="<|vision_end|>",
    )
    text = {**TEXT, "vocab_size": len(tokenizer), "eos_token_id": 1, "pad_token_id": 0, "bos_token_id": None}
    text["rope_scaling"] = {"rope_type": "default", "mrope_section": [2, 2, 4]}
    if model_type == "qwen3_vl":
        text["rope_scaling"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    config = {"model_type": model_type, "text_config": text, "vision_config": vision, **ids}
    return processor, config, "<|vision_start|><|image_pad|><|vision_end|>"


def _qwen2_vl(chars: bool = False):
    vision = {"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2, "patch_size": 14}
    vision.update(spatial_merge_size=2, temporal_patch_size=2)
    return _qwen("qwen2_vl", "Qwen2VLProcessor", 14, vision, chars)


def _qwen2_5_vl():
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32}
    vision.update(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0])
    return _qwen("qwen2_5_vl", "Qwen2_5_VLProcessor", 14, vision)


def _qwen3_vl():
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32}
    vision.update(patch_size=16, spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0])
    vision["num_position_embeddings"] = 64
    return _qwen("qwen3_vl", "Qwen3VLProcessor", 16, vision)


def _gemma3():
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = _byte_tokenizer(
        ["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
        boi_token="<start_of_image>",
        eoi_token="<end_of_image>",
        image_token="<image_soft_token>",
    )
    tokenizer.boi_token_id, tokenizer.eoi_token_id, tokenizer.image_token_id = (
        tokenizer.convert_tokens_to_ids(t) for t in ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
    )
    image_processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28}, do_pan_and_scan=False)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4)
    text = {**TEXT, "vocab_size": len(tokenizer), "sliding_window": 64, "eos_token_id": 1, "pad_token_id": 0}
    text["bos_token_id"] = None
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    vision.update(image_size=28, patch_size=7)
    ids = _ids(tokenizer, image_token_id="<image_soft_token>", boi_token_id="<start_of_image>")
    ids.update(_ids(tokenizer, eoi_token_id="<end_of_image>"))
    config = {"model_type": "gemma3", "text_config": text, "vision_config": vision, "mm_tokens_per_image": 4, **ids}
    return processor, config, "<start_of_image>"


def _llava():
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = _byte_tokenizer(["<image>"])
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=1,  # CLIP's class token: ``full`` keeps it
    )
    text = {**TEXT, "model_type": "llama", "vocab_size": len(tokenizer), "eos_token_id": 1, "pad_token_id": 0}
    text["bos_token_id"] = None
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    vision.update(num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)
    config = {"model_type": "llava", "text_config": text, "vision_config": vision, "vision_feature_layer": -1}
    config.update(vision_feature_select_strategy="full", **_ids(tokenizer, image_token_id="<image>"))
    return processor, config, "<image>"


def _idefics3(model_type: str = "idefics3"):
    import transformers
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = _fast_byte_tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"])
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": 28}, max_image_size={"longest_edge": 28}
    )
    # SmolVLM's own processor needs ``num2words``; its models read Idefics3's layout
    processor = transformers.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4)
    text = {**TEXT, "model_type": "llama", "vocab_size": len(tokenizer), "eos_token_id": 1, "pad_token_id": 0}
    text["bos_token_id"] = None
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    vision.update(image_size=28, patch_size=7)
    config = {"model_type": model_type, "text_config": text, "vision_config": vision, "scale_factor": 2}
    config.update(_ids(tokenizer, image_token_id="<image>"))
    return processor, config, "<image>"


#: preset name -> builder of (processor, inline model config, the text of one image placeholder in a prompt)
VISION_PRESETS: dict[str, Callable[[], tuple[Any, dict[str, Any], str]]] = {
    "tiny-qwen2-vl": _qwen2_vl,
    "tiny-qwen2-vl-colours": lambda: _qwen2_vl(chars=True),  # the colour task's characters (``_char_tokenizer``)
    "tiny-qwen2.5-vl": _qwen2_5_vl,
    "tiny-qwen3-vl": _qwen3_vl,
    "tiny-gemma3": _gemma3,
    "tiny-llava": _llava,
    "tiny-idefics3": _idefics3,
    "tiny-smolvlm": lambda: _idefics3("smolvlm"),
}


def vision_preset(name: str) -> tuple[Any, dict[str, Any], str]:
    """(processor, inline model config, image placeholder text) of the preset ``name`` (``VISION_PRESETS``)."""
    if name not in VISION_PRESETS:
        raise ValueError(f"unknown vision preset {name!r}; must be one of {', '.join(VISION_PRESETS)}")
    return VISION_PRESETS[name]()
