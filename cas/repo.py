"""Repository: the one facade over a store: save/load state, put/get files, refs, show and diff."""

from __future__ import annotations

import fnmatch
import mmap
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from cas.blobstore import BlobStore, LocalBlobStore, ReadOnlyBlobStore, open_blobstore
from cas.chunking import Cut, fixed_cuts, layout_cuts
from cas.chunkio import ChunkIO, Progress, WriteStats, wait_all
from cas.codecs import Codec, EncodeHints, codec_by_name
from cas.config import StoreConfig, read_config, write_config
from cas.digest import Digest, digest_of, parse_digest
from cas.errors import FormatError, InvalidName, NotFound
from cas.manifest import (
    ChunkRef,
    FileEntry,
    FileRegion,
    Manifest,
    TensorEntry,
    decode_manifest,
    encode_manifest,
)
from cas.names import RefName, parse_ref_name
from cas.objects import HEADER_SIZE, ObjectStore, chunk_key
from cas.refs import RefEvent, RefRecord, RefStore
from cas.state import TensorSource, decode_state, encode_state, iter_tensor_paths, tensor_from_bytes

STORE_ENV = "CAS_STORE"
_ANY: Any = ...


def default_store_url() -> str:
    """``$CAS_STORE``, else ``$XDG_DATA_HOME/cas/store`` (``~/.local/share/cas/store``)."""
    env = os.environ.get(STORE_ENV)
    if env:
        return env
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return os.path.join(data_home, "cas", "store")


def open(
    url: str | os.PathLike[str] | None = None,
    *,
    create: bool = True,
    readonly: bool = False,
    config: StoreConfig | None = None,
    clock: Callable[[], float] = time.time,
    **options: Any,
) -> Repository:
    """Open (and by default create) the store at ``url``: a path, ``file://``, ``s3://`` or fsspec.

    With no URL: ``$CAS_STORE``, else ``~/.local/share/cas/store``. A location that holds a store of
    another format version is a clear ``FormatError``; a missing store with ``create=False`` is
    ``NotFound``.
    """
    blobs = open_blobstore(url if url is not None else default_store_url(), **options)
    existing = read_config(blobs)
    if existing is None:
        if readonly or not create:
            raise NotFound(f"no cas store at {blobs.url} (create one with `cas init`)")
        existing = replace(config or StoreConfig(), created_at=clock())
        write_config(blobs, existing)
    if readonly:
        blobs = ReadOnlyBlobStore(blobs)
    return Repository(blobs, existing, clock=clock)


