"""Append logs: records under a ref, verified, shared by every later version, and old stores still read.

The training history, the retention eviction logs and the opponent pool's eviction record are all
one ``AppendLog``. Stores written before it (history as msgpack inside uint8 tensors, the pool's
list in manifest meta, eviction logs as JSON-lines blobs) are built here by hand, object by
object, and read back with the new code.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

import cas
import cas.refs.log as log_mod
from cas.blobstore import MemoryBlobStore
from cas.codecs import codec_by_name
from cas.errors import FormatError, IntegrityError, NotFound
from cas.model.manifest import ChunkRef, Manifest, TensorEntry
from cas.objects.store import chunk_key
from cas.refs.log import AppendLog, LogRecord, LogSegment
from cas.refs.store import RefStore
from cas.repo.config import StoreConfig
from cas.retention.evictions import append_evictions
from cas.retention.policy import RetentionPolicy, Rule
from cas.testing.races import RaceBlobStore
from cas.training.history import TrainingHistory
from cas.training.pool import OpponentPool
from tests.retention_helpers import FakeClock, local_repo, memory_repo, tensor, utc


def small_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seal once a tail passes 200 bytes, so a few records make several segments."""
    monkeypatch.setattr(log_mod, "TAIL_BYTES", 200)


def steps(log: AppendLog) -> list[int]:
    return [r["step"] for r in log.records()]


# -- the primitive ---------------------------------------------------------------------------------


def test_records_come_back_in_order_from_tail_and_sealed_segments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small_tail(monkeypatch)
    repo = local_repo(tmp_path)
    log = repo.append_log("runs/r/history", "training-history")
    for start in range(0, 60, 6):
        log.append([{"step": s, "loss": 1.0 / (s + 1)} for s in range(start, start + 6)])
    head = log.head()
    assert len(head.segments) >= 3 and head.count == 60 and len(log) == 60
    assert steps(log) == list(range(60))
    assert [r["step"] for r in log.newest_first()] == list(reversed(range(60)))
    again = repo.append_log("runs/r/history", "training-history")  # another reader, cold
    assert again.records() == log.records()


def test_reading_the_newest_records_reads_only_the_segments_it_reaches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small_tail(monkeypatch)
    repo = local_repo(tmp_path)
    log = repo.append_log("runs/r/history", "training-history")
    for s in range(40):
        log.append([{"step": s, "note": "x" * 20}])
    reader = repo.append_log("runs/r/history", "training-history")
    read: list[str] = []
    real = reader._read_segment

    def counting(segment: LogSegment) -> tuple[LogRecord, ...]:
        read.append(segment.path)
        return real(segment)

    monkeypatch.setattr(reader, "_read_segment", counting)
    head = reader.head()
    newest = [r["step"] for r in itertools.islice(reader.newest_first(), len(head.tail) + 1)]
    assert newest == list(reversed(range(40 - len(head.tail) - 1, 40)))
    assert read == [head.segments[-1].path]  # one segment of many
    assert len(head.segments) > 2


