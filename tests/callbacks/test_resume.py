"""Exact mid-epoch resume: a run killed after a checkpoint at step k and resumed from it ends bit-identical to
an uninterrupted run (DPO, reward model, PPO); the resumable loader and seeded sampler on their own."""

from __future__ import annotations

import random

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from conftest import TINY_LLAMA
from dpo_utils import preference_data, preference_rows

from aitraining_pl.callbacks.kl import AdaptiveKLCallback
from aitraining_pl.callbacks.resume import collect_rng_states, set_rng_states
from aitraining_pl.datamodules.preference import LengthGroupedSampler
from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.datamodules.resumable import ResumableDataLoader, SeededShuffleSampler
from aitraining_pl.modules.critic_free import GRPOModule
from aitraining_pl.modules.dpo import DPOModule
from aitraining_pl.modules.ppo import PPOModule
from aitraining_pl.modules.reward import RewardModule
from aitraining_pl.rollout import GenerationConfig

TOY_REWARD = "aitraining_pl.rewards:char_fraction_reward"  # PPO/GRPO/RLOO need a reward source


@pytest.fixture
def deterministic():
    threads, flag = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(flag)
    torch.set_num_threads(threads)


class _Killed(RuntimeError):
    pass


class _KillAfter(pl.Callback):
    """Raises at the start of the batch after optimizer step ``k`` (its checkpoint is already written)."""

    def __init__(self, k: int):
        self.k = k

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.k:
            raise _Killed(f"killed after step {self.k}")


class _Record(pl.Callback):
    """What each training batch was (pair indices or prompt texts) and the KL coefficient after it."""

    def __init__(self):
        self.batches, self.kl_coefs = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch["prompts"] if "prompts" in batch else batch["index"].tolist())

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.kl_coefs.append(getattr(pl_module, "kl_coef", None))


def _trainer(tmp_path, callbacks, **kw):
    options = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
    )
    return pl.Trainer(callbacks=callbacks, **{**options, **kw})


def _run_and_resume(tmp_path, make, k, extra_callbacks=lambda: [], **trainer_kw):
    """(uninterrupted module, resumed module, recorder of each, callbacks of each)."""
    pl.seed_everything(0)
    module, data = make()
    full_record, full_extra = _Record(), extra_callbacks()
    _trainer(tmp_path / "full", [full_record, *full_extra], enable_checkpointing=False, **trainer_kw).fit(module, data)

    pl.seed_everything(0)
    first, data = make()
    first_record = _Record()
    ckpt = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=k, save_top_k=-1, filename="{step}"
    )
    with pytest.raises(_Killed):
        callbacks = [first_record, _KillAfter(k), ckpt, *extra_callbacks()]
        _trainer(tmp_path / "first", callbacks, **trainer_kw).fit(first, data)

    pl.seed_everything(123)  # a resumed process starts from other random states
    resumed, data = make()
    resumed_record, resumed_extra = _Record(), extra_callbacks()
    _trainer(tmp_path / "resumed", [resumed_record, *resumed_extra], enable_checkpointing=False, **trainer_kw).fit(
        resumed, data, ckpt_path=str(tmp_path / "ckpt" / f"step={k}.ckpt")
    )
    return module, resumed, (full_record, first_record, resumed_record), (full_extra, resumed_extra)


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    diff = max(float((sa[n].float() - sb[n].float()).abs().max()) for n in sa)
    assert all(torch.equal(sa[n], sb[n]) for n in sa), f"weights differ (max abs diff {diff:.3g})"
    print(f"max abs weight difference: {diff}")
    return diff


def _preference_data(tokenizer, n=24, **kw):
    rows = preference_rows(n)
    return preference_data(
        rows,
        tokenizer,
        val_split=0.25,
        batch_size=3,
        **kw,
    )


@pytest.mark.parametrize("k", [2, 6, 8])  # mid-epoch 1, end of epoch 1 (6 batches), mid-epoch 2
def test_dpo_resume_is_bit_identical(tmp_path, deterministic, k):
    def make():
        module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-2, warmup_ratio=0.2)
        return module, _preference_data(module.tokenizer)

    full, resumed, (a, first, b), _ = _run_and_resume(tmp_path, make, k, max_steps=10, val_check_interval=4)
    assert first.batches[:k] + b.batches == a.batches  # no batch replayed, none skipped
    assert len({tuple(x) for x in a.batches[:6]}) == 6 and a.batches[:6] != a.batches[6:]  # shuffled per epoch
    _assert_same_weights(full.policy, resumed.policy)


