"""Repository: the one facade over a store: save/load state, put/get files, refs, show and diff."""

from __future__ import annotations

import fnmatch
import mmap
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cas.blobstore import BlobStore, touch_many
from cas.codecs import Codec, codec_by_name
from cas.digest import Digest, digest_of
from cas.errors import CASError, FormatError, NotFound
from cas.model.describe import DiffEntry, diff_manifests, tensor_table
from cas.model.manifest import (
    Manifest,
    TensorEntry,
    check_meta,
    decode_manifest,
    encode_manifest,
)
from cas.model.state import (
    TensorSource,
    decode_state,
    encode_state,
    iter_tensor_paths,
    tensor_from_bytes,
)
from cas.names import RefName, parse_ref_name
from cas.objects.chains import ChunkCache
from cas.objects.chunking import fixed_cuts
from cas.objects.chunkio import ChunkIO, Progress, WriteStats, wait_all
from cas.objects.encoding import (
    DeltaSettings,
    PendingTensor,
    TensorTarget,
    TensorWriter,
    standalone_codec,
    tensor_paths,
)
from cas.objects.store import HEADER_SIZE, ObjectStore, chunk_key, manifest_key
from cas.refs.leases import LeaseManager, LeaseSettings, leased
from cas.refs.maintenance import MaintenanceService
from cas.refs.store import RefStore
from cas.refs.stores import Stores
from cas.repo.config import StoreConfig
from cas.repo.housekeeping import HousekeepingOperations
from cas.repo.refs import RefOperations
from cas.repo.transfers import TransferOperations

if TYPE_CHECKING:
    import torch

_ANY: Any = ...


def default_readers(blobs: BlobStore) -> int:
    """Chunk reads at once: one per core plus one from a local disk, eight from a remote.

    A local read is CPU work (page-cache copy, blake3, decode) and extra threads only queue on
    the GIL: on 2 cores, delta-encoded GPT checkpoints loaded 1.15x faster with 3 reads at once
    than with 8 (docs/design.md). Writes keep all eight workers, since they wait on fsync;
    remote reads wait on the network.
    """
    if blobs.reads_in_place:
        return min(8, (os.cpu_count() or 1) + 1)
    return 8


