"""The one exception tree of cas: every error a caller can catch derives from CASError."""

from __future__ import annotations


class CASError(Exception):
    """Root of every error cas raises on purpose."""


class NotFound(CASError, FileNotFoundError):
    """A blob, object, manifest or ref that does not exist."""


class AlreadyExists(CASError, FileExistsError):
    """A create-only write found something already there."""


class IntegrityError(CASError):
    """Bytes read back do not match the blake3 digest they are stored under."""


class PreconditionFailed(CASError):
    """A conditional (compare-and-swap) write lost: the current version differs."""


class RefConflict(PreconditionFailed):
    """A ref moved between read and compare-and-swap; nothing was overwritten."""


class LeaseExpired(CASError):
    """A writer's lease ran out before its commit; the commit was aborted."""


class LockHeld(CASError):
    """Another maintenance run (``cas forget``, ``cas gc``) holds the store's lock; nothing changed."""


class FormatError(CASError):
    """A store, object, manifest or file is malformed or of an unknown version."""


class InvalidName(CASError, ValueError):
    """A ref name or path is not allowed (``..``, absolute, NUL, empty segment...)."""


class ReadOnlyError(CASError, PermissionError):
    """A write was attempted through a read-only store."""


class BackendError(CASError, OSError):
    """A storage backend failed (network, permissions, server error)."""


class TransientBackendError(BackendError):
    """A backend failure that is worth retrying (timeouts, throttling, 5xx)."""
