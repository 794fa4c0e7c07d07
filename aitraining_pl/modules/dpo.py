"""Direct preference optimisation (Rafailov et al. 2023) and its variants as a LightningModule."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import nn

from aitraining_pl.losses import REFERENCE_FREE, SequenceLogps, dpo_loss, selective_log_softmax
from aitraining_pl.models import LoRAConfig
from aitraining_pl.models.packing import AttentionPlan, packed_attention, supports_packing
from aitraining_pl.modules.base import SharedStepModule


class PackedBatch(NamedTuple):
    """The real tokens of a preference batch in one row (see ``pack_batch``)."""

    input_ids: torch.Tensor  #: (1, N)
    position_ids: torch.Tensor  #: (1, N): positions within each sequence
    plan: AttentionPlan  #: which tokens attend to which
    sources: torch.Tensor  #: (M,) packed position whose output predicts a scored token
    targets: torch.Tensor  #: (M,) the scored token
    sequences: torch.Tensor  #: (M,) row of the batch the scored token belongs to (chosen 0..B-1, rejected B..2B-1)


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
    lengths, prompts = batch["attention_mask"].sum(1).tolist(), prompt_lengths(batch).tolist()
    b = len(lengths) // 2
    rows, cols, positions, blocks, sources, targets, sequences = [], [], [], [], [], [], []
    start = 0

    def take(row: int, lo: int, hi: int, first_position: int) -> None:
        rows.extend([row] * (hi - lo))
        cols.extend(range(lo, hi))
        positions.extend(range(first_position, first_position + hi - lo))

    def score(sequence: int, first: int, last: int, first_source: int) -> None:  # packed targets [first, last)
        sources.extend([first_source] + list(range(first, last - 1)))
        targets.extend(range(first, last))
        sequences.extend([sequence] * (last - first))

    for i in range(b if share_prompt else 2 * b):
        p = prompts[i]
        if share_prompt:
            c, r = lengths[i] - p, lengths[b + i] - p
            take(i, 0, p + c, 0)
            take(b + i, p, p + r, p)
            blocks += [(((start, start + p + c),), p + c), (((start, start + p), (start + p + c, start + p + c + r)), r)]
            score(i, start + p, start + p + c, start + p - 1)
            score(b + i, start + p + c, start + p + c + r, start + p - 1)
            start += p + c + r
        else:
            n = lengths[i]
            take(i, 0, n, 0)
            blocks.append((((start, start + n),), n))
            score(i, start + p, start + n, start + p - 1)
            start += n
    device = ids.device
    packed = ids[torch.tensor(rows, device=device), torch.tensor(cols, device=device)].unsqueeze(0)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return PackedBatch(packed, as_tensor(positions).unsqueeze(0), AttentionPlan(blocks), as_tensor(sources),
                       packed[0, as_tensor(targets)], as_tensor(sequences))


def can_pack(batch: dict[str, torch.Tensor], share_prompt: bool = False) -> bool:
    """Whether every row has a non-empty prompt (its first completion token is predicted from it) and, for
    ``share_prompt``, each pair's chosen and rejected rows the same prompt."""
    prompt = prompt_lengths(batch)
    if not bool((prompt > 0).all()):
        return False
    if not share_prompt:
        return True
    chosen, rejected = prompt.chunk(2)
    width = int(chosen.max())
    ids, keep = batch["input_ids"][:, :width].chunk(2), torch.arange(width, device=prompt.device) < chosen.view(-1, 1)
    return torch.equal(chosen, rejected) and torch.equal(ids[0] * keep, ids[1] * keep)


