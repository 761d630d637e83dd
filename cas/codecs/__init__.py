"""Chunk codecs by registered id (never reused).

0 raw, 1 zstd, 2 bytegroup-zstd, 3 xor-delta, 4 sub-delta (numpy byte planes); 5 shuffle-zstd,
6 bitshuffle-zstd, 7 shuffle-lz4, 8 xor-shuffle-zstd, 9 sub-shuffle-zstd (C-Blosc2).
"""

from __future__ import annotations

from cas.codecs.base import BaseFetcher, Codec, EncodeHints
from cas.codecs.blosc import BloscCodec, BloscDeltaCodec
from cas.codecs.bytegroup import ByteGroupCodec
from cas.codecs.raw import RawCodec
from cas.codecs.xor_delta import SubDeltaCodec, XorDeltaCodec
from cas.codecs.zstd import ZstdCodec
from cas.errors import FormatError

__all__ = [
    "BaseFetcher",
    "Codec",
    "EncodeHints",
    "all_codecs",
    "codec_by_id",
    "codec_by_name",
    "register",
]

_BY_ID: dict[int, Codec] = {}
_BY_NAME: dict[str, Codec] = {}


def register(codec: Codec) -> Codec:
    """Add a codec to the registry; ids and names are unique forever."""
    if codec.codec_id in _BY_ID or codec.name in _BY_NAME:
        raise ValueError(f"codec id {codec.codec_id} / name {codec.name!r} already registered")
    _BY_ID[codec.codec_id] = codec
    _BY_NAME[codec.name] = codec
    return codec


def codec_by_id(codec_id: int) -> Codec:
    """The codec with a registered id; an unknown id is a FormatError."""
    try:
        return _BY_ID[codec_id]
    except KeyError:
        raise FormatError(f"unknown codec id {codec_id} (written by a newer cas?)") from None


def all_codecs() -> list[Codec]:
    """Every registered codec, by id."""
    return [_BY_ID[i] for i in sorted(_BY_ID)]


def codec_by_name(name: str) -> Codec:
    """The codec with a registered name; an unknown name is a FormatError."""
    try:
        return _BY_NAME[name]
    except KeyError:
        known = ", ".join(sorted(_BY_NAME))
        raise FormatError(f"unknown codec {name!r} (known: {known})") from None


register(RawCodec())
register(ZstdCodec())
register(ByteGroupCodec())
register(XorDeltaCodec())
register(SubDeltaCodec())
register(BloscCodec(5, "shuffle-zstd", "zstd", "shuffle"))
register(BloscCodec(6, "bitshuffle-zstd", "zstd", "bitshuffle"))
register(BloscCodec(7, "shuffle-lz4", "lz4", "shuffle"))
register(BloscDeltaCodec(8, "xor-shuffle-zstd", XorDeltaCodec()))
register(BloscDeltaCodec(9, "sub-shuffle-zstd", SubDeltaCodec()))
