"""Describing checkpoints from their manifests alone: tensor tables and diffs, no tensor data read."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cas.model.manifest import Manifest
from cas.model.state import iter_tensor_paths


@dataclass(frozen=True)
class TensorInfo:
    """One row of ``show``: a tensor's path, dtype, shape and size, read from the manifest only."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: int
    codec: str = "raw"
    """The codec the writer chose for the tensor (``TensorEntry.encoding``), ``inline`` if tiny."""


@dataclass(frozen=True)
class DiffEntry:
    """One path that differs between two checkpoints."""

    path: str
    change: str
    """``added``, ``removed``, ``changed`` (bytes), ``retyped`` (dtype or shape)."""
    nbytes: int


@dataclass(frozen=True)
class _Comparable:
    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    identity: Any


def _digest_table(manifest: Manifest) -> list[_Comparable]:
    rows = []
    if manifest.kind == "state":
        for path, index in iter_tensor_paths(manifest.tree):
            t = manifest.tensors[index]
            rows.append(
                _Comparable(
                    path, t.dtype, t.shape, t.nbytes, t.inline or tuple(c.digest for c in t.chunks)
                )
            )
        for path, value in _value_leaves(manifest.tree, ""):
            rows.append(_Comparable(path, "value", (), 0, repr(value)))
    for path, entry in manifest.files.items():
        rows.append(
            _Comparable(path, entry.format, (), entry.size, tuple(c.digest for c in entry.chunks))
        )
    return rows


def _value_leaves(node: Any, path: str) -> Iterable[tuple[str, Any]]:
    if isinstance(node, dict) and node.get("~") in ("dict", "list", "tuple"):
        items = node["items"] if node["~"] == "dict" else list(enumerate(node["items"]))
        for key, value in items:
            yield from _value_leaves(value, f"{path}.{key}" if path else str(key))
    elif not (isinstance(node, dict) and node.get("~") in ("tensor", "sparse")):
        yield path, node


def tensor_table(manifest: Manifest) -> list[TensorInfo]:
    """Every tensor a manifest names, with its path, from the manifest alone."""
    if manifest.kind == "state":
        pairs = list(iter_tensor_paths(manifest.tree))
    else:
        pairs = [
            (f"{p}:{r.name}", r.tensor_index) for p, e in manifest.files.items() for r in e.regions
        ]
    rows = []
    for path, index in pairs:
        t = manifest.tensors[index]
        codec = "inline" if t.inline is not None else (t.encoding or {}).get("codec", "raw")
        rows.append(TensorInfo(path, t.dtype, t.shape, t.nbytes, len(t.chunks), str(codec)))
    return rows


def diff_manifests(left_manifest: Manifest, right_manifest: Manifest) -> list[DiffEntry]:
    """Paths that differ between two manifests, compared by chunk digests and values."""
    left = {t.path: t for t in _digest_table(left_manifest)}
    right = {t.path: t for t in _digest_table(right_manifest)}
    out = []
    for path in sorted(left.keys() | right.keys()):
        x, y = left.get(path), right.get(path)
        if x is None and y is not None:
            out.append(DiffEntry(path, "added", y.nbytes))
        elif y is None and x is not None:
            out.append(DiffEntry(path, "removed", x.nbytes))
        elif x is not None and y is not None:
            if (x.dtype, x.shape) != (y.dtype, y.shape):
                out.append(DiffEntry(path, "retyped", y.nbytes))
            elif x.identity != y.identity:
                out.append(DiffEntry(path, "changed", y.nbytes))
    return out
