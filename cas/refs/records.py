"""Ref records: the msgpack document a ref's blob holds, and its encoding and decoding.

A record names the ref's current target, its recent history inline and the sealed segments that
hold older history (``cas.refs.segments``). A fence record (version 3) stands where no ref is: GC
writes one over a dead writer's declared commit so that the writer's create-only write fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from cas.blobstore.base import Version
from cas.digest import Digest, parse_digest
from cas.errors import CASError, FormatError, NotFound
from cas.model.bounded import unpack_bounded
from cas.names import RefName, parse_ref_name
from cas.refs import segments
from cas.refs.keys import is_hashed_key, name_in_key, ref_key
from cas.refs.liveness import ProcessIdentity

REF_FORMAT = "cas-ref"
REF_VERSION = 1
"""Records without sealed history are written as version 1, which older readers understand."""
REF_VERSION_SEALED = 2
"""Records that list sealed history segments: an older reader refuses them rather than lose history."""
REF_VERSION_FENCE = 3
"""A fence record: GC fenced a dead writer's commit of a ref that did not exist; read as absent."""
MAX_REF_BLOB = 16 << 20
MAX_RECORD_NESTING = 8
"""msgpack levels a ref record nests: its map, the history list, an event, a writer."""
MAX_STORED_HISTORY = 12_000
"""The most events a reader takes from one record. A writer keeps fewer than 10,128
(``cas.refs.store.MAX_HISTORY`` and two segments' worth); of a record listing more (a sealed
segment listed again and again, or older history than a writer keeps), the repeats and the oldest
events past this are left out, and ``RefRecord.ignored_history`` counts them."""


@dataclass(frozen=True)
class RefEvent:
    """One change of a ref: what it pointed at afterwards, when, and why."""

    target: Digest
    time: float
    op: str
    message: str = ""


@dataclass(frozen=True)
class SealedHistory:
    """A segment of a ref's older history, stored as an immutable manifest."""

    digest: Digest
    count: int
    until: float
    """The latest time one of its events was superseded: GC's reflog window reads a segment only
    if this falls inside the window."""


@dataclass(frozen=True)
class DamagedEvent:
    """A history entry that cannot be read (a target that is no digest, a missing field): kept
    as stored, so no rewrite of the record loses it, and reported until ``cas repair``."""

    raw: Any
    reason: str


@dataclass(frozen=True)
class RefRecord:
    """A ref as stored: its current target, its recent history (oldest first, current last) and
    the sealed segments holding older history (oldest first). ``RefStore.events`` walks all of it.
    """

    name: RefName
    target: Digest
    history: tuple[RefEvent, ...]
    version: Version | None = None
    """The blob version this record was read at; compare-and-swap uses it."""
    sealed: tuple[SealedHistory, ...] = ()
    damaged_events: tuple[DamagedEvent, ...] = field(default=(), compare=False)
    """Inline history entries that cannot be read: left out of ``history``, written back as
    they were (under ``damaged``) whenever the record is rewritten."""
    legacy_key: str | None = field(default=None, compare=False)
    """Set when the record was read from the key an older cas gave a long name
    (``cas.refs.keys.legacy_key``); the next update moves it to its current key."""
    ignored_history: int = field(default=0, compare=False)
    """Events the stored record lists that reading left out (``MAX_STORED_HISTORY``); the next
    update writes the record without them."""

    @property
    def depth(self) -> int:
        """How many events the whole history holds."""
        return segments.total(self.history, self.sealed)

    def problems(self) -> list[str]:
        """What is wrong with the record though it can be read: its unreadable history entries."""
        return [f"history entry {e.raw!r:.60}: {e.reason}" for e in self.damaged_events]


@dataclass(frozen=True)
class FencedWriter:
    """A writer whose commit a fence record stops: who it was and where it ran."""

    writer: str
    host: str
    pid: int
    boot_id: str = ""
    pid_ns: str = ""
    pid_start: int = 0

    @classmethod
    def of(cls, writer: str, who: ProcessIdentity) -> FencedWriter:
        """The fenced writer ``writer`` whose process is ``who``."""
        return cls(writer, who.host, who.pid, who.boot_id, who.pid_ns, who.pid_start)

    def identity(self) -> ProcessIdentity:
        """Its process, to tell whether it is certainly dead (``cas.refs.liveness``)."""
        return ProcessIdentity(self.host, self.pid, self.boot_id, self.pid_ns, self.pid_start)


