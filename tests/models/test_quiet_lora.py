"""A LoRA run prints nothing about bitsandbytes' hub kernels (issue 49, fix 8): ``import peft`` imports bitsandbytes,
whose CPU backend, on CPUs with AVX512-BF16, logged that it could not fetch ``kernels-community``'s 4-bit kernel.
(On a CPU without AVX512-BF16 bitsandbytes does not try, and this test shows nothing either way.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = (
    "from aitraining_pl.models import LoRAConfig, apply_lora, build_causal_lm\n"
    "apply_lora(build_causal_lm('tiny-llama'), LoRAConfig(r=4))\n"
    "print('built')\n"
)


@pytest.mark.slow
def test_lora_without_quantization_prints_no_kernels_notice():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "built" in proc.stdout, proc.stderr
    assert "kernels-community" not in proc.stderr and "gemm_4bit" not in proc.stderr, proc.stderr
