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
    """``added``, ``removed``, ``changed`` (bytes), ``retyped`` (dtype or shape), or ``same``
    (listed only when asked for)."""
    nbytes: int
    kind: str = "tensor"
    """``tensor`` (a saved tensor or one inside an ingested file), ``file`` or ``value``."""
    left_path: str | None = None
    """The path in the first checkpoint when it differs from ``path`` (tensors paired under a
    renamed prefix, see ``prefix_pairing``)."""


@dataclass(frozen=True)
class PrefixPairing:
    """Two checkpoints whose tensors share no name but do once one side's prefix is dropped
    (``model.w`` against ``w``): the side (``a`` or ``b``, empty for none) and the prefix.

    ``by_name`` compares the tensors inside one ingested file by name alone (a state's
    ``model.w`` against ``model.safetensors:w``): each side's tensors are all of one file, or all
    saved from Python.
    """

    side: str
    prefix: str
    by_name: bool = False


@dataclass(frozen=True)
class _Comparable:
    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    identity: Any
    kind: str = "tensor"


def _digest_table(manifest: Manifest, rename: dict[str, str] | None = None) -> list[_Comparable]:
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
            rows.append(_Comparable(path, "value", (), 0, repr(value), "value"))
    for name, entry in manifest.files.items():
        path = (rename or {}).get(name, name)
        digests = tuple(c.digest for c in entry.chunks)
        rows.append(_Comparable(path, entry.format, (), entry.size, digests, "file"))
        for region in entry.regions:
            t = manifest.tensors[region.tensor_index]
            identity = t.inline if t.inline is not None else tuple(c.digest for c in t.chunks)
            rows.append(_Comparable(f"{path}:{region.name}", t.dtype, t.shape, t.nbytes, identity))
    return rows


def _single_file(manifest: Manifest) -> str | None:
    """The file name of a single ingested file (``cas put model.pt``), else None."""
    single = manifest.kind == "files" and manifest.meta.get("source") == "file"
    return next(iter(manifest.files)) if single and len(manifest.files) == 1 else None


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


def diff_manifests(
    left_manifest: Manifest, right_manifest: Manifest, *, same: bool = False
) -> list[DiffEntry]:
    """Paths that differ between two manifests, compared by chunk digests and values; ``same``
    lists the unchanged ones too.

    The tensors inside ingested files are compared one by one, as ``<file>:<tensor>``; two
    single ingested files are compared with each other whatever their names (``a.pt`` against
    ``b.pt``), under the second one's name.
    """
    left_file, right_file = _single_file(left_manifest), _single_file(right_manifest)
    rename = {left_file: right_file} if left_file and right_file else None
    left_rows, right_rows = _digest_table(left_manifest, rename), _digest_table(right_manifest)
    pairing = _pairing(left_rows, right_rows)
    left = _keyed(left_rows, pairing, "a")
    right = _keyed(right_rows, pairing, "b")
    out = []
    for key in sorted(left.keys() | right.keys()):
        x, y = left.get(key), right.get(key)
        if x is None and y is not None:
            out.append(DiffEntry(y.path, "added", y.nbytes, y.kind))
        elif y is None and x is not None:
            out.append(DiffEntry(x.path, "removed", x.nbytes, x.kind))
        elif x is not None and y is not None:
            # Shown under the second checkpoint's name, with the first's when it differs.
            before = x.path if x.path != y.path else None
            if (x.dtype, x.shape) != (y.dtype, y.shape):
                out.append(DiffEntry(y.path, "retyped", y.nbytes, y.kind, before))
            elif x.identity != y.identity:
                out.append(DiffEntry(y.path, "changed", y.nbytes, y.kind, before))
            elif same:
                out.append(DiffEntry(y.path, "same", y.nbytes, y.kind, before))
    return out


def _keyed(
    rows: list[_Comparable], pairing: PrefixPairing | None, side: str
) -> dict[str, _Comparable]:
    """Rows by the name they are compared under: the path, with the paired prefix dropped."""
    if pairing is None:
        return {row.path: row for row in rows}
    return {
        _pair_key(row.path, pairing, side) if row.kind == "tensor" else row.path: row
        for row in rows
    }


def _pair_key(path: str, pairing: PrefixPairing, side: str) -> str:
    head, name = _split_tensor_path(path)
    if pairing.side == side:
        name = name.removeprefix(pairing.prefix)
    return name if pairing.by_name else head + name


def _split_tensor_path(path: str) -> tuple[str, str]:
    """``file.pt:model.w`` -> (``file.pt:``, ``model.w``); a saved state's path has no file."""
    head, sep, name = path.rpartition(":")
    return (head + sep, name) if sep else ("", path)


def prefix_pairing(left: Manifest, right: Manifest) -> PrefixPairing | None:
    """How ``diff_manifests`` pairs two checkpoints' tensors that share no name: when every
    tensor of one side starts with one dotted prefix (``model.``) and dropping it gives names
    the other side has, or when the tensors of one file match a state's (or another file's) by
    name. None when some names already match, or nothing pairs them."""
    left_file, right_file = _single_file(left), _single_file(right)
    rename = {left_file: right_file} if left_file and right_file else None
    return _pairing(_digest_table(left, rename), _digest_table(right))


def _pairing(left: list[_Comparable], right: list[_Comparable]) -> PrefixPairing | None:
    a = {row.path for row in left if row.kind == "tensor"}
    b = {row.path for row in right if row.kind == "tensor"}
    if not a or not b or a & b:
        return None
    heads_a = {_split_tensor_path(p)[0] for p in a}
    heads_b = {_split_tensor_path(p)[0] for p in b}
    # One file against a state (or another file): its tensors are compared by name alone.
    by_name = len(heads_a) == len(heads_b) == 1 and heads_a != heads_b
    if by_name and _keys(a, PrefixPairing("", "", True), "a") & _keys(
        b, PrefixPairing("", "", True), "b"
    ):
        return PrefixPairing("", "", True)
    for side, names, other in (("a", a, b), ("b", b, a)):
        firsts = {_split_tensor_path(n)[1].partition(".") for n in names}
        if any(not dot or not rest for _, dot, rest in firsts):
            continue
        prefixes = {head + "." for head, _, _ in firsts}
        if len(prefixes) != 1:
            continue
        pairing = PrefixPairing(side, prefixes.pop(), by_name)
        if _keys(names, pairing, side) & _keys(other, pairing, "b" if side == "a" else "a"):
            return pairing
    return None


def _keys(paths: set[str], pairing: PrefixPairing, side: str) -> set[str]:
    return {_pair_key(p, pairing, side) for p in paths}
