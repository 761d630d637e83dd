"""cas: a content-addressed object store for model state.

``repo = cas.open(url)`` opens a store (a local path by default, or ``s3://bucket/prefix``);
``repo.save(state, "runs/r1/ckpt_step00000100")`` and ``repo.load(...)`` move training state in and
out without pickle; refs name manifests, manifests name chunks, chunks are stored once by blake3.
"""

from typing import TYPE_CHECKING, Any

from cas.errors import (
    AlreadyExists,
    BackendError,
    CASError,
    FormatError,
    IntegrityError,
    InvalidName,
    LeaseExpired,
    NotFound,
    ReadOnlyError,
    RefConflict,
)
from cas.model.limits import ReadLimits
from cas.repo.opening import default_store_url, open
from cas.repo.repository import Repository

if TYPE_CHECKING:
    from cas.training.manager import CheckpointManager

__version__ = "0.1.0"

__all__ = [
    "AlreadyExists",
    "BackendError",
    "CASError",
    "CheckpointManager",
    "FormatError",
    "IntegrityError",
    "InvalidName",
    "LeaseExpired",
    "NotFound",
    "ReadLimits",
    "ReadOnlyError",
    "RefConflict",
    "Repository",
    "default_store_url",
    "open",
]


def __getattr__(name: str) -> Any:
    """``cas.CheckpointManager`` on first use: the training layer loads numpy, ``import cas`` does
    not (and neither imports torch until a tensor is built)."""
    if name == "CheckpointManager":
        from cas.training.manager import CheckpointManager

        return CheckpointManager
    raise AttributeError(f"module 'cas' has no attribute {name!r}")
