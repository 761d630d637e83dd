"""Is a checkpoint compatible with this run? Config hashes at resume, strict key sets at phase
transitions.

Resuming under a changed config silently trains a different experiment, so resume refuses it;
at a phase transition a key mismatch between the model and its gate checkpoint means a code bug
and must fail loudly. Both checks live here so the errors read the same wherever a checkpoint is
loaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, is_dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from cas.digest import digest_of
from cas.errors import CASError, FormatError

if TYPE_CHECKING:
    pass


class ConfigMismatch(CASError):
    """``resume`` found a checkpoint written under a different config hash."""


class SystemMismatch(ConfigMismatch):
    """``resume`` found a checkpoint written for other input data (its ``system_hash``)."""


class StrictLoadError(CASError):
    """A strict load found missing, unexpected or reshaped keys."""


def config_hash(config: Any) -> str:
    """blake3 of the config's canonical JSON (dataclasses and mappings; keys sorted)."""
    return digest_of(_canonical_json(config).encode())


def check_config(ref: str, meta: Mapping[str, Any], current_hash: str | None, config: Any) -> None:
    """Raise ConfigMismatch when ``ref`` was saved under a config hash other than ``current_hash``.

    Nothing is checked when either side has no hash (an old checkpoint, a run without config).
    """
    saved = meta.get("config_hash")
    if current_hash is None or saved is None or saved == current_hash:
        return
    changed = changed_keys(meta.get("config"), plain_config(config))
    detail = f"; changed: {', '.join(changed)}" if changed else ""
    raise ConfigMismatch(
        f"cannot resume from {ref}: it was saved with config {saved[:12]}, this run's config "
        f"is {current_hash[:12]}{detail}. Restore the original config, or start from "
        "these weights with mode='warm_start'"
    )


def resume_meta(config_hash: str | None, config: Any, system_hash: str | None) -> dict[str, Any]:
    """What a checkpoint records so that a resume can check it: the config hash (and the config
    itself when it is plain data) and the system (input data) hash, each when the run has one."""
    meta: dict[str, Any] = {}
    if config_hash is not None:
        meta["config_hash"] = config_hash
        plain = plain_config(config)
        if plain is not None:
            meta["config"] = plain
    if system_hash is not None:
        meta["system_hash"] = system_hash
    return meta


def check_system(ref: str, meta: Mapping[str, Any], current: str | None) -> None:
    """Raise SystemMismatch when ``ref`` was saved for a system (input data) hash other than
    ``current``, or for one while this run passes none (the caller's ``allow_system_change``
    skips the check); a checkpoint saved without one is not checked."""
    saved = meta.get("system_hash")
    if saved is None or saved == current:
        return
    if current is None:
        raise SystemMismatch(
            f"cannot resume from {ref}: it was saved for system (input data) {str(saved)[:16]} "
            "and this run passes no system_hash, so a change of inputs cannot be ruled out. "
            "Pass the inputs' system_hash=, or restore(..., allow_system_change=True) to resume "
            "without checking"
        )
    raise SystemMismatch(
        f"cannot resume from {ref}: it was saved for system (input data) {str(saved)[:16]}, this "
        f"run's is {current[:16]}. Restore the original inputs, pass "
        "restore(..., allow_system_change=True) to resume on the new ones, or start from these "
        "weights with mode='warm_start'"
    )


@dataclass(frozen=True)
class TensorSpec:
    """A template leaf for a tensor whose size is free along some dimensions: ``None`` in
    ``shape`` matches any size there (``TensorSpec((None, 12))``: any number of cuts by 12
    stages); ``dtype`` None matches any dtype."""

    shape: tuple[int | None, ...]
    dtype: str | None = None


