"""What a decoded manifest may hold: bounds on shapes, dtypes, tree nodes and metadata.

Every check here runs on untrusted bytes (a store someone else wrote, or one damaged on disk) and
raises FormatError, so that a reader meets one error type whatever a manifest claims (invariant
7). The bounds are far above what any writer produces; they exist so that a reader's work and
memory stay proportional to the manifest's size, and its recursion to a fixed depth.
"""

from __future__ import annotations

import math
import re
from typing import Any

from cas.errors import FormatError

MAX_DIMS = 64
MAX_ELEMENT_BYTES = 1 << 62
"""Bytes a tensor's shape may span, zero-sized dimensions counted as one: what torch and numpy
can index without overflowing 64-bit sizes and strides."""
MAX_CHUNK_BYTES = 1 << 30
"""A chunk larger than this can never be read (stores refuse objects above 64 MiB + 4 KiB)."""
MAX_TREE_DEPTH = 100
"""Containers a state tree may nest (a model's state dict nests fewer than ten)."""
MAX_META_DEPTH = 64
MAX_INT_DIGITS = 4300
"""Digits of an int outside the 64-bit range: Python's own default conversion limit."""
MAX_NAME_LENGTH = 4096
"""Characters of a dtype, device, tag, file format or region name."""

SPARSE_PARTS: dict[str, tuple[str, ...]] = {
    "coo": ("indices", "values"),
    "csr": ("crow_indices", "col_indices", "values"),
}
"""Each sparse layout cas stores, with its component tensors in order (torch's accessor names)."""
TREE_TAGS = ("dict", "list", "tuple", "tensor", "sparse", "int", "dtype", "device")
SCALARS = (type(None), bool, int, float, str, bytes)

_INT_TEXT = re.compile(rf"-?[0-9]{{1,{MAX_INT_DIGITS}}}\Z")
_DEVICE = re.compile(r"[a-z][a-z0-9_]{0,63}(:[0-9]{1,6})?\Z")
_NUMPY_DTYPE = re.compile(r"[<>|=]?([biufcSUVmM])([0-9]{1,6})(\[[0-9]{0,6}[A-Za-z]{1,3}\])?\Z")


def expect(cond: bool, what: str) -> None:
    """FormatError("corrupt manifest: <what>") unless ``cond``."""
    if not cond:
        raise FormatError(f"corrupt manifest: {what}")


