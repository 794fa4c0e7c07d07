"""vLLM's Qwen2-VL on a CPU-only machine without torchvision (tests only).

vLLM 0.32's ``qwen2_vl`` imports transformers' torchvision image processor (``image_processing_qwen2_vl``), and
transformers' ``Qwen2VLProcessor`` loads a torchvision video processor. The CPU build of torchvision is on
download.pytorch.org only; PyPI's torchvision 0.28 is the CUDA build, whose ops do not load beside a CPU torch
(``libtorch_cuda.so`` not found, then ``operator torchvision::nms does not exist``). So the vLLM venv has none, and
these tests put transformers' PIL image processor (``Qwen2VLImageProcessorPil``, the one the trainer's processor
uses, so both sides make the same pixels) in the torchvision one's place and give the processor a stand-in video
processor that refuses videos. ``install()`` does it in this process; ``SITE`` (a ``sitecustomize``) in the
processes vLLM starts (its model-inspection subprocess, a ``vllm serve``) when it is on their ``PYTHONPATH``.
A machine with the CPU torchvision (``pip install torchvision --index-url https://download.pytorch.org/whl/cpu``)
needs none of this: ``install()`` does nothing there.
"""

from __future__ import annotations

import os
import sys
import types

#: a folder whose ``sitecustomize`` calls ``install()`` (prepend it to ``PYTHONPATH`` of vLLM's processes)
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pil_qwen_vl_site")
MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


def has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or a CUDA build that fails to load beside a CPU torch
        return False
    return True


class NoVideo:
    """A video processor that is not there (``limit_mm_per_prompt={"video": 0}``)."""

    class valid_kwargs:  # noqa: N801 - vLLM reads ``video_processor.valid_kwargs.__annotations__``
        __annotations__ = {}

    def to_dict(self) -> dict:
        return {}

    def __call__(self, *args, **kwargs):
        raise RuntimeError("no video processor: torchvision is not installed")


def install() -> None:
    """The PIL image processor in place of transformers' torchvision one for Qwen2-VL (no-op with torchvision)."""
    if MODULE in sys.modules or has_torchvision():
        return
    import transformers.models.qwen2_vl as package
    import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl as pil
    from transformers import AutoTokenizer, ProcessorMixin
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

    module = types.ModuleType(MODULE)
    module.__dict__.update({k: v for k, v in pil.__dict__.items() if not k.startswith("__")})
    module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    sys.modules[MODULE] = module
    package.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil

    def arguments(cls, path, processor_dict=None, **kwargs):
        return [pil.Qwen2VLImageProcessorPil.from_pretrained(path), AutoTokenizer.from_pretrained(path), NoVideo()]

    Qwen2VLProcessor._get_arguments_from_pretrained = classmethod(arguments)
    check = ProcessorMixin.check_argument_for_proper_class

    def checked(self, name, value):
        return None if isinstance(value, NoVideo) else check(self, name, value)

    ProcessorMixin.check_argument_for_proper_class = checked
    to_dict = ProcessorMixin.to_dict

    def without_video(self, *args, **kwargs):
        video = self.__dict__.pop("video_processor", None)
        try:
            return to_dict(self, *args, **kwargs)
        finally:
            if video is not None:
                self.__dict__["video_processor"] = video

    ProcessorMixin.to_dict = without_video


def install_everywhere() -> None:
    """``install()`` here and in the processes this one starts (``PYTHONPATH``)."""
    install()
    if not has_torchvision():
        paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if SITE not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([SITE, os.path.dirname(SITE), *filter(None, paths)])
