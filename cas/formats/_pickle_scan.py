"""Reading a torch checkpoint's pickle without running it: its opcodes checked against an allowlist.

``torch.load(weights_only=True)`` is an unpickler: it imports and calls what a file names once
the name passes its allowlist, and that checking has had holes (CVE-2025-32434 ran code through
it). Here nothing a pickle names is imported or called. ``scan_pickle`` reads the opcodes with
``pickletools.genops`` and interprets them on a model of the unpickler's stack and memo:

- constants, lists, tuples, dicts and sets become plain Python values;
- ``GLOBAL`` / ``STACK_GLOBAL`` must name an entry of ``ALLOWED_GLOBALS`` (the globals torch's
  weights-only unpickler allows: tensor rebuild functions, storage types, dtypes,
  ``collections.OrderedDict``, ``torch.Size``, ``torch.device``..., plus numpy's array and dtype
  reconstructors for ``rng_state.pth``); anything else is refused, naming ``module.name``. The
  refusal waits while the opcodes that follow only spell a name: protocol 2 writes a nested class
  ``mod.Outer.Inner`` as ``builtins.getattr(mod.Outer, "Inner")``, and the message names the
  class, not ``builtins.getattr``;
- ``REDUCE`` / ``NEWOBJ`` of an allowed global is interpreted by this module, never called: a
  tensor rebuild becomes a ``TensorRef`` (storage, offset, shape, stride, dtype), a storage
  persistent id (``BINPERSID``) a ``StorageRef``, other allowed objects an ``Opaque`` marker;
- ``BUILD`` is allowed only on ``OrderedDict`` and numpy objects; ``INST``, ``OBJ``, ``EXT*``,
  text ``PERSID`` and out-of-band buffers are refused outright.

The result is the object tree the file describes, which ``named_tensors``
(``cas.formats._pickle_names``) walks to name tensors by their dotted paths. With
``foreign_objects=True`` (for a file the caller has agreed never to load) a global outside the
allowlist is not refused: it and whatever it builds become ``Opaque`` markers, so the tensors
around an ``argparse.Namespace`` or a config object are still named.
Work and memory stay linear in the pickle's size: bulk copies and hashing draw on a budget
proportional to it, and hashable keys are bounded in depth.
"""

from __future__ import annotations

import pickletools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from cas.formats._pickle_allow import (
    ALLOWED_GLOBALS,
    CONSTANT_OPCODES,
    DTYPE_ITEMSIZE,
    FUNCTION_ROLES,
    GETATTR,
    MODULE_ALIASES,
    NAMING_OPCODES,
    STORAGE_DTYPES,
    Role,
)


class UnsafePickle(Exception):
    """The pickle names or does something a weights-only state never needs."""


class BrokenPickle(Exception):
    """The bytes are not a well-formed pickle (truncated, garbage, inconsistent stack)."""


MAX_KEY_DEPTH = 32
"""Deepest tuple accepted as a dict key or set member (hashing recurses in C)."""


@dataclass(frozen=True)
class StorageRef:
    """A storage a persistent id names: its key in the archive, element dtype and length."""

    key: str
    dtype: str
    numel: int

    @property
    def nbytes(self) -> int:
        """Bytes the storage's record holds."""
        return self.numel * DTYPE_ITEMSIZE[self.dtype]