def test_lora_checkpoint_holds_the_adapters_and_resumes_exactly(tmp_path, deterministic):
    """A LoRA checkpoint holds what trains (the adapters), not the frozen base, which the resumed module rebuilds
    from its source; the resumed run ends bit-identical to the uninterrupted one (adapters and base)."""
    from aitraining_pl.models import LoRAConfig

    def make():
        module = DPOModule(
            model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-2, lora=LoRAConfig(r=4, dropout=0.0)
        )
        return module, _preference_data(module.tokenizer)

    full, resumed, (a, first, b), _ = _run_and_resume(tmp_path, make, 3, max_steps=6)
    state = torch.load(tmp_path / "ckpt" / "step=3.ckpt", weights_only=True)["state_dict"]
    trainable = {n for n, p in full.named_parameters() if p.requires_grad}
    assert set(state) == trainable and all("lora_" in k for k in state)
    base = sum(v.numel() for v in full.policy.state_dict().values())
    assert sum(v.numel() for v in state.values()) < base / 5
    assert first.batches[:3] + b.batches == a.batches
    _assert_same_weights(full.policy, resumed.policy)
    whole = DPOModule(  # asked for (``lora.checkpoint_base``, also ``--model.init_args.lora.checkpoint_base true``)
        model_config=TINY_LLAMA, tokenizer_name="byte", lora=LoRAConfig(r=4, dropout=0.0, checkpoint_base=True)
    )
    assert whole.checkpoint_frozen_base and not full.checkpoint_frozen_base
    assert set(whole.state_dict()) == {f"policy.{k}" for k in whole.policy.state_dict()}  # the whole model


def test_dpo_resume_with_precomputed_reference_and_length_grouping(tmp_path, deterministic):
    def make():
        module = DPOModule(
            model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-2, precompute_ref_log_probs=True
        )
        return module, _preference_data(module.tokenizer, group_by_length=True)

    full, resumed, (a, first, b), _ = _run_and_resume(tmp_path, make, 3, max_steps=8)
    assert first.batches[:3] + b.batches == a.batches
    _assert_same_weights(full.policy, resumed.policy)


def test_reward_model_resume_is_bit_identical(tmp_path, deterministic):
    def make():
        module = RewardModule(model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=3e-3)
        return module, _preference_data(module.tokenizer)

    full, resumed, (a, first, b), _ = _run_and_resume(tmp_path, make, 4, max_epochs=2)
    assert first.batches[:4] + b.batches == a.batches
    _assert_same_weights(full, resumed)


def test_ppo_resume_is_bit_identical_with_kl_and_prompts(tmp_path, deterministic):
    prompts = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]

    def make():
        module = PPOModule(
            reward=TOY_REWARD,
            model_config=TINY_LLAMA,
            tokenizer_name="byte",
            learning_rate=1e-3,
            mini_batch_size=2,
            num_iterations=1,
            kl_coef=0.05,
            generation=GenerationConfig(max_new_tokens=4, temperature=1.0, top_p=1.0),
        )
        return module, PromptDataModule(prompts=prompts, tokenizer=module.tokenizer, batch_size=2)

    kl = lambda: [AdaptiveKLCallback(kl_target=1e-3, kl_horizon=10)]  # noqa: E731
    full, resumed, (a, first, b), _ = _run_and_resume(tmp_path, make, 3, kl, max_epochs=2)
    assert first.batches[:3] + b.batches == a.batches  # the prompts seen, iteration by iteration
    assert sorted(p for batch in a.batches[:4] for p in batch) == sorted(prompts)
    assert first.kl_coefs[:3] + b.kl_coefs == a.kl_coefs and len(set(a.kl_coefs)) > 1
    assert resumed.kl_coef == full.kl_coef  # the module owns the coefficient; the callback keeps none
    _assert_same_weights(full, resumed)


def test_grpo_resume_is_bit_identical_with_prompts(tmp_path, deterministic):
    """The online family (GRPO: G samples per prompt, k3 KL in the loss) resumes like PPO: same prompts, same
    sampled groups (random states restored), same weights."""
    prompts = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]

    def make():
        module = GRPOModule(
            reward=TOY_REWARD,
            model_config=TINY_LLAMA,
            tokenizer_name="byte",
            learning_rate=1e-3,
            num_generations=2,
            mini_batch_size=4,  # 2 prompts x 2 samples: one optimizer step per iteration
            kl_coef=0.05,
            generation=GenerationConfig(max_new_tokens=4, temperature=1.0, top_p=1.0),
        )
        return module, PromptDataModule(prompts=prompts, tokenizer=module.tokenizer, batch_size=2)

    full, resumed, (a, first, b), _ = _run_and_resume(tmp_path, make, 3, max_epochs=2)
    assert first.batches[:3] + b.batches == a.batches
    assert resumed.global_step == full.global_step == len(a.batches)
    untrained = make()[0].state_dict()
    assert any(not torch.equal(untrained[n], t) for n, t in full.state_dict().items())  # it did train
    _assert_same_weights(full, resumed)