def is_int(value: Any) -> bool:
    """An int that is not a bool (msgpack keeps them apart; Python does not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_size(value: Any, limit: int) -> bool:
    """An int in ``[0, limit]``."""
    return is_int(value) and 0 <= value <= limit


def is_name(value: Any) -> bool:
    """A non-empty str of bounded length."""
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME_LENGTH


def shape_bytes(shape: Any, itemsize: int) -> int:
    """The bytes ``shape`` of ``itemsize``-byte elements spans; FormatError for a bad shape."""
    expect(isinstance(shape, list) and len(shape) <= MAX_DIMS, "bad shape")
    expect(all(is_size(d, MAX_ELEMENT_BYTES) for d in shape), "bad shape")
    # Zero-sized dimensions make the tensor empty, but torch and numpy still compute strides from
    # the others: bound them as if the zeros were ones.
    expect(
        math.prod(max(d, 1) for d in shape) * max(itemsize, 1) <= MAX_ELEMENT_BYTES,
        f"shape {shape[:8]} is too large",
    )
    nbytes: int = math.prod(shape) * itemsize
    return nbytes


def numpy_itemsize(dtype: str) -> int:
    """Element bytes of a numpy ``dtype.str`` (``<f4``, ``|b1``, ``<U3``, ``<M8[ns]``)."""
    match = _NUMPY_DTYPE.match(dtype)
    expect(match is not None, f"unknown numpy dtype {dtype[:64]!r}")
    assert match is not None
    kind, count = match.group(1), int(match.group(2))
    expect(count > 0, f"numpy dtype {dtype!r} has no size")
    expect(kind in "mM" or match.group(3) is None, f"bad numpy dtype {dtype!r}")
    return 4 * count if kind == "U" else count


def check_tree(tree: Any, tensor_count: int, itemsizes: dict[str, int]) -> None:
    """Validate a state tree: known tags, well-formed items, tensor indices in range, bounded
    depth, ints, dtypes and devices that parse. Iterative, so depth costs no Python stack."""
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, SCALARS):
            continue
        expect(isinstance(node, dict), f"untagged {type(node).__name__} in the tree")
        tag = node.get("~")
        expect(tag in TREE_TAGS, f"unknown node tag {str(tag)[:64]!r}")
        if tag in ("dict", "list", "tuple"):
            expect(depth < MAX_TREE_DEPTH, f"tree nests deeper than {MAX_TREE_DEPTH}")
            items = node.get("items")
            expect(isinstance(items, list), f"{tag} items are not a list")
            if tag == "dict":
                expect(node.get("type") is None or is_name(node.get("type")), "bad dict type")
                for item in items:
                    expect(isinstance(item, list) and len(item) == 2, "dict item is not a pair")
                    key = item[0]
                    expect(isinstance(key, str) or is_int(key), "dict key is not a str or int")
                    stack.append((item[1], depth + 1))
            else:
                stack.extend((value, depth + 1) for value in items)
            continue
        if tag == "sparse":
            _check_sparse(node, tensor_count)
            continue
        value = node.get("i" if tag == "tensor" else "v")
        if tag == "tensor":
            expect(is_int(value) and 0 <= value < tensor_count, "tensor index out of range")
            restore = node.get("as", "float32")
            expect(restore in ("float64", "float32", "float16", "bfloat16"), "bad tensor 'as'")
        elif tag == "int":
            expect(isinstance(value, str) and _INT_TEXT.match(value) is not None, "bad big int")
        elif tag == "dtype":
            expect(
                isinstance(value, str) and value in itemsizes, f"unknown dtype {str(value)[:64]!r}"
            )
        else:
            expect(isinstance(value, str) and _DEVICE.match(value) is not None, "bad device")


def _check_sparse(node: dict[Any, Any], tensor_count: int) -> None:
    """A sparse node: a known layout, a bounded size, and its components by name, in order."""
    layout: Any = node.get("layout")
    names = SPARSE_PARTS.get(layout) if isinstance(layout, str) else None
    if names is None:
        raise FormatError(f"corrupt manifest: unknown sparse layout {str(layout)[:64]!r}")
    size: Any = node.get("size")
    expect(isinstance(size, list) and len(size) <= MAX_DIMS, "bad sparse size")
    expect(all(is_int(n) and 0 <= n < MAX_ELEMENT_BYTES for n in size), "bad sparse size")
    expect(isinstance(node.get("coalesced", False), bool), "bad sparse coalesced flag")
    parts: Any = node.get("parts")
    expect(isinstance(parts, list) and len(parts) == len(names), "bad sparse parts")
    for name, part in zip(names, parts, strict=True):
        expect(isinstance(part, list) and len(part) == 2 and part[0] == name, "bad sparse part")
        tensor = part[1]
        expect(isinstance(tensor, dict) and tensor.get("~") == "tensor", "sparse part no tensor")
        index = tensor.get("i")
        expect(is_int(index) and 0 <= index < tensor_count, "tensor index out of range")


def check_stored_meta(meta: Any) -> None:
    """Validate decoded metadata: a map of JSON-like values with str or int keys, bounded depth."""
    expect(isinstance(meta, dict), "meta is not a map")
    stack: list[tuple[Any, int]] = [(meta, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, SCALARS):
            continue
        expect(depth < MAX_META_DEPTH, f"meta nests deeper than {MAX_META_DEPTH}")
        if isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, dict):
            for key, v in value.items():
                expect(isinstance(key, str) or is_int(key), "meta key is not a str or int")
                stack.append((v, depth + 1))
        else:
            expect(False, f"meta holds a {type(value).__name__}")
