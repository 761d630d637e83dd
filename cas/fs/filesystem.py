"""CASFileSystem: the store as an fsspec filesystem, ``cas://<ref>/<file in the checkpoint>``.

``fsspec.open("cas://runs/r1/ckpt_phase2_step00045000/model.safetensors", store="/data/cas")``
(or with ``$CAS_STORE`` set, no option at all). The store comes from the ``store=`` storage
option (any URL ``cas.open`` takes; further options such as ``endpoint_url`` go to it), from an
open ``repo=`` Repository, else ``$CAS_STORE``, else a store that already exists at the default
place (none is created there: NotFound says how to name one). fsspec's generic options
(``anon``...) are ignored; any other option the store does not take is a TypeError naming it.

Paths and refs: refs and every prefix of a ref name are directories. A path belongs to the
*longest ref that is the path or one of its ancestors*; the rest of the path names a file inside
that checkpoint (see ``cas.fs.views`` for what a checkpoint shows). A new file whose path no ref
owns creates a ref at its parent directory (the longest prefix of it that is a valid ref name).
``mkdir`` of a path no ref owns creates a ref holding no files; inside a checkpoint, where
manifests hold files and not directories, an empty directory lives only in this filesystem object
until a file is written below it.

Writes stream: bytes are cut into chunks as they arrive (``cas.objects.streamcut``) and stored at once;
closing the file adds or replaces its entry in the owning ref's ``kind="files"`` manifest by
compare-and-swap on the ref, retried on conflict, so concurrent writers of different files in one
checkpoint never lose each other's files. Until close the file is invisible. A state saved with
``Repository.save`` is read-only here. A gate, a ``best`` pointer or a ref the stored policy
protects keeps its files: writing, renaming or removing one is refused (``ProtectedRef``, a
``FileExistsError``, when the file is opened) unless opened with ``fs.open(path, "wb",
overwrite=True)``. ``cp``/``mv`` of an ingested file copy its manifest entry,
not its bytes.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import os
import time
from collections.abc import Callable
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.spec import AbstractBufferedFile
from fsspec.utils import stringify_path

from cas.digest import digest_of_parts
from cas.errors import InvalidName, NotFound, RefConflict
from cas.fs.extents import FileRecord, FileView
from cas.fs.reading import CASReadFile, FileReadCache, ViewReader, read_view
from cas.fs.tree import CheckpointTree, Snapshot
from cas.fs.writes import (
    CASWriteFile,
    TextWriteFile,
    edit_files,
    file_location,
    put_record,
    read_only_state,
    rename_within_ref,
)
from cas.names import parse_ref_name
from cas.objects.chunkio import WriteStats
from cas.repo.config import CONFIG_KEY
from cas.repo.opening import STORE_ENV, default_store_url
from cas.repo.opening import open as open_store
from cas.repo.repository import Repository


def _join(base: str, name: str) -> str:
    return f"{base}/{name}" if base else name


def _is_under(path: str, root: str) -> bool:
    return not root or path == root or path.startswith(root + "/")


IGNORED_OPTIONS = frozenset(
    {"anon", "use_listings_cache", "listings_expiry_time", "max_paths", "asynchronous", "loop"}
)
"""fsspec options callers pass to any filesystem that mean nothing to a cas store: pandas, for
one, retries a refused write with ``anon=True``, and failing on that would hide why it was refused."""


def _open_for_fsspec(store: str | None, options: dict[str, Any]) -> Repository:
    """The store behind a ``cas://`` filesystem: ``store=``, else ``$CAS_STORE``, else an existing
    store at the default place; never a new store nobody asked for in the home directory."""
    options = {k: v for k, v in options.items() if k not in IGNORED_OPTIONS}
    if store is None and not os.environ.get(STORE_ENV):
        default = default_store_url()
        # Checked here: even opening a local store to look would make its directory.
        if not os.path.exists(os.path.join(default, CONFIG_KEY)):
            raise NotFound(
                f"cas:// needs a store: pass store=URL (a storage option) or set ${STORE_ENV}; "
                f"there is no store at the default {default} (`cas init` makes one)"
            )
        options.setdefault("create", False)
    try:
        return open_store(store, **options)
    except TypeError as e:
        if "unexpected keyword argument" not in str(e):
            raise
        known = "store, repo, cache_bytes, ref_cache_ttl, block_size, clock and cas.open's"
        raise TypeError(
            f"cas:// does not take the storage option {str(e).rpartition(' ')[2]} for the store "
            f"at {store or default_store_url()} (it takes {known})"
        ) from None


class _DefaultStore:
    """The store a bare ``cas://`` URL means right now; part of fsspec's instance-cache key, so a
    changed ``$CAS_STORE`` gives a new filesystem rather than a cached one on the old store."""

    def __get__(self, obj: object, owner: type | None = None) -> str:
        return default_store_url()


class CASFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """The ``cas://`` protocol; see the module docstring for paths, writes and views."""

    protocol = "cas"
    root_marker = ""
    _default_store = _DefaultStore()
    _extra_tokenize_attributes = ("_default_store",)

    def __init__(
        self,
        store: str | None = None,
        repo: Repository | None = None,
        *,
        cache_bytes: int = 64 << 20,
        ref_cache_ttl: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        block_size: int = 8 << 20,
        **store_options: Any,
    ) -> None:
        super().__init__(store=store, repo=repo)
        if repo is None:
            repo = _open_for_fsspec(store, store_options)
        self.repo = repo
        self.blocksize = block_size
        self.tree = CheckpointTree(repo, clock, ref_cache_ttl)
        self.reader = ViewReader(repo.chunk_reader(), FileReadCache(cache_bytes))
        self.write_stats = WriteStats()
        """Chunks written through this filesystem (new and reused), summed over every file."""

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        text = stringify_path(path)
        for prefix in ("cas://", "cas::"):
            if text.startswith(prefix):
                text = text[len(prefix) :]
        return text.strip("/")

    # -- refs and snapshots ----------------------------------------------------------------------

    def invalidate_cache(self, path: str | None = None) -> None:
        """Forget cached ref names and targets (manifests are immutable and stay cached)."""
        self.tree.invalidate()
        super().invalidate_cache(path)

    def file_view(self, path: str) -> FileView:
        """The view of the file at ``path`` as the store holds it now (what a reader pins)."""
        return self.tree.file(self._strip_protocol(path))[2]

    # -- reading ---------------------------------------------------------------------------------

    def _file_info(self, path: str, snapshot: Snapshot, view: FileView) -> dict[str, Any]:
        return {
            "name": path,
            "size": view.size,
            "type": "file",
            "ref": snapshot.ref,
            "manifest": snapshot.digest,
            "created": snapshot.manifest.created_at,
            "mode": view.mode,
            "synthesized": view.synthesized,
        }

    def _dir_info(self, path: str, snapshot: Snapshot | None = None) -> dict[str, Any]:
        info: dict[str, Any] = {"name": path, "size": 0, "type": "directory"}
        if snapshot is not None:
            info.update(
                ref=snapshot.ref, manifest=snapshot.digest, created=snapshot.manifest.created_at
            )
        return info

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        """Name, size, type; files and refs also carry ``ref``, ``manifest`` and ``created``."""
        path = self._strip_protocol(path)
        if not path:
            return self._dir_info("")
        ref, rel = self.tree.owner(path)
        snapshot = self.tree.snapshot(ref) if ref is not None else None
        if snapshot is not None:
            if rel in snapshot.views:
                return self._file_info(path, snapshot, snapshot.views[rel])
            if rel == "":
                return self._dir_info(path, snapshot)
            if rel in snapshot.dirs:
                return self._dir_info(path)
        if self.tree.is_prefix_dir(path) or path in self.tree.pseudo_dirs:
            return self._dir_info(path)
        raise FileNotFoundError(errno.ENOENT, "no such file or directory in the store", path)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        """Entries of a directory: child refs and ref prefixes, and files of the owning ref."""
        path = self._strip_protocol(path)
        info = self.info(path)
        if info["type"] == "file":
            return [info] if detail else [path]
        entries: dict[str, dict[str, Any]] = {}
        prefix = path + "/" if path else ""
        first = path.split("/")[0] if path else ""
        for name in self.tree.ref_names(first):
            if name.startswith(prefix) and name != path:
                child = prefix + name[len(prefix) :].split("/")[0]
                entries[child] = self._dir_info(child)
        ref, rel = self.tree.owner(path)
        snapshot = self.tree.snapshot(ref) if ref is not None else None
        if snapshot is not None:
            base = rel + "/" if rel else ""
            for file_path, view in snapshot.views.items():
                if not file_path.startswith(base):
                    continue
                head, sep, _ = file_path[len(base) :].partition("/")
                full = _join(path, head)
                if sep:
                    entries.setdefault(full, self._dir_info(full))
                elif full not in entries:
                    entries[full] = self._file_info(full, snapshot, view)
        for pseudo in self.tree.pseudo_dirs:
            if pseudo.rpartition("/")[0] == path and pseudo != path:
                entries.setdefault(pseudo, self._dir_info(pseudo))
        out = [entries[k] for k in sorted(entries)]
        return out if detail else [e["name"] for e in out]

    def read_view(self, view: FileView, start: int, out: memoryview, readahead: int = 0) -> int:
        """Fill ``out`` with the view's bytes from ``start``; a corrupt or missing chunk is a
        ``CorruptChunkError`` (an OSError, EIO). Returns the bytes read."""
        return read_view(self.reader, view, start, out, readahead)

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        """The file's bytes ``[start, end)`` (negative values count from the end)."""
        _, _, view = self.tree.file(self._strip_protocol(path))
        lo = 0 if start is None else (start if start >= 0 else max(0, view.size + start))
        hi = view.size if end is None else (end if end >= 0 else view.size + end)
        hi = min(hi, view.size)
        if lo >= hi:
            return b""
        buffer = bytearray(hi - lo)
        self.read_view(view, lo, memoryview(buffer))
        return bytes(buffer)

    def open(self, path: Any, mode: str = "rb", **kwargs: Any) -> Any:
        """fsspec's ``open``; text-mode writes get a wrapper that discards on an exception."""
        if "b" in mode or "r" in mode:
            return super().open(path, mode, **kwargs)
        text = {k: kwargs.pop(k) for k in ("encoding", "errors", "newline") if k in kwargs}
        return TextWriteFile(super().open(path, mode.replace("t", "") + "b", **kwargs), **text)

    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> AbstractBufferedFile:
        path = self._strip_protocol(path)
        if mode == "rb":
            snapshot, _, view = self.tree.file(path)
            return CASReadFile(
                self,
                path,
                view,
                self._file_info(path, snapshot, view),
                block_size,
                reader=self.reader,
                chunk_size=self.repo.config.chunk_size,
            )
        if mode in ("wb", "xb"):
            overwrite = bool(kwargs.pop("overwrite", False))
            if mode == "xb" and self.exists(path):
                raise FileExistsError(errno.EEXIST, "file exists", path)
            if self.isdir(path):
                raise IsADirectoryError(errno.EISDIR, "is a directory", path)
            ref, _ = file_location(
                self.tree, path
            )  # fail now, not at close, if it cannot hold a file
            owner = self.tree.snapshot(ref)
            if owner is not None and owner.manifest.kind != "files":
                raise read_only_state(ref)
            self.repo.check_replaceable(ref, overwrite=overwrite)  # before a byte is stored
            return CASWriteFile(
                self,
                path,
                mode,
                block_size or self.blocksize,
                autocommit,
                tree=self.tree,
                totals=self.write_stats,
                overwrite=overwrite,
            )
        raise ValueError(
            f"mode {mode!r} is not supported by cas://: files are read ('rb') or written whole "
            "('wb', 'xb'); a closed file's chunks are immutable, so there is no append"
        )

    def modified(self, path: str) -> dt.datetime:
        """When the manifest holding the path was created."""
        info = self.info(path)
        if "created" not in info:
            raise IsADirectoryError(errno.EISDIR, "a ref prefix has no time", path)
        return dt.datetime.fromtimestamp(info["created"], tz=dt.timezone.utc)

    created = modified

    def ukey(self, path: str) -> str:
        """Changes when the file's bytes may have changed: its chunk digests."""
        _, _, view = self.tree.file(self._strip_protocol(path))
        return digest_of_parts(
            [e.digest.encode() if e.digest else e.data or b"" for e in view.extents]
        )

    # -- writing ---------------------------------------------------------------------------------

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        """Write a whole file; ``mode="create"`` fails if it exists (checked at commit)."""
        with self.open(path, "xb" if mode == "create" else "wb", **kwargs) as f:
            f.write(value)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        """Copy a file: an ingested file's entry is copied (no chunk is read or written)."""
        path1, path2 = self._strip_protocol(path1), self._strip_protocol(path2)
        if self.isdir(path1):
            self.makedirs(path2, exist_ok=True)
            return
        _, _, view = self.tree.file(path1)
        if path1 == path2:
            return
        if view.record is not None:
            put_record(self.tree, path2, view.record)
            return
        with self.open(path1, "rb") as src, self.open(path2, "wb") as dst:
            while block := src.read(self.blocksize):
                dst.write(block)

    def mv(
        self,
        path1: Any,
        path2: Any,
        recursive: bool = False,
        maxdepth: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Move; one file within one checkpoint is renamed by a single compare-and-swap."""
        if isinstance(path1, str) and isinstance(path2, str) and not recursive:
            src, dst = self._strip_protocol(path1), self._strip_protocol(path2)
            if self.isfile(src):
                if path2.endswith("/") or self.isdir(dst):
                    dst = _join(dst, src.rsplit("/", 1)[-1])
                if src == dst:
                    return
                ref, _ = self.tree.owner(src)
                if (
                    self.tree.file(src)[2].record is None
                ):  # a view of a saved state: no file to move
                    raise read_only_state(ref or src)
                if rename_within_ref(self.tree, src, dst):
                    return
        super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)

    def rm_file(self, path: str) -> None:
        """Delete one file from its checkpoint."""
        self.rm(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        """Delete files and directories; a ref removed whole is deleted (chunks wait for GC)."""
        self.invalidate_cache()  # decide what to delete from a fresh listing, not a cached one
        paths = self.expand_path(path, recursive=recursive, maxdepth=maxdepth)
        files: dict[str, set[str]] = {}
        dirs: list[str] = []
        for p in paths:
            if self.info(p)["type"] == "directory":
                dirs.append(p)
                continue
            ref, rel = self.tree.owner(p)
            assert ref is not None
            files.setdefault(ref, set()).add(rel)
        whole = {
            d: self.tree.target(d)
            for d in dirs
            if recursive and maxdepth is None and self.tree.owner(d) == (d, "")
        }
        for ref, rels in files.items():
            if any(_is_under(ref, w) for w in whole):
                continue

            def drop(
                records: dict[str, FileRecord], rels: set[str] = rels
            ) -> dict[str, FileRecord]:
                return {k: v for k, v in records.items() if k not in rels}

            edit_files(
                self.tree, ref, drop, create=False, op="fs-rm", message=" ".join(sorted(rels))
            )
        for ref in sorted(whole, reverse=True):
            with contextlib.suppress(NotFound):  # a ref written meanwhile is a RefConflict
                self.repo.rm(ref, expected=whole[ref])
        for d in sorted(dirs, reverse=True):
            if d in whole:
                continue
            if not recursive:
                self.rmdir(d)
            elif self.exists(d):
                self._drop_if_empty(d)
        pseudo = self.tree.pseudo_dirs
        pseudo.difference_update({p for p in pseudo if any(_is_under(p, d) for d in dirs)})
        self.invalidate_cache()

    def _drop_if_empty(self, path: str) -> None:
        if not self.ls(path, detail=False):
            self.rmdir(path)

    def rmdir(self, path: str) -> None:
        """Remove an empty directory; an empty ref is deleted."""
        path = self._strip_protocol(path)
        if self.info(path)["type"] != "directory":
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
        if self.ls(path, detail=False):
            raise OSError(errno.ENOTEMPTY, "directory not empty", path)
        self.tree.pseudo_dirs.discard(path)
        if self.tree.owner(path) == (path, ""):
            self.repo.rm(path)
            self.invalidate_cache()

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        """Create a directory: a new ref with no files, or (inside a checkpoint) an empty folder."""
        path = self._strip_protocol(path)
        if self.exists(path):
            raise FileExistsError(errno.EEXIST, "file exists", path)
        ref, _ = self.tree.owner(path)
        if ref is not None:
            self.tree.pseudo_dirs.update(self._folders_to(ref, path, create_parents))
            return
        try:
            name = parse_ref_name(path)
        except InvalidName as e:
            raise PermissionError(errno.EACCES, f"cannot create a ref here: {e}", path) from e
        try:
            edit_files(self.tree, name, lambda files: files, create=True, op="fs-mkdir", message="")
        except RefConflict:
            self.invalidate_cache()
            if not self.isdir(path):
                raise

    def _folders_to(self, ref: str, path: str, create_parents: bool) -> list[str]:
        """The folders from ``ref`` down to ``path`` that do not exist yet (parents first)."""
        parts = path[len(ref) + 1 :].split("/")
        missing = []
        for i in range(1, len(parts) + 1):
            folder = _join(ref, "/".join(parts[:i]))
            if self.isfile(folder):
                raise NotADirectoryError(errno.ENOTDIR, "a parent of this path is a file", path)
            if i < len(parts) and not create_parents and not self.isdir(folder):
                raise FileNotFoundError(errno.ENOENT, "no such directory", folder)
            if not self.isdir(folder):
                missing.append(folder)
        return missing

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """``mkdir`` that tolerates an existing directory when ``exist_ok``.

        With ``exist_ok``, a directory that would be a new ref is only remembered here, as an
        object store's directories are: the ref appears with the first file written into it.
        ``fsspec.open(path, "wb")`` makes the parent directory before it opens the file, and a
        write that then fails must leave nothing behind, not an empty checkpoint.
        """
        path = self._strip_protocol(path)
        if not path:
            return
        if exist_ok and self.tree.owner(path)[0] is None and not self.exists(path):
            try:
                parse_ref_name(path)
            except InvalidName as e:
                raise PermissionError(errno.EACCES, f"cannot create a ref here: {e}", path) from e
            parts = path.split("/")
            self.tree.pseudo_dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
            return
        try:
            self.mkdir(path)
        except FileExistsError:
            if not exist_ok or not self.isdir(path):
                raise

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        """Create an empty file (files are immutable, so an existing one is only replaced)."""
        if truncate or not self.exists(path):
            self.pipe_file(path, b"")
