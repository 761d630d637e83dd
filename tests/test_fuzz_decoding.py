"""Fuzzed manifests, state trees, object envelopes and ref records: only a CASError ever escapes.

Valid documents written by cas itself are mutated (a field replaced by a value of another type,
a huge number, a deep nesting; a key removed) and fed to every decoding entry point, and to
``Repository.load`` and ``show`` on a store holding them.
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cas
from cas.blobstore.memory import MemoryBlobStore
from cas.codecs import EncodeHints, all_codecs, codec_by_name
from cas.digest import digest_of
from cas.model.describe import diff_manifests, tensor_table
from cas.model.manifest import decode_manifest, encode_manifest
from cas.model.state import decode_state
from cas.names import RefName
from cas.objects.envelope import encode_header
from cas.objects.store import ObjectStore, chunk_key
from cas.refs.records import decode_ref
from cas.repo.config import StoreConfig
from tests.hostile import HOSTILE_REF

FUZZ = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@cache
def valid_documents() -> list[dict[str, Any]]:
    """Manifests cas writes: a state with every kind of leaf and tensor, and ingested files."""
    root = Path(tempfile.mkdtemp(prefix="cas-fuzz-"))
    repo = cas.open(root / "store", config=StoreConfig(chunk_size=4096))
    state = {
        "model": {"w": torch.randn(64, 40), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "np": np.arange(6, dtype=np.int16).reshape(2, 3),
        "scalar": np.float32(1.5),
        "opt": [1, 2**70, (torch.float16, torch.device("cpu"))],
        "ints": {3: "three", "s": None, "b": b"\x00"},
    }
    repo.save(state, "runs/state", metadata={"step": 3, "nested": {"a": [1, 2]}})
    (root / "f.bin").write_bytes(bytes(range(256)) * 64)
    repo.put_path(root / "f.bin", "runs/files")
    docs = [msgpack.unpackb(encode_manifest(repo.manifest(r)), strict_map_key=False) for r in (
        "runs/state", "runs/files")]  # fmt: skip
    repo.close()
    return docs


def nested(depth: int) -> Any:
    node: Any = 0
    for _ in range(depth):
        node = {"~": "list", "items": [node]}
    return node


HOSTILE_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.sampled_from([2**62, 2**63, 2**64 - 1, -1, 0, 1 << 40]),
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=40),
    st.sampled_from(["~", "dict", "list", "tensor", "int", "device", "items", "../x", "/etc", "a\0b"]),
    st.sampled_from(["9" * 5000, "cuda:x", "warp", "<f4", "|V0", "<M8[ns]", "uint8", "float32"]),
    st.lists(st.integers(min_value=-2, max_value=2**62), max_size=4),
    st.dictionaries(st.sampled_from(["~", "items", "i", "v", "kind"]), st.integers(-1, 3), max_size=3),
    st.integers(min_value=90, max_value=240).map(nested),
    st.just([[b"\x01" * 32, 8]] * 2000),
)  # fmt: skip


def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path]
    if isinstance(node, dict):
        items: Any = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return found
    for key, value in list(items)[:64]:
        found.extend(_paths(value, (*path, key)))
    return found


@st.composite
def mutated_documents(draw: st.DrawFn) -> dict[str, Any]:
    """A valid manifest document with one to three fields replaced, removed or duplicated."""
    doc: dict[str, Any] = copy.deepcopy(draw(st.sampled_from(valid_documents())))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(doc)[1:]))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "remove"]))
        if action == "remove" and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = copy.deepcopy(draw(HOSTILE_VALUES))
    return doc


def _pack(doc: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(doc)
    return packed


@FUZZ
@given(mutated_documents())
def test_a_mutated_manifest_decodes_or_is_a_cas_error(doc: dict[str, Any]) -> None:
    with contextlib.suppress(cas.CASError):
        manifest = decode_manifest(_pack(doc))
        tensor_table(manifest)
        diff_manifests(manifest, manifest)
        decode_state(manifest.tree, lambda i: manifest.tensors[i])


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_bytes_are_no_manifest(data: bytes) -> None:
    with pytest.raises(cas.CASError):
        decode_manifest(data)


@pytest.fixture(scope="module")
def fuzz_store(tmp_path_factory: pytest.TempPathFactory) -> cas.Repository:
    return cas.open(tmp_path_factory.mktemp("fuzz") / "store")


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(mutated_documents())  # fmt: skip
def test_load_and_show_of_a_mutated_manifest_raise_only_cas_errors(
    fuzz_store: cas.Repository, doc: dict[str, Any]
) -> None:
    digest = fuzz_store.objects.put_manifest(_pack(doc), codec_by_name("zstd"))
    fuzz_store.set_ref(HOSTILE_REF, digest)
    for read in (fuzz_store.load, fuzz_store.show):
        with contextlib.suppress(cas.CASError):
            read(HOSTILE_REF)


_DATA = np.arange(512, dtype=np.float32).tobytes()
_BASE = bytes(reversed(_DATA))


@cache
def valid_envelopes() -> list[bytes]:
    """``_DATA`` stored by each registered codec (the delta ones against ``_BASE``)."""
    hints = EncodeHints(elem_size=4, base=_BASE, base_digest=digest_of(_BASE))
    out = []
    for codec in all_codecs():
        params, payload = codec.encode(memoryview(_DATA), hints)
        out.append(encode_header(codec, params, len(_DATA)) + bytes(payload))
    return out


ENVELOPES = valid_envelopes()
"""Built at import: importing blosc2 (on first use by its codecs) inside a strategy touches the
``random`` module's state, which hypothesis warns about."""


