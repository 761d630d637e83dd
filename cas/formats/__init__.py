"""Checkpoint file formats: where the tensor bytes are inside files that ``cas put`` ingests.

``inspect_file`` recognises a file by its content, never only by its name:

- **safetensors**: an 8-byte little-endian header length, then a JSON object. Each tensor's
  ``data_offsets`` become a region. Any defect (truncation, offsets past the end, overlap, bad
  JSON, a header over 100 MiB, an unknown dtype) is a ``FormatError`` naming the file. Files not
  named ``.safetensors`` are only treated as such when the header length fits the file.
- **torch-zip** (``torch.save``'s default format): a zip holding ``<archive>/data.pkl``. The
  pickle is never unpickled and torch is not imported: its opcodes are scanned against the
  globals a weights-only state may name (``cas.formats._pickle_scan``), so a pickle that would
  run code is refused, naming the global. Each storage it names must be a record of its size;
  each uncompressed ``<archive>/data/<key>`` member becomes a region, named after the tensor that
  covers it (compressed members and big-endian files yield no regions).
- **legacy torch / raw pickles** (first byte ``0x80``, protocol 2 to 5): each pickle of the
  legacy layout (magic number, version, system info, the object, the storage keys) is scanned the
  same way and the storage sizes after them are checked; the bytes are stored as opaque. A file
  not named like a torch file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``) is taken for a pickle only
  if its opcodes read as one (``pickletools``, nothing executed); binary data that merely starts
  with those two bytes is opaque.
- anything else is **opaque**: no regions, cut by content-defined chunking.

A pickle that fails weights-only validation raises ``FormatError`` unless the caller passes
``allow_opaque_pickles=True``; then it is described as opaque and never read again. Only the
header of a safetensors file and the zip directory, local headers and ``data.pkl`` of a torch
file are read; tensor bytes are not read.

The layout describes the file at the moment of inspection: the caller must read the same
bytes (e.g. check size and mtime again) before cutting chunks from the regions.
"""

from __future__ import annotations

import os
import stat

from cas.errors import FormatError, NotFound
from cas.formats.layout import FileLayout, TensorRegion, opaque_layout

__all__ = ["FileLayout", "TensorRegion", "inspect_file"]

_ZIP_MAGIC = b"PK\x03\x04"


def inspect_file(path: str | os.PathLike[str], *, allow_opaque_pickles: bool = False) -> FileLayout:
    """Describe one regular file's format and tensor regions; see the module docstring."""
    # The parsers load on first use: a store opened to save or load never needs them.
    from cas.formats._safetensors import inspect_safetensors, looks_like_safetensors
    from cas.formats._torchzip import (
        TORCH_SUFFIXES,
        inspect_pickle,
        inspect_torch_zip,
        is_pickle_head,
        parses_as_pickle,
    )

    name = os.fspath(path)
    suffix = os.path.splitext(name)[1].lower()
    try:
        # O_NONBLOCK so that a FIFO is reported instead of blocking the open.
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError as e:
        raise NotFound(f"{name}: no such file") from e
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise FormatError(f"{name}: not a regular file")
    size = info.st_size
    with os.fdopen(fd, "rb") as stream:
        head = stream.read(16)
        if suffix == ".safetensors" or looks_like_safetensors(head, size):
            return inspect_safetensors(name, stream, size)
        if head.startswith(_ZIP_MAGIC):
            return inspect_torch_zip(
                name,
                stream,
                size,
                strict=suffix in TORCH_SUFFIXES,
                allow_opaque_pickles=allow_opaque_pickles,
            )
    # A file named like a torch file is a torch file; any other file that merely starts like a
    # pickle (two bytes) is checked only if it really is one, else it is stored as opaque bytes.
    if is_pickle_head(head) and (suffix in TORCH_SUFFIXES or parses_as_pickle(name)):
        return inspect_pickle(name, size, allow_opaque_pickles=allow_opaque_pickles)
    return opaque_layout(size)
