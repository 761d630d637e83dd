"""The framework integrations, each against the real library: transformers, Lightning, DCP."""

from __future__ import annotations

import concurrent.futures
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import cas
from tests.prerequisites import require_module

HF_EXTRA = "pip install 'cas[hf]'"
LIGHTNING_EXTRA = "pip install 'cas[lightning]'"


def chunk_count(repo: cas.Repository) -> int:
    return len(list(repo.blobs.list("chunks/")))


# -- transformers ---------------------------------------------------------------------------------


def tiny_bert() -> Any:
    transformers = require_module("transformers", HF_EXTRA)
    require_module("accelerate", HF_EXTRA)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 64, (8,), generator=g), "labels": torch.tensor(i % 2)}


def test_a_save_pretrained_model_goes_into_the_store_and_comes_back_with_from_pretrained(
    tmp_path: Path,
) -> None:
    transformers = require_module("transformers", HF_EXTRA)
    model = tiny_bert()
    model.save_pretrained(tmp_path / "saved")  # model.safetensors + config.json
    repo = cas.open(tmp_path / "store")
    repo.put_path(tmp_path / "saved", "models/tiny-bert")
    repo.get_path("models/tiny-bert", tmp_path / "restored")
    for saved in (tmp_path / "saved").iterdir():
        assert (tmp_path / "restored" / saved.name).read_bytes() == saved.read_bytes()
    back = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "restored")
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


@pytest.mark.parametrize("async_ingest", [False, True])
def test_hf_trainer_checkpoints_land_in_the_store_byte_identical(
    tmp_path: Path, async_ingest: bool
) -> None:
    model = tiny_bert()
    from transformers import Trainer, TrainingArguments

    from cas.training.integrations.hf import CASCallback, restore_checkpoint

    repo = cas.open(tmp_path / "store")
    callback = CASCallback(repo, "runs/bert", async_ingest=async_ingest)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=4, save_steps=2, save_strategy="steps",
        per_device_train_batch_size=4, report_to=[], use_cpu=True, disable_tqdm=True,
        logging_steps=100,
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback]).train()

    assert [r.name for r in repo.refs("runs/bert")] == [
        "runs/bert/ckpt_step00000002", "runs/bert/ckpt_step00000004", "runs/bert/latest"
    ]  # fmt: skip
    assert repo.resolve("runs/bert/latest") == repo.resolve("runs/bert/ckpt_step00000004")
    files = repo.show("runs/bert/ckpt_step00000004")["files"]
    assert files["training_args.bin"]["format"] == "torch-zip"
    assert files["model.safetensors"]["format"] == "safetensors"
    restored = restore_checkpoint(repo, "runs/bert/ckpt_step00000004", tmp_path / "restored")
    original = tmp_path / "out" / "checkpoint-4"
    names = sorted(p.name for p in original.iterdir())
    assert names == sorted(p.name for p in restored.iterdir())
    for name in names:
        assert (original / name).read_bytes() == (restored / name).read_bytes(), name