@st.composite
def mutated_envelopes(draw: st.DrawFn) -> bytes:
    """A stored chunk with bytes flipped, cut off, appended or header fields rewritten."""
    blob = bytearray(draw(st.sampled_from(ENVELOPES)))
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "truncate", "append", "field"]))
        if action == "flip" and blob:
            blob[draw(st.integers(0, len(blob) - 1))] ^= 1 << draw(st.integers(0, 7))
        elif action == "truncate":
            del blob[draw(st.integers(0, len(blob))) :]
        elif action == "append":
            blob += draw(st.binary(min_size=1, max_size=64))
        elif len(blob) >= 16:
            offset = draw(st.sampled_from([4, 5, 6, 8]))
            width = {4: 1, 5: 1, 6: 2, 8: 8}[offset]
            blob[offset : offset + width] = draw(st.binary(min_size=width, max_size=width))
    return bytes(blob)


@FUZZ
@given(mutated_envelopes())
def test_a_mutated_envelope_returns_its_bytes_or_is_a_cas_error(blob: bytes) -> None:
    objects = ObjectStore(MemoryBlobStore(), max_object_size=1 << 20)
    objects.put_chunk(_BASE, codec_by_name("raw"))
    digest = digest_of(_DATA)
    objects.blobs.put(chunk_key(digest), blob)
    with contextlib.suppress(cas.CASError):
        assert bytes(objects.get_chunk(digest)) == _DATA
    with contextlib.suppress(cas.CASError):
        objects.chunk_base(digest)


@st.composite
def mutated_ref_records(draw: st.DrawFn) -> bytes:
    target = digest_of(b"m")
    doc: dict[str, Any] = {
        "format": "cas-ref",
        "version": 2,
        "name": "runs/a",
        "target": target,
        "history": [[target, 1.0, "save", ""]],
        "sealed": [[digest_of(b"s"), 3, 0.5]],
    }
    path = draw(st.sampled_from(_paths(doc)[1:]))
    parent: Any = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = copy.deepcopy(draw(HOSTILE_VALUES))
    return _pack(doc)


@FUZZ
@given(mutated_ref_records())
def test_a_mutated_ref_record_decodes_or_is_a_format_error(data: bytes) -> None:
    with contextlib.suppress(cas.CASError):
        decode_ref(RefName("runs/a"), data, None)


def test_the_fuzzed_documents_and_envelopes_start_valid() -> None:
    for doc in valid_documents():
        assert decode_manifest(_pack(doc)).chunk_digests()
    for blob in valid_envelopes():
        objects = ObjectStore(MemoryBlobStore(), max_object_size=1 << 20)
        objects.put_chunk(_BASE, codec_by_name("raw"))
        objects.blobs.put(chunk_key(digest_of(_DATA)), blob)
        assert bytes(objects.get_chunk(digest_of(_DATA))) == _DATA
