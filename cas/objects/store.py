"""Content-addressed objects: hash, encode and put chunks and manifests; get re-hashes and verifies.

Every stored object is an envelope::

    offset  size  field
    0       4     magic b"CASo"
    4       1     envelope version (1)
    5       1     codec id (cas.codecs; ids are never reused)
    6       2     length P of the codec parameters (u16, little-endian)
    8       8     decoded size (u64, little-endian)
    16      P     codec parameters
    16+P    ...   payload

and is stored under the blake3 digest of its *decoded* bytes, so the key never depends on the
codec. Chunks live under ``chunks/<d[:2]>/<d>``, manifests under ``manifests/<d[:2]>/<d>``.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from cas.blobstore.base import BlobStore
from cas.blobstore.bulk import DEFAULT_WORKERS, read_into
from cas.codecs import Codec, EncodeHints, codec_by_id, codec_by_name
from cas.digest import Digest, digest_of, digest_of_parts
from cas.errors import FormatError, IntegrityError, NotFound
from cas.objects import inventory
from cas.objects.keys import ObjectKind, StoredObject, object_key
from cas.objects.sweep import Sweeper, sweeper_for

OBJECT_MAGIC = b"CASo"
OBJECT_VERSION = 1
_HEADER = struct.Struct("<4sBBHQ")
HEADER_SIZE = _HEADER.size
MAX_PARAMS = 4096
DEFAULT_HINTS = EncodeHints()
MAX_DELTA_DEPTH = 64
"""A base chain deeper than this is treated as corrupt (a cycle or a hostile store)."""
CREATE_ATTEMPTS = 3
"""Create-only puts of a chunk that keeps vanishing right after losing, before it is overwritten."""


def chunk_key(digest: Digest) -> str:
    """The blob key of a chunk."""
    return object_key(ObjectKind.CHUNK, digest)


def manifest_key(digest: Digest) -> str:
    """The blob key of a manifest."""
    return object_key(ObjectKind.MANIFEST, digest)


@dataclass(frozen=True)
class Envelope:
    """A parsed object header."""

    codec_id: int
    decoded_size: int
    params: bytes
    payload_offset: int


def parse_envelope(data: bytes | bytearray | memoryview, max_decoded_size: int) -> Envelope:
    """Parse and bound-check an object header."""
    if len(data) < HEADER_SIZE:
        raise FormatError("object shorter than its header")
    magic, version, codec_id, params_len, decoded_size = _HEADER.unpack_from(data, 0)
    if magic != OBJECT_MAGIC:
        raise FormatError("not a cas object (bad magic)")
    if version != OBJECT_VERSION:
        raise FormatError(f"object envelope version {version} is not supported (expected 1)")
    if params_len > MAX_PARAMS or HEADER_SIZE + params_len > len(data):
        raise FormatError("object header parameters out of bounds")
    if decoded_size > max_decoded_size:
        raise FormatError(
            f"object declares {decoded_size} bytes, above the limit {max_decoded_size}"
        )
    params = bytes(data[HEADER_SIZE : HEADER_SIZE + params_len])
    return Envelope(codec_id, decoded_size, params, HEADER_SIZE + params_len)


def encode_header(codec: Codec, params: bytes, decoded_size: int) -> bytes:
    """The header bytes that precede a payload."""
    return (
        _HEADER.pack(OBJECT_MAGIC, OBJECT_VERSION, codec.codec_id, len(params), decoded_size)
        + params
    )


@dataclass(frozen=True)
class PutResult:
    """What storing one chunk did: ``stored_bytes`` is 0 when the chunk already existed."""

    digest: Digest
    size: int
    stored_bytes: int
    new: bool
    base: Digest | None = None
    """The chunk the *stored* encoding is against (delta codecs), for a new chunk and an existing
    one alike: a writer that reuses a chunk must record its base chain in the manifest (GC reads
    manifests only). When a concurrent writer stored the chunk first, this is that writer's base,
    whatever this call encoded against, and ``new`` is False."""


@dataclass(frozen=True)
class CopiedObject:
    """What ``ObjectStore.copy`` did with one object."""

    kind: ObjectKind
    digest: Digest
    created: bool
    """False when the destination held the object already: its own encoding stayed."""
    size: int
    """Decoded bytes."""
    stored_bytes: int
    """Encoded bytes as stored here (what was written when ``created``)."""
    base: Digest | None
    """The delta base the copied encoding needs (it must travel too)."""


class ObjectStore:
    """Chunks and manifests on a BlobStore: dedup on put, verification on get.

    ``put_chunk`` of a chunk that already exists writes nothing but refreshes its modification
    time, so an age-based GC sweep running concurrently spares it (dulwich's "freshen"). New
    chunks are written create-only, so the first stored encoding of a chunk is never replaced by
    a concurrent writer's (see ``_create``).
    """

    def __init__(self, blobs: BlobStore, *, max_object_size: int = 256 << 20) -> None:
        self.blobs = blobs
        self.max_object_size = max_object_size

    def has_chunk(self, digest: Digest) -> bool:
        """Whether the chunk is stored."""
        return self.blobs.has(chunk_key(digest))

    def put_chunk(
        self,
        data: memoryview | bytes,
        codec: Codec,
        hints: EncodeHints = DEFAULT_HINTS,
        digest: Digest | None = None,
        *,
        freshen: bool = True,
        replace: bool = False,
        encoded: tuple[bytes, bytes | memoryview] | None = None,
    ) -> PutResult:
        """Store one chunk unless present; return its digest, the bytes written and its base.

        Presence is learnt from the stored header, which also gives the base an existing chunk
        was delta-encoded against. A chunk found absent is written create-only: if another writer
        stored it meanwhile, its encoding stays and the result carries its base. An existing
        chunk whose header is unreadable (damaged, or an unknown codec) is written again;
        ``replace=True`` always writes, e.g. to re-encode a chunk standalone when its stored base
        chain is broken (safe against any writer: a standalone chunk needs no base). Decoded
        bytes, hence identity, never change. ``encoded`` is ``codec.encode(data, hints)`` when the
        caller already has it.
        """
        view = memoryview(data).cast("B")
        digest = digest or digest_of(view)
        key = chunk_key(digest)
        if not replace:
            present, base = self._stored_base(key)
            if present:
                if not freshen:
                    return PutResult(digest, len(view), 0, False, base)
                try:
                    self.blobs.touch(key)
                except FileNotFoundError:
                    pass  # swept between the header read and touch(): write it again
                else:
                    return PutResult(digest, len(view), 0, False, base)
        params, payload = encoded if encoded is not None else codec.encode(view, hints)
        header = encode_header(codec, params, len(view))
        if replace:
            self.blobs.put(key, (header, payload))
        else:
            outcome = self._create(key, (header, payload), freshen)
            if outcome is None:
                # Damaged, or gone again after every lost create: overwrite it, standalone, so
                # whichever of several repairing writers lands last, no manifest needs its base.
                if codec.needs_base:
                    codec = codec_by_name("zstd")
                    params, payload = codec.encode(view, hints)
                    header = encode_header(codec, params, len(view))
                self.blobs.put(key, (header, payload))
            elif not outcome[0]:
                return PutResult(digest, len(view), 0, False, outcome[1])
        base = codec.base_of(params) if codec.needs_base else None
        return PutResult(digest, len(view), len(header) + len(payload), True, base)

    def _create(
        self, key: str, parts: tuple[bytes, bytes | memoryview], freshen: bool
    ) -> tuple[bool, Digest | None] | None:
        """Write a new chunk create-only: ``(True, None)`` if this call stored it, else
        ``(False, base)`` with the base of the encoding another writer stored first.

        Two writers can both find a chunk absent and encode it against different bases. Were the
        second write to replace the first, the first writer's manifest would record a base the
        stored chunk no longer needs, and GC, which reads manifests only, could sweep the one it
        does need. So the first write stays and the others record its base instead, refreshing
        it like any reused chunk. ``None`` says the caller must overwrite: the chunk is there but
        unreadable (damaged), or it vanished right after each lost create.
        """
        for _ in range(CREATE_ATTEMPTS):
            if self.blobs.put_if_absent(key, parts):
                return True, None
            present, base = self._stored_base(key)
            if present:
                try:
                    if freshen:
                        self.blobs.touch(key)
                except FileNotFoundError:
                    continue  # swept since: try to create it again
                return False, base
            if self.blobs.has(key):
                break  # damaged: no manifest can depend on how it is encoded
        return None  # the caller overwrites it

    def _stored_base(self, key: str) -> tuple[bool, Digest | None]:
        """``(present and readable, base)`` of a stored chunk, from its header only."""
        try:
            head = self.blobs.get_range(key, 0, HEADER_SIZE + MAX_PARAMS)
            envelope = parse_envelope(head, self.max_object_size)
            return True, codec_by_id(envelope.codec_id).base_of(envelope.params)
        except (NotFound, FormatError):
            return False, None

    def stored_size(self, digest: Digest) -> int:
        """Bytes the chunk occupies in the store."""
        return self.blobs.stat(chunk_key(digest)).size

    def get_chunk(self, digest: Digest) -> bytes | memoryview:
        """The verified decoded bytes of a chunk; IntegrityError if they do not hash to ``digest``.

        Delta bases on the way are decoded but not hashed one by one: a base with a wrong byte
        makes the chunk built on it hash wrong, so checking the chunk itself catches it, and a
        chain of depth d costs one hash instead of d + 1.
        """
        key = chunk_key(digest)
        try:
            return self._verified(digest, self.blobs.get(key))
        except IntegrityError:
            # A cached copy that fails (damaged on the local disk, or stored against a base the
            # remote has since dropped) is read again from the store itself, chain included.
            if not self.blobs.drop_cached(key):
                raise
            self._drop_cached_chain(digest)
            return self._verified(digest, self.blobs.get(key))

    def _drop_cached_chain(self, digest: Digest) -> None:
        """Drop cached copies of the bases the stored ``digest`` depends on (headers only)."""
        current: Digest | None = digest
        for _ in range(MAX_DELTA_DEPTH):
            try:
                current = self.chunk_base(current) if current is not None else None
            except (NotFound, IntegrityError):
                return
            if current is None:
                return
            self.blobs.drop_cached(chunk_key(current))

    def _verified(self, digest: Digest, blob: bytes | bytearray) -> bytes | memoryview:
        decoded = self._decode(digest, blob)
        if digest_of(decoded) != digest:
            raise IntegrityError(
                f"chunk {digest} is corrupt: its bytes (or a delta base's) hash to something else"
            )
        return decoded

    def read_chunk_into(self, digest: Digest, out: memoryview) -> None:
        """Fill ``out`` (exactly the chunk's size) with the verified chunk bytes."""
        self.read_chunk_parts(digest, [out])

    def read_chunk_parts(self, digest: Digest, outs: Sequence[memoryview]) -> None:
        """Scatter the verified chunk bytes over ``outs`` in order (their sizes sum to the chunk's).

        On stores that read in place (local files) a raw chunk goes straight from its file into
        the buffers in one read and is hashed there, with no intermediate copy: a reader whose
        range ends inside a chunk gets that head in its own buffer and the rest in a side buffer.
        """
        key = chunk_key(digest)
        size = sum(len(out) for out in outs)
        if self.blobs.reads_in_place:
            header = memoryview(bytearray(HEADER_SIZE))
            got = read_into(self.blobs, key, 0, [header, *outs])
            if got < HEADER_SIZE:
                raise IntegrityError(f"chunk {digest} is corrupt: shorter than its header")
            # Only the fixed fields are here; other codecs' parameters follow and are checked
            # by get_chunk below.
            magic, version, codec_id, params_len, decoded_size = _HEADER.unpack_from(header, 0)
            raw = (magic, version, codec_id, params_len) == (OBJECT_MAGIC, OBJECT_VERSION, 0, 0)
            if raw and decoded_size == size:
                if got != HEADER_SIZE + size or digest_of_parts(outs) != digest:
                    raise IntegrityError(
                        f"chunk {digest} is corrupt: its bytes hash to something else"
                    )
                return
            if got < HEADER_SIZE + size:
                # An encoded chunk smaller than its decoded bytes was read whole: decode that copy
                # rather than reading the file again.
                blob = _gather([header, *outs], got)
                decoded = memoryview(self._verified(digest, blob)).cast("B")
                _scatter(decoded, outs, digest)
                return
        _scatter(memoryview(self.get_chunk(digest)).cast("B"), outs, digest)

    def _decode(self, digest: Digest, blob: bytes | bytearray) -> bytes | memoryview:
        """The decoded bytes of a stored object, unverified; a delta is rebuilt from the bottom of
        its base chain up.

        The chain is walked by headers first (one small read per hop), refusing loops, chains
        deeper than MAX_DELTA_DEPTH and bases of another size, so nothing is decompressed for a
        chain that cannot be rebuilt. Each level is then decoded on the one below, so a read
        holds one base, one payload and one result at a time, however deep the chain.
        """
        try:
            envelope = parse_envelope(blob, self.max_object_size)
            chain = self._base_chain(digest, envelope)
            below: tuple[Digest, bytes | memoryview] | None = None
            for base in reversed(chain):
                try:
                    base_blob = self.blobs.get(chunk_key(base))
                except NotFound as e:
                    raise IntegrityError(f"delta base {base} is missing from the store") from e
                base_envelope = parse_envelope(base_blob, self.max_object_size)
                below = (base, _decode_level(base_envelope, base_blob, below))
                del base_blob  # only the decoded base is needed from here up
            return _decode_level(envelope, blob, below)
        except FormatError as e:
            raise IntegrityError(f"chunk {digest} is corrupt: {e}") from e

    def _base_chain(self, digest: Digest, envelope: Envelope) -> list[Digest]:
        """The bases a stored object needs, nearest first, from their headers alone."""
        chain: list[Digest] = []
        base = codec_by_id(envelope.codec_id).base_of(envelope.params)
        while base is not None:
            if base == digest or base in chain or len(chain) >= MAX_DELTA_DEPTH:
                raise IntegrityError(
                    f"chunk {digest}: delta chain loops or is deeper than {MAX_DELTA_DEPTH}"
                )
            chain.append(base)
            try:
                head = self.blobs.get_range(chunk_key(base), 0, HEADER_SIZE + MAX_PARAMS)
            except NotFound as e:
                raise IntegrityError(f"delta base {base} is missing from the store") from e
            found = parse_envelope(head, self.max_object_size)
            if found.decoded_size != envelope.decoded_size:
                raise FormatError(
                    f"delta base {base} holds {found.decoded_size} bytes, "
                    f"the chunk {envelope.decoded_size}"
                )
            base = codec_by_id(found.codec_id).base_of(found.params)
        return chain

    def chunk_base(self, digest: Digest) -> Digest | None:
        """The base chunk a delta-encoded chunk depends on, read from its header only."""
        head = self.blobs.get_range(chunk_key(digest), 0, HEADER_SIZE + MAX_PARAMS)
        try:
            envelope = parse_envelope(head, self.max_object_size)
            return codec_by_id(envelope.codec_id).base_of(envelope.params)
        except FormatError as e:
            raise IntegrityError(f"chunk {digest} is corrupt: {e}") from e

    def put_manifest(self, data: bytes, codec: Codec) -> Digest:
        """Store an encoded manifest; return its digest."""
        digest = digest_of(data)
        key = manifest_key(digest)
        if not self.blobs.has(key):
            params, payload = codec.encode(memoryview(data), EncodeHints(level=3))
            self.blobs.put(key, (encode_header(codec, params, len(data)), payload))
        else:
            self.blobs.touch(key)
        return digest

    def get_manifest(self, digest: Digest) -> bytes:
        """The verified bytes of a manifest."""
        try:
            blob = self.blobs.get(manifest_key(digest))
        except NotFound as e:
            raise NotFound(f"manifest {digest} is missing from the store") from e
        decoded = bytes(self._decode(digest, blob))
        if digest_of(decoded) != digest:
            raise IntegrityError(f"manifest {digest} is corrupt: its bytes hash to something else")
        return decoded

    def map_raw_chunk(self, digest: Digest, size: int) -> memoryview | None:
        """A raw chunk's bytes mapped copy-on-write from its local file, verified; None where
        the store has no local files or the chunk is not stored raw (read it instead).

        NotFound if the chunk is missing; IntegrityError if its bytes do not hash to ``digest``.
        """
        path = self.blobs.local_path(chunk_key(digest))
        if path is None:
            return None
        try:
            with path.open("rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except FileNotFoundError as e:
            raise NotFound(f"chunk {digest} is missing from the store") from e
        if len(mapped) != HEADER_SIZE + size or mapped[5] != 0:
            mapped.close()
            return None  # not a raw chunk
        payload = memoryview(mapped)[HEADER_SIZE:]
        if digest_of(payload) != digest:
            raise IntegrityError(f"chunk {digest} is corrupt: its bytes hash to something else")
        return payload

    # -- the store as a whole: what retention and transfers ask of it ---------------------------

    @property
    def url(self) -> str:
        """Where the objects live."""
        return self.blobs.url

    def sync(self) -> None:
        """Make every object stored so far durable (before a manifest or ref names them)."""
        self.blobs.sync()

    def list_objects(self, kind: ObjectKind) -> Iterator[StoredObject]:
        """Every stored object of ``kind`` with its stored size and mtime (one listing)."""
        return inventory.list_objects(self.blobs, kind)

    def stat(self, kind: ObjectKind, digest: Digest) -> StoredObject:
        """Stored size and mtime of one object; NotFound if it is not stored."""
        return inventory.stat_object(self.blobs, kind, digest)

    def stored_sizes(
        self, objects: Iterable[tuple[ObjectKind, Digest]]
    ) -> dict[tuple[ObjectKind, Digest], int]:
        """Stored bytes of each object (missing ones left out), by ``stat`` or one listing."""
        return inventory.stored_sizes(self.blobs, objects)

    def has_many(
        self, kind: ObjectKind, digests: Iterable[Digest], workers: int = DEFAULT_WORKERS
    ) -> dict[Digest, bool]:
        """Whether each object is stored, asked ``workers`` at a time."""
        return inventory.present(self.blobs, kind, digests, workers)

    def missing(self, kind: ObjectKind, digests: Sequence[Digest]) -> tuple[set[Digest], str]:
        """Which objects are not stored, by existence requests or by listing, whichever costs
        fewer requests; and which was used (``has`` or ``list``)."""
        return inventory.missing(self.blobs, kind, digests)

    def freshen(
        self, kind: ObjectKind, digests: Iterable[Digest], workers: int = DEFAULT_WORKERS
    ) -> list[Digest]:
        """Refresh each object's mtime so an age-based GC spares it; return those not stored."""
        return inventory.freshen(self.blobs, kind, digests, workers)

    def sweeper(self) -> Sweeper:
        """The safest way this store allows to delete GC's candidates (``cas.objects.sweep``)."""
        return sweeper_for(self.blobs)

    def verify(self, digest: Digest) -> int:
        """Re-read and re-hash a chunk; its decoded size. IntegrityError or NotFound if bad."""
        return len(self.get_chunk(digest))

    def verify_stored(
        self, kind: ObjectKind, digest: Digest, blob: bytes | bytearray
    ) -> bytes | memoryview:
        """The decoded bytes of a stored object ``blob`` (delta bases read from this store),
        checked against ``digest``; IntegrityError naming this store if they do not match."""
        where = f"{kind.noun} {digest} in {self.url}"
        try:
            envelope = parse_envelope(blob, self.max_object_size)
            decoded = codec_by_id(envelope.codec_id).decode(
                envelope.params,
                memoryview(blob)[envelope.payload_offset :],
                envelope.decoded_size,
                self.get_chunk,
            )
        except FormatError as e:
            raise IntegrityError(f"{where} is corrupt: {e}") from e
        if len(decoded) != envelope.decoded_size or digest_of(decoded) != digest:
            raise IntegrityError(f"{where} is corrupt: its bytes hash to something else")
        return decoded

    def copy(self, kind: ObjectKind, digest: Digest, to: ObjectStore) -> CopiedObject:
        """Copy one object into ``to`` as it is stored here (its codec kept), verified first, so
        corrupt bytes never travel.

        Create-only: an object ``to`` holds already (perhaps a delta against another base,
        which a manifest there records) keeps its encoding and is refreshed instead, so an
        age-based GC there spares it. NotFound if it is not stored here.
        """
        try:
            blob = self.blobs.get(object_key(kind, digest))
        except NotFound as e:
            raise NotFound(f"{kind.noun} {digest} is missing from {self.url}") from e
        decoded = self.verify_stored(kind, digest, blob)
        envelope = parse_envelope(blob, self.max_object_size)
        base = codec_by_id(envelope.codec_id).base_of(envelope.params)
        created = to.blobs.put_if_absent(object_key(kind, digest), blob)
        if not created:
            with contextlib.suppress(NotFound):
                to.blobs.touch(object_key(kind, digest))
        return CopiedObject(kind, digest, created, len(decoded), len(blob), base)


def _decode_level(
    envelope: Envelope,
    blob: bytes | bytearray,
    below: tuple[Digest, bytes | memoryview] | None,
) -> bytes | memoryview:
    """Decode one object of a chain; ``below`` is its base, already decoded (None at the root)."""

    def base(digest: Digest) -> bytes | memoryview:
        # The headers walked before named this base; a blob rewritten since names another.
        if below is None or below[0] != digest:
            raise FormatError(f"delta base {digest} is not the one its chain named")
        return below[1]

    codec = codec_by_id(envelope.codec_id)
    return codec.decode(
        envelope.params, memoryview(blob)[envelope.payload_offset :], envelope.decoded_size, base
    )


def _gather(parts: Sequence[memoryview], size: int) -> bytearray:
    """The first ``size`` bytes of ``parts`` laid end to end, in one new buffer."""
    blob = bytearray(size)
    offset = 0
    for part in parts:
        n = min(len(part), size - offset)
        blob[offset : offset + n] = part[:n]
        offset += n
    return blob


def _scatter(decoded: memoryview, outs: Sequence[memoryview], digest: Digest) -> None:
    """Copy a chunk's decoded bytes over ``outs``, whose sizes must sum to its size."""
    size = sum(len(out) for out in outs)
    if len(decoded) != size:
        raise IntegrityError(f"chunk {digest} has {len(decoded)} bytes, manifest says {size}")
    offset = 0
    for out in outs:
        out[:] = decoded[offset : offset + len(out)]
        offset += len(out)