def test_concurrent_appenders_from_one_version_both_land(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both appenders read the same head and meet at the barrier before their ref write: one
    wins, the other appends again onto the winner's head, and no record is lost."""
    blobs = MemoryBlobStore()
    AppendLog(RefStore(blobs), "runs/r/history", "training-history").append([{"step": 0}])
    held = RaceBlobStore(blobs, threading.Barrier(2), prefix="refs/")
    logs = [AppendLog(RefStore(held), "runs/r/history", "training-history") for _ in range(2)]
    threads = [threading.Thread(target=logs[i].append, args=([{"step": i + 1}],)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert held.held == 2
    final = AppendLog(RefStore(blobs), "runs/r/history", "training-history")
    assert sorted(steps(final)) == [0, 1, 2] and steps(final)[0] == 0


def test_a_repeated_append_with_a_key_adds_nothing_twice() -> None:
    repo = memory_repo(FakeClock(1000.0))
    log = repo.append_log("logs/l", "eviction-log")
    batch = [{"ref": f"r{i}", "manifest": "m"} for i in range(3)]
    assert log.append(batch, unique=lambda r: r["ref"]).added == 3
    assert log.append([*batch, batch[0]], unique=lambda r: r["ref"]).added == 0
    assert log.append(batch, unique=lambda r: r["ref"], lookback=1).added == 2
    assert len(log) == 5


def test_a_log_refuses_another_kind_a_forged_segment_and_a_missing_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small_tail(monkeypatch)
    repo = local_repo(tmp_path)
    history = repo.append_log("runs/r/history", "training-history")
    for s in range(20):
        history.append([{"step": s, "note": "x" * 20}])
    with pytest.raises(FormatError, match="holds a 'training-history' log, not eviction-log"):
        repo.append_log("runs/r/history", "eviction-log").records()
    repo.save({"x": torch.zeros(2)}, "runs/r/ckpt")
    with pytest.raises(FormatError, match="is not a training-history log"):
        repo.append_log("runs/r/ckpt", "training-history").records()
    # A head whose listing disagrees with the segment it names: refused, not misread.
    head = history.head()
    forged_counts = [*(s.count for s in head.segments[:-1]), head.segments[-1].count + 1]
    manifest = repo.manifest("runs/r/history")
    forged = Manifest(
        kind="files",
        tensors=(),
        files=manifest.files,
        meta={**manifest.meta, "segments": forged_counts, "records": head.count + 1},
    )
    repo.commit(forged, "runs/r/forged")
    with pytest.raises(FormatError, match=r"holds \d+ items, its listing says"):
        repo.append_log("runs/r/forged", "training-history").records()
    repo.blobs.delete(chunk_key(head.segments[0].chunk.digest))
    with pytest.raises(NotFound, match=r"log 'runs/r/history': segment segments/00000000"):
        repo.append_log("runs/r/history", "training-history").records()


def test_a_corrupt_segment_is_an_integrity_error(tmp_path: Path) -> None:
    repo = local_repo(tmp_path)
    log = repo.append_log("runs/r/history", "training-history")
    log.append([{"step": s, "note": "x" * 100} for s in range(log_mod.TAIL_BYTES // 50)])
    segment = log.head().segments[0]
    key = chunk_key(segment.chunk.digest)
    blob = bytearray(repo.blobs.get(key))
    blob[-1] ^= 0xFF
    repo.blobs.put(key, bytes(blob))
    with pytest.raises((IntegrityError, FormatError)):
        repo.append_log("runs/r/history", "training-history").records()


# -- stores written before append logs -------------------------------------------------------------


def old_history_segment(records: list[dict[str, Any]]) -> bytes:
    packed: bytes = msgpack.packb(records, use_bin_type=True)
    return packed


def write_old_history(repo: cas.Repository, ref: str, records: list[dict[str, Any]]) -> None:
    """A training history exactly as the previous code stored it: a manifest of uint8 tensors,
    sealed segments as chunks and the newest as an inline tail, each a msgpack list."""
    sealed, tail = old_history_segment(records[:-2]), old_history_segment(records[-2:])
    stored = repo.objects.put_chunk(sealed, codec_by_name("zstd"))
    entries = (
        TensorEntry("torch", "uint8", (len(sealed),), len(sealed), (ChunkRef(stored.digest, len(sealed)),)),
        TensorEntry("torch", "uint8", (len(tail),), len(tail), (), tail),
    )  # fmt: skip
    tree = {"~": "dict", "items": [["segments", {"~": "list", "items": [
        {"~": "tensor", "i": 0}, {"~": "tensor", "i": 1}]}]]}  # fmt: skip
    repo.commit(
        Manifest(
            kind="state",
            tensors=entries,
            tree=tree,
            meta={"format": "cas-history", "version": 1, "records": len(records)},
            created_at=repo.clock(),
            chunk_size=repo.config.chunk_size,
        ),
        ref,
        op="history",
    )


def test_a_history_stored_as_byte_tensors_is_read_and_continued(tmp_path: Path) -> None:
    repo = local_repo(tmp_path)
    records = [{"step": s, "loss": 1.0 / (s + 1), "tags": ["a", s]} for s in range(50)]
    write_old_history(repo, "runs/old/history", records)
    history = TrainingHistory(repo, "runs/old/history")
    assert history.read() == records and len(history) == 50
    assert history.append([{"step": 50, "loss": 0.0}]) == 51
    head = repo.manifest("runs/old/history")
    assert head.kind == "files" and head.meta["format"] == "cas-log" and not head.tensors
    assert TrainingHistory(repo, "runs/old/history").read() == [*records, {"step": 50, "loss": 0.0}]


def test_an_old_history_with_a_wrong_count_is_refused(tmp_path: Path) -> None:
    repo = local_repo(tmp_path)
    write_old_history(repo, "runs/old/history", [{"step": s} for s in range(5)])
    manifest = repo.manifest("runs/old/history")
    repo.commit(
        Manifest(
            kind="state",
            tensors=manifest.tensors,
            tree=manifest.tree,
            meta={**manifest.meta, "records": 6},
        ),
        "runs/old/history",
    )
    with pytest.raises(FormatError, match="holds 5 records, its head says 6"):
        TrainingHistory(repo, "runs/old/history").read()


def test_an_old_pool_eviction_list_is_read_and_continued(tmp_path: Path) -> None:
    repo = local_repo(tmp_path)
    old = [
        {"version": 1, "step": 500, "mu": 30.0, "ref": "league/pool_v0001_step00000500",
         "digest": "0" * 64, "evicted_at": 1000.0},
        {"version": 2, "step": 1000, "mu": 28.0, "ref": "league/pool_v0002_step00001000",
         "digest": "1" * 64, "evicted_at": 2000.0},
    ]  # fmt: skip
    repo.commit(
        Manifest(kind="state", tensors=(), meta={"cas_pool_evictions": 1, "log": old}),
        "league/evictions",
        op="pool-evict",
    )
    pool = OpponentPool(repo, "league", capacity=1)
    assert pool.evictions() == old
    assert pool.next_version() == 3  # evicted versions are never handed out again
    pool.promote({"w": torch.zeros(4)}, {"mu": 25.0})
    pool.promote({"w": torch.ones(4)}, {"mu": 26.0})  # evicts v3
    assert [e["version"] for e in pool.evictions()] == [1, 2, 3]
    assert repo.manifest("league/evictions").meta["format"] == "cas-log"


def test_json_lines_eviction_logs_are_read_before_the_new_log(tmp_path: Path) -> None:
    clock = FakeClock(utc("2026-04-01 00:00"))
    # Only a store of format version 1 (not yet `cas migrate`d) may hold JSON-lines logs.
    config = StoreConfig(chunk_size=4096, inline_max=64, version=1)
    repo = cas.open(tmp_path, config=config, clock=clock, fsync=False)
    march = [{"ref": f"pool/m{i}", "manifest": f"{i}" * 64, "reason": "old"} for i in range(3)]
    repo.blobs.put(
        "state/eviction-log/pool/2026-03.jsonl",
        b"".join(json.dumps(r).encode() + b"\n" for r in march),
    )
    assert repo.eviction_logs() == ["pool"]
    assert repo.eviction_log("pool") == march
    # A forget killed after logging under the old code and rerun now adds nothing twice.
    assert append_evictions(repo.refs_store, "pool", march[-1:]) == 0
    for i in range(4):
        clock.advance(60)
        repo.save({"t": tensor(i, 256)}, f"pool/new{i}")
    policy = RetentionPolicy(rules=(Rule("pool/*", keep_last=1, eviction_log="pool"),))
    assert repo.plan_forget(policy).execute().logged == 3
    log = repo.eviction_log("pool")
    assert log[:3] == march and [r["ref"] for r in log[3:]] == [f"pool/new{i}" for i in range(3)]
    assert repo.eviction_logs() == ["pool"]


# -- without torch ---------------------------------------------------------------------------------

NO_TORCH = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not installed here")
        return None

sys.meta_path.insert(0, NoTorch())
"""


def runs_without_torch(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter where importing torch fails."""
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_training_history_is_read_without_torch(tmp_path: Path) -> None:
    root = tmp_path / "store"
    repo = local_repo(root)
    write_old_history(repo, "runs/old/history", [{"step": s} for s in range(20)])
    TrainingHistory(repo, "runs/new/history").append([{"step": s, "loss": 0.5} for s in range(3)])
    if runs_without_torch("import cas").returncode != 0:
        pytest.skip(
            "`import cas` itself needs torch in this tree, so nothing under it can be checked"
        )
    done = runs_without_torch(f"""
        import sys
        import cas
        from cas.training.history import TrainingHistory
        assert "torch" not in sys.modules
        repo = cas.open({str(root)!r}, create=False, readonly=True)
        old = TrainingHistory(repo, "runs/old/history").read()
        new = TrainingHistory(repo, "runs/new/history").read()
        assert [r["step"] for r in old] == list(range(20)), old
        assert new == [{{"step": s, "loss": 0.5}} for s in range(3)], new
        assert "torch" not in sys.modules
        print("read without torch")
    """)
    assert done.returncode == 0, done.stderr
    assert "read without torch" in done.stdout


def test_importing_the_history_module_imports_no_torch() -> None:
    if runs_without_torch("import cas").returncode != 0:
        pytest.skip(
            "`import cas` itself needs torch in this tree, so nothing under it can be checked"
        )
    done = subprocess.run(
        [sys.executable, "-c", "import sys, cas.training.history; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
