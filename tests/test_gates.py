"""Gates belong to their run, and no gate, best pointer or protected ref is replaced silently."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import cas
from cas.digest import Digest
from cas.errors import AlreadyExists, ProtectedRef
from cas.refs.records import RefRecord
from cas.retention.policy import RetentionPolicy, Rule
from cas.training.manager import CheckpointManager
from tests.helpers import chunk_files, run_cli


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


# -- every writer, not only copies -----------------------------------------------------------------

PROTECTED = ["gates/bc_best", "runs/r1/gates/bc_best", "runs/r1/phase1/best", "keep/forever"]


def protecting_repo(tmp_path: Path) -> cas.Repository:
    """A store whose policy protects ``keep/**`` (gates and best pointers need no policy)."""
    repo = cas.open(tmp_path / "store")
    repo.store_retention_policy(
        RetentionPolicy(rules=(Rule("runs/*/phase*/ckpt_*", keep_last=3),), protect=("keep/**",))
    )
    return repo


@pytest.mark.parametrize("dst", PROTECTED)
def test_saving_onto_a_gate_best_or_protected_ref_is_refused_before_any_chunk_is_written(
    tmp_path: Path, dst: str
) -> None:
    repo = protecting_repo(tmp_path)
    old = repo.save(weights(1.0), dst)  # creating it is fine
    chunks = chunk_files(repo)
    with pytest.raises(
        ProtectedRef, match=rf"^{dst} is .* replace it explicitly with overwrite=True"
    ):
        repo.save(weights(2.0), dst)
    assert repo.resolve(dst) == old
    assert chunk_files(repo) == chunks  # refused up front, not after writing the state


@pytest.mark.parametrize("dst", PROTECTED)
def test_saving_onto_a_gate_with_overwrite_replaces_it(tmp_path: Path, dst: str) -> None:
    repo = protecting_repo(tmp_path)
    repo.save(weights(1.0), dst)
    new = repo.save(weights(2.0), dst, overwrite=True)
    assert repo.resolve(dst) == new
    assert torch.equal(repo.load(dst)["w"], weights(2.0)["w"])
    assert [e.op for e in repo.log(dst)] == ["save", "save"]  # the old target stays in history


def test_ingesting_files_onto_a_gate_is_refused_unless_overwrite(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    (tmp_path / "a.bin").write_bytes(b"a" * 1000)
    (tmp_path / "b.bin").write_bytes(b"b" * 1000)
    old = repo.put_path(tmp_path / "a.bin", "runs/r1/gates/data")
    with pytest.raises(ProtectedRef):
        repo.put_path(tmp_path / "b.bin", "runs/r1/gates/data")
    assert repo.resolve("runs/r1/gates/data") == old
    new = repo.put_path(tmp_path / "b.bin", "runs/r1/gates/data", overwrite=True)
    assert repo.resolve("runs/r1/gates/data") == new


def test_moving_a_gate_by_set_ref_or_update_ref_needs_overwrite(repo: cas.Repository) -> None:
    old = repo.save(weights(1.0), "runs/r1/gates/g")
    new = repo.save(weights(2.0), "runs/r1/ckpt_b")
    with pytest.raises(ProtectedRef):
        repo.set_ref("runs/r1/gates/g", new)
    with pytest.raises(ProtectedRef):
        repo.update_ref("runs/r1/gates/g", lambda current: new, op="edit")
    assert repo.resolve("runs/r1/gates/g") == old
    repo.set_ref("runs/r1/gates/g", old)  # pointing it where it points changes nothing: allowed
    assert repo.update_ref("runs/r1/gates/g", lambda c: new, op="edit", overwrite=True)
    assert repo.resolve("runs/r1/gates/g") == new


def test_a_gate_created_by_a_racing_writer_is_not_replaced(repo: cas.Repository) -> None:
    theirs = repo.save(weights(1.0), "runs/r1/ckpt_a")
    ours = repo.save(weights(2.0), "runs/r1/ckpt_b")
    raced = False

    def point(current: RefRecord | None) -> Digest:
        nonlocal raced
        if current is None and not raced:  # another writer creates the gate right now
            raced = True
            repo.cp("runs/r1/ckpt_a", "runs/r1/gates/g")
        return ours

    with pytest.raises(ProtectedRef):
        repo.update_ref("runs/r1/gates/g", point, op="edit")
    assert repo.resolve("runs/r1/gates/g") == theirs


def test_cas_put_onto_a_protected_ref_fails_in_one_line_unless_forced(tmp_path: Path) -> None:
    store = tmp_path / "store"
    repo = protecting_repo(tmp_path)
    (tmp_path / "v1.bin").write_bytes(b"1" * 4096)
    (tmp_path / "v2.bin").write_bytes(b"2" * 4096)
    old = repo.put_path(tmp_path / "v1.bin", "keep/forever")

    refused = run_cli(store, "put", str(tmp_path / "v2.bin"), "keep/forever")
    assert refused.returncode == 1, refused
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "keep/forever" in lines[0] and "--force" in lines[0], lines
    assert "overwrite=True" not in lines[0], lines  # the flag, not the Python argument
    assert cas.open(store).resolve("keep/forever") == old
    forced = run_cli(store, "put", "--force", str(tmp_path / "v2.bin"), "keep/forever")
    assert forced.returncode == 0, forced.stderr
    assert cas.open(store).load("keep/forever")["v2.bin"] == b"2" * 4096


def test_writing_into_a_gate_through_cas_urls_is_refused_unless_opened_with_overwrite(
    repo: cas.Repository,
) -> None:
    from cas.fs.filesystem import CASFileSystem

    fs = CASFileSystem(repo=repo, skip_instance_cache=True)
    fs.pipe_file("runs/r1/gates/cfg/config.json", b"{}")  # creating the gate is fine
    old = repo.resolve("runs/r1/gates/cfg")
    with pytest.raises(FileExistsError, match="runs/r1/gates/cfg is a gate"):
        fs.open("runs/r1/gates/cfg/config.json", "wb")  # refused at open, before any byte
    with pytest.raises(FileExistsError):
        fs.rm("runs/r1/gates/cfg/config.json")
    assert repo.resolve("runs/r1/gates/cfg") == old
    with fs.open("runs/r1/gates/cfg/config.json", "wb", overwrite=True) as f:
        f.write(b'{"lr": 1}')
    assert fs.cat_file("runs/r1/gates/cfg/config.json") == b'{"lr": 1}'


def test_copying_onto_a_pointer_whose_targets_the_policy_protects_moves_it(
    repo: cas.Repository,
) -> None:
    # protect_targets_of keeps what "latest" names; the pointer itself moves at every save.
    repo.store_retention_policy(
        RetentionPolicy(
            rules=(Rule("cobre/policy/ckpt_*", keep_last=3, protect_targets_of=("**/latest",)),)
        )
    )
    repo.save(weights(1.0), "cobre/policy/ckpt_1")
    second = repo.save(weights(2.0), "cobre/policy/ckpt_2")
    repo.cp("cobre/policy/ckpt_1", "cobre/policy/latest")
    assert repo.cp("cobre/policy/ckpt_2", "cobre/policy/latest") == second