@dataclass(frozen=True)
class TensorInfo:
    """One row of ``show``: a tensor's path, dtype, shape and size, read from the manifest only."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: int


@dataclass(frozen=True)
class DiffEntry:
    """One path that differs between two checkpoints."""

    path: str
    change: str
    """``added``, ``removed``, ``changed`` (bytes), ``retyped`` (dtype or shape)."""
    nbytes: int


class Repository:
    """A cas store. Write order is always chunks, then manifest, then ref (invariant 1)."""

    def __init__(
        self,
        blobs: BlobStore,
        config: StoreConfig,
        *,
        clock: Callable[[], float] = time.time,
        workers: int = 8,
    ) -> None:
        self.blobs = blobs
        self.config = config
        self.clock = clock
        self.objects = ObjectStore(blobs, max_object_size=max(config.chunk_size, 64 << 20) + 4096)
        self.refs_store = RefStore(blobs, clock)
        self.io = ChunkIO(self.objects, workers)
        self.last_write: WriteStats = WriteStats()

    @property
    def url(self) -> str:
        """Where the store lives."""
        return self.blobs.url

    def close(self) -> None:
        """Release threads and connections."""
        self.io.close()
        self.blobs.close()

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def codec(self, name: str | None = None) -> Codec:
        """The codec to write with: ``name``, else the store's default."""
        return codec_by_name(name or self.config.codec)

    # -- writing -------------------------------------------------------------------------------

    def save(
        self,
        state: Any,
        ref: str,
        metadata: dict[str, Any] | None = None,
        *,
        parent: str | None = None,
        expected: Digest | Any | None = _ANY,
        codec: str | None = None,
        message: str = "",
        progress: Progress | None = None,
    ) -> Digest:
        """Store a nested training state under ``ref``; return the manifest digest.

        ``parent`` names the previous checkpoint (default: the ref's current target); ``expected``
        makes the ref update a compare-and-swap against that digest (``None``: must not exist).
        """
        name = parse_ref_name(ref)
        tree, sources = encode_state(state)
        stats = WriteStats()
        entries = self._write_tensors(sources, self.codec(codec), stats, progress)
        manifest = Manifest(
            kind="state",
            tensors=tuple(entries),
            tree=tree,
            meta=_clean_meta(metadata),
            created_at=self.clock(),
            parent=self._parent_digest(name, parent),
            chunk_size=self.config.chunk_size,
        )
        return self.commit(
            manifest, name, expected=expected, op="save", message=message, stats=stats
        )

    def _parent_digest(self, name: RefName, parent: str | None) -> Digest | None:
        if parent is not None:
            return self.resolve(parent)
        record = self.refs_store.try_get(name)
        return record.target if record else None

    def write_tensors(
        self, sources: Sequence[TensorSource], *, codec: str | None = None
    ) -> tuple[list[TensorEntry], WriteStats]:
        """Store tensors' chunks only (no manifest, no ref) and return their entries.

        The first half of a save, for writers that assemble their own manifest (a distributed
        checkpoint commits one manifest for every rank's tensors). Call ``commit`` afterwards.
        """
        stats = WriteStats()
        return self._write_tensors(sources, self.codec(codec), stats, None), stats

    def _write_tensors(
        self,
        sources: Sequence[TensorSource],
        codec: Codec,
        stats: WriteStats,
        progress: Progress | None,
    ) -> list[TensorEntry]:
        pending: list[tuple[TensorSource, list[Future[ChunkRef]]]] = []
        for source in sources:
            if source.nbytes <= self.config.inline_max:
                pending.append((source, []))
                continue
            cuts = fixed_cuts(source.nbytes, self.config.chunk_size)
            hints = EncodeHints(elem_size=source.elem_size, level=self.config.compression_level)
            pending.append(
                (source, self.io.write_cuts(source.data, cuts, codec, hints, stats, progress))
            )
        wait_all(f for _, futures in pending for f in futures)
        entries = []
        for source, futures in pending:
            if futures:
                chunks = tuple(f.result() for f in futures)
                entries.append(
                    TensorEntry(source.kind, source.dtype, source.shape, source.nbytes, chunks)
                )
            else:
                stats.logical_bytes += source.nbytes
                entries.append(
                    TensorEntry(
                        source.kind,
                        source.dtype,
                        source.shape,
                        source.nbytes,
                        (),
                        bytes(source.data),
                    )
                )
        return entries

    def commit(
        self,
        manifest: Manifest,
        ref: str,
        *,
        expected: Digest | Any | None = _ANY,
        op: str = "commit",
        message: str = "",
        stats: WriteStats | None = None,
    ) -> Digest:
        """Make chunks durable, store the manifest, then move the ref (invariant 1)."""
        self.blobs.sync()
        digest = self.objects.put_manifest(encode_manifest(manifest), codec_by_name("zstd"))
        self.blobs.sync()
        self.refs_store.set(ref, digest, expected=expected, op=op, message=message)
        self.last_write = stats or WriteStats()
        return digest

    def put_path(
        self,
        path: str | os.PathLike[str],
        ref: str,
        metadata: dict[str, Any] | None = None,
        *,
        allow_opaque_pickles: bool = False,
        expected: Digest | Any | None = _ANY,
        codec: str | None = None,
        progress: Progress | None = None,
    ) -> Digest:
        """Ingest a file or a directory (e.g. an HF ``checkpoint-N/``) byte-for-byte under ``ref``."""
        from cas.formats import inspect_file
        from cas.formats.hfdir import inspect_directory

        name = parse_ref_name(ref)
        source = Path(path)
        if source.is_dir():
            layouts = inspect_directory(source, allow_opaque_pickles=allow_opaque_pickles)
            files = [(rel, source / rel, layout) for rel, layout in layouts]
            kind = "dir"
        elif source.is_file():
            layout = inspect_file(source, allow_opaque_pickles=allow_opaque_pickles)
            files = [(source.name, source, layout)]
            kind = "file"
        else:
            raise NotFound(f"no such file or directory: {source}")
        stats = WriteStats()
        tensors: list[TensorEntry] = []
        entries: dict[str, FileEntry] = {}
        for rel, file_path, layout in files:
            entries[rel] = self._write_file(
                file_path, layout, self.codec(codec), tensors, stats, progress
            )
        meta = {"source": kind, "name": source.name, **_clean_meta(metadata)}
        manifest = Manifest(
            kind="files",
            tensors=tuple(tensors),
            files=entries,
            meta=meta,
            created_at=self.clock(),
            parent=self._parent_digest(name, None),
            chunk_size=self.config.chunk_size,
        )
        return self.commit(
            manifest, name, expected=expected, op="put", message=str(source), stats=stats
        )

    def _write_file(
        self,
        path: Path,
        layout: Any,
        codec: Codec,
        tensors: list[TensorEntry],
        stats: WriteStats,
        progress: Progress | None,
    ) -> FileEntry:
        regions = [r for r in layout.regions if r.nbytes > self.config.inline_max]
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != layout.size:
                raise FormatError(f"{path} changed while it was being read")
            mode = os.fstat(f.fileno()).st_mode & 0o777
            if size == 0:
                return FileEntry(0, layout.format, (), (), mode)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    cut_list: list[tuple[Cut, int | None]] = list(
                        layout_cuts(
                            view,
                            [(r.offset, r.nbytes) for r in regions],
                            self.config.chunk_size,
                            self.config.cdc_avg_size,
                        )
                    )
                    hints = [
                        EncodeHints(
                            elem_size=_itemsize(regions[i].dtype) if i is not None else 1,
                            level=self.config.compression_level,
                        )
                        for _, i in cut_list
                    ]
                    futures = self.io.write_cuts(
                        view, [c for c, _ in cut_list], codec, hints, stats, progress
                    )
                    wait_all(futures)
                    chunks = [f.result() for f in futures]
                finally:
                    view.release()
        file_regions = []
        for index, region in enumerate(regions):
            region_chunks = tuple(c for c, (_, i) in zip(chunks, cut_list, strict=False) if i == index)
            file_regions.append(FileRegion(region.name, len(tensors), region.offset))
            tensors.append(
                TensorEntry(
                    "torch", region.dtype, tuple(region.shape), region.nbytes, region_chunks
                )
            )
        return FileEntry(size, layout.format, tuple(chunks), tuple(file_regions), mode)

    # -- reading -------------------------------------------------------------------------------

    def resolve(self, spec: str) -> Digest:
        """A ref name, ``name~N`` (N versions back), or a manifest digest -> manifest digest."""
        if len(spec) == 64 and all(c in "0123456789abcdef" for c in spec):
            return parse_digest(spec)
        name, _, back = spec.partition("~")
        record = self.refs_store.get(name)
        if not back:
            return record.target
        if not back.isdigit():
            raise InvalidName(f"bad ref spec {spec!r}: use NAME~N with N a number")
        steps = int(back)
        if steps >= len(record.history):
            raise NotFound(f"ref {name!r} has only {len(record.history)} versions in its history")
        return record.history[-1 - steps].target

    def manifest(self, spec: str) -> Manifest:
        """The decoded, verified manifest a ref (or digest) names."""
        return decode_manifest(self.objects.get_manifest(self.resolve(spec)))

    def load(
        self,
        ref: str,
        map_location: str | torch.device | None = None,
        keys: str | Sequence[str] | None = None,
        *,
        mmap: bool = False,
        progress: Progress | None = None,
    ) -> Any:
        """Load what ``ref`` names: the saved state, or ``{path: tensors-or-bytes}`` for files.

        ``keys`` are glob patterns over dotted paths (``model.*``, ``optimizer.state.*.exp_avg``);
        only the chunks of selected tensors are read. ``mmap=True`` maps single-chunk raw tensors
        of a local store from their files (copy-on-write) instead of reading them.
        """
        manifest = self.manifest(ref)
        patterns = [keys] if isinstance(keys, str) else list(keys or [])
        select = (
            (lambda p: any(fnmatch.fnmatchcase(p, pat) for pat in patterns)) if patterns else None
        )
        if manifest.kind == "files":
            return self._load_files(manifest, select, map_location, progress)
        wanted = {i for p, i in iter_tensor_paths(manifest.tree) if select is None or select(p)}
        tensors = self._materialize(manifest, sorted(wanted), map_location, mmap, progress)
        return decode_state(manifest.tree, tensors.__getitem__, select)

    def read_tensors(
        self,
        manifest: Manifest,
        indices: Iterable[int],
        map_location: str | torch.device | None = None,
    ) -> dict[int, Any]:
        """Verified values of ``manifest.tensors[i]`` for each index, read in parallel."""
        return self._materialize(manifest, indices, map_location, False, None)

    def _materialize(
        self,
        manifest: Manifest,
        indices: Iterable[int],
        map_location: str | torch.device | None,
        use_mmap: bool,
        progress: Progress | None,
    ) -> dict[int, Any]:
        buffers: dict[int, torch.Tensor] = {}
        futures: list[Future[None]] = []
        for index in indices:
            entry = manifest.tensors[index]
            if entry.inline is not None:
                buffers[index] = (
                    torch.frombuffer(bytearray(entry.inline), dtype=torch.uint8)
                    if entry.nbytes
                    else torch.empty(0, dtype=torch.uint8)
                )
                continue
            mapped = self._mmap_chunk(entry) if use_mmap else None
            if mapped is not None:
                buffers[index] = mapped
                continue
            buffer = torch.empty(entry.nbytes, dtype=torch.uint8)
            buffers[index] = buffer
            if entry.nbytes:
                futures.extend(self.io.read_into(entry.chunks, _byte_view(buffer), progress))
        wait_all(futures)
        out: dict[int, Any] = {}
        for index, buffer in buffers.items():
            entry = manifest.tensors[index]
            value = tensor_from_bytes(entry.kind, entry.dtype, entry.shape, buffer)
            if map_location is not None and isinstance(value, torch.Tensor):
                value = value.to(map_location)
            out[index] = value
        return out

    def _mmap_chunk(self, entry: TensorEntry) -> torch.Tensor | None:
        blobs = self.blobs.inner if isinstance(self.blobs, ReadOnlyBlobStore) else self.blobs
        if not isinstance(blobs, LocalBlobStore) or len(entry.chunks) != 1 or entry.encoding:
            return None
        digest = entry.chunks[0].digest
        path = blobs.path_of(chunk_key(digest))
        try:
            with path.open("rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except FileNotFoundError as e:
            raise NotFound(f"chunk {digest} is missing from the store") from e
        if len(mapped) != HEADER_SIZE + entry.nbytes or mapped[5] != 0:
            mapped.close()
            return None  # not a raw chunk: read it the ordinary way
        from cas.errors import IntegrityError

        if digest_of(memoryview(mapped)[HEADER_SIZE:]) != digest:
            raise IntegrityError(f"chunk {digest} is corrupt: its bytes hash to something else")
        return torch.frombuffer(mapped, dtype=torch.uint8, offset=HEADER_SIZE, count=entry.nbytes)

    def _load_files(
        self,
        manifest: Manifest,
        select: Callable[[str], bool] | None,
        map_location: str | torch.device | None,
        progress: Progress | None,
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for path, entry in manifest.files.items():
            if entry.regions:
                names = {r.name: r.tensor_index for r in entry.regions}
                chosen = {
                    n: i
                    for n, i in names.items()
                    if select is None or select(f"{path}.{n}") or select(path)
                }
                if chosen:
                    values = self._materialize(
                        manifest, chosen.values(), map_location, False, progress
                    )
                    out[path] = {n: values[i] for n, i in chosen.items()}
            elif select is None or select(path):
                out[path] = b"".join(bytes(c) for c in self.io.iter_chunks(entry.chunks))
        return out

    def get_path(
        self,
        ref: str,
        dest: str | os.PathLike[str],
        *,
        fmt: str | None = None,
        sha256: bool = False,
        overwrite: bool = False,
        progress: Progress | None = None,
    ) -> list[Path]:
        """Write what ``ref`` names to ``dest``; return the files written (sidecars included)."""
        from cas.export import export_files, export_state

        manifest = self.manifest(ref)
        if manifest.kind == "files":
            if fmt is not None:
                raise FormatError(
                    f"{ref} holds ingested files; they are written back as they were (drop --format)"
                )
            return export_files(
                self, manifest, Path(dest), sha256=sha256, overwrite=overwrite, progress=progress
            )
        state = self.load(ref, progress=progress)
        return export_state(state, Path(dest), fmt or "pt", sha256=sha256, overwrite=overwrite)

    # -- refs ------------------------------------------------------------------------------------

    def refs(self, prefix: str = "") -> list[RefRecord]:
        """Refs selected by prefix, exact name or glob (``runs/r1/**``), sorted by name."""
        records = []
        for name in self.refs_store.names(prefix):
            record = self.refs_store.try_get(name)
            if record is not None:
                records.append(record)
        return records

    def log(self, ref: str) -> list[RefEvent]:
        """The ref's history, newest first."""
        return list(reversed(self.refs_store.get(ref).history))

    def cp(
        self, src: str, dst: str, *, only: str | Sequence[str] | None = None, message: str = ""
    ) -> Digest:
        """Point ``dst`` at what ``src`` names (writes no chunk); ``only`` keeps matching entries."""
        parse_ref_name(dst)
        digest = self.resolve(src)
        if only:
            from cas.subset import subset_manifest

            manifest = decode_manifest(self.objects.get_manifest(digest))
            patterns = [only] if isinstance(only, str) else list(only)
            sub = subset_manifest(manifest, patterns, parent=digest, created_at=self.clock())
            return self.commit(
                sub, dst, op="cp", message=message or f"cp {src} --only {' '.join(patterns)}"
            )
        self.refs_store.set(dst, digest, op="cp", message=message or f"cp {src}")
        return digest

    def rm(self, ref: str) -> Digest:
        """Delete a ref (its chunks stay until GC finds them unreachable); return its target."""
        return self.refs_store.delete(ref).target

    def show(self, ref: str) -> dict[str, Any]:
        """Metadata and a tensor table from the manifest alone; no tensor data is read."""
        digest = self.resolve(ref)
        manifest = decode_manifest(self.objects.get_manifest(digest))
        return {
            "ref": ref,
            "manifest": digest,
            "kind": manifest.kind,
            "created_at": manifest.created_at,
            "parent": manifest.parent,
            "meta": manifest.meta,
            "logical_bytes": manifest.logical_bytes(),
            "chunks": len({c.digest for c in manifest.chunk_refs()}),
            "tensors": [info.__dict__ for info in tensor_table(manifest)],
            "files": {
                p: {"size": e.size, "format": e.format, "chunks": len(e.chunks)}
                for p, e in manifest.files.items()
            },
        }

    def diff(self, a: str, b: str) -> list[DiffEntry]:
        """Entries that differ between two checkpoints, compared by chunk digests, not bytes."""
        left = {t.path: t for t in _digest_table(self.manifest(a))}
        right = {t.path: t for t in _digest_table(self.manifest(b))}
        out = []
        for path in sorted(left.keys() | right.keys()):
            x, y = left.get(path), right.get(path)
            if x is None and y is not None:
                out.append(DiffEntry(path, "added", y.nbytes))
            elif y is None and x is not None:
                out.append(DiffEntry(path, "removed", x.nbytes))
            elif x is not None and y is not None:
                if (x.dtype, x.shape) != (y.dtype, y.shape):
                    out.append(DiffEntry(path, "retyped", y.nbytes))
                elif x.identity != y.identity:
                    out.append(DiffEntry(path, "changed", y.nbytes))
        return out


@dataclass(frozen=True)
class _Comparable:
    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    identity: Any


def _digest_table(manifest: Manifest) -> list[_Comparable]:
    rows = []
    if manifest.kind == "state":
        for path, index in iter_tensor_paths(manifest.tree):
            t = manifest.tensors[index]
            rows.append(
                _Comparable(
                    path, t.dtype, t.shape, t.nbytes, t.inline or tuple(c.digest for c in t.chunks)
                )
            )
        for path, value in _value_leaves(manifest.tree, ""):
            rows.append(_Comparable(path, "value", (), 0, repr(value)))
    for path, entry in manifest.files.items():
        rows.append(
            _Comparable(path, entry.format, (), entry.size, tuple(c.digest for c in entry.chunks))
        )
    return rows


def _value_leaves(node: Any, path: str) -> Iterable[tuple[str, Any]]:
    if isinstance(node, dict) and node.get("~") in ("dict", "list", "tuple"):
        items = node["items"] if node["~"] == "dict" else list(enumerate(node["items"]))
        for key, value in items:
            yield from _value_leaves(value, f"{path}.{key}" if path else str(key))
    elif not (isinstance(node, dict) and node.get("~") == "tensor"):
        yield path, node


def tensor_table(manifest: Manifest) -> list[TensorInfo]:
    """Every tensor a manifest names, with its path, from the manifest alone."""
    if manifest.kind == "state":
        pairs = list(iter_tensor_paths(manifest.tree))
    else:
        pairs = [
            (f"{p}:{r.name}", r.tensor_index) for p, e in manifest.files.items() for r in e.regions
        ]
    rows = []
    for path, index in pairs:
        t = manifest.tensors[index]
        rows.append(TensorInfo(path, t.dtype, t.shape, t.nbytes, len(t.chunks)))
    return rows


def _byte_view(buffer: torch.Tensor) -> memoryview:
    """A writable memoryview over a flat uint8 CPU tensor."""
    return memoryview(buffer.numpy())  # type: ignore[arg-type]


def _itemsize(dtype: str) -> int:
    from cas.manifest import ITEMSIZE

    return ITEMSIZE.get(dtype, 1)


def _clean_meta(metadata: dict[str, Any] | None) -> dict[str, Any]:
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
