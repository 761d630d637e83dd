"""A read-only FUSE mount of a ref or ref prefix, built on ``CASFileSystem`` reads.

Any program (``sha256sum``, ``safe_open``, ``torch.load``, ``cp``) then reads checkpoints in
place: directory listings and sizes come from manifests, and each ``read`` fetches and verifies
only the chunks it touches. A chunk that fails verification is ``EIO`` for the reading program,
never wrong bytes. Writes are ``EROFS``.

The mount needs the optional ``fusepy`` package (``pip install 'cas[fuse]'``), the libfuse 2
library (Debian/Ubuntu: ``apt-get install fuse3 libfuse2``), a ``/dev/fuse`` device the user may
open (in a container: ``--device /dev/fuse --cap-add SYS_ADMIN``) and ``fusermount`` to unmount.
``fuse_unavailable_reason`` says which of these is missing.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import threading
from itertools import count
from typing import Any

from cas.fs.extents import FileView
from cas.fs.filesystem import CASFileSystem
from cas.repo.repository import Repository

_FUSE_DEVICE = "/dev/fuse"


def fuse_unavailable_reason() -> str | None:
    """Why a FUSE mount cannot work on this machine, or None if it can."""
    try:
        import fuse  # noqa: F401
    except ImportError:
        return "fusepy is not installed (pip install 'cas[fuse]')"
    except OSError as e:  # fusepy raises this when it cannot load libfuse
        return f"libfuse is not installed ({e}); on Debian/Ubuntu: apt-get install fuse3 libfuse2"
    if not os.path.exists(_FUSE_DEVICE):
        return f"{_FUSE_DEVICE} does not exist (a container needs --device /dev/fuse --cap-add SYS_ADMIN)"
    if not os.access(_FUSE_DEVICE, os.R_OK | os.W_OK):
        return f"no permission to open {_FUSE_DEVICE}"
    if shutil.which("fusermount") is None and shutil.which("fusermount3") is None:
        return "fusermount is not installed (apt-get install fuse3)"
    return None


def _operations_base() -> Any:
    try:
        from fuse import Operations
    except (ImportError, OSError):  # stay importable, so fuse_unavailable_reason can say why
        return object
    return Operations


_Operations: Any = _operations_base()


class ReadOnlyCAS(_Operations):  # type: ignore[misc]
    """fusepy operations serving ``root`` (a ref or prefix) of a CASFileSystem, read-only."""

    def __init__(self, fs: CASFileSystem, root: str) -> None:
        self.fs = fs
        self.root = root.strip("/")
        self.uid, self.gid = os.getuid(), os.getgid()
        self._handles: dict[int, FileView] = {}
        self._next = count(1)
        self._lock = threading.Lock()

    def _path(self, path: str) -> str:
        inner = path.strip("/")
        return f"{self.root}/{inner}" if self.root and inner else self.root or inner

    def _fail(self, code: int) -> Exception:
        from fuse import FuseOSError

        error: Exception = FuseOSError(code)
        return error

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        """Sizes and types from manifests; the manifest's creation time as every timestamp.

        On an open handle (``fstat``) the size is the pinned version's, even if the ref moved.
        """
        with self._lock:
            pinned = self._handles.get(fh) if fh is not None else None
        try:
            info = self.fs.info(self._path(path))
        except FileNotFoundError:
            raise self._fail(errno.ENOENT) from None
        except OSError as e:
            raise self._fail(e.errno or errno.EIO) from None
        when = float(info.get("created", 0.0))
        attrs: dict[str, Any] = {
            "st_uid": self.uid, "st_gid": self.gid, "st_atime": when, "st_mtime": when, "st_ctime": when,
        }  # fmt: skip
        if info["type"] == "directory":
            attrs.update(st_mode=stat.S_IFDIR | 0o555, st_nlink=2, st_size=0)
        else:
            size = pinned.size if pinned is not None else info["size"]
            attrs.update(st_mode=stat.S_IFREG | 0o444, st_nlink=1, st_size=size)
        return attrs

    def readdir(self, path: str, fh: int) -> list[str]:
        """Child refs, prefixes and files, by base name."""
        try:
            names = self.fs.ls(self._path(path), detail=False)
        except FileNotFoundError:
            raise self._fail(errno.ENOENT) from None
        return [".", "..", *(name.rsplit("/", 1)[-1] for name in names)]

    def open(self, path: str, flags: int) -> int:
        """Pin the file's current version for the life of the handle."""
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC):
            raise self._fail(errno.EROFS)
        try:
            view = self.fs.file_view(self._path(path))
        except FileNotFoundError:
            raise self._fail(errno.ENOENT) from None
        except IsADirectoryError:
            raise self._fail(errno.EISDIR) from None
        with self._lock:
            handle = next(self._next)
            self._handles[handle] = view
        return handle

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        """Verified bytes; a corrupt or missing chunk is EIO."""
        with self._lock:
            view = self._handles.get(fh)
        if view is None:
            raise self._fail(errno.EBADF)
        length = max(0, min(size, view.size - offset))
        buffer = bytearray(length)
        try:
            self.fs.read_view(view, offset, memoryview(buffer))
        except OSError:
            raise self._fail(errno.EIO) from None
        return bytes(buffer)

    def release(self, path: str, fh: int) -> int:
        """Forget the handle."""
        with self._lock:
            self._handles.pop(fh, None)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        """A read-only filesystem with no free space."""
        return {
            "f_bsize": 4096,
            "f_frsize": 4096,
            "f_blocks": 0,
            "f_bfree": 0,
            "f_bavail": 0,
            "f_namemax": 255,
        }

    def _read_only(self, *args: Any) -> None:
        raise self._fail(errno.EROFS)

    create = mkdir = rmdir = unlink = rename = write = truncate = chmod = chown = _read_only
    symlink = link = utimens = setxattr = removexattr = _read_only


def mount_readonly(
    repo: Repository, root: str, mountpoint: str, *, allow_other: bool = False
) -> None:
    """Serve ``root`` of the store at ``mountpoint`` until it is unmounted (blocks)."""
    from fuse import FUSE

    fs = CASFileSystem(repo=repo, skip_instance_cache=True)
    root = fs._strip_protocol(root)
    if root and not fs.exists(root):
        raise FileNotFoundError(errno.ENOENT, "no ref or prefix of refs by that name", root)
    if root and not fs.isdir(root):
        raise NotADirectoryError(errno.ENOTDIR, "mount a ref or a prefix of refs, not a file", root)
    options: dict[str, Any] = {"foreground": True, "ro": True, "nothreads": False, "fsname": "cas"}
    if allow_other:
        options["allow_other"] = True
    FUSE(ReadOnlyCAS(fs, root), mountpoint, **options)
