"""The one door where bytes read back from a store are checked against their digest.

Every read of a chunk or manifest (``ObjectStore.get_chunk``, ``read_chunk_parts``,
``map_raw_chunk``, ``get_manifest``, ``verify``, ``verify_stored``, ``copy``, the reuse probe
``stored_base`` and the diagnosis of an object found corrupt) hashes what it is about to return,
or to pass on, here and nowhere else (invariant 2). The object store calls it as
``readcheck.verify_digest`` so that a test that replaces it reaches every path, and
``tests/test_read_door.py`` refuses a digest comparison anywhere else in ``cas/``. Quarantine stays
with the object store, which knows whose bytes are at fault; this module only decides whether
bytes are what their name says.
"""

from __future__ import annotations

from collections.abc import Sequence

from cas.digest import Digest, digest_of_parts
from cas.errors import IntegrityError

Readable = bytes | bytearray | memoryview

__all__ = ["verify_digest"]


def verify_digest(
    data: Readable | Sequence[Readable], expected: Digest, what: str, *, size: int | None = None
) -> None:
    """Return if ``data`` (one buffer, or parts laid end to end) is ``size`` bytes when given and
    hashes to ``expected``; else IntegrityError saying ``what`` (e.g. ``"chunk 1a2b..."``) is
    corrupt."""
    parts: Sequence[Readable] = (
        (data,) if isinstance(data, bytes | bytearray | memoryview) else data
    )
    if size is not None:
        found = sum(memoryview(part).nbytes for part in parts)
        if found != size:
            raise IntegrityError(f"{what} is corrupt: {found} bytes where its header says {size}")
    if digest_of_parts(parts) != expected:
        raise IntegrityError(f"{what} is corrupt: its bytes hash to something else")
