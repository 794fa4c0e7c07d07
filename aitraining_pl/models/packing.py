"""Padding-free attention for transformers decoders: many sequences packed into one row of tokens.

A batch of padded rows wastes work on padding in every linear layer and in attention. Packing puts the real
tokens of all sequences end to end in one row (``position_ids`` restart per sequence, so rotary embeddings
see each sequence's own positions) and runs attention block by block, so no token attends across sequences
and none is computed for padding. A block may also take its keys from several ranges of the row, which lets a
preference pair hold its prompt once for both completions.

This is the variable-length ("unpadded") attention of FlashAttention (Dao 2023) written with one SDPA call
per block, so it runs on any device SDPA runs on, CPU included. The attention is registered with
transformers' ``AttentionInterface`` and switched on only inside ``packed_attention(config, plan)``; the
model's own implementation is restored afterwards.

Batches are packed by ``pack_batch`` (preference pairs, optionally with each pair's prompt held once) and
``pack_rows`` (any rows: SFT, rollouts); ``packing_pays`` says when packing is worth its per-block calls.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from aitraining_pl.models.shared_prefix import prefix_holders

PACKED_ATTENTION = "aitraining_pl_packed"

#: ((start, end) key ranges of the packed row, number of queries): the queries are the last ``queries``
#: tokens of the concatenated key ranges, attending causally (aligned at the bottom right)
Block = tuple[tuple[tuple[int, int], ...], int]


#: queries per attention call on a CPU: a block of at least twice as many queries runs as that many query chunks
#: (bottom-right causal, each chunk with the keys up to its last query). SDPA's CPU flash kernel tiles keys by 512 and
#: does not skip the masked half of a causal block within a tile, so a 420-token causal block costs as much as a full
#: one; in chunks of about 128 queries the later keys are left out (fwd + bwd, 4 heads of 64, one thread: 7.9 -> 6.9
#: ms at 420 tokens, 11.2 -> 9.0 ms at 512, 3.2 -> 2.9 ms at 256, the same within noise at 128).
CPU_QUERY_CHUNK = 128
#: the longest block run in query chunks: each chunk's causal mask is (chunk x keys) floats, saved for backward, so a
#: block of q queries holds about q * q / 2 of them (16k tokens: 512 MB) where one causal call holds none
CPU_CHUNKED_BLOCK_MAX = 1024


@dataclass
class AttentionPlan:
    """Attention blocks of a packed row, in token order: the blocks' queries, concatenated, are the whole row.

    Args:
        blocks: one ``(key ranges, queries)`` entry per block.
        calls: attention layers that used the plan in the last forward (a model that does not route
            attention through ``AttentionInterface`` leaves it at 0, see ``packed_attention``).
    """

    blocks: list[Block]
    calls: int = field(default=0, compare=False)
    _pieces: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def pieces(self) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
        """The row cut at every range boundary: (piece sizes, per block (key pieces, query pieces)).

        Blocks gather whole pieces of one ``split`` of the row, whose backward is one concatenation, rather
        than slicing the row per block, whose backward writes a row-sized gradient per slice.
        """
        if "pieces" not in self._pieces:
            cuts = sorted(
                {0}
                | {x for ranges, q in self.blocks for a, b in ranges for x in (a, b)}
                | {ranges[-1][1] - q for ranges, q in self.blocks}
            )
            at = {cut: i for i, cut in enumerate(cuts)}
            blocks = [
                (
                    [i for a, b in ranges for i in range(at[a], at[b])],
                    list(range(at[ranges[-1][1] - q], at[ranges[-1][1]])),
                )
                for ranges, q in self.blocks
            ]
            self._pieces["pieces"] = ([b - a for a, b in zip(cuts, cuts[1:])], blocks)
        return self._pieces["pieces"]

    def runs(self, chunk: int | None) -> list[list[tuple[int, int, int]]]:
        """Per block, its attention calls as runs of its queries: ``(first, end, keys)``, queries [first, end) of
        the block attending to its first ``keys`` keys (those up to the run's last query). One run per block, or
        with ``chunk`` a block of ``2 * chunk <= q <= CPU_CHUNKED_BLOCK_MAX`` queries as ``q // chunk`` runs of about
        equal size."""
        key = ("runs", chunk)
        if key not in self._pieces:
            runs = []
            for ranges, q in self.blocks:
                keys, n = sum(b - a for a, b in ranges), q // chunk if chunk and q <= CPU_CHUNKED_BLOCK_MAX else 1
                cuts = [round(i * q / n) for i in range(n + 1)] if n > 1 else [0, q]
                runs.append([(lo, hi, keys - q + hi) for lo, hi in zip(cuts, cuts[1:])])
            self._pieces[key] = runs
        return self._pieces[key]

    def masks(self, chunk: int | None, device: torch.device, dtype: torch.dtype) -> list[list[torch.Tensor | None]]:
        """Per run of ``runs(chunk)``: None where it has as many queries as keys (SDPA's own causal mask), else the
        causal mask aligned at the bottom right (query j sees keys up to keys - queries + j) as additive ``dtype``
        values, built once for every layer of every model that runs the plan."""
        key = ("masks", chunk, str(device), dtype)
        if key not in self._pieces:
            self._pieces[key] = [
                [_mask(hi - lo, keys, device, dtype) for lo, hi, keys in block] for block in self.runs(chunk)
            ]
        return self._pieces[key]

    def varlen(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """The plan as one variable-length attention call: (row position of each packed key, cumulative query
        counts, cumulative key counts, most queries, most keys), the keys of every block end to end."""
        key = ("varlen", str(device))
        if key not in self._pieces:
            keys = [x for ranges, _ in self.blocks for a, b in ranges for x in range(a, b)]
            queries = [q for _, q in self.blocks]
            counts = [sum(b - a for a, b in ranges) for ranges, _ in self.blocks]
            as_int32 = lambda v: torch.tensor([0, *v], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)  # noqa: E731
            index = torch.tensor(keys, dtype=torch.long, device=device)
            self._pieces[key] = (index, as_int32(queries), as_int32(counts), max(queries), max(counts))
        return self._pieces[key]


def _mask(queries: int, keys: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    if queries == keys:
        return None
    seen = torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)


def _plan_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: AttentionPlan,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """(1, heads, tokens, dim): one SDPA call per block (per query run of a long block on a CPU)."""
    chunk = CPU_QUERY_CHUNK if query.device.type == "cpu" else None
    sizes, blocks = plan.pieces()
    qs, ks, vs = (t.split(sizes, dim=2) for t in (query, key, value))
    out = []
    for (key_pieces, query_pieces), runs, masks in zip(
        blocks, plan.runs(chunk), plan.masks(chunk, query.device, query.dtype)
    ):
        q, k, v = (
            _cat([qs[i] for i in query_pieces]),
            _cat([ks[i] for i in key_pieces]),
            _cat([vs[i] for i in key_pieces]),
        )
        for (lo, hi, keys), mask in zip(runs, masks):  # views of the block's tensors: no copies kept for backward
            if len(runs) > 1:
                q_run, k_run, v_run = q[:, :, lo:hi], k[:, :, :keys], v[:, :, :keys]
            else:
                q_run, k_run, v_run = q, k, v
            out.append(F.scaled_dot_product_attention(q_run, k_run, v_run, mask, dropout, mask is None, scale=scaling))
    return torch.cat(out, dim=2)


def _varlen_attn() -> Any:
    """``torch.nn.attention.varlen.varlen_attn`` (FlashAttention's variable-length kernel, CUDA), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _use_varlen(query: torch.Tensor, dropout: float) -> bool:
    """Whether the plan runs as one variable-length call: a half-precision CUDA batch without attention dropout
    (FlashAttention's dtypes; its kernel has no dropout) and a torch that has the kernel."""
    return (
        query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and not dropout and _varlen_attn() is not None
    )


def _varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: AttentionPlan, scaling):
    """(1, tokens, heads, dim): every block in one call, each block's keys gathered end to end; FlashAttention's
    causal mask for fewer queries than keys is aligned at the bottom right, as the plan's blocks are."""
    index, cu_q, cu_k, max_q, max_k = plan.varlen(query.device)
    q = query[0].transpose(0, 1)
    k, v = (t[0].transpose(0, 1).index_select(0, index) for t in (key, value))
    attn = _varlen_attn()
    causal = {"window_size": (-1, 0)} if "window_size" in inspect.signature(attn).parameters else {"is_causal": True}
    return attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scaling, **causal).unsqueeze(0)


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_plan: AttentionPlan | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``(1, heads, tokens, dim)`` inputs, ``(1, tokens, heads, dim)`` output.

    Without a ``packed_plan`` (e.g. a forward outside ``completion_logps``) it is transformers' SDPA.
    """
    if packed_plan is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row, got a batch of {query.shape[0]}")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    packed_plan.calls += 1
    if _use_varlen(query, dropout):
        return _varlen_attention(query, key, value, packed_plan, scaling), None
    out = _plan_attention(query, key, value, packed_plan, dropout, scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)


def supports_packing(config: Any) -> bool:
    """Whether a decoder with this config can run packed: its attention is SDPA or eager (plain softmax
    attention over every earlier token), with no sliding window and no logit soft-capping."""
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "_attn_implementation", None) not in (
        "sdpa",
        "eager",
    ):
        return False
    if getattr(config, "attn_logit_softcapping", None):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(t == "full_attention" for t in layer_types)
    return not (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))


#: (config, attention implementation) switched by the ``packed_attention`` blocks being run (innermost last)
_ACTIVE: list[tuple[Any, str]] = []


@contextmanager
def _switched(switches: list[tuple[Any, str]]) -> Iterator[None]:
    configs = [config for config, _ in switches]
    previous = [config._attn_implementation for config in configs]
    for config, implementation in switches:
        config._attn_implementation = implementation
    try:
        yield
    finally:
        for config, implementation in zip(configs, previous):
            config._attn_implementation = implementation


def checkpoint_contexts() -> tuple[Any, Any]:
    """``context_fn`` of ``torch.utils.checkpoint``: the recomputation in backward (outside the
    ``packed_attention`` block) runs with the attention implementation the checkpointed forward ran with."""
    return nullcontext(), _switched(list(_ACTIVE))


@contextmanager
def packed_attention(
    config: Any, plan: AttentionPlan, implementation: str = PACKED_ATTENTION
) -> Iterator[AttentionPlan]:
    """Switch a model (through its ``config``) to packed attention for the forwards inside the block; pass
    ``packed_plan=plan`` to the decoder. Raises after the block when no attention layer used the plan (a model
    whose attention bypasses ``AttentionInterface`` would otherwise attend across sequences silently).
    ``implementation``: the registered attention function that runs the plan (``models.sequence_parallel``'s
    wraps this one)."""
    plan.calls = 0
    _ACTIVE.append((config, implementation))
    try:
        with _switched([(config, implementation)]):
            yield plan
    finally:
        _ACTIVE.pop()
    if plan.calls == 0:
        raise RuntimeError(
            f"{type(config).__name__}: the model's attention did not use the packed plan; "
            "run it padded (padding_free=False)"
        )


class PackedBatch(NamedTuple):
    """The real tokens of a preference batch in one row (see ``pack_batch``)."""

    input_ids: torch.Tensor  #: (1, N)
    position_ids: torch.Tensor  #: (1, N): positions within each sequence
    plan: AttentionPlan  #: which tokens attend to which
    sources: torch.Tensor  #: (M,) packed position whose output predicts a scored token
    targets: torch.Tensor  #: (M,) the scored token
    sequences: torch.Tensor  #: (M,) row of the batch the scored token belongs to (chosen 0..B-1, rejected B..2B-1)
    columns: torch.Tensor  #: (M,) column of the scored token in its padded row


def prompt_lengths(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(2B,) leading non-completion tokens of each row."""
    return (batch["completion_mask"].cumsum(1) == 0).sum(1)


def pack_batch(batch: dict[str, torch.Tensor], share_prompt: bool = False) -> PackedBatch:
    """Pack the real tokens of a preference batch (2B right-padded rows, chosen first) into one row.

    Each row becomes one causal attention block. With ``share_prompt`` each pair is ``prompt, chosen,
    rejected`` with the prompt held once: the rejected completion attends to the prompt and to itself, its
    positions continue from the prompt, and its first token is predicted from the last prompt position, so
    every token sees exactly what it sees in its own padded row.
    """
    ids = batch["input_ids"]
    lengths, prompts = torch.stack([batch["attention_mask"].sum(1), prompt_lengths(batch)]).tolist()  # one sync
    b = len(lengths) // 2
    rows, cols, positions, blocks, sources, targets, sequences, columns = [], [], [], [], [], [], [], []
    start = 0

    def take(row: int, lo: int, hi: int, first_position: int) -> None:
        rows.extend([row] * (hi - lo))
        cols.extend(range(lo, hi))
        positions.extend(range(first_position, first_position + hi - lo))

    def score(sequence: int, first: int, last: int, first_source: int, column: int) -> None:  # packed [first, last)
        sources.extend([first_source] + list(range(first, last - 1)))
        targets.extend(range(first, last))
        sequences.extend([sequence] * (last - first))
        columns.extend(range(column, column + last - first))

    for i in range(b if share_prompt else 2 * b):
        p = prompts[i]
        if share_prompt:
            c, r = lengths[i] - p, lengths[b + i] - p
            take(i, 0, p + c, 0)
            take(b + i, p, p + r, p)
            blocks += [
                (((start, start + p + c),), p + c),
                (((start, start + p), (start + p + c, start + p + c + r)), r),
            ]
            score(i, start + p, start + p + c, start + p - 1, p)
            score(b + i, start + p + c, start + p + c + r, start + p - 1, p)
            start += p + c + r
        else:
            n = lengths[i]
            take(i, 0, n, 0)
            blocks.append((((start, start + n),), n))
            score(i, start + p, start + n, start + p - 1, p)
            start += n
    device = ids.device
    packed = ids[torch.tensor(rows, device=device), torch.tensor(cols, device=device)].unsqueeze(0)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return PackedBatch(
        packed,
        as_tensor(positions).unsqueeze(0),
        AttentionPlan(blocks),
        as_tensor(sources),
        packed[0, as_tensor(targets)],
        as_tensor(sequences),
        as_tensor(columns),
    )


def is_contiguous(batch: dict[str, torch.Tensor]) -> bool:
    """Whether every row is ``prompt, completion, padding``: real tokens first, the completion mask one run
    that ends at the last real token (the layout ``pack_batch`` assumes)."""
    mask, completion = batch["attention_mask"].bool(), batch["completion_mask"].bool()
    column = torch.arange(mask.shape[1], device=mask.device)
    real = column < mask.sum(1, keepdim=True)
    return torch.equal(mask, real) and torch.equal(completion, real & (column >= prompt_lengths(batch).unsqueeze(1)))


def can_pack(batch: dict[str, torch.Tensor], share_prompt: bool = False) -> bool:
    """Whether every row is contiguous (``is_contiguous``) with a non-empty prompt (its first completion token
    is predicted from it) and, for ``share_prompt``, each pair's chosen and rejected rows the same prompt."""
    prompt = prompt_lengths(batch)
    if not bool((prompt > 0).all()) or not is_contiguous(batch):
        return False
    if not share_prompt:
        return True
    chosen, rejected = prompt.chunk(2)
    width = int(chosen.max())
    ids, keep = batch["input_ids"][:, :width].chunk(2), torch.arange(width, device=prompt.device) < chosen.view(-1, 1)
    return torch.equal(chosen, rejected) and torch.equal(ids[0] * keep, ids[1] * keep)


def pack_rows(batch: dict[str, torch.Tensor], shared_prefix: int = 0) -> PackedBatch:
    """Pack the real tokens of B padded rows into one row, each row one causal attention block (SFT, rollouts).

    A row's real tokens must be one contiguous run (right padded, or left-padded prompt and right-padded
    response as a rollout makes them); positions restart at 0 at each row's first real token. Every token
    ``t >= 1`` with ``completion_mask[t] == 1`` is scored, predicted from the packed position of token ``t - 1``
    (which must be real); the mask may have any pattern (several assistant turns, every token), unlike
    ``pack_batch``, which scores one contiguous completion per row and needs a non-empty prompt. Rows may be
    any number (not pairs). ``sequences`` holds each scored token's row, ``columns`` its padded column.

    With ``shared_prefix`` = P, the real tokens of the first P columns are held as a prefix tree
    (``models.shared_prefix.prefix_holders``): rows with the same prompt (the ``G`` samples of one prompt in a
    rollout) hold it once, in the first such row, and prompts that begin alike (a chat template's system turn) hold
    their common beginning once. The others attend to the rows holding their prefix and to their own tokens,
    their positions continue from it, and a token right after a shared prefix is predicted from the prefix's last
    position, so every token sees what it sees in its own padded row (a prefix's hidden states are the same in
    every row that has it). Tokens in the first P columns that a row does not hold cannot be scored.
    """
    ids, real = batch["input_ids"], batch["attention_mask"].bool()
    n, device = ids.shape[0], ids.device
    first = real.long().argmax(1)  # first real column of each row
    kept, holders = real, None
    if shared_prefix:  # (N, P) the row holding each prompt token
        holders = prefix_holders(ids, real, shared_prefix)
        kept = real.clone()
        kept[:, :shared_prefix] &= holders == torch.arange(n, device=device)[:, None]
    lengths = kept.sum(1)
    emitted = kept.long().argmax(1)  # first kept column of each row
    held_from = emitted - first  # position of each row's first held token
    starts = torch.cumsum(lengths, 0) - lengths
    rows, cols = torch.nonzero(kept, as_tuple=True)  # row-major: the rows' kept tokens end to end
    scored_rows, scored_cols = torch.nonzero(batch["completion_mask"].bool()[:, 1:] & real[:, 1:], as_tuple=True)
    scored_cols = scored_cols + 1  # the scored token's column; it is predicted from the column before

    def at(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        """Packed position of (row, col): the row's own token, or that of the row holding it."""
        depth = col - first[row]
        if holders is not None:
            shared = holders[row, col.clamp(max=shared_prefix - 1)]
            row = torch.where(kept[row, col] | (col >= shared_prefix), row, shared)
        return starts[row] + depth - held_from[row]

    if not bool(kept[scored_rows, scored_cols].all()):
        raise ValueError(f"pack_rows: a scored token lies in the first {shared_prefix} (shared) columns")
    # one host transfer for the plan (not one per row: each is a device sync on an accelerator)
    starts_, lengths_, first_, held_from_ = torch.stack([starts, lengths, first, held_from]).tolist()
    holders_ = holders.tolist() if holders is not None else None
    blocks = []
    for row, (s, length) in enumerate(zip(starts_, lengths_)):
        if not length:
            continue
        ranges, depth = [], 0
        while depth < held_from_[row]:  # the shared prefix, a run of positions per row holding them
            holder, end = holders_[row][first_[row] + depth], depth + 1
            while end < held_from_[row] and holders_[row][first_[row] + end] == holder:
                end += 1
            base = starts_[holder] - held_from_[holder]
            ranges.append((base + depth, base + end))
            depth = end
        blocks.append(((*ranges, (s, s + length)), length))
    targets_at = at(scored_rows, scored_cols)
    packed = ids[rows, cols].unsqueeze(0)
    return PackedBatch(
        packed,
        (cols - first[rows]).unsqueeze(0),
        AttentionPlan(blocks),
        at(scored_rows, scored_cols - 1),
        packed[0, targets_at],
        scored_rows,
        scored_cols,
    )


#: pack rows only when their real tokens are fewer than this share of the padded tokens. Packing saves the work
#: on padding but runs attention one block (sequence) at a time; with little padding the per-block calls cost
#: more than one batched call: the GRPO benchmark (3M Llama, fp32 CPU, 8 prompts x 8 samples that all ran to 128
#: new tokens, so the only padding was the prompts') measured the packed passes at about twice the padded ones.
#: ``benchmarks/packing_threshold.py`` (3M Llama, 16 rollout rows of 32 + 128 tokens, forward + backward, 2 CPU
#: threads on a loaded machine) measured packed / padded time 0.96-2.2 at 79-90% real tokens and 0.59-0.94 at
#: 45-71%: the crossover lies between, hence 0.75.
PACKING_THRESHOLD = 0.75


def packing_pays(attention_mask: torch.Tensor, threshold: float = PACKING_THRESHOLD, real: int | None = None) -> bool:
    """Whether the packed tokens (``real``, default the rows' real tokens) are fewer than ``threshold`` times the
    padded tokens (``PACKING_THRESHOLD``)."""
    real = float(attention_mask.sum()) if real is None else real
    return real < threshold * attention_mask.numel()
