"""The store as a filesystem: reading, writing and existing tools (DCP, Lightning) through cas://."""

from __future__ import annotations

import io
import os
import threading
import zipfile
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from safetensors.torch import save_file

import cas
from cas.digest import Digest
from cas.errors import IntegrityError
from cas.fs.filesystem import CASFileSystem
from cas.fs.torch_view import torch_view
from cas.model.manifest import ChunkRef, TensorEntry
from cas.objects.store import chunk_key
from tests.helpers import assert_bit_exact, chunk_files, local_root, small_chunk_repo, trained_state
from tests.prerequisites import require_module

CHUNK = 64 << 10


@pytest.fixture
def repo(tmp_path: Path) -> Iterator[cas.Repository]:
    store = small_chunk_repo(tmp_path / "store", chunk_size=CHUNK)
    yield store
    store.close()


@pytest.fixture
def fs(repo: cas.Repository) -> CASFileSystem:
    return CASFileSystem(repo=repo, skip_instance_cache=True)


class ChunkReads:
    """Counts the chunks the object store is asked for, by digest."""

    def __init__(self, repo: cas.Repository, monkeypatch: pytest.MonkeyPatch) -> None:
        self.digests: Counter[str] = Counter()
        objects = repo.objects
        get_chunk, read_parts = objects.get_chunk, objects.read_chunk_parts

        def counted_get(digest: Digest) -> bytes | memoryview:
            self.digests[digest] += 1
            return get_chunk(digest)

        def counted_read_parts(
            digest: Digest, outs: Sequence[memoryview], *, encoded: bool = False
        ) -> None:
            self.digests[digest] += 1
            read_parts(digest, outs, encoded=encoded)

        # read_chunk_into goes through read_chunk_parts, so every chunk read is counted once.
        monkeypatch.setattr(objects, "get_chunk", counted_get)
        monkeypatch.setattr(objects, "read_chunk_parts", counted_read_parts)

    def reset(self) -> None:
        self.digests.clear()


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {
        "embed.weight": torch.randn(256, 256),
        "head.weight": torch.randn(64, 256).to(torch.bfloat16),
        "head.bias": torch.zeros(64),
        "step": torch.tensor(7),
    }


def test_ingested_files_read_back_byte_identical_through_cas_urls(
    repo: cas.Repository, tmp_path: Path
) -> None:
    ckpt = tmp_path / "checkpoint-500"
    ckpt.mkdir()
    save_file(weights(), ckpt / "model.safetensors")
    torch.save({"optimizer": weights(1)}, ckpt / "optimizer.pt")
    (ckpt / "trainer_state.json").write_text('{"global_step": 500}\n')
    (ckpt / "blob.bin").write_bytes(os.urandom(300_000))
    repo.put_path(ckpt, "runs/r1/checkpoint-500")

    for name in ("model.safetensors", "optimizer.pt", "trainer_state.json", "blob.bin"):
        original = (ckpt / name).read_bytes()
        with fsspec.open(f"cas://runs/r1/checkpoint-500/{name}", "rb", repo=repo) as f:
            assert f.read() == original, name
        fs = fsspec.filesystem("cas", repo=repo)
        assert fs.size(f"runs/r1/checkpoint-500/{name}") == len(original)
        for start in (0, 1, len(original) // 3, max(0, len(original) - 5)):
            end = min(len(original), start + 70_000)
            assert (
                fs.cat_file(f"cas://runs/r1/checkpoint-500/{name}", start, end)
                == original[start:end]
            )


def test_a_random_4k_read_touches_one_chunk(
    repo: cas.Repository, fs: CASFileSystem, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "big.safetensors"
    save_file({"w": torch.randn(1024, 1024)}, path)  # 4 MiB of tensor: 64 chunks of 64 KiB
    repo.put_path(path, "models/big")
    original = path.read_bytes()
    reads = ChunkReads(repo, monkeypatch)
    header = 8 + int.from_bytes(original[:8], "little")
    for k in (3, 17, 40):
        start = header + k * CHUNK + 1000  # well inside the k-th chunk of the tensor
        reads.reset()
        with fs.open("models/big/big.safetensors") as f:
            f.seek(start)
            assert f.read(4096) == original[start : start + 4096]
        assert sum(reads.digests.values()) == 1
    reads.reset()
    again = fs.cat_file("models/big/big.safetensors", start + 4096, start + 8192)
    assert again == original[start + 4096 : start + 8192]
    assert sum(reads.digests.values()) == 0  # served from the LRU of decoded chunks


def test_a_corrupted_chunk_is_an_io_error_never_wrong_bytes(
    repo: cas.Repository, fs: CASFileSystem, tmp_path: Path
) -> None:
    data = os.urandom(6 << 20)  # opaque bytes: FastCDC cuts ~1 MiB chunks
    fs.pipe("data/blobs/random.bin", data)
    entry = repo.manifest("data/blobs").files["random.bin"]
    assert len(entry.chunks) > 1
    victim = local_root(repo) / chunk_key(entry.chunks[0].digest)
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))

    fresh = CASFileSystem(repo=repo, skip_instance_cache=True)
    with pytest.raises(OSError) as excinfo:
        fresh.cat_file("data/blobs/random.bin")
    assert isinstance(excinfo.value, IntegrityError)
    with fresh.open("data/blobs/random.bin") as f, pytest.raises(OSError):
        f.read(10)
    tail = entry.chunks[0].size
    assert fresh.cat_file("data/blobs/random.bin", tail, tail + 100) == data[tail : tail + 100]


