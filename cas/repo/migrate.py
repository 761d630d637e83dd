"""Moving a store forward to the current format version, one registered step per version.

A store's config names the version of its layout (``cas.repo.config``). Each step moves a store
from one version to the next: it first *plans* (reads the store and lists what it will change,
touching nothing), then executes each action. Every action is safe to repeat and leaves the store
readable if it is interrupted: refs move by compare-and-swap, a new object is durable before
anything names it, and an old blob is deleted only after what replaces it is in place. The config
moves to the next version only after every action of the step is done, so a killed migration is
finished by running it again. Steps run under the maintenance lock, so GC never runs meanwhile.

Version 1 to 2 moves what older cas wrote and this one only reads (docs/format.md): long ref
names at their whole quoted key, training histories kept as byte tensors, a pool's eviction list
in manifest meta, and eviction logs kept as JSON-lines blobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from cas.errors import CASError, FormatError
from cas.model.manifest import decode_manifest
from cas.names import RefName
from cas.refs import legacy_logs
from cas.refs.keys import REFS_PREFIX, is_hashed_key, legacy_key, name_in_key
from cas.refs.log import AppendLog
from cas.repo.config import STORE_VERSION, StoreConfig, read_config, write_config
from cas.repo.repository import Repository

EVICTION_LOG_PREFIX = "logs/evictions/"
"""Where an eviction log lives as an append log (the retention layer's layout)."""


@dataclass(frozen=True)
class Action:
    """One change a step makes: what it is (for ``--dry-run``) and how to make it."""

    description: str
    run: Callable[[], object]


@dataclass(frozen=True)
class Step:
    """Moves a store from ``version`` to ``version + 1``."""

    version: int
    title: str
    plan: Callable[[Repository], list[Action]]


@dataclass
class MigrationReport:
    """What ``migrate`` found and did: the versions, and each step's planned actions."""

    from_version: int
    to_version: int
    dry_run: bool
    steps: list[tuple[Step, list[str]]] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        """The report as JSON-ready data (``cas migrate --json``)."""
        return {
            "from_version": self.from_version,
            "to_version": self.to_version,
            "dry_run": self.dry_run,
            "steps": [
                {"from": step.version, "to": step.version + 1, "title": step.title, "actions": acts}
                for step, acts in self.steps
            ],
        }


def migrate(repo: Repository, *, dry_run: bool = False) -> MigrationReport:
    """Move ``repo``'s store to ``STORE_VERSION``, step by step (``dry_run``: plan only).

    A store already at the current version is left as it is; a store newer than this cas is a
    FormatError (it cannot be opened either). With ``dry_run``, only the first pending step can be
    planned in full: later steps plan against the store as the earlier ones leave it.
    """
    with repo.maintenance.lock("migrate", enabled=not dry_run):
        config = _current_config(repo)
        report = MigrationReport(config.version, config.version, dry_run)
        while config.version < STORE_VERSION:
            step = STEPS.get(config.version)
            if step is None:
                raise FormatError(f"this cas cannot move a store of version {config.version}")
            actions = step.plan(repo)
            report.steps.append((step, [a.description for a in actions]))
            if dry_run:
                report.to_version = STORE_VERSION
                return report
            for action in actions:
                action.run()
                repo.maintenance.refresh_lock()
            repo.objects.sync()  # everything the step wrote is durable before the version moves
            # Read again: a policy change made while the step ran must not be lost.
            config = replace(_current_config(repo), version=step.version + 1)
            write_config(repo.blobs, config)
            repo.config = config
            report.to_version = config.version
        return report


def _current_config(repo: Repository) -> StoreConfig:
    """The config as stored now (another process may have migrated or changed it)."""
    config = read_config(repo.blobs)
    if config is None:
        raise FormatError(f"no store config at {repo.url}")
    return config


# -- version 1 to 2 ------------------------------------------------------------------------------


def _plan_1_to_2(repo: Repository) -> list[Action]:
    return [*_long_ref_moves(repo), *_old_log_heads(repo), *_jsonl_logs(repo)]


def _long_ref_moves(repo: Repository) -> list[Action]:
    """Refs whose long name is still at its whole quoted key."""
    refs = repo.refs_store
    moves = []
    for key in sorted(repo.blobs.list(REFS_PREFIX)):
        if is_hashed_key(key):
            continue
        try:
            name = name_in_key(key)
        except CASError:
            continue  # no ref name: `cas verify` reports it, nothing here can move it
        if legacy_key(name) == key:
            moves.append(
                Action(f"move ref {name[:60]!r}... to its hashed key", _bind(refs.relocate, name))
            )
    return moves


def _old_log_heads(repo: Repository) -> list[Action]:
    """Training histories and pool eviction lists in the layouts before append logs."""
    actions = []
    for scanned in repo.refs_store.scan():
        if scanned.record is None:
            raise FormatError(
                f"ref {scanned.label!r} cannot be read ({scanned.error}); repair it "
                "(`cas verify --repair-from`) or delete it before migrating"
            )
        record = scanned.record
        meta = decode_manifest(repo.objects.get_manifest(record.target)).meta
        if meta.get("format") == legacy_logs.HISTORY_FORMAT:
            kind = "training-history"
        elif meta.get("cas_pool_evictions") == 1:
            kind = "pool-evictions"
        else:
            continue
        log = AppendLog(repo.refs_store, record.name, kind)
        actions.append(Action(f"rewrite {kind} log {record.name!r} as an append log", log.rewrite))
    return actions


def _jsonl_logs(repo: Repository) -> list[Action]:
    """Eviction logs still kept as JSON-lines blobs."""
    actions = []
    for name in sorted(legacy_logs.jsonl_names(repo.blobs)):
        log = AppendLog(
            repo.refs_store, EVICTION_LOG_PREFIX + name, "eviction-log", legacy_jsonl=name
        )
        actions.append(
            Action(
                f"move eviction log {name!r} from JSON lines into {EVICTION_LOG_PREFIX}{name}",
                log.absorb_jsonl,
            )
        )
    return actions


def _bind(fn: Callable[[str], object], name: RefName) -> Callable[[], object]:
    return lambda: fn(name)


STEPS: dict[int, Step] = {
    1: Step(1, "move layouts older cas wrote to the current ones", _plan_1_to_2),
}
"""The registered steps, by the version each moves from; one per version below the current."""
