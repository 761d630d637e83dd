"""Read limits: the most one read allocates for what a manifest declares.

A manifest names sizes; a reader allocates them. Decoding bounds each field (``cas.model.schema``),
but a well-formed manifest may still declare a terabyte-sized tensor over chunks that do not
exist: these limits refuse it before anything is allocated or written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cas.errors import FormatError
from cas.units import format_size, parse_size


@dataclass(frozen=True)
class ReadLimits:
    """The most a reader allocates for what a manifest declares, whatever the store holds.

    A reader's own choice, never the store's (the store may be the hostile party): from
    ``cas.open(..., read_limits=...)`` or ``$CAS_MAX_CHECKPOINT_BYTES`` / ``$CAS_MAX_TENSOR_BYTES``
    (sizes such as ``2T``). A checkpoint declaring more is refused before anything is allocated.
    """

    max_checkpoint_bytes: int = 1 << 40
    """Bytes one checkpoint may declare in all (its tensors, or its files)."""
    max_tensor_bytes: int = 256 << 30
    """Bytes one tensor or file may declare."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ReadLimits:
        """Defaults, overridden by ``CAS_MAX_CHECKPOINT_BYTES`` and ``CAS_MAX_TENSOR_BYTES``."""
        values: dict[str, int] = {}
        for name, var in (
            ("max_checkpoint_bytes", "CAS_MAX_CHECKPOINT_BYTES"),
            ("max_tensor_bytes", "CAS_MAX_TENSOR_BYTES"),
        ):
            if environ.get(var):
                try:
                    values[name] = parse_size(environ[var])
                except ValueError as e:
                    raise FormatError(f"${var}: {e}") from e
        return cls(**values)

    def check(self, sizes: Iterable[int]) -> None:
        """FormatError if the tensors or files of ``sizes`` (what one read would allocate or
        write) add up to more than these limits allow, or one of them does."""
        sizes = list(sizes)
        largest = max(sizes, default=0)
        if largest > self.max_tensor_bytes:
            raise FormatError(
                f"checkpoint holds a tensor or file of {format_size(largest)}, above the "
                f"reader's limit of {format_size(self.max_tensor_bytes)} "
                "(raise $CAS_MAX_TENSOR_BYTES)"
            )
        if sum(sizes) > self.max_checkpoint_bytes:
            raise FormatError(
                f"checkpoint declares {format_size(sum(sizes))}, above the reader's limit of "
                f"{format_size(self.max_checkpoint_bytes)} (raise $CAS_MAX_CHECKPOINT_BYTES)"
            )
