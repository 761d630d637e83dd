"""Applying an opt-in lossy storage policy to a save (``cas.model.precision``): casts first, then
the lossy delta against the parent checkpoint's stored tensors, read one at a time."""

from __future__ import annotations

from typing import Any

from cas.digest import Digest
from cas.errors import NotFound
from cas.model.manifest import Manifest
from cas.model.precision import StoragePolicy, cast_sources, keep_small_changes
from cas.model.state import (
    TensorSource,
    buffer_over,
    byte_buffer,
    iter_tensor_paths,
    tensor_from_bytes,
    writable_view,
)
from cas.objects.chunkio import ChunkIO


def apply_policy(
    io: ChunkIO,
    parent: Manifest | None,
    tree: Any,
    sources: list[TensorSource],
    policy: StoragePolicy,
) -> tuple[Any, list[TensorSource]]:
    """The tree and sources a save with ``policy`` stores."""
    tree, sources = cast_sources(tree, sources, policy)
    if not policy.lossy_delta or parent is None or parent.kind != "state":
        return tree, sources
    by_path = dict(iter_tensor_paths(parent.tree))

    def parent_value(source: TensorSource) -> Any:
        index = by_path.get(source.path)
        if index is None:
            return None
        entry = parent.tensors[index]
        if (entry.kind, entry.dtype, entry.shape) != (source.kind, source.dtype, source.shape):
            return None
        if entry.inline is not None:
            buffer = buffer_over(bytearray(entry.inline))
        else:
            buffer = byte_buffer(entry.nbytes)
            if entry.nbytes:
                encoded = {0} if entry.encoding else set()
                io.read_all([(entry.chunks, writable_view(buffer))], encoded=encoded)
        return tensor_from_bytes(entry.kind, entry.dtype, entry.shape, buffer)

    return tree, keep_small_changes(sources, policy, parent_value)


def parent_manifest(manifest_of: Any, digest: Digest | None) -> Manifest | None:
    """The parent's manifest for a lossy delta, None when there is none to compare with."""
    if digest is None:
        return None
    try:
        found: Manifest = manifest_of(digest)
    except NotFound:
        return None
    return found
