"""Checkpoint directories (e.g. a Hugging Face ``checkpoint-N/``): which files they hold, and how.

``inspect_directory`` walks a directory and returns ``(relative POSIX path, FileLayout)`` for every
regular file, sorted by path. The rules a user can rely on:

- **Only files are kept.** Empty directories are not recorded (as in git); ``cas get`` recreates
  the directories that contain files.
- **Symlinks** are followed only if they resolve inside the directory: a link to a file is stored
  as that file's bytes under the link's path, a link to a directory is walked under the link's
  path. A link that leaves the directory, dangles or creates a cycle is a ``FormatError``. (Hugging
  Face *cache* snapshots link to ``../../blobs``: put the resolved files, not the snapshot.)
- **Special files** (FIFOs, sockets, devices) and names that are not valid UTF-8 are a
  ``FormatError``.
- **Pickles.** Every file goes through ``inspect_file``, so ``optimizer.pt``, ``scheduler.pt`` and
  ``rng_state.pth`` are validated as weights-only by an opcode scan. ``training_args.bin`` is
  a pickled ``TrainingArguments`` object, which is *not* weights-only: by default it makes the
  whole put fail with a ``FormatError`` naming the file, because storing a pickle we could not
  validate means a later ``torch.load`` of the exported copy could run its code. With
  ``allow_opaque_pickles=True`` such files are stored as opaque bytes and never unpickled by cas.
"""

from __future__ import annotations

import os
import stat

from cas.errors import FormatError, NotFound
from cas.formats import inspect_file
from cas.formats.layout import FileLayout

__all__ = ["inspect_directory"]


def inspect_directory(
    path: str | os.PathLike[str], *, allow_opaque_pickles: bool = False
) -> list[tuple[str, FileLayout]]:
    """Describe every file under ``path``; see the module docstring for the rules."""
    top = os.fspath(path)
    if not os.path.isdir(top):
        if not os.path.lexists(top):
            raise NotFound(f"{top}: no such directory")
        raise FormatError(f"{top}: not a directory")
    root = os.path.realpath(top)
    files: list[tuple[str, FileLayout]] = []
    # (path as the user sees it, relative POSIX path, resolved paths of it and its ancestors)
    pending: list[tuple[str, str, tuple[str, ...]]] = [(top, "", (root,))]
    while pending:
        shown_dir, rel_dir, real_chain = pending.pop()
        with os.scandir(shown_dir) as entries:
            listing = sorted(entries, key=lambda e: e.name)
        for entry in listing:
            rel = f"{rel_dir}/{_utf8_name(entry)}" if rel_dir else _utf8_name(entry)
            target = _resolve(root, entry) if entry.is_symlink() else entry.path
            mode = os.stat(target).st_mode
            if stat.S_ISDIR(mode):
                real = os.path.realpath(target)
                if real in real_chain:
                    raise FormatError(f"{entry.path}: symlink creates a directory cycle")
                pending.append((entry.path, rel, (*real_chain, real)))
            elif stat.S_ISREG(mode):
                layout = inspect_file(entry.path, allow_opaque_pickles=allow_opaque_pickles)
                files.append((rel, layout))
            else:
                raise FormatError(f"{entry.path}: special file (FIFO, socket, device) not stored")
    files.sort(key=lambda item: item[0])
    return files


def _resolve(root: str, entry: os.DirEntry[str]) -> str:
    target = os.path.realpath(entry.path)
    if not _is_within(target, root):
        raise FormatError(f"{entry.path}: symlink points outside {root}")
    if not os.path.exists(target):
        raise FormatError(f"{entry.path}: dangling symlink")
    return target


def _is_within(inner: str, outer: str) -> bool:
    """True if ``inner`` is ``outer`` or below it (both resolved)."""
    return os.path.commonpath([inner, outer]) == outer


def _utf8_name(entry: os.DirEntry[str]) -> str:
    try:
        os.fsencode(entry.name).decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{entry.path!r}: file name is not valid UTF-8") from e
    return entry.name
