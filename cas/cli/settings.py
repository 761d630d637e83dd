"""The CLI's configuration: the per-user TOML file, and named remotes (per user or per store).

The user's file is ``$CAS_CONFIG``, else ``$XDG_CONFIG_HOME/cas/config.toml``
(``~/.config/cas/config.toml``)::

    [core]
    store = "/data/cas"                      # the default store (--store and CAS_STORE win)
    endpoint_url = "http://localhost:8333"   # for s3:// stores (--endpoint-url and AWS_ENDPOINT_URL win)

    [remote.archive]
    url = "s3://bucket/prefix"
    endpoint_url = "http://localhost:8333"   # optional

A store's own remotes live in its config (the ``remotes`` section of ``cas.repo.config``), so
they travel with the store, and win over the user's remote of the same name. Credentials are
never read from either: boto3's chain (``AWS_PROFILE``, ``~/.aws/credentials``, instance roles)
supplies them, and a key that looks like one is refused.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cas.errors import FormatError, InvalidName

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CONFIG_ENV = "CAS_CONFIG"
STORE_SECTION = "remotes"
"""The section of a store's config (``StoreConfig.extra``) that holds its remotes."""
CORE_KEYS = ("store", "endpoint_url")
REMOTE_KEYS = ("url", "endpoint_url")
_REMOTE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_SECRET_HINTS = ("secret", "password", "token", "access_key", "credential")


@dataclass(frozen=True)
class Remote:
    """A named store to push to and pull from: its URL and, for S3, its endpoint."""

    name: str
    url: str
    endpoint_url: str | None = None
    scope: str = "user"
    """``user`` (the user's config file) or ``store`` (the store's own config)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {
            "name": self.name,
            "url": self.url,
            "endpoint_url": self.endpoint_url,
            "scope": self.scope,
        }


@dataclass(frozen=True)
class UserConfig:
    """The parsed user config file (empty when there is none)."""

    path: Path
    core: dict[str, str] = field(default_factory=dict)
    remotes: dict[str, Remote] = field(default_factory=dict)


def user_config_path(environ: Mapping[str, str] | None = None) -> Path:
    """``$CAS_CONFIG``, else ``$XDG_CONFIG_HOME/cas/config.toml`` (``~/.config/...``)."""
    env = os.environ if environ is None else environ
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV]).expanduser()
    base = env.get("XDG_CONFIG_HOME") or os.path.join(Path.home(), ".config")
    return Path(base) / "cas" / "config.toml"


def is_remote_name(text: str) -> bool:
    """Whether ``text`` could name a remote (rather than only be a URL or a path)."""
    return _REMOTE_NAME.fullmatch(text) is not None


def check_remote_name(name: str) -> str:
    """A remote's name: one word of letters, digits and ``_.-`` (never a path or URL)."""
    if not _REMOTE_NAME.fullmatch(name):
        raise InvalidName(
            f"bad remote name {name!r}: one word of letters, digits and _.- (at most 64)"
        )
    return name


def _check_keys(where: str, table: Any, allowed: tuple[str, ...]) -> dict[str, str]:
    if not isinstance(table, dict):
        raise FormatError(f"{where} is not a table")
    for key, value in table.items():
        if any(hint in key.lower() for hint in _SECRET_HINTS):
            raise FormatError(
                f"{where}.{key}: cas never reads credentials from its config; "
                "use the AWS chain (AWS_PROFILE, ~/.aws/credentials, an instance role)"
            )
        if key not in allowed:
            raise FormatError(f"{where}.{key}: unknown setting (known: {', '.join(allowed)})")
        if not isinstance(value, str):
            raise FormatError(f"{where}.{key} is not a string")
    return dict(table)


def _remotes(where: str, tables: Any, scope: str) -> dict[str, Remote]:
    if not isinstance(tables, dict):
        raise FormatError(f"{where} is not a table of remotes")
    out = {}
    for name, table in tables.items():
        check_remote_name(name)
        values = _check_keys(f"{where}.{name}", table, REMOTE_KEYS)
        if not values.get("url"):
            raise FormatError(f"{where}.{name} has no url")
        out[name] = Remote(name, values["url"], values.get("endpoint_url"), scope)
    return out


def load_user_config(path: Path | None = None) -> UserConfig:
    """Read the user's config file; a missing one is an empty config, a malformed one a
    FormatError naming the file."""
    path = path or user_config_path()
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return UserConfig(path)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: not valid TOML: {e}") from e
    unknown = sorted(set(doc) - {"core", "remote"})
    if unknown:
        raise FormatError(f"{path}: unknown section [{unknown[0]}] (known: [core], [remote.NAME])")
    try:
        core = _check_keys("core", doc.get("core", {}), CORE_KEYS)
        remotes = _remotes("remote", doc.get("remote", {}), "user")
    except FormatError as e:
        raise FormatError(f"{path}: {e}") from None
    return UserConfig(path, core, remotes)


def store_remotes(extra: Mapping[str, Any]) -> dict[str, Remote]:
    """The remotes kept in a store's config (its ``extra`` sections)."""
    return _remotes(f"store config {STORE_SECTION}", extra.get(STORE_SECTION) or {}, "store")


def store_section(remotes: Mapping[str, Remote]) -> dict[str, Any] | None:
    """The ``remotes`` section of a store's config for ``remotes`` (None: remove it)."""
    section = {name: _remote_table(r) for name, r in sorted(remotes.items())}
    return section or None


def _remote_table(remote: Remote) -> dict[str, str]:
    table = {"url": remote.url}
    if remote.endpoint_url:
        table["endpoint_url"] = remote.endpoint_url
    return table


def write_user_config(config: UserConfig) -> None:
    """Write the user's config file (made private: 0600), by temp file and rename."""
    lines = ["# cas configuration (see `cas remote --help`); credentials come from the AWS chain"]
    if config.core:
        lines += ["", "[core]", *(f"{k} = {_toml_str(v)}" for k, v in sorted(config.core.items()))]
    for name, remote in sorted(config.remotes.items()):
        lines += ["", f"[remote.{_toml_key(name)}]"]
        lines += [f"{k} = {_toml_str(v)}" for k, v in _remote_table(remote).items()]
    config.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = config.path.with_name(f".{config.path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, config.path)


def _toml_str(value: str) -> str:
    """A TOML basic string: JSON's string escapes are all valid TOML escapes."""
    return json.dumps(value)


def _toml_key(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else _toml_str(name)
