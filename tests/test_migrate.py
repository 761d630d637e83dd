"""`cas migrate`: a store written by the previous cas (format version 1, with the layouts that
version had) is moved to the current version, every ref loads after it, and a migration that
dies half-way is finished by running it again.

The old stores are built here by hand, blob by blob, the way the older code wrote them: the config
at version 1, a long ref name under its whole quoted key, a training history as byte tensors, a
pool's eviction list in manifest meta and an eviction log as JSON-lines blobs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import cas
from cas.blobstore import BlobStore, MemoryBlobStore
from cas.cli import cli
from cas.errors import FormatError
from cas.model.manifest import Manifest
from cas.refs import legacy_logs
from cas.refs.keys import legacy_key, ref_key
from cas.repo.config import STORE_VERSION, StoreConfig, read_config
from cas.repo.migrate import migrate
from cas.repo.repository import Repository
from cas.retention.evictions import append_evictions
from cas.training.history import TrainingHistory
from cas.training.pool import OpponentPool
from tests.retention_helpers import FakeClock, tensor, utc
from tests.test_logs import write_old_history

LONG = "runs/" + "/".join(["sweep"] * 60) + "/best"
"""A name whose quoted form is longer than a file name: the previous cas kept it whole on S3."""
HISTORY = [{"step": s, "loss": 1.0 / (s + 1)} for s in range(20)]
POOL_EVICTED = [
    {"version": 1, "step": 500, "mu": 30.0, "ref": "league/pool_v0001", "digest": "0" * 64,
     "evicted_at": 1000.0},
]  # fmt: skip
MARCH = [{"ref": f"pool/m{i}", "manifest": f"{i}" * 64, "reason": "old"} for i in range(3)]
APRIL = [{"ref": "pool/a0", "manifest": "a" * 64, "reason": "old"}]


def write_v1_config(blobs: BlobStore) -> None:
    """The config exactly as the previous cas wrote it (its version was a constant, 1)."""
    doc = {"format": "cas-store", "version": 1, "chunk_size": 4096, "cdc_avg_size": 1024,
           "codec": "raw", "compression_level": 3, "inline_max": 64, "created_at": 1.0,
           "extra": {}}  # fmt: skip
    blobs.put("config", json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n")


def build_v1_store(repo: Repository, *, long_name: bool) -> dict[str, torch.Tensor]:
    """Fill ``repo`` the way the previous cas left a store; return the checkpoint saved in it."""
    write_v1_config(repo.blobs)
    state = {"w": tensor(1, 8192), "b": tensor(2, 64)}
    repo.save(state, "runs/a/step_1")
    if long_name:
        repo.save(state, LONG)
        key = legacy_key(cas.names.parse_ref_name(LONG))
        assert key is not None
        repo.blobs.put(key, repo.blobs.get(ref_key(cas.names.parse_ref_name(LONG))))
        repo.blobs.delete(ref_key(cas.names.parse_ref_name(LONG)))
    write_old_history(repo, "runs/a/history", HISTORY)
    repo.commit(
        Manifest(kind="state", tensors=(), meta={"cas_pool_evictions": 1, "log": POOL_EVICTED}),
        "league/evictions",
        op="pool-evict",
    )
    repo.blobs.put(
        "state/eviction-log/pool/2026-03.jsonl",
        b"".join(json.dumps(r).encode() + b"\n" for r in MARCH),
    )
    append_evictions(repo.refs_store, "pool", APRIL)  # a log begun after eviction logs were refs
    return state


def reopened(blobs: BlobStore, clock: FakeClock) -> Repository:
    config = read_config(blobs)
    assert config is not None
    return Repository(blobs, config, clock=clock)


def assert_everything_reads(repo: Repository, state: dict[str, torch.Tensor]) -> None:
    for name in repo.refs_store.names():
        repo.manifest(name)  # every ref loads
    loaded: dict[str, Any] = repo.load("runs/a/step_1")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert TrainingHistory(repo, "runs/a/history").read() == HISTORY
    assert OpponentPool(repo, "league", capacity=1).evictions() == POOL_EVICTED
    assert repo.eviction_log("pool") == [*MARCH, *APRIL]  # once each, old records first
    report = repo.verify(level="full")
    assert report.ok, report.problems


def test_a_store_of_the_previous_format_version_is_moved_forward_and_every_ref_loads() -> None:
    clock = FakeClock(utc("2026-04-01 00:00"))
    blobs = MemoryBlobStore(clock)
    old = Repository(blobs, StoreConfig(chunk_size=4096, inline_max=64), clock=clock)
    state = build_v1_store(old, long_name=True)
    repo = reopened(blobs, clock)
    assert repo.config.version == 1

    report = migrate(repo)

    assert (report.from_version, report.to_version) == (1, STORE_VERSION)
    assert len(report.steps[0][1]) == 4  # the long name, the history, the pool list, the JSON lines
    assert reopened(blobs, clock).config.version == STORE_VERSION
    assert repo.manifest(LONG).meta == repo.manifest("runs/a/step_1").meta
    assert ref_key(cas.names.parse_ref_name(LONG)) in set(blobs.list("refs/"))
    assert not blobs.has(legacy_key(cas.names.parse_ref_name(LONG)) or "")
    assert repo.manifest("runs/a/history").meta["format"] == "cas-log"
    assert repo.manifest("league/evictions").meta["format"] == "cas-log"
    assert list(blobs.list("state/eviction-log/")) == []
    assert_everything_reads(reopened(blobs, clock), state)
    assert migrate(repo).steps == []  # a second run has nothing to do


def test_a_migration_killed_half_way_is_finished_by_running_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock(utc("2026-04-01 00:00"))
    blobs = MemoryBlobStore(clock)
    old = Repository(blobs, StoreConfig(chunk_size=4096, inline_max=64), clock=clock)
    state = build_v1_store(old, long_name=True)

    def killed(blobs: BlobStore, name: str) -> int:
        raise KeyboardInterrupt  # after the log holds the records, before the blobs go

    monkeypatch.setattr(legacy_logs, "delete_jsonl", killed)
    with pytest.raises(KeyboardInterrupt):
        migrate(reopened(blobs, clock))
    assert reopened(blobs, clock).config.version == 1
    assert reopened(blobs, clock).eviction_log("pool") == [*MARCH, *APRIL]  # nothing twice
    monkeypatch.undo()

    repo = reopened(blobs, clock)
    report = migrate(repo)
    assert report.to_version == STORE_VERSION
    assert_everything_reads(reopened(blobs, clock), state)


def cas_cli(store: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["--store", str(store), *args])
    return result.exit_code, result.output


def test_cas_migrate_on_a_local_store_plans_with_dry_run_then_verify_full_passes(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    clock = FakeClock(utc("2026-04-01 00:00"))
    old = cas.open(store, config=StoreConfig(chunk_size=4096, inline_max=64), clock=clock)
    build_v1_store(old, long_name=False)  # a local disk never held a long name whole

    code, out = cas_cli(store, "migrate", "--dry-run")
    assert code == 0, out
    assert "rewrite training-history log 'runs/a/history'" in out
    assert "would move the store from version 1 to 2" in out
    code, out = cas_cli(store, "migrate", "--dry-run", "--json")
    planned = json.loads(out)
    assert (planned["from_version"], planned["to_version"], planned["dry_run"]) == (1, 2, True)
    assert len(planned["steps"][0]["actions"]) == 3  # history, pool list, JSON-lines log
    assert json.loads((store / "config").read_text())["version"] == 1  # a dry run changes nothing

    code, out = cas_cli(store, "migrate")
    assert code == 0 and "moved the store from version 1 to 2" in out, out
    assert json.loads((store / "config").read_text())["version"] == STORE_VERSION
    code, out = cas_cli(store, "verify", "--full")
    assert code == 0, out
    code, out = cas_cli(store, "migrate")
    assert code == 0 and "nothing to do" in out, out


def test_a_store_newer_than_this_cas_is_refused_with_one_line(tmp_path: Path) -> None:
    store = tmp_path / "store"
    cas.open(store)
    doc = json.loads((store / "config").read_text())
    (store / "config").write_text(json.dumps({**doc, "version": STORE_VERSION + 1}))
    code, out = cas_cli(store, "migrate")
    assert code != 0
    assert f"store format version {STORE_VERSION + 1} is newer than this cas" in out
    assert "Traceback" not in out
    with pytest.raises(FormatError, match="upgrade cas"):
        cas.open(store)


def test_a_policy_change_on_an_old_store_keeps_its_version(tmp_path: Path) -> None:
    store = tmp_path / "store"
    cas.open(store)
    write_v1_config(cas.open(store).blobs)
    repo = cas.open(store)
    repo.update_config("notes", {"owner": "team"})
    assert json.loads((store / "config").read_text())["version"] == 1


def test_a_process_that_opened_the_store_before_migrate_does_not_move_it_back(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    cas.open(store)
    write_v1_config(cas.open(store).blobs)
    trainer = cas.open(store)  # a long-running process, opened at version 1
    migrate(cas.open(store))
    trainer.update_config("notes", {"owner": "team"})  # e.g. a retention policy it stores
    stored = json.loads((store / "config").read_text())
    assert stored["version"] == STORE_VERSION and stored["extra"]["notes"] == {"owner": "team"}


def test_a_migration_killed_between_copying_a_long_ref_and_deleting_its_old_key_is_finished(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock(utc("2026-04-01 00:00"))
    blobs = MemoryBlobStore(clock)
    old = Repository(blobs, StoreConfig(chunk_size=4096, inline_max=64), clock=clock)
    state = build_v1_store(old, long_name=True)
    name = cas.names.parse_ref_name(LONG)
    old_key = legacy_key(name)
    real_delete = MemoryBlobStore.delete_conditional

    def killed(self: MemoryBlobStore, key: str, expected: Any) -> None:
        if key == old_key:
            raise KeyboardInterrupt  # the new key is written, the old one still there
        real_delete(self, key, expected)

    monkeypatch.setattr(MemoryBlobStore, "delete_conditional", killed)
    with pytest.raises(KeyboardInterrupt):
        migrate(reopened(blobs, clock))
    monkeypatch.undo()
    assert {ref_key(name), old_key} <= set(blobs.list("refs/"))  # both keys: the new one wins
    assert [n for n in reopened(blobs, clock).refs_store.names() if n == LONG] == [LONG]

    migrate(reopened(blobs, clock))
    assert old_key not in set(blobs.list("refs/"))
    assert_everything_reads(reopened(blobs, clock), state)


def test_a_store_at_the_current_version_is_read_without_looking_for_older_layouts() -> None:
    clock = FakeClock(utc("2026-04-01 00:00"))
    blobs = MemoryBlobStore(clock)
    repo = Repository(blobs, StoreConfig(chunk_size=4096, inline_max=64), clock=clock)
    append_evictions(repo.refs_store, "pool", APRIL)
    listed: list[str] = []
    real_list = MemoryBlobStore.list

    def counting(self: MemoryBlobStore, prefix: str = "") -> Any:
        listed.append(prefix)
        return real_list(self, prefix)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MemoryBlobStore, "list", counting)
        assert repo.eviction_log("pool") == APRIL
        assert repo.eviction_logs() == ["pool"]
    assert not [p for p in listed if p.startswith("state/eviction-log/")]
