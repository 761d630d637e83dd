"""Subset manifests: a new manifest holding only some entries of another (weights-only snapshots)."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from cas.digest import Digest
from cas.errors import NotFound
from cas.model.manifest import Manifest, TensorEntry
from cas.model.state import selected_tensors, sparse_selected


def subset_manifest(
    manifest: Manifest, patterns: Sequence[str], *, parent: Digest, created_at: float
) -> Manifest:
    """Keep the entries whose dotted path matches any glob; the chunks are shared, none written."""

    def select(path: str) -> bool:
        return any(fnmatch.fnmatchcase(path, p) for p in patterns)

    if manifest.kind == "files":
        files = {p: e for p, e in manifest.files.items() if select(p)}
        if not files:
            raise NotFound(f"no file matches {list(patterns)}")
        used = sorted({r.tensor_index for e in files.values() for r in e.regions})
        remap = {old: new for new, old in enumerate(used)}
        files = {
            p: replace(
                e, regions=tuple(replace(r, tensor_index=remap[r.tensor_index]) for r in e.regions)
            )
            for p, e in files.items()
        }
        tensors = tuple(manifest.tensors[i] for i in used)
        return Manifest(
            "files",
            tensors,
            None,
            files,
            dict(manifest.meta),
            created_at,
            parent,
            manifest.chunk_size,
            manifest.message,
            manifest.tags,
        )

    kept: list[TensorEntry] = []
    remap_state: dict[int, int] = {}
    for index in selected_tensors(manifest.tree, select):
        remap_state[index] = len(kept)
        kept.append(manifest.tensors[index])
    tree = _rebuild_tree(manifest.tree, select, remap_state)
    if tree is None:
        raise NotFound(f"no entry matches {list(patterns)}")
    return Manifest(
        "state",
        tuple(kept),
        tree,
        {},
        dict(manifest.meta),
        created_at,
        parent,
        manifest.chunk_size,
        manifest.message,
        manifest.tags,
    )


def _rebuild_tree(tree: Any, select: Any, remap: dict[int, int]) -> Any:
    """The encoded tree restricted to selected leaves, tensor indices renumbered; None if empty."""
    missing = object()

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, dict):
            tag = node.get("~")
            if tag == "tensor":
                return {**node, "i": remap[int(node["i"])]} if select(path) else missing
            if tag == "sparse":
                if not sparse_selected(node, path, select):
                    return missing
                parts = [[name, {"~": "tensor", "i": remap[int(part["i"])]}]
                         for name, part in node["parts"]]  # fmt: skip
                return {**node, "parts": parts}
            if tag == "dict":
                items = []
                for key, value in node["items"]:
                    item = walk(value, f"{path}.{key}" if path else str(key))
                    if item is not missing:
                        items.append([key, item])
                return {**node, "items": items} if items else missing
            if tag in ("list", "tuple"):
                values = [
                    walk(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(node["items"])
                ]
                if all(v is missing for v in values):
                    return missing
                return {"~": tag, "items": [None if v is missing else v for v in values]}
        return node if select(path) else missing

    result = walk(tree, "")
    return None if result is missing else result
