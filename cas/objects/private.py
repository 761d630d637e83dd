"""The buffers the chunk door hashes and writes: immutable, or copied once into private memory.

``ObjectStore.put_chunk`` computes a chunk's digest and writes its body from the same buffer
(invariant 9). That is only one reading of the source if nothing else can change the buffer in
between, so ``private_view`` keeps what cannot change (bytes, and its own copies) and copies the
rest; ``Encoding`` ties an encoding made ahead of a put to the bytes it encodes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from cas.codecs import Codec


def private_view(data: bytes | bytearray | memoryview) -> memoryview:
    """``data`` as flat bytes that nothing else can change while they are hashed and written.

    Bytes, views of bytes and views this function made are kept as they are; anything else is
    copied once. The copy is what makes a chunk's name and body one reading of its source: a
    raw chunk would otherwise be written straight from the caller's buffer after being hashed
    from it, and an mmap of a file rewritten in between, or a tensor a training step updates,
    gives two different readings.
    """
    view = memoryview(data).cast("B")
    if is_private(view):
        return view
    if view.nbytes < PRIVATE_ALIGN_MIN:
        return memoryview(bytes(view))
    return _aligned_copy(view)


def is_private(data: bytes | bytearray | memoryview) -> bool:
    """Whether nothing else can change ``data``: bytes, or a copy ``private_view`` made."""
    obj = data.obj if isinstance(data, memoryview) else data
    return isinstance(obj, bytes) or _is_private_copy(obj)


class ReuseOdds:
    """Whether the next chunk put is likely one already stored, from how recent puts went.

    A chunk found stored costs a hash of its bytes where they lie; one to be written is first
    copied into private memory and hashed there. Probing in place first saves the copy when
    most puts are reuses (a re-save, a push of a mostly present checkpoint) and costs a second
    hash per new chunk otherwise (a first save). Puts probe while the recent share of reuses is
    at least a quarter: a wrong probe costs a hash (a millisecond of CPU for 4 MiB), a wrong
    guess the other way a copy and a write of a chunk the disk already holds. With one half, a
    few changed tensors close together in a re-save with one in ten changed turned the odds, and
    reused chunks were written again (37 writes for 25 new chunks of a 1 GiB state). A chunk
    found new goes past the page cache (``ObjectStore.put_chunk``), written while it is hashed
    again. Threads racing on the estimate only blur it.
    """

    THRESHOLD = 0.25
    WEIGHT = 0.125

    def __init__(self) -> None:
        self.share = 0.5
        """A new handle's first six puts probe, unless one is a reuse. Starting at the threshold
        saved a first save five probes (of 256 chunks for 1 GiB), but a re-save whose first
        chunk changed then wrote the next ones, stored, while the odds came back: the re-save of
        the benchmark (``scripts/bench.py``) went from 1.19-1.24x its floor to 1.34-1.42x."""

    def likely(self) -> bool:
        """Whether to probe in place first."""
        return self.share >= self.THRESHOLD

    def observe(self, reused: bool) -> None:
        """Count one put's outcome."""
        self.share += self.WEIGHT * (float(reused) - self.share)


PRIVATE_ALIGN_MIN = 1 << 20
"""Copies from this size on are laid out for direct writes (smaller blobs are not written so)."""
PAYLOAD_OFFSET = 16
"""Where a raw chunk's bytes start in its file: the object header's size (``HEADER_SIZE`` of
``cas.objects.store``, which imports this module; a test pins the two together)."""
_PAGE = 4096


def _aligned_copy(view: memoryview) -> memoryview:
    """A read-only copy of ``view`` starting ``PAYLOAD_OFFSET`` bytes past a page boundary.

    A raw chunk is its header followed by its bytes, so the payload then lies where it goes in
    the chunk's file, modulo a page, and a direct write sends it from where it lies
    (``cas.blobstore.direct``) instead of copying it again into an aligned buffer. numpy copies
    with the GIL released, so chunk workers copy in parallel.
    """
    import numpy as np

    room = np.empty(view.nbytes + _PAGE, dtype=np.uint8)
    start = (PAYLOAD_OFFSET - room.ctypes.data) % _PAGE
    copy = room[start : start + view.nbytes].view(private_copy_class())
    copy[:] = np.frombuffer(view, dtype=np.uint8)
    copy.flags.writeable = False
    return memoryview(copy)


@functools.cache
def private_copy_class() -> type[Any]:
    """The array type of ``private_view``'s copies, made on first use (numpy loads lazily)."""
    import numpy as np

    class PrivateCopy(np.ndarray):
        """Bytes ``private_view`` copied: no one else holds them, so they are not copied again."""

    return PrivateCopy


def copy_into(target: Any, source: memoryview) -> None:
    """Copy ``source`` over the uint8 array ``target`` of the same size, with the GIL released."""
    import numpy as np

    np.copyto(target, np.frombuffer(source, dtype=np.uint8))


def _is_private_copy(obj: object) -> bool:
    return private_copy_class.cache_info().currsize > 0 and isinstance(obj, private_copy_class())


@dataclass(frozen=True)
class Encoding:
    """A chunk encoded ahead of its put (a codec trial), tied to the immutable bytes it encodes.

    ``put_chunk`` reuses it only when handed the same ``source`` object, so a stale or foreign
    encoding can cost a second encode but never be written under the wrong name.
    """

    source: bytes
    codec: Codec
    params: bytes
    payload: bytes | memoryview
