"""Names: every ref name the format allows is stored on every backend, every file name `put`
accepts comes back from `get`, and `get` never writes through a link inside its destination."""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import pytest
import torch
from click.testing import CliRunner
from fsspec.implementations.local import LocalFileSystem

import cas
from cas.blobstore import BlobStore, LocalBlobStore, MemoryBlobStore, open_blobstore
from cas.blobstore.fsspec_store import FsspecBlobStore
from cas.blobstore.s3 import S3BlobStore
from cas.cli import cli
from cas.digest import Digest, digest_of
from cas.names import MAX_REF_LENGTH, RefName, parse_ref_name
from cas.refs.keys import MAX_PLAIN_NAME, ref_key
from cas.refs.records import RefEvent, RefRecord, encode_ref
from cas.refs.store import RefStore

LONGEST_PLAIN = "n" * MAX_PLAIN_NAME
"""A name whose key is its quoted self at the longest: what older stores hold as it is."""
LONG_NAMES = (
    "/".join(["a" * 250] * 3),
    # Quoting turns each '@' into three bytes: 1,023 characters become over 3,000 bytes.
    "/".join(["b" + "@" * 254] * 4),
    "c" * (MAX_PLAIN_NAME - 5) + "@@",  # one byte over the plain limit once quoted
    "runs/" + "d" * 200 + "/" + "e" * 200 + "/ckpt",
)


def _target(i: int) -> Digest:
    return digest_of(f"manifest {i}".encode())


Backend = Callable[[Path], BlobStore]
BACKENDS: dict[str, Backend] = {
    "local": lambda tmp: LocalBlobStore(tmp / "store"),
    "memory": lambda tmp: MemoryBlobStore(),
    "fsspec-local": lambda tmp: FsspecBlobStore(LocalFileSystem(), str(tmp / "store")),
    "fsspec-memory": lambda tmp: open_blobstore(f"memory://cas-names-{uuid.uuid4().hex}"),
}


def _check_every_name_is_stored(blobs: BlobStore) -> None:
    refs = RefStore(blobs)
    names = [LONGEST_PLAIN, *LONG_NAMES]
    for i, name in enumerate(names):
        refs.set(name, _target(i), expected=None)
    for key in blobs.list("refs/"):
        assert all(len(part.encode()) <= 255 for part in key.split("/")), key
        assert len(key.encode()) <= 255 + len("refs/")
    fresh = RefStore(blobs)  # nothing remembered from the writes
    for i, name in enumerate(names):
        assert fresh.get(name).target == _target(i)
    assert list(fresh.names()) == sorted(names)
    assert [s.name for s in fresh.scan()] == sorted(names)
    assert all(s.error is None for s in fresh.scan())
    assert list(fresh.names("runs/" + "d" * 200)) == [LONG_NAMES[3]]
    assert list(fresh.names("a*/**")) == [LONG_NAMES[0]]
    fresh.set(LONG_NAMES[1], _target(99))
    assert [e.target for e in fresh.events(fresh.get(LONG_NAMES[1]))] == [_target(99), _target(2)]
    for name in names:
        fresh.delete(name)
    assert list(blobs.list("refs/")) == []


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_ref_name_the_format_allows_is_stored_on_every_backend(
    tmp_path: Path, backend: str
) -> None:
    assert all(len(parse_ref_name(n)) <= MAX_REF_LENGTH for n in LONG_NAMES)
    blobs = BACKENDS[backend](tmp_path)
    try:
        _check_every_name_is_stored(blobs)
    finally:
        blobs.close()


@pytest.mark.s3
def test_every_ref_name_the_format_allows_is_stored_on_s3(s3_url: str) -> None:
    blobs = S3BlobStore.from_url(s3_url)
    try:
        _check_every_name_is_stored(blobs)
    finally:
        blobs.close()


def test_names_that_fit_keep_the_keys_older_stores_used() -> None:
    assert ref_key(RefName("runs/r1/ckpt_step00045000")) == "refs/runs%2Fr1%2Fckpt_step00045000"
    assert ref_key(RefName("pool/v@1+a=b,c")) == "refs/pool%2Fv%401%2Ba%3Db%2Cc"
    assert ref_key(RefName(LONGEST_PLAIN)) == "refs/" + LONGEST_PLAIN


def test_a_long_name_an_older_cas_stored_on_an_object_store_is_read_and_moved() -> None:
    blobs = MemoryBlobStore()
    name = RefName(LONG_NAMES[0])
    old_key = "refs/" + quote(name, safe="")
    event = RefEvent(_target(1), 1_700_000_000.0, "save", "older cas")
    blobs.put(old_key, encode_ref(RefRecord(name, event.target, (event,))))
    refs = RefStore(blobs)
    assert refs.get(name).target == _target(1)
    assert list(refs.names()) == [name]
    assert [s.name for s in refs.scan()] == [name]
    refs.set(name, _target(2))
    assert list(blobs.list("refs/")) == [ref_key(name)]  # moved to its current key
    assert [e.message for e in refs.events(refs.get(name))] == ["", "older cas"]
    refs.delete(name)
    assert list(blobs.list("refs/")) == []


