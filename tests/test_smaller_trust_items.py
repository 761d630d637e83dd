"""The smaller items of issue 26: each a reader or writer saying what is true, one line each.

A file entry declaring 5 bytes over a 100-byte chunk returned 100 bytes from ``get`` and ``load``;
a stored mode 6777 was restored as 0777 without a word; ``cas put`` of a FIFO said "no such
file"; a manifest whose envelope declared too many bytes was called a chunk.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import cas
from cas.codecs import codec_by_name
from cas.errors import FormatError, IntegrityError
from cas.objects.envelope import encode_header
from cas.objects.store import manifest_key
from tests.hostile import HOSTILE_REF, plant_chunk, plant_manifest


def files_doc(digest: bytes, size: int, mode: int = 0o644) -> dict[str, Any]:
    """A files manifest holding one file ``a.bin`` of ``size`` bytes in the chunk ``digest``."""
    entry = {"size": size, "format": "raw", "mode": mode, "chunks": [[digest, size]], "regions": []}
    return {
        "format": "cas-manifest",
        "version": 1,
        "kind": "files",
        "created_at": 0.0,
        "parent": None,
        "chunk_size": 4 << 20,
        "meta": {},
        "tensors": [],
        "files": {"a.bin": entry},
    }


def cli(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "cas", "--store", str(store), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_a_file_entry_declaring_5_bytes_of_a_100_byte_chunk_is_refused_by_get_and_load(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    plant_manifest(store, files_doc(plant_chunk(store, bytes(range(100))), 5))
    with (
        cas.open(store) as repo,
        pytest.raises(IntegrityError, match="has 100 bytes, manifest says 5"),
    ):
        repo.load(HOSTILE_REF)
    result = cli(store, "get", HOSTILE_REF, str(tmp_path / "out"))
    assert result.returncode == 1
    assert result.stderr.strip().endswith("has 100 bytes, manifest says 5")
    assert not (tmp_path / "out" / "a.bin").exists()


def test_a_stored_mode_6777_is_refused_never_restored(tmp_path: Path) -> None:
    store = tmp_path / "store"
    plant_manifest(store, files_doc(plant_chunk(store, bytes(8)), 8, mode=0o6777))
    with cas.open(store) as repo, pytest.raises(FormatError, match="file mode 0o6777 is not"):
        repo.manifest(HOSTILE_REF)
    result = cli(store, "get", HOSTILE_REF, str(tmp_path / "out"))
    assert result.returncode == 1 and "file mode 0o6777 is not permission bits" in result.stderr
    assert not (tmp_path / "out" / "a.bin").exists()


def test_permission_bits_are_restored_as_stored(tmp_path: Path) -> None:
    store = tmp_path / "store"
    plant_manifest(store, files_doc(plant_chunk(store, bytes(8)), 8, mode=0o750))
    assert cli(store, "get", HOSTILE_REF, str(tmp_path / "out")).returncode == 0
    assert (tmp_path / "out" / "a.bin").stat().st_mode & 0o7777 == 0o750


def test_cas_put_of_a_fifo_says_it_is_a_fifo(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    result = cli(tmp_path / "store", "put", str(tmp_path / "pipe"), "runs/p")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"cas: error: FormatError: {tmp_path / 'pipe'}: a FIFO, not a regular file or directory "
        "(cas stores only those)"
    )


def test_a_manifest_declaring_too_many_bytes_is_called_a_manifest(tmp_path: Path) -> None:
    with cas.open(tmp_path / "store") as repo:
        repo.save({"x": 1}, "runs/a")
        digest = repo.resolve("runs/a")
        data = repo.objects.get_manifest(digest)
        oversized = encode_header(codec_by_name("raw"), b"", 1 << 40) + data
        repo.blobs.put(manifest_key(digest), oversized)
        with pytest.raises(IntegrityError, match=f"^manifest {digest} is corrupt: object declares"):
            repo.manifest("runs/a")
