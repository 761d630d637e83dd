"""Writing through ``cas://``: stream files into chunks, then edit checkpoints by compare-and-swap.

A ``CASWriteFile`` streams its bytes into chunks as they arrive (``Repository.stream_writer``), so
a file is never held whole in memory. Closing it makes its ``FileRecord`` visible by a
compare-and-swap on the owning ref (``put_record``). Every change to a checkpoint's files (write,
rename, remove) goes through ``edit_files``: read the ref, apply the change to its file table and
store the new manifest, all inside ``Repository.update_ref``, which on a lost compare-and-swap
starts over from the ref's new state. Paths are resolved by the filesystem's ``CheckpointTree``.
"""

from __future__ import annotations

import errno
import io
import sys
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.spec import AbstractBufferedFile

from cas.digest import Digest
from cas.errors import InvalidName
from cas.fs.extents import FileRecord
from cas.fs.tree import CheckpointTree
from cas.fs.views import file_records
from cas.model.manifest import FileEntry, FileRegion, Manifest, TensorEntry
from cas.names import check_relative_path, parse_ref_name
from cas.objects.chunkio import WriteStats
from cas.refs.records import RefRecord

MAX_REF_RETRIES = 64
"""Compare-and-swap attempts on one ref before a write gives up with RefConflict."""


def read_only_state(ref: str) -> PermissionError:
    """The error for writing into a ref that holds a saved state."""
    return PermissionError(
        errno.EROFS,
        "this ref holds a state saved by Repository.save; its files are read-only views",
        ref,
    )


def _is_under(path: str, root: str) -> bool:
    return not root or path == root or path.startswith(root + "/")


def files_manifest(
    files: dict[str, FileRecord],
    meta: dict[str, Any],
    parent: Digest | None,
    created_at: float,
    chunk_size: int,
) -> Manifest:
    """A ``kind="files"`` manifest of ``files``, its tensor table rebuilt in path order."""
    tensors: list[TensorEntry] = []
    entries: dict[str, FileEntry] = {}
    for path in sorted(files):
        record = files[path]
        regions = []
        for region, tensor in zip(record.entry.regions, record.tensors, strict=True):
            regions.append(FileRegion(region.name, len(tensors), region.offset))
            tensors.append(tensor)
        entries[path] = replace(record.entry, regions=tuple(regions))
    return Manifest(
        kind="files",
        tensors=tuple(tensors),
        files=entries,
        meta=meta,
        created_at=created_at,
        parent=parent,
        chunk_size=chunk_size,
    )


