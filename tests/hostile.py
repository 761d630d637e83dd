"""Hostile and damaged stores, crafted below the API: manifests and chunk envelopes written as bytes.

Each builder makes a store at ``root`` whose ref ``HOSTILE_REF`` names a manifest no cas writer
would produce, and returns nothing: the tests then point the CLI and ``Repository.load`` at it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import zstandard

import cas
from cas.codecs import codec_by_name
from cas.codecs.bytegroup import PLANE_ZSTD, PlaneTable
from cas.digest import Digest, digest_of, digest_to_bytes
from cas.objects.envelope import encode_header
from cas.objects.store import chunk_key
from cas.refs.keys import ref_key
from cas.refs.records import encode_ref

HOSTILE_REF = "runs/hostile"
BOMB_SIZE = 64 << 20
"""Decoded size the delta-cycle chunks declare: the most a store's envelope limit lets through."""


_SPLICE = "\x00splice\x00"


def plant_manifest(root: Path, doc: dict[str, Any], tree_bytes: bytes | None = None) -> Digest:
    """Store ``doc`` as a zstd manifest object of a new store at ``root`` and point the ref at it.

    ``tree_bytes`` replace the packed tree: msgpack's packer refuses to nest as deep as its
    unpacker reads.
    """
    repo = cas.open(root)
    try:
        data = msgpack.packb(doc if tree_bytes is None else {**doc, "tree": _SPLICE})
        if tree_bytes is not None:
            data = data.replace(msgpack.packb(_SPLICE), tree_bytes)
        digest = repo.objects.put_manifest(data, codec_by_name("zstd"))
        repo.set_ref(HOSTILE_REF, digest)
        return digest
    finally:
        repo.close()


def plant_chunk(root: Path, data: bytes) -> bytes:
    """Store ``data`` as a raw chunk; its raw digest, for a manifest's chunk list."""
    repo = cas.open(root)
    try:
        return digest_to_bytes(repo.objects.put_chunk(data, codec_by_name("raw")).digest)
    finally:
        repo.close()


