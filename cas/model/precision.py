"""Opt-in lossy storage: a precision policy (``store_as``) and a lossy delta threshold.

Both change the bytes stored, so neither is ever a default, and a manifest written with either
records it under ``meta["lossy"]`` (``cas show`` prints it).

- ``store_as={"model.*": "float16"}`` stores the floating tensors whose path matches a pattern in
  that dtype; the tensor's tree node keeps the dtype it had (``{"~": "tensor", "i": n, "as":
  "float32"}``), so a load returns it in its own dtype again, with the precision the stored dtype
  kept.
- ``lossy_delta=1e-5`` (or ``{"model.*": 1e-5}``) keeps, element by element, the parent
  checkpoint's value wherever a floating tensor changed by less than the threshold since it: such
  elements are stored as the very bytes the parent stored, so unchanged regions dedup and deltas
  against the parent are mostly zeros.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cas.errors import FormatError
from cas.model.state import TensorSource, tensor_bytes, torch_dtype

if TYPE_CHECKING:
    import torch

FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
"""The dtypes a policy applies to, and stores as."""


@dataclass(frozen=True)
class StoragePolicy:
    """What a save may store lossily: a dtype per path pattern, a delta threshold per pattern."""

    store_as: dict[str, str] = field(default_factory=dict)
    lossy_delta: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_args(
        cls, store_as: dict[str, str] | None, lossy_delta: float | dict[str, float] | None
    ) -> StoragePolicy | None:
        """The policy ``save(store_as=, lossy_delta=)`` asks for, None for a lossless save."""
        casts = dict(store_as or {})
        for pattern, dtype in casts.items():
            if dtype not in FLOAT_DTYPES:
                raise FormatError(
                    f"store_as[{pattern!r}] = {dtype!r}: choose one of {sorted(FLOAT_DTYPES)}"
                )
        if lossy_delta is None:
            deltas: dict[str, float] = {}
        elif isinstance(lossy_delta, dict):
            deltas = {str(k): float(v) for k, v in lossy_delta.items()}
        else:
            deltas = {"*": float(lossy_delta)}
        for pattern, threshold in deltas.items():
            if not threshold > 0:
                raise FormatError(f"lossy_delta for {pattern!r} must be above 0, not {threshold}")
        return cls(casts, deltas) if casts or deltas else None

    def describe(self) -> dict[str, Any]:
        """What ``meta["lossy"]`` records."""
        out: dict[str, Any] = {}
        if self.store_as:
            out["store_as"] = dict(self.store_as)
        if self.lossy_delta:
            out["lossy_delta"] = dict(self.lossy_delta)
        return out

    def dtype_for(self, path: str) -> str | None:
        """The dtype ``path`` is stored as, if a pattern names one (the first match wins)."""
        return next((d for p, d in self.store_as.items() if fnmatch.fnmatchcase(path, p)), None)

    def threshold_for(self, path: str) -> float | None:
        """The lossy delta threshold of ``path``, if any pattern matches it."""
        return next((t for p, t in self.lossy_delta.items() if fnmatch.fnmatchcase(path, p)), None)


def _values(source: TensorSource) -> torch.Tensor:
    import torch

    with warnings.catch_warnings():  # the bytes are only read, never written through
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(source.data, dtype=torch.uint8) if source.nbytes else None
    if flat is None:
        return torch.empty(source.shape, dtype=torch_dtype(source.dtype))
    return flat.view(torch_dtype(source.dtype)).reshape(source.shape)


def _with_values(source: TensorSource, values: torch.Tensor) -> TensorSource:
    return TensorSource(
        source.kind, str(values.dtype).removeprefix("torch."), source.shape, tensor_bytes(values),
        source.path,
    )  # fmt: skip


def cast_sources(
    tree: Any, sources: list[TensorSource], policy: StoragePolicy
) -> tuple[Any, list[TensorSource]]:
    """Sources cast to the policy's dtypes, and the tree with each cast tensor's node recording
    the dtype a load gives back."""
    restore: dict[int, str] = {}
    out = list(sources)
    for index, source in enumerate(sources):
        target = policy.dtype_for(source.path)
        if source.kind != "torch" or source.dtype not in FLOAT_DTYPES or target is None:
            continue
        if target != source.dtype:
            out[index] = _with_values(source, _values(source).to(torch_dtype(target)))
            restore[index] = source.dtype
    return (_mark_casts(tree, restore) if restore else tree), out


def _mark_casts(node: Any, restore: dict[int, str]) -> Any:
    if not isinstance(node, dict):
        return node
    tag = node.get("~")
    if tag == "tensor":
        index = int(node["i"])
        return {**node, "as": restore[index]} if index in restore else node
    if tag == "dict":
        return {**node, "items": [[k, _mark_casts(v, restore)] for k, v in node["items"]]}
    if tag in ("list", "tuple"):
        return {**node, "items": [_mark_casts(v, restore) for v in node["items"]]}
    return node  # sparse parts are never cast: their values are stored as they are


def keep_small_changes(
    sources: list[TensorSource],
    policy: StoragePolicy,
    parent_value: Callable[[TensorSource], torch.Tensor | None],
) -> list[TensorSource]:
    """Sources whose elements within the threshold of the parent's take the parent's value.

    ``parent_value(source)`` is the parent's stored tensor at the same path (same stored dtype
    and shape), or None; tensors without one are stored as they are.
    """
    import torch

    out = list(sources)
    for index, source in enumerate(sources):
        threshold = policy.threshold_for(source.path)
        if threshold is None or source.kind != "torch" or source.dtype not in FLOAT_DTYPES:
            continue
        before = parent_value(source)
        if before is None or before.dtype != torch_dtype(source.dtype):
            continue
        now = _values(source)
        if before.shape != now.shape:
            continue
        close = (now.double() - before.double()).abs() < threshold
        out[index] = _with_values(source, torch.where(close, before, now))
    return out
