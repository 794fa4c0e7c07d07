"""Models and loaders: causal LMs and tokenizers, LoRA, the reference policy, value heads."""

from aitraining_pl.models.loading import (
    BYTE_TOKENIZER,
    build_causal_lm,
    hidden_size_of,
    load_backbone,
    load_causal_lm,
    load_tokenizer,
    resolve_dtype,
    with_padding_side,
)
from aitraining_pl.models.lora import LoRAConfig, apply_lora, is_peft_model, link_adapter_base, save_adapter_base
from aitraining_pl.models.policy import load_policy
from aitraining_pl.models.presets import MODEL_PRESETS, resolve_model_config
from aitraining_pl.models.quantization import QuantizationConfig, is_quantized
from aitraining_pl.models.reference import ReferencePolicy
from aitraining_pl.models.reward import (
    MultiObjectiveRewardModel,
    PairwiseRewardModel,
    RewardModel,
    RewardModelConfig,
    load_reward_model,
)
from aitraining_pl.models.value_head import (
    PolicyValueOutput,
    PolicyValueScores,
    PPOModel,
    ValueHead,
    load_value_head,
)

__all__ = [
    "BYTE_TOKENIZER",
    "MODEL_PRESETS",
    "build_causal_lm",
    "hidden_size_of",
    "load_backbone",
    "load_causal_lm",
    "load_tokenizer",
    "resolve_dtype",
    "resolve_model_config",
    "with_padding_side",
    "LoRAConfig",
    "QuantizationConfig",
    "is_quantized",
    "apply_lora",
    "is_peft_model",
    "ReferencePolicy",
    "load_policy",
    "PolicyValueOutput",
    "PolicyValueScores",
    "PPOModel",
    "ValueHead",
    "load_value_head",
    "link_adapter_base",
    "save_adapter_base",
    "RewardModelConfig",
    "RewardModel",
    "PairwiseRewardModel",
    "MultiObjectiveRewardModel",
    "load_reward_model",
]
