"""Shuffle + zstd / lz4 codecs on C-Blosc2 (ids 5-9): compiled SIMD shuffles, one bounded chunk.

C-Blosc2 does in compiled, vectorised code what ``bytegroup-zstd`` does with numpy: it splits
each block into byte planes (shuffle) or bit planes (bitshuffle), compresses each plane with
zstd or lz4 and stores a block whose compression does not pay as it is. Measured on the tensors
of a small GPT's AdamW checkpoints it stores what ``bytegroup-zstd`` does (0.819 of raw) and
decodes 1.5-2x faster. The delta codecs compute ``chunk XOR base`` or the zigzag
difference of ``cas.codecs.xor_delta`` first, then shuffle and compress the result.

| id | name | payload |
|---|---|---|
| 5 | ``shuffle-zstd`` | a Blosc2 chunk: byte shuffle, zstd |
| 6 | ``bitshuffle-zstd`` | a Blosc2 chunk: bit shuffle, zstd |
| 7 | ``shuffle-lz4`` | a Blosc2 chunk: byte shuffle, lz4 (faster, larger) |
| 8 | ``xor-shuffle-zstd`` | ``chunk XOR base``, then as id 5 |
| 9 | ``sub-shuffle-zstd`` | the zigzag difference of ``sub-delta``, then as id 5 |

Parameters are empty for ids 5-7 and the 32-byte digest of the base chunk for ids 8 and 9. The
payload is one Blosc2 chunk (its 32-byte extended header, then blocks), or nothing for an empty
chunk. The shuffle's type size is the byte-group element size (a complex number's component).

Python-blosc2 decompresses into a caller's buffer trusting the size the chunk header declares,
not the buffer's (a lying header writes past the buffer), and allocates what the header declares
when given none. So every header is checked here before C-Blosc2 sees it: it must declare
exactly the envelope's decoded size and the payload's length, a block no larger than the chunk,
and only the filters and compressors cas writes (no user-defined codec or filter, which Blosc2
would look up as a plugin); decompression then goes into a buffer of exactly that size, and any
failure C-Blosc2 reports is a ``FormatError``.
"""

from __future__ import annotations

import struct
import threading
from typing import TYPE_CHECKING, Any

from cas.codecs.base import BaseFetcher, Codec, EncodeHints
from cas.codecs.bytegroup import as_bytes, as_view, check_elem_size
from cas.codecs.xor_delta import SubDeltaCodec, XorDeltaCodec
from cas.digest import DIGEST_BYTES, Digest, digest_to_bytes, parse_digest
from cas.errors import FormatError

if TYPE_CHECKING:
    from cas.codecs.bytegroup import Bytes

CHUNK_HEADER = 32
"""Blosc2's extended chunk header, which every chunk cas writes has."""
_SIZES = struct.Struct("<iii")  # nbytes, blocksize, cbytes at offset 4
_EXTENDED = 0x05  # flags bits 0 and 2 together mark the Blosc2 extended header
_FORMATS = {0, 1, 4}  # compressor formats: BloscLZ (memcpyed chunks), LZ4, Zstd; no plugins
_FILTERS = {0, 1, 2}  # no filter, shuffle, bitshuffle
_BLOSC2_FLAGS_KNOWN = 0x01 | 0x70  # a zstd dictionary, run-length special values
MAX_CHUNK = 2**31 - 1 - CHUNK_HEADER
"""Blosc2 chunks hold at most this many bytes (cas chunks are far smaller)."""
BLOCK = 1 << 20
"""Blosc2 block size. Blocks are shuffled and compressed one by one, each byte plane on its own
(split mode); Blosc2's own choice at zstd level 1, 128 KiB, stored the tensors of a small GPT's
AdamW checkpoints 1.4% of raw larger than whole-tensor blocks (0.833 vs 0.819) for no faster
decoding."""
THREADS = 1
"""Blosc2 threads per chunk. Parallelism comes from the reader and writer pools, one chunk per
thread (the GIL is released); on 2 cores a 4 MiB chunk of GPT weights decoded at 5,020 MB/s on
one thread and 5,430 on two at best, 4,730 and 4,290 median over 40 runs, so a second thread per
chunk only competes with the pool's other reads."""

_ready = threading.Lock()
_blosc2: Any = None


