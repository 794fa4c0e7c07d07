"""Peak memory of ``DPOModule`` under QLoRA (4-bit NF4 base, bitsandbytes) against plain LoRA on the same model.

A randomly initialised Llama (``--size``: ``25m`` hidden 512 x 8 layers, ``100m`` hidden 1024 x 8 layers;
vocabulary 8000, so the linear layers QLoRA quantizes hold most weights) is written to a temporary folder once;
each measurement then loads it by ``model_name`` in its own process, as a user would (``quantization`` loads it
quantized layer by layer), with LoRA (r 16, all linear layers) and runs ``--steps`` DPO optimizer steps on
synthetic pairs (batch 4, about 390 byte tokens per sequence). The reference is the base with the adapters off in
both runs. On CPU it reports the peak RSS of the process after loading and after training; on a GPU
(``--device cuda``) also ``torch.cuda.max_memory_allocated``. It also counts the bytes of the policy's weights
(``nn.Module`` parameters and buffers, 4-bit weights as stored).

    python benchmarks/qlora_memory.py --size 25m --steps 2

Prints the command, date and versions, one JSON line per mode, and one ``ratio`` line (QLoRA / LoRA).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import peak_rss_mb, print_header, quiet_trainer, run_child  # noqa: E402

SIZES = {
    "25m": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8},
    "100m": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16},
}


def _rss_mb() -> float:
    return peak_rss_mb()  # not ru_maxrss: a child inherits its parent's over exec (_common.peak_rss_mb)


def child(folder: str, quantized: bool, steps: int, device: str) -> None:
    import torch

    from aitraining_pl.datamodules.preference import PreferenceDataModule
    from aitraining_pl.models import LoRAConfig
    from aitraining_pl.modules.dpo import DPOModule

    compute = "bfloat16" if device == "cuda" else "float32"
    quantization = {"load_in_4bit": True, "quant_type": "nf4", "compute_dtype": compute} if quantized else None
    module = DPOModule(
        model_name=folder,
        tokenizer_name="byte",
        lora=LoRAConfig(r=16, alpha=32, dropout=0.0),
        quantization=quantization,
        learning_rate=1e-4,
        dtype=None if quantized or device == "cpu" else "bfloat16",
    )
    weights = sum(t.numel() * t.element_size() for t in [*module.policy.parameters(), *module.policy.buffers()])
    loaded_rss = _rss_mb()
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    prompts = [" ".join(words[(i + j) % 8] for j in range(40)) for i in range(8 * steps)]
    chosen = [" ".join(words[(i + 2 * j) % 8] for j in range(25)) for i in range(8 * steps)]
    rejected = [" ".join(words[(i + 3 * j) % 8] for j in range(25)) for i in range(8 * steps)]
    data = PreferenceDataModule(
        prompts=prompts, chosen=chosen, rejected=rejected, tokenizer=module.tokenizer, val_split=0.0,
        batch_size=4, max_length=512, max_prompt_length=256,
    )  # fmt: skip
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = quiet_trainer(
        max_steps=steps, accelerator=device, precision="32-true" if device == "cpu" else "bf16-mixed"
    )
    trainer.fit(module, data)
    result = {
        "mode": "qlora" if quantized else "lora",
        "policy_weight_mb": round(weights / 2**20, 1),
        "peak_rss_after_load_mb": round(loaded_rss, 1),
        "peak_rss_mb": round(_rss_mb(), 1),
        "device": device,
    }
    if device == "cuda":
        result["cuda_max_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="25m")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--child", nargs=2, metavar=("FOLDER", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1] == "qlora", args.steps, args.device)
        return
    print_header(args.threads, size=args.size, steps=args.steps, device=args.device)
    from aitraining_pl.models import build_causal_lm

    config = {"model_type": "llama", "vocab_size": 8000, "num_key_value_heads": 4, **SIZES[args.size]}
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        build_causal_lm(config, seed=0).save_pretrained(folder, safe_serialization=True)
        for mode in ("lora", "qlora"):
            command = [sys.executable, __file__, "--child", folder, mode, "--steps", str(args.steps)]
            command += ["--device", args.device]
            results[mode] = run_child(command, args.threads, mode)
            print(json.dumps({"size": args.size, **results[mode]}), flush=True)
    keys = ["policy_weight_mb", "peak_rss_mb"] + (["cuda_max_allocated_mb"] if args.device == "cuda" else [])
    ratio = {k: round(results["qlora"][k] / results["lora"][k], 3) for k in keys}
    print(json.dumps({"ratio": "qlora / lora", **ratio}), flush=True)


if __name__ == "__main__":
    main()
