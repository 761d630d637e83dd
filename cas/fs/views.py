"""Checkpoints as files: the files a manifest shows, as extents over its chunks.

A ``kind="files"`` manifest shows its ingested files as they were. A ``kind="state"`` manifest
(``Repository.save``) shows, per top-level entry, a synthesized ``<key>.safetensors`` (if the
entry holds tensors; named by the dotted path below the entry: ``fc.weight``,
``state.0.exp_avg``) and a ``<key>.pt`` that ``torch.load`` reads back as the entry itself
(``cas.fs.torch_view``), plus a ``manifest.json`` describing everything, plain values included. A
state whose top level is not a dict shows ``state.safetensors`` and ``state.pt``. Synthesized
files are a pure function of the manifest: headers are computed from dtypes and shapes, and every
tensor byte range maps onto that tensor's chunks, so nothing is read until a range is asked for
and the bytes never vary. Reading them is ``cas.fs.reading``'s job.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from cas.digest import Digest
from cas.fs.extents import Extent, FileRecord, FileView, chunk_extents, literal_view
from cas.fs.torch_view import torch_view
from cas.model.manifest import Manifest, TensorEntry
from cas.model.state import iter_tensor_paths

MANIFEST_JSON = "manifest.json"
STATE_STEM = "state"
_SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "complex64": "C64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0", "float4_e2m1fn_x2": "F4",
}  # fmt: skip
_NUMPY_KINDS = {"f": "F", "i": "I", "u": "U", "c": "C"}


def file_records(manifest: Manifest) -> dict[str, FileRecord]:
    """The files of a ``kind="files"`` manifest, each with the tensors its regions name."""
    out = {}
    for path, entry in manifest.files.items():
        tensors = tuple(manifest.tensors[r.tensor_index] for r in entry.regions)
        out[path] = FileRecord(entry, tensors)
    return out


def manifest_views(manifest: Manifest, digest: Digest) -> dict[str, FileView]:
    """Every file a manifest shows, by path relative to its ref."""
    if manifest.kind == "files":
        return {
            path: FileView(
                rec.entry.size, tuple(chunk_extents(rec.entry.chunks, 0)), rec.entry.mode, rec
            )
            for path, rec in file_records(manifest).items()
        }
    return _state_views(manifest, digest)


@dataclass
class _Placed:
    file: str
    name: str
    path: str
    tensor: TensorEntry


def _groups(tree: Any) -> list[tuple[str, str, Any]]:
    """``(file stem, path prefix, subtree)`` per top-level entry, or one group for the whole tree."""
    if isinstance(tree, dict) and tree.get("~") == "dict":
        return [(quote(str(key), safe=""), str(key), node) for key, node in tree["items"]]
    return [(STATE_STEM, "", tree)]


def _state_views(manifest: Manifest, digest: Digest) -> dict[str, FileView]:
    views: dict[str, FileView] = {}
    placed: list[_Placed] = []
    skipped: list[str] = []
    stems: set[str] = set()
    for stem, prefix, node in _groups(manifest.tree):
        paths = [
            (f"{prefix}.{sub}" if prefix and sub else prefix or sub, sub or prefix or "tensor", i)
            for sub, i in iter_tensor_paths(node)
        ]
        if stem in stems:  # keys 1 and "1" name the same files: the first one shows
            skipped.extend(full for full, _, _ in paths)
            continue
        stems.add(stem)
        file_name = stem + ".safetensors"
        pt_view = torch_view(node, manifest.tensors, digest)
        if pt_view is not None:
            views[stem + ".pt"] = pt_view
        members: list[tuple[str, TensorEntry]] = []
        names = {"__metadata__"}  # the header's own key
        for full, name, index in paths:
            tensor = manifest.tensors[index]
            # A dtype safetensors lacks, or a name already taken ({"a.b": x, "a": {"b": y}}).
            if safetensors_dtype(tensor) is None or name in names:
                skipped.append(full)
                continue
            names.add(name)
            members.append((name, tensor))
            placed.append(_Placed(file_name, name, full, tensor))
        if members:
            views[file_name] = _safetensors_view(members, digest)
    document = _manifest_document(manifest, digest, placed, skipped)
    views[MANIFEST_JSON] = literal_view(document, 0o444)
    return views


def safetensors_dtype(tensor: TensorEntry) -> str | None:
    """The safetensors dtype code of a tensor entry, or None if safetensors cannot hold it."""
    if tensor.kind == "torch":
        return _SAFETENSORS_DTYPES.get(tensor.dtype)
    import numpy as np

    try:
        dtype = np.dtype(tensor.dtype)
    except TypeError:
        return None
    if dtype.kind == "b":
        return "BOOL"
    letter = _NUMPY_KINDS.get(dtype.kind)
    code = f"{letter}{dtype.itemsize * 8}" if letter else None
    return code if code in set(_SAFETENSORS_DTYPES.values()) else None


def _safetensors_shape(tensor: TensorEntry, code: str) -> list[int]:
    if code == "F4":  # torch packs two 4-bit values per element; safetensors counts values
        return [*tensor.shape[:-1], tensor.shape[-1] * 2] if tensor.shape else [2]
    return list(tensor.shape)


def _safetensors_view(members: list[tuple[str, TensorEntry]], digest: Digest) -> FileView:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "cas.model.manifest": digest}}
    offset = 0
    for name, tensor in members:
        code = safetensors_dtype(tensor)
        assert code is not None
        shape = _safetensors_shape(tensor, code)
        header[name] = {
            "dtype": code,
            "shape": shape,
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
    head = len(raw).to_bytes(8, "little") + raw
    extents = [Extent(0, len(head), data=head)]
    position = len(head)
    for _, tensor in members:
        if tensor.inline is not None:
            if tensor.nbytes:
                extents.append(Extent(position, tensor.nbytes, data=tensor.inline))
        else:
            extents.extend(chunk_extents(tensor.chunks, position))
        position += tensor.nbytes
    return FileView(position, tuple(extents), 0o444)


def _manifest_document(
    manifest: Manifest, digest: Digest, placed: list[_Placed], skipped: list[str]
) -> bytes:
    doc = {
        "format": "cas-fs-manifest",
        "version": 1,
        "manifest": digest,
        "kind": manifest.kind,
        "created_at": manifest.created_at,
        "parent": manifest.parent,
        "chunk_size": manifest.chunk_size,
        "meta": manifest.meta,
        "values": dict(_plain_leaves(manifest.tree, "")),
        "tensors": [
            {
                "path": p.path,
                "file": p.file,
                "name": p.name,
                "kind": p.tensor.kind,
                "dtype": p.tensor.dtype,
                "shape": list(p.tensor.shape),
                "nbytes": p.tensor.nbytes,
                "chunks": [c.digest for c in p.tensor.chunks],
            }
            for p in placed
        ],
        "not_in_safetensors": skipped,
    }
    return (json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n").encode()


def _plain_leaves(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        tag = node.get("~")
        if tag == "tensor":
            return
        if tag in ("dict", "list", "tuple"):
            items = node["items"] if tag == "dict" else list(enumerate(node["items"]))
            for key, value in items:
                yield from _plain_leaves(value, f"{path}.{key}" if path else str(key))
            return
        if tag == "int":
            yield path, int(node["v"])
        elif tag == "dtype":
            yield path, f"torch.{node['v']}"
        elif tag == "device":
            yield path, str(node["v"])
        return
    if isinstance(node, bytes):
        yield path, {"bytes_hex": node.hex()}
    elif isinstance(node, float) and not math.isfinite(node):
        yield path, repr(node)
    else:
        yield path, node
