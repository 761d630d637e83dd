"""An encrypted store through every way in: the mount, ``cas://``, a cache in front of S3 and a
training run's two tiers, with nothing readable left behind in the storage."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import boto3
import fsspec
import pytest
import torch
from safetensors.torch import load as load_safetensors

import cas
from cas.fs.fuse import fuse_unavailable_reason
from cas.repo.keys import KeyRequired
from cas.training.manager import CheckpointManager
from tests.helpers import assert_bit_exact
from tests.prerequisites import require
from tests.test_mount import _wait_for_mount

PATTERN = b"CAS-PLAINTEXT-PATTERN-0123456789"
PASSPHRASE = "correct horse battery staple"
CKPT = "runs/r1/phase1/ckpt_phase1_step{:08d}"


@pytest.fixture(autouse=True)
def no_key_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CAS_KEY", "CAS_KEY_FILE", "CAS_KEY_COMMAND", "CAS_APPEND_ONLY"):
        monkeypatch.delenv(name, raising=False)


def marked(step: int = 0) -> dict[str, torch.Tensor]:
    """A state holding a byte pattern a reader of the storage could search for."""
    pattern = torch.frombuffer(bytearray(PATTERN * 2048), dtype=torch.uint8)
    return {
        "marked": pattern,
        "w": torch.randn(20_000, generator=torch.Generator().manual_seed(step)),
    }


def assert_no_plaintext(root: Path) -> None:
    files = [p for p in root.rglob("*") if p.is_file() and "tmp" not in p.relative_to(root).parts]
    assert files
    for path in files:
        assert PATTERN[:16] not in path.read_bytes(), path


def test_an_encrypted_store_mounts_with_its_key_and_refuses_without_one(tmp_path: Path) -> None:
    reason = fuse_unavailable_reason()
    require(f"FUSE unusable here: {reason}" if reason else None)
    store, mnt = tmp_path / "store", tmp_path / "mnt"
    repo = cas.open(store, key=PASSPHRASE)
    ckpt = tmp_path / "checkpoint-1"
    ckpt.mkdir()
    (ckpt / "data.bin").write_bytes(PATTERN * 4096 + os.urandom(1 << 20))
    repo.put_path(ckpt, "runs/r1/checkpoint-1")
    mnt.mkdir()
    command = [sys.executable, "-m", "cas", "--store", str(store), "mount", "runs/r1", str(mnt)]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and not os.path.ismount(mnt)
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    env = {**os.environ, "CAS_KEY": PASSPHRASE}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for_mount(mnt, process)
        read = (mnt / "checkpoint-1" / "data.bin").read_bytes()
        assert (
            hashlib.sha256(read).digest()
            == hashlib.sha256((ckpt / "data.bin").read_bytes()).digest()
        )
    finally:
        subprocess.run(["fusermount", "-u", str(mnt)], check=False, capture_output=True)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
        repo.close()
    assert_no_plaintext(store)


def test_cas_urls_write_and_read_an_encrypted_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    cas.open(store, key=PASSPHRASE).save(marked(), "runs/r1/ckpt")
    fs = fsspec.filesystem("cas", store=str(store), key=PASSPHRASE, skip_instance_cache=True)
    body = PATTERN * 8192 + os.urandom(100_000)
    with fs.open("models/m1/data.bin", "wb") as f:
        f.write(body)
    with fs.open("models/m1/data.bin", "rb") as f:
        assert f.read() == body
    with fs.open("runs/r1/ckpt/marked.safetensors", "rb") as f:
        assert torch.equal(load_safetensors(f.read())["marked"], marked()["marked"])
    with pytest.raises(KeyRequired):
        fsspec.filesystem("cas", store=str(store), skip_instance_cache=True)
    assert_no_plaintext(store)


def test_a_cache_in_front_of_an_encrypted_s3_store_holds_only_ciphertext(
    tmp_path: Path, s3_url: str
) -> None:
    saved = marked()
    cas.open(s3_url, key=PASSPHRASE, cache=tmp_path / "cache-a").save(saved, "runs/r1/ckpt")
    reader = cas.open(s3_url, key=PASSPHRASE, cache=tmp_path / "cache-b")
    assert_bit_exact(reader.load("runs/r1/ckpt"), saved)  # fills the cache
    assert_bit_exact(reader.load("runs/r1/ckpt"), saved)  # from it
    for cache in ("cache-a", "cache-b"):
        assert any((tmp_path / cache / "chunks").rglob("*"))
        assert_no_plaintext(tmp_path / cache)
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)
    s3 = boto3.client("s3")
    for item in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]:
        assert PATTERN[:16] not in s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()


def drain_three_saves(local: cas.Repository, remote: cas.Repository | str) -> None:
    with CheckpointManager(local, run="r1", signals=False, remote=remote) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, marked(step)).result()
        assert mgr.tier is not None
        lag = mgr.tier.wait(60)
        assert (lag.saves, lag.error) == (0, None)


def test_a_run_drains_an_encrypted_local_tier_to_an_encrypted_remote_of_the_same_key(
    tmp_path: Path,
) -> None:
    local = cas.open(tmp_path / "local", key=PASSPHRASE)
    remote = cas.open(tmp_path / "remote", key="the archive's passphrase", key_from=local)
    drain_three_saves(local, remote)
    assert remote.resolve("runs/r1/latest") == local.resolve(CKPT.format(3))
    assert_bit_exact(remote.load("runs/r1/latest")["state"], marked(3))
    for path in (tmp_path / "remote" / "chunks").rglob("*"):
        if path.is_file():  # one key: the drain copied each object as it is stored
            assert (tmp_path / "local" / path.relative_to(tmp_path / "remote")).read_bytes() == (
                path.read_bytes()
            )
    assert_no_plaintext(tmp_path / "remote")


def test_a_run_drains_an_encrypted_local_tier_to_s3_under_another_key(
    tmp_path: Path, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = cas.open(tmp_path / "local", key=PASSPHRASE)
    cas.open(s3_url, key="the archive's passphrase").close()
    monkeypatch.setenv("CAS_KEY", "the archive's passphrase")  # how a remote URL gets its key
    drain_three_saves(local, s3_url)
    remote = cas.open(s3_url)
    assert remote.resolve("runs/r1/latest") == local.resolve(CKPT.format(3))
    assert_bit_exact(remote.load("runs/r1/latest")["state"], marked(3))
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)
    s3 = boto3.client("s3")
    for item in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]:
        assert PATTERN[:16] not in s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
