"""cas: a content-addressed object store for model state.

``repo = cas.open(url)`` opens a store (a local path by default, or ``s3://bucket/prefix``);
``repo.save(state, "runs/r1/ckpt_step00000100")`` and ``repo.load(...)`` move training state in and
out without pickle; refs name manifests, manifests name chunks, chunks are stored once by blake3.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
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


def _use_lightning_integration() -> None:
    """Make ``ModelCheckpoint(dirpath="cas://...")`` resume from ``last`` with no extra import.

    Lightning looks for "last" on the local disk whatever its filesystem (see
    ``cas.training.integrations.lightning``), so the integration's fix must be in place before
    a Trainer resolves ``ckpt_path="last"``. fsspec imports cas on the first ``cas://`` URL,
    usually after Lightning (then the fix is installed now); if cas came first, it is installed
    when ``lightning.pytorch`` has been imported. Without Lightning nothing is imported.
    """
    if "lightning.pytorch" in sys.modules:
        import cas.training.integrations.lightning  # noqa: F401

        return
    if not any(isinstance(f, _AfterLightning) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterLightning())


class _AfterLightning(importlib.abc.MetaPathFinder):
    """Runs ``_use_lightning_integration`` once ``lightning.pytorch`` has finished importing."""

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "lightning.pytorch":
            return None
        sys.meta_path.remove(self)  # the real finders locate it; this one only wraps the loader
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_then_integrate(module: ModuleType) -> None:
            run_module(module)
            _use_lightning_integration()

        loader.exec_module = exec_then_integrate  # type: ignore[method-assign]
        return spec


_use_lightning_integration()
