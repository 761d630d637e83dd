"""Bounded msgpack decoding: what a document will cost is measured before anything is allocated.

A stored document (a manifest, a ref record, a history segment) is untrusted: one msgpack byte
(``0x90``) is an empty list that costs Python 64 bytes, so 876 zstd'd bytes can hold 25 million
of them and cost gigabytes to unpack. ``unpack_bounded`` first walks the bytes without building
anything, adding up the memory the objects they declare will take and checking their nesting,
and refuses with one FormatError naming the document and the limit when the total is above the
document's budget. Only then does msgpack build the objects.

The budget is in proportion to the document's size, measured as what it holds rather than how it
happens to be stored (a hostile store may store it raw): ``DECODE_RATIO`` times its size
compressed with zstd, and never less than ``DECODE_FLOOR``. Real documents stay far below it: a
manifest's chunk digests do not compress, and its names and keys decode to a few times their size.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import zstandard

from cas.errors import FormatError
from cas.units import format_size

DECODE_FLOOR = 32 << 20
"""Bytes of memory any document may take to decode, whatever its size."""
DECODE_RATIO = 256
"""Bytes of memory a document may take to decode per byte of its size compressed."""
MAX_AMPLIFICATION = 128
"""The most bytes of Python objects one byte of msgpack builds (``{0: {}}``: 3 bytes, ~300):
a document smaller than ``DECODE_FLOOR / MAX_AMPLIFICATION`` cannot exceed the floor."""

LIST_COST = 64
"""Bytes a Python list takes before its items (object, GC header, allocator rounding)."""
MAP_COST = 232
"""Bytes a small dict takes before its items."""
MAP_ITEM_COST = 160
"""Bytes a dict's table grows by per item (key and value pointers, hash, spare room), and what
interning its str key costs (msgpack interns map keys)."""
SLOT_COST = 8
"""Bytes one item takes in its list: a pointer."""
SCALAR_COST = 32
"""Bytes an int or float takes (small ints, None and bools are shared and cost nothing)."""
STR_COST = 49
"""Bytes a str or bytes takes besides its characters."""

_PIECE = 1 << 20
_FIXED = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
"""Payload bytes of the fixed-size number types, by type byte."""
_LENGTH = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
"""Bytes of the length field of bin and str types, by type byte."""
_EXT_LENGTH = {0xC7: 1, 0xC8: 2, 0xC9: 4}
_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}
_DIGEST_HEADER = {bytes: b"\xc4\x20", str: b"\xd9\x40"}
"""How a 32-byte bin and a 64-character str start."""
_COUNT = {0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}
"""Bytes of the count field of array16/32 and map16/32, by type byte."""


def _refuse(what: str, reason: str) -> FormatError:
    return FormatError(f"{what} {reason}")


def measure(
    data: bytes,
    what: str,
    *,
    budget: int,
    max_depth: int,
    share: type[bytes] | type[str] | None = None,
) -> int:
    """The bytes of Python objects unpacking ``data`` (one msgpack document) will allocate.

    FormatError, before anything is built, when that is above ``budget``, when containers nest
    deeper than ``max_depth``, or when the bytes are not one well-formed document. With
    ``share``, repeats of a digest list of that digest type cost only their slot
    (``share_digest_lists``).
    """
    size = len(data)
    view = memoryview(data)
    open_items: list[int] = []  # items still to read in each open container, innermost last
    left = 1  # items still to read at the current level
    cost = 0
    seen_lists: set[int] = set()
    i = 0
    while True:
        if left == 0:
            if not open_items:
                break
            left = open_items.pop()
            continue
        if i >= size:
            raise _refuse(what, "is not valid msgpack: it ends inside a value")
        left -= 1
        b = data[i]
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
            i += 1
            if b >= 0xE0:
                cost += SCALAR_COST
            continue
        if 0xA0 <= b <= 0xBF:
            length = b & 0x1F
            i += 1 + length
            cost += STR_COST + length if length > 1 else 0
            continue
        if b in _FIXED:
            i += 1 + _FIXED[b]
            cost += SCALAR_COST
            continue
        if b in _LENGTH:
            width = _LENGTH[b]
            length = int.from_bytes(view[i + 1 : i + 1 + width], "big")
            i += 1 + width + length
            cost += STR_COST + length
            continue
        if b in _FIXEXT:
            i += 2 + _FIXEXT[b]
            cost += STR_COST + _FIXEXT[b]
            continue
        if b in _EXT_LENGTH:
            width = _EXT_LENGTH[b]
            length = int.from_bytes(view[i + 1 : i + 1 + width], "big")
            i += 2 + width + length
            cost += STR_COST + length
            continue
        if b <= 0x9F or b in _COUNT:
            if b <= 0x9F:
                count, header, is_map = b & 0x0F, 1, b <= 0x8F
            else:
                width = _COUNT[b]
                count = int.from_bytes(view[i + 1 : i + 1 + width], "big")
                header, is_map = 1 + width, b >= 0xDE
            if share is not None and 0x92 <= b <= 0x94:
                end = _digest_list_end(data, i, share)
                if end:
                    key = hash(view[i:end].tobytes())
                    if key in seen_lists:
                        i = end
                        continue
                    seen_lists.add(key)
            i += header
            if is_map:
                cost += MAP_COST + MAP_ITEM_COST * count
                count *= 2
            else:
                cost += LIST_COST + SLOT_COST * count
            if count > size - i:
                raise _refuse(what, f"declares {count} items in {size - i} bytes")
            if cost > budget:
                raise _over_budget(what, cost, budget)
            if count:
                if len(open_items) >= max_depth:
                    raise _refuse(what, f"nests deeper than {max_depth} levels")
                open_items.append(left)
                left = count
            continue
        raise _refuse(what, f"is not valid msgpack: byte 0x{b:02x} at offset {i}")
    if i != size:
        raise _refuse(what, "is not valid msgpack: bytes follow the document")
    if cost > budget:
        raise _over_budget(what, cost, budget)
    return cost


def _digest_list_end(data: bytes, at: int, digest: type[bytes] | type[str]) -> int:
    """Where the array at ``at`` ends if it is a digest list (``share_digest_lists``), else 0."""
    b = data[at]
    if not 0x92 <= b <= 0x94 or data[at + 1 : at + 3] != _DIGEST_HEADER[digest]:
        return 0
    i = at + 3 + (32 if digest is bytes else 64)
    for _ in range(b - 0x91):
        if i >= len(data):
            return 0
        b = data[i]
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
            i += 1
        elif b in _FIXED:
            number = data[i + 1 : i + 1 + _FIXED[b]]
            if b in (0xCA, 0xCB) and math.isnan(
                struct.unpack(">f" if b == 0xCA else ">d", number)[0]
            ):
                return 0  # NaN is not equal to itself: unpacking could not share it
            i += 1 + _FIXED[b]
        else:
            return 0
    return i


def share_digest_lists(digest: type[bytes] | type[str]) -> Callable[[list[Any]], list[Any]]:
    """A msgpack list hook that returns one list for every equal digest list.

    A digest list is ``[digest, number, ...]``: two to four items, the digest 32 bytes of bin or
    64 characters of str (``digest`` says which, so that no other list of a document is shared):
    a chunk's ``[digest, size]`` in a manifest, a sealed segment's ``[digest, count, until]`` in a
    ref record. A few KB of zstd'd document can name one a million
    times; shared as they are unpacked, the repeats cost a pointer each, which is what ``measure``
    charges them.
    """
    seen: dict[tuple[Any, ...], list[Any]] = {}
    size = 32 if digest is bytes else 64

    def share(item: list[Any]) -> list[Any]:
        if (
            2 <= len(item) <= 4
            and type(item[0]) is digest
            and len(item[0]) == size
            and all(type(x) in (int, float, bool) or x is None for x in item[1:])
        ):
            return seen.setdefault(tuple(item), item)
        return item

    return share


def _over_budget(what: str, cost: int, budget: int) -> FormatError:
    return _refuse(
        what,
        f"would take at least {format_size(cost)} of memory to decode, above its limit of "
        f"{format_size(budget)} ({DECODE_RATIO} x its size compressed, at least "
        f"{format_size(DECODE_FLOOR)})",
    )


def decode_budget(data: bytes) -> int:
    """The bytes of memory decoding ``data`` may take: ``DECODE_RATIO`` times its size compressed,
    at least ``DECODE_FLOOR``."""
    if len(data) * MAX_AMPLIFICATION <= DECODE_FLOOR:
        return DECODE_FLOOR
    # In pieces: a one-shot compress would allocate the document's size again for its output.
    compressor = zstandard.ZstdCompressor(level=1).compressobj()
    view = memoryview(data)
    compressed = sum(
        len(compressor.compress(view[at : at + _PIECE])) for at in range(0, len(data), _PIECE)
    )
    compressed += len(compressor.flush())
    return max(DECODE_FLOOR, DECODE_RATIO * compressed)


def unpack_bounded(
    data: bytes,
    what: str,
    *,
    max_depth: int,
    share: type[bytes] | type[str] | None = None,
) -> Any:
    """Unpack one msgpack document after ``measure`` found it within its ``decode_budget`` and
    ``max_depth``; with ``share``, equal digest lists are one list. A document too small to
    exceed the budget is not measured: msgpack's own stack limit bounds its nesting.

    Every failure is one FormatError naming ``what``: a document over its limits, malformed
    msgpack, or invalid UTF-8 in a string.
    """
    if len(data) * MAX_AMPLIFICATION > DECODE_FLOOR:
        budget = decode_budget(data)
        measure(data, what, budget=budget, max_depth=max_depth, share=share)
    try:
        if share is not None:
            hook = share_digest_lists(share)
            return msgpack.unpackb(data, raw=False, strict_map_key=False, list_hook=hook)
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except MemoryError as e:
        raise _refuse(what, f"does not fit in memory ({format_size(len(data))})") from e
    except msgpack.StackError as e:
        raise _refuse(what, "nests deeper than msgpack reads") from e
    except Exception as e:
        reason = str(e) or type(e).__name__
        raise _refuse(what, f"is not valid msgpack: {reason}") from e


MAX_RECORD_JSON = 1 << 20
"""Bytes a small JSON record (lease, lock, sweep, quarantine, store config) may take: the largest
cas writes, a lease naming the refs it commits, stays far below."""


def load_record_json(data: bytes, what: str, limit: int = MAX_RECORD_JSON) -> Any:
    """A small JSON record, or one FormatError naming ``what`` and the limit: larger than
    ``limit`` bytes (its objects then cost at most some 30 times that), nested deeper than
    Python's recursion limit, or not JSON."""
    if len(data) > limit:
        raise _refuse(what, f"is {format_size(len(data))}, above the limit of {format_size(limit)}")
    try:
        return json.loads(data)
    except RecursionError as e:
        raise _refuse(what, "nests deeper than a record can") from e
    except ValueError as e:
        raise _refuse(what, f"is not valid JSON: {e}") from e
