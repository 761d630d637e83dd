"""Delta codecs against a base chunk: XOR (id 3) and zigzag difference (id 4), then byte-grouped zstd.

Consecutive checkpoints of a run, and a fine-tune and its base model, hold the same tensor with
small changes: the sign, exponent and top mantissa bits mostly agree. ``xor-delta`` stores
``chunk XOR base``; ``sub-delta`` stores each element's bit pattern minus the base's, as an
unsigned integer mod 2**bits, zigzag-coded so that small changes either way become small numbers
(a carry across the exponent boundary, e.g. 1.0 vs 0.99999, is a long run of flipped bits to XOR
but a difference of one). Measured on AdamW checkpoints 50 steps apart, sub-delta stores 3% less
than XOR. Either result is then byte-grouped and zstd'd exactly as ``bytegroup-zstd`` does.

Codec parameters::

    32 bytes  blake3 digest of the base chunk (same decoded size as this chunk)
    ...       byte-group plane table (see cas.codecs.bytegroup)

Decoding fetches the base through the object store, which verifies it (recursively, since a base
may itself be a delta) and bounds the chain depth; a base of the wrong size is refused.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any

from cas.codecs.base import BaseFetcher, Codec, EncodeHints
from cas.codecs.bytegroup import (
    PlaneTable,
    as_bytes,
    as_view,
    check_elem_size,
    decode_grouped,
    encode_grouped,
)
from cas.digest import DIGEST_BYTES, Digest, digest_to_bytes, parse_digest
from cas.errors import FormatError

if TYPE_CHECKING:
    import numpy.typing as npt

    from cas.codecs.bytegroup import Bytes

_UINT = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def _base_bytes(hints: EncodeHints, size: int) -> Bytes:
    if hints.base is None or hints.base_digest is None:
        raise FormatError("a delta codec needs a base chunk (EncodeHints.base and base_digest)")
    if len(hints.base) != size:
        raise FormatError(f"delta base holds {len(hints.base)} bytes, the chunk {size}")
    return as_bytes(hints.base)


def _split_params(params: bytes) -> tuple[Digest, PlaneTable]:
    if len(params) < DIGEST_BYTES:
        raise FormatError("delta parameters truncated")
    return parse_digest(params[:DIGEST_BYTES]), PlaneTable.unpack(params, DIGEST_BYTES)


def _fetch_base(fetch_base: BaseFetcher, digest: Digest, size: int) -> Bytes:
    base = fetch_base(digest)
    if len(base) != size:
        raise FormatError(f"delta base {digest} holds {len(base)} bytes, the chunk {size}")
    return as_bytes(base)


class _DeltaCodec(Codec):
    """The shared frame of the two delta codecs; subclasses say how a chunk and its base combine."""

    needs_base = True

    def encode(self, data: memoryview, hints: EncodeHints) -> tuple[bytes, bytes]:
        base = _base_bytes(hints, len(data))
        assert hints.base_digest is not None
        self.check_elem_size(hints.elem_size)
        delta = self.forward(as_bytes(data), base, hints.elem_size)
        table, parts = encode_grouped(delta, hints.elem_size, hints.level)
        return digest_to_bytes(hints.base_digest) + table.pack(), b"".join(parts)

    def decode(
        self, params: bytes, payload: memoryview, decoded_size: int, fetch_base: BaseFetcher
    ) -> bytes | memoryview:
        base_digest, table = _split_params(params)
        self.check_elem_size(table.elem_size)
        # The base first: fetching it may decode a chain, which then need not sit beside this
        # chunk's decoded delta.
        base = _fetch_base(fetch_base, base_digest, decoded_size)
        delta = decode_grouped(table, payload, decoded_size)
        return as_view(self.inverse(delta, base, table.elem_size))

    def base_of(self, params: bytes) -> Digest | None:
        return _split_params(params)[0]

    def check_elem_size(self, elem_size: int) -> None:
        """Refuse element sizes this combination cannot use (FormatError)."""
        check_elem_size(elem_size)

    @abstractmethod
    def forward(self, data: Bytes, base: Bytes, elem_size: int) -> Bytes:
        """The bytes to store for ``data`` against ``base`` (same length)."""

    @abstractmethod
    def inverse(self, delta: Bytes, base: Bytes, elem_size: int) -> Bytes:
        """``data`` back from what ``forward`` stored and the same base."""

    @abstractmethod
    def apply(self, delta: Bytes, base: Bytes, elem_size: int) -> None:
        """As ``inverse``, but writing ``data`` over ``base`` (writable; ``delta`` may be
        overwritten too), so a reader that decoded the base into its output buffer keeps it."""


class XorDeltaCodec(_DeltaCodec):
    """chunk XOR base, byte-grouped; works for any element size."""

    codec_id = 3
    name = "xor-delta"

    def forward(self, data: Bytes, base: Bytes, elem_size: int) -> Bytes:
        import numpy as np

        return np.bitwise_xor(data, base)

    def inverse(self, delta: Bytes, base: Bytes, elem_size: int) -> Bytes:
        import numpy as np

        if delta.flags.writeable:
            return np.bitwise_xor(delta, base, out=delta)
        return np.bitwise_xor(delta, base)

    def apply(self, delta: Bytes, base: Bytes, elem_size: int) -> None:
        import numpy as np

        np.bitwise_xor(base, delta, out=base)


class SubDeltaCodec(_DeltaCodec):
    """Zigzag-coded difference of element bit patterns, byte-grouped; element size 1, 2, 4 or 8.

    Trailing bytes that do not fill an element are XORed with the base.
    """

    codec_id = 4
    name = "sub-delta"

    def check_elem_size(self, elem_size: int) -> None:
        if elem_size not in _UINT:
            raise FormatError(f"sub-delta works on 1, 2, 4 or 8-byte elements, not {elem_size}")

    def forward(self, data: Bytes, base: Bytes, elem_size: int) -> Bytes:
        import numpy as np

        out = np.empty_like(data)
        n = _whole(len(data), elem_size)
        a, b, words = (_view(x, n, elem_size) for x in (data, base, out))
        np.subtract(a, b, out=words)
        sign = words >> words.dtype.type(8 * elem_size - 1)
        np.negative(sign, out=sign)
        np.left_shift(words, words.dtype.type(1), out=words)
        np.bitwise_xor(words, sign, out=words)
        np.bitwise_xor(data[n:], base[n:], out=out[n:])
        return out

    def inverse(self, delta: Bytes, base: Bytes, elem_size: int) -> Bytes:
        import numpy as np

        out, n, words = _differences(delta, elem_size)
        np.add(words, _view(base, n, elem_size), out=words)
        np.bitwise_xor(out[n:], base[n:], out=out[n:])
        return out

    def apply(self, delta: Bytes, base: Bytes, elem_size: int) -> None:
        import numpy as np

        scratch, n, words = _differences(delta, elem_size)
        b = _view(base, n, elem_size)
        np.add(b, words, out=b)
        np.bitwise_xor(base[n:], scratch[n:], out=base[n:])


def _differences(delta: Bytes, elem_size: int) -> tuple[Bytes, int, npt.NDArray[Any]]:
    """``(bytes, n, words)``: ``delta`` with its first ``n`` bytes (whole elements) turned from
    zigzag codes back into differences, ``words`` viewing them. The decoded delta is a fresh
    array, so it is undone in place to spare a pass and an allocation; a read-only one is
    copied first."""
    import numpy as np

    scratch = delta if delta.flags.writeable else delta.copy()
    n = _whole(len(delta), elem_size)
    words = _view(scratch, n, elem_size)
    one = words.dtype.type(1)
    sign = words & one
    np.negative(sign, out=sign)
    np.right_shift(words, one, out=words)
    np.bitwise_xor(words, sign, out=words)
    return scratch, n, words


def _whole(length: int, elem_size: int) -> int:
    return (length // elem_size) * elem_size


def _view(data: Bytes, n: int, elem_size: int) -> npt.NDArray[Any]:
    """The first ``n`` bytes as unsigned integers of ``elem_size`` bytes (little-endian)."""
    return data[:n].view(_UINT[elem_size])
