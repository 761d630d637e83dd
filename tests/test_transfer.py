"""Push and pull between stores: only missing chunks travel, refs move last, interruptions resume."""

from __future__ import annotations

import json
import os
import random
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import cas
from cas.blobstore import BlobStore, LocalBlobStore
from cas.blobstore.retry import RetryingBlobStore, RetryPolicy
from cas.blobstore.s3 import S3BlobStore
from cas.cli import cli
from cas.codecs import codec_by_name
from cas.digest import Digest
from cas.errors import BackendError, IntegrityError, RefConflict
from cas.objects.inventory import LIST_MIN_KEYS
from cas.objects.keys import ObjectKind
from cas.objects.store import ObjectStore, chunk_key
from cas.repo.config import StoreConfig, write_config
from cas.repo.repository import Repository
from cas.sync.transfer import TransferConflict
from cas.testing.faulty import FaultyBlobStore
from cas.testing.seaweed import SeaweedServer
from tests.helpers import assert_bit_exact, small_chunk_repo

CHUNK = 64 << 10


def layered_state(layers: int = 20, seed: int = 0, rows: int = 256) -> dict[str, Any]:
    """``layers`` float32 tensors of ``rows`` x 256 (256 KiB each at 256 rows) plus a step."""
    generator = torch.Generator().manual_seed(seed)
    model = {
        f"layer{i:02d}.weight": torch.randn(rows, 256, generator=generator) for i in range(layers)
    }
    return {"model": model, "step": seed}


def total_tensor_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def s3_repo(url: str, **options: Any) -> Repository:
    return cas.open(url, config=StoreConfig(chunk_size=CHUNK, inline_max=256), **options)


@pytest.mark.s3
def test_push_then_pull_through_s3_is_bit_exact(tmp_path: Path, s3_url: str) -> None:
    local = small_chunk_repo(tmp_path / "local")
    state = layered_state(seed=1)
    local.save(state, "runs/r1/ckpt_step00000100")
    local.save(layered_state(layers=2, seed=2), "runs/r1/ckpt_step00000200")
    local.save(layered_state(layers=2, seed=3), "runs/r2/ckpt_step00000100")
    remote = s3_repo(s3_url)

    pushed = local.push(remote, ["runs/r1/**"])

    assert [r.name for r in pushed.refs] == [
        "runs/r1/ckpt_step00000100",
        "runs/r1/ckpt_step00000200",
    ]
    assert all(r.status == "created" for r in pushed.refs)
    assert [r.name for r in remote.refs()] == [r.name for r in pushed.refs]
    elsewhere = small_chunk_repo(tmp_path / "elsewhere")
    pulled = elsewhere.pull(cas.open(s3_url), ["runs/r1/ckpt_step00000100"])
    assert pulled.bytes_moved == total_tensor_bytes(state)
    assert_bit_exact(elsewhere.load("runs/r1/ckpt_step00000100"), state)
    assert elsewhere.resolve("runs/r1/ckpt_step00000100") == local.resolve(
        "runs/r1/ckpt_step00000100"
    )


@pytest.mark.s3
def test_repushing_an_unchanged_checkpoint_moves_zero_chunk_bytes(
    tmp_path: Path, s3_url: str
) -> None:
    local = small_chunk_repo(tmp_path / "local")
    state = layered_state(seed=4)
    local.save(state, "runs/r1/latest")
    remote = s3_repo(s3_url)
    first = local.push(remote, ["runs/r1/latest"])

    again = local.push(remote, ["runs/r1/latest"])

    assert first.bytes_moved == total_tensor_bytes(state)
    assert again.bytes_moved == 0 and again.chunks_moved == 0 and again.manifests_moved == 0
    assert again.bytes_skipped == total_tensor_bytes(state)
    assert [r.status for r in again.refs] == ["unchanged"]


