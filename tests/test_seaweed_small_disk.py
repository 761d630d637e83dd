"""The SeaweedFS fixture on a machine with little free disk: every bucket can still be written.

``weed server -volume.max=0`` sizes its volume count by the free disk (free / volume size limit).
On a CI machine with a couple of GB free that was a handful of volumes, one per bucket, and once
they were taken every write to a new bucket failed with 500 InternalError: 24 S3 tests failed at
once. And by default a volume turns read-only below 1% of the disk free: on a big disk 99% full,
every write hung until the client's read timeout. The server here runs on a 1 GiB tmpfs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cas.testing.seaweed import SeaweedServer
from tests.prerequisites import require_weed

BUCKETS = 12


@pytest.mark.parametrize("small_disk", ["1g"], indirect=True)
@pytest.mark.parametrize("free_mib", [1024, 8], ids=["empty", "99-percent-full"])
def test_a_server_on_a_small_disk_takes_writes_in_a_dozen_buckets(
    small_disk: Path, free_mib: int
) -> None:
    require_weed()
    if free_mib < 1024:  # fill all but free_mib of it (pages of a tmpfs: memory, for a moment)
        with open(small_disk / "fill", "wb") as f:
            os.posix_fallocate(f.fileno(), 0, (1024 - free_mib) << 20)
    with SeaweedServer(small_disk / "weed") as server:
        client = server.client()
        written = []
        for i in range(BUCKETS):
            bucket = f"bucket-{i:02d}"
            client.create_bucket(Bucket=bucket)
            client.put_object(Bucket=bucket, Key="k", Body=b"x", IfNoneMatch="*")
            written.append(client.get_object(Bucket=bucket, Key="k")["Body"].read())
        assert written == [b"x"] * BUCKETS
