"""The remote tier through the framework integrations: the HF Trainer callback and Lightning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import cas
from tests.prerequisites import require_module
from tests.test_integrations import HF_EXTRA, LIGHTNING_EXTRA, Tokens, tiny_bert


def test_hf_trainer_checkpoints_drain_to_the_remote_tier(tmp_path: Path) -> None:
    require_module("transformers", HF_EXTRA)
    from transformers import Trainer, TrainingArguments

    from cas.training.integrations.hf import CASCallback

    repo, remote = cas.open(tmp_path / "store"), cas.open(tmp_path / "remote")
    callback = CASCallback(repo, "runs/bert", remote=remote)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=4, save_steps=2, save_strategy="steps",
        per_device_train_batch_size=4, report_to=[], use_cpu=True, disable_tqdm=True,
        logging_steps=100,
    )  # fmt: skip
    Trainer(model=tiny_bert(), args=args, train_dataset=Tokens(), callbacks=[callback]).train()
    assert callback.tier is None  # stopped at the end of training, after catching up
    for ref in ("runs/bert/ckpt_step00000002", "runs/bert/ckpt_step00000004"):
        assert remote.resolve(ref) == repo.resolve(ref)
    assert remote.resolve("runs/bert/latest") == repo.resolve("runs/bert/ckpt_step00000004")


def _fit_lightning(tmp_path: Path, io: Any) -> None:
    L = require_module("lightning", LIGHTNING_EXTRA)
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Regressor(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            loss: torch.Tensor = self.net(batch[0]).pow(2).mean()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=8)
    checkpoints = ModelCheckpoint(
        dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_top_k=1, monitor="step",
        mode="max",
    )  # fmt: skip
    trainer = L.Trainer(
        max_steps=6, plugins=[io], callbacks=[checkpoints], logger=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    trainer.fit(Regressor(), loader)


STEPS = ["runs/lit/epoch=0-step=2.ckpt", "runs/lit/epoch=0-step=4.ckpt"]
LAST = "runs/lit/epoch=0-step=6.ckpt"


def test_lightning_checkpoints_drain_to_the_remote_tier_and_top_k_prunes_only_locally(
    tmp_path: Path,
) -> None:
    from cas.training.integrations.lightning import CASCheckpointIO

    repo, remote = cas.open(tmp_path / "store"), cas.open(tmp_path / "remote")
    io = CASCheckpointIO(repo, "runs/lit", remote=remote)
    _fit_lightning(tmp_path, io)
    io.teardown()
    # save_top_k=1 pruned the local store; the remote (no policy: it keeps all) has every save.
    assert repo.ref_names("runs/lit/*.ckpt") == [LAST]
    assert remote.ref_names("runs/lit/*.ckpt") == [*STEPS, LAST]
    assert remote.resolve("runs/lit/latest") == repo.resolve(LAST)


def test_lightning_top_k_keeps_a_checkpoint_the_remote_still_needs(tmp_path: Path) -> None:
    from cas.training.integrations.lightning import CASCheckpointIO

    repo, remote = cas.open(tmp_path / "store"), cas.open(tmp_path / "remote")
    io = CASCheckpointIO(repo, "runs/lit", remote=remote)
    assert io.tier is not None
    io.tier.close(0)  # the remote is unreachable from here on: nothing drains
    _fit_lightning(tmp_path, io)
    # save_top_k=1 asked to remove steps 2 and 4; the remote (which keeps all) lacks them.
    assert repo.ref_names("runs/lit/*.ckpt") == [*STEPS, LAST]
    assert remote.ref_names() == []


def test_the_integrations_take_remote_retry_as_the_manager_does(tmp_path: Path) -> None:
    from cas.training.integrations.hf import CASCallback
    from cas.training.integrations.lightning import CASCheckpointIO

    repo, remote = cas.open(tmp_path / "store"), cas.open(tmp_path / "remote")
    io = CASCheckpointIO(repo, "runs/lit", remote=remote, remote_retry=0.25)
    assert io.tier is not None and (io.tier.retry, io.tier.max_retry) == (0.25, 60.0)
    io.teardown()
    callback = CASCallback(repo, "runs/bert", remote=remote, remote_retry=120.0)
    tier = callback._tier("runs/bert")  # started at the first save, once the prefix is known
    assert tier is not None and (tier.retry, tier.max_retry) == (120.0, 120.0)
    tier.close(0)
