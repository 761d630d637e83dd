"""Codecs are bit-exact for every dtype and refuse chunks that would decode to anything else."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import cas
from cas.blobstore import MemoryBlobStore
from cas.codecs import EncodeHints, all_codecs, codec_by_name
from cas.codecs.bytegroup import PLANE_STORED, PLANE_ZSTD, PlaneTable
from cas.digest import Digest, digest_of, digest_to_bytes
from cas.errors import FormatError, IntegrityError
from cas.objects.envelope import encode_header
from cas.objects.store import ObjectStore, chunk_key
from cas.repo.config import StoreConfig
from tests.helpers import assert_bit_exact

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
    torch.bool, torch.complex64,
]  # fmt: skip


def special_values(dtype: torch.dtype, n: int = 5003, seed: int = 0) -> torch.Tensor:
    """Random values of ``dtype`` salted with NaN payloads, -0.0, denormals and infinities."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if not (dtype.is_floating_point or dtype.is_complex):
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(dtype)
    if dtype.is_complex:
        parts = special_values(torch.float32, 2 * n, seed).view(torch.complex64)
        return parts
    t = (torch.randn(n, generator=g) * 3).to(dtype)
    bits = t.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )
    size = t.element_size()
    if dtype == torch.float8_e4m3fn:
        nans = [0x7F, 0xFF]  # e4m3fn has only these two NaN encodings and no infinity
    elif dtype == torch.float8_e5m2:
        nans = [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF]
    else:
        exp_bits = {2: 5 if dtype == torch.float16 else 8, 4: 8, 8: 11}[size]
        mant_bits = 8 * size - 1 - exp_bits
        exp_all = ((1 << exp_bits) - 1) << mant_bits
        nans = [
            exp_all | 1,
            exp_all | (1 << (mant_bits - 1)),
            exp_all | 0x5,
            exp_all | ((1 << mant_bits) - 1),
        ]
        nans += [-(1 << (8 * size - 1)) | n_ for n_ in nans[:2]]  # negative-sign NaNs
    specials = [*nans, 1 << (8 * size - 1), 1, 2, 3]  # -0.0 and the smallest denormals
    for i, pattern in enumerate(specials):
        bits[7 * i] = _signed(pattern, size)
    t[1001] = float("inf") if dtype != torch.float8_e4m3fn else 0.0
    t[1002] = float("-inf") if dtype != torch.float8_e4m3fn else -0.0
    return t


def _signed(pattern: int, size: int) -> int:
    pattern &= (1 << (8 * size)) - 1
    return pattern - (1 << (8 * size)) if size > 1 and pattern >= 1 << (8 * size - 1) else pattern


def raw_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def roundtrip(codec_name: str, data: memoryview, base: memoryview | None, elem: int) -> bytes:
    codec = codec_by_name(codec_name)
    hints = EncodeHints(elem_size=elem)
    if codec.needs_base:
        assert base is not None
        hints = EncodeHints(elem_size=elem, base=base, base_digest=digest_of(base))
    params, payload = codec.encode(data, hints)
    fetched = []

    def fetch(digest: Digest) -> bytes:
        assert base is not None and digest == digest_of(base)
        fetched.append(digest)
        return bytes(base)

    out = codec.decode(params, memoryview(bytes(payload)), len(data), fetch)
    assert bool(fetched) == codec.needs_base
    return bytes(out)


def elem_for(codec_name: str, t: torch.Tensor) -> int:
    return t.element_size() // 2 if t.is_complex() else t.element_size()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("codec_name", [c.name for c in all_codecs()])
def test_every_codec_round_trips_every_dtype_bit_exact(codec_name: str, dtype: torch.dtype) -> None:
    value = special_values(dtype)
    base = special_values(dtype, seed=1)
    data = raw_bytes(value)
    out = roundtrip(codec_name, data, raw_bytes(base), elem_for(codec_name, value))
    assert out == bytes(data)
    back = torch.frombuffer(bytearray(out), dtype=torch.uint8).view(dtype)
    assert_bit_exact(back, value)


