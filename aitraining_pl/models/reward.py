"""Reward models: a transformer trunk (encoder or decoder) with a linear head on a pooled hidden state.

``RewardModel`` scores a sequence; ``PairwiseRewardModel`` adds the Bradley-Terry comparison of two inputs;
``MultiObjectiveRewardModel`` has one head per objective and a weighted combination. All save to and load
from a Hugging Face folder that a PPO run can name as its reward model: where the trunk allows, a standard
``AutoModelForSequenceClassification`` folder whose one logit is the reward, with ``reward_config.json`` and
``reward_head.safetensors`` beside (``aitraining_pl.models.reward_export`` says which settings are exact), else
the trunk's ``config.json`` and ``trunk.*`` / ``head.*`` weights. Loading reads JSON and safetensors only,
so it never unpickles anything, and it runs no code of the folder's unless the caller passes
``trust_remote_code=True`` (a saved ``trust_remote_code`` is ignored).

Padded batches score as each sequence alone, for encoders and decoders alike: how position ids are given to
the trunk is decided by probing it once (``aitraining_pl.models.trunk_positions``).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aitraining_pl.errors import ConfigError
from aitraining_pl.losses.reward import POOLING_STRATEGIES, pool_hidden_states
from aitraining_pl.models.loading import hidden_size_of, load_backbone, load_tokenizer, resolve_dtype
from aitraining_pl.models.lora import (
    LoRAConfig,
    apply_lora,
    as_lora_config,
    base_model,
    is_peft_model,
    plain_state_dict,
)
from aitraining_pl.models.tokens import ends_turn, with_bos
from aitraining_pl.models.training import eval_mode
from aitraining_pl.models.trunk_positions import POSITION_MODES, choose_position_mode, trunk_hidden
from aitraining_pl.validation import replaced

#: File names inside a saved reward-model folder.
REWARD_CONFIG_FILE = "reward_config.json"
WEIGHTS_FILE = "model.safetensors"
_FORMAT = "aitraining_pl.reward_model"


@dataclass
class RewardModelConfig:
    """What a reward model is made of and how the seed's trainer trains it."""

    model_name: str | None = None
    """Trunk to load: local folder or hub id (``AutoModel``: encoder or decoder)."""
    num_labels: int = 1
    """Outputs of the head; the reward is output 0."""
    pooling_strategy: str = "last"
    """How a sequence becomes one vector: ``last`` (last real token), ``mean`` or ``cls`` (first real token)."""
    dropout_prob: float = 0.1
    """Dropout before the head."""
    temperature: float = 1.0
    """Rewards are divided by this."""
    use_lora: InitVar[bool | None] = None
    """Deprecated (the seed's spelling): ``lora=LoRAConfig(...)``; ``True`` gives the seed's adapters (rank 8, alpha
    16, dropout 0.1, ``all-linear``), which the four fields below change. Accepted with a warning until the next
    release."""
    lora_rank: InitVar[int | None] = None
    """Deprecated: ``lora.r``."""
    lora_alpha: InitVar[int | None] = None
    """Deprecated: ``lora.alpha``."""
    lora_dropout: InitVar[float | None] = None
    """Deprecated: ``lora.dropout``."""
    learning_rate: float = 1e-4
    """Peak learning rate (used by ``RewardModelTrainer``)."""
    warmup_steps: int = 100
    """Linear warmup steps (used by ``RewardModelTrainer``)."""
    gradient_accumulation_steps: int = 1
    """Batches per optimizer step (used by ``RewardModelTrainer``)."""
    model_config: dict | None = None
    """Instead of ``model_name``: an inline trunk config (``{"model_type": "llama", ...}``), randomly initialised."""
    tokenizer_name: str | None = None
    """Tokenizer folder / hub id, or ``byte``; defaults to ``model_name``."""
    lora_target_modules: InitVar[str | list | None] = None
    """Deprecated: ``lora.target_modules``."""
    seed: int = 0
    """Seed of the random initialisation (inline trunk and head)."""
    trust_remote_code: bool = False
    """Allow custom modelling code from the hub (off unless set)."""
    dtype: str | None = None
    """Trunk dtype (``bfloat16``, ``float32``, ...); the head always runs in float32."""
    head_bias: bool = True
    """Give the reward head a bias. Without one, decoder reward models export exactly to the standard
    ``<Arch>ForSequenceClassification`` layout (whose ``score`` head has none; see ``reward_export``)."""
    extra: dict = field(default_factory=dict)
    """Model-specific settings (the multi-objective model keeps ``num_objectives`` and its weights here)."""
    lora: LoRAConfig | None = None
    """LoRA adapters on the trunk (``LoRAConfig``, or a dict of its fields), trained instead of all of its weights;
    the head is always trained in full. ``None``: no adapters."""

    def __post_init__(self, use_lora, lora_rank, lora_alpha, lora_dropout, lora_target_modules) -> None:
        old = {"use_lora": use_lora, "lora_rank": lora_rank, "lora_alpha": lora_alpha, "lora_dropout": lora_dropout}
        old["lora_target_modules"] = lora_target_modules
        given = [repr(name) for name, value in old.items() if value is not None]
        self.lora = as_lora_config(self.lora, "RewardModelConfig.lora")
        if given:
            if self.lora is not None:
                raise ConfigError("RewardModelConfig.lora", f"given twice: as 'lora' and as {', '.join(given)}")
            replaced("RewardModelConfig", ", ".join(given), "lora=LoRAConfig(r, alpha, dropout, target_modules)")
            self.lora = seed_lora(**old)

    @classmethod
    def from_saved(cls, values: dict) -> RewardModelConfig:
        """The config of a saved ``reward_config.json``; one written before ``lora`` (with the seed's ``use_lora`` /
        ``lora_*`` fields) is read as it was meant, without a warning (a file is not the user's spelling)."""
        values = dict(values)
        old = {name: values.pop(name) for name in ("use_lora", *SEED_LORA_FIELDS) if name in values}
        return cls(**values, lora=seed_lora(**old)) if old else cls(**values)


