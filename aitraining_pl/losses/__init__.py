"""The maths of preference optimisation and RL fine-tuning as pure tensor functions.

No Lightning or transformers imports here; each function names the paper it follows.
"""

from aitraining_pl.losses.advantages import (
    ADVANTAGE_ESTIMATORS,
    CRITIC_ESTIMATORS,
    compute_advantages,
    group_statistics,
    whitened_gae,
)
from aitraining_pl.losses.distillation import (
    DistillationOutput,
    DistillationStats,
    distillation_chunk_rows,
    fused_distillation_loss,
    generalized_jsd,
)
from aitraining_pl.losses.fused_head import DEFAULT_MEMORY_BUDGET, HeadLogps, chunk_rows, fused_head_logps
from aitraining_pl.losses.kto import KTOOutput, kto_loss, kto_reference_point
from aitraining_pl.losses.logprobs import (
    SequenceLogps,
    entropy_from_logits,
    explained_variance,
    masked_mean,
    masked_var,
    masked_whiten,
    positions_from_mask,
    selective_log_softmax,
    sequence_logps,
    token_logps,
)
from aitraining_pl.losses.off_policy import (
    IMPORTANCE_SAMPLING_MODES,
    decoupled_policy_loss,
    off_policy_log_ratio,
    off_policy_weights,
    truncated_importance_weights,
)
from aitraining_pl.losses.policy_gradient import LOSS_AGGREGATIONS, clipped_policy_loss
from aitraining_pl.losses.policy_options import (
    IMPORTANCE_SAMPLING_LEVELS,
    POLICY_LOSSES,
    PolicyLossConfig,
    completed_rows,
    high_entropy_mask,
)
from aitraining_pl.losses.preference import (
    DPO_LOSSES,
    LENGTH_NORMALISED,
    REFERENCE_FREE,
    DPOOutput,
    ORPOOutput,
    bradley_terry_loss,
    dpo_loss,
    loss_types,
    needs_reference,
    orpo_loss,
)
from aitraining_pl.losses.reward import (
    POOLING_STRATEGIES,
    masked_objective_mse,
    pool_hidden_states,
)
from aitraining_pl.losses.rl import gae, kl_penalty, place_scores, ppo_value_loss, token_rewards
from aitraining_pl.losses.sft import sft_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CRITIC_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "clipped_policy_loss",
    "IMPORTANCE_SAMPLING_MODES",
    "decoupled_policy_loss",
    "off_policy_log_ratio",
    "off_policy_weights",
    "truncated_importance_weights",
    "IMPORTANCE_SAMPLING_LEVELS",
    "POLICY_LOSSES",
    "PolicyLossConfig",
    "completed_rows",
    "high_entropy_mask",
    "compute_advantages",
    "group_statistics",
    "whitened_gae",
    "DistillationOutput",
    "DistillationStats",
    "distillation_chunk_rows",
    "fused_distillation_loss",
    "generalized_jsd",
    "DEFAULT_MEMORY_BUDGET",
    "HeadLogps",
    "chunk_rows",
    "fused_head_logps",
    "POOLING_STRATEGIES",
    "masked_objective_mse",
    "pool_hidden_states",
    "positions_from_mask",
    "SequenceLogps",
    "entropy_from_logits",
    "explained_variance",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "selective_log_softmax",
    "sequence_logps",
    "token_logps",
    "DPO_LOSSES",
    "LENGTH_NORMALISED",
    "REFERENCE_FREE",
    "DPOOutput",
    "ORPOOutput",
    "bradley_terry_loss",
    "dpo_loss",
    "orpo_loss",
    "loss_types",
    "needs_reference",
    "KTOOutput",
    "kto_loss",
    "kto_reference_point",
    "gae",
    "kl_penalty",
    "ppo_value_loss",
    "place_scores",
    "token_rewards",
    "sft_loss",
]