def _decoder_and_head(model: nn.Module):
    """(decoder, lm head, config) of a transformers causal LM (through a ``peft`` wrapper), or Nones."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    config = getattr(lm, "config", None)
    if getattr(config, "logit_scale", None) is not None:  # heads with extra scaling: use the model's forward
        decoder = head = None
    return decoder, head, config


def _head_logps(head: nn.Module, config: Any, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return selective_log_softmax(logits.float(), targets)


def completion_logps(model: nn.Module, batch: dict[str, torch.Tensor], padding_free: bool = False,
                     share_prompt: bool = False) -> SequenceLogps:
    """Summed completion-token log-probs of every row of ``batch`` (chosen rows, then rejected rows).

    The language-model head runs only on positions whose next token is a completion token, so the
    (rows, length, vocabulary) logits tensor is never built. ``padding_free`` runs the real tokens packed in
    one row (``pack_batch``, ``models.packing``): no work on padding. ``share_prompt`` (packed too) holds each
    pair's prompt once. Both fall back to padded rows for a model that cannot run packed
    (``supports_packing``) or a batch with an empty prompt; a model without a separable decoder and head
    runs its full forward.

    Args:
        model: a transformers causal LM (optionally wrapped by ``peft``).
        batch: ``input_ids``, ``attention_mask``, ``completion_mask``, each (2B, L).
        padding_free: pack the rows' real tokens into one row.
        share_prompt: pack each pair as one sequence holding its prompt once.

    Returns:
        ``SequenceLogps(logps (2B,), lengths (2B,))``.
    """
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    scored = batch["completion_mask"][:, 1:].bool()  # position t scores token t + 1
    lengths = scored.sum(-1).float()
    decoder, head, config = _decoder_and_head(model)
    packed = None
    if decoder is not None and (padding_free or share_prompt) and supports_packing(config):
        if share_prompt and can_pack(batch, share_prompt=True):
            packed = pack_batch(batch, share_prompt=True)
        elif can_pack(batch):  # prompts differ within a pair: still packed, one block per row
            packed = pack_batch(batch)
    if decoder is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
        token, rows = selective_log_softmax(logits[scored], input_ids[:, 1:][scored]), torch.nonzero(scored, as_tuple=True)[0]
    elif packed is not None:
        with packed_attention(config, packed.plan):
            hidden = decoder(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                             packed_plan=packed.plan).last_hidden_state
        token, rows = _head_logps(head, config, hidden[0, packed.sources], packed.targets), packed.sequences
    else:
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        token = _head_logps(head, config, hidden[:, :-1][scored], input_ids[:, 1:][scored])
        rows = torch.nonzero(scored, as_tuple=True)[0]
    logps = torch.zeros(input_ids.shape[0], dtype=token.dtype, device=token.device).index_add(0, rows, token)
    return SequenceLogps(logps, lengths.to(token.dtype))


def preference_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """(B,) 1 where the chosen reward is higher, 0 where lower, 0.5 on ties: an untrained policy (equal to
    its reference, all rewards 0) scores 0.5, as a coin flip would."""
    return (chosen > rejected).float() + 0.5 * (chosen == rejected).float()


class DPOModule(SharedStepModule):
    """DPO and its variants (IPO, SLiC hinge, robust DPO, conservative DPO, SimPO) on preference batches.

    Args:
        model_name: folder or hub id of the policy (a causal LM).
        model_config: inline transformers config for a randomly initialised policy (instead of ``model_name``).
        tokenizer_name: tokenizer folder, hub id or ``"byte"`` (default: ``model_name``); shared with the data.
        lora: LoRA adapters on the policy; the reference is then the policy with adapters disabled.
        beta: temperature of the implicit reward ``beta * log(pi / pi_ref)``.
        loss_type: one of ``sigmoid`` (DPO), ``robust``, ``hinge``, ``ipo``, ``simpo``.
        label_smoothing: assumed label-flip rate for ``sigmoid`` (conservative DPO) and ``robust``.
        reference_free: treat the reference as uniform (no reference model is loaded).
        simpo_gamma: target reward margin of SimPO.
        learning_rate: peak AdamW learning rate.
        warmup_ratio: fraction of the optimizer steps spent in linear warmup.
        lr_schedule: decay after warmup: ``linear``, ``cosine`` or ``constant``.
        weight_decay: AdamW weight decay.
        precompute_ref_logps: compute reference log-probs for every pair in one pass before training, then
            release the reference model.
        padding_free: run the batch's real tokens packed end to end in one row, attention block by block
            (no work on padding; the same log-probs as padded rows). Used when the model's attention is SDPA or
            eager with no sliding window (Llama, Qwen2, Mistral, ...); other models run padded.
        share_prompt: pack each pair as one sequence holding its prompt once (the rejected completion attends
            to the prompt and itself, with the same log-probs as separate rows): fewer tokens in every layer.
        dtype: weights dtype when loading (``bfloat16``, ``float32``, ...; default: as stored / float32).
        seed: seed of the random initialisation when ``model_config`` is used.
        trust_remote_code: allow custom model code from the hub (off by default).
    """

    def __init__(
        self,
        model_name: Optional[str] = None,
        model_config: Optional[dict[str, Any]] = None,
        tokenizer_name: Optional[str] = None,
        lora: Optional[LoRAConfig] = None,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        reference_free: bool = False,
        simpo_gamma: float = 0.5,
        learning_rate: float = 1e-6,
        warmup_ratio: float = 0.1,
        lr_schedule: str = "linear",
        weight_decay: float = 0.0,
        precompute_ref_logps: bool = False,
        padding_free: bool = True,
        share_prompt: bool = True,
        dtype: Optional[str] = None,
        seed: int = 0,
        trust_remote_code: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["lora"])
        self.store_lora_hparam(lora)
        from aitraining_pl.losses import DPO_LOSSES

        if loss_type not in DPO_LOSSES:
            raise ValueError(f"unknown loss_type {loss_type!r}; known: {', '.join(sorted(DPO_LOSSES))}")
        self.uses_reference = not (reference_free or loss_type in REFERENCE_FREE)
        self.policy, self.reference = self.load_policy_from_hparams(with_reference=self.uses_reference)
        self._ref_cache: dict[str, torch.Tensor] = {}  # split -> (N, 2) precomputed reference log-probs

    # ------------------------------------------------------------------ reference log-probs
    def _place_reference(self) -> None:
        if self.reference is not None:  # a no-op under LoRA and once the frozen copy was released
            self.reference.to(self.device, next(self.policy.parameters()).dtype)

    def on_fit_start(self) -> None:
        self._place_reference()
        if self.reference is not None and self.hparams.precompute_ref_logps:
            self.precompute_reference()

    def on_validation_start(self) -> None:
        self._place_reference()

    def on_test_start(self) -> None:
        self._place_reference()

    @torch.no_grad()
    def _reference_forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(2B,) reference log-probs: the frozen copy, or the policy with adapters disabled, in eval mode."""
        model = self.reference.model
        was_training = model.training
        model.eval()
        try:
            with self.reference.context():
                return completion_logps(model, batch, self.hparams.padding_free, self.hparams.share_prompt).logps
        finally:
            model.train(was_training)

    def precompute_reference(self) -> None:
        """One pass over every split of the data module; afterwards the frozen reference copy is released."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "ordered_dataloaders"):
            raise ValueError("precompute_ref_logps needs a data module with ordered_dataloaders() (PreferenceDataModule)")
        # fork the RNG: creating DataLoader iterators draws from it, and the training order must not change
        with torch.random.fork_rng(devices=[]), self.trainer.precision_plugin.forward_context():
            for split, loader in datamodule.ordered_dataloaders().items():
                chunks = []
                for batch in loader:
                    batch = {k: v.to(self.device) for k, v in batch.items()}
                    logps = self._reference_forward(batch)
                    chunks.append(torch.stack(logps.chunk(2), dim=1))
                self._ref_cache[split] = torch.cat(chunks)
        self.reference.drop()

    def reference_logps(self, batch: dict[str, torch.Tensor], split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) reference log-probs of chosen and rejected: looked up when precomputed, else one forward."""
        split = "val" if split == "test" else split  # the test loader is the validation split
        if split in self._ref_cache:
            pairs = self._ref_cache[split][batch["index"]]
            return pairs[:, 0], pairs[:, 1]
        chosen, rejected = self._reference_forward(batch).chunk(2)
        return chosen, rejected

    # ------------------------------------------------------------------ steps
    def shared_step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        hp = self.hparams
        # 1. reference log-probs (precomputed, or under no_grad), unless reference-free; first, so that its
        #    activations are freed before the policy's are built (a lower peak)
        ref_chosen, ref_rejected = self.reference_logps(batch, stage) if self.uses_reference else (None, None)
        # 2. policy log-probs of chosen and rejected rows in one forward
        policy = completion_logps(self.policy, batch, hp.padding_free, hp.share_prompt)
        chosen, rejected = policy.logps.chunk(2)
        chosen_len, rejected_len = policy.lengths.chunk(2)
        # 3. the loss
        out = dpo_loss(
            chosen, rejected, ref_chosen, ref_rejected, beta=hp.beta, loss_type=hp.loss_type,
            label_smoothing=hp.label_smoothing, reference_free=hp.reference_free,
            chosen_lengths=chosen_len, rejected_lengths=rejected_len, gamma=hp.simpo_gamma,
        )
        loss = out.losses.mean()
        # 4. metrics
        metrics = {
            "loss": loss,
            "rewards/chosen": out.chosen_rewards,
            "rewards/rejected": out.rejected_rewards,
            "rewards/accuracies": preference_accuracy(out.chosen_rewards, out.rejected_rewards),
            "rewards/margins": out.chosen_rewards - out.rejected_rewards,
            "logps/chosen": chosen,
            "logps/rejected": rejected,
        }
        self.log_metrics(stage, metrics, batch_size=chosen.shape[0], prog_bar=("loss", "rewards/accuracies"))
        return loss
