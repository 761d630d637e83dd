"""Manifests: the immutable, versioned msgpack document that names a checkpoint's chunks.

A manifest never contains a pickle. Its schema (``docs/format.md``) is:

    {"format": "cas-manifest", "version": 1, "kind": "state" | "files",
     "created_at": float, "parent": hex | nil, "chunk_size": int, "meta": {str: value},
     "tensors": [tensor entry, ...], "tree": node (state only), "files": {path: file entry}}

Decoding validates every field and bound, so a hostile or corrupt manifest is a FormatError.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack

from cas.digest import Digest, digest_to_bytes, parse_digest
from cas.errors import FormatError
from cas.model.bounded import unpack_bounded
from cas.model.schema import (
    MAX_CHUNK_BYTES,
    MAX_ELEMENT_BYTES,
    MAX_TREE_DEPTH,
    check_stored_meta,
    check_tree,
    expect,
    is_int,
    is_name,
    is_size,
    numpy_itemsize,
    shape_bytes,
)
from cas.names import check_relative_path

MANIFEST_FORMAT = "cas-manifest"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 512 << 20
MAX_MANIFEST_NESTING = 3 * MAX_TREE_DEPTH + 8
"""msgpack levels a manifest may nest: a state tree spends up to three per level (node, items,
pair), under the document's own map and its entry."""

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
    mtime_ns: int | None = None
    """The file's modification time when ingested (None in manifests written before cas kept
    it, and for streamed files): ``cas get`` sets it back."""


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
    message: str = ""
    """What the checkpoint is, in the writer's words (``cas put -m``, ``save(message=)``)."""
    tags: tuple[str, ...] = ()
    """Labels to find it by (``cas put --tag eval``, ``cas ls --tag eval``)."""

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

    def bases_by_chunk(self) -> dict[Digest, set[Digest]]:
        """Each chunk GC keeps for this manifest -> the delta bases it lists for that chunk.

        GC keeps exactly these (invariant 4), so a stored chunk that is a delta against any
        other base breaks once that base is swept. An entry's bases are its chunks' whole
        chains, so a base may itself be a delta against another base of the same entry; file
        chunks are allowed none.
        """
        allowed: dict[Digest, set[Digest]] = {d: set() for d in self.chunk_digests()}
        for tensor in self.tensors:
            bases = set(tensor.base_digests())
            for digest in [*(ref.digest for ref in tensor.chunks), *bases]:
                allowed[digest].update(bases)
        return allowed

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
    # Absent when empty: a manifest without them is byte for byte what older cas wrote.
    if manifest.message:
        doc["message"] = manifest.message
    if manifest.tags:
        doc["tags"] = list(check_tags(manifest.tags))
    if manifest.kind == "state":
        doc["tree"] = manifest.tree
    else:
        for path in manifest.files:  # never store a manifest decode_manifest would refuse
            check_relative_path(path)
        doc["files"] = {path: _pack_file(e) for path, e in sorted(manifest.files.items())}
    try:
        packed: bytes = msgpack.packb(doc, use_bin_type=True, strict_types=False)
        return packed
    except (TypeError, ValueError, OverflowError) as e:
        raise FormatError(f"cannot encode manifest: {e}") from e


def _pack_file(entry: FileEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "size": entry.size,
        "format": entry.format,
        "mode": entry.mode,
        "chunks": _pack_chunks(entry.chunks),
        "regions": [[r.name, r.tensor_index, r.offset] for r in entry.regions],
    }
    if entry.mtime_ns is not None:  # absent, a manifest is byte for byte what older cas wrote
        doc["mtime_ns"] = entry.mtime_ns
    return doc


def _unpack_chunks(raw: Any, total: int, refs: dict[int, ChunkRef]) -> tuple[ChunkRef, ...]:
    expect(isinstance(raw, list), "chunk list is not a list")
    chunks = []
    for item in raw:
        # Identical refs share one list (see share_digest_lists), so one ChunkRef serves them all.
        ref = refs.get(id(item))
        if ref is None:
            expect(isinstance(item, list) and len(item) == 2, "chunk ref is not [digest, size]")
            digest_raw, size = item
            expect(isinstance(digest_raw, bytes), "chunk digest is not bin")
            expect(is_size(size, MAX_CHUNK_BYTES) and size > 0, f"bad chunk size {size!r}")
            ref = refs[id(item)] = ChunkRef(parse_digest(digest_raw), size)
        chunks.append(ref)
    expect(sum(c.size for c in chunks) == total, "chunk sizes do not add up to the size")
    return tuple(chunks)


