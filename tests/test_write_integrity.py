"""Hash what you write (invariant 9), and faults anywhere: what a user sees when input changes
under ``cas put``, when a buffer changes while its chunk is written, when the disk fills up or
fails, and when a ``cas://`` write raises half way."""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import fsspec
import numpy as np
import pytest

import cas
from cas.blobstore.base import Payload
from cas.blobstore.local import LocalBlobStore
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.codecs import codec_by_name
from cas.digest import Digest, digest_of
from cas.objects.chunking import Cut, cdc_cuts, windowed_cdc_cuts
from cas.objects.store import ObjectStore
from cas.repo.config import StoreConfig
from cas.testing.faulty import FaultyBlobStore

BLOCK = 64 << 10
REPO = Path(__file__).resolve().parent.parent

# -- input that changes while `cas put` reads it ------------------------------------------------

_POOL = random.Random(17).randbytes(4 << 20)


def block(offset: int, generation: int) -> bytes:
    """The 64 KiB a rewriter writes at ``offset`` in pass ``generation``: self-describing, so a
    restored file shows whether each block is one that was ever written whole."""
    start = (offset // BLOCK * 7919 + generation * 104729) % (len(_POOL) - BLOCK)
    return struct.pack("<QQ", offset, generation) + _POOL[start : start + BLOCK - 16]


def rewrite_forever(path: str, size: int) -> None:
    """Rewrite the file in place, block after block, pass after pass, until killed."""
    fd = os.open(path, os.O_WRONLY)
    generation = 1
    print("rewriting", flush=True)
    while True:
        for offset in range(0, size, BLOCK):
            os.pwrite(fd, block(offset, generation), offset)
        generation += 1


def array(repo: cas.Repository, ref: str, key: str) -> np.ndarray[Any, Any]:
    """One array of a saved state."""
    return np.asarray(cast(dict[str, Any], repo.load(ref))[key])


def cas_cli(store: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``cas --store STORE -q ARGS`` in a subprocess, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    return subprocess.run(
        [sys.executable, "-m", "cas", "--store", str(store), "-q", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def assert_refused_in_one_line(put: subprocess.CompletedProcess[str], *words: str) -> None:
    """A refusal: non-zero exit (not a signal), one line on stderr, no traceback."""
    assert put.returncode > 0, f"killed by signal {-put.returncode}: {put.stderr[-400:]}"
    assert "Traceback" not in put.stderr, put.stderr
    assert len(put.stderr.strip().splitlines()) == 1, put.stderr
    for word in words:
        assert word in put.stderr, put.stderr


def assert_committed_whole(store: Path, tmp: Path, size: int) -> bytes:
    """What a successful put stored: it verifies in full and comes back as whole blocks."""
    verify = cas_cli(store, "verify", "--full")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    out = tmp / "restored.bin"
    got = cas_cli(store, "get", "r/x", str(out))
    assert got.returncode == 0, got.stderr
    data = out.read_bytes()
    assert len(data) == size
    for offset in range(0, size, BLOCK):
        _, generation = struct.unpack_from("<QQ", data, offset)
        assert data[offset : offset + BLOCK] == block(offset, generation), offset
    return data


def test_a_file_rewritten_during_put_is_refused_or_stored_whole(tmp_path: Path) -> None:
    size = 80 << 20
    path = tmp_path / "data.bin"
    path.write_bytes(b"".join(block(offset, 0) for offset in range(0, size, BLOCK)))
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from tests.test_write_integrity import rewrite_forever; "
            "rewrite_forever(sys.argv[1], int(sys.argv[2]))",
            str(path),
            str(size),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "rewriting\n"
        put = cas_cli(tmp_path / "store", "put", str(path), "r/x")
        assert writer.poll() is None  # it was still rewriting when put ended
    finally:
        writer.kill()
        writer.wait()
    if put.returncode == 0:
        assert_committed_whole(tmp_path / "store", tmp_path, size)
    else:
        assert_refused_in_one_line(put, "changed while it was being read")
        assert cas_cli(tmp_path / "store", "ls").stdout.strip() == ""


def test_a_file_truncated_during_put_is_refused_not_killed_by_sigbus(tmp_path: Path) -> None:
    size = 64 << 20
    path = tmp_path / "data.bin"
    original = b"".join(block(offset, 0) for offset in range(0, size, BLOCK))
    path.write_bytes(original)
    store = tmp_path / "store"
    truncated = threading.Event()

    def truncate_once_put_writes() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            chunks = store / "chunks"
            if chunks.is_dir() and any(d.is_dir() and any(d.iterdir()) for d in chunks.iterdir()):
                os.truncate(path, 4096)
                truncated.set()
                return
            time.sleep(0.001)

    watcher = threading.Thread(target=truncate_once_put_writes)
    watcher.start()
    put = cas_cli(store, "put", str(path), "r/x")
    watcher.join()
    assert truncated.is_set()
    if put.returncode == 0:  # it had read everything before the file shrank
        assert assert_committed_whole(store, tmp_path, size) == original
    else:
        assert_refused_in_one_line(put, "changed while it was being read")


def test_gaps_read_a_window_at_a_time_are_cut_as_the_whole_file_is() -> None:
    data = random.Random(3).randbytes(3 << 20) + bytes(1 << 20) + random.Random(4).randbytes(999)
    avg = 64 << 10
    for start, end in [(0, len(data)), (12345, len(data) - 777), (5, 6000)]:
        whole = cdc_cuts(memoryview(data)[start:end], avg, start=start)
        for window in (avg, 3 * avg + 17, 1 << 20, len(data)):
            seen: list[int] = []

            def emit(buf: bytes, at: int, cuts: list[Cut], seen: list[int] = seen) -> None:
                for cut in cuts:
                    assert (
                        buf[cut.offset - at : cut.offset - at + cut.size]
                        == (data[cut.offset : cut.offset + cut.size])
                    )
                    seen.append(cut.offset)

            def read(offset: int, size: int) -> bytes:
                return data[offset : offset + size]

            cuts = windowed_cdc_cuts(read, start, end, avg, window, emit)
            assert cuts == whole, (start, end, window)
            assert seen == [c.offset for c in whole]


# -- a buffer that changes while its chunk is written ----------------------------------------


class ChangesSourceOnWrite(BlobStoreWrapper):
    """Overwrites the caller's buffer just as a chunk is written, as a concurrent writer to a
    mapped file or a training step on a live tensor would."""

    def __init__(self, inner: LocalBlobStore, source: np.ndarray) -> None:
        super().__init__(inner)
        self.source = source
        self.struck = 0

    def put_if_absent(self, key: str, data: Payload) -> bool:
        if key.startswith("chunks/"):
            self.source[:] += 1
            self.struck += 1
        return self.inner.put_if_absent(key, data)


def test_a_buffer_changed_while_its_chunk_is_written_is_stored_as_it_was_hashed(
    tmp_path: Path,
) -> None:
    source = np.frombuffer(bytearray(random.Random(5).randbytes(1 << 20)), dtype=np.uint8)
    first = source.tobytes()
    blobs = ChangesSourceOnWrite(LocalBlobStore(tmp_path / "store"), source)
    objects = ObjectStore(blobs)
    result = objects.put_chunk(source.data, codec_by_name("raw"))
    assert blobs.struck == 1 and source.tobytes() != first
    assert result.digest == digest_of(first)
    assert bytes(objects.get_chunk(result.digest)) == first


def test_a_tensor_changed_during_save_is_stored_as_it_was_read(tmp_path: Path) -> None:
    weights = np.arange(1 << 18, dtype=np.float32)
    saved = weights.copy()
    base = cas.open(tmp_path / "store", config=StoreConfig(chunk_size=64 << 10, inline_max=256))
    blobs = ChangesSourceOnWrite(LocalBlobStore(tmp_path / "store"), weights.view(np.uint8))
    # One chunk worker, so the chunks are read and written in turn and each write's change to
    # the array falls between two readings.
    repo = cas.Repository(blobs, base.config, workers=1)
    repo.save({"w": weights}, "runs/a")
    assert blobs.struck == 16
    loaded = array(cas.open(tmp_path / "store"), "runs/a", "w").view(np.uint8)
    # Each chunk holds one reading of the tensor, the one its digest names: chunk i was read
    # after the i writes before it had each added 1 to every byte of the array.
    chunk = 64 << 10
    for i in range(16):
        expected = saved.view(np.uint8)[i * chunk : (i + 1) * chunk] + np.uint8(i)
        assert np.array_equal(loaded[i * chunk : (i + 1) * chunk], expected), f"chunk {i}"
    assert cas_cli(tmp_path / "store", "verify", "--full").returncode == 0


# -- a full disk ------------------------------------------------------------------------------


def fill(disk: Path, leave: int) -> Path:
    """A ballast file taking all but ``leave`` bytes of the disk."""
    ballast = disk / "ballast"
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with ballast.open("wb") as f:
        f.write(bytes(max(0, free - leave)))
    return ballast


def assert_no_partial_objects(store: Path) -> None:
    """No temp file left, and every object under a final name is whole and verifies."""
    leftovers = [p for p in (store / "tmp").rglob("*") if p.is_file() and p.suffix == ".tmp"]
    assert leftovers == []
    objects = ObjectStore(LocalBlobStore(store))
    for key in LocalBlobStore(store).list("chunks/"):
        objects.get_chunk(Digest(key.rsplit("/", 1)[1]))


def test_put_on_a_full_disk_fails_in_one_line_and_the_store_works_once_space_is_freed(
    small_disk: Path, tmp_path: Path
) -> None:
    store = small_disk / "store"
    assert cas_cli(store, "init").returncode == 0
    data = random.Random(6).randbytes(4 << 20)
    (tmp_path / "weights.bin").write_bytes(data)
    ballast = fill(small_disk, leave=1 << 20)
    put = cas_cli(store, "put", str(tmp_path / "weights.bin"), "r/x")
    assert_refused_in_one_line(put, "No space left on device")
    assert_no_partial_objects(store)
    assert cas_cli(store, "ls").stdout.strip() == ""
    ballast.unlink()
    assert cas_cli(store, "put", str(tmp_path / "weights.bin"), "r/x").returncode == 0
    assert cas_cli(store, "get", "r/x", str(tmp_path / "back.bin")).returncode == 0
    assert (tmp_path / "back.bin").read_bytes() == data
    assert cas_cli(store, "verify", "--full").returncode == 0


def test_get_onto_a_full_disk_fails_in_one_line_and_leaves_no_file(
    small_disk: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    data = random.Random(8).randbytes(6 << 20)
    (tmp_path / "weights.bin").write_bytes(data)
    assert cas_cli(store, "put", str(tmp_path / "weights.bin"), "r/x").returncode == 0
    ballast = fill(small_disk, leave=1 << 20)
    get = cas_cli(store, "get", "r/x", str(small_disk / "weights.bin"), "--sha256")
    assert_refused_in_one_line(get, "No space left on device")
    assert sorted(p.name for p in small_disk.iterdir()) == ["ballast"]
    ballast.unlink()
    assert cas_cli(store, "get", "r/x", str(small_disk / "weights.bin")).returncode == 0
    assert (small_disk / "weights.bin").read_bytes() == data


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_exporting_a_saved_state_onto_a_full_disk_fails_in_one_line_and_leaves_no_file(
    small_disk: Path, tmp_path: Path, fmt: str
) -> None:
    store = tmp_path / "store"
    import torch

    state = {"w": torch.from_numpy(np.random.default_rng(9).standard_normal(1 << 20, np.float32))}
    cas.open(store).save(state, "runs/a")
    ballast = fill(small_disk, leave=1 << 20)
    target = small_disk / f"weights.{fmt}"
    get = cas_cli(store, "get", "runs/a", str(target), "--format", fmt)
    assert_refused_in_one_line(get, "No space left on device")
    assert sorted(p.name for p in small_disk.iterdir()) == ["ballast"]
    ballast.unlink()
    assert cas_cli(store, "get", "runs/a", str(target), "--format", fmt).returncode == 0
    if fmt == "pt":
        back = torch.load(target, weights_only=True)["w"]
    else:
        from safetensors.torch import load_file

        back = load_file(target)["w"]
    assert torch.equal(back, state["w"])


def test_save_on_a_full_disk_raises_one_line_and_commits_nothing(small_disk: Path) -> None:
    store = small_disk / "store"
    repo = cas.open(store, config=StoreConfig(chunk_size=256 << 10))
    state = {"w": np.random.default_rng(7).standard_normal(1 << 20).astype(np.float32)}
    ballast = fill(small_disk, leave=1 << 20)
    with pytest.raises(cas.BackendError) as failure:
        repo.save(state, "runs/a")
    assert "No space left on device" in str(failure.value)
    assert len(str(failure.value).splitlines()) == 1
    assert repo.ref_names() == []
    assert_no_partial_objects(store)
    ballast.unlink()
    repo.save(state, "runs/a")
    assert np.array_equal(array(cas.open(store), "runs/a", "w"), state["w"])


# -- a failing disk (EIO) at every point of save and load ------------------------------------


def eio(what: str) -> Exception:
    return cas.BackendError(f"{what}: [Errno 5] Input/output error")


def test_an_io_error_at_any_point_of_a_save_leaves_no_half_checkpoint(tmp_path: Path) -> None:
    config = StoreConfig(chunk_size=64 << 10, inline_max=256)
    state: dict[str, np.ndarray[Any, Any]] = {
        "a": np.arange(50_000, dtype=np.float32),
        "b": np.ones(40_000, dtype=np.int64),
    }

    def faulty_store(root: Path) -> FaultyBlobStore:
        cas.open(root, config=config).close()
        return FaultyBlobStore(LocalBlobStore(root), error=eio)

    # One chunk worker: the calls come in one order, so every point is struck. With eight, how
    # many workers probe for a reuse before the first miss varies with scheduling, and a busy
    # machine moved the count by more than the slack below.
    counted = faulty_store(tmp_path / "count")
    cas.Repository(counted, config, workers=1).save(state, "runs/a")
    calls = sum(counted.calls.values())
    assert calls > 20
    struck = 0
    for point in range(calls):
        root = tmp_path / f"s{point}"
        faulty = faulty_store(root)
        faulty.fail_call(point)
        try:
            cas.Repository(faulty, config, workers=1).save(state, "runs/a")
        except cas.BackendError as e:
            assert "Input/output error" in str(e) and len(str(e).splitlines()) == 1
        struck += faulty.faults.total()
        reopened = cas.open(root)
        if reopened.ref_names():  # the fault came after the commit point: the checkpoint is whole
            assert np.array_equal(array(reopened, "runs/a", "b"), state["b"])
        assert_no_partial_objects(root)
        reopened.save(state, "runs/a")  # and the store goes on working
        assert np.array_equal(array(reopened, "runs/a", "a"), state["a"])
    assert struck >= calls - 2  # a lease renewal may add or move a call


def test_an_io_error_at_any_point_of_a_load_raises_and_never_returns_bad_bytes(
    tmp_path: Path,
) -> None:
    config = StoreConfig(chunk_size=64 << 10, inline_max=256)
    state = {"a": np.arange(50_000, dtype=np.float32)}
    cas.open(tmp_path / "store", config=config).save(state, "runs/a")
    faulty = FaultyBlobStore(LocalBlobStore(tmp_path / "store"), error=eio)
    repo = cas.Repository(faulty, config)
    repo.load("runs/a")
    calls = sum(faulty.calls.values())
    for point in range(calls):
        faulty.fail_call(point)
        try:
            loaded = repo.load("runs/a")
        except cas.BackendError as e:
            assert len(str(e).splitlines()) == 1
        else:
            assert np.array_equal(np.asarray(cast(Any, loaded)["a"]), state["a"])


# -- a cas:// write that raises ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["wb", "w"])
def test_a_cas_url_write_whose_with_block_raises_leaves_no_file_or_ref(
    tmp_path: Path, mode: str
) -> None:
    store = str(tmp_path / "store")
    opened = fsspec.open("cas://runs/r1/step-10/model.pt", mode, store=store)
    with pytest.raises(RuntimeError, match="crashed mid-save"), opened as f:
        f.write(b"partial" if "b" in mode else "partial")
        raise RuntimeError("crashed mid-save")
    assert cas.open(store).ref_names() == []
    fs = fsspec.filesystem("cas", store=store)
    assert not fs.exists("runs/r1/step-10/model.pt")


def test_a_cas_file_opened_while_handling_an_error_is_still_published(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    try:
        raise ValueError("the run failed")
    except ValueError:
        with fsspec.open("cas://runs/r1/crash/report.txt", "w", store=store) as f:
            f.write("what went wrong")
    fs = fsspec.filesystem("cas", store=store)
    assert fs.cat_file("runs/r1/crash/report.txt") == b"what went wrong"