def state_doc(tree: Any, tensors: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A version-1 state manifest document with ``tree`` and ``tensors``."""
    return {
        "format": "cas-manifest",
        "version": 1,
        "kind": "state",
        "created_at": 0.0,
        "parent": None,
        "chunk_size": 4 << 20,
        "meta": {},
        "tensors": tensors or [],
        "tree": tree,
    }


def tensor_leaf(index: int = 0) -> dict[str, Any]:
    """A tree node naming ``tensors[index]``."""
    return {"~": "tensor", "i": index}


def one_tensor(entry: dict[str, Any]) -> dict[str, Any]:
    """A state whose tree is ``{"w": tensors[0]}`` and whose only tensor is ``entry``."""
    return state_doc({"~": "dict", "items": [["w", tensor_leaf(0)]]}, [entry])


def huge_tensor(root: Path) -> None:
    """A 2**40-element uint8 tensor whose one chunk is 64 bytes."""
    digest = plant_chunk(root, bytes(64))
    entry = {"kind": "torch", "dtype": "uint8", "shape": [1 << 40], "nbytes": 1 << 40}
    plant_manifest(root, one_tensor({**entry, "chunks": [[digest, 1 << 40]]}))


def overflowing_shape(root: Path) -> None:
    """An empty tensor whose other dimensions multiply past 2**64."""
    entry = {"kind": "torch", "dtype": "float32", "shape": [1 << 62, 1 << 62, 0], "nbytes": 0}
    plant_manifest(root, one_tensor({**entry, "chunks": []}))


def numpy_shape_mismatch(root: Path) -> None:
    """A float32 numpy array of 1000 elements holding 8 bytes."""
    entry = {"kind": "numpy", "dtype": "<f4", "shape": [1000], "nbytes": 8, "inline": bytes(8)}
    plant_manifest(root, one_tensor(entry))


def deep_tree(root: Path, depth: int = 490) -> None:
    """Lists nested ``depth`` deep around one int (``2 * depth`` msgpack levels)."""
    level = msgpack.packb({"~": "list", "items": []})[:-1] + b"\x91"  # items: [<child>]
    plant_manifest(root, state_doc(None), level * depth + msgpack.packb(1))


def huge_int(root: Path) -> None:
    """A 5,000-digit int (past Python's int/str conversion limit)."""
    plant_manifest(root, state_doc({"~": "dict", "items": [["n", {"~": "int", "v": "7" * 5000}]]}))


def tensor_index_out_of_range(root: Path) -> None:
    """A tree leaf naming tensor 7 of a table of one."""
    entry = {"kind": "torch", "dtype": "uint8", "shape": [4], "nbytes": 4, "inline": bytes(4)}
    doc = one_tensor(entry)
    doc["tree"] = {"~": "dict", "items": [["w", tensor_leaf(7)]]}
    plant_manifest(root, doc)


def items_not_a_list(root: Path) -> None:
    """A dict node whose items are an int."""
    plant_manifest(root, state_doc({"~": "dict", "items": 5}))


def bad_device(root: Path) -> None:
    """A ``torch.device`` leaf naming no device."""
    plant_manifest(
        root, state_doc({"~": "dict", "items": [["d", {"~": "device", "v": "warp drive"}]]})
    )


def delta_cycle(root: Path) -> None:
    """Two ~2 KB chunks, each a 64 MiB XOR delta against the other, named by one tensor."""
    repo = cas.open(root)
    try:
        bomb = zstandard.ZstdCompressor(level=19).compress(bytes(BOMB_SIZE))
        table = PlaneTable(1, ((PLANE_ZSTD, len(bomb)),)).pack()
        first, second = digest_of(b"first"), digest_of(b"second")
        for digest, base in ((first, second), (second, first)):
            params = digest_to_bytes(base) + table
            header = encode_header(codec_by_name("xor-delta"), params, BOMB_SIZE)
            repo.blobs.put(chunk_key(digest), header + bomb)
    finally:
        repo.close()
    entry = {"kind": "torch", "dtype": "uint8", "shape": [BOMB_SIZE], "nbytes": BOMB_SIZE}
    plant_manifest(root, one_tensor({**entry, "chunks": [[digest_to_bytes(first), BOMB_SIZE]]}))


def repeated_chunk(root: Path, times: int = 1_500_000) -> None:
    """One 8-byte chunk named ``times`` times by one tensor (a few KB of zstd'd manifest)."""
    digest = plant_chunk(root, bytes(range(8)))
    entry = {"kind": "torch", "dtype": "uint8", "shape": [8 * times], "nbytes": 8 * times}
    plant_manifest(root, one_tensor({**entry, "chunks": [[digest, 8]] * times}))


def empty_lists_meta(root: Path, count: int = 23_200_000, width: int = 0) -> None:
    """A manifest whose ``meta`` holds ``count`` empty msgpack arrays: 876 bytes stored, 3.4 GB
    of lists when unpacked. ``width`` > 0 nests them ``width`` to a list, so that no single
    array header declares the whole count."""
    if width:
        groups = count // width
        lists = (
            b"\xdd" + groups.to_bytes(4, "big") + (bytes([0x90 + width]) + b"\x90" * width) * groups
        )
    else:
        lists = b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count
    doc = state_doc({"~": "dict", "items": []})
    doc["meta"] = {"x": _SPLICE}
    repo = cas.open(root)
    try:
        data = msgpack.packb(doc).replace(msgpack.packb(_SPLICE), lists)
        repo.set_ref(HOSTILE_REF, repo.objects.put_manifest(data, codec_by_name("zstd")))
    finally:
        repo.close()


def repeated_segment(root: Path, times: int = 200_000) -> None:
    """A ref whose record lists one sealed history segment ``times`` times (15 MB of record,
    12.8 million events if each listing were read)."""
    repo = cas.open(root)
    try:
        targets = [repo.save({"step": step}, "runs/scratch") for step in range(2)]
        for step in range(200):
            repo.set_ref(HOSTILE_REF, targets[step % 2])
        record = repo.find_ref(HOSTILE_REF)
        assert record is not None and record.sealed
        hostile = replace(record, sealed=record.sealed[-1:] * times)
        repo.blobs.put(ref_key(record.name), encode_ref(hostile))
        repo.rm("runs/scratch")
    finally:
        repo.close()


BUILDERS: dict[str, Callable[[Path], None]] = {
    "huge_tensor": huge_tensor,
    "overflowing_shape": overflowing_shape,
    "numpy_shape_mismatch": numpy_shape_mismatch,
    "deep_tree": deep_tree,
    "huge_int": huge_int,
    "tensor_index_out_of_range": tensor_index_out_of_range,
    "items_not_a_list": items_not_a_list,
    "bad_device": bad_device,
    "delta_cycle": delta_cycle,
    "repeated_chunk": repeated_chunk,
}
