"""A compare-and-swap that landed but answered "precondition failed" is recognised as our own.

That is what a retry below cas looks like (an HTTP client that resends a write whose reply was
lost): the resend finds the key holding what the first attempt wrote. The ref store and the
maintenance lock recognise their own write by what they wrote, whatever layer retried it.
"""

from __future__ import annotations

from pathlib import Path

import torch

import cas
from cas.blobstore.base import BlobStore, BytesLike, Version
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.errors import PreconditionFailed
from cas.names import RefName
from cas.refs.keys import ref_key
from cas.refs.maintenance import MAINTENANCE_LOCK_KEY
from cas.retention.gc import GCSettings


class LandsThenRefuses(BlobStoreWrapper):
    """The first conditional write of ``key`` is stored, then answered PreconditionFailed."""

    def __init__(self, inner: BlobStore, key: str) -> None:
        super().__init__(inner)
        self.key = key
        self.tripped = False

    def put_conditional(self, key: str, data: BytesLike, expected: Version | None) -> Version:
        version = self.inner.put_conditional(key, data, expected)
        if key == self.key and not self.tripped:
            self.tripped = True
            raise PreconditionFailed(f"{key}: the resent write found the key changed")
        return version


def lossy(root: Path, key: str) -> tuple[cas.Repository, LandsThenRefuses]:
    repo = cas.open(root)
    blobs = LandsThenRefuses(repo.blobs, key)
    return cas.Repository(blobs, repo.config), blobs


def test_a_save_whose_landed_ref_write_answered_412_records_its_event_once(
    tmp_path: Path,
) -> None:
    cas.open(tmp_path / "s").save({"w": torch.zeros(4)}, "runs/r1/latest")
    repo, blobs = lossy(tmp_path / "s", ref_key(RefName("runs/r1/latest")))

    second = repo.save({"w": torch.ones(4)}, "runs/r1/latest")

    assert blobs.tripped
    events = cas.open(tmp_path / "s").log("runs/r1/latest")
    assert [e.target for e in events][:1] == [second]
    assert len(events) == 2


def test_a_push_whose_landed_ref_write_answered_412_is_no_conflict(tmp_path: Path) -> None:
    local = cas.open(tmp_path / "local")
    target = local.save({"w": torch.ones(8)}, "gates/best")
    remote, blobs = lossy(tmp_path / "remote", ref_key(RefName("gates/best")))

    report = local.push(remote, ["gates/best"])

    assert blobs.tripped
    assert [r.status for r in report.refs] == ["created"]
    assert cas.open(tmp_path / "remote").resolve("gates/best") == target


def test_gc_whose_landed_lock_take_answered_412_knows_the_lock_is_its_own(tmp_path: Path) -> None:
    cas.open(tmp_path / "s").save({"w": torch.ones(4)}, "runs/r1/latest")
    repo, blobs = lossy(tmp_path / "s", MAINTENANCE_LOCK_KEY)

    repo.plan_gc(GCSettings(grace=0, reflog_window=0)).execute()

    assert blobs.tripped
    assert repo.maintenance_lock_holder() is None
