"""The globals a weights-only torch pickle may name, and what each one is to the pickle scanner.

The list is the one torch's own weights-only unpickler allows by default (tensor rebuild
functions, storage and legacy tensor types, dtypes, quantization schemes, ``torch.Size``,
``torch.device``, ``collections.OrderedDict`` and ``Counter``, ``_codecs.encode`` for bytes,
``builtins.set``/``bytearray``/``complex``), plus numpy's array and dtype reconstructors, which
``transformers`` allows for ``rng_state.pth``. No entry is ever imported or called: the scanner
models what each does (``Role``). The opcode tables the scanner interprets by are here too.
"""

from __future__ import annotations

import enum


class Role(enum.Enum):
    """What an allowed global is to the scanner."""

    TENSOR_V1 = "torch._utils._rebuild_tensor"
    TENSOR_V2 = "torch._utils._rebuild_tensor_v2"
    TENSOR_V3 = "torch._utils._rebuild_tensor_v3"
    PARAMETER = "parameter"  # _rebuild_parameter(_with_state), nn.Parameter(data, ...)
    FROM_TYPE = "torch._tensor._rebuild_from_type_v2"
    OPAQUE_TENSOR = "opaque tensor"  # sparse, quantized, nested, meta... and legacy tensor types
    TENSOR_CLASS = "torch.Tensor"
    SIZE = "torch.Size"
    DICT_CLASS = "dict class"  # collections.OrderedDict, collections.Counter
    ENCODE = "_codecs.encode"
    SET = "builtins.set"
    OPAQUE_VALUE = "opaque value"  # torch.device, layouts, bytearray, complex
    NUMPY = "numpy reconstructor"  # its results take BUILD
    STORAGE_TYPE = "storage type"  # only inside a storage persistent id
    VALUE = "value"  # dtypes, quantization schemes, numpy.ndarray: never called


FUNCTION_ROLES = frozenset(
    {Role.TENSOR_V1, Role.TENSOR_V2, Role.TENSOR_V3, Role.FROM_TYPE, Role.ENCODE}
)
"""Roles of functions, which ``NEWOBJ`` (a class's ``__new__``) cannot apply to."""

DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1, "complex128": 16, "complex64": 8, "complex32": 4,
    "qint8": 1, "qint32": 4, "quint8": 1, "quint4x2": 1, "quint2x4": 1,
    "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
    **{f"{sign}int{bits}": 1 for sign in ("", "u") for bits in range(1, 8)},
}  # fmt: skip
"""Bytes per element of every torch dtype a weights-only file may name."""

PLAIN_DTYPES = frozenset(list(DTYPE_ITEMSIZE)[:22])
"""The dtypes a manifest stores (``float64`` to ``complex32``); quantized and bit types are not."""

STORAGE_DTYPES = {
    "Double": "float64", "Float": "float32", "Half": "float16", "BFloat16": "bfloat16",
    "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
    "Bool": "bool", "ComplexDouble": "complex128", "ComplexFloat": "complex64",
    "QInt8": "qint8", "QInt32": "qint32", "QUInt8": "quint8", "QUInt4x2": "quint4x2",
    "QUInt2x4": "quint2x4",
}  # fmt: skip
"""Element dtype of each legacy ``torch.<Kind>Storage`` type (``UntypedStorage`` holds bytes)."""

MODULE_ALIASES = {"__builtin__": "builtins", "torch.tensor": "torch._tensor"}
"""Module paths that protocol-2 pickles and older torch versions write for allowed globals."""

_TENSOR_KINDS = [
    "BFloat16",
    "Bool",
    "Byte",
    "Char",
    "Double",
    "Float",
    "Half",
    "Int",
    "Long",
    "Short",
]
_OPAQUE_REBUILDS = [
    "_rebuild_qtensor", "_rebuild_sparse_tensor", "_rebuild_meta_tensor_no_storage",
    "_rebuild_nested_tensor", "_rebuild_wrapper_subclass", "_rebuild_device_tensor_from_numpy",
    "_rebuild_device_tensor_from_cpu_tensor",
]  # fmt: skip
_NUMPY_DTYPE_CLASSES = [
    "Bool", "Int8", "Int16", "Int32", "Int64", "LongLong", "UInt8", "UInt16", "UInt32", "UInt64",
    "ULongLong", "Float16", "Float32", "Float64", "Complex64", "Complex128",
]  # fmt: skip
_QSCHEMES = [
    "per_tensor_affine", "per_tensor_symmetric", "per_channel_affine", "per_channel_symmetric",
    "per_channel_affine_float_qparams",
]  # fmt: skip


