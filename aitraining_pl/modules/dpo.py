"""Direct preference optimisation (Rafailov et al. 2023) and its variants as a LightningModule."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import nn

from aitraining_pl.losses import REFERENCE_FREE, SequenceLogps, dpo_loss, selective_log_softmax
from aitraining_pl.models import LoRAConfig
from aitraining_pl.modules.base import SharedStepModule


class PackedPairs(NamedTuple):
    """B rows, each ``prompt + chosen + rejected`` with the prompt held once (see ``pack_pairs``)."""

    input_ids: torch.Tensor  #: (B, T)
    attention_mask: torch.Tensor  #: (B, 1, T, T) bool: causal, and rejected tokens do not see chosen ones
    position_ids: torch.Tensor  #: (B, T): the rejected completion restarts right after the prompt
    rows: torch.Tensor  #: (N,) packed row of each scored token
    sources: torch.Tensor  #: (N,) position whose output predicts the token
    targets: torch.Tensor  #: (N,) the scored token
    sequences: torch.Tensor  #: (N,) output slot: i for the chosen completion of pair i, B + i for its rejected one


def pack_pairs(batch: dict[str, torch.Tensor]) -> PackedPairs:
    """Pack each pair of a preference batch (2B right-padded rows, chosen first) into one row that holds the
    shared prompt once, so prompt tokens are computed once instead of twice.

    Row i is ``prompt, chosen, rejected``; positions of the rejected completion continue from the prompt, and a
    4-D mask keeps it from attending to the chosen tokens, so every token sees exactly what it would see in
    its own unpacked row. The first completion token of both is predicted from the last prompt position.
    """
    ids, attention, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    b = ids.shape[0] // 2
    lengths = attention.sum(1)
    prompt = (completion.cumsum(1) == 0).sum(1)[:b]  # leading non-completion tokens
    n_chosen, n_rejected = lengths[:b] - prompt, lengths[b:] - prompt
    total = prompt + n_chosen + n_rejected
    width = int(total.max())
    packed = torch.zeros(b, width, dtype=ids.dtype, device=ids.device)
    position = torch.zeros(b, width, dtype=torch.long, device=ids.device)
    rows, sources, targets, sequences = [], [], [], []
    for i, (p, c, r) in enumerate(zip(prompt.tolist(), n_chosen.tolist(), n_rejected.tolist())):
        packed[i, : p + c] = ids[i, : p + c]
        packed[i, p + c : p + c + r] = ids[b + i, p : p + r]
        position[i, : p + c] = torch.arange(p + c)
        position[i, p + c : p + c + r] = torch.arange(p, p + r)
        src = torch.cat([torch.arange(p - 1, p + c - 1), torch.tensor([p - 1]), torch.arange(p + c, p + c + r - 1)])
        rows.append(torch.full((c + r,), i))
        sources.append(src)
        targets.append(torch.arange(p, p + c + r))
        sequences.append(torch.cat([torch.full((c,), i), torch.full((r,), b + i)]))
    q = torch.arange(width, device=ids.device).view(1, -1, 1)
    k = torch.arange(width, device=ids.device).view(1, 1, -1)
    start_r = (prompt + n_chosen).view(-1, 1, 1)
    mask = (k <= q) & (k < total.view(-1, 1, 1))
    mask &= ~((q >= start_r) & (k >= prompt.view(-1, 1, 1)) & (k < start_r))
    mask |= (q >= total.view(-1, 1, 1)) & (k == q)  # padding rows attend to themselves (no all-masked rows)
    rows, sources = torch.cat(rows).to(ids.device), torch.cat(sources).to(ids.device)
    return PackedPairs(packed, mask.unsqueeze(1), position, rows, sources,
                       packed[rows, torch.cat(targets).to(ids.device)], torch.cat(sequences).to(ids.device))


def can_pack(batch: dict[str, torch.Tensor]) -> bool:
    """Whether every pair has the same non-empty prompt length in its chosen and rejected rows."""
    prompt = (batch["completion_mask"].cumsum(1) == 0).sum(1)
    chosen, rejected = prompt.chunk(2)
    return bool((chosen > 0).all()) and torch.equal(chosen, rejected)


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


def completion_logps(model: nn.Module, batch: dict[str, torch.Tensor], pack: bool = False) -> SequenceLogps:
    """Summed completion-token log-probs of every row of ``batch`` (chosen rows, then rejected rows).

    The language-model head runs only on positions whose next token is a completion token, so the
    (rows, length, vocabulary) logits tensor is never built. With ``pack`` each pair is one row holding its
    prompt once (``pack_pairs``). Models without a separable decoder and head fall back to a full forward
    over the unpacked rows.

    Args:
        model: a transformers causal LM (optionally wrapped by ``peft``).
        batch: ``input_ids``, ``attention_mask``, ``completion_mask``, each (2B, L).
        pack: share the prompt between chosen and rejected (needs 4-D attention-mask support, as in Llama).

    Returns:
        ``SequenceLogps(logps (2B,), lengths (2B,))``.
    """
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    scored = batch["completion_mask"][:, 1:].bool()  # position t scores token t + 1
    lengths = scored.sum(-1).float()
    decoder, head, config = _decoder_and_head(model)
    if decoder is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
        token, rows = selective_log_softmax(logits[scored], input_ids[:, 1:][scored]), torch.nonzero(scored, as_tuple=True)[0]
    elif pack and can_pack(batch):
        packed = pack_pairs(batch)
        hidden = decoder(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                         position_ids=packed.position_ids, use_cache=False).last_hidden_state
        token, rows = _head_logps(head, config, hidden[packed.rows, packed.sources], packed.targets), packed.sequences
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
        share_prompt: run each pair as one row holding its prompt once (a 4-D attention mask keeps the
            rejected completion from seeing the chosen one): fewer tokens, but longer rows and a dense mask, so
            it pays only when prompts are long and attention is cheap next to the MLPs (measure it; it was
            slower for a 3M-parameter model on CPU). Needs a model that takes 4-D masks and ``position_ids``
            (Llama, Qwen2, Mistral, ...).
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
        share_prompt: bool = False,
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
                return completion_logps(model, batch, pack=self.hparams.share_prompt).logps
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
        # 1. policy log-probs of chosen and rejected rows in one forward
        policy = completion_logps(self.policy, batch, pack=hp.share_prompt)
        chosen, rejected = policy.logps.chunk(2)
        chosen_len, rejected_len = policy.lengths.chunk(2)
        # 2. reference log-probs (precomputed, or under no_grad), unless reference-free
        ref_chosen, ref_rejected = self.reference_logps(batch, stage) if self.uses_reference else (None, None)
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