def test_a_ref_named_like_a_temp_file_is_listed_and_its_data_kept_by_gc(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    source = tmp_path / "weights.bin"
    source.write_bytes(os.urandom(10_000))
    repo.put_path(source, "runs/r1/ckpt.tmp")
    assert repo.ref_names() == ["runs/r1/ckpt.tmp"]
    plan = repo.plan_gc(dataclasses.replace(repo.gc_settings(), grace=0.0))
    assert not plan.chunks and not plan.manifests
    plan.execute()
    repo.get_path("runs/r1/ckpt.tmp", tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == source.read_bytes()


def _cas(store: Path, *args: str, ok: bool = True) -> str:
    result = CliRunner().invoke(cli, ["--store", str(store), *args], catch_exceptions=False)
    assert (result.exit_code == 0) == ok, result.output
    return result.output


def test_a_file_with_a_250_character_name_comes_back_from_get(tmp_path: Path) -> None:
    store, src = tmp_path / "store", tmp_path / "src"
    long_name = "w" * 250 + ".bin"
    (src / ("d" * 250)).mkdir(parents=True)
    (src / long_name).write_bytes(os.urandom(5000))
    (src / ("d" * 250) / long_name).write_bytes(os.urandom(300))
    _cas(store, "put", str(src / long_name), "one")
    _cas(store, "put", str(src), "tree")
    (tmp_path / "one").mkdir()
    _cas(store, "get", "one", str(tmp_path / "one"))
    assert (tmp_path / "one" / long_name).read_bytes() == (src / long_name).read_bytes()
    _cas(store, "get", "tree", str(tmp_path / "tree"))
    for path in (Path(long_name), Path("d" * 250) / long_name):
        assert (tmp_path / "tree" / path).read_bytes() == (src / path).read_bytes()
    assert not [p for p in (tmp_path / "tree").rglob(".cas-*")]  # no temp file left
    # Its sidecar's name would be too long: refused, in one line, before anything is written.
    out = _cas(store, "get", "tree", str(tmp_path / "sums"), "--sha256", ok=False)
    assert out.count("\n") == 1 and "--sha256" in out
    assert not (tmp_path / "sums").exists()


def _stored_tree(tmp_path: Path) -> Path:
    store, src = tmp_path / "store", tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "model.bin").write_bytes(b"model")
    (src / "sub" / "notes.txt").write_bytes(b"notes")
    _cas(store, "put", str(src), "tree")
    return store


@pytest.mark.parametrize("force", [False, True])
def test_get_never_writes_through_a_directory_link_inside_its_destination(
    tmp_path: Path, force: bool
) -> None:
    store = _stored_tree(tmp_path)
    outside, dest = tmp_path / "outside", tmp_path / "dest"
    outside.mkdir()
    dest.mkdir()
    (dest / "sub").symlink_to(outside)
    out = _cas(store, "get", "tree", str(dest), *(["--force"] if force else []), ok=False)
    assert out.count("\n") == 1 and "symlink" in out
    assert list(outside.iterdir()) == []


def test_get_replaces_a_file_link_inside_its_destination_and_never_writes_through_it(
    tmp_path: Path,
) -> None:
    store = _stored_tree(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    dest = tmp_path / "dest"
    (dest / "sub").mkdir(parents=True)
    (dest / "model.bin").symlink_to(victim)
    (dest / "sub" / "notes.txt.sha256").symlink_to(victim)
    _cas(store, "get", "tree", str(dest), ok=False)  # exists: nothing is written without -f
    _cas(store, "get", "tree", str(dest), "--force", "--sha256")
    assert victim.read_bytes() == b"precious"
    assert not (dest / "model.bin").is_symlink()
    assert (dest / "model.bin").read_bytes() == b"model"
    assert not (dest / "sub" / "notes.txt.sha256").is_symlink()


@pytest.mark.parametrize("selector", ["s3://bucket/ckpts/runs/r1", "/data/cas/runs/r1"])
def test_listing_with_a_url_or_a_path_for_a_prefix_fails_saying_why(
    tmp_path: Path, selector: str
) -> None:
    """`cas ls s3://bucket/prefix/runs/r1`, as `aws s3 ls` takes it, listed nothing and exited
    0: the URL was taken for a ref prefix no ref has. Now it is refused with the way to say it."""
    store = tmp_path / "store"
    repo = cas.open(store)
    repo.save({"w": torch.ones(3)}, "runs/r1/ckpt")
    with pytest.raises(cas.InvalidName, match=r"is a URL|is absolute"):
        repo.refs(selector)
    result = CliRunner().invoke(cli, ["--store", str(store), "ls", selector])
    assert result.exit_code == 1
    assert "cas --store URL" in result.output or "is absolute" in result.output
    assert _cas(store, "ls", "runs/r1") == "runs/r1/ckpt\n"  # a real prefix still lists
    assert _cas(store, "ls", "runs/*/ckpt") == "runs/r1/ckpt\n"


def test_a_url_given_for_a_ref_name_says_to_open_the_store_at_it() -> None:
    with pytest.raises(cas.InvalidName, match=r"is a URL: open the store at the URL"):
        parse_ref_name("s3://bucket/ckpts/runs/r1/ckpt")
