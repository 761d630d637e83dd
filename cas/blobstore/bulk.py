"""Operations built from any BlobStore's methods: many keys at once, reads into caller buffers.

They are functions rather than methods so that no backend or wrapper has to carry them: each
needs only the narrow ``BlobStore`` interface (and its ``local_path`` capability).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from cas.blobstore.base import BlobStore, open_local_blob
from cas.blobstore.direct import Staging, read_cold
from cas.errors import BackendError, NotFound

DEFAULT_WORKERS = 16
"""Requests in flight at once: enough to hide a remote store's round trips."""


def has_many(
    store: BlobStore, keys: Iterable[str], workers: int = DEFAULT_WORKERS
) -> dict[str, bool]:
    """Whether each key exists, asked ``workers`` at a time."""
    key_list = list(keys)
    if len(key_list) < 4:
        return {key: store.has(key) for key in key_list}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(key_list, pool.map(store.has, key_list), strict=True))


def touch_many(store: BlobStore, keys: Iterable[str], workers: int = DEFAULT_WORKERS) -> list[str]:
    """Touch every key, ``workers`` at a time; return the keys that were not there."""
    key_list = list(keys)

    def touched(key: str) -> bool:
        try:
            store.touch(key)
        except NotFound:
            return False
        return True

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(key_list) or 1))) as pool:
        found = list(pool.map(touched, key_list))
    return [key for key, ok in zip(key_list, found, strict=True) if not ok]


def read_into(
    store: BlobStore,
    key: str,
    start: int,
    outs: Sequence[memoryview],
    staging: Staging | None = None,
) -> int:
    """Fill ``outs`` in order with the blob's bytes from ``start``; return how many were read.

    Fewer than the buffers hold are read only at the blob's end. Where the store's blobs are
    local files this is one open and, as a rule, one ``preadv`` straight into the buffers; a
    store with a way of its own uses it (``BlobStore.read_into_buffers``); elsewhere one ranged
    read, copied over. Given ``staging``, a whole local file that is not in the page cache is
    read past it into a staging buffer and copied over (``direct.read_cold`` says when).
    """
    own = store.read_into_buffers(key, start, outs)
    if own is not None:
        return own
    wanted = sum(len(out) for out in outs)
    path = store.local_path(key)
    if path is None:
        data = store.get_range(key, start, start + wanted)
        return _scatter(memoryview(data), outs)
    try:
        fd = open_local_blob(path, key)
    except NotFound:
        raise
    except OSError as e:
        raise BackendError(f"reading {path}: {e.strerror}") from e
    try:
        if staging is not None and start == 0:
            cold = read_cold(fd, outs, wanted, staging)
            if cold is not None:
                return cold
        total = 0
        while total < wanted:
            n = os.preadv(fd, _after(outs, total), start + total)
            if not n:
                break
            total += n
        return total
    except OSError as e:
        raise BackendError(f"reading {path}: {e.strerror}") from e
    finally:
        os.close(fd)


def _scatter(data: memoryview, outs: Sequence[memoryview]) -> int:
    """Copy ``data`` over ``outs`` in order; return the bytes copied."""
    at = 0
    for out in outs:
        n = min(len(out), len(data) - at)
        out[:n] = data[at : at + n]
        at += n
        if at == len(data):
            break
    return at


def _after(outs: Sequence[memoryview], done: int) -> list[memoryview]:
    """The parts of ``outs`` after the first ``done`` bytes (a short read resumes here)."""
    rest: list[memoryview] = []
    for out in outs:
        if done >= len(out):
            done -= len(out)
            continue
        rest.append(out[done:] if done else out)
        done = 0
    return rest