@pytest.mark.parametrize("codec_name", [c.name for c in all_codecs()])
@pytest.mark.parametrize("size", [0, 1, 3, 4097])
def test_chunks_that_do_not_fill_whole_elements_round_trip(codec_name: str, size: int) -> None:
    rng = np.random.default_rng(size)
    data = memoryview(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    base = memoryview(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    assert roundtrip(codec_name, data, base, 4) == bytes(data)


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(max_size=3000),
    elem=st.sampled_from([1, 2, 3, 4, 8, 16]),
    codec_name=st.sampled_from([c.name for c in all_codecs()]),
    flips=st.lists(st.integers(min_value=0), max_size=8),
)
def test_any_bytes_round_trip_through_any_codec(
    data: bytes, elem: int, codec_name: str, flips: list[int]
) -> None:
    if codec_name in ("sub-delta", "sub-shuffle-zstd") and elem not in (1, 2, 4, 8):
        elem = 4
    base = bytearray(data)
    for flip in flips:
        if base:
            base[flip % len(base)] ^= 1 + flip % 255
    assert roundtrip(codec_name, memoryview(data), memoryview(bytes(base)), elem) == data


@pytest.mark.parametrize("codec_name", [c.name for c in all_codecs()])
def test_a_state_saved_with_each_codec_loads_bit_exact(tmp_path: Path, codec_name: str) -> None:
    repo = cas.open(tmp_path / "s", config=StoreConfig(chunk_size=8192, inline_max=64))
    state = {str(d).removeprefix("torch."): special_values(d, 3001) for d in DTYPES}
    repo.save(state, "v1", codec=codec_name)
    state2 = {k: v.clone() for k, v in state.items()}
    state2["float32"][::7] += 1e-3
    repo.save(state2, "v1", codec=codec_name)
    assert_bit_exact(repo.load("v1"), state2)
    assert_bit_exact(repo.load("v1~1"), state)


# -- hostile chunks ----------------------------------------------------------------------------


def _store() -> ObjectStore:
    return ObjectStore(MemoryBlobStore(), max_object_size=1 << 20)


def _plant(
    objects: ObjectStore, digest: Digest, codec_name: str, params: bytes, payload: bytes, size: int
) -> None:
    header = encode_header(codec_by_name(codec_name), params, size)
    objects.blobs.put(chunk_key(digest), header + payload)


def test_a_zstd_frame_declaring_more_than_the_plane_is_refused() -> None:
    objects = _store()
    data = bytes(4096)
    digest = digest_of(data)
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 20))  # declares 1 MiB
    table = PlaneTable(
        4,
        ((PLANE_ZSTD, len(bomb)), (PLANE_STORED, 1024), (PLANE_STORED, 1024), (PLANE_STORED, 1024)),
    )
    _plant(objects, digest, "bytegroup-zstd", table.pack(), bomb + bytes(3072), len(data))
    with pytest.raises(IntegrityError, match="declares"):
        objects.get_chunk(digest)


def test_a_frame_without_declared_size_that_expands_without_bound_is_refused() -> None:
    objects = _store()
    data = bytes(4096)
    digest = digest_of(data)
    streaming = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    bomb = streaming.compress(bytes(64 << 20)) + streaming.flush()
    assert zstandard.frame_content_size(bomb) == -1 and len(bomb) < 64 << 10
    _plant(
        objects,
        digest,
        "bytegroup-zstd",
        PlaneTable(1, ((PLANE_ZSTD, len(bomb)),)).pack(),
        bomb,
        len(data),
    )
    with pytest.raises(IntegrityError):
        objects.get_chunk(digest)
    _plant(objects, digest, "zstd", b"", bomb, len(data))
    with pytest.raises(IntegrityError):
        objects.get_chunk(digest)


@pytest.mark.parametrize(
    "defect",
    [
        "truncated plane",
        "extra bytes",
        "plane length lies",
        "stored plane short",
        "bad mode",
        "elem size 0",
    ],
)
def test_a_damaged_plane_table_is_refused(defect: str) -> None:
    objects = _store()
    data = np.arange(1024, dtype=np.float32).tobytes()
    digest = digest_of(data)
    params, payload = codec_by_name("bytegroup-zstd").encode(
        memoryview(data), EncodeHints(elem_size=4)
    )
    table = PlaneTable.unpack(params)
    rows = list(table.planes)
    if defect == "truncated plane":
        payload = payload[:-10]
    elif defect == "extra bytes":
        payload = bytes(payload) + b"xx"
    elif defect == "plane length lies":
        rows[0] = (rows[0][0], rows[0][1] + 5)
        rows[1] = (rows[1][0], rows[1][1] - 5)
    elif defect == "stored plane short":
        rows = [(PLANE_STORED, n) for _, n in rows]
    params = PlaneTable(4, tuple(rows)).pack()
    if defect == "bad mode":
        params = params[:1] + b"\x07" + params[2:]
    if defect == "elem size 0":
        params = b"\x00" + params[1:]
    _plant(objects, digest, "bytegroup-zstd", params, bytes(payload), len(data))
    with pytest.raises(IntegrityError):
        objects.get_chunk(digest)


