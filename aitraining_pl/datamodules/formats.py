"""TRL's dataset formats: how a preference or prompt row becomes prompt and completion *text*.

The rules follow TRL's documented dataset formats (https://huggingface.co/docs/trl/dataset_formats and
``trl.extract_prompt`` / ``trl.maybe_extract_prompt`` / ``trl.apply_chat_template`` in
https://huggingface.co/docs/trl/data_utils); they are reimplemented here, not copied.

Preference rows (``split_preference`` then ``preference_texts``):

========================================  =====================================================================
layout (columns)                          prompt / completion
========================================  =====================================================================
explicit, standard: ``prompt`` str,       used as given (TRL's standard preference type).
``chosen`` / ``rejected`` str
implicit, standard: ``chosen`` /          ``extract_prompt``: the longest common prefix is the prompt, the rest
``rejected`` str, no ``prompt``           the completions; a space ending that prefix moves to the completions
(Anthropic HH strings)                    (``"The sky is"`` + ``" blue."``), as TRL does.
implicit, conversational: ``chosen`` /    ``extract_prompt`` on whole messages: the shared leading messages are
``rejected`` message lists, no prompt     the prompt, the rest the completions (``trl-lib/ultrafeedback_binarized``,
                                          HH-RLHF as conversations).
string ``prompt`` + full conversations    TRL's ``maybe_extract_prompt``: the shared leading messages are the
(``HuggingFaceH4/ultrafeedback_binarized``) prompt, the string column is not used. When the completions share no
                                          message (they hold the assistant turn only), the string prompt becomes
                                          a user message (TRL would lose it).
explicit, conversational: ``prompt``      used as given (Capybara-preferences). When both completions repeat the
messages, ``chosen`` / ``rejected``       prompt messages at their start, the repeat is removed (TRL would
assistant message lists                   render it twice).
mixed: a string beside message lists      the string becomes a user (prompt) or assistant (completion) message.
========================================  =====================================================================

Conversational rows are rendered as in TRL's ``apply_chat_template``: the prompt with the generation prompt
(``add_generation_prompt=True``; ``continue_final_message=True`` when it ends with an assistant message), each
completion as what the whole conversation (prompt + completion, rendered) adds after the prompt. When a
template renders the prompt differently inside the conversation (e.g. a ``<think>`` generation prompt), the
prompt is cut to the characters it shares with both conversations, so prompt + completion is always exactly
the rendered conversation. Tokenisation itself (``preference.encode_pair``) follows TRL's ``tokenize_row``.
"""

from __future__ import annotations

from typing import Any

#: Chat template used for conversational rows when the tokenizer has none (e.g. the byte tokenizer).
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def is_messages(value: Any) -> bool:
    """Whether ``value`` is a non-empty list of message dicts."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def clean_messages(messages: list[dict]) -> list[dict]:
    """Messages without ``None`` values (Arrow gives every message every key seen in the column)."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def as_messages(value: Any, role: str) -> list[dict]:
    """``value`` as a message list: messages cleaned, a string as one message of ``role``, ``None`` as none."""
    if value is None:
        return []
    return clean_messages(value) if is_messages(value) else [{"role": role, "content": value}]


def render(tokenizer: Any, messages: list[dict], *, generation_prompt: bool = False) -> str:
    """``messages`` through the tokenizer's chat template (``FALLBACK_CHAT_TEMPLATE`` when it has none).

    With ``generation_prompt`` a conversation ending in a user (or system / tool) turn gets the assistant header
    and one ending in an assistant turn is left open (``continue_final_message``), as TRL renders prompts."""
    template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
    open_last = generation_prompt and bool(messages) and messages[-1].get("role") == "assistant"
    return tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        chat_template=template,
        add_generation_prompt=generation_prompt and not open_last,
        continue_final_message=open_last,
    )


def template_ends_turns(tokenizer: Any) -> bool:
    """Whether a conversation rendered for ``tokenizer`` ends each turn with the model's own markup: its own chat
    template does (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, Mistral's ``</s>``), so no EOS follows it, as
    TRL 1.x's SFT, DPO and reward trainers append EOS to non-conversational rows only (``add_eos`` in
    ``trl/trainer/sft_trainer.py``, ``dpo_trainer.py``, ``reward_trainer.py``); ``FALLBACK_CHAT_TEMPLATE`` ends
    none, so EOS follows it."""
    return bool(getattr(tokenizer, "chat_template", None))


def common_prefix_length(a: Any, b: Any) -> int:
    """Length of the longest common prefix of two strings or lists."""
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def extract_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """TRL's implicit-prompt rule: ``(prompt, chosen, rejected)`` split at the longest common prefix of two
    strings (characters) or message lists (whole messages), each completion keeping at least one element.
    For strings, a space that ends the prefix before the completions differ moves into the completions."""
    n = max(0, min(common_prefix_length(chosen, rejected), len(chosen) - 1, len(rejected) - 1))
    differ = n < min(len(chosen), len(rejected)) and chosen[n] != rejected[n]
    if isinstance(chosen, str) and differ and n > 0 and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def split_preference(prompt: Any, chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """``(prompt, chosen, rejected)`` after the prompt rules of the module docstring (``prompt`` is ``None``
    for rows without a prompt column). Strings stay strings; message lists are cleaned."""
    conversational = is_messages(chosen) or is_messages(rejected)
    if not conversational:
        return extract_prompt(chosen, rejected) if prompt is None else (prompt, chosen, rejected)
    chosen, rejected = as_messages(chosen, "assistant"), as_messages(rejected, "assistant")
    if is_messages(prompt):
        prompt = clean_messages(prompt)
        n = len(prompt)
        if chosen[:n] == prompt and rejected[:n] == prompt and len(chosen) > n and len(rejected) > n:
            chosen, rejected = chosen[n:], rejected[n:]
        return prompt, chosen, rejected
    shared, chosen_rest, rejected_rest = extract_prompt(chosen, rejected)
    if shared or prompt is None:
        return shared, chosen_rest, rejected_rest
    return as_messages(prompt, "user"), chosen, rejected


def preference_texts(tokenizer: Any, prompt: Any, chosen: Any, rejected: Any) -> tuple[str, str, str]:
    """Prompt, chosen and rejected text of a row already through ``split_preference``: strings as they are,
    conversations through the chat template (module docstring)."""
    if not any(is_messages(v) for v in (prompt, chosen, rejected)):
        return prompt or "", chosen, rejected
    prompt_messages = as_messages(prompt or None, "user")
    head = render(tokenizer, prompt_messages, generation_prompt=True) if prompt_messages else ""
    full_chosen = render(tokenizer, prompt_messages + as_messages(chosen, "assistant"))
    full_rejected = render(tokenizer, prompt_messages + as_messages(rejected, "assistant"))
    n = min(len(head), common_prefix_length(head, full_chosen), common_prefix_length(head, full_rejected))
    return head[:n], full_chosen[n:], full_rejected[n:]


def prompt_text(tokenizer: Any, prompt: Any, use_chat_template: bool = False) -> str:
    """A prompt-only row as text: messages (or, with ``use_chat_template``, a string as a user message) through
    the chat template with the generation prompt (TRL's prompt-only type); other strings as they are."""
    if not (is_messages(prompt) or use_chat_template):
        return prompt
    return render(tokenizer, as_messages(prompt, "user"), generation_prompt=True)