def _tensor_bytes(kind: Any, dtype: Any, shape: Any) -> int:
    """The bytes a tensor entry's dtype and shape span."""
    expect(kind in TENSOR_KINDS, f"unknown tensor kind {str(kind)[:64]!r}")
    expect(isinstance(dtype, str) and len(dtype) < 64, "bad dtype")
    if kind == "torch":
        expect(dtype in ITEMSIZE, f"unknown torch dtype {dtype!r}")
        return shape_bytes(shape, ITEMSIZE[dtype])
    if kind == "numpy_scalar":
        expect(shape == [], "a numpy scalar has a shape")
    return shape_bytes(shape, numpy_itemsize(dtype))


def _unpack_encoding(encoding: Any) -> dict[str, Any] | None:
    expect(encoding is None or isinstance(encoding, dict), "bad encoding")
    if encoding is None:
        return None
    expect(all(isinstance(k, str) for k in encoding), "bad encoding key")
    expect(is_name(encoding.get("codec", "raw")), "bad encoding codec")
    expect(is_size(encoding.get("depth", 0), MAX_CHUNK_BYTES), "bad encoding depth")
    bases = encoding.get("base", [])
    expect(isinstance(bases, list), "encoding base is not a list")
    expect(all(isinstance(b, (bytes, str)) for b in bases), "bad encoding base digest")
    for base in bases:
        parse_digest(base)
    return dict(encoding)


def _unpack_tensor(raw: Any, refs: dict[int, ChunkRef]) -> TensorEntry:
    expect(isinstance(raw, dict), "tensor entry is not a map")
    kind, dtype, shape, nbytes = (raw.get(k) for k in ("kind", "dtype", "shape", "nbytes"))
    spanned = _tensor_bytes(kind, dtype, shape)
    expect(
        is_int(nbytes) and nbytes == spanned,
        f"nbytes {str(nbytes)[:32]} is not the {spanned} bytes of a {dtype} {shape}",
    )
    encoding = _unpack_encoding(raw.get("encoding"))
    if "inline" in raw:
        inline = raw["inline"]
        expect(
            isinstance(inline, bytes) and len(inline) == nbytes, "inline bytes do not match nbytes"
        )
        return TensorEntry(kind, dtype, tuple(shape), nbytes, (), inline, encoding)
    chunks = _unpack_chunks(raw.get("chunks"), nbytes, refs)
    return TensorEntry(kind, dtype, tuple(shape), nbytes, chunks, None, encoding)


def _unpack_file(raw: Any, tensor_count: int, refs: dict[int, ChunkRef]) -> FileEntry:
    expect(isinstance(raw, dict), "file entry is not a map")
    size, fmt, mode = raw.get("size"), raw.get("format"), raw.get("mode", 0o644)
    expect(is_size(size, MAX_ELEMENT_BYTES), "bad file size")
    expect(is_name(fmt), "bad file format")
    # Permission bits only: cas never stores setuid, setgid or sticky bits (``docs/format.md``),
    # and a store that declares them is not one to restore them from.
    shown = oct(mode) if is_int(mode) else str(mode)[:24]
    expect(is_size(mode, 0o777), f"file mode {shown} is not permission bits (0o777 at most)")
    mtime_ns = raw.get("mtime_ns")
    expect(mtime_ns is None or is_int(mtime_ns), "bad file mtime")
    raw_regions = raw.get("regions", [])
    expect(isinstance(raw_regions, list), "file regions are not a list")
    regions = []
    for item in raw_regions:
        expect(isinstance(item, list) and len(item) == 3, "bad file region")
        name, index, offset = item
        expect(is_name(name) and is_int(index) and 0 <= index < tensor_count, "bad region")
        expect(is_size(offset, size), "bad region offset")
        regions.append(FileRegion(name, index, offset))
    return FileEntry(
        size,
        fmt,
        _unpack_chunks(raw.get("chunks"), size, refs),
        tuple(regions),
        mode,
        mtime_ns,
    )