def test_a_chunk_whose_header_declares_another_size_is_refused() -> None:
    objects = _store()
    data = np.arange(1024, dtype=np.float32).tobytes()
    digest = digest_of(data)
    for name in ("zstd", "bytegroup-zstd", "raw"):
        params, payload = codec_by_name(name).encode(memoryview(data), EncodeHints(elem_size=4))
        _plant(objects, digest, name, params, bytes(payload), len(data) * 2)
        with pytest.raises(IntegrityError):
            objects.get_chunk(digest)


def test_a_delta_whose_base_has_another_size_is_refused() -> None:
    objects = _store()
    small = bytes(100)
    small_digest = objects.put_chunk(small, codec_by_name("raw")).digest
    data = bytes(range(200))
    digest = digest_of(data)
    params = digest_to_bytes(small_digest) + PlaneTable(1, ((PLANE_STORED, 200),)).pack()
    _plant(objects, digest, "xor-delta", params, data, len(data))
    with pytest.raises(IntegrityError, match="base"):
        objects.get_chunk(digest)


def test_a_delta_chain_that_loops_is_refused() -> None:
    objects = _store()
    a, b = bytes(64), bytes(range(64))
    da, db = digest_of(a), digest_of(b)
    table = PlaneTable(1, ((PLANE_STORED, 64),)).pack()
    _plant(objects, da, "xor-delta", digest_to_bytes(db) + table, bytes(64), 64)
    _plant(objects, db, "xor-delta", digest_to_bytes(da) + table, bytes(64), 64)
    with pytest.raises(IntegrityError, match="deeper"):
        objects.get_chunk(da)


def test_a_delta_codec_without_a_base_is_a_format_error() -> None:
    with pytest.raises(FormatError):
        codec_by_name("xor-delta").encode(memoryview(bytes(8)), EncodeHints())
    with pytest.raises(FormatError):
        codec_by_name("sub-delta").encode(
            memoryview(bytes(6)),
            EncodeHints(elem_size=3, base=bytes(6), base_digest=digest_of(bytes(6))),
        )


def test_codec_ids_are_registered_once_and_never_reused() -> None:
    ids = {c.name: c.codec_id for c in all_codecs()}
    assert ids == {
        "raw": 0,
        "zstd": 1,
        "bytegroup-zstd": 2,
        "xor-delta": 3,
        "sub-delta": 4,
        "shuffle-zstd": 5,
        "bitshuffle-zstd": 6,
        "shuffle-lz4": 7,
        "xor-shuffle-zstd": 8,
        "sub-shuffle-zstd": 9,
    }
    with pytest.raises(ValueError):
        from cas.codecs import register
        from cas.codecs.bytegroup import ByteGroupCodec

        register(ByteGroupCodec())


def test_byte_planes_beat_plain_zstd_on_trained_float_weights() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    for _ in range(5):
        layer(torch.randn(8, 256)).pow(2).mean().backward()
        opt.step()
    data = raw_bytes(layer.weight.detach())
    sizes = {
        name: len(codec_by_name(name).encode(data, EncodeHints(elem_size=4, level=1))[1])
        for name in ("zstd", "bytegroup-zstd")
    }
    assert sizes["bytegroup-zstd"] < 0.95 * sizes["zstd"] < 0.95 * len(data)

    # The parameters and payload follow docs/codecs.md, read here without the codec's own parser:
    # u8 element size, then per plane (u8 mode, u32 little-endian stored length).
    params, payload = codec_by_name("bytegroup-zstd").encode(
        data, EncodeHints(elem_size=4, level=1)
    )
    assert params[0] == 4 and len(params) == 1 + 4 * 5
    rows = [struct.unpack_from("<BI", params, 1 + 5 * k) for k in range(4)]
    assert sum(length for _, length in rows) == len(payload)  # 4-byte floats leave no tail
    plane_size = len(data) // 4
    # Little-endian fp32: plane 3 holds sign and exponent, which compress; plane 0 is noise.
    assert rows[3][0] == PLANE_ZSTD and rows[3][1] < plane_size // 2
    assert rows[0] == (PLANE_STORED, plane_size)
    planes: list[bytes] = []
    offset = 0
    for mode, length in rows:
        part = bytes(payload[offset : offset + length])
        offset += length
        planes.append(zstandard.ZstdDecompressor().decompress(part) if mode == PLANE_ZSTD else part)
    assert all(len(plane) == plane_size for plane in planes)
    interleaved = np.stack([np.frombuffer(plane, dtype=np.uint8) for plane in planes], axis=1)
    assert interleaved.tobytes() == bytes(data)
