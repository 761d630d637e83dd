"""Ref history: recent events inside the record, older ones sealed into segments, all still read."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import msgpack
import pytest
import torch
from click.testing import CliRunner

import cas
import cas.refs.records as records_mod
import cas.refs.store as refs_mod
from cas.blobstore import Version
from cas.cli import cli
from cas.digest import Digest
from cas.errors import FormatError, NotFound, RefConflict
from cas.names import RefName
from cas.objects.store import manifest_key
from cas.refs.keys import ref_key
from cas.refs.records import RefRecord, decode_ref
from cas.refs.store import RefStore
from cas.retention.gc import GCSettings
from cas.training.manager import CheckpointManager
from tests.retention_helpers import FakeClock, chunk_digests, local_repo, memory_repo, tensor


def small_sealing(monkeypatch: pytest.MonkeyPatch, inline: int = 8, seal: int = 4) -> None:
    """Seal after ``inline`` events, ``seal`` at a time, so tests need few updates."""
    monkeypatch.setattr(refs_mod, "INLINE_HISTORY", inline)
    monkeypatch.setattr(refs_mod, "SEAL_EVENTS", seal)


def targets(repo: cas.Repository, count: int) -> list[Digest]:
    """``count`` distinct manifests to point refs at (one tiny inline tensor each)."""
    return [repo.save({"x": torch.tensor([i])}, f"scratch/{i}") for i in range(count)]


def test_record_stays_small_while_every_event_stays_readable(tmp_path: Path) -> None:
    repo = local_repo(tmp_path)
    digests = targets(repo, 3)
    store = repo.refs_store
    updates = 700
    for i in range(updates):
        store.set("runs/r/latest", digests[i % 3], op="save", message=f"save {i}")
    record = store.get("runs/r/latest")
    assert len(record.history) <= refs_mod.INLINE_HISTORY
    assert record.sealed and record.depth == updates
    # Without sealing the record held all 700 events (about 85 KB) and grew with every save.
    assert len(repo.blobs.get(ref_key(record.name))) < 20_000
    events = list(store.events(record))
    assert [e.message for e in events] == [f"save {i}" for i in reversed(range(updates))]
    assert [e.target for e in events] == [digests[i % 3] for i in reversed(range(updates))]
    for back in (0, len(record.history) - 1, len(record.history), 400, updates - 1):
        assert repo.resolve(f"runs/r/latest~{back}") == digests[(updates - 1 - back) % 3]
    with pytest.raises(NotFound, match="has only 700 versions"):
        repo.resolve(f"runs/r/latest~{updates}")
    assert [e.message for e in repo.log("runs/r/latest", 3)] == ["save 699", "save 698", "save 697"]


def test_history_is_capped_by_dropping_whole_sealed_segments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small_sealing(monkeypatch)
    monkeypatch.setattr(refs_mod, "MAX_HISTORY", 30)
    repo = local_repo(tmp_path)
    (digest,) = targets(repo, 1)
    for i in range(100):
        repo.refs_store.set("ref", digest, message=str(i))
    record = repo.refs_store.get("ref")
    assert 30 <= record.depth < 30 + 2 * 4
    messages = [e.message for e in repo.refs_store.events(record)]
    assert messages == [str(i) for i in reversed(range(100 - record.depth, 100))]


def test_a_record_without_sealed_history_keeps_format_version_1(tmp_path: Path) -> None:
    repo = local_repo(tmp_path)
    (digest,) = targets(repo, 1)
    repo.refs_store.set("short", digest)
    doc = msgpack.unpackb(repo.blobs.get(ref_key(RefName("short"))))
    assert doc["version"] == 1 and "sealed" not in doc
    for _ in range(refs_mod.INLINE_HISTORY + 1):
        repo.refs_store.set("long", digest)
    doc = msgpack.unpackb(repo.blobs.get(ref_key(RefName("long"))))
    assert doc["version"] == 2 and len(doc["sealed"]) == 1
    doc["version"] = 3
    repo.blobs.put(ref_key(RefName("long")), msgpack.packb(doc))
    with pytest.raises(FormatError, match="unsupported version 3"):
        repo.refs_store.get("long")


def test_a_long_version_1_record_is_sealed_at_its_next_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = local_repo(tmp_path)
    (digest,) = targets(repo, 1)
    monkeypatch.setattr(refs_mod, "INLINE_HISTORY", 10_000)  # as written before sealing existed
    for i in range(500):
        repo.refs_store.set("old", digest, message=str(i))
    assert msgpack.unpackb(repo.blobs.get(ref_key(RefName("old"))))["version"] == 1
    monkeypatch.undo()
    repo.refs_store.set("old", digest, message="500")
    record = repo.refs_store.get("old")
    assert len(record.history) <= refs_mod.INLINE_HISTORY and record.depth == 501
    assert [e.message for e in repo.refs_store.events(record)] == [
        str(i) for i in reversed(range(501))
    ]


def test_a_missing_or_foreign_segment_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small_sealing(monkeypatch)
    repo = local_repo(tmp_path)
    digests = targets(repo, 2)
    for i in range(20):
        repo.refs_store.set("a", digests[0], message=str(i))
        repo.refs_store.set("b", digests[1], message=str(i))
    a, b = repo.refs_store.get("a"), repo.refs_store.get("b")
    # b's record naming a's segment: the segment must say which ref it belongs to.
    forged = dataclasses.replace(b, sealed=a.sealed)
    with pytest.raises(FormatError, match="not a history segment of this ref"):
        list(repo.refs_store.events(forged))
    repo.blobs.delete(manifest_key(a.sealed[-1].digest))
    with pytest.raises(NotFound, match=r"ref 'a': history segment \w+: manifest \w+ is missing"):
        list(repo.refs_store.events(a))
    assert repo.resolve("a~0") == digests[0]  # the inline part still reads
    report = repo.verify(level="structure")
    assert [(p.ref, p.kind) for p in report.problems] == [("a", "bad-history")]


def saved_every_minute(
    monkeypatch: pytest.MonkeyPatch, count: int = 20
) -> tuple[cas.Repository, FakeClock, list[Digest]]:
    """A memory store (small sealing) with ``count`` checkpoints saved to ``runs/r/latest`` one
    minute apart, each with its own chunks."""
    small_sealing(monkeypatch)
    clock = FakeClock(1_000_000.0)
    repo = memory_repo(clock)
    digests = []
    for i in range(count):
        if i:
            clock.advance(60)
        digests.append(repo.save({"t": tensor(i, 8192)}, "runs/r/latest"))
    return repo, clock, digests


def test_gc_reads_sealed_history_inside_the_reflog_window_and_keeps_the_segments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    repo, _, digests = saved_every_minute(monkeypatch)
    record = repo.refs_store.get("runs/r/latest")
    assert len(record.history) <= 8 and record.depth == 20
    # Save i was current from minute i to minute i + 1; the window reaches back to minute 4, so
    # saves 3..19 are kept, most of them only through sealed segments.
    repo.plan_gc(GCSettings(grace=0, reflog_window=15 * 60)).execute()
    for i, digest in enumerate(digests):
        if i >= 3:
            assert repo.load(digest)["t"].equal(tensor(i, 8192))
        else:
            with pytest.raises(NotFound):
                repo.load(digest)
    assert all(repo.blobs.has(manifest_key(s.digest)) for s in record.sealed)
    assert len(list(repo.refs_store.events(repo.refs_store.get("runs/r/latest")))) == 20


def test_gc_sweeps_the_segments_of_a_deleted_ref(monkeypatch: pytest.MonkeyPatch) -> None:
    repo, clock, _ = saved_every_minute(monkeypatch)
    sealed = repo.refs_store.get("runs/r/latest").sealed
    repo.rm("runs/r/latest")
    clock.advance(1)
    repo.plan_gc(GCSettings(grace=0, reflog_window=0)).execute()
    assert not any(repo.blobs.has(manifest_key(s.digest)) for s in sealed)
    assert chunk_digests(repo) == set()


def test_gc_deletes_nothing_while_a_segment_inside_the_window_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    repo, clock, _ = saved_every_minute(monkeypatch)
    record = repo.refs_store.get("runs/r/latest")
    oldest = record.sealed[0]
    repo.blobs.delete(manifest_key(oldest.digest))
    before = chunk_digests(repo)
    # Outside the window the segment is not needed, so GC goes ahead.
    assert oldest.until < clock() - 10 * 60
    repo.plan_gc(GCSettings(grace=3600, reflog_window=10 * 60))
    plan = repo.plan_gc(GCSettings(grace=0, reflog_window=3600))
    assert plan.held and plan.chunks == () and plan.manifests == ()
    assert "history cannot be read" in plan.damaged[0].problem
    plan.execute()
    assert chunk_digests(repo) == before


def test_resume_falls_back_into_sealed_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small_sealing(monkeypatch)
    repo = cas.open(tmp_path / "store")
    weights = torch.zeros(4096)
    with CheckpointManager(repo, run="r1", signals=False) as mgr:
        saved = [mgr.save(step, {"w": weights + step}).result() for step in range(1, 15)]
    assert len(repo.refs_store.get(mgr.latest_ref).history) < 10
    for result in saved[2:]:  # every checkpoint the record still lists inline, and more
        repo.blobs.delete(manifest_key(result.digest))
    with CheckpointManager(repo, run="r1", signals=False) as mgr:
        restored = mgr.restore("resume")
    assert restored.step == 2 and restored.state["w"].equal(weights + 2)
    assert len(restored.fallbacks) == 12


def test_cas_log_shows_sealed_history_and_takes_a_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small_sealing(monkeypatch)
    repo = local_repo(tmp_path)
    (digest,) = targets(repo, 1)
    for i in range(30):
        repo.refs_store.set("ref", digest, message=f"m{i}")
    runner = CliRunner()
    full = runner.invoke(cli, ["--store", str(tmp_path), "log", "ref", "--json"])
    assert full.exit_code == 0, full.output
    assert [e["message"] for e in json.loads(full.output)] == [f"m{i}" for i in range(29, -1, -1)]
    short = runner.invoke(cli, ["--store", str(tmp_path), "log", "ref", "-n", "2"])
    assert short.exit_code == 0 and short.output.count("ref~") == 2, short.output
    assert "ref~1" in short.output and "m28" in short.output
    bad = runner.invoke(cli, ["--store", str(tmp_path), "log", "ref", "-n", "0"])
    assert bad.exit_code == 2


def test_a_ref_store_on_its_own_blobs_reads_and_writes_segments(tmp_path: Path) -> None:
    store = RefStore(cas.open(tmp_path).blobs)
    digest = Digest("ab" * 32)
    for i in range(refs_mod.INLINE_HISTORY + 1):
        store.set("lonely", digest, message=str(i))
    record = store.get("lonely")
    assert record.sealed and len(list(store.events(record))) == refs_mod.INLINE_HISTORY + 1


def test_an_unchanged_record_is_not_decoded_again_and_a_change_is_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = local_repo(tmp_path)
    digests = targets(repo, 3)
    mine, other = repo.refs_store, RefStore(repo.blobs)
    decoded: list[str] = []
    real_decode = decode_ref  # records.decode_stored calls it by this name; patched there below

    def counting_decode(name: RefName, data: bytes, version: Version | None) -> RefRecord:
        decoded.append(name)
        return real_decode(name, data, version)

    monkeypatch.setattr(records_mod, "decode_ref", counting_decode)
    mine.set("runs/r/latest", digests[0], expected=None)
    for i in (1, 2):
        mine.set("runs/r/latest", digests[i], expected=digests[i - 1])
    assert mine.get("runs/r/latest").target == digests[2]
    assert decoded == []  # every read found the record this store had just written
    other.set("runs/r/latest", digests[0], expected=digests[2])  # another writer, another process
    assert mine.get("runs/r/latest").target == digests[0]
    assert decoded == ["runs/r/latest", "runs/r/latest"]  # other's read, then mine of its write
    with pytest.raises(RefConflict):
        mine.set("runs/r/latest", digests[1], expected=digests[2])
    other.delete("runs/r/latest")
    assert mine.try_get("runs/r/latest") is None