def files_under(directory: Path) -> dict[str, bytes]:
    """Every file below ``directory`` by relative path, with its bytes."""
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def checkpoint_recorder() -> Any:
    """A TrainerCallback that keeps the bytes of every ``checkpoint-N/`` as the Trainer saves it."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):  # type: ignore[misc,unused-ignore]
        def __init__(self) -> None:
            self.files: dict[int, dict[str, bytes]] = {}

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            directory = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            self.files[state.global_step] = files_under(directory)

    return Recorder()


@pytest.mark.parametrize("strategy", ["epoch", "best"])
def test_hf_async_ingest_finishes_before_the_trainer_rotates_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    # With save_total_limit=1 the Trainer deletes checkpoint-N once it has written the next one;
    # a slow ingest of checkpoint-N must be finished by then, whatever decides to save.
    model = tiny_bert()
    from transformers import Trainer, TrainingArguments

    from cas.training.integrations.hf import CASCallback, restore_checkpoint

    repo = cas.open(tmp_path / "store")
    put_path = repo.put_path

    def slow_put_path(*args: Any, **kwargs: Any) -> Any:
        time.sleep(1.0)  # a large model's ingest
        return put_path(*args, **kwargs)

    monkeypatch.setattr(repo, "put_path", slow_put_path)
    callback = CASCallback(repo, "runs/bert", async_ingest=True)
    written = checkpoint_recorder()  # reads each directory before the Trainer rotates it away
    extra: dict[str, Any] = {}
    if strategy == "best":
        extra = {
            "eval_strategy": "epoch",
            "metric_for_best_model": "loss",
            "greater_is_better": False,
        }
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), num_train_epochs=3, save_strategy=strategy,
        save_total_limit=1, per_device_train_batch_size=8, report_to=[], use_cpu=True,
        disable_tqdm=True, logging_steps=100, **extra,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(),
                      callbacks=[written, callback])  # fmt: skip
    trainer.train()
    stored = [r.name for r in repo.refs("runs/bert") if "ckpt_" in r.name]
    assert stored == [f"runs/bert/ckpt_step{step:08d}" for step in sorted(written.files)]
    assert len(stored) >= 2 and len(stored) == len(callback.stored)
    # What was ingested is what the Trainer wrote, byte for byte, though the directories are gone.
    for step, files in written.files.items():
        restored = restore_checkpoint(repo, f"runs/bert/ckpt_step{step:08d}", tmp_path / "back")
        assert files_under(restored) == files, step


def hf_args(output_dir: Path, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    settings: dict[str, Any] = dict(
        output_dir=str(output_dir), max_steps=4, save_steps=2, save_strategy="steps",
        per_device_train_batch_size=4, report_to=[], use_cpu=True, disable_tqdm=True,
        logging_steps=100, seed=0, lr_scheduler_type="constant",
    )  # fmt: skip
    settings.update(overrides)
    return TrainingArguments(**settings)


def checkpoint_dirs(output_dir: Path) -> list[str]:
    return sorted(p.name for p in output_dir.glob("checkpoint-*")) if output_dir.exists() else []


def weights(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("async_ingest", [False, True])
def test_hf_store_replaces_the_local_checkpoint_directories(
    tmp_path: Path, async_ingest: bool
) -> None:
    model = tiny_bert()
    from transformers import Trainer

    from cas.training.integrations.hf import CASCallback

    repo = cas.open(tmp_path / "store")
    written = checkpoint_recorder()
    callback = CASCallback(repo, "runs/bert", async_ingest=async_ingest, keep_local=False)
    Trainer(model=model, args=hf_args(tmp_path / "out", max_steps=6),
            train_dataset=Tokens(), callbacks=[written, callback]).train()  # fmt: skip
    assert checkpoint_dirs(tmp_path / "out") == []
    assert [step for step, _, _ in callback.stored] == [2, 4, 6] == sorted(written.files)


def test_hf_store_without_local_copies_still_loads_the_best_model_at_the_end(
    tmp_path: Path,
) -> None:
    model = tiny_bert()
    from safetensors.torch import load_file
    from transformers import Trainer

    from cas.training.integrations.hf import CASCallback, restore_checkpoint

    repo = cas.open(tmp_path / "store")
    callback = CASCallback(repo, "runs/bert", keep_local=False)
    # "Best" is the highest eval loss (it falls as this model trains): an early checkpoint, which
    # the Trainer loads back at the end.
    args = hf_args(tmp_path / "out", max_steps=6, eval_strategy="steps", eval_steps=2,
                   load_best_model_at_end=True, metric_for_best_model="loss",
                   greater_is_better=True)  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(),
                      callbacks=[callback])  # fmt: skip
    trainer.train()
    assert checkpoint_dirs(tmp_path / "out") == []
    best_step = int(str(trainer.state.best_model_checkpoint).rpartition("-")[2])
    assert best_step < 6
    best = restore_checkpoint(repo, f"runs/bert/ckpt_step{best_step:08d}", tmp_path / "back")
    stored = load_file(str(best / "model.safetensors"))
    for name, tensor in weights(trainer.model).items():
        if name in stored:
            assert torch.equal(tensor, stored[name]), name


def test_hf_resumes_from_a_ref_at_its_step_without_a_hand_made_directory(tmp_path: Path) -> None:
    from transformers import Trainer, TrainerCallback

    from cas.training.integrations.hf import CASCallback, resume_dir

    class StartStep(TrainerCallback):  # type: ignore[misc,unused-ignore]
        step: int | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.step = state.global_step

    straight = Trainer(model=tiny_bert(), args=hf_args(tmp_path / "straight", max_steps=6),
                       train_dataset=Tokens())  # fmt: skip
    straight.train()

    repo = cas.open(tmp_path / "store")
    args = hf_args(tmp_path / "out", max_steps=4)
    first = CASCallback(repo, "runs/bert", keep_local=False)
    Trainer(model=tiny_bert(), args=args, train_dataset=Tokens(), callbacks=[first]).train()
    assert checkpoint_dirs(tmp_path / "out") == []

    start = StartStep()
    args = hf_args(tmp_path / "out", max_steps=6)
    resumed = Trainer(model=tiny_bert(), args=args, train_dataset=Tokens(),
                      callbacks=[start, CASCallback(repo, "runs/bert", keep_local=False)])  # fmt: skip
    resumed.train(resume_from_checkpoint=resume_dir(repo, "runs/bert/latest", args.output_dir))
    assert start.step == 4
    assert resumed.state.global_step == 6
    assert checkpoint_dirs(tmp_path / "out") == []  # the restored directory went once read
    after, expected = weights(resumed.model), weights(straight.model)
    for name, tensor in expected.items():
        assert torch.equal(after[name], tensor), name


def test_hf_trainer_resumed_from_an_earlier_step_saves_steps_the_policy_protects_again(
    tmp_path: Path,
) -> None:
    from transformers import Trainer

    from cas.retention.policy import RetentionPolicy
    from cas.training.integrations.hf import CASCallback, resume_dir

    repo = cas.open(tmp_path / "store")
    repo.store_retention_policy(RetentionPolicy(protect=("runs/bert/**",)))
    args = hf_args(tmp_path / "out", max_steps=6)
    first = CASCallback(repo, "runs/bert", keep_local=False)
    Trainer(model=tiny_bert(), args=args, train_dataset=Tokens(), callbacks=[first]).train()
    old_step4 = repo.resolve("runs/bert/ckpt_step00000004")

    # The run owns its step refs: resumed from step 2, it saves steps 4 and 6 again.
    again = CASCallback(repo, "runs/bert", keep_local=False)
    resumed = Trainer(model=tiny_bert(), args=args, train_dataset=Tokens(), callbacks=[again])
    resumed.train(
        resume_from_checkpoint=resume_dir(repo, "runs/bert/ckpt_step00000002", args.output_dir)
    )
    assert [step for step, _, _ in again.stored] == [4, 6]
    assert repo.resolve("runs/bert/latest") == repo.resolve("runs/bert/ckpt_step00000006")
    assert old_step4 in [e.target for e in repo.log("runs/bert/ckpt_step00000004")]


# -- Lightning ------------------------------------------------------------------------------------


def test_lightning_saves_prunes_and_resumes_through_the_store(tmp_path: Path) -> None:
    L = require_module("lightning", LIGHTNING_EXTRA)
    from lightning.pytorch.callbacks import ModelCheckpoint

    from cas.training.integrations.lightning import CASCheckpointIO

    class Regressor(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self, width: int = 8) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Linear(width, 1)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            (x,) = batch
            loss: torch.Tensor = self.net(x).pow(2).mean()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def loader() -> torch.utils.data.DataLoader[Any]:
        data = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=8)

    repo = cas.open(tmp_path / "store")
    quiet: dict[str, Any] = dict(
        logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu"
    )
    checkpoints = ModelCheckpoint(
        dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_top_k=2, monitor="step",
        mode="max", save_last=True,
    )  # fmt: skip
    trainer = L.Trainer(
        max_steps=6, plugins=[CASCheckpointIO(repo, "runs/lit")], callbacks=[checkpoints], **quiet
    )
    torch.manual_seed(0)
    model = Regressor()
    trainer.fit(model, loader())

    names = [r.name for r in repo.refs("runs/lit")]
    assert names == [
        "runs/lit/epoch=0-step=4.ckpt", "runs/lit/epoch=0-step=6.ckpt", "runs/lit/last.ckpt",
        "runs/lit/latest",
    ]  # fmt: skip
    assert not (tmp_path / "ckpts").exists()  # nothing went to the filesystem
    stored = repo.load("runs/lit/last.ckpt")
    assert stored["global_step"] == 6 and stored["hyper_parameters"] == {"width": 8}
    assert torch.equal(stored["state_dict"]["net.weight"], model.net.weight.detach())

    resumed = L.Trainer(
        max_steps=8, plugins=[CASCheckpointIO(repo, "runs/lit")], enable_checkpointing=False,
        **quiet,
    )  # fmt: skip
    resumed.fit(Regressor(), loader(), ckpt_path=checkpoints.last_model_path)
    assert resumed.global_step == 8


def lightning_run(
    tmp_path: Path, route: str, max_steps: int, ckpt_path: str | None = None
) -> tuple[Any, Any, cas.Repository]:
    """Fit a small regressor for ``max_steps`` with checkpoints every 2 steps and ``save_last``,
    either through ``CASCheckpointIO`` ("plugin") or a ``cas://`` dirpath ("cas_url"); return the
    trainer, the model and the store. ``model.started`` records the step and weights training
    started from."""
    L = require_module("lightning", LIGHTNING_EXTRA)
    from lightning.pytorch.callbacks import ModelCheckpoint

    from cas.training.integrations.lightning import CASCheckpointIO

    class Regressor(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)
            self.started: tuple[int, torch.Tensor] | None = None

        def on_train_start(self) -> None:
            self.started = (self.trainer.global_step, self.net.weight.detach().clone())

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            loss: torch.Tensor = self.net(batch[0]).pow(2).mean()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=8)
    repo = cas.open(tmp_path / "store")
    plugins: list[Any] = []
    if route == "plugin":
        dirpath: str | Path = tmp_path / "ckpts"
        plugins = [CASCheckpointIO(repo, "runs/lit")]
    else:
        dirpath = "cas://runs/lit"  # the store is $CAS_STORE
    checkpoints = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_last=True)
    trainer = L.Trainer(
        max_steps=max_steps, plugins=plugins, callbacks=[checkpoints], logger=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    torch.manual_seed(max_steps)  # each run starts from other weights
    model = Regressor()
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return trainer, model, repo


def stored_lightning_checkpoint(repo: cas.Repository, route: str, name: str) -> dict[str, Any]:
    if route == "plugin":
        return dict(repo.load(f"runs/lit/{name}"))
    from cas.fs.filesystem import CASFileSystem

    with CASFileSystem(repo=repo, skip_instance_cache=True).open(f"runs/lit/{name}", "rb") as f:
        loaded: dict[str, Any] = torch.load(f, weights_only=True)
    return loaded


LIGHTNING_ROUTES = ["plugin", "cas_url"]


@pytest.fixture
def cas_store_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``$CAS_STORE`` names the test's store, for ``cas://`` paths Lightning opens itself."""
    monkeypatch.setenv("CAS_STORE", str(tmp_path / "store"))
    cas.open(tmp_path / "store")
    return tmp_path / "store"


