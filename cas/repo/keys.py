"""An encrypted store's keys: one random master key, wrapped under each passphrase that opens it.

As restic's ``key`` files: the store holds ``keys/<id>``, each a small JSON document with the
master key sealed (AES-256-GCM) under a key derived from one passphrase by scrypt (memory-hard:
64 MiB and about 0.1-0.3 s per try), with its salt and parameters. Several may open one store;
adding, listing, removing and replacing them (``cas key add / list / remove / passwd``) never
touches the data, because the data is sealed under the master key, which never changes.

The passphrase comes from ``key=`` (``cas.open``), else ``CAS_KEY``, else the file
``CAS_KEY_FILE`` names, else what ``CAS_KEY_COMMAND`` prints (a secrets manager's CLI). The store's
config says it is encrypted (``extra["encryption"]``), so a store opened without a key fails in one
line before any other blob is read, and a wrong key fails likewise.
"""

from __future__ import annotations

import base64
import functools
import getpass
import json
import os
import shlex
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cas.blobstore.base import BlobStore
from cas.errors import CASError, FormatError, NotFound

if TYPE_CHECKING:
    from cas.blobstore.sealed import StoreKey
    from cas.repo.repository import Repository

KEYS_PREFIX = "keys/"
KEY_FORMAT = "cas-key"
ENCRYPTION_SECTION = "encryption"
"""The ``StoreConfig.extra`` section that marks a store encrypted."""
SCHEME = "aes-256-gcm/aes-256-names/scrypt"
KEY_ENV, KEY_FILE_ENV, KEY_COMMAND_ENV = "CAS_KEY", "CAS_KEY_FILE", "CAS_KEY_COMMAND"
SCRYPT_N = 1 << 16
"""scrypt's cost: 2^16 x 128 x r bytes = 64 MiB of memory per try (r=8)."""
SCRYPT_R, SCRYPT_P = 8, 1
MAX_KEY_BLOB = 16 << 10


class KeyRequired(CASError):
    """The store is encrypted and no passphrase was given."""


class WrongKey(CASError):
    """No key of the store opens with the passphrase given."""


@dataclass(frozen=True)
class KeySlot:
    """One wrapped copy of the master key: ``keys/<id>``."""

    id: str
    created_at: float
    host: str
    user: str
    doc: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """What ``cas key list --json`` prints (nothing secret)."""
        return {"id": self.id, "created_at": self.created_at, "host": self.host, "user": self.user}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@functools.lru_cache(maxsize=8)
def _kek(passphrase: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    """The key-encryption key (remembered, so a process that reopens its store pays once)."""
    # cryptography loads with the first encrypted store, not with every ``import cas``.
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

    return Scrypt(salt=salt, length=32, n=n, r=r, p=p).derive(passphrase.encode())


def wrap(master: StoreKey, passphrase: str, *, n: int = SCRYPT_N) -> dict[str, Any]:
    """A key document: ``master`` sealed under a key scrypt derives from ``passphrase``."""
    if not passphrase:
        raise CASError("an empty passphrase cannot protect a store")
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    salt, nonce = os.urandom(16), os.urandom(12)
    sealed = AESGCM(_kek(passphrase, salt, n, SCRYPT_R, SCRYPT_P)).encrypt(
        nonce, master.master, KEY_FORMAT.encode()
    )
    return {
        "format": KEY_FORMAT,
        "version": 1,
        "kdf": "scrypt",
        "n": n,
        "r": SCRYPT_R,
        "p": SCRYPT_P,
        "salt": _b64(salt),
        "nonce": _b64(nonce),
        "wrapped": _b64(sealed),
        "created_at": time.time(),
        "host": socket.gethostname(),
        "user": getpass.getuser(),
    }


def unwrap(doc: dict[str, Any], passphrase: str) -> StoreKey | None:
    """The master key, or None when ``passphrase`` is not this document's."""
    try:
        n, r, p = int(doc["n"]), int(doc["r"]), int(doc["p"])
        if doc.get("format") != KEY_FORMAT or doc.get("kdf") != "scrypt":
            raise FormatError("not a cas key")
        if not (1 << 10 <= n <= 1 << 22 and 1 <= r <= 32 and 1 <= p <= 16):
            raise FormatError(f"scrypt parameters out of bounds (n={n}, r={r}, p={p})")
        salt, nonce = base64.b64decode(doc["salt"]), base64.b64decode(doc["nonce"])
        sealed = base64.b64decode(doc["wrapped"])
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"malformed key document: {e}") from e
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from cas.blobstore.sealed import StoreKey

    try:
        return StoreKey(
            AESGCM(_kek(passphrase, salt, n, r, p)).decrypt(nonce, sealed, KEY_FORMAT.encode())
        )
    except InvalidTag:
        return None


