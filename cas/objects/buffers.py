"""Buffers of a chunk read: gather a read's parts into one blob, scatter decoded bytes over many."""

from __future__ import annotations

from collections.abc import Sequence

from cas.digest import Digest
from cas.errors import IntegrityError


def gather(parts: Sequence[memoryview], size: int) -> bytearray:
    """The first ``size`` bytes of ``parts`` laid end to end, in one new buffer."""
    blob = bytearray(size)
    offset = 0
    for part in parts:
        n = min(len(part), size - offset)
        blob[offset : offset + n] = part[:n]
        offset += n
    return blob


def scatter(decoded: memoryview, outs: Sequence[memoryview], digest: Digest) -> None:
    """Copy a chunk's decoded bytes over ``outs``, whose sizes must sum to its size."""
    size = sum(len(out) for out in outs)
    if len(decoded) != size:
        raise IntegrityError(f"chunk {digest} has {len(decoded)} bytes, manifest says {size}")
    offset = 0
    for out in outs:
        out[:] = decoded[offset : offset + len(out)]
        offset += len(out)
