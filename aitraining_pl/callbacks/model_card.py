"""A Hugging Face model card (``README.md``) for an export folder.

The card has the hub's YAML header (``library_name``, ``base_model`` when the base has a hub id, ``tags``,
``pipeline_tag``, ``datasets`` when the data came from the hub) and says what was trained and how: the base
model, the data (the data module's source), the algorithm (the module's class), its hyperparameters (the
module's ``hparams``), the final metrics (the trainer's ``callback_metrics`` when the card is written), the
library versions, and how to load the folder with plain ``transformers`` / ``peft``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: module class name -> algorithm tag on the hub.
ALGORITHM_TAGS = {
    "SFTModule": "sft", "DPOModule": "dpo", "PPOModule": "ppo", "GRPOModule": "grpo", "RLOOModule": "rloo",
    "KTOModule": "kto", "ORPOModule": "orpo", "CPOModule": "cpo",
    "RewardModule": "reward-model", "PairwiseRewardModule": "reward-model",
    "MultiObjectiveRewardModule": "reward-model",
}  # fmt: skip
_DATA_KEYS = ("data_path", "name", "data_files", "revision", "split", "val_data_path", "val_split")
_LIBRARIES = ("aitraining_pl", "torch", "transformers", "peft", "lightning", "datasets")


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in _LIBRARIES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def _kind(folder: Path, module) -> str:
    if getattr(getattr(module, "model", None), "value_head", None) is not None:
        return "value"  # PPO: the value head is written beside the policy after the card
    if (folder / "reward_config.json").is_file():
        return "reward"
    return "causal_lm"


def _data_source(trainer) -> dict[str, Any]:
    datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
    hparams = dict(getattr(datamodule, "hparams", {}) or {})
    source = {k: hparams[k] for k in _DATA_KEYS if hparams.get(k) is not None}
    if datamodule is not None and not source:
        source["data_path"] = f"in-memory rows ({type(datamodule).__name__})"
    return source


def _metrics(trainer) -> dict[str, float]:
    metrics = getattr(trainer, "callback_metrics", {}) if trainer is not None else {}
    out = {}
    for key, value in sorted(metrics.items()):
        try:
            out[key] = float(value)
        except (TypeError, ValueError, RuntimeError):
            continue
    return out


def _yaml_list(name: str, items: list[str]) -> list[str]:
    return [f"{name}:"] + [f"- {json.dumps(item)}" for item in items] if items else []


def _usage(kind: str, adapters: bool) -> str:
    if kind == "reward":
        return ("from transformers import AutoModelForSequenceClassification, AutoTokenizer\n"
                "model = AutoModelForSequenceClassification.from_pretrained(path)  # logits[:, 0] is the reward\n"
                "# exact project model, extras included: aitraining_pl.models.load_reward_model(path)")  # fmt: skip
    if adapters:
        text = (
            "from peft import AutoPeftModelForCausalLM\n"
            "model = AutoPeftModelForCausalLM.from_pretrained(path)  # adapter_config.json names the base"
        )
    else:
        text = "from transformers import AutoModelForCausalLM\nmodel = AutoModelForCausalLM.from_pretrained(path)"
    if kind == "value":
        text += "\n# with the value head: aitraining_pl.models.PPOModel.from_pretrained(path)"
    return text


def _reward_notes(folder: Path) -> list[str]:
    """What the standard ``AutoModelForSequenceClassification`` layout of a reward export holds."""
    file = folder / "reward_config.json"
    if not file.is_file():
        return []
    record = json.loads(file.read_text(encoding="utf-8")).get("standard")
    if not record:
        return [
            "**Layout:** the project's own (`trunk.*` / `head.*`); load it with "
            "`aitraining_pl.models.load_reward_model`, not with `AutoModelForSequenceClassification`.",
            "",
        ]
    exact = "exact" if record["exact"] else "; ".join(record["reasons"])
    return [
        f"**Layout:** `{record['architecture']}` with one label, the reward ({exact}; probe difference "
        f"{record['max_abs_difference']:.2g}, score_offset {record['score_offset']:.6g}). "
        "The project's extras (`reward_config.json`, `reward_head.safetensors`) lie beside.",
        "",
    ]


def model_card(folder: str | os.PathLike, module, trainer=None) -> str:
    """The card text for the export in ``folder`` of ``module`` (a ``LightningModule`` with ``hparams``),
    trained by ``trainer`` (default: the module's own, when it has one)."""
    folder = Path(folder)
    if trainer is None:
        trainer = getattr(module, "_trainer", None)
    hparams: Mapping[str, Any] = dict(getattr(module, "hparams", {}) or {})
    algorithm, kind = type(module).__name__, _kind(folder, module)
    base = hparams.get("model_name")
    hub_base = base if base and not Path(str(base)).exists() else None
    if base is None and hparams.get("model_config"):
        base_text = f"inline `{hparams['model_config'].get('model_type')}` config, random initialisation"
        base_text += " (base weights in `base/`)" if (folder / "base").is_dir() else ""
    else:
        base_text = f"`{base}`"
    data = _data_source(trainer)
    hub_data = [str(data["data_path"])] if "data_path" in data and not Path(str(data["data_path"])).exists() else []
    hub_data = [d for d in hub_data if not d.startswith("in-memory")]
    tags = ["aitraining_pl", ALGORITHM_TAGS.get(algorithm, algorithm.removesuffix("Module").lower()), "lightning"]
    tags += ["lora"] if hparams.get("lora") else []
    adapters = (folder / "adapter_config.json").is_file()
    header = ["---", f"library_name: {'peft' if adapters else 'transformers'}"]
    header += [f"base_model: {json.dumps(hub_base)}"] if hub_base else []
    header += _yaml_list("tags", tags) + _yaml_list("datasets", hub_data)
    header += [f"pipeline_tag: {'text-classification' if kind == 'reward' else 'text-generation'}", "---"]
    metrics = _metrics(trainer)
    lines = header + [
        "", f"# {algorithm} export", "",
        f"Trained with `aitraining_pl` (`{algorithm}`, a PyTorch Lightning module).", "", *_reward_notes(folder),
        "## Training", "", f"- **Base model:** {base_text}",
        f"- **Data:** {', '.join(f'{k}=`{v}`' for k, v in data.items()) or 'unknown'}",
        f"- **Algorithm:** `{type(module).__module__}.{algorithm}`",
        f"- **Steps:** {getattr(trainer, 'global_step', 'unknown')}", "",
        "## Hyperparameters", "", "| name | value |", "| --- | --- |",
        *[f"| {k} | `{json.dumps(v, default=str)}` |" for k, v in sorted(hparams.items())], "",
        "## Final metrics", "",
        *(["| metric | value |", "| --- | --- |", *[f"| {k} | {v:.6g} |" for k, v in metrics.items()]]
          if metrics else ["none recorded"]), "",
        "## Usage", "", "```python", _usage(kind, adapters), "```", "",
        "## Library versions", "", *[f"- {k} {v}" for k, v in _versions().items()], "",
    ]  # fmt: skip
    return "\n".join(lines)


def write_model_card(folder: str | os.PathLike, module, trainer=None) -> Path:
    """Write ``model_card(folder, module, trainer)`` to ``<folder>/README.md``; returns its path."""
    path = Path(folder) / "README.md"
    path.write_text(model_card(folder, module, trainer), encoding="utf-8")
    return path
