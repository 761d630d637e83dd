"""Lazy partial reads: ``with repo.open(ref) as ckpt`` reads only the chunks a caller asks for."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import cas
from cas.blobstore.base import BlobStore
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.errors import NotFound
from cas.model.state import iter_tensor_paths
from cas.objects.store import chunk_key
from cas.repo.config import StoreConfig
from cas.repo.lazy import ClosedCheckpoint

CHUNK = 16 << 10
ROWS, COLS = 256, 128  # 128 KiB of float32: 8 chunks of 32 rows each


class RecordingReads(BlobStoreWrapper):
    """Records every chunk key read; never hands out a local path, so each read goes through it."""

    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner)
        self.lock = threading.Lock()
        self.chunk_reads: list[str] = []

    def _note(self, key: str) -> None:
        if key.startswith("chunks/"):
            with self.lock:
                self.chunk_reads.append(key)

    def get(self, key: str) -> bytes:
        self._note(key)
        return self.inner.get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        self._note(key)
        return self.inner.get_range(key, start, end)

    def local_path(self, key: str) -> Path | None:
        return None


def _saved(url: str) -> tuple[cas.Repository, RecordingReads, dict[str, torch.Tensor]]:
    repo = cas.open(url, config=StoreConfig(chunk_size=CHUNK, inline_max=256))
    torch.manual_seed(0)
    w, b = torch.randn(ROWS, COLS), torch.randn(COLS)
    state = {"model": {"w": w, "b": b}, "step": 7}
    repo.save(state, "runs/r1/ckpt", metadata={"loss": 0.5})
    recording = RecordingReads(repo.blobs)
    return cas.Repository(recording, repo.config), recording, {"w": w, "b": b}


def _keys_of(repo: cas.Repository, name: str, chunks: slice) -> set[str]:
    manifest = repo.manifest("runs/r1/ckpt")
    index = dict(iter_tensor_paths(manifest.tree))[name]
    return {chunk_key(c.digest) for c in manifest.tensors[index].chunks[chunks]}


def _reads_only_what_it_returns(url: str) -> None:
    repo, recording, model = _saved(url)
    with repo.open("runs/r1/ckpt") as ckpt:
        assert sorted(ckpt.keys()) == ["model.b", "model.w"]
        assert ckpt.metadata["loss"] == 0.5 and ckpt.plain_values() == {"step": 7}
        assert recording.chunk_reads == []  # opening reads the manifest only

        rows = ckpt.get_slice("model.w")[40:70]  # rows 40..69 lie in chunks 1 and 2
        assert torch.equal(rows, model["w"][40:70])
        assert set(recording.chunk_reads) == _keys_of(repo, "model.w", slice(1, 3))

        recording.chunk_reads.clear()
        assert torch.equal(ckpt.get_slice("model.w")[-1, 5:9], model["w"][-1, 5:9])
        assert set(recording.chunk_reads) == _keys_of(repo, "model.w", slice(7, 8))

        recording.chunk_reads.clear()
        assert torch.equal(ckpt["model.b"], model["b"])
        assert set(recording.chunk_reads) == _keys_of(repo, "model.b", slice(None))

        assert torch.equal(ckpt.get_slice("model.w")[::64], model["w"][::64])
        assert ckpt.get_slice("model.w").get_shape() == [ROWS, COLS]
        with pytest.raises(NotFound, match=r"model\.nope"):
            ckpt["model.nope"]
    with pytest.raises(ClosedCheckpoint):
        ckpt["model.b"]


def test_thalia_reads_a_few_rows_of_one_tensor_from_a_local_store(tmp_path: Path) -> None:
    _reads_only_what_it_returns(str(tmp_path / "store"))


def test_thalia_reads_a_few_rows_of_one_tensor_from_s3(s3_url: str) -> None:
    _reads_only_what_it_returns(s3_url)


def test_lazy_reader_lists_the_tensors_of_an_ingested_safetensors_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    repo = cas.open(tmp_path / "store", config=StoreConfig(chunk_size=CHUNK, inline_max=256))
    weights = {"embed": torch.randn(64, 64), "head": torch.randn(64, 8)}
    save_file(weights, tmp_path / "model.safetensors")
    repo.put_path(tmp_path / "model.safetensors", "files/m")
    with repo.open("files/m") as ckpt:
        assert set(ckpt) == {"model.safetensors.embed", "model.safetensors.head"}
        assert torch.equal(ckpt.get_slice("model.safetensors.embed")[3:5], weights["embed"][3:5])