@pytest.mark.s3
def test_push_after_changing_a_tenth_of_the_tensors_moves_about_a_tenth(
    tmp_path: Path, s3_url: str
) -> None:
    local = small_chunk_repo(tmp_path / "local")
    state = layered_state(layers=20, seed=5)
    local.save(state, "runs/r1/latest")
    remote = s3_repo(s3_url)
    local.push(remote, ["runs/r1"])
    for name in ("layer03.weight", "layer17.weight"):
        state["model"][name] = state["model"][name] + 1.0
    local.save(state, "runs/r1/latest")
    seen = {"moved": 0, "skipped": 0}

    def progress(moved: int, skipped: int) -> None:
        seen["moved"] += moved
        seen["skipped"] += skipped

    report = local.push(remote, ["runs/r1"], progress=progress)

    share = report.bytes_moved / total_tensor_bytes(state)
    assert 0.08 <= share <= 0.12, share
    assert (seen["moved"], seen["skipped"]) == (report.bytes_moved, report.bytes_skipped)
    assert report.bytes_moved + report.bytes_skipped == total_tensor_bytes(state)
    assert [r.status for r in report.refs] == ["updated"]
    assert_bit_exact(cas.open(s3_url).load("runs/r1/latest"), state)


@pytest.mark.s3
def test_many_candidate_chunks_are_checked_by_listing_their_prefix(
    s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("cas.objects.inventory.LIST_MIN_KEYS", 16)
    blobs = S3BlobStore.from_url(s3_url)
    digests = [Digest(f"00{i:062x}") for i in range(40)]
    for digest in digests[::2]:
        blobs.put(chunk_key(digest), b"x")

    missing, method = ObjectStore(blobs).missing(ObjectKind.CHUNK, digests)

    assert LIST_MIN_KEYS > 16  # the production threshold is untouched
    assert method == "list"  # one LIST beats forty HEADs
    assert missing == set(digests[1::2])


def test_copying_a_chunk_the_destination_holds_keeps_its_encoding_and_refreshes_it(
    tmp_path: Path,
) -> None:
    src, dst = small_chunk_repo(tmp_path / "src"), small_chunk_repo(tmp_path / "dst")
    data = bytes(range(256)) * 256
    digest = src.objects.put_chunk(data, codec_by_name("zstd")).digest
    dst.objects.put_chunk(data, codec_by_name("raw"))
    key = chunk_key(digest)
    stored_raw = dst.blobs.get(key)
    an_hour_ago = time.time() - 3600
    os.utime(tmp_path / "dst" / key, (an_hour_ago, an_hour_ago))

    copied = src.objects.copy(ObjectKind.CHUNK, digest, dst.objects)

    assert not copied.created
    assert dst.blobs.get(key) == stored_raw  # the destination's own encoding stays
    assert dst.blobs.stat(key).mtime > an_hour_ago + 1800  # and GC's age check now spares it
    assert dst.objects.get_chunk(digest) == data


def test_a_push_that_finds_missing_chunks_by_listing_moves_only_those(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 4 KiB chunks: 640 keys, several per chunks/<xx>/ prefix, so a listing is the cheaper way.
    monkeypatch.setattr("cas.objects.inventory.LIST_MIN_KEYS", 16)
    local = small_chunk_repo(tmp_path / "local", chunk_size=4096)
    remote = small_chunk_repo(tmp_path / "remote", chunk_size=4096)
    state = layered_state(layers=10, seed=6)
    local.save(state, "a")
    local.push(remote, ["a"])
    state["model"]["layer00.weight"] = -state["model"]["layer00.weight"]
    local.save(state, "b")

    report = local.push(remote, ["b"])

    assert report.lookup == "list"
    assert report.bytes_moved == state["model"]["layer00.weight"].numel() * 4
    assert_bit_exact(remote.load("b"), state)


@pytest.mark.s3
@pytest.mark.slow
def test_server_stopped_mid_push_leaves_the_old_checkpoint_and_the_rerun_moves_the_rest(
    tmp_path: Path, private_seaweed: SeaweedServer
) -> None:
    server = private_seaweed
    url = "s3://crash/store"
    local = small_chunk_repo(tmp_path / "local")
    old_state = layered_state(layers=4, seed=7)
    old = local.save(old_state, "runs/r1/latest")
    local.push(s3_repo(url, endpoint_url=server.endpoint_url), ["runs/r1/latest"])
    new_state = layered_state(layers=16, seed=8)
    new = local.save(new_state, "runs/r1/latest")
    new_bytes = total_tensor_bytes(new_state)
    lock = threading.Lock()
    moved = [0]

    def stop_server_a_quarter_in(step: int, _skipped: int) -> None:
        # Every worker passes here, so once the server is down no worker has a request in flight
        # that could still succeed.
        with lock:
            moved[0] += step
            if moved[0] >= new_bytes // 4 and server.running:
                server.stop()

    with pytest.raises(BackendError, match="no destination ref was changed"):
        local.push(
            # botocore's own retry sleeps only slow the test down; cas's retry layer stays on.
            s3_repo(url, endpoint_url=server.endpoint_url, max_attempts=1),
            ["runs/r1/latest"],
            jobs=4,
            progress=stop_server_a_quarter_in,
        )
    server.start()
    remote = s3_repo(url, endpoint_url=server.endpoint_url)
    assert remote.resolve("runs/r1/latest") == old
    assert_bit_exact(remote.load("runs/r1/latest"), old_state)

    rerun = local.push(remote, ["runs/r1/latest"])

    assert rerun.refs[0].status == "updated" and remote.resolve("runs/r1/latest") == new
    assert 0 < rerun.bytes_moved <= new_bytes - new_bytes // 4
    assert rerun.bytes_moved + rerun.bytes_skipped == new_bytes
    assert_bit_exact(remote.load("runs/r1/latest"), new_state)


def _faulty_repo(
    blobs: BlobStore, seed: int, config: StoreConfig
) -> tuple[Repository, FaultyBlobStore]:
    faulty = FaultyBlobStore(blobs, rate=0.05, after_write=0.5, seed=seed)
    policy = RetryPolicy(attempts=12, base_delay=0.001, max_delay=0.01)
    retrying = RetryingBlobStore(faulty, policy, rng=random.Random(seed))
    write_config(retrying, config)
    return Repository(retrying, config), faulty


@pytest.mark.s3
def test_saves_and_pushes_complete_bit_exact_with_5_percent_transient_failures(
    tmp_path: Path, s3_url: str
) -> None:
    config = StoreConfig(chunk_size=CHUNK, inline_max=256)
    local, local_faults = _faulty_repo(LocalBlobStore(tmp_path / "local"), 1, config)
    remote, remote_faults = _faulty_repo(S3BlobStore.from_url(s3_url), 2, config)
    back, back_faults = _faulty_repo(LocalBlobStore(tmp_path / "back"), 3, config)
    state = layered_state(layers=12, seed=9)

    local.save(state, "runs/r1/latest")
    remote.save(layered_state(layers=2, seed=10), "runs/r0/latest")
    local.push(remote, ["runs/r1/latest"])
    back.pull(remote, ["runs/**"])

    assert_bit_exact(back.load("runs/r1/latest"), state)
    assert_bit_exact(back.load("runs/r0/latest"), layered_state(layers=2, seed=10))
    for faults in (local_faults, remote_faults, back_faults):
        assert sum(faults.faults.values()) >= 3, faults.faults


def test_a_ref_moved_during_the_push_is_a_conflict_and_nothing_is_lost(tmp_path: Path) -> None:
    local = small_chunk_repo(tmp_path / "local")
    remote = small_chunk_repo(tmp_path / "remote")
    state = layered_state(layers=6, seed=11)
    ours = local.save(state, "gates/best")
    theirs_state = layered_state(layers=1, seed=12)
    interloper = small_chunk_repo(tmp_path / "remote")

    def another_writer_moves_the_ref(moved: int, _skipped: int) -> None:
        if moved and interloper.refs_store.try_get("gates/best") is None:
            interloper.save(theirs_state, "gates/best")

    with pytest.raises(RefConflict) as caught:
        local.push(remote, ["gates/best"], jobs=1, progress=another_writer_moves_the_ref)

    assert isinstance(caught.value, TransferConflict)
    assert caught.value.report.refs[0].status == "conflict"
    assert_bit_exact(remote.load("gates/best"), theirs_state)
    assert_bit_exact(remote.load(ours), state)  # our manifest and chunks arrived all the same
    assert local.push(remote, ["gates/best"]).bytes_moved == 0


def test_a_corrupt_source_chunk_stops_the_push_before_any_ref_moves(tmp_path: Path) -> None:
    local = small_chunk_repo(tmp_path / "local")
    remote = small_chunk_repo(tmp_path / "remote")
    manifest_digest = local.save(layered_state(layers=2, seed=13), "runs/r1/latest")
    victim = next(iter(local.manifest(manifest_digest).chunk_digests()))
    path = tmp_path / "local" / chunk_key(victim)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))

    with pytest.raises(IntegrityError, match=victim):
        local.push(remote, ["runs/r1/latest"])

    assert remote.refs() == []
    assert not remote.blobs.has(chunk_key(victim))