class FencedRef(NotFound):
    """The ref's blob is a fence record (no such ref); ``version`` is what a creator replaces,
    ``writers`` the writers it fences and ``at`` when GC first wrote it (its clock)."""

    def __init__(
        self,
        message: str,
        version: Version | None,
        writers: tuple[FencedWriter, ...] = (),
        at: float = 0.0,
    ) -> None:
        super().__init__(message)
        self.version = version
        self.writers = writers
        self.at = at


def encode_ref(record: RefRecord, *, fence: str = "") -> bytes:
    """The msgpack bytes of a ref record; ``fence``, a token GC writes to change its version."""
    doc: dict[str, Any] = {
        "format": REF_FORMAT,
        "version": REF_VERSION_SEALED if record.sealed else REF_VERSION,
        "name": record.name,
        "target": record.target,
        "history": pack_events(record.history),
    }
    if record.sealed:
        doc["sealed"] = [[s.digest, s.count, s.until] for s in record.sealed]
    if record.damaged_events:
        doc["damaged"] = [e.raw for e in record.damaged_events]
    if fence:
        doc["fence"] = fence
    packed: bytes = msgpack.packb(doc)
    return packed


def encode_fence(
    name: RefName, token: str, writers: tuple[FencedWriter, ...] = (), at: float = 0.0
) -> bytes:
    """A fence record: stands where no ref is, so a paused creator's create-only write fails.
    ``writers`` are the writers it stops; it may go once none of them can write again."""
    doc = {
        "format": REF_FORMAT,
        "version": REF_VERSION_FENCE,
        "name": name,
        "fence": token,
        "writers": [_pack_writer(w) for w in writers],
        "at": at,
    }
    packed: bytes = msgpack.packb(doc)
    return packed


def pack_events(events: tuple[RefEvent, ...]) -> list[list[Any]]:
    """Events as msgpack-ready lists (inline in a record, or in a sealed segment)."""
    return [[e.target, e.time, e.op, e.message] for e in events]


def unpack_events(raw: Any) -> tuple[RefEvent, ...]:
    """Events back from their msgpack lists; malformed ones raise (callers say where)."""
    return tuple(RefEvent(parse_digest(t), float(ts), str(op), str(msg)) for t, ts, op, msg in raw)


def _readable_events(raw: Any) -> tuple[tuple[RefEvent, ...], tuple[DamagedEvent, ...]]:
    """Inline events, each parsed alone: one bad entry must not make the whole ref unreadable
    (``show`` and ``save`` need only the target), so it is set aside with its reason."""
    if not isinstance(raw, list):
        raise FormatError(f"history is a {type(raw).__name__}, not a list")
    good: list[RefEvent] = []
    bad: list[DamagedEvent] = []
    for entry in raw:
        try:
            good.extend(unpack_events([entry]))
        except Exception as e:
            bad.append(DamagedEvent(entry, str(e) or type(e).__name__))
    return tuple(good), tuple(bad)


def _still_damaged(raw: Any) -> DamagedEvent:
    """An entry an earlier write set aside (see ``_readable_events``), with why it is unreadable."""
    _, bad = _readable_events([raw])
    return bad[0] if bad else DamagedEvent(raw, "set aside as unreadable by an earlier read")


def decode_ref(name: RefName, data: bytes, version: Version | None) -> RefRecord:
    """Parse a ref blob, refusing unknown formats and versions."""
    if len(data) > MAX_REF_BLOB:
        raise FormatError(f"ref {name!r} is larger than {MAX_REF_BLOB} bytes")
    try:
        try:
            doc: Any = _unpack(data, "its record")
        except FormatError as e:
            raise FormatError(f"ref {name!r} is corrupt: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != REF_FORMAT:
            raise FormatError(f"ref {name!r} is not a cas ref")
        if doc.get("version") == REF_VERSION_FENCE and "target" not in doc:
            raise _fence(name, doc, version)
        if doc.get("version") not in (REF_VERSION, REF_VERSION_SEALED):
            raise FormatError(f"ref {name!r} has unsupported version {doc.get('version')!r}")
        raw_history = doc["history"]
        if not isinstance(raw_history, list):
            raise FormatError(f"history is a {type(raw_history).__name__}, not a list")
        kept = raw_history[-MAX_STORED_HISTORY:]
        history, damaged = _readable_events(kept)
        earlier = doc.get("damaged", [])
        if not isinstance(earlier, list):
            raise FormatError("its damaged history entries are not a list")
        damaged += tuple(_still_damaged(raw) for raw in earlier)
        sealed, ignored_sealed = _newest_sealed(
            doc.get("sealed", ()), MAX_STORED_HISTORY - len(kept)
        )
        if not history:
            raise FormatError(f"ref {name!r} has no history")
        target = parse_digest(doc["target"])
        return RefRecord(
            name,
            target,
            history,
            version,
            sealed,
            damaged,
            ignored_history=len(raw_history) - len(kept) + ignored_sealed,
        )
    except (FormatError, FencedRef):
        raise
    except Exception as e:
        raise FormatError(f"ref {name!r} is corrupt: {e}") from e


def read_fence(data: bytes, version: Version | None) -> FencedRef | None:
    """The fence a ref blob holds, or None when it holds none (a ref, or something damaged)."""
    try:
        doc: Any = _unpack(data, "ref record")
    except FormatError:
        return None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != REF_FORMAT
        or doc.get("version") != REF_VERSION_FENCE
        or "target" in doc
    ):
        return None
    return _fence(str(doc.get("name", "?")), doc, version)


