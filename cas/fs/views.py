"""Checkpoints as files: the files a manifest shows, and verified random-access reads of them.

A ``kind="files"`` manifest shows its ingested files as they were. A ``kind="state"`` manifest
(``Repository.save``) shows, per top-level entry, a synthesized ``<key>.safetensors`` (if the
entry holds tensors; named by the dotted path below the entry: ``fc.weight``,
``state.0.exp_avg``) and a ``<key>.pt`` that ``torch.load`` reads back as the entry itself
(``cas.fs.torch_view``), plus a ``manifest.json`` describing everything, plain values included. A
state whose top level is not a dict shows ``state.safetensors`` and ``state.pt``. Synthesized
files are a pure function of the manifest: headers are computed from dtypes and shapes, and every
tensor byte range maps onto that tensor's chunks, so nothing is read until a range is asked for
and the bytes never vary.

Every file is a list of extents: chunks (fetched and verified on demand, kept in a small LRU of
decoded chunks) and literal bytes (synthesized headers, inline tensors).
"""

from __future__ import annotations

import bisect
import errno
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from fsspec.spec import AbstractBufferedFile

from cas.digest import Digest
from cas.errors import IntegrityError
from cas.model.manifest import FileEntry, Manifest, TensorEntry
from cas.model.state import iter_tensor_paths
from cas.objects.chunkio import wait_all

if TYPE_CHECKING:
    from cas.fs.filesystem import CASFileSystem
    from cas.repo.repository import Repository

MANIFEST_JSON = "manifest.json"
STATE_STEM = "state"
_SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "complex64": "C64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0", "float4_e2m1fn_x2": "F4",
}  # fmt: skip
_NUMPY_KINDS = {"f": "F", "i": "I", "u": "U", "c": "C"}


@dataclass(frozen=True)
class Extent:
    """A run of a file's bytes: one chunk (``digest``) or literal ``data``."""

    offset: int
    size: int
    digest: Digest | None = None
    data: bytes | None = None


@dataclass(frozen=True)
class FileRecord:
    """An ingested file as a manifest holds it: its entry and the tensors its regions name."""

    entry: FileEntry
    tensors: tuple[TensorEntry, ...] = ()


@dataclass(frozen=True)
class FileView:
    """One file of a checkpoint: its size and extents; ``record`` is set for ingested files."""

    size: int
    extents: tuple[Extent, ...]
    mode: int = 0o644
    record: FileRecord | None = None
    starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "starts", tuple(e.offset for e in self.extents))

    @property
    def synthesized(self) -> bool:
        """Whether the bytes are computed from a saved state rather than ingested."""
        return self.record is None

    def touched(self, start: int, end: int) -> Iterator[Extent]:
        """The extents overlapping ``[start, end)``."""
        index = max(0, bisect.bisect_right(self.starts, start) - 1)
        while index < len(self.extents) and self.extents[index].offset < end:
            extent = self.extents[index]
            if extent.offset + extent.size > start:
                yield extent
            index += 1


def chunk_extents(chunks: Any, offset: int) -> list[Extent]:
    """One extent per chunk, laid end to end from ``offset``."""
    out = []
    for ref in chunks:
        out.append(Extent(offset, ref.size, digest=ref.digest))
        offset += ref.size
    return out


def file_records(manifest: Manifest) -> dict[str, FileRecord]:
    """The files of a ``kind="files"`` manifest, each with the tensors its regions name."""
    out = {}
    for path, entry in manifest.files.items():
        tensors = tuple(manifest.tensors[r.tensor_index] for r in entry.regions)
        out[path] = FileRecord(entry, tensors)
    return out


def manifest_views(manifest: Manifest, digest: Digest) -> dict[str, FileView]:
    """Every file a manifest shows, by path relative to its ref."""
    if manifest.kind == "files":
        return {
            path: FileView(
                rec.entry.size, tuple(chunk_extents(rec.entry.chunks, 0)), rec.entry.mode, rec
            )
            for path, rec in file_records(manifest).items()
        }
    return _state_views(manifest, digest)


