"""StoreConfig: the store's self-description (format, version, chunking and codec choices)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from cas.blobstore.base import BlobStore
from cas.errors import FormatError, NotFound
from cas.model.bounded import load_record_json
from cas.objects.chunking import DEFAULT_CDC_AVG, DEFAULT_CHUNK_SIZE

CONFIG_KEY = "config"
STORE_FORMAT = "cas-store"
STORE_VERSION = 2
"""Version 2 is version 1 with no older layout left in it (``cas.repo.migrate``); ``cas`` reads
both and creates version 2."""
CLEAN_VERSION = 2
"""From this version on a store holds none of the layouts an older cas wrote, so readers do not
look for them."""
MAX_CHUNK_SIZE = 64 << 20
WRITER_SETTINGS = ("codec", "compression_level", "inline_max")
"""Settings that only say how new data is written (readers never depend on them): changeable in
a store at any time (``Repository.update_settings``). Chunking is fixed when a store is made."""


@dataclass(frozen=True)
class StoreConfig:
    """Settings fixed when a store is created (``chunk_size``) or changeable later (codec...).

    ``extra`` holds sections owned by other layers (retention policies, GC settings) so that
    adding one never needs a new store version.
    """

    chunk_size: int = DEFAULT_CHUNK_SIZE
    cdc_avg_size: int = DEFAULT_CDC_AVG
    codec: str = "raw"
    compression_level: int = 3
    inline_max: int = 4096
    created_at: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    version: int = STORE_VERSION
    """The format version the store's layout is at: rewriting the config (a policy change) keeps
    it, only ``cas migrate`` moves it."""

    def validate(self) -> StoreConfig:
        """Check bounds; a store with absurd settings is refused rather than trusted."""
        if not 4096 <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise FormatError(f"chunk_size {self.chunk_size} outside [4096, {MAX_CHUNK_SIZE}]")
        if not 256 <= self.cdc_avg_size <= MAX_CHUNK_SIZE // 4:
            raise FormatError(f"cdc_avg_size {self.cdc_avg_size} out of range")
        if not 0 <= self.inline_max <= 65536:
            raise FormatError(f"inline_max {self.inline_max} out of range")
        return self

    def to_json(self) -> bytes:
        """The config blob: JSON so a person (or another language) can read it."""
        doc = {"format": STORE_FORMAT, **asdict(self)}
        return json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes) -> StoreConfig:
        """Parse a config blob; another format or an unknown version is a clear FormatError."""
        doc = load_record_json(data, "store config")
        if not isinstance(doc, dict) or doc.get("format") != STORE_FORMAT:
            raise FormatError("not a cas store (config has no 'format': 'cas-store')")
        version = doc.get("version")
        if type(version) is not int or version < 1:
            raise FormatError(f"store config has no valid format version ({version!r})")
        if version > STORE_VERSION:
            raise FormatError(
                f"store format version {version} is newer than this cas "
                f"(it reads versions 1 to {STORE_VERSION}); upgrade cas"
            )
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in doc.items() if k in known}).validate()
        except TypeError as e:
            raise FormatError(f"store config is malformed: {e}") from e

    def differences(self, wanted: StoreConfig) -> list[str]:
        """The settings ``wanted`` asks for that this (stored) config holds otherwise, as
        ``name <stored> (asked <wanted>)``; ``created_at`` and ``version`` are the store's own,
        and only the ``extra`` sections ``wanted`` has are compared."""
        out = [
            f"{f.name} {getattr(self, f.name)!r} (asked {getattr(wanted, f.name)!r})"
            for f in fields(self)
            if f.name not in ("created_at", "version", "extra")
            and getattr(self, f.name) != getattr(wanted, f.name)
        ]
        out.extend(
            f"extra section {name!r}"
            for name, value in wanted.extra.items()
            if self.extra.get(name) != value
        )
        return out

    def with_extra(self, section: str, value: Any) -> StoreConfig:
        """A copy with one ``extra`` section replaced."""
        return replace(self, extra={**self.extra, section: value})


def read_config(blobs: BlobStore) -> StoreConfig | None:
    """The store's config, or None for an empty location."""
    try:
        return StoreConfig.from_json(blobs.get(CONFIG_KEY))
    except NotFound:
        return None


def write_config(blobs: BlobStore, config: StoreConfig) -> None:
    """Write the config blob durably."""
    blobs.put(CONFIG_KEY, config.validate().to_json())
    blobs.sync()