def test_grpo_resume_with_multi_turn_episodes_is_bit_identical(tmp_path, deterministic):
    """Multi-turn episodes (the guessing game: the environment answers between turns) are played and trained on
    within one training step, so a checkpoint never holds half an episode: the resumed run plays the same
    episodes from the same prompts and ends with the same weights."""
    from aitraining_pl.environments.multiturn import GuessingGame

    path = tmp_path / "game.jsonl"
    path.write_text("".join(f'{{"prompt": "Guess 1-7 (#{i}):", "secret": {1 + i % 7}}}\n' for i in range(8)))

    def make():
        module = GRPOModule(
            reward=GuessingGame(max_turns=3),
            model_config=TINY_LLAMA,
            tokenizer_name="byte",
            learning_rate=1e-3,
            num_generations=2,
            mini_batch_size=4,
            kl_coef=0.05,
            generation=GenerationConfig(max_new_tokens=2, temperature=1.0, top_p=1.0),
        )
        return module, PromptDataModule(data_path=str(path), batch_size=2)

    full, resumed, (a, first, b), _ = _run_and_resume(tmp_path, make, 3, max_epochs=2)
    assert first.batches[:3] + b.batches == a.batches
    assert resumed.global_step == full.global_step == len(a.batches)
    untrained = make()[0].state_dict()
    assert any(not torch.equal(untrained[n], t) for n, t in full.state_dict().items())  # it did train
    _assert_same_weights(full, resumed)


# ------------------------------------------------------------------ the pieces
def test_resumable_loader_skips_consumed_batches_without_loading_them():
    loaded = []

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            loaded.append(i)
            return i

    sampler = SeededShuffleSampler(10, seed=3)
    loader = ResumableDataLoader(Data(), batch_size=3, sampler=sampler)
    order = [b.tolist() for b in loader]
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert state == {"batches": 2}
    fresh = ResumableDataLoader(Data(), batch_size=3, sampler=SeededShuffleSampler(10, seed=3))
    fresh.load_state_dict(state)
    loaded.clear()
    assert [b.tolist() for b in fresh] == order[2:]
    assert sorted(loaded) == sorted(i for b in order[2:] for i in b)  # skipped batches were never loaded
    assert [b.tolist() for b in fresh] == order  # the next pass is whole
    fresh.load_state_dict({"batches": len(order)})  # a state taken at the end of an epoch
    assert [b.tolist() for b in fresh] == order


def test_seeded_samplers_depend_on_seed_and_epoch_only():
    a, b = SeededShuffleSampler(20, seed=1), SeededShuffleSampler(20, seed=1)
    torch.manual_seed(0)
    first = list(a)
    torch.manual_seed(1)  # the global stream does not matter
    assert list(b) == first and sorted(first) == list(range(20))
    b.set_epoch(1)
    assert list(b) != first
    grouped, again = (LengthGroupedSampler(list(range(20)), batch_size=4, seed=1, group_factor=2) for _ in range(2))
    epoch0 = list(grouped)
    grouped.set_epoch(2), again.set_epoch(2)
    torch.manual_seed(3), random.seed(3)
    assert list(grouped) == list(again) != epoch0


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path):
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    states = collect_rng_states()
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.save(states, tmp_path / "rng.pt")
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    set_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


@pytest.mark.slow
def test_ppo_validation_and_sampling_callback_do_not_shift_training_randomness(tmp_path, deterministic):
    """Generation in validation (sanity check included) and in SamplingCallback runs on a forked random stream:
    the trained weights are those of a run without them."""
    from aitraining_pl.callbacks.sampling import SamplingCallback

    prompts = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]

    def run(name, callbacks, **kw):
        pl.seed_everything(0)
        module = PPOModule(
            reward=TOY_REWARD,
            model_config=TINY_LLAMA,
            tokenizer_name="byte",
            learning_rate=1e-3,
            mini_batch_size=2,
            num_iterations=1,
            generation=GenerationConfig(max_new_tokens=4, temperature=1.0, top_p=1.0),
        )
        data = PromptDataModule(prompts=prompts, tokenizer=module.tokenizer, batch_size=2, val_split=0.25)
        options = dict(
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(tmp_path / name),
            enable_checkpointing=False,
            max_epochs=2,
        )
        pl.Trainer(callbacks=callbacks, **{**options, **kw}).fit(module, data)
        return module

    plain = run("plain", [], limit_val_batches=0)
    busy = run(
        "busy", [SamplingCallback(every_n_iterations=1, num_prompts=2)], num_sanity_val_steps=2, val_check_interval=1
    )
    _assert_same_weights(plain, busy)


