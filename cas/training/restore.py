"""Restoring a run: which checkpoints to try, in what order, and loading the first sound one.

The candidates for a resume are the targets of the run's ``latest`` ref, newest first, taken from
its history (so a checkpoint whose ``ckpt_`` ref was pruned is still tried). A candidate whose
manifest or any chunk fails verification (every byte read is re-hashed) or is missing is skipped
with a warning and recorded; an explicit source is never replaced by another.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cas.digest import Digest
from cas.errors import FormatError, IntegrityError, NotFound, NothingSelected

if TYPE_CHECKING:
    import torch

    from cas.repo.repository import Repository

log = logging.getLogger("cas.training.manager")


@dataclass(frozen=True)
class Skipped:
    """A checkpoint that ``restore`` passed over, and why."""

    ref: str
    digest: str
    reason: str


@dataclass
class Restored:
    """What ``restore`` did: the state (None for ``fresh``) and where it came from."""

    mode: str
    state: Any
    step: int = 0
    phase: int = 1
    ref: str | None = None
    digest: Digest | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    fallbacks: list[Skipped] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Found:
    """The checkpoint ``load_first_good`` settled on."""

    ref: str
    digest: Digest
    tree: Any
    meta: dict[str, Any]
    skipped: list[Skipped]


def unwrap(tree: Any, meta: Mapping[str, Any]) -> Any:
    """The user's state inside a manager checkpoint's ``{"state", "rng"}`` tree (else the tree)."""
    if meta.get("cas_checkpoint") and isinstance(tree, dict):
        return tree.get("state")
    return tree


def resume_candidates(repo: Repository, latest_ref: str) -> Iterator[tuple[str, Digest]]:
    """``(checkpoint ref, digest)`` for every target ``latest_ref`` ever had, newest first.

    Lazy: the first good candidate usually ends the walk, so sealed history is seldom read.
    """
    record = repo.find_ref(latest_ref)
    if record is None:
        return
    seen: set[Digest] = set()
    for event in repo.ref_events(record):
        if event.target not in seen:
            seen.add(event.target)
            yield event.message or latest_ref, event.target


def load_checkpoint(
    repo: Repository,
    ref: str,
    keys: str | Sequence[str] | None,
    map_location: str | torch.device | None,
    *,
    with_rng: bool,
) -> tuple[Any, dict[str, Any]]:
    """Load ``ref``; ``keys`` select within the user's state (and RNG states if ``with_rng``)."""
    meta = repo.manifest(ref).meta
    patterns = None
    wanted = [keys] if isinstance(keys, str) else list(keys or [])
    in_state = keys is not None and bool(meta.get("cas_checkpoint"))
    if in_state:
        patterns = [f"state.{k}" for k in wanted] + (["rng", "rng.*"] if with_rng else [])
    elif keys is not None:
        patterns = wanted
    tree = repo.load(ref, map_location=map_location, keys=patterns)
    if in_state and not (isinstance(tree, dict) and "state" in tree):  # only RNGs matched
        raise NothingSelected(
            f"keys {', '.join(map(repr, wanted))} match nothing in the state saved at {ref}"
        )
    return tree, dict(meta)


def load_first_good(
    repo: Repository,
    candidates: Iterable[tuple[str, Digest]],
    *,
    keys: str | Sequence[str] | None,
    map_location: str | torch.device | None,
    with_rng: bool,
    check: Callable[[str, Mapping[str, Any]], None] | None,
    fallback: bool,
    heal: Callable[[str, Digest], bool] | None = None,
) -> Found:
    """Load the first candidate that passes ``check`` and verification.

    ``check`` errors (a config mismatch) are raised at once, never skipped. With ``fallback``
    false the first candidate's failure is raised as it is. ``heal(ref, digest)`` (a remote
    tier's) may restore a candidate that failed; it is then loaded once more.
    """
    skipped: list[Skipped] = []
    newest: tuple[str, tuple[int, int]] | None = None
    for ref, digest in candidates:
        try:
            stored_meta = repo.manifest(digest).meta
            position = _position(stored_meta)
            if newest is not None and position is not None and position > newest[1]:
                # latest once named a later step: a branch the run was restarted away from.
                skipped.append(Skipped(ref, digest, f"later than {newest[0]}: another branch"))
                continue
            if newest is None and position is not None:
                newest = (ref, position)
            if check is not None:
                check(ref, stored_meta)
            tree, meta = _load_healing(repo, ref, digest, keys, map_location, with_rng, heal)
        except NothingSelected:
            raise  # a typo in keys=, not a damaged checkpoint: an older one would not help
        except (IntegrityError, NotFound, FormatError) as e:
            if not fallback:
                raise
            skipped.append(Skipped(ref, digest, str(e)))
            log.warning("checkpoint %s failed verification (%s); trying the one before it", ref, e)
            continue
        return Found(ref, digest, tree, meta, skipped)
    if not skipped:
        raise NotFound("there is no checkpoint to load")
    tried = "; ".join(f"{s.ref}: {s.reason}" for s in skipped)
    raise IntegrityError(f"every checkpoint failed verification: {tried}")


def _load_healing(
    repo: Repository,
    ref: str,
    digest: Digest,
    keys: str | Sequence[str] | None,
    map_location: str | torch.device | None,
    with_rng: bool,
    heal: Callable[[str, Digest], bool] | None,
) -> tuple[Any, dict[str, Any]]:
    try:
        return load_checkpoint(repo, digest, keys, map_location, with_rng=with_rng)
    except (IntegrityError, NotFound) as e:
        if heal is None or not heal(ref, digest):
            raise
        log.warning("checkpoint %s failed verification (%s); healed it from the remote", ref, e)
        return load_checkpoint(repo, digest, keys, map_location, with_rng=with_rng)


def _position(meta: Mapping[str, Any]) -> tuple[int, int] | None:
    """``(phase, step)`` of a manager checkpoint; None for anything else."""
    phase, step = meta.get("phase", 0), meta.get("step")
    if not isinstance(step, int) or not isinstance(phase, int):
        return None
    return phase, step
