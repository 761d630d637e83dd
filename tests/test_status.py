"""`cas status`: the retention manager's morning report, checked against a scripted run."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner

from cas.cli import cli
from cas.repo.repository import Repository
from cas.retention.policy import RetentionPolicy, Rule
from cas.training.manager import CheckpointManager
from tests.retention_helpers import HOUR, FakeClock, local_repo, memory_repo, utc

START = utc("2026-11-20 10:00")
TEN_MINUTES = HOUR / 6
LOSSES = [3.0, 1.0, 2.0, 2.5]
POLICY = RetentionPolicy(
    rules=(
        Rule(
            "runs/*/phase*/ckpt_*",
            keep_last=2,
            protect_targets_of=("runs/*/phase*/best",),
        ),
    ),
    max_total_bytes=1 << 20,
)


def _scripted_run(repo: Repository, clock: FakeClock) -> None:
    """Saves of distinct weights ten minutes apart (best: step 2), a gate, a stored policy."""
    with CheckpointManager(
        repo, run="r1", signals=False, async_save=False, best=("loss", "min"), clock=clock
    ) as mgr:
        for step, loss in enumerate(LOSSES, start=1):
            clock.set(START + step * TEN_MINUTES)
            mgr.save(step, {"w": torch.full((2048,), float(step))}, {"loss": loss}).result()
        mgr.promote_gate("bc_best")
    repo.store_retention_policy(POLICY)


def test_status_reports_usage_protection_runs_and_pending_gc_after_a_forget() -> None:
    clock = FakeClock(START)
    repo = memory_repo(clock)
    _scripted_run(repo, clock)
    before = repo.status()
    assert (before.refs, before.checkpoints, before.protected_refs) == (8, 4, 4)
    assert before.forget_would_remove == 1  # step 1: not in the last 2, not best
    assert before.budget == 1 << 20 and before.has_policy

    clock.set(START + 45 * 60)
    plan = repo.plan_forget()
    assert [d.ref for d in plan.dropped] == ["runs/r1/phase1/ckpt_phase1_step00000001"]
    plan.execute()
    status = repo.status()

    # Usage: what the refs reach is what the forget plan said would remain.
    assert status.referenced_bytes == plan.bytes_after
    assert status.usage_pct == 100.0 * plan.bytes_after / (1 << 20)
    assert status.stored_bytes >= status.referenced_bytes + plan.freed_bytes
    # Protected: the gate, best, the checkpoint best names, the group's latest.
    assert (status.refs, status.protected_refs, status.forget_would_remove) == (7, 4, 0)
    assert status.checkpoints == 3
    assert status.oldest is not None and status.newest is not None
    assert (status.oldest.ref, status.oldest.step) == ("runs/r1/phase1/ckpt_phase1_step00000002", 2)
    assert status.oldest.created_at == START + 2 * TEN_MINUTES
    assert (status.newest.ref, status.newest.metrics) == (
        "runs/r1/phase1/ckpt_phase1_step00000004",
        {"loss": 2.5},
    )
    [run] = status.runs
    assert run.run == "runs/r1" and run.gates == 1
    assert run.latest.ref == "runs/r1/phase1/ckpt_phase1_step00000004"
    assert [(p, c.ref, c.metrics) for p, c in run.best] == [
        ("runs/r1/phase1/best", "runs/r1/phase1/ckpt_phase1_step00000002", {"loss": 1.0})
    ]
    # Pending GC: the forgotten checkpoint (written 35 minutes ago) waits for the one-hour
    # grace period, with the figures `cas gc` plans; nothing is collectable yet.
    gc_plan = repo.plan_gc(clock=clock)
    assert status.gc_collectable_bytes == gc_plan.freed_bytes == 0
    assert status.gc_waiting_bytes == gc_plan.waiting_bytes >= plan.freed_bytes > 0
    assert status.gc_waiting_until == gc_plan.waiting_until
    assert status.gc_waiting_until == START + 45 * 60 + HOUR  # the reflog window of `history`
    assert status.quarantined_objects == 0

    # Two hours on, the grace period and the window are over: all of it is collectable now.
    clock.set(START + 3 * HOUR)
    later = repo.status()
    assert later.gc_collectable_bytes == status.gc_waiting_bytes
    assert later.gc_waiting_bytes == 0


def test_cas_status_prints_the_report_and_json_for_scripts(tmp_path: Path) -> None:
    clock = FakeClock(START)
    repo = local_repo(tmp_path / "store", clock)
    _scripted_run(repo, clock)
    repo.forget(now=START + 45 * 60)
    runner = CliRunner()
    result = runner.invoke(cli, ["--store", str(tmp_path / "store"), "status"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("storage: ") and "/ budget 1.0 MiB (" in lines[0]
    assert lines[1] == "refs: 7 total, 4 protected, 0 `cas forget` would remove now"
    assert lines[2] == "checkpoints: 3"
    assert lines[3].startswith(
        "  oldest: runs/r1/phase1/ckpt_phase1_step00000002 (step 2, loss=1, "
    )
    assert lines[5].startswith("run runs/r1: latest runs/r1/phase1/ckpt_phase1_step00000004 (")
    assert lines[6].startswith(
        "  best runs/r1/phase1/best: runs/r1/phase1/ckpt_phase1_step00000002"
    )
    assert lines[7] == "  gates: 1"
    assert lines[8].startswith("gc: 0 B collectable now, ") and "waiting for the grace" in lines[8]

    doc = json.loads(
        runner.invoke(cli, ["--store", str(tmp_path / "store"), "status", "--json"]).output
    )
    assert (doc["refs"], doc["protected_refs"], doc["checkpoints"]) == (7, 4, 3)
    assert doc["budget"] == 1 << 20
    assert doc["oldest"]["ref"] == "runs/r1/phase1/ckpt_phase1_step00000002"
    assert doc["runs"][0]["best"][0]["pointer"] == "runs/r1/phase1/best"
    assert doc["gc"]["collectable_bytes"] == 0 and doc["gc"]["waiting_bytes"] > 0
    assert doc["quarantine"] == {"objects": 0, "bytes": 0}


def test_status_of_a_store_without_policy_or_runs_says_so(tmp_path: Path) -> None:
    clock = FakeClock(START)
    repo = local_repo(tmp_path / "store", clock)
    repo.save({"w": torch.zeros(4)}, "models/base")
    status = repo.status()
    assert (status.refs, status.checkpoints, status.protected_refs) == (1, 1, 0)
    assert not status.has_policy and status.budget == 0 and status.usage_pct is None
    assert status.runs == ()
    assert "no stored retention policy" in status.describe()[1]
    assert "(no budget)" in status.describe()[0]
