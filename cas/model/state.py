"""Nested training state <-> manifest tree plus raw tensor bytes, with no pickle anywhere.

A state is any nesting of dicts (str or int keys), lists and tuples whose leaves are tensors,
numpy arrays and scalars, ints, floats, strings, bytes, bools, None, ``torch.dtype`` and
``torch.device``; a dataclass instance (a config) is stored as a dict of its fields that names its
type, and loads as that dict. Containers become tagged msgpack maps (``{"~": "dict", "items": [[k, v], ...]}``),
plain values stay plain, and each tensor becomes ``{"~": "tensor", "i": n}``, an index into the
manifest's tensor table. The same tensor reached twice (one object, or two objects over the same
elements of one storage, as ``state_dict()`` gives tied weights) is stored once and comes back as
one object (tied weights stay tied). A sparse tensor (COO or CSR) becomes a ``sparse`` node naming
its component tensors (indices and values, or row pointers, columns and values) and its size, so
it comes back bit-exact without being densified.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cas.errors import FormatError
from cas.model.manifest import ITEMSIZE
from cas.model.schema import SPARSE_PARTS

if TYPE_CHECKING:
    import numpy as np
    import torch

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


def sparse_layout(tensor: torch.Tensor) -> str | None:
    """``"coo"`` or ``"csr"`` for a sparse tensor cas stores, None for a dense one; other
    layouts (CSC, BSR, BSC) are a FormatError."""
    import torch

    if tensor.layout == torch.strided:
        return None
    if tensor.layout == torch.sparse_coo:
        return "coo"
    if tensor.layout == torch.sparse_csr:
        return "csr"
    raise FormatError(
        f"cannot store a {tensor.layout} tensor: cas stores dense, sparse COO and sparse CSR "
        "tensors (convert it with .to_sparse_csr() or .to_dense())"
    )


def sparse_parts(tensor: torch.Tensor, layout: str) -> list[torch.Tensor]:
    """The component tensors of a sparse tensor, in ``SPARSE_PARTS`` order, as stored: a COO
    tensor's raw indices and values, coalesced or not."""
    t = tensor.detach()
    if layout == "coo":
        return [t._indices(), t._values()]
    return [t.crow_indices(), t.col_indices(), t.values()]


