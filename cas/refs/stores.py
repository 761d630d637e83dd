"""The stores of one cas store that retention and transfers work through, bundled.

``Stores`` is what the layers between the object and ref stores and the ``Repository`` take: the
object store (chunks and manifests by digest), the ref store (the one door where a ref moves) and
the maintenance service (writer leases, the maintenance lock, the store's clock), plus a thread
pool for reading many manifests at once. None of them hands out a ``BlobStore``, so code that holds
a ``Stores`` cannot write a blob except through a named operation.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from cas.blobstore.appendonly import AppendOnly
from cas.objects.store import ObjectStore
from cas.refs.leases import LeaseManager
from cas.refs.maintenance import MaintenanceService
from cas.refs.store import RefStore


@dataclass(frozen=True)
class Stores:
    """A store's objects, refs and maintenance service, and a pool to read them in parallel."""

    objects: ObjectStore
    refs: RefStore
    maintenance: MaintenanceService
    threads: Callable[[], Executor] = field(repr=False)
    """The pool to use, asked for when needed (the repository creates its pool lazily)."""

    @property
    def pool(self) -> Executor:
        """Threads for reading many manifests or objects at once."""
        return self.threads()

    @property
    def url(self) -> str:
        """Where the store lives."""
        return self.objects.url

    @property
    def writers(self) -> LeaseManager:
        """This process's writer leases on the store (``hold`` one for a block of writes)."""
        return self.maintenance.writers

    @property
    def clock(self) -> Callable[[], float]:
        """The host clock the store was opened with (injected in tests)."""
        return self.maintenance.clock

    def check_deletes(self, what: str) -> None:
        """Raise ``AppendOnly`` before ``what`` (a forget, a GC sweep, an rm) makes a request
        through a handle that may not delete, rather than fail half-way through it."""
        if not self.refs.blobs.accepts_deletes:
            raise AppendOnly(
                f"store {self.url} is opened append-only: {what} is refused (forget, gc and rm "
                "run from a maintenance host's handle)"
            )