def test_a_run_that_resumes_from_an_earlier_step_saves_its_protected_steps_again_with_a_warning(
    repo: cas.Repository, caplog: pytest.LogCaptureFixture
) -> None:
    # The policy protects every checkpoint of the run, latest and best included: the manager's
    # own moves (latest, best, history, its step refs) go on; replaying a step says so.
    repo.store_retention_policy(RetentionPolicy(protect=("runs/r1/**",)))
    with CheckpointManager(repo, run="r1", best=("loss", "min"), signals=False) as mgr:
        for step in (10, 20):
            mgr.save(step, weights(float(step)), {"loss": 1.0 / step})
        mgr.wait()
        old_20 = repo.resolve(mgr.checkpoint_ref(20))
    with CheckpointManager(repo, run="r1", best=("loss", "min"), signals=False) as mgr:
        restored = mgr.restore("resume", source=mgr.checkpoint_ref(10))
        assert restored.step == 10
        with caplog.at_level(logging.WARNING, logger="cas.training.manager"):
            result = mgr.save(20, weights(-20.0), {"loss": 0.01}).result()
        assert mgr.finish(20, weights(-20.0), {"loss": 0.01}).step == 20
    assert result.digest != old_20
    assert any(
        "re-saved step 20 over runs/r1/phase1/ckpt_phase1_step00000020" in r.getMessage()
        and old_20[:16] in r.getMessage()
        for r in caplog.records
    ), caplog.text
    assert repo.resolve("runs/r1/latest") == repo.resolve(mgr.checkpoint_ref(20))
    assert repo.resolve("runs/r1/phase1/best") == repo.resolve(mgr.checkpoint_ref(20))
    assert old_20 in [e.target for e in repo.log(mgr.checkpoint_ref(20))]