def seed_lora(use_lora: bool | None = None, **fields: Any) -> LoRAConfig | None:
    """The ``LoRAConfig`` described by the seed's ``RewardModelConfig`` fields (``use_lora``, ``lora_rank``, ...;
    the seed's default for each one not given), ``None`` without ``use_lora``."""
    if not use_lora:
        return None
    return LoRAConfig(
        **{
            ours: default if fields.get(old) is None else fields[old]
            for old, (ours, default) in SEED_LORA_FIELDS.items()
        }
    )


#: the seed's LoRA fields of ``RewardModelConfig`` -> (``LoRAConfig`` field, the seed's default).
SEED_LORA_FIELDS = {
    "lora_rank": ("r", 8),
    "lora_alpha": ("alpha", 16),
    "lora_dropout": ("dropout", 0.1),
    "lora_target_modules": ("target_modules", "all-linear"),
}


def encode_for_reward(tokenizer, text: str, max_length: int | None = None) -> list[int]:
    """Token ids of one scored sequence, laid out as the preference data module lays out prompt +
    completion: BOS (when the tokenizer adds it itself), the text, then EOS, unless the text ends with the end of an
    assistant turn of the tokenizer's own chat template (``models.tokens.ends_turn``; a conversation, whose turn the
    template closed, as TRL's reward trainer adds no EOS to a conversational row), so ``last`` pooling reads the same
    position at training and at scoring time (``models.tokens.closed_turn`` renders a rollout's turn so). Over
    ``max_length`` the end is kept."""
    ids = with_bos(tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer)
    eos = tokenizer.eos_token_id
    if eos is not None and not ends_turn(tokenizer, ids):
        ids.append(eos)
    return ids[-max_length:] if max_length else ids