class Repository(RefOperations, HousekeepingOperations, TransferOperations):
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
        self.leases = LeaseManager(blobs, clock, LeaseSettings.from_config(config.extra))
        self.maintenance = MaintenanceService(blobs, clock, self.leases)
        self.refs_store = RefStore(blobs, clock, self.leases)
        self.io = ChunkIO(self.objects, workers, readers=min(workers, default_readers(blobs)))
        self.stores = Stores(self.objects, self.refs_store, self.maintenance, lambda: self.io.pool)
        self.last_write: WriteStats = WriteStats()
        self.delta_settings = DeltaSettings.from_config(config.extra)
        self.chunk_cache = ChunkCache(self.delta_settings.cache_bytes)

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
        """The codec to write with: ``name``, else the store's default.

        ``"auto"`` and the delta codecs choose per tensor in ``save``/``put_path``; writers that
        write opaque chunks get ``bytegroup-zstd`` for them.
        """
        return standalone_codec(name or self.config.codec, 2)

    # -- writing -------------------------------------------------------------------------------

    @leased
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

        ``parent`` names the previous checkpoint (default: the ref's current target), which is
        also the delta base: with codec ``"auto"`` each tensor may be stored as a delta against
        the parent's tensor at the same path (``cas.objects.encoding``). ``expected`` makes the ref update
        a compare-and-swap against that digest (``None``: must not exist).
        """
        name = parse_ref_name(ref)
        tree, sources = encode_state(state)
        stats = WriteStats()
        parent_digest = self._parent_digest(name, parent)
        entries = self._write_tensors(sources, codec, stats, progress, parent_digest)
        manifest = Manifest(
            kind="state",
            tensors=tuple(entries),
            tree=tree,
            meta=check_meta(metadata),
            created_at=self.clock(),
            parent=parent_digest,
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

    @leased
    def write_tensors(
        self, sources: Sequence[TensorSource], *, codec: str | None = None
    ) -> tuple[list[TensorEntry], WriteStats]:
        """Store tensors' chunks only (no manifest, no ref) and return their entries.

        The first half of a save, for writers that assemble their own manifest (a distributed
        checkpoint commits one manifest for every rank's tensors). Call ``commit`` afterwards.
        """
        stats = WriteStats()
        return self._write_tensors(sources, codec, stats, None), stats

    def _tensor_writer(
        self,
        codec: str | None,
        stats: WriteStats,
        progress: Progress | None,
        parent: Digest | None,
    ) -> tuple[TensorWriter, dict[str, TensorEntry]]:
        """A writer for one save, and the parent's tensors by path (the delta bases)."""
        parent_manifest = None
        if parent is not None:
            try:
                parent_manifest = decode_manifest(self.objects.get_manifest(parent))
            except CASError:
                parent_manifest = None  # a damaged parent only costs the deltas, not the save
        writer = TensorWriter(
            self.objects,
            self.io.pool,
            codec_name=codec or self.config.codec,
            level=self.config.compression_level,
            settings=self.delta_settings,
            cache=self.chunk_cache,
            stats=stats,
            progress=self.leases.beat(progress),
            parent=parent_manifest,
        )
        paths = tensor_paths(parent_manifest, iter_tensor_paths) if parent_manifest else {}
        return writer, paths

    def _write_tensors(
        self,
        sources: Sequence[TensorSource],
        codec: str | None,
        stats: WriteStats,
        progress: Progress | None,
        parent: Digest | None = None,
    ) -> list[TensorEntry]:
        writer, parents = self._tensor_writer(codec, stats, progress, parent)
        pending: list[tuple[TensorSource, PendingTensor | None]] = []
        for source in sources:
            if source.nbytes <= self.config.inline_max:
                pending.append((source, None))
                continue
            cuts = fixed_cuts(source.nbytes, self.config.chunk_size)
            target = TensorTarget(
                source.data, cuts, source.dtype, source.elem_size, parents.get(source.path)
            )
            pending.append((source, writer.submit(target)))
        wait_all(f for _, written in pending if written for f in written.futures())
        entries = []
        for source, written in pending:
            if written is not None:
                entries.append(writer.entry(source.kind, written, source.shape))
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
        writer.refresh_bases(entries)
        return entries

    @leased
    def put_manifest(self, manifest: Manifest) -> Digest:
        """Make the chunks written so far durable, then store ``manifest``; return its digest.

        No ref moves: for update functions passed to ``update_ref``, which return the digest.
        """
        self.leases.check()
        self.blobs.sync()
        digest = self.objects.put_manifest(encode_manifest(manifest), codec_by_name("zstd"))
        self.blobs.sync()
        return digest

    @leased
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
        """Make chunks durable, store the manifest, then move the ref (invariant 1).

        The ref store checks this thread's lease right before the ref moves (invariant 5).
        """
        digest = self.put_manifest(manifest)
        self.refs_store.set(ref, digest, expected=expected, op=op, message=message)
        self.last_write = stats or WriteStats()
        return digest

    def save_shard(self, state: Any, run_id: str, rank: int, world_size: int, **kw: Any) -> Digest:
        """Store this rank's shard of a checkpoint for ``commit_shards`` (see ``cas.repo.shards``)."""
        from cas.repo.shards import save_shard

        return save_shard(self, state, run_id, rank, world_size, **kw)

    def commit_shards(self, ref: str, run_id: str, world_size: int, **kw: Any) -> Digest:
        """Merge the shards of ``run_id`` into one manifest named ``ref`` (see ``cas.repo.shards``)."""
        from cas.repo.shards import commit_shards

        return commit_shards(self, ref, run_id, world_size, **kw)

    @leased
    def put_path(
        self,
        path: str | os.PathLike[str],
        ref: str,
        metadata: dict[str, Any] | None = None,
        *,
        allow_opaque_pickles: bool = False,
        expected: Digest | Any | None = _ANY,
        codec: str | None = None,
        parent: str | None = None,
        progress: Progress | None = None,
    ) -> Digest:
        """Ingest a file or a directory (e.g. an HF ``checkpoint-N/``) byte-for-byte under ``ref``.

        ``parent`` (default: the ref's current target) is the delta base for the tensors inside
        known formats, matched by file and tensor name (or tensor name alone).
        """
        from cas.repo.ingest import ingest_path

        return ingest_path(
            self,
            path,
            ref,
            metadata,
            allow_opaque_pickles=allow_opaque_pickles,
            expected=expected,
            codec=codec,
            parent=parent,
            progress=progress,
        )

    # -- reading -------------------------------------------------------------------------------

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
        import torch  # only reads that build tensors need it; listing and files do not

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
        import torch

        if len(entry.chunks) != 1 or entry.encoding:
            return None
        digest = entry.chunks[0].digest
        path = self.blobs.local_path(chunk_key(digest))
        if path is None:
            return None
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
        from cas.repo.export import export_files, export_state

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

    # -- copying and describing ----------------------------------------------------------------

    @leased
    def cp(
        self, src: str, dst: str, *, only: str | Sequence[str] | None = None, message: str = ""
    ) -> Digest:
        """Point ``dst`` at what ``src`` names (writes no chunk); ``only`` keeps matching entries.

        The source's manifest and chunks are touched under a writer lease first: ``src`` may be
        a history entry or a digest GC found unreachable, or a ref deleted meanwhile, and a GC
        sweeping now must spare what ``dst`` is about to name.
        """
        parse_ref_name(dst)
        digest = self.resolve(src)
        manifest = decode_manifest(self.objects.get_manifest(digest))
        missing = touch_many(
            self.blobs, [manifest_key(digest), *map(chunk_key, manifest.chunk_digests())]
        )
        if missing:
            raise NotFound(f"{missing[0]} is missing from the store: {src} is damaged")
        if only:
            from cas.model.subset import subset_manifest

            patterns = [only] if isinstance(only, str) else list(only)
            sub = subset_manifest(manifest, patterns, parent=digest, created_at=self.clock())
            return self.commit(
                sub, dst, op="cp", message=message or f"cp {src} --only {' '.join(patterns)}"
            )
        self.set_ref(dst, digest, op="cp", message=message or f"cp {src}")
        return digest

    def show(self, ref: str) -> dict[str, Any]:
        """Metadata and a tensor table from the manifest; no tensor data is read.

        Stored sizes come from statting the chunks (``cas.retention.space``): ``stored_bytes`` are
        the chunks the checkpoint names, ``stored_with_bases`` adds the delta bases it needs.
        """
        digest = self.resolve(ref)
        manifest = decode_manifest(self.objects.get_manifest(digest))
        usage = self.manifest_usage(manifest).as_dict()
        return {
            "ref": ref,
            "manifest": digest,
            "kind": manifest.kind,
            "created_at": manifest.created_at,
            "parent": manifest.parent,
            "meta": manifest.meta,
            "logical_bytes": manifest.logical_bytes(),
            "chunks": len({c.digest for c in manifest.chunk_refs()}),
            **{k: v for k, v in usage.items() if k not in ("logical_bytes", "chunks")},
            "tensors": [info.__dict__ for info in tensor_table(manifest)],
            "files": {
                p: {"size": e.size, "format": e.format, "chunks": len(e.chunks)}
                for p, e in manifest.files.items()
            },
        }

    def diff(self, a: str, b: str) -> list[DiffEntry]:
        """Entries that differ between two checkpoints, compared by chunk digests, not bytes."""
        return diff_manifests(self.manifest(a), self.manifest(b))


def _byte_view(buffer: torch.Tensor) -> memoryview:
    """A writable memoryview over a flat uint8 CPU tensor."""
    return memoryview(buffer.numpy())  # type: ignore[arg-type]
