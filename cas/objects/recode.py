"""Copying chunks between stores under another encoding: a hot raw copy, a compressed archive.

A chunk's key is the blake3 of its decoded bytes, so re-encoding it never changes its identity
and manifests stay valid in both stores. The transfer layer calls ``recode_chunk`` (or
``recode_manifest`` for a whole checkpoint) with the codec the destination wants:

- ``"keep"``: copy the stored object as it is, through ``ObjectStore.copy``, which verifies the
  very bytes it writes (a chunk read twice could change in between). A
  delta chunk keeps its base, so the base is copied first (recursively) when the destination
  lacks it; the manifest that names the chunk already lists those bases for GC.
- a standalone codec (``"raw"``, ``"shuffle-zstd"``, ``"shuffle-lz4"``, ``"zstd"``...): decode
  at the source (verified) and encode anew. ``"auto"`` picks the smallest of the shuffle codecs
  on a sample, as the write path does without a parent; ``push --codec auto`` from a store of
  the older numpy codecs therefore moves it to the C-Blosc2 ones.
- Delta codecs are refused: choosing a base is the writer's job (``cas.objects.encoding``).

A chunk the destination already holds is refreshed, not rewritten, and copies are create-only:
one that a concurrent writer stores first stays as that writer encoded it.
"""

from __future__ import annotations

from collections.abc import Iterator

from cas.codecs import EncodeHints, codec_by_name
from cas.digest import Digest
from cas.errors import FormatError, IntegrityError
from cas.model.manifest import ITEMSIZE, Manifest
from cas.objects.encoding import AUTO, DeltaSettings, choose_codec, group_size
from cas.objects.keys import ObjectKind
from cas.objects.store import MAX_DELTA_DEPTH, ObjectStore, PutResult

KEEP = "keep"

__all__ = ["KEEP", "recode_chunk", "recode_manifest"]


def recode_chunk(
    src: ObjectStore,
    dst: ObjectStore,
    digest: Digest,
    codec_name: str = KEEP,
    *,
    elem_size: int = 1,
    level: int = 3,
    _depth: int = 0,
) -> PutResult:
    """Copy one chunk from ``src`` to ``dst`` encoded with ``codec_name`` (see module docstring).

    ``elem_size`` is the byte-group element size (the tensor's, from its manifest entry). The
    result's ``base`` is the chunk's base in ``dst`` (``None`` unless kept as a delta).
    """
    if _depth > MAX_DELTA_DEPTH:
        raise IntegrityError(f"chunk {digest}: delta chain deeper than {MAX_DELTA_DEPTH}")
    if codec_name not in (KEEP, AUTO) and codec_by_name(codec_name).needs_base:
        raise FormatError(
            f"recode cannot choose a base for {codec_name}; use 'keep' or a standalone codec"
        )
    if codec_name == KEEP:
        base = src.chunk_base(digest)
        if base is not None and not dst.has_chunk(base):
            recode_chunk(src, dst, base, KEEP, _depth=_depth + 1)
        if not dst.has_chunk(digest):
            # One read: the blob verified at the source is the very blob written (no re-read).
            copied = src.copy(ObjectKind.CHUNK, digest, dst)
            if copied.created:
                return PutResult(digest, copied.size, copied.stored_bytes, True, copied.base)
        # Held there already (or stored meanwhile by another writer, perhaps against another
        # base): refresh that copy, or heal it if corrupt, and report its base.
        return dst.put_chunk(src.get_chunk(digest), codec_by_name("raw"), expected=digest)
    data = src.get_chunk(digest)  # verified, whatever the source encoding
    elem = group_size("", elem_size)
    hints = EncodeHints(elem_size=elem, level=level)
    if codec_name == AUTO:
        source = data if isinstance(data, bytes) else bytes(data)
        choice = choose_codec(source, "", elem, None, level, DeltaSettings())
        return dst.put_chunk(source, choice.codec, hints, expected=digest, encoded=choice.encoded)
    return dst.put_chunk(data, codec_by_name(codec_name), hints, expected=digest)


def recode_manifest(
    src: ObjectStore,
    dst: ObjectStore,
    manifest: Manifest,
    codec_name: str = KEEP,
    *,
    level: int = 3,
) -> Iterator[PutResult]:
    """Copy every chunk a manifest needs (bases included) into ``dst``; yield each result.

    Tensor chunks get their tensor's element size for byte grouping; delta bases are copied
    before the chunks that need them when kept as deltas.
    """
    elems: dict[Digest, int] = {}
    for tensor in manifest.tensors:
        elem = group_size(tensor.dtype, ITEMSIZE.get(tensor.dtype, 1))
        for ref in tensor.chunks:
            elems.setdefault(ref.digest, elem)
        for base in tensor.base_digests():
            elems.setdefault(base, elem)
    for digest in sorted(manifest.chunk_digests()):
        yield recode_chunk(
            src, dst, digest, codec_name, elem_size=elems.get(digest, 1), level=level
        )
