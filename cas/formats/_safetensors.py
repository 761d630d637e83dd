"""Reading the layout of a .safetensors file from its header, without loading any tensor."""

from __future__ import annotations

import json
from typing import Any, BinaryIO

from cas.errors import FormatError
from cas.formats.layout import FileLayout, TensorRegion, first_overlap, sorted_regions

HEADER_LEN_CAP = 100 * 1024 * 1024
"""The largest JSON header accepted; the safetensors library itself refuses more than 100 MB."""

# safetensors dtype -> (torch dtype name, bits per element). F6 types have no torch dtype, so
# their regions are described as raw bytes.
_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 64),
    "F32": ("float32", 32),
    "F16": ("float16", 16),
    "BF16": ("bfloat16", 16),
    "I64": ("int64", 64),
    "I32": ("int32", 32),
    "I16": ("int16", 16),
    "I8": ("int8", 8),
    "U64": ("uint64", 64),
    "U32": ("uint32", 32),
    "U16": ("uint16", 16),
    "U8": ("uint8", 8),
    "BOOL": ("bool", 8),
    "C64": ("complex64", 64),
    "F8_E4M3": ("float8_e4m3fn", 8),
    "F8_E5M2": ("float8_e5m2", 8),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 8),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 8),
    "F8_E8M0": ("float8_e8m0fnu", 8),
    "F4": ("float4_e2m1fn_x2", 4),
    "F6_E2M3": ("uint8", 6),
    "F6_E3M2": ("uint8", 6),
}


def looks_like_safetensors(head: bytes, size: int) -> bool:
    """True if the first bytes are a plausible header length followed by a JSON object.

    Text files never match (the length's high bytes would be NUL), so content sniffing is safe
    for files that are not named ``.safetensors``.
    """
    if len(head) < 9 or head[8:9] != b"{":
        return False
    header_len = int.from_bytes(head[:8], "little")
    return 2 <= header_len <= HEADER_LEN_CAP and 8 + header_len <= size


def inspect_safetensors(name: str, stream: BinaryIO, size: int) -> FileLayout:
    """Parse and validate the header; raise ``FormatError`` naming ``name`` on any defect."""
    if size < 8:
        raise FormatError(f"{name}: truncated safetensors file ({size} bytes)")
    stream.seek(0)
    header_len = int.from_bytes(stream.read(8), "little")
    if header_len > HEADER_LEN_CAP:
        raise FormatError(f"{name}: safetensors header length {header_len} exceeds the 100 MiB cap")
    data_start = 8 + header_len
    if data_start > size:
        raise FormatError(f"{name}: truncated safetensors file: header needs {data_start} bytes")
    raw = stream.read(header_len)
    if len(raw) != header_len:
        raise FormatError(f"{name}: file shrank while reading the safetensors header")
    header = _parse_header(name, raw)

    metadata = _parse_metadata(name, header.pop("__metadata__", None))
    regions = sorted_regions(
        [_region(name, key, entry, data_start, size) for key, entry in header.items()]
    )
    overlap = first_overlap(regions)
    if overlap is not None:
        raise FormatError(
            f"{name}: safetensors tensors {overlap[0].name!r} and {overlap[1].name!r} overlap"
        )
    return FileLayout(format="safetensors", size=size, regions=regions, metadata=metadata)


def _parse_header(name: str, raw: bytes) -> dict[str, Any]:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise FormatError(f"{name}: safetensors header repeats key {key!r}")
            result[key] = value
        return result

    try:
        # The format allows trailing spaces as padding after the JSON object.
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise FormatError(f"{name}: safetensors header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise FormatError(f"{name}: safetensors header is not a JSON object")
    return header


def _parse_metadata(name: str, raw: object) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise FormatError(f"{name}: safetensors __metadata__ must map strings to strings")
    return dict(raw)


def _region(name: str, key: str, entry: object, data_start: int, size: int) -> TensorRegion:
    if not isinstance(entry, dict):
        raise FormatError(f"{name}: safetensors entry {key!r} is not an object")
    st_dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(st_dtype, str) or st_dtype not in _DTYPES:
        raise FormatError(f"{name}: tensor {key!r} has unknown safetensors dtype {st_dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise FormatError(f"{name}: tensor {key!r} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise FormatError(f"{name}: tensor {key!r} has invalid data_offsets {offsets!r}")
    begin, end = data_start + offsets[0], data_start + offsets[1]
    if end > size:
        raise FormatError(
            f"{name}: tensor {key!r} ends at byte {end}, past the end of the file ({size} bytes)"
        )

    dtype, bits = _DTYPES[st_dtype]
    numel = 1
    for dim in shape:
        numel *= dim
    if numel * bits % 8 != 0 or numel * bits // 8 != end - begin:
        raise FormatError(
            f"{name}: tensor {key!r} ({st_dtype} {shape}) needs {numel * bits / 8:g} bytes, "
            f"data_offsets give {end - begin}"
        )
    torch_shape = tuple(shape)
    if st_dtype == "F4":
        # safetensors counts 4-bit elements; torch packs two per float4_e2m1fn_x2 element.
        if not shape or shape[-1] % 2:
            raise FormatError(f"{name}: F4 tensor {key!r} needs an even last dimension")
        torch_shape = (*shape[:-1], shape[-1] // 2)
    elif dtype == "uint8" and st_dtype != "U8":
        torch_shape = (end - begin,)
    return TensorRegion(name=key, dtype=dtype, shape=torch_shape, offset=begin, nbytes=end - begin)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