def read_slots(blobs: BlobStore) -> list[KeySlot]:
    """Every key document in the store (a malformed one is skipped: it opens nothing)."""
    slots = []
    for key in sorted(blobs.list(KEYS_PREFIX)):
        try:
            raw = blobs.get(key)
            if len(raw) > MAX_KEY_BLOB:
                continue
            doc = json.loads(raw)
            slots.append(
                KeySlot(
                    key[len(KEYS_PREFIX) :],
                    float(doc.get("created_at", 0)),
                    str(doc.get("host", "")),
                    str(doc.get("user", "")),
                    doc,
                )
            )
        except (CASError, ValueError, TypeError, AttributeError):
            continue
    return slots


def add_slot(blobs: BlobStore, master: StoreKey, passphrase: str, *, n: int = SCRYPT_N) -> KeySlot:
    """Store another wrapped copy of ``master``, opened by ``passphrase``."""
    doc = wrap(master, passphrase, n=n)
    slot_id = uuid.uuid4().hex[:16]
    blobs.put(f"{KEYS_PREFIX}{slot_id}", json.dumps(doc).encode())
    blobs.sync()
    return KeySlot(slot_id, doc["created_at"], doc["host"], doc["user"], doc)


def remove_slot(blobs: BlobStore, slot_id: str) -> None:
    """Remove one key document; the last one is never removed (the store would be lost)."""
    slots = read_slots(blobs)
    if not any(s.id == slot_id for s in slots):
        raise NotFound(f"no key {slot_id!r} in {blobs.url}")
    if len(slots) == 1:
        raise CASError(f"key {slot_id} is the store's last key: add another before removing it")
    blobs.delete(f"{KEYS_PREFIX}{slot_id}")


def open_key(blobs: BlobStore, passphrase: str | None) -> tuple[StoreKey, KeySlot]:
    """The master key and the slot ``passphrase`` opened; KeyRequired or WrongKey in one line."""
    if passphrase is None:
        passphrase = passphrase_from_environment()
    if passphrase is None:
        raise KeyRequired(
            f"the store at {blobs.url} is encrypted: give its passphrase (key=, {KEY_ENV}, "
            f"{KEY_FILE_ENV} or {KEY_COMMAND_ENV})"
        )
    for slot in read_slots(blobs):
        master = unwrap(slot.doc, passphrase)
        if master is not None:
            return master, slot
    raise WrongKey(f"no key of the store at {blobs.url} opens with the passphrase given")


def passphrase_from_environment() -> str | None:
    """``CAS_KEY``, else the first line of ``CAS_KEY_FILE``, else what ``CAS_KEY_COMMAND``
    prints (its first line); None when none is set."""
    if os.environ.get(KEY_ENV):
        return os.environ[KEY_ENV]
    path = os.environ.get(KEY_FILE_ENV)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.readline().rstrip("\r\n")
        except OSError as e:
            raise CASError(f"cannot read {KEY_FILE_ENV} {path}: {e.strerror}") from e
    command = os.environ.get(KEY_COMMAND_ENV)
    if command:
        try:
            out = subprocess.run(
                shlex.split(command), capture_output=True, text=True, timeout=60, check=True
            )
        except (OSError, subprocess.SubprocessError) as e:
            raise CASError(f"{KEY_COMMAND_ENV} ({command}) failed: {e}") from e
        return out.stdout.splitlines()[0] if out.stdout else ""
    return None


def list_keys(repo: Repository) -> list[KeySlot]:
    """The keys of ``repo``'s store (an encrypted one)."""
    return read_slots(repo.blobs)


def add_key(repo: Repository, passphrase: str) -> KeySlot:
    """Wrap ``repo``'s master key under another passphrase."""
    if repo.store_key is None:
        raise CASError(f"the store at {repo.url} is not encrypted")
    return add_slot(repo.blobs, repo.store_key, passphrase)


def remove_key(repo: Repository, slot_id: str, *, allow_current: bool = False) -> None:
    """Remove one key; not the one ``repo`` was opened with unless ``allow_current`` (``passwd``
    removes it once the new one is stored), and never the last."""
    if slot_id == repo.key_slot and not allow_current:
        raise CASError(f"key {slot_id} is the one in use: `cas key passwd` replaces it")
    remove_slot(repo.blobs, slot_id)