def _lib() -> Any:
    """The blosc2 module, imported on first use (``import cas`` stays quick) with the GIL released
    during (de)compression, so the reader pool decodes several chunks at once."""
    global _blosc2
    if _blosc2 is None:
        with _ready:
            if _blosc2 is None:
                import random

                # Importing blosc2 draws from Python's global random generator; a load must not
                # move a training run's seeded stream (it may have just been restored).
                state = random.getstate()
                import blosc2

                random.setstate(state)
                blosc2.set_releasegil(True)
                _blosc2 = blosc2
    return _blosc2


def check_chunk(payload: memoryview, decoded_size: int) -> None:
    """Refuse a Blosc2 chunk header that does not describe exactly ``decoded_size`` bytes in
    exactly ``len(payload)`` bytes, or that names a filter or compressor cas does not write."""
    if len(payload) < CHUNK_HEADER:
        raise FormatError(f"blosc2 chunk of {len(payload)} bytes is shorter than its header")
    flags = payload[2]
    nbytes, blocksize, cbytes = _SIZES.unpack_from(payload, 4)
    if nbytes != decoded_size or cbytes != len(payload):
        raise FormatError(
            f"blosc2 chunk declares {nbytes} bytes in {cbytes}; "
            f"the object holds {decoded_size} in {len(payload)}"
        )
    if (blocksize <= 0 and decoded_size > 0) or blocksize > max(decoded_size, 1):
        raise FormatError(f"blosc2 block size {blocksize} out of range")
    if flags & _EXTENDED != _EXTENDED or flags >> 5 not in _FORMATS:
        raise FormatError(f"blosc2 chunk flags {flags:#04x} are not ones cas writes")
    if any(f not in _FILTERS for f in payload[16:22]) or payload[30] != 0:
        raise FormatError("blosc2 chunk names a filter cas does not write")
    if payload[31] & ~_BLOSC2_FLAGS_KNOWN:
        raise FormatError(f"blosc2 chunk flags {payload[31]:#04x} are not ones cas writes")


def blosc_compress(data: Bytes, typesize: int, level: int, compressor: str, filt: str) -> bytes:
    """One Blosc2 chunk of ``data``; ``level`` is a zstd level, clamped to Blosc2's 1..9."""
    if len(data) == 0:
        return b""
    if len(data) > MAX_CHUNK:
        raise FormatError(f"a chunk of {len(data)} bytes is too large for a blosc2 chunk")
    lib = _lib()
    typesize = check_elem_size(typesize)
    # C-Blosc2 restores the bytes after a block's last whole element wrongly when the block size
    # is not a whole number of elements (a chunk of 4,003 bytes shuffled by 4 came back with a
    # bad tail), so blocks hold whole elements and only the last one has the leftover bytes.
    block = min(len(data), BLOCK)
    if len(data) >= typesize:
        block = block // typesize * typesize
    out: bytes = lib.compress2(
        data,
        typesize=typesize,
        clevel=min(max(level, 1), 9),
        codec=lib.Codec.ZSTD if compressor == "zstd" else lib.Codec.LZ4,
        filters=[lib.Filter.SHUFFLE if filt == "shuffle" else lib.Filter.BITSHUFFLE],
        blocksize=block,
        nthreads=THREADS,
    )
    return out


def blosc_decompress(payload: memoryview, decoded_size: int) -> Bytes:
    """The ``decoded_size`` bytes of a checked Blosc2 chunk, in a fresh writable array."""
    import numpy as np

    out = np.empty(decoded_size, dtype=np.uint8)
    blosc_decompress_into(payload, out)
    return out


def blosc_decompress_into(payload: memoryview, out: Bytes) -> None:
    """Decompress a checked Blosc2 chunk into ``out``, which must be exactly its decoded size
    (the header is checked against ``len(out)`` first, so a lying header cannot overrun it)."""
    if len(out) == 0 and len(payload) == 0:
        return
    check_chunk(payload, len(out))
    if len(out) == 0:
        return
    try:
        _lib().decompress2(payload, dst=out, nthreads=THREADS)
    except (ValueError, RuntimeError) as e:
        raise FormatError(f"corrupt blosc2 chunk: {e}") from e


