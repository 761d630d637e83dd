"""Manifests: the immutable, versioned msgpack document that names a checkpoint's chunks.

A manifest never contains a pickle. Its schema (``docs/format.md``) is:

    {"format": "cas-manifest", "version": 1, "kind": "state" | "files",
     "created_at": float, "parent": hex | nil, "chunk_size": int, "meta": {str: value},
     "tensors": [tensor entry, ...], "tree": node (state only), "files": {path: file entry}}

Decoding validates every field and bound, so a hostile or corrupt manifest is a FormatError.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack

from cas.digest import Digest, digest_to_bytes, parse_digest
from cas.errors import FormatError
from cas.names import check_relative_path

MANIFEST_FORMAT = "cas-manifest"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 512 << 20
MAX_DIMS = 64

ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1, "complex128": 16, "complex64": 8, "complex32": 4,
}  # fmt: skip
"""Element sizes of the torch dtypes a manifest may name (numpy dtypes use numpy's own strings)."""

TENSOR_KINDS = ("torch", "numpy", "numpy_scalar")


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a tensor or file: its digest and decoded size."""

    digest: Digest
    size: int


@dataclass(frozen=True)
class TensorEntry:
    """A tensor or array: dtype, shape and its bytes as chunks (or inline when tiny).

    ``encoding`` is None for plain chunks; codecs that depend on other chunks (XOR delta) record
    ``{"base": [digest, ...]}`` here so GC can keep the bases alive from manifests alone.
    """

    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: tuple[ChunkRef, ...] = ()
    inline: bytes | None = None
    encoding: dict[str, Any] | None = None

    def base_digests(self) -> tuple[Digest, ...]:
        """Chunks this tensor's encoding depends on besides its own."""
        if not self.encoding:
            return ()
        return tuple(parse_digest(d) for d in self.encoding.get("base", ()))


@dataclass(frozen=True)
class FileRegion:
    """A tensor stored inside a file entry at ``offset``, described by ``tensors[index]``."""

    name: str
    tensor_index: int
    offset: int


@dataclass(frozen=True)
class FileEntry:
    """An ingested file: its bytes as chunks, plus where the tensors inside it are."""

    size: int
    format: str
    chunks: tuple[ChunkRef, ...]
    regions: tuple[FileRegion, ...] = ()
    mode: int = 0o644


@dataclass(frozen=True)
class Manifest:
    """A checkpoint: a tree of values and tensors (``kind="state"``) or a set of files."""

    kind: str
    tensors: tuple[TensorEntry, ...]
    tree: Any = None
    files: dict[str, FileEntry] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    parent: Digest | None = None
    chunk_size: int = 0

    def chunk_refs(self) -> Iterator[ChunkRef]:
        """Every chunk this manifest names, tensors' and files' (repeats possible)."""
        for tensor in self.tensors:
            yield from tensor.chunks
        for entry in self.files.values():
            yield from entry.chunks

    def chunk_digests(self) -> set[Digest]:
        """Every chunk GC must keep for this manifest, delta bases included."""
        digests = {ref.digest for ref in self.chunk_refs()}
        for tensor in self.tensors:
            digests.update(tensor.base_digests())
        return digests

    def logical_bytes(self) -> int:
        """Bytes a reader gets back: tensor bytes for a state, file bytes for files."""
        if self.kind == "files":
            return sum(entry.size for entry in self.files.values())
        return sum(tensor.nbytes for tensor in self.tensors)


def _pack_chunks(chunks: tuple[ChunkRef, ...]) -> list[list[Any]]:
    return [[digest_to_bytes(c.digest), c.size] for c in chunks]


def _pack_tensor(t: TensorEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "kind": t.kind,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "nbytes": t.nbytes,
    }
    if t.inline is not None:
        doc["inline"] = t.inline
    else:
        doc["chunks"] = _pack_chunks(t.chunks)
    if t.encoding:
        doc["encoding"] = t.encoding
    return doc


def encode_manifest(manifest: Manifest) -> bytes:
    """The canonical msgpack bytes of a manifest (its digest is its identity)."""
    doc: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "kind": manifest.kind,
        "created_at": manifest.created_at,
        "parent": manifest.parent,
        "chunk_size": manifest.chunk_size,
        "meta": manifest.meta,
        "tensors": [_pack_tensor(t) for t in manifest.tensors],
    }
    if manifest.kind == "state":
        doc["tree"] = manifest.tree
    else:
        for path in manifest.files:  # never store a manifest decode_manifest would refuse
            check_relative_path(path)
        doc["files"] = {
            path: {
                "size": e.size,
                "format": e.format,
                "mode": e.mode,
                "chunks": _pack_chunks(e.chunks),
                "regions": [[r.name, r.tensor_index, r.offset] for r in e.regions],
            }
            for path, e in sorted(manifest.files.items())
        }
    try:
        packed: bytes = msgpack.packb(doc, use_bin_type=True, strict_types=False)
        return packed
    except (TypeError, ValueError, OverflowError) as e:
        raise FormatError(f"cannot encode manifest: {e}") from e


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise FormatError(f"corrupt manifest: {what}")


def _unpack_chunks(raw: Any, total: int | None) -> tuple[ChunkRef, ...]:
    _expect(isinstance(raw, list), "chunk list is not a list")
    chunks = []
    for item in raw:
        _expect(isinstance(item, list) and len(item) == 2, "chunk ref is not [digest, size]")
        digest_raw, size = item
        _expect(
            isinstance(digest_raw, bytes) and isinstance(size, int) and size >= 0, "bad chunk ref"
        )
        chunks.append(ChunkRef(parse_digest(digest_raw), size))
    if total is not None:
        _expect(sum(c.size for c in chunks) == total, "chunk sizes do not add up to the size")
    return tuple(chunks)


