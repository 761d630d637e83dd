"""Gates belong to their run, and no gate, best pointer or protected ref is replaced silently."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import cas
from cas.errors import AlreadyExists
from cas.retention.policy import RetentionPolicy, Rule
from cas.training.manager import CheckpointManager
from tests.helpers import run_cli


def weights(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), value)}


@pytest.fixture
def repo(tmp_path: Path) -> cas.Repository:
    return cas.open(tmp_path / "store")


def test_two_runs_promoting_the_same_gate_name_keep_separate_gates(repo: cas.Repository) -> None:
    for run, value in (("run_a", 1.0), ("run_b", 2.0)):
        with CheckpointManager(repo, run=run, signals=False, async_save=False) as mgr:
            mgr.save(10, weights(value))
            mgr.promote_gate("bc_best")
    for run, value in (("run_a", 1.0), ("run_b", 2.0)):
        gate = f"runs/{run}/gates/bc_best"
        assert torch.equal(repo.load(gate)["state"]["w"], weights(value)["w"])
        with CheckpointManager(repo, run=run, signals=False) as mgr:
            assert torch.equal(mgr.load_gate("bc_best")["w"], weights(value)["w"])
    assert not repo.refs("gates/")


def test_promoting_a_gate_again_to_another_checkpoint_needs_overwrite(
    repo: cas.Repository,
) -> None:
    with CheckpointManager(repo, run="r1", signals=False, async_save=False) as mgr:
        first = mgr.save(10, weights(1.0)).result().digest
        mgr.promote_gate("bc_best")
        mgr.promote_gate("bc_best")  # the same checkpoint again changes nothing: allowed
        second = mgr.save(20, weights(2.0)).result().digest
        with pytest.raises(AlreadyExists, match=r"runs/r1/gates/bc_best is a gate.*overwrite"):
            mgr.promote_gate("bc_best")
        assert repo.resolve(mgr.gate_ref("bc_best")) == first
        assert mgr.promote_gate("bc_best", overwrite=True) == second
    assert repo.resolve("runs/r1/gates/bc_best") == second


@pytest.mark.parametrize(
    "dst",
    ["gates/bc_best", "runs/r1/gates/bc_best", "runs/r1/phase1/best", "keep/forever"],
)
def test_copying_onto_a_gate_best_or_policy_protected_ref_is_refused_without_overwrite(
    repo: cas.Repository, dst: str
) -> None:
    repo.store_retention_policy(
        RetentionPolicy(rules=(Rule("runs/*/phase*/ckpt_*", keep_last=3),), protect=("keep/**",))
    )
    old = repo.save(weights(1.0), "runs/r1/phase1/ckpt_a")
    new = repo.save(weights(2.0), "runs/r1/phase1/ckpt_b")
    repo.cp("runs/r1/phase1/ckpt_a", dst)  # creating it is fine
    with pytest.raises(AlreadyExists, match="overwrite=True"):
        repo.cp("runs/r1/phase1/ckpt_b", dst)
    with pytest.raises(AlreadyExists):
        repo.cp("runs/r1/phase1/ckpt_b", dst, only="w")
    assert repo.resolve(dst) == old
    assert repo.cp("runs/r1/phase1/ckpt_b", dst, overwrite=True) == new
    assert repo.resolve(dst) == new


def test_copying_onto_an_unprotected_ref_replaces_it_as_before(repo: cas.Repository) -> None:
    repo.save(weights(1.0), "runs/r1/a")
    new = repo.save(weights(2.0), "runs/r1/b")
    repo.cp("runs/r1/a", "scratch/copy")
    assert repo.cp("runs/r1/b", "scratch/copy") == new


def test_cas_cp_onto_an_existing_gate_fails_in_one_line_unless_forced(tmp_path: Path) -> None:
    store = tmp_path / "store"
    repo = cas.open(store)
    old = repo.save(weights(1.0), "runs/r1/ckpt_a")
    new = repo.save(weights(2.0), "runs/r1/ckpt_b")
    repo.cp("runs/r1/ckpt_a", "runs/r1/gates/bc_best")

    refused = run_cli(store, "cp", "runs/r1/ckpt_b", "runs/r1/gates/bc_best")
    assert refused.returncode == 1, refused
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "is a gate" in lines[0] and "--force" in lines[0], lines
    assert cas.open(store).resolve("runs/r1/gates/bc_best") == old
    forced = run_cli(store, "cp", "--force", "runs/r1/ckpt_b", "runs/r1/gates/bc_best")
    assert forced.returncode == 0, forced.stderr
    assert cas.open(store).resolve("runs/r1/gates/bc_best") == new
