"""A stored policy's daily weights-only snapshot: the cron job is just `cas forget --prune`."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import torch
from click.testing import CliRunner

import cas
from cas.cli import cli
from cas.repo.repository import Repository
from cas.retention.policy import DailySnapshot, RetentionPolicy, Rule
from tests.retention_helpers import DAY, HOUR, FakeClock, memory_repo, utc

POLICY = RetentionPolicy(
    rules=(Rule("checkpoints/*", keep_last=2),),
    snapshots=(DailySnapshot("checkpoints/*", keep=3, protect_days=2),),
)


def _checkpoint(step: int) -> dict[str, dict[str, torch.Tensor]]:
    return {
        "model": {"w": torch.full((512,), float(step))},
        "optimizer": {"m": torch.full((2048,), -float(step))},
    }


def _train_a_day(repo: Repository, clock: FakeClock, day: float, first_step: int) -> None:
    for i, hour in enumerate((10, 20)):
        clock.set(day + hour * HOUR)
        step = first_step + 1000 * i
        repo.save(_checkpoint(step), f"checkpoints/checkpoint-{step}", {"step": step})


def test_each_nightly_forget_takes_one_weights_only_snapshot_and_keeps_the_last_three() -> None:
    start = utc("2026-11-20 00:00")
    clock = FakeClock(start)
    repo = memory_repo(clock)
    repo.store_retention_policy(POLICY)
    for n in range(5):
        day = start + n * DAY
        _train_a_day(repo, clock, day, first_step=(n + 1) * 10_000)
        clock.set(day + DAY + 3 * HOUR)  # the cron job at 03:00 the next morning
        repo.forget()
        repo.forget()  # a second run the same day takes no second snapshot
    snapshots = repo.ref_names("snapshots/")
    assert snapshots == ["snapshots/2026-11-23", "snapshots/2026-11-24", "snapshots/2026-11-25"]
    # Each is the newest checkpoint the night before, weights only, and writes no chunk.
    for name, step in zip(snapshots, (31_000, 41_000, 51_000), strict=True):
        record = repo.find_ref(name)
        assert record is not None
        assert record.history[-1].message == f"daily snapshot of checkpoints/checkpoint-{step}"
        state = repo.load(name)
        assert set(state) == {"model"}
        assert torch.equal(state["model"]["w"], torch.full((512,), float(step)))
    source = repo.manifest("checkpoints/checkpoint-51000").chunk_digests()
    assert repo.manifest("snapshots/2026-11-25").chunk_digests() <= source
    assert repo.ref_names("checkpoints/") == [
        "checkpoints/checkpoint-50000",
        "checkpoints/checkpoint-51000",
    ]
    # `cas status` counts the snapshots apart from the checkpoints.
    status = repo.status(clock=clock)
    assert (status.checkpoints, status.snapshots) == (2, 3)
    assert status.newest is not None and status.newest.ref == "checkpoints/checkpoint-51000"
    assert status.newest_snapshot is not None
    assert status.newest_snapshot.ref == "snapshots/2026-11-25"


def test_a_dry_run_names_the_snapshot_it_would_take_and_takes_none() -> None:
    clock = FakeClock(utc("2026-11-20 10:00"))
    repo = memory_repo(clock)
    repo.store_retention_policy(POLICY)
    repo.save(_checkpoint(1), "checkpoints/checkpoint-1")
    [taken] = repo.take_snapshots(dry_run=True)
    assert (taken.ref, taken.source, taken.created) == (
        "snapshots/2026-11-20",
        "checkpoints/checkpoint-1",
        False,
    )
    assert repo.ref_names("snapshots/") == []


def test_a_snapshot_whose_source_matches_nothing_says_so() -> None:
    clock = FakeClock(utc("2026-11-20 10:00"))
    repo = memory_repo(clock)
    [taken] = repo.take_snapshots(POLICY)
    assert not taken.created and taken.note == "no checkpoint matches 'checkpoints/*'"


def test_the_stored_policy_keeps_its_daily_snapshot_across_a_round_trip() -> None:
    doc = json.loads(json.dumps(POLICY.to_dict()))
    assert RetentionPolicy.from_dict(doc) == POLICY
    assert "daily snapshot snapshots/{date} <- newest checkpoints/* (model.*)" in "\n".join(
        POLICY.describe()
    )


def test_cron_job_is_just_cas_forget_prune(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    repo = cas.open(store)
    repo.save(_checkpoint(1), "checkpoints/checkpoint-1")
    repo.save(_checkpoint(2), "checkpoints/checkpoint-2")
    runner = CliRunner()
    args = ["--store", store, "policy", "add", "--daily-snapshot", "checkpoints/*"]
    result = runner.invoke(cli, [*args, "--snapshot-keep", "2", "--snapshot-only", "model.*"])
    assert result.exit_code == 0, result.output
    assert "daily snapshot snapshots/{date} <- newest checkpoints/* (model.*), keep last 2" in (
        result.output
    )
    days = {dt.datetime.now(dt.timezone.utc).date().isoformat()}
    result = runner.invoke(cli, ["--store", store, "forget", "--prune"])
    days.add(dt.datetime.now(dt.timezone.utc).date().isoformat())
    assert result.exit_code == 0, result.output
    [name] = cas.open(store).ref_names("snapshots/")
    assert name.removeprefix("snapshots/") in days
    assert f"snapshot {name}: copied checkpoints/checkpoint-2 (model.*)" in result.output
    again = runner.invoke(cli, ["--store", store, "forget", "--json"])
    assert json.loads(again.output)["snapshots"] == [
        {"ref": name, "source": None, "created": False, "note": "exists"}
    ]