def test_a_saved_state_shows_one_safetensors_file_per_top_level_entry(
    repo: cas.Repository, fs: CASFileSystem, tmp_path: Path
) -> None:
    state = trained_state()
    repo.save(state, "runs/r2/ckpt_step00000003", {"loss": 0.5})
    names = fs.ls("runs/r2/ckpt_step00000003", detail=False)
    assert [n.rsplit("/", 1)[1] for n in names] == [
        "manifest.json", "model.pt", "model.safetensors", "optimizer.pt", "optimizer.safetensors",
        "rng_state.pt", "rng_state.safetensors", "scheduler.pt", "step.pt",
    ]  # fmt: skip
    model_url = "runs/r2/ckpt_step00000003/model.safetensors"
    first = fs.cat_file(model_url)
    assert CASFileSystem(repo=repo, skip_instance_cache=True).cat_file(model_url) == first

    fs.get(model_url, str(tmp_path / "model.safetensors"))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(state["model"])
        for key, tensor in state["model"].items():
            assert torch.equal(f.get_tensor(key), tensor)
    optimizer = load_safetensors(fs.cat_file("runs/r2/ckpt_step00000003/optimizer.safetensors"))
    assert torch.equal(optimizer["state.0.exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    manifest = fs.read_text("runs/r2/ckpt_step00000003/manifest.json")
    assert '"optimizer.param_groups.0.lr": 0.001' in manifest and '"loss": 0.5' in manifest


def test_a_saved_state_shows_one_torch_file_per_top_level_entry(
    repo: cas.Repository, fs: CASFileSystem
) -> None:
    state = trained_state()
    state["tied"] = {
        "a": state["model"]["0.weight"],
        "b": state["model"]["0.weight"],
        "dtype": torch.bfloat16,
    }
    repo.save(state, "runs/r3/ckpt")
    loaded = repo.load("runs/r3/ckpt")
    for key in state:
        with fs.open(f"runs/r3/ckpt/{key}.pt") as f:
            assert_bit_exact(torch.load(f, weights_only=True), loaded[key], key)
    tied = torch.load(io.BytesIO(fs.cat_file("runs/r3/ckpt/tied.pt")), weights_only=True)
    assert tied["a"] is tied["b"]
    again = CASFileSystem(repo=repo, skip_instance_cache=True).cat_file("runs/r3/ckpt/optimizer.pt")
    assert again == fs.cat_file("runs/r3/ckpt/optimizer.pt")


def test_every_dtype_reads_back_through_both_synthesized_views(
    repo: cas.Repository, fs: CASFileSystem
) -> None:
    torch.manual_seed(1)
    base = torch.randn(300, 70)
    model = {
        str(dtype).removeprefix("torch."): base.to(dtype)
        for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                      torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn,
                      torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64)
    }  # fmt: skip
    model |= {"empty": torch.empty(0, 5), "scalar": torch.tensor(2.5), "transposed": base.t()}
    repo.save(
        {"model": model, "arrays": {"a": np.arange(6, dtype=np.float32).reshape(2, 3)}},
        "dtypes/all",
    )
    from_safetensors = load_safetensors(fs.cat_file("dtypes/all/model.safetensors"))
    with fs.open("dtypes/all/model.pt") as f:
        from_torch = torch.load(f, weights_only=True)
    for key, tensor in model.items():
        assert_bit_exact(from_safetensors[key], tensor.contiguous(), key)
        assert_bit_exact(from_torch[key], tensor.contiguous(), key)
    arrays = load_safetensors(fs.cat_file("dtypes/all/arrays.safetensors"))
    assert torch.equal(arrays["a"], torch.arange(6.0).reshape(2, 3))
    assert not fs.exists("dtypes/all/arrays.pt")  # weights-only torch.load refuses numpy


def test_a_torch_view_of_tensors_over_4_gib_uses_zip64_headers() -> None:
    huge = 5 << 30
    chunks = tuple(ChunkRef(Digest(f"{i:064x}"), 1 << 30) for i in range(5))
    tensors = (
        TensorEntry("torch", "uint8", (huge,), huge, chunks),
        TensorEntry("torch", "float32", (2,), 8, (), bytes(8)),
    )
    tree = {
        "~": "dict",
        "items": [["big", {"~": "tensor", "i": 0}], ["small", {"~": "tensor", "i": 1}]],
    }
    view = torch_view(tree, tensors, Digest("ab" * 32))
    assert view is not None and view.size > huge

    class HeadersOnly(io.RawIOBase):
        """Serves the literal (header) bytes of the view; touching tensor data fails the test."""

        position = 0

        def readable(self) -> bool:
            return True

        def seekable(self) -> bool:
            return True

        def seek(self, offset: int, whence: int = 0) -> int:
            assert view is not None
            self.position = {0: 0, 1: self.position, 2: view.size}[whence] + offset
            return self.position

        def tell(self) -> int:
            return self.position

        def readinto(self, buffer: Any) -> int:
            assert view is not None
            out = memoryview(buffer).cast("B")
            end = min(view.size, self.position + len(out))
            for extent in view.touched(self.position, end):
                assert extent.data is not None, "read tensor bytes while parsing zip headers"
                lo, hi = max(self.position, extent.offset), min(end, extent.offset + extent.size)
                out[lo - self.position : hi - self.position] = extent.data[
                    lo - extent.offset : hi - extent.offset
                ]
            count = end - self.position
            self.position = end
            return count

    members = {i.filename: i for i in zipfile.ZipFile(HeadersOnly()).infolist()}
    assert members["archive/data/0"].file_size == huge
    assert (
        members["archive/data/1"].header_offset > huge and members["archive/data/1"].file_size == 8
    )


def test_a_synthesized_file_reads_only_the_chunks_of_the_range(
    repo: cas.Repository, fs: CASFileSystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {"model": {"a": torch.randn(128, 1024), "b": torch.randn(128, 1024)}}
    repo.save(state, "runs/lazy")
    reads = ChunkReads(repo, monkeypatch)
    url = "runs/lazy/model.safetensors"
    size = fs.size(url)
    assert size == fs.info(url)["size"] and sum(reads.digests.values()) == 0
    head = fs.cat_file(url, 0, 8)
    header_len = int.from_bytes(head, "little")
    fs.cat_file(url, 0, 8 + header_len)
    assert sum(reads.digests.values()) == 0  # the header comes from the manifest
    tail = fs.cat_file(url, size - 4096, size)
    assert tail == state["model"]["b"].reshape(-1).view(torch.uint8)[-4096:].numpy().tobytes()
    assert sum(reads.digests.values()) == 1


def test_a_file_written_through_cas_shares_chunks_with_save_and_put(
    repo: cas.Repository, fs: CASFileSystem, tmp_path: Path
) -> None:
    tensors = weights()
    with fs.open("models/m1/model.safetensors", "wb") as f:
        for i in range(0, len(blob := save_safetensors(tensors)), 10_000):
            f.write(blob[i : i + 10_000])  # small writes: cut as they stream in
    written = repo.manifest("models/m1").files["model.safetensors"]
    (tmp_path / "model.safetensors").write_bytes(blob)
    repo.put_path(tmp_path / "model.safetensors", "models/m1-put")
    assert repo.manifest("models/m1-put").files["model.safetensors"].chunks == written.chunks
    assert written.format == "safetensors" and {r.name for r in written.regions} == {
        "embed.weight",
        "head.weight",
        "head.bias",  # small tensors are listed too, inline (their bytes stay in the gap)
        "step",
    }
    repo.save({"embed": tensors["embed.weight"]}, "models/m1-state")
    embed = repo.manifest("models/m1-state").tensors[0].chunks
    assert set(embed) <= set(written.chunks)
    assert repo.load("models/m1")["model.safetensors"]["embed.weight"].equal(
        tensors["embed.weight"]
    )

    before = chunk_files(repo)
    torch.save(tensors, tmp_path / "model.pt")
    fs.put(str(tmp_path / "model.pt"), "models/m2/model.pt")
    assert fs.cat_file("models/m2/model.pt") == (tmp_path / "model.pt").read_bytes()
    new = chunk_files(repo) - before
    embed_keys = {chunk_key(c.digest) for c in embed}
    assert not embed_keys & new  # the torch.save'd tensor reused the chunks save() wrote
    repo.put_path(tmp_path / "model.pt", "models/m2-put")
    ingested = repo.manifest("models/m2-put").files["model.pt"]
    assert ingested.chunks == repo.manifest("models/m2").files["model.pt"].chunks


def test_sequential_reads_of_any_size_return_the_file_and_fail_on_a_bad_chunk(
    repo: cas.Repository, fs: CASFileSystem, tmp_path: Path
) -> None:
    data = os.urandom(5 << 20)
    fs.pipe("seq/f/data.bin", data)
    for size in (4095, 100_003, 3 << 20):
        with CASFileSystem(repo=repo, skip_instance_cache=True).open("seq/f/data.bin") as f:
            buffer = bytearray(size)
            parts = []
            while n := f.readinto(buffer):
                parts.append(bytes(buffer[:n]))
            assert b"".join(parts) == data, size
    with fs.open("seq/f/data.bin") as f:
        assert b"".join(iter(lambda: f.read(77_777), b"")) == data
    entry = repo.manifest("seq/f").files["data.bin"]
    victim = local_root(repo) / chunk_key(entry.chunks[-1].digest)
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    with (
        CASFileSystem(repo=repo, skip_instance_cache=True).open("seq/f/data.bin") as f,
        pytest.raises(OSError),
    ):
        while f.read(1 << 20):
            pass
    # Reads that end inside chunks take the chunk's head into the caller's buffer and its tail
    # into the cache; the bad chunk still fails the read rather than reaching either.
    with (
        CASFileSystem(repo=repo, skip_instance_cache=True).open("seq/f/data.bin") as f,
        pytest.raises(OSError),
    ):
        buffer = bytearray(100_003)
        while f.readinto(buffer):
            pass


def test_a_bare_cas_url_follows_cas_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAS_STORE", str(tmp_path / "one"))
    fsspec.filesystem("cas").pipe("runs/a/x.bin", b"1")
    monkeypatch.setenv("CAS_STORE", str(tmp_path / "two"))
    second = fsspec.filesystem("cas")
    assert not second.exists("runs/a/x.bin")
    assert second.repo.url == (tmp_path / "two").absolute().as_uri()


def test_paths_map_to_refs_and_files(repo: cas.Repository, fs: CASFileSystem) -> None:
    fs.pipe("exp/a/b/c.txt", b"1")
    assert [r.name for r in repo.refs("exp")] == ["exp/a/b"]
    fs.pipe("exp/a/b/sub/d.txt", b"2")  # below an existing ref: a file in that checkpoint
    assert set(repo.manifest("exp/a/b").files) == {"c.txt", "sub/d.txt"}
    fs.mkdir("exp/empty")
    assert fs.isdir("exp/empty") and fs.ls("exp/empty") == []
    assert fs.ls("exp", detail=False) == ["exp/a", "exp/empty"]
    fs.rmdir("exp/empty")
    assert not fs.exists("exp/empty") and [r.name for r in repo.refs("exp")] == ["exp/a/b"]
    with pytest.raises(PermissionError):
        fs.pipe("toplevel.bin", b"x")
    repo.save({"w": torch.ones(3)}, "exp/state")
    with pytest.raises(PermissionError):
        fs.pipe("exp/state/extra.bin", b"x")
    fs.rm("exp", recursive=True)
    assert repo.refs("exp") == [] and not fs.exists("exp")


def test_tensor_names_that_collide_in_a_synthesized_file_are_listed_not_shown_twice(
    repo: cas.Repository, fs: CASFileSystem
) -> None:
    import json

    one, two, three = torch.ones(4), torch.full((4,), 2.0), torch.full((4,), 3.0)
    repo.save({"model": {"a.b": one, "a": {"b": two}, "__metadata__": three}}, "st/names")
    shown = load_safetensors(fs.cat_file("st/names/model.safetensors"))
    assert list(shown) == ["a.b"] and torch.equal(shown["a.b"], one)
    document = json.loads(fs.cat_file("st/names/manifest.json"))
    assert sorted(document["not_in_safetensors"]) == ["model.__metadata__", "model.a.b"]
    repo.save({1: {"w": one}, "1": {"w": two}}, "st/keys")
    fs.invalidate_cache()
    assert fs.ls("st/keys", detail=False) == [
        "st/keys/1.pt", "st/keys/1.safetensors", "st/keys/manifest.json"
    ]  # fmt: skip
    document = json.loads(fs.cat_file("st/keys/manifest.json"))
    assert len(document["not_in_safetensors"]) == 1


def test_a_write_that_fails_half_way_never_becomes_visible(
    repo: cas.Repository, fs: CASFileSystem
) -> None:
    fs.pipe("ckpts/c3/keep.bin", b"old")
    with pytest.raises(RuntimeError), fs.open("ckpts/c3/keep.bin", "wb") as f:
        f.write(b"new, half written")
        raise RuntimeError("training crashed")
    assert fs.cat_file("ckpts/c3/keep.bin") == b"old"
    assert list(repo.blobs.list("leases/")) == []  # the writer's lease was released


def test_a_text_mode_write_that_fails_is_discarded_too(fs: CASFileSystem) -> None:
    fs.pipe("ckpts/t1/notes.txt", b"old")
    with pytest.raises(RuntimeError), fs.open("ckpts/t1/notes.txt", "w") as f:
        f.write("new, half written")
        raise RuntimeError("training crashed")
    assert fs.cat_file("ckpts/t1/notes.txt") == b"old"
    with fs.open("ckpts/t1/notes.txt", "w", encoding="utf-8") as f:
        f.write("fresh ✓")
    assert fs.cat_file("ckpts/t1/notes.txt") == "fresh ✓".encode()


def test_a_failed_write_inside_a_transaction_leaves_the_others_to_commit(fs: CASFileSystem) -> None:
    with fs.transaction:
        fs.pipe("ckpts/tx/good.bin", b"good")
        with pytest.raises(RuntimeError), fs.open("ckpts/tx/bad.bin", "wb") as f:
            f.write(b"partial")
            raise RuntimeError("one writer failed")
    assert fs.ls("ckpts/tx", detail=False) == ["ckpts/tx/good.bin"]


@pytest.mark.parametrize("name", ["a//b", "./a", "a/../b", "a/..", "a\\b", "tab\there"])
def test_a_file_path_a_manifest_cannot_hold_is_refused_and_the_checkpoint_stays_readable(
    fs: CASFileSystem, name: str
) -> None:
    fs.pipe("ckpts/p1/good.bin", b"good")
    with pytest.raises(OSError, match="not a valid file path"):
        fs.pipe(f"ckpts/p1/{name}", b"x")
    assert fs.ls("ckpts/p1", detail=False) == ["ckpts/p1/good.bin"]


def test_a_file_cannot_replace_a_directory_or_sit_below_a_file(fs: CASFileSystem) -> None:
    fs.pipe("ckpts/d1/sub/x", b"inner")
    fs.pipe("ckpts/d1/file", b"outer")
    fs.pipe("runs/r1/x/f", b"ref below a prefix directory")
    with pytest.raises(IsADirectoryError):
        fs.pipe("ckpts/d1/sub", b"clobber")
    with pytest.raises(NotADirectoryError):
        fs.pipe("ckpts/d1/file/y", b"below a file")
    with pytest.raises(IsADirectoryError):
        fs.pipe("runs/r1", b"over a prefix of ref names")
    assert fs.find("ckpts/d1") == ["ckpts/d1/file", "ckpts/d1/sub/x"]
    assert fs.find("runs") == ["runs/r1/x/f"]


def test_makedirs_inside_a_checkpoint_creates_every_level(fs: CASFileSystem) -> None:
    fs.mkdir("ckpts/m1")
    fs.makedirs("ckpts/m1/sub/deeper", exist_ok=True)
    assert fs.isdir("ckpts/m1/sub") and fs.isdir("ckpts/m1/sub/deeper")
    assert fs.ls("ckpts/m1", detail=False) == ["ckpts/m1/sub"]
    fs.pipe("ckpts/m1/file", b"x")
    with pytest.raises(NotADirectoryError):
        fs.makedirs("ckpts/m1/file/below")
    with pytest.raises(FileNotFoundError):
        fs.mkdir("ckpts/m1/none/leaf", create_parents=False)


def test_moving_a_file_of_a_saved_state_is_refused_before_anything_is_copied(
    repo: cas.Repository, fs: CASFileSystem
) -> None:
    repo.save({"model": {"w": torch.ones(4)}}, "st/s1")
    with pytest.raises(PermissionError):
        fs.mv("st/s1/model.safetensors", "dst/d1/model.safetensors")
    assert not fs.exists("dst/d1")
    assert fs.exists("st/s1/model.safetensors")


def test_rename_within_a_checkpoint_is_one_ref_update_and_copies_write_no_chunk(
    repo: cas.Repository, fs: CASFileSystem
) -> None:
    fs.pipe("ckpts/c1/.metadata.tmp", os.urandom(1000))
    events = len(repo.log("ckpts/c1"))
    fs.mv("ckpts/c1/.metadata.tmp", "ckpts/c1/.metadata")
    assert len(repo.log("ckpts/c1")) == events + 1
    assert fs.ls("ckpts/c1", detail=False) == ["ckpts/c1/.metadata"]
    before = chunk_files(repo)
    fs.cp("ckpts/c1/.metadata", "ckpts/c2/metadata-copy")
    assert chunk_files(repo) == before
    assert fs.cat_file("ckpts/c2/metadata-copy") == fs.cat_file("ckpts/c1/.metadata")


def test_concurrent_writers_into_one_checkpoint_lose_no_file(repo: cas.Repository) -> None:
    fs = CASFileSystem(repo=repo, skip_instance_cache=True)
    fs.mkdir("ckpts/shared")
    errors: list[BaseException] = []

    def writer(rank: int) -> None:
        try:
            own = CASFileSystem(repo=repo, skip_instance_cache=True)
            for i in range(4):
                own.pipe(f"ckpts/shared/__{rank}_{i}.distcp", bytes([rank, i]) * 100)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(rank,)) for rank in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(repo.manifest("ckpts/shared").files) == 16


def test_dcp_save_then_load_through_cas_and_a_second_save_writes_no_tensor_chunk(
    repo: cas.Repository, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    monkeypatch.setenv("CAS_STORE", str(local_root(repo)))
    state = {"model": weights(), "extra": {"steps": torch.arange(10)}}
    with pytest.warns(UserWarning):  # DCP warns that it runs without a process group
        dcp_save(state, checkpoint_id="cas://dcp/step1")
    assert set(CASFileSystem().ls("dcp/step1", detail=False)) == {
        "dcp/step1/.metadata",
        "dcp/step1/__0_0.distcp",
    }

    target = {
        "model": {k: torch.zeros_like(v) for k, v in weights().items()},
        "extra": {"steps": torch.zeros(10, dtype=torch.int64)},
    }
    with pytest.warns(UserWarning):
        dcp_load(target, checkpoint_id="cas://dcp/step1")
    for key, tensor in state["model"].items():
        assert torch.equal(target["model"][key], tensor), key
    assert torch.equal(target["extra"]["steps"], state["extra"]["steps"])

    before = chunk_files(repo)
    with pytest.warns(UserWarning):
        dcp_save(state, checkpoint_id="cas://dcp/step1")
    files = repo.manifest("dcp/step1").files
    new = chunk_files(repo) - before
    # Only DCP's .metadata pickle differs (it embeds a fresh save id); tensor data reuses chunks.
    assert new <= {chunk_key(c.digest) for c in files[".metadata"].chunks}
    assert len(new) <= 1


def test_lightning_model_checkpoint_writes_into_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pl = require_module("lightning.pytorch", "pip install 'cas[lightning]'")
    monkeypatch.setenv("CAS_STORE", str(tmp_path / "store"))

    class Tiny(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            loss: torch.Tensor = self.layer(batch[0]).pow(2).mean()
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4
    )
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath="cas://lightning/run1", save_top_k=-1)
    trainer = pl.Trainer(
        max_epochs=2,
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Tiny(), data)
    fs = CASFileSystem()
    names = fs.ls("lightning/run1", detail=False)
    assert names == ["lightning/run1/epoch=0-step=2.ckpt", "lightning/run1/epoch=1-step=4.ckpt"]
    with fs.open(names[-1]) as f:
        loaded = torch.load(f, weights_only=False)
    assert torch.equal(loaded["state_dict"]["layer.weight"], trainer.model.layer.weight.detach())


def test_the_mount_reports_the_pinned_size_on_an_open_handle(
    repo: cas.Repository, fs: CASFileSystem
) -> None:
    from cas.fs.fuse import ReadOnlyCAS

    fs.pipe("ckpts/f1/data.bin", b"x" * 100)
    ops = ReadOnlyCAS(fs, "ckpts")
    handle = ops.open("/f1/data.bin", os.O_RDONLY)
    fs.pipe("ckpts/f1/data.bin", b"y" * 300)  # the ref moves while the file is open
    fs.invalidate_cache()
    assert ops.getattr("/f1/data.bin", handle)["st_size"] == 100
    assert ops.getattr("/f1/data.bin")["st_size"] == 300
    assert ops.read("/f1/data.bin", 4096, 0, handle) == b"x" * 100
    ops.release("/f1/data.bin", handle)


def test_a_listing_right_after_a_save_in_the_same_process_shows_the_new_ref(
    repo: cas.Repository, tmp_path: Path
) -> None:
    # The filesystem opened the store on its own (another Repository, as fsspec.open does) and
    # caches refs for an hour by its clock: only the process's own changes can refresh it.
    fs = CASFileSystem(
        store=repo.url, skip_instance_cache=True, clock=lambda: 0.0, ref_cache_ttl=3600.0
    )
    (tmp_path / "a.txt").write_bytes(b"first")
    repo.put_path(tmp_path / "a.txt", "runs/r1/data")
    assert fs.ls("runs", detail=False) == ["runs/r1"]
    assert fs.cat_file("runs/r1/data/a.txt") == b"first"

    repo.save({"w": torch.ones(4)}, "runs/r2/ckpt")
    assert fs.ls("runs", detail=False) == ["runs/r1", "runs/r2"]
    (tmp_path / "a.txt").write_bytes(b"second")
    repo.put_path(tmp_path / "a.txt", "runs/r1/data")
    assert fs.cat_file("runs/r1/data/a.txt") == b"second"
    repo.rm("runs/r2/ckpt")
    assert fs.ls("runs", detail=False) == ["runs/r1"]
