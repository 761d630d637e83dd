"""Invariant 2: every byte returned was checked against its blake3 digest."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import cas
from tests.helpers import local_root, small_chunk_repo


def _flip_bit(path: Path, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    position = rng.randrange(len(data) * 8)
    data[position // 8] ^= 1 << (position % 8)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("use_mmap", "readonly"), [(False, False), (True, False), (False, True)])
def test_a_flipped_bit_in_any_chunk_is_detected(
    tmp_path: Path, use_mmap: bool, readonly: bool
) -> None:
    writer = small_chunk_repo(tmp_path / "store", chunk_size=4096)
    state = {"w": torch.randn(32, 64), "b": torch.randn(600)}
    writer.save(state, "r")
    # The read-only wrapper passes in-place reads through; they verify just the same.
    repo = cas.open(tmp_path / "store", readonly=True) if readonly else writer
    rng = random.Random(0)
    chunk_paths = sorted((local_root(writer) / "chunks").rglob("*"))
    chunk_paths = [p for p in chunk_paths if p.is_file()]
    assert len(chunk_paths) >= 3
    for path in chunk_paths:
        original = path.read_bytes()
        for _ in range(3):
            _flip_bit(path, rng)
            with pytest.raises(cas.IntegrityError):
                repo.load("r", mmap=use_mmap)
            path.write_bytes(original)
    assert torch.equal(repo.load("r")["w"], state["w"])


def test_a_flipped_bit_in_a_manifest_is_detected(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    repo.save({"w": torch.randn(100)}, "r")
    manifest_path = next(p for p in (local_root(repo) / "manifests").rglob("*") if p.is_file())
    rng = random.Random(1)
    original = manifest_path.read_bytes()
    for _ in range(20):
        _flip_bit(manifest_path, rng)
        with pytest.raises(cas.IntegrityError):
            repo.load("r")
        with pytest.raises(cas.IntegrityError):
            repo.show("r")
        manifest_path.write_bytes(original)


def test_verify_full_reports_corrupt_and_missing_chunks(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store", chunk_size=4096)
    repo.save({"w": torch.randn(64, 64)}, "good")
    repo.save({"w": torch.randn(64, 64)}, "bad")
    assert repo.verify(level="full").ok
    bad_chunks = [c.digest for c in repo.manifest("bad").tensors[0].chunks]
    root = local_root(repo)
    corrupt = root / "chunks" / bad_chunks[0][:2] / bad_chunks[0]
    _flip_bit(corrupt, random.Random(2))
    (root / "chunks" / bad_chunks[1][:2] / bad_chunks[1]).unlink()
    existence = repo.verify(level="existence")
    assert [p.kind for p in existence.problems] == ["missing-chunk"]
    full = repo.verify(level="full")
    assert sorted(p.kind for p in full.problems) == ["corrupt-chunk", "missing-chunk"]
    assert {p.ref for p in full.problems} == {"bad"}
    assert repo.verify(["good"], level="full").ok


def test_sampled_verification_rotates_through_the_whole_store(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store", chunk_size=4096)
    repo.save({"w": torch.randn(256, 256)}, "r")
    total = len(repo.manifest("r").chunk_digests())
    covered = 0
    for _ in range(4):
        covered += repo.verify(level="sample", sample_pct=25).rehashed_chunks
    assert covered == total


@pytest.mark.parametrize("codec", ["zstd", "bytegroup-zstd", "auto"])
def test_a_flipped_bit_in_an_encoded_chunk_is_detected(tmp_path: Path, codec: str) -> None:
    # Encoded chunks are read whole in place, then decoded from that copy: still verified.
    repo = small_chunk_repo(tmp_path / "store", chunk_size=4096, codec=codec)
    states = {"r/a": {"w": torch.arange(3000, dtype=torch.float32)}}
    states["r/b"] = {"w": states["r/a"]["w"] + 0.5}
    for ref, state in states.items():
        repo.save(state, ref, parent="r/a" if ref == "r/b" else None)
    chunk_paths = [p for p in sorted((local_root(repo) / "chunks").rglob("*")) if p.is_file()]
    assert chunk_paths and all(p.stat().st_size < 4096 for p in chunk_paths)  # encoded, smaller
    rng = random.Random(1)
    for path in chunk_paths:
        original = path.read_bytes()
        _flip_bit(path, rng)
        failed = 0
        for ref, state in states.items():
            try:
                assert torch.equal(repo.load(ref)["w"], state["w"])
            except cas.IntegrityError:
                failed += 1
        assert failed, path
        path.write_bytes(original)
