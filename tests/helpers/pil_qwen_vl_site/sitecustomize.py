"""Runs in the processes vLLM starts for the VL tests: ``pil_qwen_vl.install()`` (see that module)."""

import pil_qwen_vl

pil_qwen_vl.install()
