"""What the endpoint records of an agent's calls, and how one episode's calls become training sequences.

Every chat-completion call of an episode is a ``CallRecord``: the prompt token ids exactly as the chat template
rendered them, the sampled ids, their log-probs under the distribution sampled from, and the weights version
that sampled them. ``split_sequences`` turns an episode's records (in the order they were made) into sequences:
a call whose prompt extends a sequence (its tokens so far: first prompt, sampled tokens, replies) token for token
continues it, the new tokens between (the environment's / tools' messages) masked out; any other call (the agent
dropped, summarised or reordered messages) starts a new sequence. Only the tokens a call sampled, in the very
context they were sampled in, are ever marked as the model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CallRecord:
    """One sampled choice of one chat-completion call (a call with ``n`` choices gives ``n`` records)."""

    prompt_ids: list[int]  #: the prompt, as rendered and tokenised (BOS first, as the data module does)
    completion_ids: list[int]  #: the sampled tokens, end token included
    logprobs: list[float]  #: log-prob of each sampled token under the distribution sampled from
    ended: bool  #: ended by an end token or stop (False: cut at the call's ``max_tokens``)
    version: Any = None  #: the weights version that sampled it
    messages: list[dict] = field(default_factory=list)  #: the request's messages (normalised)
    assistant: dict = field(default_factory=dict)  #: the assistant message returned (normalised)
    tools_key: str = ""  #: the tools the prompt was rendered with (JSON)
    tool_calls: int = 0  #: tool calls returned to the agent
    #: the prompt's images, in order: each image's vision inputs (``environments.chat``; a VL policy's)
    images: list[dict] = field(default_factory=list)


@dataclass
class TokenSequence:
    """One training sequence of an episode: ``prompt`` then ``tokens``, where ``from_model`` marks the sampled ones
    (their ``logprobs`` set, 0 elsewhere) and ``ends`` indexes each call's last sampled token in ``tokens``."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    from_model: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    ended: bool = True  #: the last call ended by an end token or stop
    images: list[dict] = field(default_factory=list)  #: its images' vision inputs, in order (its last call's)

    @property
    def all_ids(self) -> list[int]:
        """The whole sequence: prompt and everything after it."""
        return self.prompt + self.tokens

    def add(self, record: CallRecord, context: Sequence[int]) -> None:
        """Append ``context`` (tokens not sampled: masked) and then ``record``'s sampled tokens."""
        self.tokens += list(context) + list(record.completion_ids)
        self.from_model += [False] * len(context) + [True] * len(record.completion_ids)
        self.logprobs += [0.0] * len(context) + [float(x) for x in record.logprobs]
        self.ends.append(len(self.tokens) - 1)
        self.ended, self.images = record.ended, list(record.images)


def split_sequences(records: Sequence[CallRecord]) -> list[TokenSequence]:
    """The training sequences of one episode's records, in the order made (see the module docstring). A record
    continues the most recent sequence whose tokens so far are a prefix of its prompt; a sequence is continued at
    most once per state (a second choice of the same call, or a retry, starts a sequence of its own)."""
    sequences: list[TokenSequence] = []
    for record in records:
        prompt = list(record.prompt_ids)
        for sequence in reversed(sequences):
            done = sequence.all_ids
            if len(prompt) >= len(done) and prompt[: len(done)] == done:
                sequence.add(record, prompt[len(done) :])
                break
        else:
            sequence = TokenSequence(prompt)
            sequence.add(record, [])
            sequences.append(sequence)
    return sequences