class RewardModel(nn.Module):
    """A scalar reward for each sequence: trunk -> pool -> dropout -> linear head -> / temperature.

    Args:
        config: a ``RewardModelConfig`` (or a dict of its fields).
        trunk: an already built trunk to use instead of loading ``config.model_name`` / ``config.model_config``.
    """

    def __init__(self, config: RewardModelConfig | dict, trunk: nn.Module | None = None):
        super().__init__()
        config = RewardModelConfig(**config) if isinstance(config, dict) else config
        if config.pooling_strategy not in POOLING_STRATEGIES:
            raise ValueError(
                f"unknown pooling_strategy {config.pooling_strategy!r}; known: {', '.join(POOLING_STRATEGIES)}"
            )
        if config.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {config.temperature}")
        self.config = config
        if trunk is None:
            trunk = load_backbone(
                config.model_name, config.model_config, dtype=config.dtype,
                trust_remote_code=config.trust_remote_code, seed=config.seed,
            )  # fmt: skip
        base = base_model(trunk)
        accepted = inspect.signature(base.forward).parameters
        self._takes_positions, self._takes_cache = "position_ids" in accepted, "use_cache" in accepted
        lora = config.lora
        self.trunk = (
            apply_lora(trunk, lora, task_type="FEATURE_EXTRACTION") if lora and not is_peft_model(trunk) else trunk
        )
        self.dropout = nn.Dropout(config.dropout_prob)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.head = nn.Linear(hidden_size_of(base), self.num_outputs, config.head_bias)
        self.tokenizer = None  # set by from_pretrained / the trainer; see ``get_tokenizer``
        self._position_mode: str | None = None  # decided by probing the trunk at the first forward

    @property
    def position_mode(self) -> str:
        """How padded batches get positions (``mask``, ``none`` or ``right_align``; see
        ``aitraining_pl.models.trunk_positions``), chosen by one probe of the trunk at first use so that every
        score equals the trunk's own forward on the unpadded sequence, left or right padded."""
        if self._position_mode is None:
            self._position_mode, _ = choose_position_mode(
                self.trunk, takes_positions=self._takes_positions, use_cache=self._takes_cache
            )
        return self._position_mode

    @position_mode.setter
    def position_mode(self, mode: str) -> None:
        if mode not in POSITION_MODES:
            raise ValueError(f"unknown position mode {mode!r}; known: {', '.join(POSITION_MODES)}")
        self._position_mode = mode

    @property
    def num_outputs(self) -> int:
        return self.config.num_labels

    # ----------------------------------------------------------------- forward
    def pooled(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) token ids -> (B, H) pooled last hidden state, in float32. Left or right padding gives the
        trunk's unpadded result (``position_mode``); pooling reads the mask."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = trunk_hidden(self.trunk, input_ids, attention_mask, self.position_mode, use_cache=self._takes_cache)
        return pool_hidden_states(hidden, attention_mask, self.config.pooling_strategy).float()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) token ids -> (B, num_labels) rewards (divided by ``temperature``)."""
        pooled = self.pooled(input_ids, attention_mask)
        return self.head(self.dropout(pooled).to(self.head.weight.dtype)).float() / self.config.temperature

    #: entry points besides ``forward`` that run the model (``models.sharding.shard`` gathers parameters for them)
    fsdp_forward_methods = ("score",)

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) the scalar reward of each sequence (what PPO and Bradley-Terry use)."""
        return self.forward(input_ids, attention_mask)[:, 0]

    def get_tokenizer(self):
        """The tokenizer set on the model, else one loaded from ``tokenizer_name`` / ``model_name``."""
        if self.tokenizer is None:
            name = self.config.tokenizer_name or self.config.model_name
            if name is None:
                raise ValueError("no tokenizer: pass one, or set RewardModelConfig.tokenizer_name (e.g. 'byte')")
            self.tokenizer = load_tokenizer(name, trust_remote_code=self.config.trust_remote_code)
        return self.tokenizer

    @torch.no_grad()
    def predict_rewards(
        self, texts: Sequence[str], tokenizer=None, batch_size: int = 8, max_length: int | None = None
    ) -> list[float]:
        """Rewards of raw texts, in eval mode, ``batch_size`` texts per forward pass. Each text is tokenised
        as in training (``encode_for_reward``: BOS if the tokenizer adds it, the text, EOS unless a chat turn ended).

        Args:
            texts: the sequences to score (prompt and response already joined).
            tokenizer: defaults to the model's own (``get_tokenizer``).
            max_length: keep at most this many tokens (the end of the text); default: the tokenizer's
                ``model_max_length`` when it is a real limit, else none.
        """
        tokenizer = tokenizer if tokenizer is not None else self.get_tokenizer()
        if max_length is None and 0 < getattr(tokenizer, "model_max_length", 0) < 1_000_000:
            max_length = int(tokenizer.model_max_length)
        device = self.head.weight.device
        rewards: list[float] = []
        with eval_mode(self):
            for start in range(0, len(texts), batch_size):
                ids = [encode_for_reward(tokenizer, t, max_length) for t in texts[start : start + batch_size]]
                enc = tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
                rewards += self.score(enc["input_ids"].to(device), enc["attention_mask"].to(device)).tolist()
        return rewards

    # ------------------------------------------------------------ save / load
    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """Plain (non-peft) weights, LoRA adapters merged into the trunk; the live model is left as it was."""
        if not is_peft_model(self.trunk):
            return {k: v.detach() for k, v in self.state_dict().items()}
        trunk = {f"trunk.{k}": v for k, v in plain_state_dict(self.trunk, merged=True).items()}
        rest = {k: v.detach() for k, v in self.state_dict().items() if not k.startswith("trunk.")}
        return {**trunk, **rest}

    def save_pretrained(self, path: str | Path, tokenizer=None, standard: bool = True) -> Path:
        """Write the folder and return it: the tokenizer (``tokenizer`` or the model's own), ``reward_config.json``
        and the weights (LoRA merged). With ``standard`` (default) and a trunk whose
        ``AutoModelForSequenceClassification`` layout can represent the model, ``config.json`` +
        ``model.safetensors`` are that class with the reward as its one logit, and ``reward_head.safetensors``
        holds the rest (``aitraining_pl.models.reward_export``); otherwise the trunk's ``config.json`` and
        one ``model.safetensors`` with ``trunk.*`` / ``head.*`` keys (the project's own format)."""
        from safetensors.torch import save_file

        from aitraining_pl.models.reward_export import save_standard

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        if tokenizer is None and (self.config.tokenizer_name or self.config.model_name):
            tokenizer = self.get_tokenizer()
        state = {k: v.contiguous().cpu() for k, v in self.merged_state_dict().items()}
        record = save_standard(self, path, state, tokenizer) if standard else None
        if record is None:
            base = base_model(self.trunk)
            base.config.save_pretrained(path)
            save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
        meta = {
            "format": _FORMAT, "version": 2, "class": self.saved_class().__name__,
            "config": dataclasses.asdict(self.config),
            "weights": "sequence_classification" if record else "project", "standard": record,
        }  # fmt: skip
        (path / REWARD_CONFIG_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
        return path

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str | torch.device | None = None, trust_remote_code: bool = False
    ) -> RewardModel:
        """Load a folder written by ``save_pretrained``. Called on ``RewardModel`` it returns whichever class
        was saved (``MultiObjectiveRewardModel``, ...); called on a subclass it insists on that subclass.
        Reads both layouts: the standard one (``reward_config.json`` version 2, ``"weights":
        "sequence_classification"``) and the project's own (version 1 folders, or trunks without a standard layout).

        Reads JSON and safetensors only. Remote code is allowed only by this call's ``trust_remote_code``:
        the saved ``trust_remote_code`` of ``reward_config.json`` is replaced by it, so a folder cannot ask
        for its own code (nor for a remote-code tokenizer through ``tokenizer_name``) to run."""
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        path = Path(path)
        meta_file = path / REWARD_CONFIG_FILE
        if not meta_file.is_file():
            raise FileNotFoundError(f"{path} is not a reward-model folder: {REWARD_CONFIG_FILE} is missing")
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        if meta.get("format") != _FORMAT:
            raise ValueError(f"{meta_file}: not a reward-model config (format {meta.get('format')!r})")
        saved_cls = REWARD_MODEL_CLASSES.get(meta["class"])
        if saved_cls is None or not issubclass(saved_cls, cls.saved_class()):
            raise ValueError(f"{path} holds a {meta['class']}, which is not a {cls.__name__}")
        saved_cls = cls if saved_cls is cls.saved_class() else saved_cls  # a subclass of the saved class: itself
        known = {f.name for f in dataclasses.fields(RewardModelConfig)}  # version 1 lacks head_bias: True
        unknown = sorted(set(meta.get("config") or {}) - known - {"use_lora", *SEED_LORA_FIELDS})
        if unknown:
            raise ValueError(f"{meta_file}: unknown reward-model config fields {unknown}")
        config = RewardModelConfig.from_saved({**meta["config"], "trust_remote_code": trust_remote_code})
        trunk_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        trunk = AutoModel.from_config(trunk_config, trust_remote_code=trust_remote_code)
        model = saved_cls._from_config(config, trunk)
        if meta.get("weights") == "sequence_classification":  # the standard layout (version 2)
            from aitraining_pl.models.reward_export import read_standard_state

            state = read_standard_state(path, meta["standard"])
        else:
            state = load_file(str(path / WEIGHTS_FILE))
        model.load_merged_state_dict(state)
        if resolve_dtype(config.dtype) is not None:  # the trunk as it was trained; the head stays float32
            model.trunk.to(resolve_dtype(config.dtype))
        if any(path.glob("tokenizer*")) or (path / "special_tokens_map.json").exists():
            model.tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        return model.to(device) if device is not None else model

    @classmethod
    def _from_config(cls, config: RewardModelConfig, trunk: nn.Module) -> RewardModel:
        return cls(config, trunk=trunk)

    @classmethod
    def saved_class(cls) -> type[RewardModel]:
        """The class a folder records (``REWARD_MODEL_CLASSES``): ``cls``, or the one it extends (the seed's API in
        ``aitraining_pl.compat`` adds methods to these classes, and saves and loads the same folders)."""
        return next(c for c in cls.__mro__ if REWARD_MODEL_CLASSES.get(c.__name__) is c)

    def load_merged_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load plain weights (as ``merged_state_dict`` gives) into this model, LoRA-wrapped or not. The
        adapters' up-projections (``lora_B``) are zeroed, since the loaded weights already hold whatever the
        adapters had learnt, so the rewards equal the saved model's."""
        base = base_model(self.trunk)
        if is_peft_model(self.trunk):
            with torch.no_grad():
                for name, param in self.trunk.named_parameters():
                    if "lora_B" in name or "lora_embedding_B" in name:
                        param.zero_()
            peft_keys = {k.replace(".base_layer.", "."): k for k in base.state_dict() if "lora_" not in k}
            trunk_state = {peft_keys.get(k[6:], k[6:]): v for k, v in state.items() if k.startswith("trunk.")}
            missing, unexpected = base.load_state_dict(trunk_state, strict=False)
            missing = [k for k in missing if "lora_" not in k]
        else:
            trunk_state = {k[6:]: v for k, v in state.items() if k.startswith("trunk.")}
            missing, unexpected = base.load_state_dict(trunk_state, strict=False)
        rest = {k: v for k, v in state.items() if not k.startswith("trunk.")}
        rest_missing, rest_unexpected = nn.Module.load_state_dict(self, rest, strict=False)
        missing += [k for k in rest_missing if not k.startswith("trunk.")]
        unexpected += list(rest_unexpected)
        if missing or unexpected:
            raise ValueError(f"reward-model weights do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")


