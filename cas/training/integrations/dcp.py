"""torch.distributed.checkpoint: a StorageWriter and StorageReader that use a cas store directly.

``dcp.save(state_dict, storage_writer=CASStorageWriter(repo), checkpoint_id="runs/r1/step100")``
writes no files: every rank stores the tensors (and byte items) of its write plan as chunks in the
shared store (local or S3), and the coordinator commits one manifest naming every rank's tensors,
with DCP's ``Metadata`` encoded as plain values (never pickled) under ``tree["dcp"]``, then moves
the ref. ``dcp.load(state_dict, storage_reader=CASStorageReader(repo), checkpoint_id=...)`` reads
back only the chunks each rank's plan needs, verified, with any resharding DCP plans.

Non-tensor values (optimizer ``param_groups``, ints) are pickled by DCP's own planner into byte
items: cas stores those bytes as they are and, on load, first checks them with
``torch.load(weights_only=True)`` before handing them to the planner (which unpickles them); a
payload that needs arbitrary classes is a ``FormatError`` unless ``allow_pickled_values=True``.
Written against the ``StorageWriter``/``StorageReader`` interface of torch >= 2.4; rank-local
metadata (``use_collectives=False``) goes to ``<ref>@rank<N>``.
"""

from __future__ import annotations

import io
import os
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from cas.errors import FormatError
from cas.model.manifest import Manifest, TensorEntry
from cas.model.state import (
    TensorSource,
    decode_state,
    encode_state,
    tensor_bytes,
    torch_dtype,
    torch_dtype_name,
)
from cas.names import parse_ref_name

if TYPE_CHECKING:
    from cas.repo.repository import Repository

DCP_FORMAT = "cas-dcp"
DCP_SCHEMA = 1
DCP_VERSION = "1.0.0"
BATCH_BYTES = 256 << 20
"""A rank resolves and stores at most about this many bytes at a time (bounds staging memory)."""


@dataclass(frozen=True)
class StoredItem:
    """Where one write item went: a tensor or byte item, described by its tensor entry."""

    kind: str
    entry: TensorEntry


def _ref_for(checkpoint_id: str | os.PathLike[str] | None, rank: int | None = None) -> str:
    if checkpoint_id is None:
        raise FormatError("a DCP checkpoint_id (the ref to write or read) is required")
    ref = os.fspath(checkpoint_id).removeprefix("cas://")
    return parse_ref_name(ref if rank is None else f"{ref}@rank{rank}")


class CASStorageWriter(StorageWriter):  # type: ignore[misc,unused-ignore]
    """Writes a DCP checkpoint into ``repo`` under the ref ``checkpoint_id``.

    A gate, a ``best`` pointer or a ref the stored policy protects is replaced only with
    ``overwrite=True`` (checked before any byte is written, and again at the commit).
    """

    def __init__(
        self, repo: Repository, checkpoint_id: str | None = None, *, overwrite: bool = False
    ) -> None:
        super().__init__()
        self.repo = repo
        self.checkpoint_id = checkpoint_id
        self.overwrite = overwrite
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self.rank: int | None = None
        self.use_collectives = True

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save begins (optionally to another ref)."""
        if checkpoint_id:
            self.checkpoint_id = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Learn this instance's role."""
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Validate the ref, and that it may be written, before any byte is written."""
        ref = _ref_for(self.checkpoint_id, self.rank if not self.use_collectives else None)
        self.repo.check_replaceable(ref, overwrite=self.overwrite)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Nothing to coordinate: each write result carries its own tensor entry."""
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Store this rank's items as chunks; the results travel to the coordinator."""
        results: list[WriteResult] = []
        for batch in _batches(plan.items):
            sources: list[TensorSource] = []
            kinds: list[str] = []
            for item in batch:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                    sources.append(
                        TensorSource("torch", "uint8", (len(raw),), memoryview(raw), item.index.fqn)
                    )
                    kinds.append("bytes")
                else:
                    if not isinstance(data, torch.Tensor):
                        raise FormatError(f"DCP item {item.index.fqn!r} resolved to no tensor")
                    tensor = data.detach()
                    sources.append(
                        TensorSource("torch", torch_dtype_name(tensor.dtype), tuple(tensor.shape),
                                     tensor_bytes(tensor), item.index.fqn)
                    )  # fmt: skip
                    kinds.append("tensor")
            entries, _ = self.repo.write_tensors(sources)
            for item, kind, entry in zip(batch, kinds, entries, strict=True):
                results.append(WriteResult(item.index, entry.nbytes, StoredItem(kind, entry)))
        self.repo.sync()  # the coordinator's commit cannot make another rank's chunks durable
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit one manifest for every rank's items, then move the ref."""
        tensors: list[TensorEntry] = []
        items: list[list[Any]] = []
        for rank_results in results:
            for result in rank_results:
                stored = result.storage_data
                if not isinstance(stored, StoredItem):
                    raise FormatError(f"unexpected DCP storage data {type(stored).__name__}")
                index = result.index
                offset = list(index.offset) if index.offset is not None else None
                items.append([index.fqn, offset, index.index, stored.kind, len(tensors)])
                tensors.append(stored.entry)
        doc = _encode_metadata(metadata, items, os.fspath(self.checkpoint_id or ""), self.save_id)
        tree, sources = encode_state({"dcp": doc})
        if sources:
            raise FormatError("DCP metadata unexpectedly holds tensors")
        data = [
            [_item_name(fqn, offset), {"~": "tensor", "i": i}] for fqn, offset, _, _, i in items
        ]
        tree["items"].append(["data", {"~": "dict", "items": data}])
        rank = self.rank if not self.use_collectives else None
        ref = _ref_for(self.checkpoint_id, rank)
        manifest = Manifest(
            kind="state", tensors=tuple(tensors), tree=tree,
            meta={"source": "torch.distributed.checkpoint", "format": DCP_FORMAT},
            created_at=self.repo.clock(), chunk_size=self.repo.config.chunk_size,
        )  # fmt: skip
        self.repo.commit(
            manifest, ref, op="dcp-save", message=self.save_id, overwrite=self.overwrite
        )

    def storage_meta(self) -> StorageMeta | None:
        """Identifies this save in the metadata."""
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Only ``cas://<ref>`` ids select this writer automatically."""
        return os.fspath(checkpoint_id).startswith("cas://")