@dataclass
class _Placed:
    file: str
    name: str
    path: str
    tensor: TensorEntry


def _groups(tree: Any) -> list[tuple[str, str, Any]]:
    """``(file stem, path prefix, subtree)`` per top-level entry, or one group for the whole tree."""
    if isinstance(tree, dict) and tree.get("~") == "dict":
        return [(quote(str(key), safe=""), str(key), node) for key, node in tree["items"]]
    return [(STATE_STEM, "", tree)]


def _state_views(manifest: Manifest, digest: Digest) -> dict[str, FileView]:
    from cas.fs.torch_view import torch_view  # it builds on this module

    views: dict[str, FileView] = {}
    placed: list[_Placed] = []
    skipped: list[str] = []
    stems: set[str] = set()
    for stem, prefix, node in _groups(manifest.tree):
        paths = [
            (f"{prefix}.{sub}" if prefix and sub else prefix or sub, sub or prefix or "tensor", i)
            for sub, i in iter_tensor_paths(node)
        ]
        if stem in stems:  # keys 1 and "1" name the same files: the first one shows
            skipped.extend(full for full, _, _ in paths)
            continue
        stems.add(stem)
        file_name = stem + ".safetensors"
        pt_view = torch_view(node, manifest.tensors, digest)
        if pt_view is not None:
            views[stem + ".pt"] = pt_view
        members: list[tuple[str, TensorEntry]] = []
        names = {"__metadata__"}  # the header's own key
        for full, name, index in paths:
            tensor = manifest.tensors[index]
            # A dtype safetensors lacks, or a name already taken ({"a.b": x, "a": {"b": y}}).
            if safetensors_dtype(tensor) is None or name in names:
                skipped.append(full)
                continue
            names.add(name)
            members.append((name, tensor))
            placed.append(_Placed(file_name, name, full, tensor))
        if members:
            views[file_name] = _safetensors_view(members, digest)
    document = _manifest_document(manifest, digest, placed, skipped)
    views[MANIFEST_JSON] = _literal_view(document, 0o444)
    return views


def safetensors_dtype(tensor: TensorEntry) -> str | None:
    """The safetensors dtype code of a tensor entry, or None if safetensors cannot hold it."""
    if tensor.kind == "torch":
        return _SAFETENSORS_DTYPES.get(tensor.dtype)
    import numpy as np

    try:
        dtype = np.dtype(tensor.dtype)
    except TypeError:
        return None
    if dtype.kind == "b":
        return "BOOL"
    letter = _NUMPY_KINDS.get(dtype.kind)
    code = f"{letter}{dtype.itemsize * 8}" if letter else None
    return code if code in set(_SAFETENSORS_DTYPES.values()) else None


def _safetensors_shape(tensor: TensorEntry, code: str) -> list[int]:
    if code == "F4":  # torch packs two 4-bit values per element; safetensors counts values
        return [*tensor.shape[:-1], tensor.shape[-1] * 2] if tensor.shape else [2]
    return list(tensor.shape)


