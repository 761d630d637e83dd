"""AppendOnlyBlobStore: a handle that writes and moves refs but never deletes data.

A training node's handle needs to write chunks, manifests and ref updates, and to clean up its
own bookkeeping (its writer lease, a transient probe), but never to remove a checkpoint: the
same line restic's rest-server ``--append-only`` and an S3 policy without ``DeleteObject`` on the
data draw. Deleting a ref, a chunk, a manifest, a key or a quarantined object is refused here,
before any request; ``accepts_deletes`` tells the layers above, so ``cas forget``, ``cas gc``
and ``cas rm`` refuse up front instead of failing half-way.
"""

from __future__ import annotations

from typing import NoReturn

from cas.blobstore.base import Version
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.errors import ReadOnlyError

APPEND_ONLY_SECTION = "append_only"
"""The ``StoreConfig.extra`` flag that opens every handle of a store append-only."""
PROTECTED_PREFIXES = ("refs/", "chunks/", "manifests/", "keys/", "quarantine/")
"""What an append-only handle never deletes: the data and what names it."""


class AppendOnly(ReadOnlyError):
    """A delete through an append-only handle."""


class AppendOnlyBlobStore(BlobStoreWrapper):
    """Forwards everything but deletes of ``PROTECTED_PREFIXES``, which raise ``AppendOnly``."""

    READS_THROUGH = True

    def _check(self, key: str) -> None:
        if key.startswith(PROTECTED_PREFIXES):
            self._refuse(f"deleting {key!r}")

    def _refuse(self, what: str) -> NoReturn:
        raise AppendOnly(
            f"store {self.url} is opened append-only: {what} is refused "
            "(forget, gc and rm run from a maintenance host's handle)"
        )

    def delete(self, key: str) -> None:
        self._check(key)
        self.inner.delete(key)

    def delete_conditional(self, key: str, expected: Version) -> None:
        self._check(key)
        self.inner.delete_conditional(key, expected)

    @property
    def accepts_deletes(self) -> bool:
        return False

    @property
    def supports_rename(self) -> bool:
        return False  # a local sweep renames objects aside before it deletes them
