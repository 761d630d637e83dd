"""The Codec contract: how one chunk's decoded bytes become stored bytes and back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from cas.digest import Digest


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

    def base_of(self, params: bytes) -> Digest | None:
        """The base chunk this encoding depends on (delta codecs), for GC and verification."""
        return None
