"""Segmented histories: a short inline tail plus immutable sealed segments, read only as needed.

Both append-only structures of the ref layer, a ref's own history (``cas.refs.store``) and the
append log (``cas.refs.log``), keep their newest items inline, where one compare-and-swap
rewrites them, and move older ones into sealed segments that every later version shares, listed
oldest first. What they share lives here: walking the items newest or oldest first while
reading a segment only when the walk reaches it, finding the item some steps back, and refusing
a segment that holds a different number of items than its listing says. How a segment is stored
is each structure's own business (a manifest for ref history, a chunk for append logs; see
docs/format.md), passed in as ``read``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar

from cas.errors import FormatError


class Sealed(Protocol):
    """What the walk needs to know about a sealed segment without reading it."""

    @property
    def count(self) -> int:
        """How many items the segment holds."""
        ...


T = TypeVar("T")
S = TypeVar("S", bound=Sealed)


def newest_first(
    tail: Sequence[T], sealed: Sequence[S], read: Callable[[S], Sequence[T]]
) -> Iterator[T]:
    """Every item, newest first; a sealed segment is read when the walk gets to it."""
    yield from reversed(tail)
    for segment in reversed(sealed):
        yield from reversed(read(segment))


def oldest_first(
    tail: Sequence[T], sealed: Sequence[S], read: Callable[[S], Sequence[T]]
) -> Iterator[T]:
    """Every item, oldest first."""
    for segment in sealed:
        yield from read(segment)
    yield from tail


def steps_back(
    tail: Sequence[T], sealed: Sequence[S], read: Callable[[S], Sequence[T]], steps: int
) -> T | None:
    """The item ``steps`` back from the newest (0: the newest), reading one segment at most;
    None beyond the oldest."""
    if steps < 0:
        raise ValueError("steps back must not be negative")
    if steps < len(tail):
        return tail[-1 - steps]
    steps -= len(tail)
    for segment in reversed(sealed):
        if steps < segment.count:
            return read(segment)[-1 - steps]
        steps -= segment.count
    return None


def total(tail: Sequence[object], sealed: Sequence[Sealed]) -> int:
    """How many items the tail and the segments hold together."""
    return len(tail) + sum(s.count for s in sealed)


def check_count(items: Sequence[T], segment: Sealed, where: str) -> Sequence[T]:
    """``items`` if there are as many as the segment's listing says, else a FormatError."""
    if len(items) != segment.count:
        raise FormatError(f"{where} holds {len(items)} items, its listing says {segment.count}")
    return items