@pytest.mark.parametrize("route", LIGHTNING_ROUTES)
def test_lightning_fit_last_resumes_from_the_store_at_the_step_it_stopped(
    tmp_path: Path, cas_store_env: Path, route: str
) -> None:
    first, trained, repo = lightning_run(tmp_path, route, max_steps=4, ckpt_path="last")
    assert first.global_step == 4 and trained.started[0] == 0  # nothing to resume yet
    saved = stored_lightning_checkpoint(repo, route, "last.ckpt")
    assert saved["global_step"] == 4
    assert torch.equal(saved["state_dict"]["net.weight"], trained.net.weight.detach())

    resumed, model, _ = lightning_run(tmp_path, route, max_steps=6, ckpt_path="last")
    step, weights = model.started
    assert step == 4, "trained from scratch instead of resuming"
    assert torch.equal(weights, trained.net.weight.detach())
    assert resumed.global_step == 6
    assert stored_lightning_checkpoint(repo, route, "last.ckpt")["global_step"] == 6


def lightning_names(repo: cas.Repository, route: str) -> list[str]:
    if route == "plugin":
        return [r.name.rpartition("/")[2] for r in repo.refs("runs/lit/") if "ckpt" in r.name]
    return [name for name in repo.show("runs/lit")["files"] if name.endswith(".ckpt")]