def _fence(name: str, doc: dict[str, Any], version: Version | None) -> FencedRef:
    at = doc.get("at", 0.0)
    return FencedRef(
        f"no ref named {name!r} (a fenced commit's record)",
        version,
        _fenced_writers(doc.get("writers")),
        float(at) if isinstance(at, (int, float)) else 0.0,
    )


UNKNOWN_WRITER = FencedWriter("?", "", 0)
"""Stands for the writers of a fence record that does not say (or garbles) whom it fences: one
never known to be dead, so only age removes that record."""


def _pack_writer(w: FencedWriter) -> list[Any]:
    # [writer, host, pid] as older versions wrote it, then what tells a live process from a dead
    # one with certainty; a record of three reads as one never known dead by its pid.
    base: list[Any] = [w.writer, w.host, w.pid]
    return [*base, w.boot_id, w.pid_ns, w.pid_start] if w.boot_id and w.pid_ns else base


def _fenced_writers(raw: Any) -> tuple[FencedWriter, ...]:
    try:
        writers = tuple(_unpack_writer(entry) for entry in raw)
    except (TypeError, ValueError):
        return (UNKNOWN_WRITER,)
    return writers or (UNKNOWN_WRITER,)


def _unpack_writer(entry: Any) -> FencedWriter:
    if not isinstance(entry, (list, tuple)) or len(entry) not in (3, 6):
        raise ValueError("not a fenced writer")
    writer, host, pid = str(entry[0]), str(entry[1]), int(entry[2])
    if len(entry) == 3:
        return FencedWriter(writer, host, pid)
    return FencedWriter(writer, host, pid, str(entry[3]), str(entry[4]), int(entry[5]))


def _newest_sealed(raw: Any, room: int) -> tuple[tuple[SealedHistory, ...], int]:
    """The sealed segments a record lists, oldest first, each once and newest first up to
    ``room`` events; and how many events the ones left out hold (each repeat counted)."""
    kept: list[SealedHistory] = []
    seen: set[Any] = set()
    ignored = 0
    for d, n, until in reversed(raw):
        if d in seen or room <= 0:
            ignored += n if isinstance(n, int) and n > 0 else 0
            continue
        segment = SealedHistory(parse_digest(d), _count(n), float(until))
        if segment.count > room:
            ignored += segment.count
            room = 0
            continue
        seen.add(d)
        room -= segment.count
        kept.append(segment)
    return tuple(reversed(kept)), ignored


def _unpack(data: bytes, what: str) -> Any:
    """A record's msgpack, decoded within the memory its size allows (``cas.model.bounded``);
    a sealed segment listed again and again is one list."""
    return unpack_bounded(data, what, max_depth=MAX_RECORD_NESTING, share=str)


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise FormatError(f"bad sealed segment size {value!r}")
    return value


def decode_stored(key: str, data: bytes, version: Version | None) -> RefRecord:
    """The record stored under ``key``, whose name the key spells or (hashed keys) holds."""
    if not is_hashed_key(key):
        return decode_ref(name_in_key(key), data, version)
    if len(data) > MAX_REF_BLOB:
        raise FormatError(f"ref blob {key!r} is larger than {MAX_REF_BLOB} bytes")
    try:
        doc: Any = _unpack(data, "its record")
        name = parse_ref_name(doc["name"])
    except (FormatError, KeyError, TypeError) as e:
        raise FormatError(f"ref blob {key!r} is corrupt: {e}") from None
    except CASError:
        raise
    except Exception as e:
        raise FormatError(f"ref blob {key!r} is corrupt: {e}") from e
    if ref_key(name) != key:
        raise FormatError(f"ref blob {key!r} holds the record of another ref, {name!r}")
    return decode_ref(name, data, version)