class CASStorageReader(StorageReader):  # type: ignore[misc,unused-ignore]
    """Reads a DCP checkpoint from ``repo`` (the ref is pinned to one manifest per load)."""

    def __init__(
        self,
        repo: Repository,
        checkpoint_id: str | None = None,
        *,
        allow_pickled_values: bool = False,
    ) -> None:
        super().__init__()
        self.repo = repo
        self.checkpoint_id = checkpoint_id
        self.allow_pickled_values = allow_pickled_values
        self.storage_data: dict[MetadataIndex, StoredItem] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new load begins (optionally from another ref)."""
        self.storage_data = {}
        if checkpoint_id:
            self.checkpoint_id = os.fspath(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Decode DCP's metadata from the manifest (no pickle involved)."""
        ref = _ref_for(self.checkpoint_id, kwargs.get("rank"))
        manifest = self.repo.manifest(ref)
        if manifest.meta.get("format") != DCP_FORMAT:
            raise FormatError(f"{ref} is not a DCP checkpoint written by cas")
        tree = decode_state(manifest.tree, _no_tensor, lambda path: path.split(".")[0] == "dcp")
        return _decode_metadata(tree["dcp"], manifest)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Keep the item table (it travels with the metadata to every rank)."""
        if not isinstance(metadata.storage_data, dict):
            raise FormatError("DCP metadata has no storage table")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """No storage-specific planning."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """No storage-specific planning."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the chunks this rank's plan needs (verified) and hand them to the planner."""
        for batch in _batches(
            plan.items, lambda item: self.storage_data[item.storage_index].entry.nbytes
        ):
            stored = [self.storage_data[item.storage_index] for item in batch]
            manifest = Manifest(kind="state", tensors=tuple(s.entry for s in stored))
            values = self.repo.read_tensors(manifest, range(len(stored)))
            for position, item in enumerate(batch):
                value = values[position]
                if item.type == LoadItemType.BYTE_IO:
                    data = value.numpy().tobytes()
                    self._check_pickle(data, item.storage_index.fqn)
                    planner.load_bytes(item, io.BytesIO(data))
                    continue
                tensor = _narrow(value, item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != tensor.size():
                    raise FormatError(
                        f"{item.storage_index.fqn}: stored slice {tuple(tensor.size())} does not "
                        f"match the requested {tuple(target.size())}"
                    )
                target.copy_(tensor)
                planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _check_pickle(self, data: bytes, fqn: str) -> None:
        if self.allow_pickled_values:
            return
        try:
            torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as e:
            raise FormatError(
                f"DCP value {fqn!r} is a pickle that needs arbitrary classes ({e}); load it "
                "with CASStorageReader(..., allow_pickled_values=True) only if you trust the store"
            ) from e

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Only ``cas://<ref>`` ids select this reader automatically."""
        return os.fspath(checkpoint_id).startswith("cas://")


def _item_name(fqn: str, offset: list[int] | None) -> str:
    """``fqn``, or ``fqn@o1,o2`` for a shard that does not start at the origin."""
    if not offset or not any(offset):
        return fqn
    return f"{fqn}@{','.join(str(o) for o in offset)}"


def _no_tensor(index: int) -> Any:
    raise FormatError("DCP metadata unexpectedly references a tensor")


def _batches(items: Sequence[Any], size: Any = None) -> Iterator[list[Any]]:
    batch: list[Any] = []
    total = 0
    for item in items:
        batch.append(item)
        total += size(item) if size is not None else _write_size(item)
        if total >= BATCH_BYTES:
            yield batch
            batch, total = [], 0
    if batch:
        yield batch


def _write_size(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    count = 1
    for dim in item.tensor_data.size:
        count *= dim
    return count * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset != 0 or length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def _encode_metadata(
    metadata: Metadata, items: list[list[Any]], checkpoint_id: str, save_id: str
) -> dict[str, Any]:
    described: dict[str, Any] = {}
    for fqn, info in metadata.state_dict_metadata.items():
        if isinstance(info, TensorStorageMetadata):
            described[fqn] = {
                "type": "tensor", "dtype": torch_dtype_name(info.properties.dtype),
                "requires_grad": bool(info.properties.requires_grad), "size": list(info.size),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in info.chunks],
            }  # fmt: skip
        elif isinstance(info, BytesStorageMetadata):
            described[fqn] = {"type": "bytes"}
        else:
            raise FormatError(
                f"DCP metadata for {fqn!r} is a {type(info).__name__}; cas cannot store it"
            )
    planner_data = metadata.planner_data
    if planner_data is not None:
        if not isinstance(planner_data, dict) or not all(
            isinstance(path, (tuple, list)) and all(isinstance(p, (str, int)) for p in path)
            for path in planner_data.values()
        ):
            raise FormatError("custom DCP planner data cannot be stored without pickle")
        planner_data = {str(k): list(v) for k, v in planner_data.items()}
    modules = list(metadata.storage_meta.modules) if metadata.storage_meta else []
    return {
        "format": DCP_FORMAT, "schema": DCP_SCHEMA, "version": metadata.version or DCP_VERSION,
        "state_dict_metadata": described, "planner_data": planner_data, "items": items,
        "storage_meta": {"checkpoint_id": checkpoint_id, "save_id": save_id, "modules": modules},
    }  # fmt: skip


def _decode_metadata(doc: dict[str, Any], manifest: Manifest) -> Metadata:
    if doc.get("format") != DCP_FORMAT or doc.get("schema") != DCP_SCHEMA:
        raise FormatError(f"unknown DCP metadata schema {doc.get('schema')!r}")
    try:
        described: dict[str, Any] = {}
        for fqn, info in doc["state_dict_metadata"].items():
            if info["type"] == "bytes":
                described[fqn] = BytesStorageMetadata()
                continue
            properties = TensorProperties(
                dtype=torch_dtype(info["dtype"]), requires_grad=bool(info["requires_grad"])
            )
            chunks = [
                ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                for offsets, sizes in info["chunks"]
            ]
            described[fqn] = TensorStorageMetadata(properties, torch.Size(info["size"]), chunks)
        storage: dict[MetadataIndex, StoredItem] = {}
        for fqn, offset, index, kind, tensor_index in doc["items"]:
            key = MetadataIndex(fqn, torch.Size(offset) if offset is not None else None, index)
            storage[key] = StoredItem(kind, manifest.tensors[tensor_index])
        planner_data = doc.get("planner_data")
        if planner_data is not None:
            planner_data = {k: tuple(v) for k, v in planner_data.items()}
        sm = doc.get("storage_meta") or {}
        storage_meta = StorageMeta(
            checkpoint_id=sm.get("checkpoint_id"), save_id=sm.get("save_id"),
            modules=list(sm.get("modules") or []),
        )  # fmt: skip
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise FormatError(f"corrupt DCP metadata: {e}") from e
    return Metadata(described, planner_data, storage, storage_meta, str(doc.get("version")))
