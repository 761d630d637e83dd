"""Repository: the one facade over a store: save/load state, put/get files, refs, show and diff.

The class is assembled from method groups, each in its own module: the write path and the store's
parts (``cas.repo.core``), refs and leases (``cas.repo.refs``), housekeeping
(``cas.repo.housekeeping``: GC, retention, verify, space) and transfers (``cas.repo.transfers``:
push, pull, archive). The layers above (fs, training, cli) use these named methods only.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cas.blobstore import ReadOnlyBlobStore
from cas.blobstore.base import BlobStore
from cas.blobstore.cache import HandedBlobStore, LocalFirstBlobStore
from cas.blobstore.cache import KeptObjects as KeptObjects  # for the training layer
from cas.digest import Digest
from cas.errors import FormatError, NotFound, NothingSelected
from cas.model.manifest import ChunkRef, Manifest, TensorEntry, decode_manifest
from cas.model.state import (
    buffer_over,
    byte_buffer,
    decode_state,
    flat_bytes,
    iter_tensor_paths,
    placed,
    selected_tensors,
    tensor_from_bytes,
    writable_view,
)
from cas.names import parse_ref_name
from cas.objects.chunkio import WORKERS, Progress
from cas.objects.keys import ObjectKind
from cas.refs.leases import leased
from cas.repo.core import RepositoryCore
from cas.repo.housekeeping import HousekeepingOperations
from cas.repo.inplace import plan_into
from cas.repo.lazy import CheckpointReader
from cas.repo.transfers import TransferOperations

# Describing, exporting, ingesting files and sharded saves load on first use: a training job
# that only saves and loads never imports them (nor the file-format parsers ingest brings).
if TYPE_CHECKING:
    import torch

    from cas.model.describe import DiffEntry

_ANY: Any = ...


class Repository(RepositoryCore, HousekeepingOperations, TransferOperations):
    """A cas store: the facade every layer above ``cas.repo`` uses (``cas.open`` returns one)."""

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def for_background_writes(self, workers: int = WORKERS) -> Repository:
        """The same store for a training loop's background saves: chunk workers of its own
        (started from the saving thread, so they inherit its priority) and writes that bypass
        the page cache where the store can (a local store's direct I/O; staging buffers laid
        out by ``cas.repo.background``). Its ``close`` stops its threads; the store stays open.
        """
        return Repository(
            self.blobs.for_background_writes(),
            self.config,
            clock=self.clock,
            workers=workers,
            owns_blobs=False,
            read_limits=self.read_limits,
        )

    def read_through(
        self, remote: Repository, keep: KeptObjects | None = None
    ) -> Repository | None:
        """``remote`` as a read-only store whose chunks and manifests are read here first when
        this store holds them (a resume from a remote tier: a cached base does not travel).
        Writes nothing here; what it reads from ``remote`` is also kept in ``keep``, if given,
        for a pull of the same checkpoint (``handing``). None when either store is encrypted
        (their keys differ)."""
        if self.store_key is not None or remote.store_key is not None:
            return None
        objects = ("chunks/", "manifests/")  # content-addressed: the same bytes on either side
        blobs = LocalFirstBlobStore(
            self.blobs, remote.blobs, prefixes=objects, remembered=("manifests/",), keep=keep
        )
        return remote._reading(blobs)

    def lacking_bytes(self, chunks: Iterable[ChunkRef], limit: int) -> int:
        """Bytes of the distinct ``chunks`` this store does not hold, counted until past
        ``limit`` (a resume's choice between reading a checkpoint through to a remote and
        pulling it first, ``cas.training.tier_resume``)."""
        lacking = 0
        seen: set[Digest] = set()
        for ref in chunks:
            if ref.digest not in seen and not self.objects.has_chunk(ref.digest):
                lacking += ref.size
                if lacking > limit:
                    break
            seen.add(ref.digest)
        return lacking

    def handing(self, kept: KeptObjects) -> Repository:
        """This store, read-only, with the objects in ``kept`` read from memory instead (each
        once): the source of a pull that follows a ``read_through`` load of the same objects."""
        return self._reading(HandedBlobStore(self.blobs, kept))

    def _reading(self, blobs: BlobStore) -> Repository:
        """A read-only handle on ``blobs`` (a wrapper around this store's), with its config."""
        return Repository(
            ReadOnlyBlobStore(blobs), self.config, clock=self.clock, owns_blobs=False,
            read_limits=self.read_limits,
        )  # fmt: skip

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
        overwrite: bool = False,
        message: str = "",
        tags: Sequence[str] = (),
    ) -> Digest:
        """Ingest a file or a directory (e.g. an HF ``checkpoint-N/``) byte-for-byte under ``ref``.

        ``message`` and ``tags`` are kept with the checkpoint, as in ``save``.

        ``parent`` (default: the ref's current target) is the delta base for the tensors inside
        known formats, matched by file and tensor name (or tensor name alone). A gate, a
        ``best`` pointer or a ref the stored policy protects is replaced only with
        ``overwrite=True`` (ProtectedRef otherwise, before any chunk is written).
        """
        from cas.repo.ingest import ingest_path  # with the file-format parsers

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
            overwrite=overwrite,
            message=message,
            tags=tuple(tags),
        )

    # -- reading -------------------------------------------------------------------------------

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
        only the chunks of selected tensors are read. Patterns that select nothing at all raise
        NothingSelected (a NotFound), not an empty state. ``mmap=True`` maps single-chunk raw
        tensors of a local store from their files (copy-on-write) instead of reading them.
        """
        manifest = self.manifest(ref)
        patterns = [keys] if isinstance(keys, str) else list(keys or [])
        matched = False

        def selected(path: str) -> bool:
            nonlocal matched
            hit = any(fnmatch.fnmatchcase(path, pattern) for pattern in patterns)
            matched = matched or hit
            return hit

        select = selected if patterns else None
        if manifest.kind == "files":
            out: Any = self._load_files(manifest, select, map_location, progress)
        else:
            wanted = selected_tensors(manifest.tree, select)
            tensors = self._materialize(manifest, sorted(wanted), map_location, mmap, progress)
            out = decode_state(manifest.tree, tensors.__getitem__, select)
        if patterns and not matched:
            _nothing_selected(ref, patterns, manifest)
        return out

    def load_into(self, ref: str, target: Any) -> Any:
        """Read ``ref``'s tensors into the tensors of ``target`` in place and return it.

        ``target`` is a state of the saved shape (``{"model": model.state_dict(), ...}``) whose
        tensors are contiguous CPU tensors; each is filled from the stored tensor at its dotted
        path, which must have its dtype and shape. Every path is checked before any byte is
        read. Other leaves are left as they are: ``load(ref, keys=...)`` reads those.
        """
        manifest = self.manifest(ref)
        plan = plan_into(ref, manifest, target)
        self._materialize(manifest, plan, None, False, None, into=plan)
        return target

    def open(self, ref: str) -> CheckpointReader:
        """A lazy read-only mapping of ``ref``'s tensors: ``with repo.open(ref) as ckpt:`` then
        ``ckpt.keys()``, ``ckpt["model.w"]``, ``ckpt.get_slice("model.w")[:10]``,
        ``ckpt.metadata``; each read fetches only the chunks it needs (``cas.repo.lazy``)."""
        return CheckpointReader(self, ref)

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
        into: dict[int, list[torch.Tensor]] | None = None,
    ) -> dict[int, Any]:
        """The values of the tensors at ``indices``; those in ``into`` are read into the first of
        its tensors instead (and copied to the others), and left out of the result."""
        buffers: dict[int, torch.Tensor] = {}
        jobs: list[tuple[Sequence[ChunkRef], memoryview]] = []
        encoded: set[int] = set()
        indices = list(indices)
        self.read_limits.check(manifest.tensors[i].nbytes for i in indices)
        for index in indices:
            entry = manifest.tensors[index]
            if entry.inline is not None:
                buffers[index] = buffer_over(bytearray(entry.inline))
                continue
            mapped = self._mapped_tensor(entry) if use_mmap else None
            if mapped is not None:
                buffers[index] = buffer_over(mapped)
                continue
            buffer = (
                flat_bytes(into[index][0]) if into and index in into else byte_buffer(entry.nbytes)
            )
            buffers[index] = buffer
            if entry.nbytes:
                if entry.encoding:
                    encoded.add(len(jobs))
                jobs.append((entry.chunks, writable_view(buffer)))
        self.io.read_all(jobs, progress, encoded=encoded)
        out: dict[int, Any] = {}
        for index, buffer in buffers.items():
            if into and index in into:
                first, *others = into[index]
                if flat_bytes(first).data_ptr() != buffer.data_ptr():
                    flat_bytes(first).copy_(buffer)  # an inline tensor
                for other in others:
                    other.copy_(first)
                continue
            entry = manifest.tensors[index]
            value = tensor_from_bytes(entry.kind, entry.dtype, entry.shape, buffer)
            out[index] = placed(value, map_location)
        return out

    def _mapped_tensor(self, entry: TensorEntry) -> memoryview | None:
        """A single raw chunk's bytes mapped from its local file (None: read it instead)."""
        if len(entry.chunks) != 1 or entry.encoding:
            return None
        return self.objects.map_raw_chunk(entry.chunks[0].digest, entry.nbytes)

    def _load_files(
        self,
        manifest: Manifest,
        select: Callable[[str], bool] | None,
        map_location: str | torch.device | None,
        progress: Progress | None,
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self.read_limits.check(
            e.size for p, e in manifest.files.items() if not e.regions and (not select or select(p))
        )
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
        include: Sequence[str] = (),
    ) -> list[Path]:
        """Write what ``ref`` names to ``dest``; return the files written (sidecars included).

        ``dest`` ending in a slash is a directory, made if it is not there yet: a single file or
        an exported state is written into it, never to a file of that name. ``include`` globs
        (``model*.safetensors``) keep only the ingested files whose path or name match them.
        """
        from cas.repo.export import export_files, export_state, select_files

        manifest = self.manifest(ref)
        if include:
            manifest = select_files(manifest, include, ref)
        if os.fspath(dest).endswith(("/", os.sep)):
            Path(dest).mkdir(parents=True, exist_ok=True)
        if manifest.kind == "files":
            if fmt is not None:
                raise FormatError(
                    f"{ref} holds ingested files; they are written back as they were (drop --format)"
                )
            self.read_limits.check(e.size for e in manifest.files.values())
            return export_files(
                self.io, manifest, Path(dest), sha256=sha256, overwrite=overwrite, progress=progress
            )
        state = self.load(ref, progress=progress)
        return export_state(state, Path(dest), fmt or "pt", sha256=sha256, overwrite=overwrite)

    def split_file_spec(self, spec: str) -> tuple[str, str | None]:
        """``REF/path/in/checkpoint`` -> (``REF``, ``path/in/checkpoint``); a plain ref (or
        ``REF~N``, or a digest) -> (spec, None). The longest prefix that names a ref wins."""
        if len(spec) > 65 and spec[64] == "/":  # DIGEST/path
            return spec[:64], spec[65:]
        parts = spec.split("/")
        for cut in range(len(parts), 0, -1):
            head = "/".join(parts[:cut])
            name, _, back = head.partition("~")
            if "/" not in back and self.find_ref(name) is not None:  # NAME or NAME~N
                return head, "/".join(parts[cut:]) or None
        return spec, None  # resolving it raises the NotFound that names it

    def iter_file(self, spec: str) -> Iterator[bytes | memoryview]:
        """The verified bytes of one ingested file, chunk by chunk: ``spec`` is ``REF/path`` (a
        file of an ingested directory) or the ``REF`` of a single ingested file."""
        from cas.repo.export import file_entry

        ref, path = self.split_file_spec(spec)
        manifest = self.manifest(ref)
        entry = file_entry(manifest, ref, path)
        return self.io.iter_chunks(entry.chunks)

    # -- copying and describing ----------------------------------------------------------------

    @leased
    def cp(
        self,
        src: str,
        dst: str,
        *,
        only: str | Sequence[str] | None = None,
        message: str = "",
        overwrite: bool = False,
    ) -> Digest:
        """Point ``dst`` at what ``src`` names (writes no chunk); ``only`` keeps matching entries.

        A gate, a ``best`` pointer or a ref the stored policy protects (``ref_protection``) that
        already names another checkpoint is replaced only with ``overwrite=True``; otherwise
        ProtectedRef (an AlreadyExists), and nothing moves (checked on the record the
        compare-and-swap reads, so a racing copy cannot slip in between). The source's manifest
        and chunks are touched under a writer lease first: ``src`` may be a history entry or a
        digest GC found unreachable, or a ref deleted meanwhile, and a GC sweeping now must
        spare what ``dst`` is about to name.
        """
        parse_ref_name(dst)
        digest = self.resolve(src)
        manifest = decode_manifest(self.objects.get_manifest(digest))
        for kind, digests in (
            (ObjectKind.MANIFEST, [digest]),
            (ObjectKind.CHUNK, sorted(manifest.chunk_digests())),
        ):
            missing = self.objects.freshen(kind, digests)
            if missing:
                raise NotFound(
                    f"{kind.noun} {missing[0]} is missing from the store: {src} is damaged"
                )
        if only:
            from cas.model.subset import subset_manifest

            patterns = [only] if isinstance(only, str) else list(only)
            sub = subset_manifest(manifest, patterns, parent=digest, created_at=self.clock())
            digest = self.put_manifest(sub)
            message = message or f"cp {src} --only {' '.join(patterns)}"
        self.set_ref(dst, digest, op="cp", message=message or f"cp {src}", overwrite=overwrite)
        return digest

    def show(self, ref: str) -> dict[str, Any]:
        """Metadata and a tensor table from the manifest; no tensor data is read.

        Stored sizes come from statting the objects (``cas.retention.space``): ``stored_bytes`` are
        the manifest and the chunks the checkpoint names, ``stored_with_bases`` adds the delta
        bases it needs (what ``cas du`` counts for the ref).
        """
        from cas.model.describe import tensor_table

        digest = self.resolve(ref)
        manifest = decode_manifest(self.objects.get_manifest(digest))
        usage = self.manifest_usage(manifest, digest).as_dict()
        return {
            "ref": ref,
            "manifest": digest,
            "kind": manifest.kind,
            "created_at": manifest.created_at,
            "parent": manifest.parent,
            "meta": manifest.meta,
            "message": manifest.message,
            "tags": list(manifest.tags),
            "logical_bytes": manifest.logical_bytes(),
            "chunks": len({c.digest for c in manifest.chunk_refs()}),
            **{k: v for k, v in usage.items() if k not in ("logical_bytes", "chunks")},
            "tensors": [info.__dict__ for info in tensor_table(manifest)],
            "files": {
                p: {"size": e.size, "format": e.format, "chunks": len(e.chunks)}
                for p, e in manifest.files.items()
            },
        }

    def diff(self, a: str, b: str, *, same: bool = False) -> list[DiffEntry]:
        """Entries that differ between two checkpoints (``same``: and those that do not),
        compared by chunk digests, not bytes; tensors inside ingested files one by one."""
        from cas.model.describe import diff_manifests

        return diff_manifests(self.manifest(a), self.manifest(b), same=same)


def _nothing_selected(ref: str, patterns: list[str], manifest: Manifest) -> None:
    """NothingSelected naming the patterns and a few of the paths there are."""
    paths = (
        sorted(manifest.files)
        if manifest.kind == "files"
        else [p for p, _ in iter_tensor_paths(manifest.tree)]
    )
    examples = ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")
    raise NothingSelected(
        f"keys {', '.join(map(repr, patterns))} match nothing in {ref}"
        + (f" (it holds {examples})" if examples else "")
    )
