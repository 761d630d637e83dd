"""The parts of a Repository and its write path: chunks, then manifest, then ref.

``RepositoryCore`` builds a store's object store, ref store, writer leases, maintenance service and
chunk I/O from its ``BlobStore`` and config, and writes: ``save``, ``write_tensors``,
``put_manifest`` and ``commit`` (invariant 1: write order is chunks, then manifest, then ref).
``cas.repo.ingest`` and ``cas.repo.shards`` build on it; ``cas.repo.repository.Repository`` adds
reading, describing and the other method groups.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from cas.blobstore import BlobStore
from cas.codecs import Codec, codec_by_name
from cas.digest import Digest
from cas.errors import CASError
from cas.model.limits import ReadLimits
from cas.model.manifest import (
    Manifest,
    TensorEntry,
    check_message,
    check_meta,
    check_tags,
    decode_manifest,
    encode_manifest,
)
from cas.model.precision import StoragePolicy
from cas.model.state import TensorSource, encode_state, iter_tensor_paths
from cas.names import RefName, parse_ref_name
from cas.objects.chains import ChunkCache
from cas.objects.chunking import fixed_cuts
from cas.objects.chunkio import WORKERS, ChunkIO, Progress, WriteStats, wait_all
from cas.objects.encoding import (
    DeltaSettings,
    PendingTensor,
    TensorTarget,
    TensorWriter,
    standalone_codec,
    tensor_paths,
)
from cas.objects.store import ObjectStore
from cas.refs.leases import LeaseManager, LeaseSettings, leased
from cas.refs.maintenance import MaintenanceService
from cas.refs.store import RefStore
from cas.refs.stores import Stores
from cas.refs.sweeps import CollectedDuringWrite
from cas.repo.config import CLEAN_VERSION, StoreConfig
from cas.repo.lossy import apply_policy, parent_manifest
from cas.repo.refs import RefOperations
from cas.repo.streaming import StreamWriter

if TYPE_CHECKING:
    from cas.blobstore.sealed import StoreKey

_ANY: Any = ...
T = TypeVar("T")
SAVE_ATTEMPTS = 3
"""Writes of one save when a GC sweep keeps collecting what it reused (rare: once is usual)."""


class ChunkReader(Protocol):
    """Verified chunk reads on the repository's thread pool: what file views read through."""

    def submit(self, fn: Callable[..., T], /, *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on the pool."""
        ...

    def read_chunk_into(self, digest: Digest, out: memoryview) -> None:
        """Fill ``out`` (exactly the chunk's size) with the verified chunk bytes."""
        ...

    def read_chunk_parts(self, digest: Digest, outs: Sequence[memoryview]) -> None:
        """Scatter the verified chunk bytes over ``outs`` (their sizes sum to the chunk's)."""
        ...


def default_readers(blobs: BlobStore) -> int:
    """Chunk reads at once: one per core plus one from a local disk, eight from a remote.

    A local read is CPU work (page-cache copy, blake3, decode) and extra threads only queue on
    the GIL: on 2 cores, delta-encoded GPT checkpoints loaded 1.15x faster with 3 reads at once
    than with 8 (docs/design.md). Writes keep all the workers, since they wait on the disk;
    remote reads wait on the network.
    """
    if blobs.reads_in_place:
        return min(8, (os.cpu_count() or 1) + 1)
    return 8


class RepositoryCore(RefOperations):
    """A store's parts and its write path. Write order is always chunks, then manifest, then ref
    (invariant 1)."""

    def __init__(
        self,
        blobs: BlobStore,
        config: StoreConfig,
        *,
        clock: Callable[[], float] = time.time,
        workers: int = WORKERS,
        owns_blobs: bool = True,
        read_limits: ReadLimits | None = None,
    ) -> None:
        self.blobs = blobs
        self.owns_blobs = owns_blobs
        """Whether ``close`` closes the store too (not for a view sharing another's store)."""
        self.config = config
        self.clock = clock
        self.read_limits = read_limits or ReadLimits.from_env(os.environ)
        """What one read may allocate, whatever a manifest declares (``ReadLimits``)."""
        self.objects = ObjectStore(blobs, max_object_size=max(config.chunk_size, 64 << 20) + 4096)
        self.leases = LeaseManager(blobs, clock, LeaseSettings.from_config(config.extra))
        self.maintenance = MaintenanceService(blobs, clock, self.leases)
        self.refs_store = RefStore(
            blobs, clock, self.leases, legacy_layouts=config.version < CLEAN_VERSION
        )
        self.io = ChunkIO(self.objects, workers, readers=min(workers, default_readers(blobs)))
        self.stores = Stores(self.objects, self.refs_store, self.maintenance, lambda: self.io.pool)
        self.last_write: WriteStats = WriteStats()
        self.delta_settings = DeltaSettings.from_config(config.extra)
        self.chunk_cache = ChunkCache(self.delta_settings.cache_bytes)
        self.append_only = not blobs.accepts_deletes
        """Opened append-only: forget, gc and rm are refused (``cas.blobstore.appendonly``)."""
        self.store_key: StoreKey | None = None
        """An encrypted store's master key (``cas.repo.keys``); None for a plain store."""
        self.key_slot: str | None = None
        """Which of the store's keys opened it."""

    @property
    def url(self) -> str:
        """Where the store lives."""
        return self.blobs.url

    def close(self) -> None:
        """Release threads, connections and leases still held (the store's only if this
        repository owns it)."""
        self.leases.close()
        self.io.close()
        if self.owns_blobs:
            self.blobs.close()

    def chunk_reader(self) -> ChunkReader:
        """Verified chunk reads by digest on this repository's threads (for file views)."""
        return self.io

    def stream_writer(self, stats: WriteStats, *, max_pending: int = 8) -> StreamWriter:
        """A writer that cuts a stream of bytes into chunks and stores them as they arrive
        (``cas.repo.streaming``); its ``finish`` describes the file for a manifest."""
        return StreamWriter(self.io, self.codec(), self.config, stats, max_pending)

    def sync(self) -> None:
        """Make every chunk written so far durable; a writer whose chunks another process
        commits (a rank of a distributed save) calls it before handing them over."""
        self.objects.sync()

    def codec(self, name: str | None = None) -> Codec:
        """The codec to write with: ``name``, else the store's default.

        ``"auto"`` and the delta codecs choose per tensor in ``save``/``put_path``; writers that
        write opaque chunks get ``shuffle-zstd`` for them (``bytegroup-zstd`` for the numpy deltas).
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
        tags: Sequence[str] = (),
        progress: Progress | None = None,
        overwrite: bool = False,
        store_as: dict[str, str] | None = None,
        lossy_delta: float | dict[str, float] | None = None,
    ) -> Digest:
        """Store a nested training state under ``ref``; return the manifest digest.

        ``message`` (what this checkpoint is) and ``tags`` (labels such as ``eval``) are kept in
        the manifest, shown by ``cas ls -l`` and ``cas log``, and ``cas ls --tag`` filters on them;
        the message is also the ref history's entry.

        ``parent`` names the previous checkpoint (default: the ref's current target), which is
        also the delta base: with codec ``"auto"`` each tensor may be stored as a delta against
        the parent's tensor at the same path (``cas.objects.encoding``). ``expected`` makes the ref update
        a compare-and-swap against that digest (``None``: must not exist). A gate, a ``best``
        pointer or a ref the stored policy protects is replaced only with ``overwrite=True``
        (ProtectedRef otherwise; the chunks written stay for GC).

        Lossy, opt-in, recorded in ``meta["lossy"]`` (``cas.model.precision``): ``store_as``
        (``{"model.*": "float16"}``) stores matching floating tensors in that dtype and loads them
        back in their own; ``lossy_delta`` (``1e-5``, or per pattern) keeps the parent's value of
        every element that changed by less than that.
        """
        name = parse_ref_name(ref)
        labels = check_tags(tags)
        check_message(message)
        if expected is _ANY:  # a compare-and-swap is refused at the commit, by the ref's state
            self.check_replaceable(name, overwrite=overwrite)
        meta = check_meta(metadata)
        tree, sources = encode_state(state)
        parent_digest = self._parent_digest(name, parent)
        policy = StoragePolicy.from_args(store_as, lossy_delta)
        if policy is not None:
            before = parent_manifest(self.manifest, parent_digest)
            tree, sources = apply_policy(self.io, before, tree, sources, policy)
            meta = {**meta, "lossy": policy.describe()}
        for attempt in range(1, SAVE_ATTEMPTS + 1):
            stats = WriteStats()
            entries = self._write_tensors(sources, codec, stats, progress, parent_digest)
            manifest = Manifest(
                kind="state",
                tensors=tuple(entries),
                tree=tree,
                meta=meta,
                created_at=self.clock(),
                parent=parent_digest,
                chunk_size=self.config.chunk_size,
                message=message,
                tags=labels,
            )
            try:
                return self.commit(
                    manifest,
                    name,
                    expected=expected,
                    op="save",
                    message=message,
                    stats=stats,
                    overwrite=overwrite,
                )
            except CollectedDuringWrite:
                # GC deleted something this save reused between its check and its delete; the
                # objects are absent now, so writing again stores them and the commit passes.
                if attempt == SAVE_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

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
        self.objects.sync()
        digest = self.objects.put_manifest(encode_manifest(manifest), codec_by_name("zstd"))
        self.objects.sync()
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
        overwrite: bool = False,
    ) -> Digest:
        """Make chunks durable, store the manifest, then move the ref (invariant 1).

        The ref store checks this thread's lease right before the ref moves (invariant 5). A
        protected ref is replaced only with ``overwrite=True``, as in ``set_ref``.
        """
        digest = self.put_manifest(manifest)
        self.set_ref(ref, digest, expected=expected, op=op, message=message, overwrite=overwrite)
        self.last_write = stats or WriteStats()
        return digest

    def manifest(self, spec: str) -> Manifest:
        """The decoded, verified manifest a ref (or digest) names."""
        return decode_manifest(self.objects.get_manifest(self.resolve(spec)))
