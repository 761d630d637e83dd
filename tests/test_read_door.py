"""The read door: every byte a store hands back is hashed in ``cas.objects.readcheck`` (invariant 2).

Two locks on the one door. Structurally: no module of ``cas/`` compares a freshly computed digest
anywhere but in the door, and only the write paths that *name* new bytes call the hash at all.
Behaviourally: with the door made to refuse everything, every read API of the object store, and
a load through the repository, fails; a read path that hashed on its own would still succeed.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import cas
from cas.blobstore import MemoryBlobStore
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.codecs import codec_by_name
from cas.digest import Digest, digest_of
from cas.errors import CASError, IntegrityError
from cas.objects import readcheck
from cas.objects.keys import ObjectKind, object_key
from cas.objects.recode import recode_chunk
from cas.objects.store import ObjectStore
from cas.repo.config import StoreConfig

CAS = Path(cas.__file__).parent
HASHES = {"digest_of", "digest_of_parts"}
DOOR = CAS / "objects" / "readcheck.py"

# Where hashing is not a read check: naming new bytes, and hashes that are no content digests.
NAMING = {
    ("objects/store.py", "put_chunk"),  # the name of the bytes a writer stores
    ("objects/store.py", "_put_private"),
    ("objects/store.py", "put_manifest"),
    ("objects/overlap.py", "_hash"),  # a new chunk's name, computed while its file is written
    ("objects/encoding.py", "_first_new_chunk"),  # which chunks of a tensor a parent holds
    ("blobstore/local.py", "_key_lock"),  # a lock file's name
    ("blobstore/local.py", "_current_version"),  # a conditional write's version token
    ("blobstore/local.py", "get_versioned"),
    ("blobstore/local.py", "put_conditional"),
    ("blobstore/fsspec_store.py", "get_versioned"),
    ("blobstore/fsspec_store.py", "put_conditional"),
    ("refs/keys.py", "ref_key"),  # a long ref name's key
    ("training/pool.py", "sample"),  # a seeded draw
    ("training/compat.py", "config_hash"),
    ("fs/filesystem.py", "ukey"),  # fsspec's change token
}


def _hash_calls(tree: ast.AST) -> Iterator[tuple[str, ast.Call]]:
    """(enclosing function, call) for every call of a digest function in ``tree``."""

    def walk(node: ast.AST, function: str) -> Iterator[tuple[str, ast.Call]]:
        for child in ast.iter_child_nodes(node):
            name = function
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = child.name
            if isinstance(child, ast.Call) and _called(child) in HASHES:
                yield name, child
            yield from walk(child, name)

    yield from walk(tree, "<module>")


def _called(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def test_no_module_checks_a_digest_outside_the_read_door() -> None:
    compared, unexpected, named = [], [], set()
    for path in sorted(CAS.rglob("*.py")):
        if path in (DOOR, CAS / "digest.py"):
            continue
        rel = path.relative_to(CAS).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Call) and _called(s) in HASHES for s in sides):
                    compared.append(f"{rel}:{node.lineno}")
        for function, call in _hash_calls(tree):
            if (rel, function) not in NAMING:
                unexpected.append(f"{rel}:{call.lineno} in {function}()")
            named.add((rel, function))
    assert not compared, f"digest compared outside cas/objects/readcheck.py: {compared}"
    assert not unexpected, (
        "a digest computed outside the read door and the naming write paths (route a read check "
        f"through readcheck.verify_digest, or add a naming site to NAMING): {unexpected}"
    )
    assert named >= NAMING, f"NAMING lists sites that no longer hash: {NAMING - named}"


class _ClosedDoor:
    """A door that refuses everything and counts who knocked."""

    def __init__(self) -> None:
        self.knocks: list[str] = []

    def __call__(self, data: object, expected: Digest, what: str, **kw: object) -> None:
        self.knocks.append(what)
        raise IntegrityError(f"{what}: refused by the closed door")


@pytest.fixture
def closed_door(monkeypatch: pytest.MonkeyPatch) -> _ClosedDoor:
    door = _ClosedDoor()
    monkeypatch.setattr(readcheck, "verify_digest", door)
    return door


def _store(tmp_path: Path, where: str) -> ObjectStore:
    if where == "memory":
        return ObjectStore(MemoryBlobStore())
    return cas.open(tmp_path / "s", fsync=False).objects


DATA = bytes(range(256)) * 64  # compressible, so the zstd copy is stored encoded


def _stored(objects: ObjectStore, codec: str) -> Digest:
    return objects.put_chunk(DATA, codec_by_name(codec)).digest


def _read_whole(o: ObjectStore, d: Digest) -> object:
    return o.get_chunk(d)


def _read_into(o: ObjectStore, d: Digest) -> object:
    o.read_chunk_into(d, memoryview(bytearray(len(DATA))))
    return None


def _read_into_encoded(o: ObjectStore, d: Digest) -> object:
    o.read_chunk_into(d, memoryview(bytearray(len(DATA))), encoded=True)
    return None


def _read_split(o: ObjectStore, d: Digest) -> object:
    half = len(DATA) // 2
    o.read_chunk_parts(d, [memoryview(bytearray(half)), memoryview(bytearray(len(DATA) - half))])
    return None


def _map(o: ObjectStore, d: Digest) -> object:
    return o.map_raw_chunk(d, len(DATA))


def _verify(o: ObjectStore, d: Digest) -> object:
    return o.verify(d)


def _verify_stored(o: ObjectStore, d: Digest) -> object:
    return o.verify_stored(ObjectKind.CHUNK, d, o.blobs.get(object_key(ObjectKind.CHUNK, d)))


def _copy(o: ObjectStore, d: Digest) -> object:
    return o.copy(ObjectKind.CHUNK, d, ObjectStore(MemoryBlobStore()))


def _recode_keep(o: ObjectStore, d: Digest) -> object:
    return recode_chunk(o, ObjectStore(MemoryBlobStore()), d, "keep")


def _recode_raw(o: ObjectStore, d: Digest) -> object:
    return recode_chunk(o, ObjectStore(MemoryBlobStore()), d, "raw")


READS: dict[str, Callable[[ObjectStore, Digest], object]] = {
    "get_chunk": _read_whole,
    "read_chunk_into": _read_into,
    "read_chunk_into(encoded)": _read_into_encoded,
    "read_chunk_parts": _read_split,
    "verify": _verify,
    "verify_stored": _verify_stored,
    "copy": _copy,
    "recode keep": _recode_keep,
    "recode raw": _recode_raw,
}


@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.parametrize("read", list(READS))
def test_every_chunk_read_goes_through_the_door(
    tmp_path: Path, closed_door: _ClosedDoor, read: str, where: str, codec: str
) -> None:
    objects = _store(tmp_path, where)
    digest = _stored(objects, codec)
    with pytest.raises(IntegrityError, match="closed door"):
        READS[read](objects, digest)
    assert closed_door.knocks


def test_a_mapped_raw_chunk_goes_through_the_door(tmp_path: Path, closed_door: _ClosedDoor) -> None:
    objects = _store(tmp_path, "local")
    digest = _stored(objects, "raw")
    with pytest.raises(IntegrityError, match="closed door"):
        _map(objects, digest)


def test_a_manifest_read_and_a_reuse_probe_go_through_the_door(
    tmp_path: Path, closed_door: _ClosedDoor
) -> None:
    objects = _store(tmp_path, "memory")
    digest = objects.put_manifest(b'{"a manifest": 1}', codec_by_name("zstd"))
    with pytest.raises(IntegrityError, match="closed door"):
        objects.get_manifest(digest)
    small = _store(tmp_path, "local")
    chunk = _stored(small, "zstd")
    assert small.stored_base(chunk, len(DATA)) == (False, None)  # not sound: stored again
    assert closed_door.knocks


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_load_through_the_repository_goes_through_the_door(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    config = StoreConfig(chunk_size=4096, inline_max=64)
    if where == "memory":
        repo = cas.Repository(MemoryBlobStore(), config)
    else:
        repo = cas.open(tmp_path / "s", config=config, fsync=False)
    state = {"w": torch.arange(10_000, dtype=torch.float32), "b": torch.ones(3000)}
    repo.save(state, "runs/r/latest")
    manifest = repo.manifest("runs/r/latest")  # read before the door closes
    door = _ClosedDoor()
    monkeypatch.setattr(readcheck, "verify_digest", door)
    with pytest.raises(CASError):
        repo.load("runs/r/latest")
    assert door.knocks, "the load returned without the door checking a byte"
    assert manifest.chunk_digests()


def test_the_open_door_lets_sound_bytes_through_and_names_bad_ones() -> None:
    readcheck.verify_digest(DATA, digest_of(DATA), "chunk x")
    readcheck.verify_digest([memoryview(DATA[:5]), DATA[5:]], digest_of(DATA), "chunk x")
    with pytest.raises(IntegrityError, match="chunk x is corrupt: its bytes hash"):
        readcheck.verify_digest(DATA[1:], digest_of(DATA), "chunk x")
    with pytest.raises(IntegrityError, match="chunk x is corrupt: 5 bytes where its header says 6"):
        readcheck.verify_digest(b"12345", digest_of(b"12345"), "chunk x", size=6)


class _RotsAfterFirstRead(BlobStoreWrapper):
    """A source whose chunk reads back right once, then with a flipped byte (a disk going bad, or
    a writer healing it with other bytes between two reads)."""

    def __init__(self, inner: MemoryBlobStore) -> None:
        super().__init__(inner)
        self.reads = 0

    def get(self, key: str) -> bytes:
        blob = bytearray(self.inner.get(key))
        self.reads += key.startswith("chunks/")
        if key.startswith("chunks/") and self.reads > 1:
            blob[-1] ^= 0xFF
        return bytes(blob)


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_a_recoded_copy_is_the_very_blob_that_was_verified(codec: str) -> None:
    source = _RotsAfterFirstRead(MemoryBlobStore())
    src = ObjectStore(source)
    digest = _stored(src, codec)
    dst = ObjectStore(MemoryBlobStore())
    result = recode_chunk(src, dst, digest, "keep")
    assert result.new and source.reads == 1
    assert bytes(dst.get_chunk(digest)) == DATA