def test_selectors_that_match_nothing_are_a_clear_error(tmp_path: Path) -> None:
    local = small_chunk_repo(tmp_path / "local")
    local.save(layered_state(layers=1), "runs/r1/latest")
    with pytest.raises(cas.NotFound, match="runs/r9"):
        local.push(small_chunk_repo(tmp_path / "remote"), ["runs/r1/latest", "runs/r9/**"])


@pytest.mark.s3
def test_cli_push_pull_and_archive_report_moved_and_skipped_bytes(
    tmp_path: Path, s3_url: str
) -> None:
    runner = CliRunner()
    store = tmp_path / "local"
    local = small_chunk_repo(store)
    shared = layered_state(layers=4, seed=14)
    local.save(shared, "runs/r1/ckpt_step00000100")
    extra = torch.randn(256, 256, generator=torch.Generator().manual_seed(15))
    grown = {"model": {**shared["model"], "extra": extra}, "step": 2}
    local.save(grown, "runs/r1/ckpt_step00000200")

    def run(*args: str) -> dict[str, Any]:
        result = runner.invoke(
            cli, ["--store", str(store), *args, "--json"], catch_exceptions=False
        )
        assert result.exit_code == 0, result.output
        doc: dict[str, Any] = json.loads(result.output)
        return doc

    first = run("push", "runs/r1/ckpt_step00000100", "--to", s3_url, "--jobs", "4")
    second = run("push", "runs/r1/**", "--to", s3_url)
    archived = run("archive", "runs/r1/ckpt_step00000200", "--to", s3_url)

    assert first["bytes_moved"] == total_tensor_bytes(shared) and first["refs_updated"] == 1
    assert second["bytes_skipped"] == total_tensor_bytes(shared)  # shared chunks count once
    assert second["bytes_moved"] == 256 * 256 * 4
    assert archived["removed_refs"] == ["runs/r1/ckpt_step00000200"]
    assert archived["freed_chunks"] == 256 * 256 * 4 // CHUNK  # only "extra" was not shared
    fresh = tmp_path / "fresh"
    result = runner.invoke(
        cli, ["--store", str(fresh), "pull", "runs/r1/ckpt_step00000200", "--from", s3_url]
    )
    assert result.exit_code == 0, result.output
    assert_bit_exact(cas.open(fresh).load("runs/r1/ckpt_step00000200"), grown)
    assert cas.open(fresh).config.chunk_size == CHUNK  # a new local store takes the remote's


