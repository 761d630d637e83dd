"""Shared pytest fixtures; each section below serves one kind of test."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cas.testing.seaweed import DUMMY_ACCESS_KEY, DUMMY_SECRET_KEY, REGION, SeaweedServer
from tests.prerequisites import missing, require_weed

# S3: one SeaweedFS for the whole session; every test gets its own prefix in one bucket.

SESSION_BUCKET = "cas-tests"


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """A running SeaweedFS with an S3 endpoint and the bucket ``cas-tests``."""
    weed = require_weed()
    data_dir: Path = tmp_path_factory.mktemp("seaweed")
    server = SeaweedServer(data_dir, weed=weed)
    server.start()
    try:
        server.make_bucket(SESSION_BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_url(seaweed: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """``s3://cas-tests/<uuid>``: a fresh prefix, with AWS_* pointing at the test server."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", DUMMY_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", DUMMY_SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    for leaking in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(leaking, raising=False)
    return f"s3://{SESSION_BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture
def private_seaweed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SeaweedServer]:
    """A SeaweedFS of this test's own with the bucket ``crash``, so stopping or killing it
    disturbs no other test."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", DUMMY_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", DUMMY_SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    for leaking in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(leaking, raising=False)
    server = SeaweedServer(tmp_path / "seaweed", weed=require_weed())
    server.start()
    try:
        server.make_bucket("crash")
        yield server
    finally:
        server.stop()


# A full disk: a small tmpfs that writes fill up (ENOSPC).


@pytest.fixture
def small_disk(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """An 8 MiB tmpfs, so writes meet ENOSPC (mounting needs root); another size with
    ``@pytest.mark.parametrize("small_disk", ["1g"], indirect=True)``."""
    size = getattr(request, "param", "8m")
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        missing(f"cannot mount a small tmpfs to fill up: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


SLOWEST_FIRST = (
    "test_tiers_faults.py",
    "test_bench_tiers.py",
    "test_crash_safety.py",
    "test_gc_s3_races.py",
    "test_faults_anywhere.py",
    "test_signals.py",
    "test_gc_s3.py",
    "test_hostile_stores.py",
    "test_liveness_s3.py",
    "test_demo.py",
    "test_bench_core.py",
)
"""Test files that take a minute or more of a worker (``--durations``), started before the rest.
The workers take whole files in collection order (``--dist loadfile --no-loadscope-reorder``,
scripts/test.sh); handed out by their number of tests, the slowest file, with six, began near
the end and ran on alone for minutes."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of ``SLOWEST_FIRST`` first, in that order; every other test keeps its place,
    and each file's tests their order (a stable sort)."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
