"""A save carries the user's description and tags; the final save never writes a state twice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import cas
from cas.cli import cli
from cas.errors import FormatError
from cas.training.history import TrainingHistory
from cas.training.manager import CheckpointManager


def state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((4096,), value)}}


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


def test_save_metadata_is_stored_in_the_manifest_and_shown_by_cas_show(store: Path) -> None:
    repo = cas.open(store)
    with CheckpointManager(repo, run="r1", signals=False) as mgr:
        pending = mgr.save(
            10, state(1.0), {"loss": 0.5},
            metadata={"description": "after warm-up", "tags": ["baseline", "lr-3e-4"]},
        )  # fmt: skip
        ref = pending.result().ref
    meta = repo.show(ref)["meta"]
    assert meta["description"] == "after warm-up"
    assert meta["tags"] == ["baseline", "lr-3e-4"]
    assert meta["step"] == 10 and meta["metrics"] == {"loss": 0.5}
    shown = CliRunner().invoke(cli, ["--store", str(store), "show", ref])
    assert shown.exit_code == 0, shown.output
    assert "description = after warm-up" in shown.output
    assert "tags = ['baseline', 'lr-3e-4']" in shown.output


def test_metadata_may_not_reuse_the_managers_keys_or_hold_objects(store: Path) -> None:
    with CheckpointManager(cas.open(store), run="r1", signals=False) as mgr:
        with pytest.raises(ValueError, match="status, step are the manager's own"):
            mgr.save(1, state(1.0), metadata={"status": "great", "step": 3})
        with pytest.raises(FormatError, match="metadata value 'owner' is a object"):
            mgr.save(1, state(1.0), metadata={"owner": object()})
    assert not cas.open(store).refs("runs/r1/phase1/")


def test_finish_right_after_the_last_periodic_save_does_not_write_the_state_again(
    store: Path,
) -> None:
    repo = cas.open(store)
    calls = []

    def state_at_the_end() -> dict[str, Any]:
        calls.append(1)
        return state(2.0)

    with CheckpointManager(
        repo, run="r1", signals=False, every_n_steps=5, best=("loss", "min")
    ) as mgr:
        mgr.step_end(5, state(1.0), {"loss": 1.0})
        periodic = mgr.step_end(10, state(2.0), {"loss": 0.5})
        assert periodic is not None
        saved = periodic.result()
        final = mgr.finish(10, state_at_the_end, metadata={"description": "done"})
    assert calls == []  # the state was not built, copied or hashed again
    assert final.new_bytes == 0 and final.ref == saved.ref and final.is_best
    meta = repo.show("runs/r1/latest")["meta"]
    assert (meta["status"], meta["trigger"], meta["description"]) == ("completed", "final", "done")
    assert repo.resolve("runs/r1/latest") == repo.resolve(saved.ref) == final.digest
    assert repo.resolve("runs/r1/phase1/best") == final.digest
    assert repo.manifest(final.digest).tensors == repo.manifest(saved.digest).tensors
    assert torch.equal(repo.load(saved.ref)["state"]["model"]["w"], state(2.0)["model"]["w"])
    saves = [r for r in TrainingHistory(repo, "runs/r1/history").read() if r["event"] == "save"]
    assert [(r["step"], r["trigger"]) for r in saves] == [
        (5, "periodic"),
        (10, "periodic"),
        (10, "final"),
    ]
    assert saves[-1]["same_state_as"] == saved.digest


def test_finish_after_more_steps_than_were_saved_saves_the_final_state(store: Path) -> None:
    repo = cas.open(store)
    with CheckpointManager(repo, run="r1", signals=False, every_n_steps=5) as mgr:
        mgr.step_end(5, state(1.0))
        final = mgr.finish(7, state(3.0))
    assert final.ref.endswith("step00000007") and final.new_bytes > 0
    assert repo.show("runs/r1/latest")["meta"]["status"] == "completed"