@pytest.mark.parametrize("route", LIGHTNING_ROUTES)
def test_a_lightning_rerun_keeps_the_previous_runs_checkpoints_as_local_disk_would(
    tmp_path: Path, cas_store_env: Path, route: str
) -> None:
    # On local disk a second run into the same directory writes last-v1.ckpt and
    # epoch=0-step=4-v1.ckpt next to the first run's files; "last" is then the newer one.
    _, first, repo = lightning_run(tmp_path, route, max_steps=4)
    before = stored_lightning_checkpoint(repo, route, "last.ckpt")
    _, second, _ = lightning_run(tmp_path, route, max_steps=4)
    assert sorted(lightning_names(repo, route)) == [
        "epoch=0-step=4-v1.ckpt", "epoch=0-step=4.ckpt", "last-v1.ckpt", "last.ckpt",
    ]  # fmt: skip
    kept = stored_lightning_checkpoint(repo, route, "last.ckpt")
    assert torch.equal(kept["state_dict"]["net.weight"], before["state_dict"]["net.weight"])
    assert torch.equal(kept["state_dict"]["net.weight"], first.net.weight.detach())

    _, resumed, _ = lightning_run(tmp_path, route, max_steps=6, ckpt_path="last")
    step, weights = resumed.started
    assert step == 4 and torch.equal(weights, second.net.weight.detach())


