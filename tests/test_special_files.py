"""Only regular files are blobs: a FIFO, device or socket inside a local store is damage, not a hang.

The story of issue 26: a FIFO planted as a chunk or as a ref hung ``cas ls`` and ``cas pull``
for ever, waiting for a writer that never came. Every open of a store file is non-blocking and
checks the file's type first; what is not a regular file is an IntegrityError naming it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cas
from cas.blobstore.bulk import read_into
from cas.blobstore.local import LocalBlobStore
from cas.digest import Digest
from cas.errors import IntegrityError, NotFound
from cas.objects.store import chunk_key

TIMEOUT = 60
"""Seconds a command may take on a small store before it counts as hung."""


def planted_store(root: Path) -> Digest:
    """A store with refs runs/a and runs/b; runs/a's chunk and runs/b's record are FIFOs.
    Returns the chunk's digest."""
    with cas.open(root) as repo:
        repo.save({"w": np.arange(100_000, dtype=np.float32)}, "runs/a")
        repo.save({"w": np.ones(1000, dtype=np.float32)}, "runs/b")
        digest = repo.manifest("runs/a").tensors[0].chunks[0].digest
    for path in (root / chunk_key(digest), root / "refs" / "runs%2Fb"):
        path.unlink()
        os.mkfifo(path)
    return digest


def run(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``cas --store STORE ARGS``; TimeoutExpired (a failure) if it hangs."""
    command = [sys.executable, "-m", "cas", "--store", str(store), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT)


def test_a_fifo_planted_as_a_chunk_or_a_ref_does_not_hang_ls_or_pull(tmp_path: Path) -> None:
    store = tmp_path / "store"
    planted_store(store)
    for args in (["ls"], ["ls", "-l"]):
        result = run(store, *args)
        assert result.returncode == 0 and result.stdout.split()[-1] == "runs/a", result
        assert result.stderr.strip() == (
            "cas: warning: cannot read runs/b: blob 'refs/runs%2Fb' is a FIFO, not a regular file"
        )
    pulled = run(tmp_path / "copy", "pull", "--from", str(store), "runs/a")
    assert pulled.returncode == 1 and len(pulled.stderr.strip().splitlines()) == 1, pulled
    assert "is a FIFO, not a regular file" in pulled.stderr
    assert "runs/a" not in run(tmp_path / "copy", "ls").stdout
    verified = run(store, "verify")
    assert verified.returncode == 1
    assert "bad-ref: blob 'refs/runs%2Fb' is a FIFO" in verified.stderr
    assert "corrupt-chunk" in verified.stderr and "is a FIFO" in verified.stderr


def test_a_load_or_get_through_a_fifo_chunk_is_an_integrity_error(tmp_path: Path) -> None:
    digest = planted_store(tmp_path / "store")
    with cas.open(tmp_path / "store") as repo:
        with pytest.raises(IntegrityError, match="is a FIFO, not a regular file"):
            repo.load("runs/a")
        with pytest.raises(IntegrityError, match="is a FIFO, not a regular file"):
            repo.objects.get_chunk(digest)
        with pytest.raises(IntegrityError, match="is a FIFO, not a regular file"):
            repo.objects.map_raw_chunk(digest, 400_000)
    result = run(tmp_path / "store", "get", "runs/a", str(tmp_path / "out"))
    assert result.returncode == 1 and "is a FIFO, not a regular file" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["FIFO", "socket", "character device"])
def test_every_read_of_a_local_blob_refuses_a_special_file(tmp_path: Path, kind: str) -> None:
    blobs = LocalBlobStore(tmp_path / "store")
    blobs.put("refs/x", b"a record")
    path = tmp_path / "store" / "refs" / "x"
    path.unlink()
    if kind == "FIFO":
        os.mkfifo(path)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
    else:
        path.symlink_to("/dev/zero")
    what = "a socket" if kind == "socket" else f"a {kind}"
    message = f"blob 'refs/x' is {what}, not a regular file"
    with pytest.raises(IntegrityError, match=message):
        blobs.get("refs/x")
    with pytest.raises(IntegrityError, match=message):
        blobs.get_range("refs/x", 0, 4)
    with pytest.raises(IntegrityError, match=message):
        read_into(blobs, "refs/x", 0, [memoryview(bytearray(4))])
    with pytest.raises(IntegrityError, match=message):
        blobs.put_conditional("refs/x", b"new", None)


def test_a_missing_blob_is_still_not_found(tmp_path: Path) -> None:
    blobs = LocalBlobStore(tmp_path / "store")
    blobs.put("chunks/ab/cd", b"x")
    for key in ("chunks/ab/none", "chunks/ab"):
        with pytest.raises(NotFound):
            blobs.get(key)
        with pytest.raises(NotFound):
            read_into(blobs, key, 0, [memoryview(bytearray(4))])