@dataclass(frozen=True, eq=False)
class TensorRef:
    """A strided tensor over a storage, as a tensor rebuild function would make it."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    plain: bool
    """False when a conjugate or negative bit (or any other metadata flag) is set."""

    @property
    def numel(self) -> int:
        """Number of elements."""
        count = 1
        for size in self.shape:
            count *= size
        return count

    def covers_storage(self) -> bool:
        """Whether the tensor's elements, in order, are exactly its storage's bytes."""
        if not self.plain or self.offset != 0:
            return False
        if self.numel * DTYPE_ITEMSIZE[self.dtype] != self.storage.nbytes:
            return False
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return self.numel == 0  # torch calls every empty tensor contiguous
            expected *= size
        return True


@dataclass(frozen=True, eq=False)
class Opaque:
    """An allowed object whose insides do not matter for the layout (a device, an array...)."""

    kind: str
    tensor: bool = False
    buildable: bool = False
    foreign: bool = False
    """Built by a global outside the allowlist (only when foreign objects are modelled)."""


@dataclass(frozen=True, eq=False)
class _Global:
    name: str
    role: Role


@dataclass(frozen=True, eq=False)
class _Refused:
    """A global that is not allowed, held only while the next opcodes may still spell a longer
    name for it (``getattr(mod.Outer, "Inner")``); any other use refuses the pickle."""

    name: str


class _DictObject(dict[Any, Any]):
    """An ``OrderedDict`` or ``Counter``: a dict that ``BUILD`` may give attributes."""


@dataclass(frozen=True)
class ScannedPickle:
    """What a pickle describes: its root object and the storages its persistent ids name."""

    root: object
    storages: dict[str, StorageRef]


def scan_pickle(
    stream: IO[bytes], *, storage_id_fields: int = 5, foreign_objects: bool = False
) -> ScannedPickle:
    """Interpret one pickle up to its STOP without importing or calling anything it names.

    ``storage_id_fields`` is the length of torch's storage persistent ids: 5 in zip files
    (``"storage"``, type, key, location, numel), 6 in legacy files (plus view metadata).
    ``foreign_objects`` models globals outside the allowlist (and what they build) as ``Opaque``
    instead of refusing them; nothing is called either way.
    Raises ``UnsafePickle`` (with the refused ``module.name`` in its message) or ``BrokenPickle``.
    """
    return _Machine(storage_id_fields, foreign_objects).run(stream)


def _printable(text: str, limit: int = 1000) -> str:
    shown = text.encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


class _Machine:
    """The unpickler's stack machine, with every side effect replaced by a model of it."""

    def __init__(self, storage_id_fields: int, foreign_objects: bool = False) -> None:
        self.storage_id_fields = storage_id_fields
        self.foreign_objects = foreign_objects
        self.stack: list[Any] = []
        self.metastack: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.storages: dict[str, StorageRef] = {}
        self.budget = 0
        self.refused: str | None = None
        """The refused global (the longest name spelled so far); the pickle is refused once
        an opcode does something other than spell a name."""

    def run(self, stream: IO[bytes]) -> ScannedPickle:
        try:
            for name, arg, size in _opcodes(stream):
                self.budget += 64 + 8 * size  # work allowed grows with the bytes read
                if self.refused is not None and name not in NAMING_OPCODES:
                    break
                if name == "STOP":
                    return ScannedPickle(self.pop(), self.storages)
                self.step(name, arg)
        except BrokenPickle:
            if self.refused is None:
                raise
        if self.refused is not None:
            raise UnsafePickle(f"global {_printable(self.refused)} is not allowed")
        raise BrokenPickle("pickle ended before its STOP")  # genops raises first; kept for mypy

    def spend(self, amount: int) -> None:
        self.budget -= amount
        if self.budget < 0:
            raise UnsafePickle("it expands far beyond its size (repeated copies of big objects)")

    def push(self, value: Any) -> None:
        self.stack.append(value)

    def pop(self) -> Any:
        if not self.stack:
            raise BrokenPickle("stack underflow")
        return self.stack.pop()

    def top(self) -> Any:
        if not self.stack:
            raise BrokenPickle("stack underflow")
        return self.stack[-1]

    def pop_mark(self) -> list[Any]:
        if not self.metastack:
            raise BrokenPickle("no MARK before a mark-consuming opcode")
        items = self.stack
        self.stack = self.metastack.pop()
        return items

    def step(self, name: str, arg: Any) -> None:
        if name in CONSTANT_OPCODES:
            self.push(arg)
        elif name in ("NONE", "NEWTRUE", "NEWFALSE", "EMPTY_TUPLE"):
            self.push({"NONE": None, "NEWTRUE": True, "NEWFALSE": False, "EMPTY_TUPLE": ()}[name])
        elif name == "EMPTY_LIST":
            self.push([])
        elif name == "EMPTY_DICT":
            self.push({})
        elif name == "EMPTY_SET":
            self.push(set())
        elif name == "MARK":
            self.metastack.append(self.stack)
            self.stack = []
        elif name in ("TUPLE", "LIST"):
            items = self.pop_mark()
            self.push(tuple(items) if name == "TUPLE" else items)
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            count = int(name[-1])
            items = [self.pop() for _ in range(count)][::-1]
            self.push(tuple(items))
        elif name == "FROZENSET":
            items = self.pop_mark()
            self.push(frozenset(self.hashable(i) for i in items))
        elif name in ("APPEND", "APPENDS"):
            items = [self.pop()] if name == "APPEND" else self.pop_mark()
            target = self.top()
            if self._is_foreign(target):
                return  # a foreign object's list items (``__reduce__``'s listitems)
            if type(target) is not list:
                raise UnsafePickle(f"{name} to a {type(target).__name__}, not a list")
            target.extend(items)
        elif name in ("SETITEM", "SETITEMS", "DICT"):
            if name == "SETITEM":
                value, key = self.pop(), self.pop()
                items = [key, value]
            else:
                items = self.pop_mark()
            if len(items) % 2:
                raise BrokenPickle(f"{name} with an odd number of items")
            target = {} if name == "DICT" else self.top()
            if self._is_foreign(target):
                return  # a foreign object's dict items (``__reduce__``'s dictitems)
            if not isinstance(target, dict):
                raise UnsafePickle(f"{name} on a {type(target).__name__}, not a dict")
            for i in range(0, len(items), 2):
                target[self.hashable(items[i])] = items[i + 1]
            if name == "DICT":
                self.push(target)
        elif name == "ADDITEMS":
            items = self.pop_mark()
            target = self.top()
            if type(target) is not set:
                raise UnsafePickle(f"ADDITEMS to a {type(target).__name__}, not a set")
            target.update(self.hashable(i) for i in items)
        elif name == "POP":
            if self.stack:
                self.stack.pop()
            else:
                self.pop_mark()
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            self.push(self.top())
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            self.memo[int(arg)] = self.top()
        elif name == "MEMOIZE":
            self.memo[len(self.memo)] = self.top()
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            if int(arg) not in self.memo:
                raise BrokenPickle(f"memo entry {arg} read before it was written")
            self.push(self.memo[int(arg)])
        elif name in ("PROTO", "FRAME"):
            pass
        elif name == "GLOBAL":
            module, _, attr = str(arg).partition(" ")
            self.push(self.lookup(module, attr))
        elif name == "STACK_GLOBAL":
            attr, module = self.pop(), self.pop()
            if not isinstance(module, str) or not isinstance(attr, str):
                raise BrokenPickle("STACK_GLOBAL of something other than two strings")
            self.push(self.lookup(module, attr))
        elif name == "REDUCE":
            args = self.pop()
            self.push(self.call(self.pop(), args))
        elif name in ("NEWOBJ", "NEWOBJ_EX"):
            if name == "NEWOBJ_EX":
                self.pop()  # keyword arguments: no allowed class takes any that matter here
            args = self.pop()
            self.push(self.call(self.pop(), args, new=True))
        elif name == "BUILD":
            self.build(self.pop(), self.top())
        elif name == "BINPERSID":
            self.push(self.storage(self.pop()))
        elif name in ("INST", "OBJ") and self.foreign_objects:
            self.pop_mark()  # the class (OBJ) and the constructor's arguments
            kind = str(arg) if name == "INST" else "object"
            self.push(Opaque(kind, buildable=True, foreign=True))
        elif name in ("INST", "OBJ"):
            what = _printable(str(arg).replace(" ", ".")) if name == "INST" else "a class"
            raise UnsafePickle(f"opcode {name} ({what}) creates objects; torch.save never uses it")
        else:  # EXT1/2/4, PERSID, NEXT_BUFFER, READONLY_BUFFER
            raise UnsafePickle(f"opcode {name} is not used by weights-only checkpoints")

    def hashable(self, key: Any) -> Any:
        """``key`` if it can be a dict key without recursing deeply or unboundedly in C."""
        pending = [(key, 0)]
        while pending:
            item, depth = pending.pop()
            self.spend(1)
            if isinstance(item, (tuple, frozenset)):
                if depth >= MAX_KEY_DEPTH:
                    raise UnsafePickle(f"a dict key nested deeper than {MAX_KEY_DEPTH} levels")
                pending.extend((i, depth + 1) for i in item)
            elif isinstance(item, (list, dict, set, bytearray)):
                raise BrokenPickle(f"unhashable {type(item).__name__} used as a dict key")
            elif isinstance(item, int) and item.bit_length() > 64:
                # Python hashes big integers modulo 2**61 - 1: a pickle could make every key
                # collide and the dict quadratic. Real keys are small indices.
                raise UnsafePickle(f"a dict key integer of {item.bit_length()} bits")
        return key

    def lookup(self, module: str, attr: str) -> _Global | _Refused:
        """The allowed global ``module.attr``, or a ``_Refused`` one (``run`` refuses the pickle
        as soon as it is used for anything but spelling a nested name)."""
        module = MODULE_ALIASES.get(module, module)
        name = f"{module}.{attr}"
        role = ALLOWED_GLOBALS.get(name)
        if role is not None:
            return _Global(name, role)
        if self.foreign_objects:
            return _Refused(name)  # an opaque marker once it is used (``call``)
        if self.refused is None or self.refused == GETATTR:
            self.refused = name
        return _Refused(name)

    def call(self, func: Any, args: Any, *, new: bool = False) -> Any:
        """The model of ``func(*args)`` (``REDUCE``) or ``func.__new__(func, *args)``."""
        if self.foreign_objects and (isinstance(func, _Refused) or self._is_foreign(func)):
            self.spend(len(args) if isinstance(args, tuple) else 1)
            kind = func.name if isinstance(func, _Refused) else func.kind
            return Opaque(kind, buildable=True, foreign=True)
        if isinstance(func, _Refused):
            return self.refused_call(func, args)
        opcode = "NEWOBJ" if new else "REDUCE"
        if not isinstance(func, _Global):
            raise UnsafePickle(f"{opcode} on a {type(func).__name__}, not an allowed global")
        if new and func.role in FUNCTION_ROLES:
            raise UnsafePickle(f"NEWOBJ on {func.name}, which is a function, not a class")
        if not isinstance(args, tuple):
            raise BrokenPickle(f"arguments to {func.name} are not a tuple")
        self.spend(len(args))
        role = func.role
        if role in (Role.TENSOR_V1, Role.TENSOR_V2, Role.TENSOR_V3):
            return self.tensor(func, args)
        if role is Role.PARAMETER:
            data = args[0] if args else None
            return data if isinstance(data, TensorRef) else Opaque(func.name, tensor=True)
        if role is Role.FROM_TYPE:
            return self.from_type(func, args)
        if role in (Role.OPAQUE_TENSOR, Role.TENSOR_CLASS):
            return Opaque(func.name, tensor=True, buildable=role is Role.TENSOR_CLASS)
        if role is Role.SIZE:
            sizes = args[0] if len(args) == 1 else None
            if not isinstance(sizes, (tuple, list)) or not all(_is_int(s) for s in sizes):
                raise BrokenPickle("torch.Size of something other than integers")
            self.spend(len(sizes))
            return tuple(sizes)
        if role is Role.DICT_CLASS:
            return self.dict_object(func, args)
        if role is Role.ENCODE:
            return _encode(args)
        if role is Role.SET:
            items = args[0] if args else []
            if not isinstance(items, (list, tuple)):
                raise BrokenPickle("builtins.set of something other than a list")
            return {self.hashable(i) for i in items}
        if role is Role.OPAQUE_VALUE:
            return Opaque(func.name)
        if role is Role.NUMPY:
            return Opaque(func.name, buildable=True)
        raise UnsafePickle(f"calling {func.name} is not allowed (it may only appear as a value)")

    def _is_foreign(self, value: Any) -> bool:
        """Whether ``value`` is something a foreign global built (only with foreign objects)."""
        return self.foreign_objects and isinstance(value, Opaque) and value.foreign

    def refused_call(self, func: _Refused, args: Any) -> _Refused:
        """``getattr(parent, "Inner")`` spells the nested class ``parent.Inner``, which becomes
        the name to refuse; calling any other refused global refuses the pickle."""
        parent, attr = args if isinstance(args, tuple) and len(args) == 2 else (None, None)
        if func.name != GETATTR or not isinstance(parent, (_Global, _Refused)):
            raise UnsafePickle(f"global {_printable(self.refused or func.name)} is not allowed")
        if not isinstance(attr, str):
            raise UnsafePickle(f"global {_printable(self.refused or func.name)} is not allowed")
        self.refused = f"{parent.name}.{attr}"
        return _Refused(self.refused)

    def tensor(self, func: _Global, args: tuple[Any, ...]) -> TensorRef:
        arity = {Role.TENSOR_V1: (4, 4), Role.TENSOR_V2: (6, 7), Role.TENSOR_V3: (7, 8)}
        low, high = arity[func.role]
        if not low <= len(args) <= high:
            raise BrokenPickle(f"{func.name} takes {low} to {high} arguments, got {len(args)}")
        storage, offset, shape, stride = args[:4]
        dtype = storage.dtype if isinstance(storage, StorageRef) else ""
        if func.role is Role.TENSOR_V3:
            given = args[6]
            if not (
                isinstance(given, _Global) and given.name.removeprefix("torch.") in DTYPE_ITEMSIZE
            ):
                raise BrokenPickle(f"{func.name} with a dtype that is not a torch dtype")
            dtype = given.name.removeprefix("torch.")
        # v2 and v3 end with an optional dict of flags (conjugate, negative...); v1 has none.
        has_metadata = func.role is not Role.TENSOR_V1 and len(args) == high
        metadata = args[-1] if has_metadata else None
        if (
            not isinstance(storage, StorageRef)
            or not _is_int(offset)
            or not isinstance(shape, tuple)
            or not isinstance(stride, tuple)
            or len(shape) != len(stride)
            or not all(_is_int(v) for v in (offset, *shape, *stride))
            or min((offset, *shape, *stride)) < 0
            or not (metadata is None or isinstance(metadata, dict))
        ):
            raise BrokenPickle(f"{func.name} with arguments that do not describe a tensor")
        ref = TensorRef(storage, offset, shape, stride, dtype, not any((metadata or {}).values()))
        if ref.numel:
            last = offset + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))
            if (last + 1) * DTYPE_ITEMSIZE[dtype] > storage.nbytes:
                raise BrokenPickle(f"a tensor runs past the end of storage {storage.key!r}")
        return ref

    def from_type(self, func: _Global, args: tuple[Any, ...]) -> Any:
        if len(args) != 4 or not isinstance(args[0], _Global) or not isinstance(args[2], tuple):
            raise BrokenPickle(f"{func.name} with arguments that do not rebuild a tensor")
        inner, new_type, inner_args, _state = args
        if inner.role is Role.FROM_TYPE:
            raise UnsafePickle(f"{func.name} nested in itself")
        if not isinstance(new_type, _Global) or new_type.role not in (
            Role.TENSOR_CLASS,
            Role.PARAMETER,
        ):
            shown = new_type.name if isinstance(new_type, _Global) else type(new_type).__name__
            raise UnsafePickle(f"{func.name} makes a {shown}, not a tensor")
        result = self.call(inner, inner_args)
        if not isinstance(result, (TensorRef, Opaque)) or (
            isinstance(result, Opaque) and not result.tensor
        ):
            raise UnsafePickle(f"{func.name} of {inner.name}, which does not make a tensor")
        return result

    def dict_object(self, func: _Global, args: tuple[Any, ...]) -> _DictObject:
        out = _DictObject()
        if not args:
            return out
        source = args[0]
        if len(args) != 1 or not isinstance(source, (dict, list, tuple)):
            raise BrokenPickle(f"{func.name} of something other than a mapping or pairs")
        pairs = list(source.items()) if isinstance(source, dict) else source
        self.spend(len(pairs))
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise BrokenPickle(f"{func.name} of something other than key-value pairs")
            out[self.hashable(pair[0])] = pair[1]
        return out

    def build(self, state: Any, target: Any) -> None:
        """``BUILD``: only an ``OrderedDict``'s attributes and numpy objects' state are set."""
        if isinstance(target, _DictObject) and isinstance(state, dict):
            return  # torch keeps e.g. a state dict's ``_metadata`` as an attribute
        if isinstance(target, Opaque) and target.buildable:
            return
        if isinstance(target, Opaque):
            shown = target.kind
        else:
            shown = "tensor" if isinstance(target, TensorRef) else type(target).__name__
        raise UnsafePickle(f"BUILD on a {shown} is not allowed")

    def storage(self, pid: Any) -> StorageRef:
        """A storage persistent id: ("storage", type, key, location, numel[, view])."""
        if not isinstance(pid, tuple) or not pid or pid[0] not in ("storage", b"storage"):
            shown = _describe(pid[0] if isinstance(pid, tuple) and pid else pid)
            raise UnsafePickle(f"a persistent id that is not a storage ({shown})")
        if len(pid) != self.storage_id_fields:
            raise BrokenPickle(f"a storage id of {len(pid)} fields, not {self.storage_id_fields}")
        kind, key, location, numel = pid[1:5]
        if not isinstance(kind, _Global) or kind.role is not Role.STORAGE_TYPE:
            shown = kind.name if isinstance(kind, _Global) else type(kind).__name__
            raise UnsafePickle(f"a storage of type {shown}")
        if not isinstance(key, str) or not isinstance(location, (str, bytes)):
            raise BrokenPickle("a storage id whose key or location is not a string")
        if not _is_int(numel) or numel < 0:
            raise BrokenPickle(f"storage {_printable(key, 80)!r} with a bad element count")
        kind_name = kind.name.rsplit(".", 1)[-1].removesuffix("Storage")
        dtype = STORAGE_DTYPES.get(kind_name, "uint8")  # UntypedStorage holds bytes
        if key not in self.storages:
            self.storages[key] = StorageRef(key, dtype, numel)
        root = self.storages[key]  # torch reuses the first storage loaded under a key
        view = pid[5] if len(pid) == 6 else None
        if view is None:
            return root
        # Legacy files from torch before 1.0 could name a slice of a storage.
        if not (isinstance(view, tuple) and len(view) == 3 and isinstance(view[0], str)):
            raise BrokenPickle(f"storage {_printable(key, 80)!r} with bad view metadata")
        view_key, start, count = view
        if not (_is_int(start) and _is_int(count) and start >= 0 and count >= 0):
            raise BrokenPickle(f"storage {_printable(key, 80)!r} with bad view metadata")
        if start + count > root.numel:
            raise BrokenPickle(f"a view runs past the end of storage {_printable(key, 80)!r}")
        return StorageRef(view_key, root.dtype, count)


def _opcodes(stream: IO[bytes]) -> Iterator[tuple[str, Any, int]]:
    """``(name, argument, approximate size)`` per opcode; malformed bytes are ``BrokenPickle``."""
    ops = pickletools.genops(stream)
    while True:
        try:
            op, arg, _ = next(ops)
        except StopIteration:
            return
        except Exception as e:  # genops raises ValueError, UnicodeDecodeError and more on junk
            raise BrokenPickle(f"unreadable pickle ({type(e).__name__})") from e
        size = len(arg) if isinstance(arg, (str, bytes, bytearray)) else 1
        yield op.name, arg, size


def _describe(value: object) -> str:
    if isinstance(value, str):
        return repr(_printable(value, 80))
    return type(value).__name__


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _encode(args: tuple[Any, ...]) -> Any:
    """``_codecs.encode(text, "latin1")``: how protocol 2 writes ``bytes``."""
    if len(args) == 2 and isinstance(args[0], str) and args[1] in ("latin1", "latin-1"):
        try:
            return args[0].encode("latin-1")
        except UnicodeEncodeError as e:
            raise BrokenPickle("_codecs.encode of text that is not latin-1") from e
    return Opaque("_codecs.encode")