def _safetensors_view(members: list[tuple[str, TensorEntry]], digest: Digest) -> FileView:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "cas.model.manifest": digest}}
    offset = 0
    for name, tensor in members:
        code = safetensors_dtype(tensor)
        assert code is not None
        shape = _safetensors_shape(tensor, code)
        header[name] = {
            "dtype": code,
            "shape": shape,
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
    head = len(raw).to_bytes(8, "little") + raw
    extents = [Extent(0, len(head), data=head)]
    position = len(head)
    for _, tensor in members:
        if tensor.inline is not None:
            if tensor.nbytes:
                extents.append(Extent(position, tensor.nbytes, data=tensor.inline))
        else:
            extents.extend(chunk_extents(tensor.chunks, position))
        position += tensor.nbytes
    return FileView(position, tuple(extents), 0o444)


def _literal_view(data: bytes, mode: int) -> FileView:
    return FileView(len(data), (Extent(0, len(data), data=data),) if data else (), mode)


def _manifest_document(
    manifest: Manifest, digest: Digest, placed: list[_Placed], skipped: list[str]
) -> bytes:
    doc = {
        "format": "cas-fs-manifest",
        "version": 1,
        "manifest": digest,
        "kind": manifest.kind,
        "created_at": manifest.created_at,
        "parent": manifest.parent,
        "chunk_size": manifest.chunk_size,
        "meta": manifest.meta,
        "values": dict(_plain_leaves(manifest.tree, "")),
        "tensors": [
            {
                "path": p.path,
                "file": p.file,
                "name": p.name,
                "kind": p.tensor.kind,
                "dtype": p.tensor.dtype,
                "shape": list(p.tensor.shape),
                "nbytes": p.tensor.nbytes,
                "chunks": [c.digest for c in p.tensor.chunks],
            }
            for p in placed
        ],
        "not_in_safetensors": skipped,
    }
    return (json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n").encode()


def _plain_leaves(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        tag = node.get("~")
        if tag == "tensor":
            return
        if tag in ("dict", "list", "tuple"):
            items = node["items"] if tag == "dict" else list(enumerate(node["items"]))
            for key, value in items:
                yield from _plain_leaves(value, f"{path}.{key}" if path else str(key))
            return
        if tag == "int":
            yield path, int(node["v"])
        elif tag == "dtype":
            yield path, f"torch.{node['v']}"
        elif tag == "device":
            yield path, str(node["v"])
        return
    if isinstance(node, bytes):
        yield path, {"bytes_hex": node.hex()}
    elif isinstance(node, float) and not math.isfinite(node):
        yield path, repr(node)
    else:
        yield path, node


class ChunkCache:
    """A small LRU of verified chunks, or of a chunk's tail, bounded in bytes; safe across threads.

    A tail is what a sequential reader has not consumed yet of a chunk its last read ended
    inside. Evicted buffers are reused for the next fetch (a fresh multi-MiB buffer costs page
    faults), which is safe because every copy out of the cache happens under its lock.
    """

    def __init__(self, capacity: int, spare_buffers: int = 8) -> None:
        self.capacity = capacity
        self._items: OrderedDict[Digest, tuple[int, memoryview]] = OrderedDict()
        """digest -> (offset in the chunk of the first byte held, bytes held)"""
        self._spare: list[bytearray] = []
        self._spare_max = spare_buffers
        self._bytes = 0
        self._lock = threading.Lock()

    def copy_into(self, digest: Digest, inner: slice, dst: memoryview) -> bool:
        """Copy ``chunk[inner]`` into ``dst`` if the cache holds those bytes; False if not."""
        with self._lock:
            item = self._items.get(digest)
            if item is None:
                return False
            if not _covers(item, inner):
                return False
            first, data = item
            self._items.move_to_end(digest)
            dst[:] = data[inner.start - first : inner.stop - first]
            return True

    def holds(self, digest: Digest, inner: slice) -> bool:
        """Whether the cache holds bytes ``inner`` of the chunk (they may be evicted by the time
        they are copied; ``copy_into`` says)."""
        with self._lock:
            item = self._items.get(digest)
            return item is not None and _covers(item, inner)

    def contains(self, digest: Digest) -> bool:
        """Whether the whole chunk is cached."""
        with self._lock:
            item = self._items.get(digest)
            return item is not None and item[0] == 0

    def buffer(self, size: int) -> memoryview:
        """A writable buffer of ``size`` bytes to fetch a chunk into, reused when possible."""
        with self._lock:
            for i, spare in enumerate(self._spare):
                if len(spare) >= size:
                    return memoryview(self._spare.pop(i))[:size]
        return memoryview(bytearray(size))

    def put(self, digest: Digest, data: memoryview, first: int = 0) -> None:
        """Remember verified bytes of a chunk from offset ``first`` (a buffer from ``buffer``),
        evicting the least recently used; a whole chunk replaces a tail of it."""
        if len(data) > self.capacity:
            return
        with self._lock:
            held = self._items.get(digest)
            if held is not None:
                if held[0] <= first:
                    return
                self._drop(digest)
            self._items[digest] = (first, data)
            self._bytes += len(data)
            while self._bytes > self.capacity:
                self._drop(next(iter(self._items)))

    def _drop(self, digest: Digest) -> None:
        _, old = self._items.pop(digest)
        self._bytes -= len(old)
        if len(self._spare) < self._spare_max and isinstance(old.obj, bytearray):
            self._spare.append(old.obj)
        old.release()


def _covers(item: tuple[int, memoryview], inner: slice) -> bool:
    """Whether a cache item ``(first, data)`` holds bytes ``inner`` of its chunk."""
    first, data = item
    return bool(first <= inner.start and inner.stop <= first + len(data))


class ViewReader:
    """Reads byte ranges of file views, touching only the chunks a range overlaps.

    A chunk the range covers whole is read and verified straight into the caller's buffer; a
    chunk it covers in part is fetched whole, verified, and kept in the LRU for the next read.
    """

    def __init__(self, repo: Repository, cache: ChunkCache) -> None:
        self.repo = repo
        self.cache = cache
        self._inflight: dict[Digest, Future[None]] = {}
        self._lock = threading.Lock()

    def fetch(self, digest: Digest, size: int) -> None:
        """Make sure a verified copy of the chunk is in the cache."""
        buffer = self.cache.buffer(size)
        self.repo.objects.read_chunk_into(digest, buffer)
        self.cache.put(digest, buffer)

    def prefetch(self, view: FileView, start: int, end: int) -> None:
        """Start fetching the chunks of ``[start, end)`` into the cache without waiting."""
        for extent in view.touched(start, min(end, view.size)):
            digest = extent.digest
            if digest is None:
                continue
            with self._lock:
                if digest in self._inflight or self.cache.contains(digest):
                    continue
                self._inflight[digest] = self.repo.io.pool.submit(
                    self._fetch_tracked, digest, extent.size
                )

    def _fetch_tracked(self, digest: Digest, size: int) -> None:
        try:
            self.fetch(digest, size)
        finally:
            with self._lock:
                self._inflight.pop(digest, None)

    def read_into(self, view: FileView, start: int, out: memoryview, readahead: int = 0) -> int:
        """Fill ``out`` from ``start``; return the bytes read (fewer only at the end of file).

        ``readahead`` bytes past the range are fetched into the cache in the background, so a
        sequential reader finds its next chunks verified already.
        """
        end = min(view.size, start + len(out))
        if start >= end:
            return 0
        work: list[Callable[[], None]] = []
        cached: list[tuple[Extent, slice, memoryview]] = []
        for extent in view.touched(start, end):
            lo, hi = max(start, extent.offset), min(end, extent.offset + extent.size)
            dst = out[lo - start : hi - start]
            inner = slice(lo - extent.offset, hi - extent.offset)
            if extent.data is not None:
                dst[:] = extent.data[inner]
                continue
            assert extent.digest is not None
            if self.cache.holds(extent.digest, inner):
                cached.append((extent, inner, dst))
                continue
            with self._lock:
                pending = self._inflight.get(extent.digest)
            if pending is not None:
                work.append(_after(self, pending, extent, inner, dst))
            elif hi - lo == extent.size:
                work.append(_whole(self.repo, extent.digest, dst))
            elif lo == extent.offset:
                work.append(_head(self, extent.digest, dst, extent.size))
            else:
                work.append(_part(self, extent, inner, dst))
        if readahead:
            self.prefetch(view, end, end + readahead)
        # Fetches beyond the first go to the pool; this thread copies out of the cache and runs
        # the first fetch meanwhile, so a sequential read keeps both cores busy.
        futures: list[Future[None]] = [self.repo.io.pool.submit(task) for task in work[1:]]
        try:
            for extent, inner, dst in cached:
                _copy_out(self, extent, inner, dst)
            if work:
                work[0]()
        finally:
            wait_all(futures)
        return end - start

    def read(self, view: FileView, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the view (clamped to its size)."""
        end = min(end, view.size)
        if start >= end:
            return b""
        buffer = bytearray(end - start)
        self.read_into(view, start, memoryview(buffer))
        return bytes(buffer)


def _whole(repo: Repository, digest: Digest, dst: memoryview) -> Callable[[], None]:
    return lambda: repo.objects.read_chunk_into(digest, dst)


def _head(reader: ViewReader, digest: Digest, dst: memoryview, size: int) -> Callable[[], None]:
    """Read a chunk whose head the range covers: the head into the caller's buffer, the tail into
    the cache for the next sequential read, both verified together and copied once."""

    def run() -> None:
        tail = reader.cache.buffer(size - len(dst))
        reader.repo.objects.read_chunk_parts(digest, [dst, tail])
        reader.cache.put(digest, tail, len(dst))

    return run


def _part(reader: ViewReader, extent: Extent, inner: slice, dst: memoryview) -> Callable[[], None]:
    def run() -> None:
        assert extent.digest is not None
        reader.fetch(extent.digest, extent.size)
        _copy_out(reader, extent, inner, dst)

    return run


def _after(
    reader: ViewReader, pending: Future[None], extent: Extent, inner: slice, dst: memoryview
) -> Callable[[], None]:
    def run() -> None:
        pending.result()  # a failed prefetch fails the read that needs the chunk
        _copy_out(reader, extent, inner, dst)

    return run


def _copy_out(reader: ViewReader, extent: Extent, inner: slice, dst: memoryview) -> None:
    assert extent.digest is not None
    if not reader.cache.copy_into(extent.digest, inner, dst):  # evicted already: a tiny cache
        whole = memoryview(bytearray(extent.size))
        reader.repo.objects.read_chunk_into(extent.digest, whole)
        dst[:] = whole[inner]


class CorruptChunkError(IntegrityError, OSError):
    """A chunk failed verification while a file was read: an I/O error, never wrong bytes."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)

    def __str__(self) -> str:
        return str(self.args[1])


class CASReadFile(AbstractBufferedFile):  # type: ignore[misc]
    """A file opened for reading: random access, each read touching only the chunks it needs."""

    def __init__(
        self,
        fs: CASFileSystem,
        path: str,
        view: FileView,
        info: dict[str, Any],
        block_size: int | None,
    ) -> None:
        self.view = view
        self._last_end = -1
        super().__init__(
            fs,
            path,
            mode="rb",
            block_size=block_size or fs.blocksize,
            cache_type="none",
            size=view.size,
        )
        self.details = info

    def _fetch_range(self, start: int, end: int) -> bytes:
        end = min(end, self.view.size)
        if start >= end:
            return b""
        buffer = bytearray(end - start)
        self.fs._read_view(
            self.view, start, memoryview(buffer), self._readahead(start, end - start)
        )
        return bytes(buffer)

    def readinto(self, b: Any) -> int:
        """Read straight into ``b`` (no intermediate copy for whole chunks)."""
        if self.closed:
            raise ValueError("I/O operation on closed file.")
        out = memoryview(b).cast("B")
        count: int = self.fs._read_view(
            self.view, self.loc, out, self._readahead(self.loc, len(out))
        )
        self.loc += count
        return count

    def _readahead(self, start: int, length: int) -> int:
        """Read ahead while reads are sequential and smaller than a chunk.

        Reads of a chunk or more already fetch their chunks in parallel straight into the
        caller's buffer; staging them through the cache would only add a copy.
        """
        sequential = start == self._last_end
        self._last_end = start + length
        chunk: int = self.fs.repo.config.chunk_size
        return 2 * chunk if sequential and start and length < chunk else 0
