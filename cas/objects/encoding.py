"""How the write path encodes each tensor: codec choice by trial, deltas against a keyframe, chains.

With the store codec ``"auto"`` (or ``save(codec="auto")``), every tensor is encoded with the
candidate that stores fewest bytes on its first chunk not stored yet: the whole chunk up to
twice ``sample_bytes`` (its trial encoding is then kept), else four slices spread over it, so a
choice costs a few milliseconds whatever the tensor's size. Candidates are the C-Blosc2 codecs
``shuffle-zstd`` and ``bitshuffle-zstd``, plus ``xor-shuffle-zstd`` and ``sub-shuffle-zstd``
when the parent checkpoint has a tensor at the same path with the same dtype, shape and chunk
layout. A compressed candidate must save ``min_saving`` of the raw bytes to beat ``raw`` (raw
chunks of a local store are memory-mapped and read without decoding), and a candidate that is
slower to decode (a delta decodes its base too) must save ``decode_margin`` more than the best
faster one.

A delta's base is chosen by ``DeltaSettings.anchor``. With ``"keyframe"`` (the default) chunk
``i`` is encoded against the keyframe the parent's chunk ``i`` was encoded against (or that
chunk itself when it is a keyframe), so every chunk is a keyframe or one delta from one and the
newest checkpoint, the one a resume loads, decodes at most two chunks per chunk. A delta that
stores more than ``rekey`` of what a fresh keyframe would is not worth keeping the old keyframe
for: the tensor is written standalone and becomes the next keyframe. With ``"parent"`` chunks
chain against the parent's chunk, up to ``max_depth`` levels, then a keyframe. Every tensor
entry lists the transitive bases its chunks need (``cas.objects.chains``) and the writer
refreshes them, so a concurrent GC sees them as in use.

A named codec (``"raw"``, ``"shuffle-zstd"``, ``"shuffle-lz4"``...) is used for every chunk; a
named delta codec is used wherever a parent tensor matches (against a keyframe, while it stores
under ``rekey`` of a fresh one), and elsewhere ``shuffle-zstd`` (or ``bytegroup-zstd`` for the
numpy delta codecs, whose stores keep their older family).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, replace
from typing import Any, Protocol

from cas.codecs import Codec, EncodeHints, codec_by_name
from cas.codecs.bytegroup import MAX_ELEM_SIZE
from cas.digest import Digest, digest_of
from cas.errors import CASError, FormatError
from cas.model.manifest import ChunkRef, Manifest, TensorEntry
from cas.objects.chains import STANDALONE, Chain, ChainIndex, ChunkCache, encoding_record
from cas.objects.chunking import Cut
from cas.objects.chunkio import Progress, WriteStats
from cas.objects.private import PRIVATE_ALIGN_MIN, Encoding, private_view
from cas.objects.staging import staging_pool
from cas.objects.store import MAX_DELTA_DEPTH, ObjectStore, chunk_key

AUTO = "auto"
KEYFRAME = "keyframe"
PARENT = "parent"
DELTA_SECTION = "delta"
"""The ``StoreConfig.extra`` section holding ``DeltaSettings``."""


@dataclass(frozen=True)
class DeltaSettings:
    """Write-path encoding knobs, stored in ``StoreConfig.extra["delta"]``."""

    max_depth: int = 4
    """Longest delta chain with ``anchor="parent"``; 0 turns deltas off in either mode. Loading
    a chunk decodes its whole chain, and on AdamW checkpoints of a small GPT 50 steps apart depth
    4 stored as little as depth 8 (0.780 vs 0.780 of raw; 0.796 at depth 1)."""
    anchor: str = KEYFRAME
    """``"keyframe"``: deltas against the parent's keyframe, so chains are one delta deep and
    the newest checkpoint loads fast; ``"parent"``: deltas against the parent, chains up to
    ``max_depth`` (a little smaller, slower to load the further down the chain)."""
    rekey: float = 0.9
    """With ``anchor="keyframe"``, a delta storing more than this fraction of a fresh keyframe's
    bytes starts a new keyframe instead (see docs/codecs.md for the measured trade-off)."""
    sample_bytes: int = 256 << 10
    min_saving: float = 0.03
    """A compressed encoding must store this fraction less than raw to be chosen."""
    decode_margin: float = 0.01
    """A candidate slower to decode (zstd < bytegroup < xor-delta < sub-delta) must store this
    fraction of the raw bytes less than the best cheaper one: the speed budget."""
    level: int = 1
    """zstd level when choosing per tensor: on float byte planes level 1 stored 0.3% less than
    level 3 and compressed 1.5x faster (AdamW checkpoints of a small GPT)."""
    cache_bytes: int = 512 << 20
    """Decoded chunks of recent saves kept in memory as delta bases for the next save."""

    @classmethod
    def from_config(cls, extra: dict[str, Any]) -> DeltaSettings:
        """Read the section; unknown keys or bad values are a FormatError."""
        section = extra.get(DELTA_SECTION, {})
        if not isinstance(section, dict):
            raise FormatError(f"store config section {DELTA_SECTION!r} is not a map")
        known = set(cls.__dataclass_fields__)
        unknown = set(section) - known
        if unknown:
            raise FormatError(f"unknown {DELTA_SECTION!r} settings: {', '.join(sorted(unknown))}")
        settings = cls(**section)
        if settings.anchor not in (KEYFRAME, PARENT):
            raise FormatError(f"delta anchor {settings.anchor!r} is not 'keyframe' or 'parent'")
        numbers = [getattr(settings, name) for name in known - {"anchor"}]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
            raise FormatError(f"{DELTA_SECTION!r} settings must be numbers")
        if not 0 <= settings.max_depth <= 32:
            raise FormatError(f"delta max_depth {settings.max_depth} outside [0, 32]")
        if not 4096 <= settings.sample_bytes <= 64 << 20 or not 0 <= settings.min_saving < 1:
            raise FormatError("delta sample_bytes or min_saving out of range")
        if not 0 <= settings.decode_margin < 1 or not 0 < settings.rekey <= 1:
            raise FormatError("delta decode_margin or rekey out of range")
        if not -7 <= settings.level <= 22:
            raise FormatError(f"delta level {settings.level} outside [-7, 22]")
        if settings.cache_bytes < 0:
            raise FormatError("delta cache_bytes must be >= 0")
        return settings


def group_size(dtype: str, elem_size: int) -> int:
    """Bytes per byte-group element: a complex number's component, else the element itself."""
    size = elem_size // 2 if dtype.startswith("complex") and elem_size % 2 == 0 else elem_size
    return max(1, min(size, MAX_ELEM_SIZE))