@pytest.mark.s3
def test_cli_push_to_a_missing_bucket_is_one_clear_line(tmp_path: Path, s3_url: str) -> None:
    store = tmp_path / "local"
    small_chunk_repo(store).save(layered_state(layers=1), "a")
    result = CliRunner().invoke(
        cli,
        ["--store", str(store), "push", "a", "--to", f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}"],
    )
    assert result.exit_code == 1
    assert result.output.startswith("cas: error: BackendError: ")
    assert "no-such-bucket" in result.output and result.output.count("\n") == 1


def test_an_archive_push_can_recompress_chunks_and_stays_bit_exact(tmp_path: Path) -> None:
    local = small_chunk_repo(tmp_path / "local")
    remote = small_chunk_repo(tmp_path / "remote")
    state = {"mask": (torch.arange(256 * 1024) % 7 == 0).float(), "step": 1}
    local.save(state, "runs/r1/latest")

    report = local.push(remote, ["runs/r1/latest"], codec="zstd")

    assert report.wire_bytes < report.bytes_moved // 4
    for digest in remote.manifest("runs/r1/latest").chunk_digests():
        assert remote.blobs.get(chunk_key(digest))[5] == 1  # the zstd codec id
        assert local.blobs.get(chunk_key(digest))[5] == 0  # the source keeps its raw copy
    assert_bit_exact(remote.load("runs/r1/latest"), state)
