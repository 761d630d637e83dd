"""The Codec contract: how one chunk's decoded bytes become stored bytes and back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from cas.digest import Digest
from cas.errors import FormatError


@dataclass(frozen=True)
class EncodeHints:
    """What a writer knows about a chunk that a codec may use.

    ``elem_size`` is the tensor element size in bytes (1 for opaque bytes); ``base`` and
    ``base_digest`` name the chunk a delta codec encodes against (the decoded bytes of the base
    chunk at the same position of the base tensor).
    """

    elem_size: int = 1
    level: int = 3
    base: bytes | memoryview | None = None
    base_digest: Digest | None = None


BaseFetcher = Callable[[Digest], bytes | memoryview]
"""Returns the verified decoded bytes of a base chunk, for delta codecs."""


class Codec(ABC):
    """Encodes and decodes one chunk. ``codec_id`` is registered once and never reused."""

    codec_id: int
    name: str
    needs_base = False
    """Delta codecs encode against a base chunk (``EncodeHints.base``) and decode through it."""

    @abstractmethod
    def encode(self, data: memoryview, hints: EncodeHints) -> tuple[bytes, bytes | memoryview]:
        """Return ``(params, payload)``; ``params`` is stored in the object header.

        The payload may be ``data`` itself (no copy); callers write it before ``data`` changes.
        """

    @abstractmethod
    def decode(
        self, params: bytes, payload: memoryview, decoded_size: int, fetch_base: BaseFetcher
    ) -> bytes | memoryview:
        """Return exactly ``decoded_size`` bytes or raise ``FormatError``; never allocate more."""

    def decode_into(
        self, params: bytes, payload: memoryview, out: memoryview, fetch_base: BaseFetcher
    ) -> None:
        """Write the decoded bytes into ``out``, which holds exactly the decoded size.

        Codecs that can decompress straight into ``out`` override this; the default decodes
        into a new buffer and copies it over.
        """
        out[:] = _exact(self.decode(params, payload, len(out), fetch_base), len(out))

    def apply_into(self, params: bytes, payload: memoryview, out: memoryview) -> None:
        """Delta codecs: ``out`` holds the decoded base these parameters name (the caller has
        checked which); turn it into this chunk's decoded bytes in place.

        Delta codecs that can combine in place override this; the default copies the base aside
        and decodes against the copy.
        """
        base = bytes(out)
        self.decode_into(params, payload, out, lambda digest: base)

    def base_of(self, params: bytes) -> Digest | None:
        """The base chunk this encoding depends on (delta codecs), for GC and verification."""
        return None


def _exact(decoded: bytes | memoryview, size: int) -> memoryview:
    view = memoryview(decoded).cast("B")
    if len(view) != size:
        raise FormatError(f"decoded {len(view)} bytes, the header says {size}")
    return view
