"""The one exception tree of cas: every error a caller can catch derives from CASError."""

from __future__ import annotations


class CASError(Exception):
    """Root of every error cas raises on purpose."""


class NotFound(CASError, FileNotFoundError):
    """A blob, object, manifest or ref that does not exist."""


class NothingSelected(NotFound):
    """A selection (``keys=``, ``--only``, a ref selector) matched nothing: a typo, not damage."""


class AlreadyExists(CASError, FileExistsError):
    """A create-only write found something already there."""


class ProtectedRef(AlreadyExists):
    """A write would replace a gate, a ``best`` pointer or a ref the stored policy protects."""

    def __init__(self, ref: str, protection: str, current: str, *, option: str = "") -> None:
        self.ref, self.protection, self.current = ref, protection, current
        option = option or "overwrite=True"
        super().__init__(
            f"{ref} is {protection} and already names {current[:16]}; "
            f"replace it explicitly with {option}"
        )

    def for_option(self, option: str) -> ProtectedRef:
        """The same refusal, naming ``option`` (a CLI flag) as the way to replace it anyway."""
        return ProtectedRef(self.ref, self.protection, self.current, option=option)


class IntegrityError(CASError):
    """Bytes read back do not match the blake3 digest they are stored under."""


class PreconditionFailed(CASError):
    """A conditional (compare-and-swap) write lost: the current version differs."""


class RefConflict(PreconditionFailed):
    """A ref moved between read and compare-and-swap; nothing was overwritten."""


class LeaseExpired(CASError):
    """A writer's lease ran out before its commit; the commit was aborted."""


class ClockSkew(CASError):
    """This host's offset to the storage's clock cannot be measured, or not closely enough for
    the lease margin; nothing was written under a lease or lock that would rely on it."""


class LockHeld(CASError):
    """Another maintenance run (``cas forget``, ``cas gc``) holds the store's lock; nothing changed."""


class FormatError(CASError):
    """A store, object, manifest or file is malformed or of an unknown version."""


class RefusedPickle(FormatError):
    """A file whose pickle weights-only loading would refuse (or cannot read); never unpickled."""

    def __init__(self, file: str, problem: str, reason: str, *, option: str = "") -> None:
        self.file, self.problem, self.reason = file, problem, reason
        option = option or "allow_opaque_pickles=True"
        super().__init__(
            f"refusing to load {file}: {problem} ({reason}); "
            f"{option} stores it as opaque bytes, never loaded"
        )

    def for_option(self, option: str) -> RefusedPickle:
        """The same refusal, naming ``option`` (a CLI flag) as the way to store it anyway."""
        return RefusedPickle(self.file, self.problem, self.reason, option=option)


class InvalidName(CASError, ValueError):
    """A ref name or path is not allowed (``..``, absolute, NUL, empty segment...)."""


class ReadOnlyError(CASError, PermissionError):
    """A write was attempted through a read-only store."""


class BackendError(CASError, OSError):
    """A storage backend failed (network, permissions, server error)."""


class TransientBackendError(BackendError):
    """A backend failure that is worth retrying (timeouts, throttling, 5xx)."""