class BloscCodec(Codec):
    """A standalone Blosc2 chunk with one filter and compressor (ids 5-7)."""

    def __init__(self, codec_id: int, name: str, compressor: str, filt: str) -> None:
        self.codec_id = codec_id
        self.name = name
        self.compressor = compressor
        self.filter = filt

    def encode(self, data: memoryview, hints: EncodeHints) -> tuple[bytes, bytes]:
        return b"", blosc_compress(
            as_bytes(data), hints.elem_size, hints.level, self.compressor, self.filter
        )

    def decode(
        self, params: bytes, payload: memoryview, decoded_size: int, fetch_base: BaseFetcher
    ) -> bytes | memoryview:
        if params:
            raise FormatError(f"{self.name} takes no parameters")
        return as_view(blosc_decompress(payload, decoded_size))

    def decode_into(
        self, params: bytes, payload: memoryview, out: memoryview, fetch_base: BaseFetcher
    ) -> None:
        if params:
            raise FormatError(f"{self.name} takes no parameters")
        blosc_decompress_into(payload, writable_bytes(out))


class BloscDeltaCodec(Codec):
    """A delta against a base chunk, then byte shuffle and zstd (ids 8 and 9).

    ``combine`` is the numpy delta of ``xor-delta`` or ``sub-delta``; only the back half, the
    byte planes and their compression, differs from those codecs.
    """

    needs_base = True

    def __init__(self, codec_id: int, name: str, combine: XorDeltaCodec | SubDeltaCodec) -> None:
        self.codec_id = codec_id
        self.name = name
        self.combine = combine

    def encode(self, data: memoryview, hints: EncodeHints) -> tuple[bytes, bytes]:
        if hints.base is None or hints.base_digest is None:
            raise FormatError("a delta codec needs a base chunk (EncodeHints.base and base_digest)")
        if len(hints.base) != len(data):
            raise FormatError(f"delta base holds {len(hints.base)} bytes, the chunk {len(data)}")
        self.combine.check_elem_size(hints.elem_size)
        delta = self.combine.forward(as_bytes(data), as_bytes(hints.base), hints.elem_size)
        payload = blosc_compress(delta, hints.elem_size, hints.level, "zstd", "shuffle")
        return digest_to_bytes(hints.base_digest), payload

    def decode(
        self, params: bytes, payload: memoryview, decoded_size: int, fetch_base: BaseFetcher
    ) -> bytes | memoryview:
        base_digest = _base_digest(params)
        elem_size = payload[3] if len(payload) >= CHUNK_HEADER else 1
        self.combine.check_elem_size(elem_size)
        base = fetch_base(base_digest)
        if len(base) != decoded_size:
            raise FormatError(
                f"delta base {base_digest} holds {len(base)} bytes, not {decoded_size}"
            )
        delta = blosc_decompress(payload, decoded_size)
        return as_view(self.combine.inverse(delta, as_bytes(base), elem_size))

    def decode_into(
        self, params: bytes, payload: memoryview, out: memoryview, fetch_base: BaseFetcher
    ) -> None:
        base = fetch_base(_base_digest(params))
        if len(base) != len(out):
            raise FormatError(f"delta base holds {len(base)} bytes, not {len(out)}")
        out[:] = memoryview(base).cast("B")
        self.apply_into(params, payload, out)

    def apply_into(self, params: bytes, payload: memoryview, out: memoryview) -> None:
        # The delta is decompressed beside ``out`` and folded into it: the base is never copied.
        _base_digest(params)
        elem_size = payload[3] if len(payload) >= CHUNK_HEADER else 1
        self.combine.check_elem_size(elem_size)
        delta = blosc_decompress(payload, len(out))
        self.combine.apply(delta, writable_bytes(out), elem_size)

    def base_of(self, params: bytes) -> Digest | None:
        return _base_digest(params)


def writable_bytes(out: memoryview) -> Bytes:
    """A uint8 array over the caller's buffer ``out``, which must be writable."""
    array = as_bytes(out)
    if not array.flags.writeable:
        raise ValueError("decoding into a read-only buffer")
    return array


def _base_digest(params: bytes) -> Digest:
    if len(params) != DIGEST_BYTES:
        raise FormatError("delta parameters are not one base digest")
    return parse_digest(params)