def _unpack_tensor(raw: Any) -> TensorEntry:
    _expect(isinstance(raw, dict), "tensor entry is not a map")
    kind, dtype, shape, nbytes = (
        raw.get("kind"),
        raw.get("dtype"),
        raw.get("shape"),
        raw.get("nbytes"),
    )
    _expect(kind in TENSOR_KINDS, f"unknown tensor kind {kind!r}")
    _expect(isinstance(dtype, str) and len(dtype) < 64, "bad dtype")
    _expect(isinstance(shape, list) and len(shape) <= MAX_DIMS, "bad shape")
    _expect(all(isinstance(d, int) and d >= 0 for d in shape), "bad shape")
    _expect(isinstance(nbytes, int) and nbytes >= 0, "bad nbytes")
    if kind == "torch":
        _expect(dtype in ITEMSIZE, f"unknown torch dtype {dtype!r}")
        _expect(
            nbytes == math.prod(shape) * ITEMSIZE[dtype], "nbytes does not match dtype and shape"
        )
    encoding = raw.get("encoding")
    _expect(encoding is None or isinstance(encoding, dict), "bad encoding")
    if encoding is not None:
        bases = encoding.get("base", [])
        _expect(isinstance(bases, list), "encoding base is not a list")
        _expect(all(isinstance(b, (bytes, str)) for b in bases), "bad encoding base digest")
        for base in bases:
            parse_digest(base)
    if "inline" in raw:
        inline = raw["inline"]
        _expect(
            isinstance(inline, bytes) and len(inline) == nbytes, "inline bytes do not match nbytes"
        )
        return TensorEntry(kind, dtype, tuple(shape), nbytes, (), inline, encoding)
    chunks = _unpack_chunks(raw.get("chunks"), nbytes)
    return TensorEntry(kind, dtype, tuple(shape), nbytes, chunks, None, encoding)


def _unpack_file(raw: Any, tensor_count: int) -> FileEntry:
    _expect(isinstance(raw, dict), "file entry is not a map")
    size, fmt, mode = raw.get("size"), raw.get("format"), raw.get("mode", 0o644)
    _expect(isinstance(size, int) and size >= 0, "bad file size")
    _expect(isinstance(fmt, str), "bad file format")
    _expect(isinstance(mode, int) and 0 <= mode <= 0o7777, "bad file mode")
    regions = []
    for item in raw.get("regions", []):
        _expect(isinstance(item, list) and len(item) == 3, "bad file region")
        name, index, offset = item
        _expect(
            isinstance(name, str) and isinstance(index, int) and 0 <= index < tensor_count,
            "bad region",
        )
        _expect(isinstance(offset, int) and 0 <= offset <= size, "bad region offset")
        regions.append(FileRegion(name, index, offset))
    return FileEntry(
        size, fmt, _unpack_chunks(raw.get("chunks"), size), tuple(regions), mode & 0o777
    )


def decode_manifest(data: bytes) -> Manifest:
    """Parse and validate manifest bytes; an unknown format or version is a FormatError."""
    _expect(len(data) <= MAX_MANIFEST_BYTES, "manifest too large")
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=False, max_bin_len=MAX_MANIFEST_BYTES)
    except Exception as e:
        raise FormatError(f"manifest is not valid msgpack: {e}") from e
    _expect(isinstance(doc, dict), "top level is not a map")
    if doc.get("format") != MANIFEST_FORMAT:
        raise FormatError("not a cas manifest")
    if doc.get("version") != MANIFEST_VERSION:
        raise FormatError(
            f"manifest version {doc.get('version')!r} is not supported by this cas "
            f"(it reads version {MANIFEST_VERSION}); upgrade cas"
        )
    kind = doc.get("kind")
    _expect(kind in ("state", "files"), f"unknown manifest kind {kind!r}")
    raw_tensors = doc.get("tensors", [])
    _expect(isinstance(raw_tensors, list), "tensors is not a list")
    tensors = tuple(_unpack_tensor(t) for t in raw_tensors)
    meta = doc.get("meta", {})
    _expect(isinstance(meta, dict), "meta is not a map")
    parent = doc.get("parent")
    files: dict[str, FileEntry] = {}
    if kind == "files":
        raw_files = doc.get("files")
        _expect(isinstance(raw_files, dict), "files is not a map")
        for path, entry in raw_files.items():
            _expect(isinstance(path, str), "file path is not a string")
            files[check_relative_path(path)] = _unpack_file(entry, len(tensors))
    created_at = doc.get("created_at", 0.0)
    chunk_size = doc.get("chunk_size", 0)
    _expect(isinstance(created_at, (int, float)), "bad created_at")
    _expect(isinstance(chunk_size, int), "bad chunk_size")
    return Manifest(
        kind=kind,
        tensors=tensors,
        tree=doc.get("tree"),
        files=files,
        meta=meta,
        created_at=float(created_at),
        parent=parse_digest(parent) if parent else None,
        chunk_size=chunk_size,
    )


def check_meta(metadata: dict[str, Any] | None) -> dict[str, Any]:
    """Validate user metadata for a manifest: JSON-like values only (never tensors or objects)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not _is_plain(metadata):
        raise FormatError(
            "metadata must be a dict of JSON-like values: numbers, strings, bools, None, lists, "
            "dicts with str keys (put tensors in the state)"
        )
    return dict(metadata)


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False
