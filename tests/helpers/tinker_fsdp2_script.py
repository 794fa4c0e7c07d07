"""Run by tests/tinker/test_tinker_replicas.py: the engine of ``tinker-serve --devices 2 --strategy fsdp2`` on two
gloo CPU ranks (``tinker.serve.launch``; Fabric re-runs this script for rank 1), driven by hand on both ranks.
Each rank records what FSDP2 made of the adapters that peft added after sharding; rank 0 writes both ranks'
records to ``OUT/fsdp2.json``.

``python tinker_fsdp2_script.py OUT``"""

import json
import os
import sys

import torch

torch.set_num_threads(1)
HELPERS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HELPERS, os.path.dirname(HELPERS)]

from tinker_fixtures import saved_model  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from aitraining_pl.tinker.engine import Engine, Lora, TrainedModel  # noqa: E402
from aitraining_pl.tinker.serve import launch  # noqa: E402
from aitraining_pl.tinker.wire import Datum, FwdBwd  # noqa: E402


def managed(model: torch.nn.Module) -> set[int]:
    """ids of the parameters FSDP2's parameter groups hold (sharded)."""
    return {id(p.sharded_param) for m in model.modules() if isinstance(m, FSDPModule)
            for group in m._get_fsdp_state()._fsdp_param_groups for p in group.fsdp_params}  # fmt: skip


def main(out: str) -> None:
    replicas, device = launch("fsdp2", 2, "cpu")
    folder = os.path.join(out, "model")
    if replicas.rank == 0:
        saved_model(folder)
    torch.distributed.barrier()
    engine = Engine(folder, device=device, checkpoint_dir=os.path.join(out, "ck"), replicas=replicas)
    base = {id(p) for p in engine.base.parameters()}
    record = {"holds": replicas.base_share(engine.base)}
    a, b = TrainedModel("a", "o", "client_a", Lora(4)), TrainedModel("b", "o", "client_b", Lora(2, train_mlp=False))
    engine.run_create(a, 3)
    engine.run_create(b, 5)  # a new tenant on the already-sharded model
    tokens = [72, 101, 108, 108, 111, 32, 119]
    datum = Datum(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]), "weights": torch.ones(len(tokens) - 1)})
    adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}
    losses = []
    for entry, forward_only in ((a, False), (b, False), (a, True)):  # swapped in and out on the one sharded model
        request = FwdBwd(entry.model_id, "cross_entropy", {}, [datum, datum, datum], forward_only)
        losses.append(engine.run_forward_backward(entry, request)[1]["loss:sum"])
        grads = [n.split(".")[-2] for n, p in engine.model.named_parameters() if "lora_" in n and p.grad is not None]
        record.setdefault("with_grad", []).append(sorted(set(grads)))
        if entry is a and not forward_only:
            engine.run_optim_step(a, adam)
    lora = [p for n, p in engine.model.named_parameters() if "lora_" in n]
    frozen = [p for n, p in engine.model.named_parameters() if "lora_" not in n]
    record.update(
        losses=losses,
        lora_plain=all(type(p) is torch.nn.Parameter for p in lora),
        lora_managed=any(id(p) in managed(engine.base) for p in lora),
        frozen_dtensor=all(isinstance(p, DTensor) for p in frozen),
        frozen_same_objects=all(id(p) in base for p in frozen),
        frozen_requires_grad=any(p.requires_grad for p in frozen),
        frozen_grad=any(p.grad is not None for p in frozen),
    )
    records = [None, None]
    torch.distributed.all_gather_object(records, record)
    if replicas.rank == 0:
        with open(os.path.join(out, "fsdp2.json"), "w") as handle:
            json.dump(records, handle)


if __name__ == "__main__":
    main(sys.argv[1])
