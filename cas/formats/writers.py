"""Writing state out as standard files for ``cas get --format``: safetensors and torch.save.

Both writers are atomic: they write a temporary file next to the target, fsync it, rename it
over the target and fsync the directory, so a reader sees the old file or the whole new one.

``flatten_state`` turns a nested state (dicts with str or int keys, lists, tuples) into the flat
``{name: tensor}`` map safetensors needs. Names join the keys on the path with ``"."``; int keys
and list positions become their decimal strings, so ``{"optimizer": {"state": {0: {"exp_avg":
t}}}}`` gives ``"optimizer.state.0.exp_avg"``. Keys may themselves contain ``"."`` (safetensors
keys are opaque); two paths that join to the same name raise ``InvalidName``. Non-tensor leaves
(None, bool, int, float, str, numpy scalars, empty dicts and lists) go, keyed the same way, into
one JSON object stored as metadata ``"cas.values"``; metadata also carries ``"format": "pt"``,
which ``transformers`` requires to load a safetensors file. numpy arrays become tensors.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from cas.errors import FormatError, InvalidName

if TYPE_CHECKING:
    import torch

__all__ = ["VALUES_METADATA_KEY", "flatten_state", "write_safetensors", "write_torch"]

VALUES_METADATA_KEY = "cas.values"
"""Metadata key of the JSON object holding a flattened state's non-tensor leaves."""

_SCALARS = (type(None), bool, int, float, str)
_MAX_DEPTH = 256


def write_safetensors(
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None,
    path: str | os.PathLike[str],
) -> None:
    """Write ``tensors`` as a safetensors file at ``path`` atomically.

    Tensors are moved to the CPU and made contiguous; tensors that share memory are copied,
    since safetensors stores each tensor's bytes separately.
    """
    from safetensors.torch import save_file

    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise FormatError("safetensors metadata must map strings to strings")
    prepared = _standalone_tensors(tensors)
    meta = dict(metadata) if metadata is not None else None

    def write(temp_path: str) -> None:
        try:
            save_file(prepared, temp_path, metadata=meta)
        except Exception as e:
            # The library reports a failed write as its own error type with the OS error in
            # its text: give it back as the OSError it was, so a full disk reads as one.
            found = _OS_ERROR.search(str(e))
            if found is not None:
                code = int(found.group(1))
                raise OSError(code, os.strerror(code), os.fspath(path)) from e
            if isinstance(e, (ValueError, RuntimeError, TypeError)):
                raise FormatError(f"cannot write {os.fspath(path)} as safetensors: {e}") from e
            raise

    _atomic_write(path, write)


def write_torch(obj: object, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj)`` to ``path`` atomically.

    The archive is written through a file object, so its internal name is always ``archive``
    rather than derived from the (random) temporary file name.
    """
    import torch

    def write(temp_path: str) -> None:
        try:
            with open(temp_path, "wb") as raw:
                stream = _RememberingWriter(raw)
                try:
                    torch.save(obj, stream)
                except RuntimeError as e:
                    # torch's archive writer turns a failed write into "unexpected pos ...":
                    # the OSError it swallowed (a full disk, an I/O error) is the reason.
                    if stream.failure is None:
                        raise
                    raise stream.failure from e
        except OSError as e:
            raise OSError(e.errno, e.strerror, os.fspath(path)) from e

    _atomic_write(path, write)


class _RememberingWriter:
    """A binary file that keeps the first OSError its writes raised."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.failure: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            written: int = self._raw.write(data)
        except OSError as e:
            self.failure = self.failure or e
            raise
        return written

    def flush(self) -> None:
        try:
            self._raw.flush()
        except OSError as e:
            self.failure = self.failure or e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def flatten_state(state: object) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Flatten a nested state into ``(tensors by dotted name, metadata)``; see module docs."""
    import torch

    if not isinstance(state, (Mapping, list, tuple)):
        raise FormatError(f"can only flatten a dict, list or tuple, not {type(state).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    stack: list[tuple[str, object, int]] = [("", state, 0)]
    while stack:
        name, node, depth = stack.pop()
        children = _children(name, node)
        if children is not None and (children or not name):
            if depth >= _MAX_DEPTH:  # a container that contains itself would never end
                raise FormatError(f"state is nested deeper than {_MAX_DEPTH} levels at {name!r}")
            stack.extend((child, value, depth + 1) for child, value in reversed(children))
            continue
        if name in tensors or name in values:
            raise InvalidName(f"state paths collide on the flattened name {name!r}")
        leaf = _leaf(name, node)
        if isinstance(leaf, torch.Tensor):
            tensors[name] = leaf
        else:
            values[name] = leaf
    metadata = {"format": "pt"}
    if values:
        metadata[VALUES_METADATA_KEY] = json.dumps(values, sort_keys=True)
    return tensors, metadata


def _children(name: str, node: object) -> list[tuple[str, object]] | None:
    """Named children of a container, or None if ``node`` is a leaf."""
    if isinstance(node, Mapping):
        pairs = []
        for key, value in node.items():
            if not isinstance(key, (str, int)):
                raise FormatError(f"state key {key!r} under {name!r} is not a str or int")
            pairs.append((str(key), value))
    elif isinstance(node, (list, tuple)):
        pairs = [(str(i), value) for i, value in enumerate(node)]
    else:
        return None
    return [(f"{name}.{key}" if name else key, value) for key, value in pairs]


def _leaf(name: str, node: object) -> object:
    """The tensor or JSON value a leaf is stored as."""
    import torch

    if isinstance(node, torch.Tensor):
        return node
    if isinstance(node, np.ndarray):
        if node.dtype.kind not in "biufc":
            raise FormatError(f"state value {name!r}: numpy dtype {node.dtype} is not numeric")
        # torch needs native byte order and its own writable copy of a read-only array.
        native = np.array(node, dtype=node.dtype.newbyteorder("="), order="C", copy=True)
        return torch.from_numpy(native)
    if isinstance(node, np.generic):
        return node.item()
    if isinstance(node, Mapping):
        return {}
    if isinstance(node, (list, tuple)):
        return []
    if isinstance(node, _SCALARS):
        return node
    raise FormatError(f"state value {name!r} of type {type(node).__name__} has no file form")


def _standalone_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch

    prepared: dict[str, torch.Tensor] = {}
    storages_seen: set[int] = set()
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise FormatError(f"tensor {name!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.layout != torch.strided:
            raise FormatError(f"tensor {name!r} has layout {tensor.layout}; make it dense first")
        t = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() in storages_seen:
            t = t.clone()
        elif storage.nbytes():
            storages_seen.add(storage.data_ptr())
        prepared[name] = t
    return prepared


_OS_ERROR = re.compile(r"os error (\d+)")


def _atomic_write(path: str | os.PathLike[str], write: Callable[[str], None]) -> None:
    final = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(final))
    # Short, so that any file name the filesystem takes can be written; O_NOFOLLOW and the
    # rename never write through a link planted under either name.
    temp = os.path.join(directory, f".cas-{secrets.token_hex(8)}.tmp")
    # Created by os.open with 0o666 so the umask applies, unlike mkstemp's 0o600.
    try:
        os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
    except FileNotFoundError:  # named for the file asked for, not the temp file beside it
        raise FileNotFoundError(errno.ENOENT, "no such directory to write into", final) from None
    try:
        write(temp)
        _fsync(temp, os.O_RDONLY)
        os.replace(temp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    _fsync(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
