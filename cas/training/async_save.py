"""Async checkpoint writes: copy the state to CPU memory now, hash, encode and write it later.

The training loop only waits for ``snapshot``: every tensor is copied into a CPU staging buffer
(pinned when CUDA is present, so device copies run asynchronously and one synchronize ends them).
The rest of a save (blake3, codecs, file or S3 writes, ref updates) runs on one background thread,
in submission order, with at most ``max_in_flight`` saves queued or running: a further ``submit``
blocks until one finishes (back-pressure, so staging memory stays bounded). A failure in the
background is kept and raised by the next ``submit``, ``wait`` or ``close``: it is never lost.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from cas.errors import CASError
from cas.model.state import alias_key, build_sparse, sparse_layout, sparse_parts
from cas.repo.background import staging_offset
from cas.training.priority import lower_thread_priority, pin_thread

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
P = TypeVar("P")


class AsyncSaveError(CASError):
    """A checkpoint write that ran in the background failed; the checkpoint was not committed."""


@dataclass
class StagingSet:
    """One save's CPU buffers, reused by later saves once that save has been written."""

    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0


class Stager:
    """Copies nested states into reusable CPU buffers; one ``StagingSet`` per save in flight.

    Reusing buffers matters: a fresh allocation of a large buffer costs page faults on every
    page, and pinned allocations are far slower still.
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        import torch

        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._free: list[StagingSet] = []
        self._lock = threading.Lock()

    def acquire(self) -> StagingSet:
        """A staging set not used by any save in flight."""
        with self._lock:
            return self._free.pop() if self._free else StagingSet()

    def release(self, staging: StagingSet) -> None:
        """Give a set back once the save that used it has been written."""
        with self._lock:
            self._free.append(staging)

    def snapshot(self, state: Any, staging: StagingSet) -> Any:
        """A copy of ``state`` whose tensors live in ``staging``; shared tensors stay shared."""
        import torch

        seen: dict[object, Any] = {}
        counter = [0]
        device_copies = [False]
        staging.nbytes = 0

        def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
            ordinal = counter[0]
            counter[0] += 1
            source = tensor.detach()
            buffer = staging.buffers.get(ordinal)
            if buffer is None or buffer.dtype != source.dtype or buffer.shape != source.shape:
                if self.pin_memory and source.device.type != "cpu":
                    buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
                else:
                    buffer = staging_tensor(source.shape, source.dtype)
                staging.buffers[ordinal] = buffer
            if source.device.type != "cpu":
                buffer.copy_(source, non_blocking=buffer.is_pinned())
                device_copies[0] = True
            elif (
                source.is_contiguous()
                and source.numel()
                and not (source.is_conj() or source.is_neg())
            ):
                # A plain memcpy: torch's copy_ opens a parallel region per tensor, and its
                # worker threads then spin, burning more CPU than the copy itself.
                np.copyto(_bytes_of(buffer), _bytes_of(source))
            else:
                buffer.copy_(source)
            staging.nbytes += buffer.numel() * buffer.element_size()
            return buffer

        def copy_any(tensor: torch.Tensor) -> torch.Tensor:
            layout = sparse_layout(tensor)  # other layouts: FormatError, not torch's RuntimeError
            if layout is None:
                return copy_tensor(tensor)
            parts = [copy_tensor(part) for part in sparse_parts(tensor, layout)]
            coalesced = layout == "coo" and tensor.is_coalesced()
            return build_sparse(layout, parts, tuple(tensor.shape), coalesced, check=False)

        def walk(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                # Tied weights from state_dict() are two objects over one storage: one copy.
                key = alias_key(obj) or id(obj)
                if key not in seen:
                    seen[key] = copy_any(obj)
                return seen[key]
            if isinstance(obj, np.ndarray):
                key = id(obj)
                if key not in seen:
                    seen[key] = obj.copy()
                    staging.nbytes += obj.nbytes
                return seen[key]
            if isinstance(obj, dict):
                return {k: walk(v) for k, v in obj.items()}
            if isinstance(obj, list):
                return [walk(v) for v in obj]
            if isinstance(obj, tuple):
                return tuple(walk(v) for v in obj)
            return obj  # immutable leaves (numbers, strings, dtypes...) need no copy

        copied = walk(state)
        if device_copies[0] and torch.cuda.is_available():
            torch.cuda.synchronize()
        return copied


class AsyncWriter(Generic[T]):
    """Runs save jobs on one background thread, in order, at most ``max_in_flight`` at once."""

    def __init__(
        self,
        max_in_flight: int = 1,
        *,
        name: str = "cas-save",
        nice: int = 0,
        cpus: frozenset[int] | None = None,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.max_in_flight = max_in_flight
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name, initializer=_background_thread,
            initargs=(nice, cpus),
        )  # fmt: skip
        self._failure: BaseException | None = None
        self._failure_lock = threading.Lock()
        self._pending: set[Future[T]] = set()
        self._closed = False

    def check(self) -> None:
        """Raise the failure of a background job that nobody has seen yet."""
        with self._failure_lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise AsyncSaveError(f"a background checkpoint save failed: {failure}") from failure

    def submit(
        self,
        prepare: Callable[[], P],
        write: Callable[[P], T],
        *,
        cleanup: Callable[[P], None] | None = None,
    ) -> tuple[Future[T], float]:
        """Wait for a free slot, run ``prepare`` here, then ``write(prepared)`` in the background.

        Returns the job's future and the seconds the caller was blocked (slot wait + prepare).
        ``cleanup(prepared)`` runs after ``write``, whether it failed or not.
        """
        if self._closed:
            raise CASError("the async writer is closed")
        start = time.perf_counter()
        self._slots.acquire()
        try:
            # After the slot wait: a job that failed while this save waited for it (its failure
            # is recorded before it frees its slot) is raised here, by this save.
            self.check()
            prepared = prepare()
        except BaseException:
            self._slots.release()
            raise
        blocked = time.perf_counter() - start

        def run() -> T:
            try:
                return write(prepared)
            except BaseException as e:
                with self._failure_lock:
                    if self._failure is None:
                        self._failure = e
                raise
            finally:
                if cleanup is not None:
                    cleanup(prepared)
                self._slots.release()

        future = self._executor.submit(run)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future, blocked

    @property
    def in_flight(self) -> int:
        """Jobs queued or running."""
        return len(self._pending)

    def wait(self) -> None:
        """Block until every submitted job has finished; raise an unseen failure."""
        for future in list(self._pending):
            # A failure is kept in self._failure and raised by check() below.
            with contextlib.suppress(BaseException):
                future.result()
        self.check()

    def close(self) -> None:
        """Finish every job, stop the thread, and raise an unseen failure."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)


