"""Sharded saves: N writers each store their shard of one checkpoint, one commits the whole.

Each rank calls ``save_shard(repo, state, run_id, rank, world_size)``: its chunks are written in
parallel with every other rank's (chunks are content-addressed, so concurrent writers never
conflict), then a shard manifest, then the staging ref ``staging/shards/<run_id>/rank<NNNNN>``.
Ranks touch different refs, so no shard write can lose against another.

One process (usually rank 0, after a barrier, or with ``timeout`` to wait for the others) calls
``commit_shards(repo, ref, run_id, world_size)``: it reads every shard manifest, merges them into
one manifest and moves ``ref`` by compare-and-swap. No chunk is read or written. The staging refs
are then removed (they only kept the shards reachable for GC until the commit).

How shards combine (``layout``):

- ``"merge"`` (default): the shards' states are parts of one nested dict, like FSDP/DCP sharded
  state dicts: dicts are merged key by key, recursively. A key present in several shards must hold
  the same value in each (a replicated ``step``, or the same tensor bytes, dtype and shape);
  anything else is a ``FormatError`` naming the path. Loading the committed ref returns the
  combined dict.
- ``"ranks"``: the combined state is ``{"rank0": shard0, "rank1": shard1, ...}``, for states that
  do not partition (per-rank RNG, per-rank optimizer shards that reuse key names).

The store must enforce compare-and-swap across processes (``supports_conditional_writes``); on a
store that does not (fsspec, an S3 server without conditional writes) sharded saves are refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cas.digest import Digest
from cas.errors import CASError, FormatError, NotFound, RefConflict
from cas.model.manifest import Manifest, TensorEntry
from cas.model.state import TensorSource, encode_state
from cas.names import parse_ref_name
from cas.repo.core import RepositoryCore

STAGING_PREFIX = "staging/shards"
LAYOUTS = ("merge", "ranks")
_ANY: Any = ...


def staging_ref(run_id: str, rank: int) -> str:
    """The ref a rank's shard manifest is staged under."""
    return str(parse_ref_name(f"{STAGING_PREFIX}/{run_id}/rank{rank:05d}"))


def _require_multi_writer(repo: RepositoryCore) -> None:
    if not repo.blobs.supports_conditional_writes:
        raise CASError(
            f"{repo.url} cannot arbitrate concurrent writers (no cross-process compare-and-swap); "
            "sharded saves need a local store or an S3 server with conditional writes"
        )


def save_shard(
    repo: RepositoryCore,
    state: Any,
    run_id: str,
    rank: int,
    world_size: int,
    *,
    metadata: dict[str, Any] | None = None,
    codec: str | None = None,
) -> Digest:
    """Store this rank's shard (chunks, shard manifest, staging ref); return its manifest digest."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    _require_multi_writer(repo)
    ref = staging_ref(run_id, rank)
    tree, sources = encode_state(state)
    with repo.leases.hold("save-shard"):
        return _store_shard(repo, ref, tree, sources, run_id, rank, world_size, metadata, codec)


def _store_shard(
    repo: RepositoryCore,
    ref: str,
    tree: Any,
    sources: list[TensorSource],
    run_id: str,
    rank: int,
    world_size: int,
    metadata: dict[str, Any] | None,
    codec: str | None,
) -> Digest:
    entries, stats = repo.write_tensors(sources, codec=codec)
    shard_meta = {"run_id": run_id, "rank": rank, "world_size": world_size}
    manifest = Manifest(
        kind="state",
        tensors=tuple(entries),
        tree=tree,
        meta={**(metadata or {}), "shard": shard_meta},
        created_at=repo.clock(),
        chunk_size=repo.config.chunk_size,
    )
    return repo.commit(
        manifest, ref, op="save-shard", message=f"rank {rank} of {world_size}", stats=stats
    )


@dataclass
class _ShardSet:
    digests: list[Digest] = field(default_factory=list)
    manifests: list[Manifest] = field(default_factory=list)


def _read_shards(
    repo: RepositoryCore,
    run_id: str,
    world_size: int,
    timeout: float,
    poll: float,
    sleep: Callable[[float], None],
) -> _ShardSet:
    deadline = repo.clock() + timeout
    while True:
        records = [repo.refs_store.try_get(staging_ref(run_id, r)) for r in range(world_size)]
        missing = [r for r, rec in enumerate(records) if rec is None]
        if not missing:
            break
        if repo.clock() >= deadline:
            raise NotFound(
                f"run {run_id!r}: no shard from rank(s) {_ranks(missing)} of {world_size} in "
                f"{repo.url} (save_shard them first, or pass a timeout to wait)"
            )
        sleep(poll)
    shards = _ShardSet()
    for rank, record in enumerate(records):
        assert record is not None
        manifest = repo.manifest(record.target)
        info = manifest.meta.get("shard", {})
        if info.get("run_id") != run_id or info.get("rank") != rank:
            raise FormatError(
                f"{staging_ref(run_id, rank)} does not hold rank {rank} of {run_id!r}"
            )
        if info.get("world_size") != world_size:
            raise FormatError(
                f"rank {rank} of {run_id!r} was saved with world_size {info.get('world_size')}, "
                f"not {world_size}"
            )
        shards.digests.append(record.target)
        shards.manifests.append(manifest)
    return shards


def commit_shards(
    repo: RepositoryCore,
    ref: str,
    run_id: str,
    world_size: int,
    *,
    layout: str = "merge",
    metadata: dict[str, Any] | None = None,
    expected: Digest | Any | None = _ANY,
    timeout: float = 0.0,
    poll: float = 0.2,
    sleep: Callable[[float], None] = time.sleep,
    keep_staging: bool = False,
    overwrite: bool = False,
) -> Digest:
    """Merge the ``world_size`` shards of ``run_id`` into one manifest and point ``ref`` at it.

    Waits up to ``timeout`` seconds (by ``repo.clock``) for missing shards. ``expected`` makes the
    ref update a compare-and-swap against that digest, and ``overwrite`` replaces a protected
    ref, as in ``Repository.save``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    _require_multi_writer(repo)
    name = parse_ref_name(ref)
    shards = _read_shards(repo, run_id, world_size, timeout, poll, sleep)
    tree, tensors = merge_trees(
        [m.tree for m in shards.manifests], [m.tensors for m in shards.manifests], layout
    )
    current = repo.refs_store.try_get(name)
    manifest = Manifest(
        kind="state",
        tensors=tensors,
        tree=tree,
        meta={
            **(metadata or {}),
            "shards": {"run_id": run_id, "world_size": world_size, "layout": layout},
        },
        created_at=repo.clock(),
        parent=current.target if current else None,
        chunk_size=repo.config.chunk_size,
    )
    digest = repo.commit(
        manifest,
        name,
        expected=expected,
        op="commit-shards",
        message=f"{world_size} shards",
        overwrite=overwrite,
    )
    if not keep_staging:
        for rank, shard in enumerate(shards.digests):
            try:
                repo.refs_store.delete(staging_ref(run_id, rank), expected=shard)
            except (NotFound, RefConflict):
                continue  # re-saved or removed meanwhile: leave it to its writer
    return digest