class CASWriteFile(AbstractBufferedFile):  # type: ignore[misc]
    """A file being written: chunked and stored as it streams in, visible once closed.

    A writer lease is held from open to commit, so GC spares the chunks stored so far; a lease
    that expired aborts the commit (invariant 5). A file closed while an exception unwinds (a
    ``with`` block that raised, whether it is ``fs.open``'s or ``fsspec.open``'s, or a ``finally``
    the error runs through) is discarded, never published half written. ``totals`` adds up what
    every file of the filesystem wrote. ``overwrite`` lets the commit change a protected ref.
    """

    closed: bool

    def __init__(
        self,
        fs: AbstractFileSystem,
        path: str,
        mode: str,
        block_size: int,
        autocommit: bool,
        *,
        tree: CheckpointTree,
        totals: WriteStats,
        overwrite: bool = False,
    ) -> None:
        super().__init__(
            fs, path, mode=mode, block_size=block_size, autocommit=autocommit, cache_type="none"
        )
        self.repo = tree.repo
        self.tree = tree
        self.totals = totals
        self.overwrite = overwrite
        self.stats = WriteStats()
        self._lease = self.repo.writer_lease("fs-write")
        self._writer = self.repo.stream_writer(self.stats)
        self._record: FileRecord | None = None
        self._discarded = False
        self._error_at_open = sys.exc_info()[1]
        """The exception being handled when the file was opened (an error report written from
        an ``except`` block): closing while it is still handled is an ordinary close."""

    def _upload_chunk(self, final: bool = False) -> bool:
        if self._lease is not None:
            self._lease.maybe_refresh()
        view = self.buffer.getbuffer()
        try:
            self._writer.write(view)
        finally:
            view.release()
        if final:
            self._record = FileRecord(*self._writer.finish())
            for name, value in self.stats.as_dict().items():
                setattr(self.totals, name, getattr(self.totals, name) + value)
            if self.autocommit:
                self.commit()
        return True

    def commit(self) -> None:
        """Add the file to its checkpoint (called on close unless in a transaction)."""
        if self._discarded:
            return  # a write that failed inside a transaction: the others still commit
        if self._record is None:
            raise ValueError("nothing to commit: the file is not closed")
        try:
            if self._lease is not None:
                self._lease.check()
            # Under the file's lease, so the ref move is fenced like a save's: a writer paused
            # past its lease is refused even between the check above and the compare-and-swap.
            with self.repo.committing_under(self._lease):
                put_record(
                    self.tree,
                    self.path,
                    self._record,
                    exclusive=self.mode == "xb",
                    overwrite=self.overwrite,
                )
        finally:
            self._release()

    def discard(self) -> None:
        """Drop the file; its chunks are unreferenced and left to GC."""
        self._record = None
        self._discarded = True
        self._release()

    def _release(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def close(self) -> None:
        """Finish and publish the file (unless in a transaction); discard it instead when an
        exception is unwinding through the caller.

        ``fsspec.open``'s ``with`` block closes its files on the way out without saying why, so
        the exception in flight is the only sign that what was written is not the whole file.
        """
        error = sys.exc_info()[1]
        if not self.closed and error is not None and error is not self._error_at_open:
            self.abandon()
            return
        super().close()

    def abandon(self) -> None:
        """Close without storing the rest or publishing anything; the file is discarded."""
        if self.closed:
            return
        self.closed = True  # nothing more is flushed: the bytes so far are not the file
        self.discard()

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self.abandon()  # a write that failed half way never becomes visible
            return
        self.close()

    def fileno(self) -> int:
        """No OS file backs this stream (callers such as DCP fall back to not fsyncing it)."""
        raise io.UnsupportedOperation("cas:// files have no file descriptor")


def file_location(tree: CheckpointTree, path: str) -> tuple[str, str]:
    """Where a file at ``path`` goes: the owning ref, or a new ref at its parent directory."""
    ref, rel = tree.owner(path)
    if ref is not None and rel:
        return ref, _file_name(rel, path)
    if ref is not None:
        raise IsADirectoryError(errno.EISDIR, "a ref is a directory", path)
    parts = path.split("/")
    for i in range(len(parts) - 1, 0, -1):
        try:
            ref = parse_ref_name("/".join(parts[:i]))
        except InvalidName:
            continue
        return ref, _file_name("/".join(parts[i:]), path)
    raise PermissionError(
        errno.EACCES,
        "a file needs a checkpoint directory: write cas://<ref>/<file> with a valid ref name",
        path,
    )


def _file_name(rel: str, path: str) -> str:
    """``rel`` if a manifest may hold it as a file path, else an OSError (EINVAL)."""
    try:
        return check_relative_path(rel)
    except InvalidName:
        raise OSError(
            errno.EINVAL,
            "not a valid file path inside a checkpoint (empty, '.' or '..' "
            "components, backslashes and control characters are refused)",
            path,
        ) from None


def edit_files(
    tree: CheckpointTree,
    ref: str,
    edit: Callable[[dict[str, FileRecord]], dict[str, FileRecord]],
    *,
    create: bool,
    op: str,
    message: str,
    overwrite: bool = False,
) -> Digest:
    """Change a ref's files by compare-and-swap, re-reading and editing again when another
    writer wins; ``edit`` may run more than once and may raise to abort. A gate, a ``best``
    pointer or a ref the stored policy protects changes only with ``overwrite`` (ProtectedRef,
    a FileExistsError, otherwise)."""
    repo = tree.repo

    def edited(current: RefRecord | None) -> Digest:
        if current is None:
            if not create:
                raise FileNotFoundError(errno.ENOENT, "no such ref", ref)
            files: dict[str, FileRecord] = {}
            meta: dict[str, Any] = {"source": "cas://"}
        else:
            manifest = repo.manifest(current.target)
            if manifest.kind != "files":
                raise read_only_state(ref)
            files, meta = file_records(manifest), manifest.meta
        new_manifest = files_manifest(
            edit(dict(files)),
            meta,
            current.target if current else None,
            repo.clock(),
            repo.config.chunk_size,
        )
        return repo.put_manifest(new_manifest)

    try:
        record = repo.update_ref(
            ref, edited, op=op, message=message, attempts=MAX_REF_RETRIES, overwrite=overwrite
        )
    finally:
        tree.invalidate()
    assert record is not None
    return record.target


def put_record(
    tree: CheckpointTree,
    path: str,
    record: FileRecord,
    *,
    exclusive: bool = False,
    overwrite: bool = False,
) -> None:
    """Make a file visible: add or replace its entry in the owning ref (the commit point)."""
    ref, rel = file_location(tree, path)

    def add(files: dict[str, FileRecord]) -> dict[str, FileRecord]:
        if exclusive and rel in files:
            raise FileExistsError(errno.EEXIST, "file exists", path)
        check_file_fits(files, rel, path)
        files[rel] = record
        return files

    edit_files(tree, ref, add, create=True, op="fs-write", message=rel, overwrite=overwrite)


def check_file_fits(files: Mapping[str, object], rel: str, path: str) -> None:
    """Refuse a file at ``rel`` over a directory of ``files`` or below one of its files."""
    if any(name.startswith(rel + "/") for name in files):
        raise IsADirectoryError(errno.EISDIR, "is a directory", path)
    parts = rel.split("/")
    for i in range(1, len(parts)):
        if "/".join(parts[:i]) in files:
            raise NotADirectoryError(errno.ENOTDIR, "a parent of this path is a file", path)


def rename_within_ref(tree: CheckpointTree, src: str, dst: str) -> bool:
    """Rename an ingested file inside its checkpoint by one compare-and-swap; False if ``dst``
    belongs to another checkpoint (the caller then copies the entry and removes the source)."""
    ref, rel = tree.owner(src)
    _, _, view = tree.file(src)
    if ref is None or view.record is None or file_location(tree, dst)[0] != ref:
        return False
    new_rel = file_location(tree, dst)[1]

    def rename(files: dict[str, FileRecord]) -> dict[str, FileRecord]:
        if rel not in files:
            raise FileNotFoundError(errno.ENOENT, "no such file", src)
        files[new_rel] = files.pop(rel)
        return files

    edit_files(tree, ref, rename, create=False, op="fs-mv", message=f"{rel} -> {new_rel}")
    return True


class TextWriteFile(io.TextIOWrapper):
    """Text-mode writing (``fs.open(path, "w")``): like the binary file, a ``with`` block that
    raises discards the file instead of committing what was written so far."""

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None and isinstance(self.buffer, CASWriteFile):
            self.buffer.__exit__(exc_type, *rest)
            return
        super().__exit__(exc_type, *rest)