def decode_manifest(data: bytes) -> Manifest:
    """Parse and validate manifest bytes; an unknown format or version, any field out of its
    bounds (``cas.model.schema``), or bytes that would cost more memory to decode than their size
    allows (``cas.model.bounded``) is a FormatError."""
    expect(len(data) <= MAX_MANIFEST_BYTES, "manifest too large")
    refused = None
    try:
        doc = unpack_bounded(data, "manifest", max_depth=MAX_MANIFEST_NESTING, share=bytes)
    except FormatError as e:
        refused = str(e)
    if refused is not None:
        # Raised afresh, with the bytes let go: a caller that keeps the error to report it
        # (a damaged ref of a listing) must not keep tens of MB of refused manifest alive.
        del data
        raise FormatError(refused)
    expect(isinstance(doc, dict), "top level is not a map")
    if doc.get("format") != MANIFEST_FORMAT:
        raise FormatError("not a cas manifest")
    if doc.get("version") != MANIFEST_VERSION:
        raise FormatError(
            f"manifest version {str(doc.get('version'))[:32]} is not supported by this cas "
            f"(it reads version {MANIFEST_VERSION}); upgrade cas"
        )
    kind = doc.get("kind")
    expect(kind in ("state", "files"), f"unknown manifest kind {str(kind)[:64]!r}")
    raw_tensors = doc.get("tensors", [])
    expect(isinstance(raw_tensors, list), "tensors is not a list")
    refs: dict[int, ChunkRef] = {}
    tensors = tuple(_unpack_tensor(t, refs) for t in raw_tensors)
    meta = doc.get("meta", {})
    check_stored_meta(meta)
    parent = doc.get("parent")
    expect(parent is None or isinstance(parent, (bytes, str)), "bad parent")
    files: dict[str, FileEntry] = {}
    tree = None
    if kind == "files":
        raw_files = doc.get("files")
        expect(isinstance(raw_files, dict), "files is not a map")
        for path, entry in raw_files.items():
            expect(isinstance(path, str), "file path is not a string")
            files[check_relative_path(path)] = _unpack_file(entry, len(tensors), refs)
    else:
        tree = doc.get("tree")
        check_tree(tree, len(tensors), ITEMSIZE)
    created_at = doc.get("created_at", 0.0)
    chunk_size = doc.get("chunk_size", 0)
    expect(isinstance(created_at, float) or is_int(created_at), "bad created_at")
    expect(is_size(chunk_size, MAX_CHUNK_BYTES), "bad chunk_size")
    message = doc.get("message", "")
    expect(isinstance(message, str) and len(message) <= MAX_MESSAGE_LENGTH, "bad message")
    tags = doc.get("tags", [])
    expect(isinstance(tags, list) and len(tags) <= MAX_TAGS, "bad tags")
    expect(all(is_name(t) and _TAG.fullmatch(t) for t in tags), "bad tag")
    return Manifest(
        kind=kind,
        tensors=tensors,
        tree=tree,
        files=files,
        meta=meta,
        created_at=float(created_at),
        parent=parse_digest(parent) if parent else None,
        chunk_size=chunk_size,
        message=message,
        tags=tuple(tags),
    )


MAX_MESSAGE_LENGTH = 65536
MAX_TAGS = 256
_TAG = re.compile(r"[A-Za-z0-9_.:+@-]{1,128}")
"""A tag is one word of letters, digits and ``_.:+@-`` (no spaces, no slashes, no globs)."""


def check_tags(tags: Iterable[str]) -> tuple[str, ...]:
    """Validate and de-duplicate tags (order kept); a bad one is a FormatError naming it."""
    out: list[str] = []
    for tag in tags:
        if not isinstance(tag, str) or not _TAG.fullmatch(tag):
            raise FormatError(
                f"bad tag {str(tag)[:64]!r}: one word of letters, digits and _.:+@- "
                "(at most 128 characters)"
            )
        if tag not in out:
            out.append(tag)
    if len(out) > MAX_TAGS:
        raise FormatError(f"at most {MAX_TAGS} tags on a checkpoint")
    return tuple(out)


def check_message(message: str) -> str:
    """Validate a checkpoint's message (a str of at most 64 KiB characters)."""
    if not isinstance(message, str) or len(message) > MAX_MESSAGE_LENGTH:
        raise FormatError(f"a message is a str of at most {MAX_MESSAGE_LENGTH} characters")
    return message


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