def check_keys(loaded: Any, template: Any, where: str) -> None:
    """Raise StrictLoadError listing missing, unexpected and reshaped keys of ``loaded``.

    A template leaf is a tensor or array (its dtype and shape must match exactly) or a
    ``TensorSpec`` with free dimensions."""
    have, want = _leaf_shapes(loaded), _leaf_shapes(template)
    missing = sorted(want.keys() - have.keys())
    unexpected = sorted(have.keys() - want.keys())
    reshaped = sorted(
        f"{k}: checkpoint {have[k]} vs expected {_shown(want[k])}"
        for k in have.keys() & want.keys()
        if not _fits(have[k], want[k])
    )
    if not (missing or unexpected or reshaped):
        return
    parts = []
    for label, items in (("missing", missing), ("unexpected", unexpected), ("shape", reshaped)):
        if items:
            parts.append(f"{len(items)} {label}: {', '.join(items)}")
    raise StrictLoadError(f"strict load of {where} failed: " + "; ".join(parts))


def _fits(have: Any, want: Any) -> bool:
    if not isinstance(want, TensorSpec):
        return bool(have == want)
    if not isinstance(have, tuple):
        return False
    dtype, shape = have
    if (want.dtype is not None and want.dtype != dtype) or len(shape) != len(want.shape):
        return False
    return all(w is None or w == h for h, w in zip(shape, want.shape, strict=True))


def _shown(want: Any) -> Any:
    if isinstance(want, TensorSpec):
        shape = "(" + ", ".join("*" if d is None else str(d) for d in want.shape) + ")"
        return f"({want.dtype or '*'!r}, {shape})"
    return want


def _leaf_shapes(state: Any, path: str = "") -> dict[str, Any]:
    import torch

    if isinstance(state, TensorSpec):
        return {path: state}
    if isinstance(state, (torch.Tensor, np.ndarray)):
        return {path: (str(state.dtype).removeprefix("torch."), tuple(state.shape))}
    if isinstance(state, Mapping):
        out: dict[str, Any] = {}
        for key, value in state.items():
            out.update(_leaf_shapes(value, f"{path}.{key}" if path else str(key)))
        return out
    if isinstance(state, (list, tuple)):
        out = {}
        for index, value in enumerate(state):
            out.update(_leaf_shapes(value, f"{path}.{index}" if path else str(index)))
        return out
    return {path: None}


def _jsonable(config: Any) -> Any:
    if is_dataclass(config) and not isinstance(config, type):
        return _jsonable(asdict(config))
    if isinstance(config, Mapping):
        return {str(k): _jsonable(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [_jsonable(v) for v in config]
    if isinstance(config, (set, frozenset)):
        return sorted(_jsonable(v) for v in config)
    if config is None or isinstance(config, (bool, int, float, str)):
        return config
    raise FormatError(
        f"config value {config!r} is a {type(config).__name__}; use dataclasses, dicts, lists "
        "and plain values so the config hash is stable"
    )


def _canonical_json(config: Any) -> str:
    return json.dumps(_jsonable(config), sort_keys=True, separators=(",", ":"))


def config_change(meta: Mapping[str, Any], config: Any) -> dict[str, Any]:
    """What a pivot's history record says about the config: the hashes before and after, and
    ``{dotted key: [before, after]}`` for each changed key (when both configs are plain data)."""
    old, new = meta.get("config"), plain_config(config)
    changes = {key: [_at(old, key), _at(new, key)] for key in changed_keys(old, new)}
    after = config_hash(config) if config is not None else None
    return {"config_from": meta.get("config_hash"), "config_to": after, "config_diff": changes}


def _at(config: Any, dotted: str) -> Any:
    for part in dotted.split(".") if dotted != "<config>" else []:
        config = config.get(part) if isinstance(config, dict) else None
    return config


def plain_config(config: Any) -> Any:
    return json.loads(_canonical_json(config)) if config is not None else None


def changed_keys(old: Any, new: Any, path: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(old.keys() | new.keys()):
            sub = f"{path}.{key}" if path else key
            out.extend(changed_keys(old.get(key), new.get(key), sub))
        return out
    if old is None and new is None:
        return []
    return [path or "<config>"] if old != new else []