def build_sparse(
    layout: str,
    parts: list[Any],
    size: tuple[int, ...],
    coalesced: bool = False,
    *,
    check: bool = True,
) -> torch.Tensor:
    """A sparse tensor from its components; components that do not form one (a damaged or
    hostile manifest) are a FormatError, checked before anything uses the indices (``check``;
    off only for copies of a tensor torch built itself)."""
    import torch

    try:
        if layout == "coo":
            return torch.sparse_coo_tensor(
                parts[0], parts[1], size, is_coalesced=coalesced, check_invariants=check
            )
        return torch.sparse_csr_tensor(parts[0], parts[1], parts[2], size, check_invariants=check)
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        raise FormatError(
            f"corrupt manifest: no sparse {layout} tensor of size {list(size)}: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from e


@dataclass(frozen=True)
class TensorSource:
    """One tensor to store: how to rebuild it, and its bytes as a flat uint8 view."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview
    path: str

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data."""
        return len(self.data)

    @property
    def elem_size(self) -> int:
        """Bytes per element (1 for numpy scalars of odd types is never wrong for codecs)."""
        return max(1, self.data.nbytes // max(1, math.prod(self.shape)))


def torch_dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; unknown names are a FormatError."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or name not in ITEMSIZE:
        raise FormatError(f"dtype {name!r} is not supported by this torch")
    return dtype


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements as a flat little-endian uint8 view, copying only when it must."""
    import torch

    if tensor.layout != torch.strided:
        raise FormatError(f"cannot store a {tensor.layout} tensor; convert it to dense first")
    if tensor.is_quantized:
        raise FormatError("cannot store a quantized tensor; dequantize it first")
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]


def _numpy_bytes(array: np.ndarray[Any, Any]) -> memoryview:
    import numpy as np

    if array.dtype.hasobject or array.dtype.fields is not None:
        raise FormatError(f"cannot store a numpy array of dtype {array.dtype} (objects/records)")
    contiguous = np.ascontiguousarray(array)
    little = contiguous.dtype.newbyteorder("<")
    if contiguous.dtype != little:  # '>' anywhere, '=' on a big-endian host: stored little-endian
        contiguous = contiguous.astype(little)
    return memoryview(contiguous.reshape(-1).view(np.uint8)).cast("B")  # type: ignore[arg-type]


def encode_state(state: Any) -> tuple[Any, list[TensorSource]]:
    """Turn a nested state into a msgpack-ready tree and the list of tensors it references."""
    import numpy as np
    import torch  # here, not at the top: ``import cas`` and the CLI start without torch

    sources: list[TensorSource] = []
    seen: dict[int, int] = {}
    seen_sparse: dict[int, dict[str, Any]] = {}
    keep_alive: list[Any] = []

    aliases: dict[tuple[Any, ...], int] = {}

    def add(obj: Any, source: Callable[[], TensorSource]) -> dict[str, Any]:
        index = seen.get(id(obj))
        alias = alias_key(obj) if index is None else None
        if index is None and alias is not None:
            index = aliases.get(alias)
        if index is None:
            index = len(sources)
            sources.append(source())
            if alias is not None:
                aliases[alias] = index
        # ids and data pointers stay unique only while objects live: every object ``seen`` names
        # is kept, an alias too (a sparse tensor's parts are temporaries, and an alias freed here
        # let a later part take its id and be stored as the wrong tensor).
        keep_alive.append(obj)
        seen[id(obj)] = index
        return {"~": "tensor", "i": index}

    def walk(obj: Any, path: str) -> Any:
        # numpy's float64 is a Python float too: kept a numpy scalar, it loads as one.
        if obj is None or (
            isinstance(obj, (bool, float, str, bytes)) and not isinstance(obj, np.number)
        ):
            return obj
        if isinstance(obj, int):
            return obj if _INT_MIN <= obj <= _INT_MAX else {"~": "int", "v": str(obj)}
        if isinstance(obj, torch.Tensor) and (layout := sparse_layout(obj)) is not None:
            if id(obj) not in seen_sparse:
                parts = sparse_parts(obj, layout)
                keep_alive.append(obj)
                seen_sparse[id(obj)] = {
                    "~": "sparse",
                    "layout": layout,
                    "size": list(obj.shape),
                    "coalesced": layout == "coo" and obj.is_coalesced(),
                    "parts": [
                        [name, walk(part, f"{path}.{name}" if path else name)]
                        for name, part in zip(SPARSE_PARTS[layout], parts, strict=True)
                    ],
                }
            return seen_sparse[id(obj)]
        if isinstance(obj, torch.Tensor):
            return add(
                obj,
                lambda: TensorSource(
                    "torch", torch_dtype_name(obj.dtype), tuple(obj.shape), tensor_bytes(obj), path
                ),
            )
        if isinstance(obj, np.ndarray):
            return add(
                obj,
                lambda: TensorSource(
                    "numpy",
                    obj.dtype.newbyteorder("<").str,
                    tuple(obj.shape),
                    _numpy_bytes(obj),
                    path,
                ),
            )
        if isinstance(obj, np.generic):
            array = np.asarray(obj)
            return add(
                obj,
                lambda: TensorSource(
                    "numpy_scalar", array.dtype.newbyteorder("<").str, (), _numpy_bytes(array), path
                ),
            )
        if isinstance(obj, dict):
            items = []
            for key, value in obj.items():
                if isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise FormatError(f"dict key {key!r} at {path or '/'} must be a str or int")
                items.append([key, walk(value, f"{path}.{key}" if path else str(key))])
            return {"~": "dict", "items": items}
        if isinstance(obj, (list, tuple)):
            tag = "tuple" if isinstance(obj, tuple) else "list"
            return {
                "~": tag,
                "items": [walk(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(obj)],
            }
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            # A config dataclass: its fields, stored as a dict that names the type; it loads as
            # that dict (cas never imports a class a store names).
            kind = type(obj)
            fields = [
                [f.name, walk(getattr(obj, f.name), f"{path}.{f.name}" if path else f.name)]
                for f in dataclasses.fields(obj)
            ]
            return {"~": "dict", "items": fields, "type": f"{kind.__module__}.{kind.__qualname__}"}
        if isinstance(obj, torch.dtype):
            return {"~": "dtype", "v": torch_dtype_name(obj)}
        if isinstance(obj, torch.device):
            return {"~": "device", "v": str(obj)}
        raise FormatError(
            f"cannot store a {type(obj).__name__} at {path or '/'}: cas stores tensors, arrays, "
            "numbers, strings, bytes, bools, None, dicts, lists and tuples (it never pickles)"
        )

    tree = walk(state, "")
    return tree, sources


def alias_key(obj: Any) -> tuple[Any, ...] | None:
    """What makes two tensor objects one tensor: the same elements of the same storage.

    ``state_dict()`` returns a new tensor object per name, so tied weights (an embedding and
    ``lm_head.weight``) are two objects over one storage; they are stored once and load as one
    tensor, as ``torch.load`` keeps them sharing memory. Empty tensors are never aliases.
    """
    import torch

    if not isinstance(obj, torch.Tensor) or obj.numel() == 0 or obj.layout != torch.strided:
        return None
    return (
        obj.device,
        obj.untyped_storage().data_ptr(),
        obj.storage_offset(),
        obj.dtype,
        tuple(obj.shape),
        obj.stride(),
        obj.is_conj(),
        obj.is_neg(),
    )


def iter_tensor_paths(tree: Any, path: str = "") -> Iterator[tuple[str, int]]:
    """Yield ``(path, tensor_index)`` for every tensor leaf of an encoded tree."""
    if isinstance(tree, dict):
        tag = tree.get("~")
        if tag == "tensor":
            yield path, int(tree["i"])
        elif tag == "sparse":
            for name, part in tree["parts"]:
                yield from iter_tensor_paths(part, f"{path}.{name}" if path else str(name))
        elif tag == "dict":
            for key, value in tree["items"]:
                yield from iter_tensor_paths(value, f"{path}.{key}" if path else str(key))
        elif tag in ("list", "tuple"):
            for i, value in enumerate(tree["items"]):
                yield from iter_tensor_paths(value, f"{path}.{i}" if path else str(i))


def tensor_casts(tree: Any) -> dict[int, str]:
    """Tensor index -> the dtype a load gives back, for tensors a precision policy stored in
    another dtype (their node's ``"as"``)."""
    out: dict[int, str] = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        tag = node.get("~")
        if tag == "tensor" and "as" in node:
            out[int(node["i"])] = str(node["as"])
        elif tag == "dict":
            stack.extend(value for _, value in node["items"])
        elif tag in ("list", "tuple"):
            stack.extend(node["items"])
    return out


def selected_tensors(tree: Any, select: Callable[[str], bool] | None) -> list[int]:
    """Tensor indices a load with ``select`` reads, in tree order, each once: a sparse tensor's
    components all, if any of them (or the sparse tensor's own path) is selected."""
    out: dict[int, None] = {}

    def walk(node: Any, path: str) -> None:
        if not isinstance(node, dict):
            return
        tag = node.get("~")
        if tag == "tensor":
            if select is None or select(path):
                out.setdefault(int(node["i"]))
        elif tag == "sparse":
            if select is None or sparse_selected(node, path, select):
                for _, part in node["parts"]:
                    out.setdefault(int(part["i"]))
        elif tag in ("dict", "list", "tuple"):
            pairs = node["items"] if tag == "dict" else enumerate(node["items"])
            for key, value in pairs:
                walk(value, f"{path}.{key}" if path else str(key))

    walk(tree, "")
    return list(out)


def decode_state(
    tree: Any,
    tensor: Callable[[int], Any],
    select: Callable[[str], bool] | None = None,
    *,
    restore_dtypes: bool = True,
) -> Any:
    """Rebuild a state from a tree; ``tensor(i)`` materialises table entry ``i``.

    A tensor a precision policy stored in another dtype is cast back to its own, unless
    ``restore_dtypes=False`` (a view of the stored bytes, as the ``cas://`` ``.pt`` files are).

    With ``select``, only leaves whose path it accepts are kept: dicts drop the rest, lists and
    tuples keep their length with ``None`` in unselected places, and empty containers vanish.
    """
    missing = object()

    def walk(node: Any, path: str) -> Any:
        if not isinstance(node, dict):
            if select is not None and not select(path):
                return missing
            return node
        tag = node.get("~")
        if tag == "tensor":
            if select is not None and not select(path):
                return missing
            value = tensor(int(node["i"]))
            # Stored in another dtype by a precision policy (``cas.model.precision``).
            if "as" not in node or not restore_dtypes:
                return value
            return value.to(torch_dtype(str(node["as"])))
        if tag == "sparse":
            if select is not None and not sparse_selected(node, path, select):
                return missing
            parts = [tensor(int(part["i"])) for _, part in node["parts"]]
            size = tuple(int(n) for n in node["size"])
            return build_sparse(str(node["layout"]), parts, size, bool(node.get("coalesced")))
        if tag == "dict":
            out: dict[Any, Any] = {}
            for key, value in node["items"]:
                if isinstance(key, (bytes, float, bool)):
                    raise FormatError(f"corrupt manifest: bad dict key at {path}")
                item = walk(value, f"{path}.{key}" if path else str(key))
                if item is not missing:
                    out[key] = item
            if select is not None and not out and not (not node["items"] and select(path)):
                return missing  # nothing selected inside (an empty dict only if named itself)
            return out
        if tag in ("list", "tuple"):
            items = [
                walk(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(node["items"])
            ]
            if (
                select is not None
                and all(i is missing for i in items)
                and (items or not select(path))
            ):
                return missing  # nothing selected inside (an empty list only if named itself)
            values = [None if i is missing else i for i in items]
            return tuple(values) if tag == "tuple" else values
        if select is not None and not select(path):
            return missing
        if tag == "int":
            return _big_int(node.get("v"), path)
        if tag == "dtype":
            return torch_dtype(str(node["v"]))
        if tag == "device":
            return _device(node.get("v"), path)
        raise FormatError(f"corrupt manifest: unknown node tag {str(tag)[:64]!r} at {path or '/'}")

    result = walk(tree, "")
    return {} if result is missing else result


def sparse_selected(node: Any, path: str, select: Callable[[str], bool]) -> bool:
    """A sparse tensor is one value: selected whole if its path or any component's path is."""
    return select(path) or any(
        select(f"{path}.{name}" if path else str(name)) for name, _ in node["parts"]
    )


def _big_int(text: Any, path: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError) as e:  # ValueError: past the interpreter's digit limit
        raise FormatError(f"corrupt manifest: bad int at {path or '/'}: {e}") from e


def _device(name: Any, path: str) -> torch.device:
    import torch

    try:
        return torch.device(str(name))
    except RuntimeError as e:  # a device type this torch does not know
        raise FormatError(f"unknown device {str(name)[:64]!r} at {path or '/'}: {e}") from e


def tensor_from_bytes(kind: str, dtype: str, shape: tuple[int, ...], buffer: torch.Tensor) -> Any:
    """Build the user-facing object from a flat uint8 CPU tensor holding its bytes.

    A dtype or shape these bytes cannot hold (a damaged or hostile manifest) is a FormatError.
    """
    try:
        return _tensor_from_bytes(kind, dtype, shape, buffer)
    except (RuntimeError, ValueError, TypeError) as e:
        raise FormatError(
            f"corrupt manifest: {len(buffer)} bytes are no {kind} {dtype} of shape {list(shape)}: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from e


def _tensor_from_bytes(kind: str, dtype: str, shape: tuple[int, ...], buffer: torch.Tensor) -> Any:
    import numpy as np
    import torch

    if kind == "torch":
        target = torch_dtype(dtype)
        if target == torch.uint8:
            return buffer.reshape(shape)
        return buffer.view(target).reshape(shape)
    try:
        np_dtype = np.dtype(dtype)
    except TypeError as e:
        raise FormatError(f"unknown numpy dtype {dtype!r}") from e
    if np_dtype.hasobject:
        raise FormatError(f"refusing numpy dtype {dtype!r} (objects)")
    array = buffer.numpy().view(np_dtype).reshape(shape)
    if not np_dtype.isnative:  # stored little-endian; a big-endian host gets its own order
        array = array.astype(np_dtype.newbyteorder("="))
    return array[()] if kind == "numpy_scalar" else array


def byte_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised flat uint8 CPU tensor of ``nbytes``, for reads to fill.

    Plain allocator memory in base pages, as ``torch.load`` gets. Advising it for transparent
    huge pages (tried, and kept for a while) made the first load of a process twice as slow on
    this project's VM, whose host takes back the guest's free memory. Zeroing fresh huge pages
    was half of such a load's CPU, and the 1 GiB state's first load after its save took
    1.19-1.23 s against 0.56-0.65 s in base pages (docs/design.md). In the benchmark's warm
    rounds, which reuse memory just freed, huge pages were faster (0.23-0.27 s against
    0.33-0.41 s). But a resume is a process's first load.
    """
    import torch

    return torch.empty(nbytes, dtype=torch.uint8)


def buffer_over(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """A flat uint8 CPU tensor over ``data`` without a copy (it keeps ``data`` alive)."""
    import torch

    if not len(data):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(data, dtype=torch.uint8)


def target_tensors(target: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(dotted path, tensor)`` for every tensor in a state of dicts, lists and tuples, named as
    ``save`` names them."""
    import torch

    if isinstance(target, torch.Tensor):
        yield path, target
    elif isinstance(target, dict):
        for key, value in target.items():
            yield from target_tensors(value, f"{path}.{key}" if path else str(key))
    elif isinstance(target, (list, tuple)):
        for index, value in enumerate(target):
            yield from target_tensors(value, f"{path}.{index}" if path else str(index))


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor over the same bytes."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def writable_view(buffer: torch.Tensor) -> memoryview:
    """A writable memoryview over a flat uint8 CPU tensor (from ``byte_buffer``)."""
    return memoryview(buffer.numpy())  # type: ignore[arg-type]


def placed(value: Any, map_location: Any) -> Any:
    """``value`` moved to ``map_location`` if it is a tensor and a location is given."""
    if map_location is None:
        return value
    import torch

    return value.to(map_location) if isinstance(value, torch.Tensor) else value