def _rank_rng_round_trip(rank: int, world: int, folder: str) -> None:
    import os

    import torch.distributed as dist

    from aitraining_pl.callbacks.resume import ExactResumeCallback

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["RESUME_TEST_PORT"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(100 + rank), random.seed(100 + rank), np.random.seed(100 + rank)
        state = ExactResumeCallback().state_dict()  # a collective: every rank calls it
        expected = (torch.rand(2), random.random(), np.random.rand())
        if rank == 0:
            torch.save(state, os.path.join(folder, "cb.pt"))
        dist.barrier()
        torch.manual_seed(7), random.seed(7), np.random.seed(7)  # the resumed processes start alike
        restored = ExactResumeCallback()
        restored.load_state_dict(torch.load(os.path.join(folder, "cb.pt"), weights_only=True))
        restored.on_train_batch_start(None, None, None, 0)
        got = (torch.rand(2), random.random(), np.random.rand())
        assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:], f"rank {rank}"
    finally:
        dist.destroy_process_group()


@pytest.mark.ddp
def test_each_rank_gets_its_own_random_states_back(tmp_path, monkeypatch):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("RESUME_TEST_PORT", str(s.getsockname()[1]))
    mp.spawn(_rank_rng_round_trip, args=(2, str(tmp_path)), nprocs=2, join=True)


@pytest.mark.ddp
@pytest.mark.slow
def test_dpo_resume_under_two_ddp_ranks_is_bit_identical(tmp_path):
    """Two CPU ranks through the CLI: 4 steps straight, or 3 steps with a checkpoint then resumed to 4 (a constant
    learning rate, so the shorter first run has the same schedule): the exported weights are bit-identical."""
    import os
    import subprocess
    import sys

    from dpo_utils import write_config
    from safetensors.torch import load_file

    script = tmp_path / "run_cli.py"  # DDP relaunches sys.argv, so the entry point must be a file
    script.write_text("from aitraining_pl.cli import main\nmain()\n")

    def run(name, steps, *extra):
        folder = tmp_path / name
        folder.mkdir()
        config = write_config(
            folder,
            n_pairs=40,
            model={"lr_schedule": "constant", "learning_rate": 1e-2},
            data={"val_split": 0.1},
            trainer={
                "max_steps": steps,
                "limit_val_batches": 0,
                "devices": 2,
                "strategy": "ddp",
                "enable_checkpointing": True,
                "callbacks": [
                    {
                        "class_path": "aitraining_pl.callbacks.export.HFExportCallback",
                        "init_args": {"dirpath": str(folder / "export")},
                    },
                    {
                        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                        "init_args": {"dirpath": str(folder / "ckpt"), "every_n_train_steps": 3, "filename": "{step}"},
                    },
                ],
            },
        )
        proc = subprocess.run(
            [sys.executable, str(script), "fit", "--config", str(config), *extra],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return folder

    straight = run("straight", 4)
    first = run("first", 3)
    resumed = run("resumed", 4, "--ckpt_path", str(first / "ckpt" / "step=3.ckpt"))
    a = load_file(straight / "export" / "last" / "model.safetensors")
    b = load_file(resumed / "export" / "last" / "model.safetensors")
    c = load_file(first / "export" / "last" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)  # the resumed run did train its last step


@pytest.mark.parametrize("staleness, sync_every", [(1, 1), (2, 2)])
def test_async_grpo_resume_is_bit_identical(tmp_path, deterministic, staleness, sync_every):
    """Asynchronous GRPO (issue 31; rollouts sampled on an HF generation server while the policy trains, on the fixed
    schedule): the checkpoint keeps the rollouts in flight (and, with ``weight_sync_steps`` 2, the weights of the
    last push when they are older than the policy's), so a run killed after step 3 and resumed with a new run id
    trains on the same rollouts and ends bit-identical; the first ``lag`` batches only warm up."""
    from async_fixtures import grpo, hf_server_port, served

    with hf_server_port(TINY_LLAMA) as port:

        def make():
            return grpo(served(port, max_staleness=staleness, weight_sync_steps=sync_every))

        full, resumed, (a, first, b), _ = _run_and_resume(tmp_path, make, 3, max_epochs=2)
    lag = staleness - sync_every + 1
    assert first.batches[: 3 + lag] + b.batches == a.batches  # the resumed loader starts after the checkpoint
    assert resumed.global_step == full.global_step == len(a.batches) - lag
    untrained = make()[0].state_dict()
    assert any(not torch.equal(untrained[n], t) for n, t in full.state_dict().items())  # it did train
    _assert_same_weights(full, resumed)
