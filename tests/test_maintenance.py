"""The maintenance service: what an operator sees with `cas leases`, `cas unlock`, and the clocks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cas.blobstore import MemoryBlobStore, ReadOnlyBlobStore
from cas.blobstore.base import Version
from cas.cli import cli
from cas.errors import BackendError
from cas.refs.leases import LeaseManager, LeaseSettings
from cas.refs.maintenance import MAINTENANCE_LOCK_KEY, MaintenanceService
from tests.retention_helpers import FakeClock, local_repo


def test_an_operator_sees_a_dead_runs_lock_and_a_live_writer_then_breaks_the_lock(
    tmp_path: Path,
) -> None:
    repo = local_repo(tmp_path)
    store = str(tmp_path)
    with repo.maintenance.lock("gc", duration=600), repo.lease("save"):
        shown = CliRunner().invoke(cli, ["--store", store, "leases", "--json"])
        assert shown.exit_code == 0, shown.output
        report = json.loads(shown.output)
        assert report["maintenance_lock"]["holder"].startswith("gc by ")
        assert [(r["purpose"], r["live"]) for r in report["leases"]] == [("save", True)]
        # The run is gone as far as the operator knows: break its lock.
        broken = CliRunner().invoke(cli, ["--store", store, "unlock", "--yes"])
        assert broken.output == "lock removed\n"
        assert repo.maintenance_lock_holder() is None
    assert CliRunner().invoke(cli, ["--store", store, "unlock", "--yes"]).output == (
        "there was no lock\n"
    )


def test_an_expired_lease_is_reaped_only_if_its_writer_did_not_come_back() -> None:
    clock = FakeClock(1000.0)
    blobs = MemoryBlobStore(clock)
    writers = LeaseManager(blobs, clock, LeaseSettings(duration=600, margin=60))
    service = MaintenanceService(blobs, clock, writers)
    lease = writers.acquire("slow writer")
    assert lease is not None
    clock.advance(700)
    (seen,) = service.lease_states()
    assert not seen.live
    # The blob changes after GC read it (its writer came back, say): GC must leave it.
    blobs.put_transient(lease.key, blobs.get(lease.key) + b" ")
    assert not service.reap(seen.lease) and blobs.has(lease.key)
    (again,) = service.leases()
    assert service.reap(again) and not blobs.has(lease.key)


def test_the_store_clock_comes_from_the_store_else_the_injected_clock() -> None:
    store_clock, host_clock = FakeClock(5000.0), FakeClock(1000.0)
    blobs = MemoryBlobStore(store_clock)
    writers = LeaseManager(blobs, host_clock, LeaseSettings())
    assert MaintenanceService(blobs, host_clock, writers).store_time() == 5000.0
    read_only = ReadOnlyBlobStore(blobs)
    assert MaintenanceService(read_only, host_clock, writers).store_time() == 1000.0


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_dead_writers_lease_and_a_dead_gcs_lock_lapse_at_once_on_their_host() -> None:
    clock = FakeClock(1000.0)
    blobs = MemoryBlobStore(clock)
    writers = LeaseManager(blobs, clock, LeaseSettings(duration=600, margin=60))
    service = MaintenanceService(blobs, clock, writers)
    lease = writers.acquire("killed writer")
    assert lease is not None
    (alive,) = service.lease_states()
    assert alive.live  # its process (this one) runs
    doc = json.loads(blobs.get(lease.key))
    blobs.put_transient(lease.key, json.dumps({**doc, "pid": _dead_pid()}).encode())
    (dead,) = service.lease_states()
    assert not dead.live  # long before its expiry

    with service.lock("gc"):
        held = json.loads(blobs.get(MAINTENANCE_LOCK_KEY))
    blobs.put(MAINTENANCE_LOCK_KEY, json.dumps({**held, "pid": _dead_pid()}).encode())
    with service.lock("gc"):  # taken over at once, not after LOCK_DURATION
        pass


class _DownAfterFirstDelete(MemoryBlobStore):
    """A server that dies in the middle of a sweep and stays down."""

    down = False

    def delete(self, key: str) -> None:
        if self.down:
            raise BackendError(f"S3 delete {key}: connection refused")
        super().delete(key)

    def delete_conditional(self, key: str, expected: Version) -> None:
        if self.down:
            raise BackendError(f"S3 delete_conditional {key}: connection refused")
        super().delete_conditional(key, expected)


def test_a_run_interrupted_by_a_dead_server_reports_what_failed_not_the_lock() -> None:
    clock = FakeClock(1000.0)
    blobs = _DownAfterFirstDelete(clock)
    service = MaintenanceService(blobs, clock, LeaseManager(blobs, clock, LeaseSettings()))
    with pytest.raises(BackendError, match="S3 delete chunks/x"), service.lock("gc"):
        blobs.down = True
        blobs.delete("chunks/x")