def sample_of(data: memoryview, elem: int, budget: int) -> list[tuple[int, int]]:
    """``(offset, size)`` slices of ``data`` to try codecs on: all of it, or four spread slices.

    Up to twice the budget the whole chunk is tried, since its encoding is then kept.
    """
    if len(data) <= 2 * budget:
        return [(0, len(data))]
    size = max(elem, (budget // 4) // elem * elem)
    step = (len(data) - size) // 3 // elem * elem
    return [(i * step, size) for i in range(4)]


@dataclass(frozen=True)
class Choice:
    """A tensor's codec, and the encoded chunk when the trial covered all of a ``bytes`` one."""

    codec: Codec
    encoded: Encoding | None = None


def candidates(dtype: str, elem: int, with_base: bool) -> list[Codec]:
    """Codecs worth trying, cheapest to decode first: byte shuffle, bit shuffle for 1-byte and
    integer elements (it packs booleans and small integers tighter; on float tensors it stored
    3% more than byte shuffle, so its trial is skipped there), then the deltas (which decode
    their base too)."""
    out = [codec_by_name("shuffle-zstd")]
    if elem == 1 or not dtype.startswith(("float", "bfloat", "complex")):
        out.append(codec_by_name("bitshuffle-zstd"))
    if with_base:
        out.append(codec_by_name("xor-shuffle-zstd"))
        if elem in (1, 2, 4, 8):
            out.append(codec_by_name("sub-shuffle-zstd"))
    return out


def choose_codec(
    chunk: bytes | memoryview,
    dtype: str,
    elem: int,
    base: tuple[Digest, memoryview | bytes] | None,
    level: int,
    settings: DeltaSettings,
) -> Choice:
    """The codec that stores a sample of ``chunk`` in fewest bytes (see the module docstring).

    When the trial covers all of a ``bytes`` chunk, the choice carries its encoding, which
    ``ObjectStore.put_chunk`` reuses when handed the same ``chunk``.
    """
    data = memoryview(chunk).cast("B")
    slices = sample_of(data, elem, settings.sample_bytes)
    whole = slices == [(0, len(data))]
    sample = data if whole else memoryview(b"".join(data[o : o + n] for o, n in slices))
    hints = EncodeHints(elem_size=elem, level=level)
    if base is not None:
        base_digest, base_data = base
        base_view = memoryview(base_data)
        base_sample = base_view if whole else b"".join(base_view[o : o + n] for o, n in slices)
        hints = replace(hints, base=base_sample, base_digest=base_digest)
    best = Choice(codec_by_name("raw"))
    best_size = len(sample) * (1 - settings.min_saving)
    standalone, standalone_size = best, best_size
    for codec in candidates(dtype, elem, base is not None):
        encoded = codec.encode(sample, hints)
        size = len(encoded[0]) + len(encoded[1])
        # Candidates come cheapest to decode first; a slower one has to be worth it.
        margin = 0 if best.codec.name == "raw" else settings.decode_margin * len(sample)
        if size < best_size - margin:
            ahead = Encoding(chunk, codec, *encoded) if whole and isinstance(chunk, bytes) else None
            best, best_size = Choice(codec, ahead), size
            if not codec.needs_base:
                standalone, standalone_size = best, best_size
    # Far from its keyframe a delta saves little; a new keyframe makes the next ones small.
    rekey = settings.anchor == KEYFRAME and best.codec.needs_base
    if rekey and best_size > settings.rekey * min(standalone_size, len(sample)):
        return standalone
    return best


def standalone_codec(name: str, elem: int) -> Codec:
    """The codec a tensor with no usable base is written with, for a store/save codec name."""
    if name == AUTO:
        return codec_by_name("shuffle-zstd")
    codec = codec_by_name(name)
    if codec.needs_base:
        return codec_by_name("bytegroup-zstd" if codec.codec_id < 5 else "shuffle-zstd")
    return codec


class ByteSource(Protocol):
    """Bytes read by offset, e.g. a file being ingested: each read is a buffer of its own."""

    def read(self, offset: int, size: int) -> bytes:
        """``size`` bytes from ``offset``."""
        ...

    def read_into(self, offset: int, out: Any) -> None:
        """Fill the writable buffer ``out`` with the bytes from ``offset``."""
        ...


@dataclass(frozen=True)
class TensorTarget:
    """One tensor to write: its bytes are ``data`` at ``cuts``; what it may delta against.

    ``data`` is a buffer in memory, or a ``ByteSource`` read chunk by chunk on the pool.
    """

    data: memoryview | ByteSource
    cuts: Sequence[Cut]
    dtype: str
    elem_size: int
    parent: TensorEntry | None = None
    """The parent's tensor at the same path (used only if dtype, size and cuts match)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor (its cuts may sit anywhere in ``data``, e.g. inside a file)."""
        return sum(cut.size for cut in self.cuts)

    def chunk(self, index: int) -> memoryview:
        """The bytes of one cut."""
        cut = self.cuts[index]
        if isinstance(self.data, memoryview):
            return self.data[cut.offset : cut.offset + cut.size]
        return memoryview(self.data.read(cut.offset, cut.size))


@dataclass(frozen=True)
class _Plan:
    codec: Codec
    fallback: Codec
    elem: int
    bases: tuple[Digest, ...] = ()
    encoded: tuple[int, Encoding] | None = None
    """A chunk (by index) that the trial already encoded, whole, with ``codec``: its bytes
    as read for the trial are what that chunk is stored from."""


ChunkResult = tuple[ChunkRef, Chain]


@dataclass(frozen=True)
class PendingTensor:
    """A submitted tensor: its plan and chunk puts, running on the pool."""

    target: TensorTarget
    plan: Future[_Plan]
    chunks: list[Future[ChunkResult]]

    def futures(self) -> list[Future[Any]]:
        """Everything to wait for."""
        return [self.plan, *self.chunks]


class TensorWriter:
    """Encodes tensors of one write: plans each tensor, puts its chunks in parallel, tracks chains.

    Planning (the codec trial) runs on the pool too; it is queued before the tensor's chunk puts,
    and the pool's queue is first in, first out, so a put waiting for its plan never waits for
    work queued behind it.
    """

    def __init__(
        self,
        objects: ObjectStore,
        pool: Executor,
        *,
        codec_name: str,
        level: int,
        settings: DeltaSettings,
        cache: ChunkCache,
        stats: WriteStats,
        progress: Progress | None = None,
        parent: Manifest | None = None,
    ) -> None:
        standalone_codec(codec_name, 1)  # an unknown name fails here, before any work
        self.objects = objects
        self.pool = pool
        self.codec_name = codec_name
        self.level = settings.level if codec_name == AUTO else level
        self.settings = settings
        self.cache = cache
        self.stats = stats
        self.progress = progress
        self.chains = ChainIndex(objects)
        if parent is not None:
            self.chains.learn_manifest(parent)
        self._deltas = settings.max_depth > 0 and (
            codec_name == AUTO or codec_by_name(codec_name).needs_base
        )

    def submit(self, target: TensorTarget) -> PendingTensor:
        """Queue the plan and the chunk puts of one tensor."""
        plan = self.pool.submit(self._plan, target)
        chunks = [self.pool.submit(self._put, target, plan, i) for i in range(len(target.cuts))]
        return PendingTensor(target, plan, chunks)

    def entry(self, kind: str, pending: PendingTensor, shape: tuple[int, ...]) -> TensorEntry:
        """The tensor entry of a submitted tensor (waits for it)."""
        results = [f.result() for f in pending.chunks]
        chain = STANDALONE
        for _, chunk_chain in results:
            chain = chain.merge(chunk_chain)
        target = pending.target
        return TensorEntry(
            kind,
            target.dtype,
            shape,
            target.nbytes,
            tuple(ref for ref, _ in results),
            None,
            encoding_record(pending.plan.result().codec.name, chain),
        )

    def refresh_bases(self, entries: Sequence[TensorEntry]) -> None:
        """Touch every base the entries need, so GC's grace and leases see them as in use.

        A base that has vanished since it was checked raises NotFound here, before any commit.
        """
        bases = {d for e in entries for d in e.base_digests()}
        futures = [self.pool.submit(self.objects.blobs.touch, chunk_key(d)) for d in sorted(bases)]
        for future in futures:
            future.result()

    def _plan(self, target: TensorTarget) -> _Plan:
        elem = group_size(target.dtype, target.elem_size)
        fallback = standalone_codec(self.codec_name, elem)
        bases = self._delta_bases(target)
        if bases and self.settings.anchor == PARENT and not self._fits_depth(bases[0]):
            bases = ()
        if bases and self.settings.anchor == KEYFRAME:
            bases = self._keyframes(bases)
        if self.codec_name != AUTO:
            codec = codec_by_name(self.codec_name)
            if bases and codec.needs_base and self.settings.anchor == KEYFRAME:
                bases = bases if self._keyframe_pays(target, bases, codec, fallback, elem) else ()
            codec = codec if bases else fallback
            return _Plan(codec, fallback, elem, bases if codec.needs_base else ())
        probe = self._first_new_chunk(target)
        if probe is None:
            return _Plan(fallback, fallback, elem)  # stored already: nothing to choose
        base_data = self._base_bytes(bases[probe]) if bases else None
        base = (bases[probe], base_data) if bases and base_data is not None else None
        data: bytes | memoryview = target.chunk(probe)
        if len(data) <= 2 * self.settings.sample_bytes:
            data = bytes(data)  # encoded whole: keep the reading, so it can be stored as is
        choice = choose_codec(data, target.dtype, elem, base, self.level, self.settings)
        delta = choice.codec.needs_base
        encoded = (probe, choice.encoded) if choice.encoded is not None else None
        return _Plan(choice.codec, fallback, elem, bases if delta else (), encoded)

    def _keyframe_pays(
        self,
        target: TensorTarget,
        bases: tuple[Digest, ...],
        codec: Codec,
        fallback: Codec,
        elem: int,
    ) -> bool:
        """Whether a named delta codec still stores under ``rekey`` of a fresh keyframe against
        these keyframes (on a sample of the first new chunk), as ``auto`` asks of its deltas."""
        probe = self._first_new_chunk(target)
        base = self._base_bytes(bases[probe]) if probe is not None else None
        if probe is None or base is None:
            return probe is None  # all stored already: nothing is encoded either way
        data = memoryview(target.chunk(probe))
        slices = sample_of(data, elem, self.settings.sample_bytes)
        sample = memoryview(b"".join(data[o : o + n] for o, n in slices))
        base_view = memoryview(base)
        hints = EncodeHints(elem_size=elem, level=self.level)
        delta_hints = replace(
            hints,
            base=b"".join(base_view[o : o + n] for o, n in slices),
            base_digest=bases[probe],
        )
        delta_size = sum(map(len, codec.encode(sample, delta_hints)))
        keyframe_size = sum(map(len, fallback.encode(sample, hints)))
        return delta_size <= self.settings.rekey * min(keyframe_size, len(sample))

    def _first_new_chunk(self, target: TensorTarget, probes: int = 4) -> int | None:
        """A chunk worth trying codecs on: the first of a few that is not stored yet."""
        for index in range(min(probes, len(target.cuts))):
            if not self.objects.has_chunk(digest_of(target.chunk(index))):
                return index
        return None

    def _delta_bases(self, target: TensorTarget) -> tuple[Digest, ...]:
        parent = target.parent
        if not self._deltas or parent is None or parent.inline is not None:
            return ()
        if parent.dtype != target.dtype or parent.nbytes != target.nbytes:
            return ()
        if [c.size for c in parent.chunks] != [c.size for c in target.cuts]:
            return ()
        return tuple(c.digest for c in parent.chunks)

    def _keyframes(self, chunks: tuple[Digest, ...]) -> tuple[Digest, ...]:
        """The keyframe each chunk was encoded against (itself when standalone); none at all
        when one cannot be found (a broken or hostile chain: the tensor becomes a keyframe)."""
        found = []
        for chunk in chunks:
            keyframe = self._keyframe_of(chunk)
            if keyframe is None:
                return ()
            found.append(keyframe)
        return tuple(found)

    def _keyframe_of(self, chunk: Digest) -> Digest | None:
        known = self.cache.keyframe(chunk)
        if known is not None:
            return known
        try:
            chain = self.chains.chain_of(chunk)
            if chain.depth == 0 and not chain.bases:
                return chunk  # listed by a tensor entry without bases: standalone
            current = chunk
            for _ in range(MAX_DELTA_DEPTH + 1):
                base = self.objects.chunk_base(current)
                if base is None:
                    self.cache.note_keyframe(chunk, current)
                    return current
                current = base
        except CASError:
            pass
        return None

    def _fits_depth(self, base: Digest) -> bool:
        try:
            return self.chains.chain_of(base).depth < self.settings.max_depth
        except CASError:
            return False

    def _base_bytes(self, digest: Digest) -> bytes | memoryview | None:
        cached = self.cache.get(digest)
        if cached is not None:
            return cached
        try:
            data = self.objects.get_chunk(digest)
        except CASError:
            return None  # a damaged or missing base: encode without it
        self.cache.put(digest, bytes(data))
        return data

    def _put(self, target: TensorTarget, planned: Future[_Plan], index: int) -> ChunkResult:
        plan = planned.result()
        encoded = plan.encoded[1] if plan.encoded and plan.encoded[0] == index else None
        cut = target.cuts[index]
        from_file = not isinstance(target.data, memoryview)
        if encoded is None and not self._deltas and from_file and cut.size >= PRIVATE_ALIGN_MIN:
            # A file's chunk is read straight into the staging pool: that one read is the
            # private copy the door hashes and writes (past the page cache).
            with staging_pool().lease(cut.size) as staged:
                target.data.read_into(cut.offset, staged)  # type: ignore[union-attr]
                return self._put_read(target, plan, index, memoryview(staged), None)
        return self._put_read(target, plan, index, None, encoded)

    def _put_read(
        self,
        target: TensorTarget,
        plan: _Plan,
        index: int,
        staged: memoryview | None,
        encoded: Encoding | None,
    ) -> ChunkResult:
        # With deltas, one private reading of the chunk serves every put below and the delta
        # cache, so a source that changes meanwhile still stores bytes that match their name;
        # without, the door reads privately whatever it writes.
        chunk: bytes | memoryview
        if staged is not None:
            chunk = staged
        elif encoded is not None:
            chunk = encoded.source
        elif self._deltas:
            chunk = bytes(target.chunk(index))
        else:
            chunk = target.chunk(index)  # the door probes it in place or reads it privately
        codec, hints = plan.codec, EncodeHints(elem_size=plan.elem, level=self.level)
        chain = STANDALONE
        if codec.needs_base:
            delta = self._delta_hints(plan.bases[index], hints)
            if delta is None:
                codec, encoded = plan.fallback, None
            else:
                hints, chain = delta
        result = self.objects.put_chunk(chunk, codec, hints, encoded=encoded)
        if not result.new:
            reused = self._reused_chain(result.base)
            if reused is None:
                # Stored as a delta whose chain is broken, too deep, or unwanted in this store:
                # store it standalone under the same identity.
                hints = EncodeHints(elem_size=plan.elem, level=self.level)
                result = self.objects.put_chunk(
                    private_view(chunk), plan.fallback, hints, expected=result.digest, replace=True
                )
            chain = reused or STANDALONE
        elif not codec.needs_base:
            chain = STANDALONE
        self.chains.learn(result.digest, chain)
        if self._deltas and isinstance(chunk, bytes):
            self.cache.put(result.digest, chunk)
        if chain.depth <= 1 and len(chain.bases) <= 1:
            # The keyframe the next save of this tensor encodes against, without a header read.
            self.cache.note_keyframe(result.digest, min(chain.bases, default=result.digest))
        self.stats.add(result)
        if self.progress is not None:
            self.progress(result.size)
        return ChunkRef(result.digest, result.size), chain

    def _delta_hints(self, base: Digest, hints: EncodeHints) -> tuple[EncodeHints, Chain] | None:
        if self.settings.anchor == KEYFRAME:
            base_chain = STANDALONE  # found standalone by its header (``_keyframe_of``)
        else:
            try:
                base_chain = self.chains.chain_of(base)
            except CASError:
                return None
            if base_chain.depth >= self.settings.max_depth:
                return None
        data = self._base_bytes(base)
        if data is None:
            return None
        return replace(hints, base=data, base_digest=base), base_chain.on_top_of(base)

    def _reused_chain(self, base: Digest | None) -> Chain | None:
        """The chain of a chunk that was already stored, or None if it should be rewritten."""
        if base is None:
            return STANDALONE
        if not self._deltas:
            return None
        try:
            chain = self.chains.chain_of(base).on_top_of(base)
        except CASError:
            return None
        return chain if chain.depth <= self.settings.max_depth else None


def tensor_paths(manifest: Manifest, state_paths: Callable[[Any], Any]) -> dict[str, TensorEntry]:
    """A manifest's tensors by the path a later checkpoint's same tensor will have.

    State manifests use dotted paths (``state_paths`` walks the tree); file manifests use
    ``file:region`` and, when unique across files, the bare region name.
    """
    if manifest.kind == "state":
        return {path: manifest.tensors[i] for path, i in state_paths(manifest.tree)}
    out: dict[str, TensorEntry] = {}
    names: dict[str, int] = {}
    for path, entry in manifest.files.items():
        for region in entry.regions:
            out[f"{path}:{region.name}"] = manifest.tensors[region.tensor_index]
            names[region.name] = names.get(region.name, 0) + 1
    for entry in manifest.files.values():
        for region in entry.regions:
            if names[region.name] == 1:
                out.setdefault(region.name, manifest.tensors[region.tensor_index])
    return out
