"""A compressed chunk read for a load is decoded straight into the caller's buffer, verified there.

A load decompresses each chunk (and a delta's base) into the tensor's own buffer and folds the
delta in place, instead of decoding into fresh buffers and copying; the base of a delta is read
once. None of it may weaken a read: what lands in the buffer is hashed there, and a hostile or
damaged chunk is still an IntegrityError.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cas.blobstore import LocalBlobStore, MemoryBlobStore
from cas.codecs import Codec, EncodeHints, all_codecs, codec_by_name
from cas.digest import Digest, digest_of
from cas.errors import IntegrityError
from cas.objects.store import ObjectStore, chunk_key

rng = np.random.default_rng(0)
BASE = (rng.standard_normal(20_001) * 0.02).astype(np.float32)
NEXT = BASE + (rng.standard_normal(BASE.size) * 1e-4).astype(np.float32)
# An odd byte count leaves a tail that fills no element: the deltas treat it apart.
BASE_BYTES, NEXT_BYTES = BASE.tobytes()[:-1], NEXT.tobytes()[:-1]


def _hints() -> EncodeHints:
    return EncodeHints(elem_size=4, level=1, base=BASE_BYTES, base_digest=digest_of(BASE_BYTES))


@pytest.mark.parametrize("codec", all_codecs(), ids=lambda c: c.name)
def test_every_codec_decodes_into_a_buffer_what_it_decodes_alone(codec: Codec) -> None:
    params, payload = codec.encode(memoryview(NEXT_BYTES), _hints())
    view = memoryview(bytes(payload))
    alone = bytes(codec.decode(params, view, len(NEXT_BYTES), lambda d: BASE_BYTES))
    assert alone == NEXT_BYTES
    out = memoryview(bytearray(len(NEXT_BYTES)))
    codec.decode_into(params, view, out, lambda d: BASE_BYTES)
    assert bytes(out) == NEXT_BYTES
    if codec.needs_base:
        out[:] = BASE_BYTES
        codec.apply_into(params, view, out)
        assert bytes(out) == NEXT_BYTES


def _delta_store(root: Path, delta: str = "sub-shuffle-zstd") -> tuple[ObjectStore, Digest]:
    """A local store holding NEXT as a delta against BASE (a keyframe); NEXT's digest."""
    objects = ObjectStore(LocalBlobStore(root), max_object_size=1 << 22)
    objects.put_chunk(BASE.tobytes(), codec_by_name("shuffle-zstd"))
    base = digest_of(BASE.tobytes())
    hints = EncodeHints(elem_size=4, level=1, base=BASE.tobytes(), base_digest=base)
    result = objects.put_chunk(NEXT.tobytes(), codec_by_name(delta), hints)
    assert result.base == base
    return objects, result.digest


@pytest.mark.parametrize("delta", ["sub-shuffle-zstd", "xor-shuffle-zstd"])
def test_a_delta_read_into_a_buffer_opens_its_keyframe_once(tmp_path: Path, delta: str) -> None:
    objects, digest = _delta_store(tmp_path / "store", delta)
    base_key = chunk_key(digest_of(BASE.tobytes()))
    opened: Counter[str] = Counter()
    blobs = objects.blobs
    get, get_range = blobs.get, blobs.get_range

    def counting_get(key: str) -> bytes:
        opened[key] += 1
        return get(key)

    def counting_range(key: str, start: int, end: int) -> bytes:
        opened[key] += 1
        return get_range(key, start, end)

    blobs.get = counting_get  # type: ignore[method-assign]
    blobs.get_range = counting_range  # type: ignore[method-assign]
    out = memoryview(bytearray(NEXT.nbytes))
    objects.read_chunk_into(digest, out, encoded=True)
    assert bytes(out) == NEXT.tobytes()
    assert opened[base_key] == 1  # its header walk read it whole: no second open to decode it


def test_a_damaged_keyframe_under_a_delta_read_into_a_buffer_is_an_integrity_error(
    tmp_path: Path,
) -> None:
    objects, digest = _delta_store(tmp_path / "store")
    path = tmp_path / "store" / chunk_key(digest_of(BASE.tobytes()))
    blob = bytearray(path.read_bytes())
    blob[-100] ^= 0xFF  # inside the compressed keyframe: it still decompresses, to wrong bytes
    path.write_bytes(bytes(blob))
    out = memoryview(bytearray(NEXT.nbytes))
    with pytest.raises(IntegrityError):
        objects.read_chunk_into(digest, out, encoded=True)


def test_a_buffer_of_another_size_is_the_manifests_fault_not_the_chunks(tmp_path: Path) -> None:
    objects, digest = _delta_store(tmp_path / "store")
    with pytest.raises(IntegrityError, match="manifest says"):
        objects.read_chunk_into(digest, memoryview(bytearray(NEXT.nbytes - 4)), encoded=True)
    assert not objects.quarantined()  # the chunk is sound; only the listing lied
    assert bytes(objects.get_chunk(digest)) == NEXT.tobytes()


@settings(max_examples=120, deadline=None)
@given(
    victim=st.sampled_from(["delta", "keyframe"]),
    edits=st.lists(
        st.tuples(st.integers(min_value=0), st.integers(min_value=0, max_value=255)),
        min_size=1,
        max_size=8,
    ),
    cut=st.one_of(st.none(), st.integers(min_value=0)),
    local=st.booleans(),
)
def test_a_mutated_delta_or_keyframe_read_into_a_buffer_fills_it_or_is_an_integrity_error(
    victim: str, edits: list[tuple[int, int]], cut: int | None, local: bool
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        objects, digest = _delta_store(Path(tmp) / "store")
        if not local:  # the same objects where nothing reads in place
            memory = ObjectStore(MemoryBlobStore(), max_object_size=1 << 22)
            for key in objects.blobs.list("chunks/"):
                memory.blobs.put(key, objects.blobs.get(key))
            objects = memory
        key = chunk_key(digest if victim == "delta" else digest_of(BASE.tobytes()))
        blob = bytearray(objects.blobs.get(key))
        for position, value in edits:
            # Half the edits land in the envelope and Blosc2 headers, where a lie does most harm.
            blob[position % (96 if position % 2 else len(blob))] = value
        if cut is not None:
            blob = blob[: cut % len(blob)]
        objects.blobs.put(key, bytes(blob))
        out = memoryview(bytearray(NEXT.nbytes))
        with contextlib.suppress(IntegrityError):
            objects.read_chunk_into(digest, out, encoded=True)
            assert bytes(out) == NEXT.tobytes()
