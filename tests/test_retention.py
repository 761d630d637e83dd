"""Retention policies replaying the seeds' scenarios: Hydra, Cobre, the LLM retention manager."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from cas import Repository
from cas.cli import cli
from cas.errors import LockHeld
from cas.refs.maintenance import MaintenanceLock
from cas.retention.gc import GCSettings
from cas.retention.policy import Best, RetentionPolicy, Rule
from tests.helpers import assert_bit_exact
from tests.retention_helpers import (
    HOUR,
    FakeClock,
    chunk_digests,
    local_repo,
    reachable_chunks,
    tensor,
    utc,
)

RUN = "runs/20260115_143022_a1b2c3d4"
NO_GRACE = GCSettings(grace=0, reflog_window=0)


def ckpt_state(seed: int) -> dict[str, Any]:
    """A checkpoint whose tensors belong to it alone: 2 model chunks and 1 optimizer chunk."""
    return {"model": {"w": tensor(seed, 8192)}, "optimizer": {"m": tensor(10_000 + seed, 4096)}}


def collect(repo: Repository) -> None:
    """GC with the real clock (local mtimes are real), no grace and no history."""
    repo.plan_gc(NO_GRACE).execute()


def test_hydra_fifo20_keeps_best_and_gates(tmp_path: Path) -> None:
    clock = FakeClock(utc("2026-01-15 14:30"))
    repo = local_repo(tmp_path, clock)
    val_ce = [3.0, 2.6, 1.1] + [2.5 - 0.01 * i for i in range(22)]
    phase1 = []
    for i, loss in enumerate(val_ce):
        clock.advance(600)
        ref = f"{RUN}/phase1/ckpt_phase1_step{(i + 1) * 10_000:08d}"
        repo.save(ckpt_state(i), ref, {"phase": 1, "metrics": {"val_ce": loss}})
        phase1.append(ref)
    repo.cp(phase1[2], f"{RUN}/gates/bc_best")
    ratings = [10.0, 11.0, 12.0, 13.0, 20.0] + [15.0] * 25
    phase2, best = [], float("-inf")
    for i, rating in enumerate(ratings):
        clock.advance(300)
        ref = f"{RUN}/phase2/ckpt_phase2_step{250_000 + (i + 1) * 500:08d}"
        repo.save(ckpt_state(100 + i), ref, {"phase": 2, "metrics": {"rating": rating}})
        phase2.append(ref)
        if rating > best:
            best = rating
            repo.cp(ref, f"{RUN}/phase2/best", overwrite=True)  # moving best is deliberate
    repo.cp(f"{RUN}/phase2/best", f"{RUN}/gates/distill_best")

    policy = RetentionPolicy(
        rules=(
            Rule(
                "runs/*/phase1/ckpt_*",
                max_count=20,
                keep_best=(Best("val_ce", "min"),),
                protect_targets_of=("runs/*/gates/*",),
            ),
            Rule(
                "runs/*/phase2/ckpt_*",
                max_count=20,
                protect_targets_of=("runs/*/phase2/best", "runs/*/gates/*"),
            ),
        )
    )
    plan = repo.plan_forget(policy)
    assert {d.ref for d in plan.dropped} == {phase1[i] for i in (0, 1, 3, 4, 5)} | {
        phase2[i] for i in (0, 1, 2, 3, *range(5, 11))
    }
    assert all("over max-count 20" in d.reasons[0] for d in plan.dropped)
    assert "best val_ce=1.1 (min)" in plan.decision(phase1[2]).reasons
    assert any(r.startswith("same checkpoint as") for r in plan.decision(phase2[4]).reasons)
    assert "latest of its group" in plan.decision(phase2[-1]).reasons
    assert plan.freed_bytes >= 15 * 12288

    result = plan.execute()
    assert len(result.removed) == 15 and not result.skipped
    assert len(repo.refs(f"{RUN}/phase1/")) == 20 and len(repo.refs(f"{RUN}/phase2/ckpt_*")) == 20
    collect(repo)
    assert chunk_digests(repo) == reachable_chunks(repo)
    assert_bit_exact(repo.load(f"{RUN}/gates/bc_best"), ckpt_state(2))
    assert_bit_exact(repo.load(f"{RUN}/gates/distill_best"), ckpt_state(104))
    assert_bit_exact(repo.load(f"{RUN}/phase2/best"), ckpt_state(104))
    assert repo.plan_forget(policy).dropped == ()


def test_cobre_keep_last_3_plus_latest(tmp_path: Path) -> None:
    clock = FakeClock(utc("2026-03-01 00:00"))
    repo = local_repo(tmp_path, clock)
    policy = RetentionPolicy(
        rules=(
            Rule("cobre/policy/ckpt_*", keep_last=3, protect_targets_of=("cobre/policy/latest",)),
        )
    )
    names = []
    for iteration in range(10, 90, 10):
        clock.advance(120)
        ref = f"cobre/policy/ckpt_iter{iteration:06d}"
        repo.save(ckpt_state(iteration), ref, {"completed_iterations": iteration})
        repo.cp(ref, "cobre/policy/latest")
        repo.forget(policy)  # step 5 of Cobre's write protocol, after every checkpoint
        names.append(ref)
    assert [r.name for r in repo.refs("cobre/")] == [*names[-3:], "cobre/policy/latest"]
    collect(repo)
    assert chunk_digests(repo) == reachable_chunks(repo)
    assert_bit_exact(repo.load("cobre/policy/latest"), ckpt_state(80))

    # A resume from iteration 30 is still possible while `latest` points back at it.
    repo.cp(names[-3], "cobre/policy/latest")
    clock.advance(120)
    repo.save(ckpt_state(90), "cobre/policy/ckpt_iter000090")
    plan = repo.plan_forget(policy)
    assert [d.ref for d in plan.dropped] == []
    assert "same checkpoint as cobre/policy/latest" in plan.decision(names[-3]).reasons
    repo.save(ckpt_state(100), "cobre/policy/ckpt_iter000100")
    assert [d.ref for d in repo.plan_forget(policy).dropped] == [names[-2]]


UNIT = 64 << 10
"""One "GB" of the worked example: sizes are scaled down 16384x."""


def _llm_store(tmp_path: Path) -> tuple[Repository, FakeClock]:
    now = utc("2025-11-22 14:30")
    clock = FakeClock(now)
    repo = local_repo(tmp_path, clock, chunk_size=UNIT)
    ages = {500: 48, 1000: 40, 1500: 30, 2000: 20, 2500: 10, 3000: 5, 3500: 2, 4000: 1}
    for step, hours in ages.items():
        clock.set(now - hours * HOUR)
        state = {"model": tensor(step, UNIT * 3 // 2), "optimizer": tensor(-step, UNIT * 3)}
        loss = 0.40 if step == 3000 else 0.5 + step / 10_000
        repo.save(state, f"checkpoints/checkpoint-{step}", {"metrics": {"eval_loss": loss}})
    repo.cp("checkpoints/checkpoint-4000", "latest")
    for day in range(13, 23):
        clock.set(utc(f"2025-11-{day} 02:00"))
        repo.save({"model": tensor(day, UNIT * 3 // 2)}, f"snapshots/2025-11-{day}")
    clock.set(now)
    return repo, clock


def _llm_policy(budget_units: float) -> RetentionPolicy:
    return RetentionPolicy(
        rules=(
            Rule(
                "checkpoints/*",
                keep_within=36 * HOUR,
                keep_best=(Best("eval_loss", "min"),),
                budget_priority=1,
            ),
            Rule("snapshots/*", protect_days=2, budget_priority=0),
        ),
        min_age=HOUR,
        max_total_bytes=int(budget_units * UNIT),
    )


def test_retention_manager_worked_example_36h_then_budget(tmp_path: Path) -> None:
    repo, _ = _llm_store(tmp_path)
    plan = repo.plan_forget(_llm_policy(150))
    assert [d.ref for d in plan.dropped] == [
        "checkpoints/checkpoint-1000",
        "checkpoints/checkpoint-500",
    ]
    assert all(d.reasons == ("not kept by keep-within 36h",) for d in plan.dropped)
    assert plan.bytes_before / UNIT == pytest.approx(51, rel=0.01)  # "Total: 51GB / 150GB"
    assert plan.bytes_after / UNIT == pytest.approx(42, rel=0.01)  # "Remaining: 42GB / 150GB"
    assert "latest of its group" in plan.decision("checkpoints/checkpoint-4000").reasons
    assert "best eval_loss=0.4 (min)" in plan.decision("checkpoints/checkpoint-3000").reasons
    assert "newest of 2025-11-21 (yesterday)" in plan.decision("snapshots/2025-11-21").reasons
    assert not plan.warnings

    # A 25 GB budget: snapshots older than two days go first, oldest first, then old checkpoints.
    tight = repo.plan_forget(_llm_policy(25))
    snapshots = [f"snapshots/2025-11-{day}" for day in range(13, 21)]
    budget_drops = [
        d.ref for d in sorted(tight.dropped, key=lambda d: d.time) if "budget" in d.reasons[0]
    ]
    assert budget_drops[:8] == snapshots
    assert budget_drops[8:] == ["checkpoints/checkpoint-1500", "checkpoints/checkpoint-2000"]
    assert tight.bytes_after / UNIT == pytest.approx(21, rel=0.01)
    assert tight.bytes_after <= tight.budget

    # Nothing is changed by planning; executing, then GC, frees exactly the planned bytes.
    before = chunk_digests(repo)
    assert len(repo.refs()) == 19
    result = tight.execute()
    assert len(result.removed) == 12
    collect(repo)
    assert chunk_digests(repo) == reachable_chunks(repo) and chunk_digests(repo) < before
    assert repo.disk_usage().stored_bytes == tight.bytes_after
    protected_left = {"snapshots/2025-11-21", "snapshots/2025-11-22", "checkpoints/checkpoint-3000"}
    assert protected_left <= {r.name for r in repo.refs()}


def test_budget_that_only_protected_refs_exceed_is_reported_not_violated(tmp_path: Path) -> None:
    repo, _ = _llm_store(tmp_path)
    plan = repo.plan_forget(_llm_policy(5))
    assert plan.warnings and "everything left is protected" in plan.warnings[0]
    kept = {d.ref for d in plan.kept}
    assert {"checkpoints/checkpoint-4000", "checkpoints/checkpoint-3000", "latest"} <= kept


def test_daily_weights_only_snapshot_costs_no_chunk_bytes(tmp_path: Path) -> None:
    repo = local_repo(tmp_path)
    repo.save(ckpt_state(1), "checkpoints/checkpoint-4000")
    chunks = chunk_digests(repo)
    repo.cp("checkpoints/checkpoint-4000", "snapshots/2025-11-22", only="model.*")
    assert chunk_digests(repo) == chunks
    snapshot = repo.disk_usage("snapshots/")
    assert snapshot.exclusive_bytes < 1024  # its manifest; every chunk is the checkpoint's
    assert snapshot.shared_bytes >= 8192
    repo.rm("checkpoints/checkpoint-4000")
    collect(repo)
    assert len(chunk_digests(repo)) == 2  # the optimizer chunk went, the weights stayed
    assert_bit_exact(repo.load("snapshots/2025-11-22"), {"model": ckpt_state(1)["model"]})


def test_du_counts_what_two_copies_share_as_exclusive_to_the_pair_not_to_either(
    tmp_path: Path,
) -> None:
    repo = local_repo(tmp_path)
    repo.save(ckpt_state(1), "runs/a/ckpt")
    repo.cp("runs/a/ckpt", "runs/a/copy")  # the same manifest and chunks
    repo.save(ckpt_state(2), "runs/b/ckpt")
    pair = repo.disk_usage("runs/a/")
    assert [row.exclusive_bytes for row in pair.refs] == [0, 0]  # each needs the other's bytes
    assert pair.exclusive_bytes == pair.stored_bytes > 0  # but no ref outside the pair does
    assert pair.shared_bytes == 0
    other = repo.disk_usage("runs/b/")
    everything = repo.disk_usage()
    assert everything.exclusive_bytes == everything.stored_bytes
    assert everything.stored_bytes == pair.stored_bytes + other.stored_bytes


def test_pool_fifo_with_anchors_and_eviction_log(tmp_path: Path) -> None:
    clock = FakeClock(utc("2026-02-01 00:00"))
    repo = local_repo(tmp_path, clock)
    pool = f"{RUN}/phase3/opponent_pool"
    for anchor in ("bc_best", "distill_best"):
        repo.save(
            {"model": ckpt_state(len(anchor))["model"]}, f"{pool}/anchor_{anchor}", {"anchor": True}
        )
    policy = RetentionPolicy(
        rules=(Rule(f"{pool}/*", max_count=20, protect=("**/anchor_*",), eviction_log="pool"),)
    )
    for version in range(1, 31):
        clock.advance(60)
        meta = {
            "version": version,
            "mu": 25.0 + version,
            "sigma": 8.0 / version,
            "games": 10 * version,
            "win_rate": 0.5,
        }
        step = 120_000 + version * 500
        repo.save(
            {"model": ckpt_state(1000 + version)["model"]},
            f"{pool}/pool_v{version:04d}_step{step:08d}",
            meta,
        )
        repo.forget(policy)
    roster = [r.name.rsplit("/", 1)[1] for r in repo.refs(pool)]
    assert roster[:2] == ["anchor_bc_best", "anchor_distill_best"]
    assert [name[:10] for name in roster[2:]] == [f"pool_v{v:04d}" for v in range(13, 31)]
    log = repo.eviction_log("pool")
    assert [r["meta"]["version"] for r in log] == list(range(1, 13))
    assert log[0]["meta"] == {"version": 1, "mu": 26.0, "sigma": 8.0, "games": 10, "win_rate": 0.5}
    assert all("over max-count 20" in r["reason"] for r in log)

    # Replaying a plan (a forget killed after logging) neither removes nor logs anything twice.
    clock.advance(60)
    repo.save({"model": tensor(7, 8192)}, f"{pool}/pool_v0031_step00135500", {"version": 31})
    plan = repo.plan_forget(policy)
    first, again = plan.execute(), plan.execute()
    assert first.logged == 1 and first.removed == (f"{pool}/pool_v0013_step00126500",)
    assert again.logged == 0 and again.removed == () and again.skipped[0][1] == "already gone"
    assert len(repo.eviction_log("pool")) == 13


def test_plan_skips_a_ref_that_moved_after_planning(tmp_path: Path) -> None:
    clock = FakeClock(utc("2026-04-01 00:00"))
    repo = local_repo(tmp_path, clock)
    for i in range(4):
        clock.advance(60)
        repo.save(ckpt_state(i), f"r/ckpt_{i}")
    plan = repo.plan_forget(RetentionPolicy(rules=(Rule("r/*", keep_last=2),)))
    assert [d.ref for d in plan.dropped] == ["r/ckpt_1", "r/ckpt_0"]
    repo.save(ckpt_state(9), "r/ckpt_0")  # re-saved after the plan was made
    result = plan.execute()
    assert result.removed == ("r/ckpt_1",)
    assert result.skipped == (("r/ckpt_0", "moved since the plan"),)
    assert_bit_exact(repo.load("r/ckpt_0"), ckpt_state(9))


def test_periodic_buckets_groups_and_best_max(tmp_path: Path) -> None:
    clock = FakeClock(utc("2026-05-01 00:00"))
    repo = local_repo(tmp_path, clock)
    for run in ("a", "b"):
        for hour in range(72):
            clock.set(utc("2026-05-01 00:00") + hour * HOUR)
            repo.save(
                {"x": hour}, f"runs/{run}/phase1/ckpt_{hour:03d}", {"rating": float(hour % 7)}
            )
    rule = Rule(
        "runs/*/phase1/ckpt_*",
        group_by=r"runs/([^/]+)/",
        keep_daily=2,
        keep_hourly=3,
        keep_best=(Best("rating", "max", 1),),
    )
    plan = repo.plan_forget(RetentionPolicy(rules=(rule,)), now=utc("2026-05-04 00:00"))
    for run in ("a", "b"):
        kept = sorted(d.ref.rsplit("_", 1)[1] for d in plan.kept if d.group == run)
        # hourly: 71, 70, 69; daily: 71 (May 3), 47 (May 2); best rating 6: hour 69 (newest).
        assert kept == ["047", "069", "070", "071"]
        assert "daily 2026-05-02" in plan.decision(f"runs/{run}/phase1/ckpt_047").reasons
        assert "best rating=6 (max)" in plan.decision(f"runs/{run}/phase1/ckpt_069").reasons
    depth = repo.plan_forget(RetentionPolicy(rules=(Rule("runs/**", group_by=1, keep_last=1),)))
    assert [d.ref for d in depth.kept] == ["runs/b/phase1/ckpt_071"]


def test_policy_round_trips_through_the_store_config(tmp_path: Path) -> None:
    repo = local_repo(tmp_path)
    policy = RetentionPolicy(
        rules=(
            Rule(
                "checkpoints/*",
                keep_within=36 * HOUR,
                keep_best=(Best("eval_loss"),),
                budget_priority=1,
            ),
            Rule(
                "pool/*", group_by=1, max_count=20, protect=("pool/anchor_*",), eviction_log="pool"
            ),
        ),
        protect=("gates/**",),
        min_age=HOUR,
        max_total_bytes=150 << 30,
        timezone="Europe/Berlin",
    )
    repo.store_retention_policy(policy)
    reopened = local_repo(tmp_path)
    assert RetentionPolicy.from_config(reopened.config.extra) == policy
    assert RetentionPolicy.from_dict(json.loads(json.dumps(policy.to_dict()))) == policy
    assert RetentionPolicy.from_dict(
        {"rules": [{"select": "x/*", "keep_within": "36h"}], "max_total_bytes": "150G"}
    ) == (RetentionPolicy(rules=(Rule("x/*", keep_within=36 * HOUR),), max_total_bytes=150 << 30))


def test_cron_forget_applies_the_stored_policy(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    repo = local_repo(Path(store))
    for i in range(5):
        repo.save(ckpt_state(i), f"runs/r1/ckpt_{i}")
    runner = CliRunner()
    assert runner.invoke(cli, ["--store", store, "forget"]).exit_code == 2  # no policy yet
    out = runner.invoke(
        cli,
        [
            "--store",
            store,
            "policy",
            "set",
            "--select",
            "runs/*/ckpt_*",
            "--keep-last",
            "2",
            "--grace",
            "0s",
            "--reflog-window",
            "0s",
        ],
    )
    assert out.exit_code == 0, out.output
    dry = runner.invoke(cli, ["--store", store, "forget", "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    planned = json.loads(dry.output)["plan"]
    assert [d["ref"] for d in planned["drop"]] == [
        "runs/r1/ckpt_2",
        "runs/r1/ckpt_1",
        "runs/r1/ckpt_0",
    ]
    assert len(local_repo(Path(store)).refs()) == 5
    done = runner.invoke(cli, ["--store", store, "forget", "--prune"])
    assert done.exit_code == 0, done.output
    assert "removed 3 refs" in done.output and "deleted 9 chunks" in done.output
    reopened = local_repo(Path(store))
    assert [r.name for r in reopened.refs()] == ["runs/r1/ckpt_3", "runs/r1/ckpt_4"]
    shown = runner.invoke(cli, ["--store", store, "policy", "show"])
    assert "keep_last=2" in shown.output and "grace 0s" in shown.output


def test_cli_forget_flags_override_and_report_bytes(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    repo = local_repo(Path(store))
    for i in range(3):
        repo.save(ckpt_state(i), f"pool/v{i}", {"mu": i})
    out = CliRunner().invoke(
        cli,
        [
            "--store",
            store,
            "forget",
            "--select",
            "pool/*",
            "--max-count",
            "1",
            "--eviction-log",
            "pool",
        ],
    )
    assert out.exit_code == 0, out.output
    assert out.output.count("DROP") == 2 and "frees 12." in out.output and "2 logged" in out.output
    logged = CliRunner().invoke(cli, ["--store", store, "policy", "log", "pool", "--json"])
    assert [r["ref"] for r in json.loads(logged.output)] == ["pool/v0", "pool/v1"]


def test_two_maintenance_runs_never_interleave(tmp_path: Path) -> None:
    clock = FakeClock(utc("2026-06-01 00:00"))
    repo = local_repo(tmp_path, clock)
    repo.save(ckpt_state(0), "r/a")
    policy = RetentionPolicy(rules=(Rule("r/*", keep_last=1),))
    storage_time = repo.maintenance.storage.now  # a lock is written in the storage's time
    with MaintenanceLock(repo.blobs, storage_time, operation="gc"):
        with pytest.raises(LockHeld, match="gc by"):
            repo.forget(policy)
        with pytest.raises(LockHeld):
            repo.plan_gc(NO_GRACE)
    repo.forget(policy)  # released
    # A run took the lock 61 s ago on the storage's clock and died: once expired, it is taken over.
    MaintenanceLock(repo.blobs, lambda: storage_time() - 61, duration=60).acquire()
    repo.forget(policy)
    assert CliRunner().invoke(cli, ["--store", str(tmp_path), "leases"]).output.endswith("free\n")


@pytest.mark.parametrize(
    ("name", "pattern", "selected"),
    [
        ("pool/anchor_1", "pool/anchor_[0-9]*", True),
        ("pool/anchor_x", "pool/anchor_[0-9]*", False),
        ("pool/anchor_x", "pool/anchor_[!0-9]*", True),
        ("a/b", "a[/]b", False),  # a class never matches '/'
        ("gate", "**/gate", True),  # '**/' also matches no folder, as in git
        ("runs/gate", "runs/**/gate", True),
        ("runs/a/b/gate", "runs/**/gate", True),
        ("runs/xgate", "runs/**/gate", False),
        ("runs/r1/x", "runs/*", False),
    ],
)
def test_selector_globs(name: str, pattern: str, selected: bool) -> None:
    from cas.names import ref_matches

    assert ref_matches(name, pattern) is selected


def test_a_character_class_in_protect_keeps_its_refs(tmp_path: Path) -> None:
    clock = FakeClock(utc("2026-03-01 00:00"))
    repo = local_repo(tmp_path, clock)
    for i, name in enumerate(("pool/anchor_1", "pool/v2", "pool/v3", "pool/v4")):
        clock.advance(600)
        repo.save(ckpt_state(i), name)
    policy = RetentionPolicy(rules=(Rule("pool/**", keep_last=2, protect=("pool/anchor_[0-9]*",)),))
    repo.forget(policy)
    assert [r.name for r in repo.refs("pool")] == ["pool/anchor_1", "pool/v3", "pool/v4"]


@pytest.mark.parametrize(
    "bad",
    [{"keep_last": 2.5}, {"max_count": float("inf")}, {"keep_within": float("inf")}, {"select": 5}],
)
def test_a_rule_with_a_value_forget_cannot_use_is_refused_when_made(bad: dict[str, Any]) -> None:
    fields: dict[str, Any] = {"select": "runs/**", **bad}
    with pytest.raises(ValueError):
        Rule(**fields)


def test_a_ref_set_again_between_plan_and_execute_is_not_removed() -> None:
    from tests.retention_helpers import memory_repo

    clock = FakeClock(1_000_000.0)
    repo = memory_repo(clock)
    repo.save({"w": tensor(1, 4096)}, "ckpt/a")
    repo.cp("ckpt/a", "snap/x")
    clock.advance(10 * HOUR)
    repo.save({"w": tensor(2, 4096)}, "ckpt/b")
    repo.cp("ckpt/b", "snap/y")
    policy = RetentionPolicy(rules=(Rule("snap/*", time="ref", protect_within=HOUR, keep_last=1),))
    plan = repo.plan_forget(policy)
    assert [d.ref for d in plan.dropped] == ["snap/x"]
    clock.advance(60)
    repo.cp("ckpt/a", "snap/x")  # re-promoted to the same manifest: now protected
    result = plan.execute()
    assert result.removed == () and result.skipped == (("snap/x", "moved since the plan"),)
    assert repo.resolve("snap/x") == repo.resolve("ckpt/a")
