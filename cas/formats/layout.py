"""The description of a checkpoint file that the chunker needs: where its tensor bytes live."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TensorRegion:
    """One tensor's raw little-endian bytes inside a file.

    ``name`` is the safetensors key, or for torch zip files the dotted path of the tensor in the
    saved object (``model.fc.weight``, ``optimizer.state.0.exp_avg``); a storage that no single
    tensor covers exactly is named ``storage/<key>`` and described as ``uint8`` of shape
    ``(nbytes,)``. ``dtype`` is a torch dtype name without the ``torch.`` prefix. ``nbytes`` may
    be 0 (empty tensors); such a region still has a valid ``offset <= size``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        """One past the region's last byte."""
        return self.offset + self.nbytes


@dataclass(frozen=True)
class FileLayout:
    """What ``inspect_file`` learned about a file.

    ``regions`` are sorted by ``(offset, nbytes)``, never overlap and end at or before ``size``.
    Bytes outside every region (headers, pickles, zip records, padding) are the caller's to cut
    with content-defined chunking. ``format`` is ``"safetensors"``, ``"torch-zip"`` or
    ``"opaque"`` (no regions; includes validated legacy torch files and, when explicitly allowed,
    pickles that are not weights-only).
    """

    format: str
    size: int
    regions: tuple[TensorRegion, ...] = ()
    metadata: dict[str, str] = field(default_factory=dict)


def opaque_layout(size: int) -> FileLayout:
    """The layout of a file whose bytes are not interpreted."""
    return FileLayout(format="opaque", size=size)


def sorted_regions(regions: list[TensorRegion]) -> tuple[TensorRegion, ...]:
    """Regions in file order; the caller has already checked they do not overlap."""
    return tuple(sorted(regions, key=lambda r: (r.offset, r.nbytes, r.name)))


def first_overlap(regions: tuple[TensorRegion, ...]) -> tuple[TensorRegion, TensorRegion] | None:
    """The first pair of sorted regions that share a byte, if any."""
    for before, after in itertools.pairwise(regions):
        if after.offset < before.end:
            return before, after
    return None
