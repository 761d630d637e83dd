"""How a background save's staging buffers are laid out, so its chunks reach the disk uncopied.

Chunks are cut from a tensor's first byte at multiples of the chunk size (a multiple of a page
unless a store chose otherwise), and a raw chunk is stored as its header followed by its bytes. A
staged tensor that starts ``STAGING_OFFSET`` (the header's length) past a page boundary therefore
has every chunk payload where it goes in the chunk's file, modulo a page, and a local store's
direct writes (``Repository.for_background_writes``) send it to the disk from where it lies
instead of copying it into an aligned buffer. Tensors too small for direct writes gain nothing.
"""

from __future__ import annotations

from cas.blobstore.direct import DIRECT_MIN
from cas.objects.envelope import HEADER_SIZE

STAGING_OFFSET = HEADER_SIZE
"""How far past a page boundary a large staged tensor starts: a raw chunk's header length."""


def staging_offset(nbytes: int) -> int | None:
    """Where past a page boundary a staged tensor of ``nbytes`` should start; None when it is
    too small for direct writes, and a plain buffer serves as well."""
    return None if STAGING_OFFSET + nbytes < DIRECT_MIN else STAGING_OFFSET