@pytest.mark.parametrize("route", LIGHTNING_ROUTES)
def test_lightning_last_after_a_rerun_is_the_reruns_last_checkpoint(
    tmp_path: Path, cas_store_env: Path, route: str
) -> None:
    lightning_run(tmp_path, route, max_steps=4)  # last.ckpt at step 4
    _, second, repo = lightning_run(tmp_path, route, max_steps=6)  # last-v1.ckpt at step 6
    assert stored_lightning_checkpoint(repo, route, "last-v1.ckpt")["global_step"] == 6

    _, resumed, _ = lightning_run(tmp_path, route, max_steps=8, ckpt_path="last")
    step, weights = resumed.started
    assert step == 6, "resumed from the first run's last.ckpt, not the newest last"
    assert torch.equal(weights, second.net.weight.detach())


@pytest.mark.parametrize("protect", ["runs/lit/**", "**/last.ckpt"])
def test_lightning_moves_last_at_every_save_though_the_policy_protects_it(
    tmp_path: Path, cas_store_env: Path, protect: str
) -> None:
    from cas.retention.policy import RetentionPolicy

    cas.open(cas_store_env).store_retention_policy(RetentionPolicy(protect=(protect,)))
    _, _, repo = lightning_run(tmp_path, "plugin", max_steps=4)  # last.ckpt at steps 2 and 4
    assert stored_lightning_checkpoint(repo, "plugin", "last.ckpt")["global_step"] == 4

    resumed, model, _ = lightning_run(tmp_path, "plugin", max_steps=6, ckpt_path="last")
    assert model.started[0] == 4 and resumed.global_step == 6
    assert stored_lightning_checkpoint(repo, "plugin", "last.ckpt")["global_step"] == 6


# -- torch.distributed.checkpoint -----------------------------------------------------------------


@dataclass
class Opaque:
    """A value DCP can only pickle: loading it needs this class, which weights_only refuses."""

    name: str


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def test_a_dcp_save_onto_a_gate_is_refused_before_any_byte_unless_overwrite(
    tmp_path: Path,
) -> None:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_saver import save

    from cas.errors import ProtectedRef
    from cas.training.integrations.dcp import CASStorageWriter

    repo = cas.open(tmp_path / "store")
    model, _ = trained()
    save({"model": model.state_dict()}, storage_writer=CASStorageWriter(repo),
         checkpoint_id="runs/d/gates/g")  # fmt: skip
    old, chunks = repo.resolve("runs/d/gates/g"), chunk_count(repo)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    # DCP wraps a writer's error in its CheckpointException (a BaseException), which quotes it.
    with pytest.raises(
        CheckpointException, match=f"{ProtectedRef.__name__}: runs/d/gates/g is a gate"
    ):
        save({"model": model.state_dict()}, storage_writer=CASStorageWriter(repo),
             checkpoint_id="runs/d/gates/g")  # fmt: skip
    assert repo.resolve("runs/d/gates/g") == old and chunk_count(repo) == chunks
    writer = CASStorageWriter(repo, overwrite=True)
    save({"model": model.state_dict()}, storage_writer=writer, checkpoint_id="runs/d/gates/g")
    assert repo.resolve("runs/d/gates/g") != old


