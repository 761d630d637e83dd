"""Damage never stops the rest: a store with a missing manifest, a garbage ref record and a bad
history entry still prunes, collects, reports and loads everything else; `cas rm` and
`cas repair` clear the damage; a training run's retention keeps its count around a damaged
checkpoint and says so."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import pytest
from click.testing import CliRunner, Result

import cas
import cas.refs.store as refs_mod
from cas.cli import cli
from cas.digest import Digest, digest_of
from cas.model.manifest import decode_manifest
from cas.names import RefName
from cas.objects.keys import ObjectKind
from cas.objects.store import manifest_key
from cas.refs.damage import DAMAGED_PREFIX
from cas.refs.keys import ref_key
from cas.repo.repository import Repository
from cas.retention.policy import RetentionPolicy, Rule
from cas.training.manager import CheckpointManager
from cas.training.pool import OpponentPool

KEEP_LAST = ("forget", "--select", "runs/*", "--keep-last", "2")
NOW = ("--grace", "0", "--reflog-window", "0")


def weights(seed: int) -> dict[str, Any]:
    """A small state of one 64 KiB chunk, different for every seed."""
    return {"w": np.random.default_rng(seed).standard_normal(8192)}


def chunk_of(seed: int) -> Digest:
    """The one chunk ``weights(seed)`` is stored as, computed without cas."""
    return digest_of(weights(seed)["w"].tobytes())


@dataclass
class Store:
    """A store at ``url`` and the CLI pointed at it."""

    url: str

    def settle(self) -> None:
        """Let a second pass: S3 stamps mtimes to the second, and grace 0 spares an object
        written in the very second GC reads the clock."""
        if self.url.startswith("s3://"):
            time.sleep(1.1)

    def cas(self, *args: str) -> Result:
        return CliRunner().invoke(cli, ["--store", self.url, *args], catch_exceptions=False)

    def json(self, *args: str) -> Any:
        result = self.cas(*args, "--json")
        assert result.exit_code in (0, 1), result.output
        return json.loads(result.stdout)

    def repo(self) -> Repository:
        return cas.open(self.url)

    def record_key(self, ref: str) -> str:
        return ref_key(RefName(ref))

    def chunks(self) -> set[str]:
        return {o.digest for o in self.repo().objects.list_objects(ObjectKind.CHUNK)}


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Store:
    if request.param == "local":
        return Store(str(tmp_path / "store"))
    url: str = request.getfixturevalue("s3_url")
    return Store(url)


def damage(store: Store) -> None:
    """runs/c0..c5, then: c1's manifest deleted, c2's record cut short after its target (garbage
    to a decoder, its target still spelled out), and one entry of c5's history given a target
    that is no digest (c5 was saved twice: seeds 5, then 6)."""
    repo = store.repo()
    for i in range(5):
        repo.save(weights(i), f"runs/c{i}")
    repo.save(weights(5), "runs/c5")
    repo.save(weights(6), "runs/c5")
    repo.blobs.delete(manifest_key(repo.resolve("runs/c1")))
    record = repo.blobs.get(store.record_key("runs/c2"))
    target = repo.resolve("runs/c2").encode()
    repo.blobs.put(store.record_key("runs/c2"), record[: record.index(target) + len(target) + 3])
    doc = msgpack.unpackb(repo.blobs.get(store.record_key("runs/c5")))
    doc["history"][0][0] = "not-hex"
    repo.blobs.put(store.record_key("runs/c5"), msgpack.packb(doc))


def test_forget_prune_prunes_the_healthy_refs_and_names_every_damaged_one(store: Store) -> None:
    damage(store)
    store.settle()
    pruned = store.cas(*KEEP_LAST, "--prune", *NOW)
    assert pruned.exit_code == 0, pruned.output
    assert "removed 2 refs" in pruned.stdout
    assert "DROP" in pruned.stdout and "runs/c0" in pruned.stdout and "runs/c3" in pruned.stdout
    warned = pruned.stderr.splitlines()
    assert [w.split()[4].rstrip(":") for w in warned] == ["runs/c1", "runs/c2", "runs/c5"]
    assert "missing" in warned[0] and "corrupt" in warned[1] and "not-hex" in warned[2]
    listed = store.cas("ls")
    assert listed.exit_code == 0
    assert listed.stdout.split() == ["runs/c1", "runs/c4", "runs/c5"]  # c2 cannot be listed
    # Kept: c4 and c5 by the policy, c2 by what its damaged record still names; c5's first
    # save (seed 5) went with its history entry, c1's chunk with its manifest.
    assert store.chunks() == {chunk_of(2), chunk_of(4), chunk_of(6)}


def test_status_ls_log_and_gc_answer_around_the_damage(store: Store) -> None:
    damage(store)
    status = store.cas("status")
    assert status.exit_code == 0, status.output
    assert "WARNING: damaged ref runs/c1" in status.stdout
    assert "WARNING: damaged ref runs/c2" in status.stdout
    assert "WARNING: damaged ref runs/c5: history entry" in status.stdout
    report = store.json("status")
    assert [d["ref"] for d in report["damage"]] == ["runs/c1", "runs/c2", "runs/c5"]
    assert report["refs"] == 4 and not report["gc"]["held"]  # c2's bytes still name its target
    verify = store.json("verify")
    assert not verify["ok"] and ["runs/c5", "bad-history"] in [
        [p["ref"], p["kind"]] for p in verify["problems"]
    ]
    log = store.cas("log", "runs/c5")
    assert log.exit_code == 0 and len(log.stdout.splitlines()) == 1
    assert "not-hex" in log.stderr
    store.settle()  # before the plan too: its deletions are counted below
    plan = store.json("gc", "--dry-run", *NOW)["plan"]
    assert [(d["ref"], d["holds"]) for d in plan["damaged"]] == [
        ("runs/c2", False),
        ("runs/c5", False),
    ]
    assert plan["broken_refs"] == ["runs/c1"]
    assert plan["delete_chunks"] == 2  # c1's, and c5's first save's
    assert store.cas("gc", *NOW).exit_code == 0
    assert store.chunks() == {chunk_of(i) for i in (0, 2, 3, 4, 6)}


def test_show_and_save_work_on_a_ref_with_a_bad_history_entry_and_keep_it(store: Store) -> None:
    damage(store)
    shown = store.cas("show", "runs/c5")
    assert shown.exit_code == 0, shown.output
    repo = store.repo()
    repo.save(weights(7), "runs/c5")
    np.testing.assert_array_equal(repo.load("runs/c5")["w"], weights(7)["w"])
    record = repo.find_ref("runs/c5")
    assert record is not None and len(record.history) == 2  # seed 6, then 7
    assert [e.raw[0] for e in record.damaged_events] == ["not-hex"]  # kept, still reported


def test_rm_and_repair_clear_the_damage(store: Store) -> None:
    damage(store)
    dry = store.json("repair", "--dry-run")
    assert dry["dry_run"] and [f["ref"] for f in dry["fixes"]] == ["runs/c1", "runs/c2", "runs/c5"]
    assert store.json("status")["damage"]  # a dry run changes nothing
    repair = store.cas("repair")
    assert repair.exit_code == 1  # c1's manifest is gone and it has no earlier target
    assert "COULD NOT rebuild runs/c1" in repair.stdout
    assert "repaired runs/c2" in repair.stdout and "repaired runs/c5" in repair.stdout
    repo = store.repo()
    np.testing.assert_array_equal(repo.load("runs/c2")["w"], weights(2)["w"])  # rebuilt
    c5 = repo.find_ref("runs/c5")
    assert c5 is not None and c5.damaged_events == () and len(c5.history) == 1
    kept = sorted(repo.blobs.list(DAMAGED_PREFIX))
    assert [k.split("/")[2] for k in kept] == ["runs%2Fc2", "runs%2Fc5"]  # bytes kept aside
    removed = store.json("rm", "runs/c1")
    assert [r["ref"] for r in removed] == ["runs/c1"]
    assert store.json("status")["damage"] == []
    again = store.cas("repair")
    assert again.exit_code == 0 and "0 damaged" in again.stdout
    pruned = store.cas(*KEEP_LAST, "--prune", *NOW)
    assert pruned.exit_code == 0 and pruned.stderr == ""
    assert store.cas("ls").stdout.split() == ["runs/c4", "runs/c5"]


def test_rm_removes_a_ref_whose_record_is_garbage(tmp_path: Any) -> None:
    store = Store(str(tmp_path / "store"))
    repo = store.repo()
    repo.save(weights(0), "runs/a")
    repo.blobs.put(store.record_key("runs/a"), b"\xc1 garbage")
    removed = store.json("rm", "runs/a")
    assert removed == [{"ref": "runs/a", "manifest": None}]
    assert store.cas("ls").stdout == ""


def test_gc_deletes_nothing_while_a_record_names_nothing_until_repair_sets_it_aside(
    tmp_path: Any,
) -> None:
    store = Store(str(tmp_path / "store"))
    repo = store.repo()
    repo.save(weights(0), "runs/a")
    repo.save(weights(1), "runs/b")
    repo.rm("runs/b")  # unreachable: what a gc frees
    repo.blobs.put(store.record_key("runs/a"), b"garbage garbage")
    gc = store.cas("gc", *NOW)
    assert gc.exit_code == 0 and "deleting nothing" in gc.stdout
    assert "runs/a" in gc.stderr
    assert store.chunks() == {chunk_of(0), chunk_of(1)}  # runs/a's target might be either
    assert store.json("status")["gc"]["held"]
    repair = store.json("repair")
    assert [(f["ref"], f["action"], f["fixed"]) for f in repair["fixes"]] == [
        ("runs/a", "set aside", False)
    ]
    (kept,) = repo.blobs.list(DAMAGED_PREFIX)
    assert repo.blobs.get(kept) == b"garbage garbage"
    assert store.cas("gc", *NOW).exit_code == 0
    assert store.chunks() == set()


def test_repair_moves_a_pointer_whose_manifest_is_gone_back_to_its_newest_stored_target(
    tmp_path: Any,
) -> None:
    store = Store(str(tmp_path / "store"))
    repo = store.repo()
    for seed in range(3):
        repo.save(weights(seed), "runs/r/latest")
    repo.blobs.delete(manifest_key(repo.resolve("runs/r/latest")))
    result = store.json("repair")
    assert [(f["ref"], f["action"]) for f in result["fixes"]] == [("runs/r/latest", "rolled back")]
    np.testing.assert_array_equal(repo.load("runs/r/latest")["w"], weights(1)["w"])
    assert repo.log("runs/r/latest")[0].op == "repair"


def test_a_run_keeps_three_healthy_checkpoints_around_a_damaged_one_and_says_so(
    tmp_path: Any,
) -> None:
    repo = cas.open(tmp_path / "store")
    policy = RetentionPolicy(rules=(Rule(select="runs/*/phase*/ckpt_*", keep_last=3),))
    mgr = CheckpointManager(repo, run="r1", signals=False, policy=policy, async_save=False)
    ckpt: Callable[[int], str] = mgr.checkpoint_ref
    results = []
    with mgr:
        for step in range(1, 11):
            results.append(mgr.save(step, weights(step)).result())
            if step == 2:
                repo.blobs.put(ref_key(RefName(ckpt(2))), b"garbage")
    kept = [r.name for r in repo.list_refs("runs/r1/phase1/ckpt_*").records]
    assert kept == [ckpt(8), ckpt(9), ckpt(10)]
    assert ckpt(2) in repo.ref_names("runs/r1/phase1/ckpt_*")  # the damaged one is kept
    assert results[1].retention_damaged == () and results[1].retention_ran
    assert all(r.retention_damaged == (ckpt(2),) for r in results[2:])
    assert not results[-1].retention_ran and results[-1].retention_error is None
    latest = decode_manifest(repo.objects.get_manifest(repo.resolve("runs/r1/latest")))
    assert latest.meta["retention"] == {"after_step": 9, "error": None, "damaged": [ckpt(2)]}
    (run,) = repo.status().runs
    assert run.damaged == (ckpt(2),)
    assert run.retention == f"retention after step 9 kept 1 damaged refs: {ckpt(2)}"
    status = CliRunner().invoke(cli, ["--store", str(tmp_path / "store"), "status"])
    assert status.exit_code == 0
    assert f"retention keeps 1 damaged refs out of its count: {ckpt(2)}" in status.stdout


def test_a_record_whose_target_is_lost_is_rebuilt_from_its_history_segments(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(refs_mod, "INLINE_HISTORY", 8)
    monkeypatch.setattr(refs_mod, "SEAL_EVENTS", 4)
    store = Store(str(tmp_path / "store"))
    repo = store.repo()
    for seed in range(12):
        repo.save(weights(seed), "runs/r/latest")
    record = repo.find_ref("runs/r/latest")
    assert record is not None and len(record.sealed) == 1  # seeds 0-3 sealed, 4-11 inline
    doc = msgpack.unpackb(repo.blobs.get(store.record_key("runs/r/latest")))
    doc["target"] = "lost"
    for event in doc["history"]:
        event[0] = "lost"  # nothing but the sealed segment still names a checkpoint
    repo.blobs.put(store.record_key("runs/r/latest"), msgpack.packb(doc))
    plan = store.json("gc", "--dry-run", *NOW)["plan"]
    assert plan["held"] and plan["delete_chunks"] == 0  # its current target is unknown
    fixes = store.json("repair")["fixes"]
    assert [(f["ref"], f["action"]) for f in fixes] == [("runs/r/latest", "rebuilt")]
    assert "history segments" in fixes[0]["detail"]
    np.testing.assert_array_equal(repo.load("runs/r/latest")["w"], weights(3)["w"])


def test_the_nightly_cron_job_takes_its_snapshot_and_prunes_around_the_damage(
    tmp_path: Any,
) -> None:
    store = Store(str(tmp_path / "store"))
    damage(store)
    policy = ("--select", "runs/*", "--keep-last", "2", "--daily-snapshot", "runs/*")
    assert store.cas("policy", "set", *policy, "--snapshot-only", "w").exit_code == 0
    nightly = store.cas("forget", "--prune")
    assert nightly.exit_code == 0, nightly.output
    assert "snapshot snapshots/" in nightly.stdout and "copied runs/c5" in nightly.stdout
    assert "removed 2 refs" in nightly.stdout
    assert [w.split()[4].rstrip(":") for w in nightly.stderr.splitlines()] == [
        "runs/c1",
        "runs/c2",
        "runs/c5",
    ]


def test_an_opponent_pool_keeps_its_capacity_around_a_damaged_entry(tmp_path: Any) -> None:
    repo = cas.open(tmp_path / "store")
    pool = OpponentPool(repo, "pool", capacity=2)
    first = pool.promote(weights(1))
    repo.blobs.put(ref_key(RefName(first.ref)), b"garbage")
    versions = [pool.promote(weights(seed)).version for seed in range(2, 6)]
    assert versions == [2, 3, 4, 5]
    assert [e.version for e in pool.entries()] == [4, 5]  # the capacity, over the healthy ones
    assert [d.ref for d in pool.damaged] == [first.ref]  # kept, and never evicted
    repo.rm_damaged(first.ref)
    repo.rm(pool.counter_ref)
    assert pool.promote(weights(6)).version == 6


def test_an_encrypted_ref_record_that_fails_its_tag_holds_gc_until_rm_removes_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("CAS_KEY", "CAS_KEY_FILE", "CAS_KEY_COMMAND"):
        monkeypatch.delenv(name, raising=False)
    root = tmp_path / "store"
    repo = cas.open(root, key="a passphrase")
    repo.save(weights(0), "runs/a")
    repo.save(weights(1), "runs/b")
    repo.rm("runs/b")
    sealed = root / "refs" / "runs%2Fa"
    sealed.write_bytes(sealed.read_bytes()[:-1] + b"\x00")  # the tag no longer verifies
    monkeypatch.setenv("CAS_KEY", "a passphrase")
    store = Store(str(root))
    gc = store.json("gc", *NOW)
    assert gc["plan"]["held"] and gc["result"]["deleted_chunks"] == 0
    repair = store.json("repair")
    assert [(f["ref"], f["action"], f["fixed"]) for f in repair["fixes"]] == [
        ("runs/a", "none", False)
    ]
    assert store.json("rm", "runs/a") == [{"ref": "runs/a", "manifest": None}]
    assert store.json("gc", *NOW)["result"]["deleted_chunks"] == 2
