"""A new chunk's write and its hash at once: the file is written while its name is computed.

A chunk's name is its blake3 digest, and a chunk file is created under its name, so the hash came
first and the disk waited for it: each chunk worker hashed 4 MiB (about a millisecond on a busy
core) before its write went out. In a first save every chunk is new, and those milliseconds were
a tenth of the save. Here the bytes go to the store's temp file at once
(``BlobStore.put_if_absent_named``) while a hashing thread computes the name; the file is linked
under it once both are done. A 1 GiB first save took 0.57-0.62 s this way against 0.62-0.65 s
hash first (docs/design.md).

Only where it pays and is safe: a raw chunk (no encoding to run first), large enough to be written
past the page cache, read privately (invariant 9: the bytes hashed are the bytes written, and they
cannot change while the lease lasts), and likely new (``ReuseOdds``): a chunk found stored after
all cost one wasted write and is then handled as any reuse. A store that cannot write first
(``put_if_absent_named``'s default) asks for the name first, as before.
"""

from __future__ import annotations

import os
import threading
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

from cas.blobstore.base import BlobStore
from cas.codecs import Codec
from cas.digest import Digest, digest_of
from cas.objects.envelope import RAW_CODEC_ID, encode_header
from cas.objects.keys import ObjectKind, object_key
from cas.objects.private import PRIVATE_ALIGN_MIN, ReuseOdds
from cas.objects.staging import CPU_SLOTS, cores


def writes_first(view: memoryview, codec: Codec, reuse: ReuseOdds, missed: bool = False) -> bool:
    """Whether a new chunk of ``view`` (read privately) is written before its name is known:
    when the odds say new, or a probe of the same bytes where they lie just ``missed`` (in a
    re-save the odds say stored, and a changed chunk then waited for two hashes before its write
    went out, which made the last one found the save's tail)."""
    likely_new = missed or not reuse.likely()
    return codec.codec_id == RAW_CODEC_ID and len(view) >= PRIVATE_ALIGN_MIN and likely_new


def write_while_hashing(
    blobs: BlobStore, view: memoryview, codec: Codec, reuse: ReuseOdds, counted: bool = False
) -> tuple[bool, Digest]:
    """Store ``view`` as a raw chunk in ``blobs`` while it is hashed: whether this call created
    it, and its digest. A name found taken (stored meanwhile, or damaged) is left to the caller,
    which knows how to reuse or repair it. The outcome counts in ``reuse`` unless a probe
    ``counted`` this put already."""
    hashed = hash_aside(view)
    try:
        stored = blobs.put_if_absent_named(
            lambda: object_key(ObjectKind.CHUNK, hashed.result()),
            (encode_header(codec, b"", len(view)), view),
        )
    finally:
        futures.wait([hashed])  # the hash reads the caller's buffer: it ends before the call does
    if not counted:
        reuse.observe(not stored)
    return stored, hashed.result()


_hashers: ThreadPoolExecutor | None = None
_hashers_lock = threading.Lock()


def hash_aside(view: memoryview) -> Future[Digest]:
    """The blake3 digest of ``view``, computed on one of the process's hashing threads (one per
    core, each hash in ``CPU_SLOTS``) while the caller goes on: a new chunk's file is written
    while its name is computed (``BlobStore.put_if_absent_named``). The caller must not let
    ``view`` change or go before the future is done."""
    global _hashers
    with _hashers_lock:
        if _hashers is None:
            _hashers = ThreadPoolExecutor(cores(), thread_name_prefix="cas-hash")
        hashers = _hashers
    return hashers.submit(_hash, view)


def _hash(view: memoryview) -> Digest:
    with CPU_SLOTS:
        return digest_of(view)


def _forget_in_child() -> None:
    """A forked child starts without the parent's hashing threads, which did not come along."""
    global _hashers, _hashers_lock
    _hashers, _hashers_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