@dataclass(frozen=True)
class _TensorLeaf:
    """A tensor reference during a merge: equal when the stored tensors are identical."""

    identity: tuple[Any, ...]
    shard: int = field(compare=False)
    index: int = field(compare=False)


def _identity(entry: TensorEntry) -> tuple[Any, ...]:
    return (
        entry.kind,
        entry.dtype,
        entry.shape,
        entry.nbytes,
        entry.chunks,
        entry.inline,
        repr(sorted((entry.encoding or {}).items())),
    )


def merge_trees(
    trees: list[Any], tables: list[tuple[TensorEntry, ...]], layout: str = "merge"
) -> tuple[Any, tuple[TensorEntry, ...]]:
    """Combine shard trees (with their tensor tables) into one tree and one tensor table."""
    lifted = [_lift(tree, shard, tables[shard]) for shard, tree in enumerate(trees)]
    if layout == "ranks":
        combined: Any = {"~": "dict", "items": [[f"rank{r}", t] for r, t in enumerate(lifted)]}
    else:
        combined = lifted[0]
        for shard in lifted[1:]:
            combined = _merge(combined, shard, "")
    order: dict[tuple[int, int], int] = {}
    table: list[TensorEntry] = []

    def lower(node: Any) -> Any:
        if isinstance(node, _TensorLeaf):
            key = (node.shard, node.index)
            if key not in order:
                order[key] = len(table)
                table.append(tables[node.shard][node.index])
            return {"~": "tensor", "i": order[key]}
        if isinstance(node, dict):
            return {k: lower(v) for k, v in node.items()}
        if isinstance(node, list):
            return [lower(v) for v in node]
        return node

    return lower(combined), tuple(table)


def _lift(node: Any, shard: int, table: tuple[TensorEntry, ...]) -> Any:
    """Replace tensor nodes by comparable leaves so equal tensors compare equal across shards."""
    if isinstance(node, dict):
        if node.get("~") == "tensor":
            index = int(node["i"])
            if not 0 <= index < len(table):
                raise FormatError(f"shard {shard}: tensor index {index} out of range")
            return _TensorLeaf(_identity(table[index]), shard, index)
        return {k: _lift(v, shard, table) for k, v in node.items()}
    if isinstance(node, list):
        return [_lift(v, shard, table) for v in node]
    return node


def _merge(left: Any, right: Any, path: str) -> Any:
    if _is_dict_node(left) and _is_dict_node(right):
        items: dict[Any, Any] = {}
        for key, value in left["items"]:
            items[key] = value
        for key, value in right["items"]:
            child = f"{path}.{key}" if path else str(key)
            items[key] = _merge(items[key], value, child) if key in items else value
        return {"~": "dict", "items": [[k, v] for k, v in items.items()]}
    if left == right:
        return left
    raise FormatError(
        f"shards disagree at {path or '/'}: a key present in several shards must hold the same "
        "value in each (use layout='ranks' to keep shards apart)"
    )


def _is_dict_node(node: Any) -> bool:
    return isinstance(node, dict) and node.get("~") == "dict"


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:10])
    return shown + (f" and {len(ranks) - 10} more" if len(ranks) > 10 else "")