class PairwiseRewardModel(RewardModel):
    """A reward model used through direct comparisons (Bradley & Terry 1952): P(A > B) = s(r_A - r_B);
    ``PairwiseRewardModule`` trains it and logs that probability. The seed's ``forward_pair`` and
    ``compute_bradley_terry_loss`` are in ``aitraining_pl.compat.PairwiseRewardModel``."""


class MultiObjectiveRewardModel(RewardModel):
    """One reward head per objective (helpfulness, safety, ...) on a shared trunk, combined by fixed weights
    (``MultiObjectiveRewardModule`` trains it; the seed's ``compute_multi_objective_loss`` is in
    ``aitraining_pl.compat.MultiObjectiveRewardModel``).

    Args:
        config: a ``RewardModelConfig``.
        num_objectives: number of objectives n.
        objective_weights: n weights of the combined reward (default: equal weights summing to 1).
        trunk: an already built trunk (see ``RewardModel``).
    """

    def __init__(
        self,
        config: RewardModelConfig | dict,
        num_objectives: int = 1,
        objective_weights: Sequence[float] | None = None,
        trunk: nn.Module | None = None,
    ):
        config = RewardModelConfig(**config) if isinstance(config, dict) else dataclasses.replace(config)
        weights = list(objective_weights) if objective_weights is not None else [1.0 / num_objectives] * num_objectives
        if num_objectives < 1 or len(weights) != num_objectives:
            raise ValueError(
                f"need num_objectives >= 1 and that many objective_weights, got {num_objectives} and {weights}"
            )
        config.extra = {
            **config.extra,
            "num_objectives": num_objectives,
            "objective_weights": [float(w) for w in weights],
        }
        super().__init__(config, trunk=trunk)
        self.register_buffer("objective_weights", torch.tensor(weights, dtype=torch.float32), persistent=False)

    @property
    def num_outputs(self) -> int:
        return int(self.config.extra["num_objectives"])

    @classmethod
    def _from_config(cls, config: RewardModelConfig, trunk: nn.Module) -> MultiObjectiveRewardModel:
        extra = config.extra
        return cls(config, extra["num_objectives"], extra["objective_weights"], trunk=trunk)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, return_all_objectives: bool = False
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The combined reward (B, 1), or with ``return_all_objectives`` a dict with ``rewards`` (B, n) and
        ``combined_reward`` (B, 1)."""
        rewards = super().forward(input_ids, attention_mask)
        combined = rewards @ self.objective_weights.unsqueeze(-1)
        return {"rewards": rewards, "combined_reward": combined} if return_all_objectives else combined

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) the combined reward."""
        return self.forward(input_ids, attention_mask)[:, 0]


#: Saved class name -> class, the only classes ``from_pretrained`` will build.
REWARD_MODEL_CLASSES: dict[str, type[RewardModel]] = {
    c.__name__: c for c in (RewardModel, PairwiseRewardModel, MultiObjectiveRewardModel)
}


def load_reward_model(
    path: str | Path, device: str | torch.device | None = None, trust_remote_code: bool = False
) -> RewardModel:
    """Any saved reward model (the class is read from ``reward_config.json``), with its tokenizer as
    ``model.tokenizer``; remote code only if ``trust_remote_code`` is passed here (see ``from_pretrained``)."""
    return RewardModel.from_pretrained(path, device=device, trust_remote_code=trust_remote_code)