def test_dcp_round_trip_writes_no_files_and_dedups_a_second_save(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    from cas.training.integrations.dcp import CASStorageReader, CASStorageWriter

    repo = cas.open(tmp_path / "store")
    model, opt = trained()
    state: dict[str, Any] = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 5}
    save(state, storage_writer=CASStorageWriter(repo), checkpoint_id="runs/d/step5")
    chunks = chunk_count(repo)
    save(state, storage_writer=CASStorageWriter(repo), checkpoint_id="runs/d/step5-again")
    assert chunk_count(repo) == chunks
    paths = [t["path"] for t in repo.show("runs/d/step5")["tensors"]]
    assert "data.model.weight" in paths and "data.optim.state.0.exp_avg_sq" in paths

    other, other_opt = trained()
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.zero_()
    target: dict[str, Any] = {
        "model": other.state_dict(),
        "optim": other_opt.state_dict(),
        "step": 0,
    }
    load(target, storage_reader=CASStorageReader(repo), checkpoint_id="runs/d/step5")
    assert target["step"] == 5
    assert torch.equal(target["model"]["weight"], model.state_dict()["weight"])
    saved_moments = opt.state_dict()["state"][0]["exp_avg_sq"]
    assert torch.equal(target["optim"]["state"][0]["exp_avg_sq"], saved_moments)
    assert not list(tmp_path.glob("**/.metadata"))


def test_dcp_async_save_commits_the_ref_when_its_future_completes(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_saver import async_save

    from cas.training.integrations.dcp import CASStorageWriter

    repo = cas.open(tmp_path / "store")
    model, _ = trained()
    future = async_save(
        {"model": model.state_dict()}, storage_writer=CASStorageWriter(repo),
        checkpoint_id="runs/d/async",
    )  # fmt: skip
    assert isinstance(future, concurrent.futures.Future)
    future.result()
    loaded = repo.load("runs/d/async", keys="data.*")["data"]
    assert torch.equal(loaded["model.weight"], model.state_dict()["weight"])


def test_dcp_refuses_pickled_values_that_need_arbitrary_classes(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    from cas.training.integrations.dcp import CASStorageReader, CASStorageWriter

    repo = cas.open(tmp_path / "store")
    save(
        {"w": torch.ones(3), "tag": Opaque("x")},
        storage_writer=CASStorageWriter(repo), checkpoint_id="runs/d/odd",
    )  # fmt: skip
    target: dict[str, Any] = {"w": torch.zeros(3), "tag": None}
    # DCP wraps a reader's error in its CheckpointException; ours is inside, by name.
    with pytest.raises(CheckpointException, match=r"(?s)FormatError.*allow_pickled_values"):
        load(target, storage_reader=CASStorageReader(repo), checkpoint_id="runs/d/odd")
    load(
        target, storage_reader=CASStorageReader(repo, allow_pickled_values=True),
        checkpoint_id="runs/d/odd",
    )  # fmt: skip
    assert target["tag"] == Opaque("x")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_dcp_two_ranks_write_one_manifest_and_load_resharded(tmp_path: Path) -> None:
    script = Path(__file__).with_name("dcp_rank_script.py")
    store, port = tmp_path / "store", free_port()
    cas.open(store).close()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(store), str(rank), "2", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0 and f"ok {rank}" in out, err[-3000:]
    with cas.open(store) as repo:
        paths = sorted(t["path"] for t in repo.show("runs/dist/step7")["tensors"])
    assert paths == [
        "data.only_rank0", "data.only_rank1", "data.step", "data.weight", "data.weight@32,0"
    ]  # fmt: skip