def _allowed_globals() -> dict[str, Role]:
    allowed = {
        "torch._utils._rebuild_tensor": Role.TENSOR_V1,
        "torch._utils._rebuild_tensor_v2": Role.TENSOR_V2,
        "torch._utils._rebuild_tensor_v3": Role.TENSOR_V3,
        "torch._utils._rebuild_parameter": Role.PARAMETER,
        "torch._utils._rebuild_parameter_with_state": Role.PARAMETER,
        "torch.nn.parameter.Parameter": Role.PARAMETER,
        "torch._tensor._rebuild_from_type_v2": Role.FROM_TYPE,
        "torch.Tensor": Role.TENSOR_CLASS,
        "torch.Size": Role.SIZE,
        "torch.device": Role.OPAQUE_VALUE,
        "torch.serialization._get_layout": Role.OPAQUE_VALUE,
        "collections.OrderedDict": Role.DICT_CLASS,
        "collections.Counter": Role.DICT_CLASS,
        "_codecs.encode": Role.ENCODE,
        "builtins.set": Role.SET,
        "builtins.bytearray": Role.OPAQUE_VALUE,
        "builtins.complex": Role.OPAQUE_VALUE,
        "torch.storage.UntypedStorage": Role.STORAGE_TYPE,
        "torch.storage.TypedStorage": Role.VALUE,
        "numpy.core.multiarray._reconstruct": Role.NUMPY,  # numpy 1.x's path
        "numpy._core.multiarray._reconstruct": Role.NUMPY,
        "numpy.dtype": Role.NUMPY,
        "numpy.ndarray": Role.VALUE,
    }
    allowed |= {f"torch._utils.{name}": Role.OPAQUE_TENSOR for name in _OPAQUE_REBUILDS}
    allowed |= {f"torch.{dtype}": Role.VALUE for dtype in DTYPE_ITEMSIZE}
    allowed |= {f"torch.{scheme}": Role.VALUE for scheme in _QSCHEMES}
    allowed |= {f"numpy.dtypes.{name}DType": Role.NUMPY for name in _NUMPY_DTYPE_CLASSES}
    for module in ("torch", "torch.cuda"):
        kinds = [k for k in STORAGE_DTYPES if module == "torch" or not k.startswith("Q")]
        allowed |= {f"{module}.{kind}Storage": Role.STORAGE_TYPE for kind in kinds}
        allowed |= {f"{module}.{kind}Tensor": Role.OPAQUE_TENSOR for kind in _TENSOR_KINDS}
    for module in ("torch.sparse", "torch.cuda.sparse"):
        sparse_kinds = [kind for kind in _TENSOR_KINDS if kind != "Bool"]
        allowed |= {f"{module}.{kind}Tensor": Role.OPAQUE_TENSOR for kind in sparse_kinds}
    return allowed


ALLOWED_GLOBALS: dict[str, Role] = _allowed_globals()
"""Every global a weights-only pickle may name, by full ``module.name``, and its role."""

CONSTANT_OPCODES = frozenset(
    {
        "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
        "STRING", "BINSTRING", "SHORT_BINSTRING", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
        "BYTEARRAY8", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8",
        "FLOAT", "BINFLOAT",
    }
)  # fmt: skip
"""Opcodes that push a constant (numbers, text, bytes)."""

GETATTR = "builtins.getattr"
"""How protocols 2 and 3 write a nested class: a ``REDUCE`` of this on (parent, name)."""

NAMING_OPCODES = frozenset(
    {
        "GLOBAL", "STACK_GLOBAL", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE",
        "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE", "GET", "BINGET", "LONG_BINGET",
        "MARK", "TUPLE", "TUPLE1", "TUPLE2", "REDUCE", "FRAME",
    }
)  # fmt: skip
"""Opcodes that may follow a refused global while a nested name is spelled out."""