def staging_tensor(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor laid out for direct writes (``cas.repo.background``).

    Only when its chunks can be large enough for direct writes: a smaller one would waste most of
    a page and a mapping of its own for nothing. Every dtype's item size divides the offset.

    The mapping is in base pages, not huge ones like the staging pool's. A run's first save
    faults in its whole staging set while the loop waits: 1 GiB took 1.7-2.4 s in huge pages
    and 0.41-0.43 s in base pages on this project's VM, where the host takes back free memory
    (docs/design.md). Huge pages would make each later direct write about a fifth faster, off
    the loop's path; the first save's stall is on it.
    """
    import torch

    nbytes = math.prod(shape) * dtype.itemsize
    offset = staging_offset(nbytes)
    if offset is None:
        return torch.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, offset + nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(dtype).reshape(shape)  # the tensor keeps the mapping alive


@dataclass
class _Lent:
    thread: int
    """``threading.get_ident()`` of the thread that lent it: OpenMP's count is per thread."""
    threads: int
    """Its ``torch.get_num_threads()`` before the save."""
    save: Future[Any]
    """The newest save it waits for."""


class ThreadLender:
    """Lends one of the training thread's intra-op threads to background saves (``yield_thread``).

    While a save runs, the caller's parallel regions run on one thread fewer, so the save has a
    core of its own instead of stalling each region at its barrier; the thread comes back once
    the newest save is written. Only the thread that lent it can give it back: torch's thread
    count is per OpenMP thread.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._lent: _Lent | None = None

    def lend(self, save: Future[Any]) -> None:
        """Run this thread's parallel regions on one thread fewer until ``save`` is written."""
        import torch

        if not self.enabled or save.done():
            return
        if self._lent is not None and self._lent.thread == threading.get_ident():
            self._lent.save = save  # still lent: keep it until the newest save is written
            return
        threads = torch.get_num_threads()
        if self._lent is None and threads > 1:
            torch.set_num_threads(threads - 1)
            self._lent = _Lent(threading.get_ident(), threads, save)

    def reclaim(self, force: bool = False) -> None:
        """Give the lent thread back once its save is written (``force``: now)."""
        import torch

        lent = self._lent
        if lent is None or lent.thread != threading.get_ident():
            return
        if not (force or lent.save.done()):
            return
        self._lent = None
        if torch.get_num_threads() == lent.threads - 1:  # unless the caller changed it since
            torch.set_num_threads(lent.threads)


def _bytes_of(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """A contiguous CPU tensor's storage as a flat uint8 numpy view (any dtype, 0-d included)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8).numpy()


def _background_thread(nice: int, cpus: frozenset[int] | None) -> None:
    """The save thread's start: at ``nice`` more than the caller, on ``cpus`` if given; the
    chunk workers it starts take both."""
    lower_thread_priority(nice)
    pin_thread(cpus)
