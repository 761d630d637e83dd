"""The C-Blosc2 codecs: a chunk header is checked before C-Blosc2 reads a byte of the chunk.

Round trips of every dtype through every codec are in test_codecs.py (parametrized over all
registered codecs); these are the hostile chunks Blosc2 itself would not survive or bound.
"""

from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cas.blobstore import MemoryBlobStore
from cas.codecs import EncodeHints, codec_by_name
from cas.digest import digest_of, digest_to_bytes
from cas.errors import IntegrityError
from cas.objects.envelope import encode_header
from cas.objects.store import ObjectStore, chunk_key

BLOSC = ["shuffle-zstd", "bitshuffle-zstd", "shuffle-lz4"]
WEIGHTS = np.random.default_rng(0).standard_normal(50_000).astype(np.float32).tobytes()


def _store() -> ObjectStore:
    return ObjectStore(MemoryBlobStore(), max_object_size=1 << 20)


def _planted(codec_name: str, payload: bytes | bytearray, data: bytes = WEIGHTS) -> ObjectStore:
    """A store whose chunk named after ``data`` holds ``payload`` under ``codec_name``."""
    objects = _store()
    header = encode_header(codec_by_name(codec_name), b"", len(data))
    objects.blobs.put(chunk_key(digest_of(data)), header + bytes(payload))
    return objects


def _encoded(codec_name: str, data: bytes = WEIGHTS) -> bytearray:
    _, payload = codec_by_name(codec_name).encode(memoryview(data), EncodeHints(elem_size=4))
    return bytearray(payload)


@pytest.mark.parametrize("codec_name", BLOSC)
def test_a_blosc_chunk_declaring_a_gigabyte_is_refused_before_decompressing(
    codec_name: str,
) -> None:
    # Python-blosc2 decompresses into a caller's buffer up to the size the chunk declares: this
    # one would write a gigabyte past a 200 KB buffer (a segfault) were the header not checked.
    payload = _encoded(codec_name)
    struct.pack_into("<i", payload, 4, 1 << 30)
    with pytest.raises(IntegrityError, match="declares"):
        _planted(codec_name, payload).get_chunk(digest_of(WEIGHTS))


@pytest.mark.parametrize("codec_name", BLOSC)
def test_a_blosc_chunk_whose_compressed_length_lies_is_refused(codec_name: str) -> None:
    payload = _encoded(codec_name)
    with pytest.raises(IntegrityError, match="declares"):
        _planted(codec_name, payload[:-7]).get_chunk(digest_of(WEIGHTS))
    with pytest.raises(IntegrityError, match="declares"):
        _planted(codec_name, payload + b"tail").get_chunk(digest_of(WEIGHTS))


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [
        (2, 0xC5, "flags"),  # compressor format 6: a user-defined codec, looked up as a plugin
        (16, 36, "filter"),  # filter 36: a registered plugin filter
        (30, 1, "filter"),  # variable-length blocks
        (31, 0x80, "flags"),  # an instrumented codec
        (8, 1 << 21, "block size"),  # one block larger than the whole chunk
    ],
)
def test_a_blosc_chunk_naming_what_cas_never_writes_is_refused(
    offset: int, value: int, message: str
) -> None:
    payload = _encoded("shuffle-zstd")
    if offset == 8:
        struct.pack_into("<i", payload, offset, value)
    else:
        payload[offset] = value
    with pytest.raises(IntegrityError, match=message):
        _planted("shuffle-zstd", payload).get_chunk(digest_of(WEIGHTS))


@pytest.mark.parametrize("codec_name", [*BLOSC, "xor-shuffle-zstd", "sub-shuffle-zstd"])
@pytest.mark.parametrize("size", [3, 4_003, (1 << 20) + 6])
def test_a_chunk_that_ends_inside_an_element_comes_back_whole(codec_name: str, size: int) -> None:
    # Blosc2 restored the bytes after the last whole element wrongly when its block size was not
    # a whole number of elements (a silent wrong tail, which every read then refused).
    data = (WEIGHTS * 100)[:size]
    base = bytes(reversed(data))
    hints = EncodeHints(elem_size=4, base=base, base_digest=digest_of(base))
    codec = codec_by_name(codec_name)
    params, payload = codec.encode(memoryview(data), hints)
    decoded = codec.decode(params, memoryview(bytes(payload)), size, lambda digest: base)
    assert bytes(decoded) == data


def test_a_blosc_delta_with_a_base_of_another_size_is_refused() -> None:
    objects = _store()
    small = objects.put_chunk(bytes(100), codec_by_name("raw")).digest
    data = WEIGHTS[:4000]
    _, payload = codec_by_name("shuffle-zstd").encode(memoryview(data), EncodeHints(elem_size=4))
    header = encode_header(codec_by_name("xor-shuffle-zstd"), digest_to_bytes(small), len(data))
    objects.blobs.put(chunk_key(digest_of(data)), header + bytes(payload))
    with pytest.raises(IntegrityError, match="base"):
        objects.get_chunk(digest_of(data))


@settings(max_examples=150, deadline=None)
@given(
    codec_name=st.sampled_from(BLOSC),
    edits=st.lists(
        st.tuples(st.integers(min_value=0), st.integers(min_value=0, max_value=255)),
        min_size=1,
        max_size=12,
    ),
    cut=st.one_of(st.none(), st.integers(min_value=0)),
)
def test_a_mutated_blosc_chunk_loads_its_bytes_or_is_an_integrity_error(
    codec_name: str, edits: list[tuple[int, int]], cut: int | None
) -> None:
    data = WEIGHTS[:40_000]
    payload = _encoded(codec_name, data)
    for position, value in edits:
        # Half the edits land in the header and block offsets, where a lie does most harm.
        payload[position % (64 if position % 2 else len(payload))] = value
    if cut is not None:
        payload = payload[: cut % len(payload)]
    objects = _planted(codec_name, payload, data)
    with contextlib.suppress(IntegrityError):
        assert objects.get_chunk(digest_of(data)) == data


def test_blosc_codecs_store_trained_weights_smaller_than_plain_zstd_and_lz4_trades_ratio() -> None:
    import torch

    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    for _ in range(5):
        torch.autograd.backward(layer(torch.randn(8, 256)).pow(2).mean())
        opt.step()
    data = memoryview(layer.weight.detach().numpy().tobytes())
    sizes = {
        name: len(codec_by_name(name).encode(data, EncodeHints(elem_size=4, level=1))[1])
        for name in ("zstd", "shuffle-zstd", "shuffle-lz4")
    }
    assert sizes["shuffle-zstd"] < 0.95 * sizes["zstd"]
    assert sizes["shuffle-zstd"] < sizes["shuffle-lz4"] < len(data)


def test_the_first_blosc_decode_leaves_pythons_random_stream_alone() -> None:
    # A resume restores the run's RNG states and then loads; importing blosc2 draws from the
    # global generator, so the codec module restores it.
    import subprocess
    import sys

    script = (
        "import random; random.seed(7); from cas.codecs import codec_by_name, EncodeHints; "
        "c = codec_by_name('shuffle-zstd'); p, pl = c.encode(memoryview(bytes(64)), EncodeHints()); "
        "print(random.random())"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    import random

    assert float(out.stdout) == random.Random(7).random()
