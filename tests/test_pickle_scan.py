"""`cas put x.pt` reads a torch pickle by its opcodes: real checkpoints pass, payloads never run."""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import pickle
import pickletools
import struct
import subprocess
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cas
from cas.errors import CASError, FormatError
from cas.formats import TensorRegion, inspect_file
from cas.formats._pickle_allow import ALLOWED_GLOBALS
from tests.test_formats import ALL_DTYPES, random_tensor, region_bytes, tensor_bytes

# -- real checkpoints ------------------------------------------------------------------------


def every_dtype_state() -> dict[str, Any]:
    """Every dtype, nested dicts/lists/tuples, tied weights, views, conj, empty and 0-d tensors."""
    tied = torch.randn(6, 4)
    base = torch.arange(12.0)
    return {
        "dtypes": {
            str(d).removeprefix("torch."): random_tensor(d, (3, 4), i)
            for i, d in enumerate([*ALL_DTYPES, torch.complex128, torch.complex32])
        },
        "model": OrderedDict(
            [("embed.weight", tied), ("head.weight", tied), ("norm.bias", torch.zeros(4))]
        ),
        "optimizer": {
            "state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(256, 64)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}],
        },
        "views": [base[3:7], base, tied.t(), (torch.randn(2, dtype=torch.complex64).conj(),)],
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "parameter": torch.nn.Parameter(torch.randn(5)),
        "step": 1200,
        "name": "gpt",
    }


def layout_by_torch(path: Path) -> set[tuple[str, str, tuple[int, ...], int, int]]:
    """The layout as cas computed it with torch.load(mmap=True): the oracle for the scanner.

    Every storage is a slice of one mapping of the file, so a pointer minus the mapping's base
    is a file offset; the first tensor (depth-first) that covers a storage exactly names it.
    """
    with zipfile.ZipFile(path) as archive:
        prefix = archive.infolist()[0].filename.split("/")[0]
        records = {}
        for info in archive.infolist():
            if info.filename.startswith(f"{prefix}/data/"):
                with path.open("rb") as f:
                    f.seek(info.header_offset + 26)
                    name_len, extra_len = struct.unpack("<HH", f.read(4))
                offset = info.header_offset + 30 + name_len + extra_len
                records[info.filename.rsplit("/", 1)[1]] = (offset, info.file_size)
    loaded = torch.load(path, weights_only=True, mmap=True)
    tensors = list(_walk(loaded, ()))
    pointers = [t.untyped_storage().data_ptr() for _, t in tensors]
    by_offset = {offset: key for key, (offset, _) in records.items()}
    base = next(
        b
        for b in (min(pointers) - o for o in by_offset)
        if all(p - b in by_offset for p in pointers)
    )
    named: dict[str, tuple[str, str, tuple[int, ...], int, int]] = {}
    for (path_, t), pointer in zip(tensors, pointers, strict=True):
        key = by_offset[pointer - base]
        offset, nbytes = records[key]
        covers = (
            t.storage_offset() == 0
            and t.is_contiguous()
            and not t.is_conj()
            and not t.is_neg()
            and t.numel() * t.element_size() == nbytes
        )
        if key not in named and covers and path_ and path_ not in {n[0] for n in named.values()}:
            named[key] = (path_, str(t.dtype)[6:], tuple(t.shape), offset, nbytes)
    return {
        named.get(key, (f"storage/{key}", "uint8", (nbytes,), offset, nbytes))
        for key, (offset, nbytes) in records.items()
    }


def _walk(obj: object, path: tuple[str, ...]) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield ".".join(path), obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk(value, (*path, str(key)))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _walk(value, (*path, str(i)))


def as_tuples(regions: tuple[TensorRegion, ...]) -> set[tuple[str, str, tuple[int, ...], int, int]]:
    return {(r.name, r.dtype, r.shape, r.offset, r.nbytes) for r in regions}


def test_every_dtype_nested_tied_and_viewed_is_laid_out_as_torch_load_saw_it(
    tmp_path: Path,
) -> None:
    state = every_dtype_state()
    path = tmp_path / "state.pt"
    torch.save(state, path)

    layout = inspect_file(path)

    assert layout.format == "torch-zip"
    assert as_tuples(layout.regions) == layout_by_torch(path)
    names = {r.name for r in layout.regions}
    assert {f"dtypes.{d}" for d in state["dtypes"]} <= names
    assert {"model.embed.weight", "optimizer.state.0.exp_avg", "views.1", "scalar"} <= names
    assert "model.head.weight" not in names  # a tied weight is named once
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in _walk(state, ()):
        tensors.setdefault(name, tensor)
    for region in layout.regions:
        if not region.name.startswith("storage/"):
            assert region_bytes(path, region) == tensor_bytes(tensors[region.name]), region.name


def test_a_checkpoint_ingests_byte_identically_and_loads_by_tensor_name(tmp_path: Path) -> None:
    state = every_dtype_state()
    path = tmp_path / "state.pt"
    torch.save(state, path)
    repo = cas.open(tmp_path / "store")

    repo.put_path(path, "runs/r1/state")
    back = repo.get_path("runs/r1/state", tmp_path / "back.pt")
    loaded = repo.load("runs/r1/state", keys="state.pt.optimizer.*")["state.pt"]

    assert back[0].read_bytes() == path.read_bytes()
    assert torch.equal(
        loaded["optimizer.state.0.exp_avg"],
        state["optimizer"]["state"][0]["exp_avg"],
    )


def test_the_scan_works_where_torch_cannot_be_imported(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    torch.save(every_dtype_state(), path)
    probe = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises
        "from cas.formats import inspect_file\n"
        f"print(len(inspect_file({str(path)!r}).regions))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == len(inspect_file(path).regions) > 20


def test_protocol_4_and_legacy_files_are_accepted(tmp_path: Path) -> None:
    proto4 = tmp_path / "proto4.pt"
    torch.save({"w": torch.ones(3)}, proto4, pickle_protocol=4)
    legacy = tmp_path / "legacy.pt"
    torch.save(
        {"w": torch.ones(3), "v": torch.arange(4)}, legacy, _use_new_zipfile_serialization=False
    )

    assert [r.name for r in inspect_file(proto4).regions] == ["w"]
    assert inspect_file(legacy).format == "opaque"


def test_the_allowlist_is_torchs_own_plus_numpy_reconstructors() -> None:
    from torch._weights_only_unpickler import _get_allowed_globals

    ours = set(ALLOWED_GLOBALS)
    torchs = set(_get_allowed_globals())
    assert torchs - ours == set(), "torch allows more now: extend cas/formats/_pickle_allow.py"
    assert {name.split(".")[0] for name in ours - torchs} == {"numpy"}


# -- payloads --------------------------------------------------------------------------------


def op_global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def op_str(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def storage_id(key: str, numel: int, kind: str = "FloatStorage", legacy: bool = False) -> bytes:
    """A storage persistent id; legacy files add a sixth field (view metadata, None)."""
    fields = op_str("storage") + op_global("torch", kind) + op_str(key) + op_str("cpu")
    return b"(" + fields + b"J" + struct.pack("<i", numel) + (b"N" if legacy else b"") + b"tQ"


def tensor_v2(key: str, numel: int, shape: int, legacy: bool = False) -> bytes:
    """``_rebuild_tensor_v2(storage, 0, (shape,), (1,), False, OrderedDict())``."""
    return (
        op_global("torch._utils", "_rebuild_tensor_v2")
        + b"("
        + storage_id(key, numel, legacy=legacy)
        + b"K\x00"
        + b"J" + struct.pack("<i", shape) + b"\x85"
        + b"K\x01\x85"
        + b"\x89"
        + op_global("collections", "OrderedDict") + b")R"
        + b"tR"
    )  # fmt: skip


Payload = Callable[[Path, bool], bytes]
"""Builds a pickle (for a zip, or legacy) that creates ``canary`` when unpickled, or does
something else a weights-only file never does."""


def os_system(canary: Path, legacy: bool) -> bytes:
    return b"\x80\x02" + op_global("os", "system") + op_str(f"touch {canary}") + b"\x85R."


def builtins_eval(canary: Path, legacy: bool) -> bytes:
    code = f"open({str(canary)!r}, 'w').close()"
    return b"\x80\x02" + op_global("__builtin__", "eval") + op_str(code) + b"\x85R."


def subprocess_popen(canary: Path, legacy: bool) -> bytes:
    argv = b"](" + op_str("touch") + op_str(str(canary)) + b"e"
    return b"\x80\x02" + op_global("subprocess", "Popen") + argv + b"\x85R."


def stack_global(canary: Path, legacy: bool) -> bytes:
    return pickle.dumps(_Reduce(os.system, (f"touch {canary}",)), protocol=4)


def inst(canary: Path, legacy: bool) -> bytes:
    return b"\x80\x02(" + b"S'touch " + str(canary).encode() + b"'\n" + b"ios\nsystem\n."


def reduce_of_a_string(canary: Path, legacy: bool) -> bytes:
    return b"\x80\x02" + op_str("os.system") + op_str(f"touch {canary}") + b"\x85R."


def reduce_of_an_allowed_value(canary: Path, legacy: bool) -> bytes:
    # torch itself would call UntypedStorage(2**40): a terabyte allocation.
    return (
        b"\x80\x02"
        + op_global("torch.storage", "UntypedStorage")
        + b"\x8a\x06\x00\x00\x00\x00\x00\x01\x85R."
    )


def allowed_module_other_name(canary: Path, legacy: bool) -> bytes:
    # torch._utils is allowed for its rebuild functions; this one imports any dotted name.
    return (
        b"\x80\x02"
        + op_global("torch._utils", "_import_dotted_name")
        + op_str("os.system")
        + b"\x85R."
    )


def obj_of_an_allowed_class(canary: Path, legacy: bool) -> bytes:
    return b"\x80\x02(" + op_global("collections", "OrderedDict") + b"o."


def build_on_a_tensor(canary: Path, legacy: bool) -> bytes:
    return b"\x80\x02" + tensor_v2("0", 4, 4, legacy) + b"}" + op_str("grad") + b"Ns" + b"b."


def build_on_a_dict(canary: Path, legacy: bool) -> bytes:
    return b"\x80\x02}}" + op_str("__class__") + op_global("torch", "Size") + b"sb."


def build_on_a_device(canary: Path, legacy: bool) -> bytes:
    return b"\x80\x02" + op_global("torch", "device") + op_str("cpu") + b"\x85R}b."


def newobj_of_a_function(canary: Path, legacy: bool) -> bytes:
    return b"\x80\x02" + op_global("torch._utils", "_rebuild_tensor_v2") + b")\x81."


def persistent_id_not_a_storage(canary: Path, legacy: bool) -> bytes:
    return b"\x80\x02(" + op_str("module") + op_str("os") + b"tQ."


def extension_code(canary: Path, legacy: bool) -> bytes:
    return b"\x80\x02\x82\x01."


class _Reduce:
    def __init__(self, func: object, args: tuple[object, ...]) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.func, self.args


PAYLOADS: dict[str, tuple[Payload, str]] = {
    "os.system": (os_system, "global os.system is not allowed"),
    "builtins.eval": (builtins_eval, "global builtins.eval is not allowed"),
    "subprocess.Popen": (subprocess_popen, "global subprocess.Popen is not allowed"),
    "STACK_GLOBAL": (stack_global, "global posix.system is not allowed"),
    "INST": (inst, "opcode INST (os.system)"),
    "REDUCE of a string": (reduce_of_a_string, "REDUCE on a str"),
    "REDUCE of a value": (reduce_of_an_allowed_value, "calling torch.storage.UntypedStorage"),
    "allowed module": (allowed_module_other_name, "global torch._utils._import_dotted_name"),
    "OBJ": (obj_of_an_allowed_class, "opcode OBJ"),
    "BUILD tensor": (build_on_a_tensor, "BUILD on a tensor is not allowed"),
    "BUILD dict": (build_on_a_dict, "BUILD on a dict is not allowed"),
    "BUILD device": (build_on_a_device, "BUILD on a torch.device is not allowed"),
    "NEWOBJ function": (newobj_of_a_function, "NEWOBJ on torch._utils._rebuild_tensor_v2"),
    "PERSID": (persistent_id_not_a_storage, "a persistent id that is not a storage ('module')"),
    "EXT1": (extension_code, "opcode EXT1"),
}

LIVE = ["os.system", "builtins.eval", "subprocess.Popen", "STACK_GLOBAL", "INST"]


def torch_zip(path: Path, pkl: bytes, records: dict[str, bytes] | None = None) -> Path:
    """A file laid out like torch.save's: ``archive/data.pkl``, byte order, storage records."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pkl)
        archive.writestr("archive/byteorder", "little")
        for key, data in (records or {}).items():
            archive.writestr(f"archive/data/{key}", data)
    return path


@pytest.mark.parametrize("live", LIVE)
def test_the_payloads_are_live_when_unpickled(tmp_path: Path, live: str) -> None:
    canary = tmp_path / "canary"
    result = pickle.loads(PAYLOADS[live][0](canary, False))
    if isinstance(result, subprocess.Popen):
        result.wait()
    assert canary.exists()


@pytest.mark.parametrize("container", ["zip", "legacy"])
@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_a_pickle_that_steps_outside_weights_is_refused_in_one_line_and_never_runs(
    tmp_path: Path, payload: str, container: str
) -> None:
    build, needle = PAYLOADS[payload]
    canary = tmp_path / "canary"
    if container == "zip":
        path = torch_zip(tmp_path / "evil.pt", build(canary, False))
    else:
        path = tmp_path / "evil.pt"
        path.write_bytes(build(canary, True))

    with pytest.raises(FormatError) as refused:
        inspect_file(path)

    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"refusing to load {path}")
    assert needle in message
    allowed = inspect_file(path, allow_opaque_pickles=True)
    assert allowed.format == ("torch-zip" if container == "zip" else "opaque")
    assert not canary.exists()


class Outer:
    """A class whose nested classes protocol 2 pickles as ``getattr(Outer, "Inner")``."""

    class Inner:
        def __init__(self) -> None:
            self.lr = 0.1

    class Middle:
        class Inner:
            pass


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
@pytest.mark.parametrize(
    "value",
    [Outer.Inner(), Outer.Middle.Inner(), [Outer.Inner, 1]],
    ids=["inner", "deeper", "class"],
)
def test_a_refused_nested_class_is_named_itself_not_builtins_getattr(
    tmp_path: Path, value: Any, zipped: bool
) -> None:
    path = tmp_path / "nested.pt"
    torch.save({"cfg": value}, path, _use_new_zipfile_serialization=zipped)  # protocol 2
    inner = type(value) if not isinstance(value, list) else value[0]
    assert b"getattr" in path.read_bytes()  # how protocol 2 writes a nested class

    with pytest.raises(FormatError) as refused:
        inspect_file(path)

    message = str(refused.value)
    assert f"global {__name__}.{inner.__qualname__} is not allowed" in message, message
    assert "getattr" not in message and "\n" not in message


def test_truncated_and_garbage_pickles_are_refused(tmp_path: Path) -> None:
    real = tmp_path / "real.pt"
    torch.save({"w": torch.ones(4)}, real)
    with zipfile.ZipFile(real) as archive:
        pkl = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
        records = {"0": archive.read(next(n for n in archive.namelist() if n.endswith("data/0")))}
    cases = {
        "truncated": pkl[: len(pkl) // 2],
        "garbage": b"\x80\x02" + bytes(range(7, 200)),
        "empty": b"",
        "no stop": pkl[:-1],
        "underflow": b"\x80\x02R.",
        "unknown memo": b"\x80\x02h\x07.",
    }
    for label, data in cases.items():
        path = torch_zip(tmp_path / f"{label.replace(' ', '_')}.pt", data, records)
        with pytest.raises(FormatError, match="not a loadable torch checkpoint") as refused:
            inspect_file(path)
        assert "\n" not in str(refused.value), label


def test_storages_must_match_their_records(tmp_path: Path) -> None:
    pkl = b"\x80\x02" + tensor_v2("0", 4, 4) + b"."
    assert inspect_file(torch_zip(tmp_path / "ok.pt", pkl, {"0": bytes(16)})).regions
    # torch before 1.x wrote _rebuild_tensor(storage, offset, size, stride): no flags after it.
    v1 = b"\x80\x02}" + op_str("w") + op_global("torch._utils", "_rebuild_tensor") + b"("
    v1 += storage_id("0", 4) + b"K\x00K\x04\x85K\x01\x85tRs."
    (region,) = inspect_file(torch_zip(tmp_path / "v1.pt", v1, {"0": bytes(16)})).regions
    assert (region.name, region.dtype, region.shape) == ("w", "float32", (4,))
    with pytest.raises(FormatError, match="names storage '0', which is missing"):
        inspect_file(torch_zip(tmp_path / "missing.pt", pkl))
    with pytest.raises(FormatError, match="holds 12 bytes, its pickle says 16"):
        inspect_file(torch_zip(tmp_path / "short.pt", pkl, {"0": bytes(12)}))
    past_end = b"\x80\x02" + tensor_v2("0", 4, 5) + b"."
    with pytest.raises(FormatError, match="runs past the end of storage"):
        inspect_file(torch_zip(tmp_path / "past.pt", past_end, {"0": bytes(16)}))


def test_a_pickle_that_expands_beyond_its_size_is_refused(tmp_path: Path) -> None:
    # A 10,000-item list read back through the memo 20,000 times as OrderedDict(pairs).
    pairs = b"](" + b"K\x01K\x02\x86" * 10_000 + b"eq\x00"
    copies = (op_global("collections", "OrderedDict") + b"h\x00\x85R0") * 20_000
    path = torch_zip(tmp_path / "bomb.pt", b"\x80\x02" + pairs + copies + b"N.")
    with pytest.raises(FormatError, match="expands far beyond its size"):
        inspect_file(path)


# -- fuzzing ---------------------------------------------------------------------------------


def _real_opcodes() -> list[bytes]:
    """Each opcode (with its argument) of a real checkpoint's pickle, as separate snippets."""
    buffer = io.BytesIO()
    torch.save(every_dtype_state(), buffer)
    with zipfile.ZipFile(buffer) as archive:
        pkl = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    positions = [pos for _, _, pos in pickletools.genops(pkl)] + [len(pkl)]
    return sorted({pkl[a:b] for a, b in itertools.pairwise(positions)})


_SNIPPETS = [
    *_real_opcodes(),
    op_global("os", "system"),
    op_global("torch", "Size"),
    op_global("collections", "OrderedDict"),
    op_global("torch._utils", "_rebuild_tensor_v3"),
    op_global("numpy", "dtype"),
    storage_id("0", 4),
    storage_id("0", 4, "UntypedStorage"),
    *(bytes([code]) for code in b"()tlde\x85\x86\x87NR\x81\x92b0\x94\x95sua\x8f\x90\x91Qoi\x82"),
]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    snippets=st.lists(st.sampled_from(_SNIPPETS) | st.binary(max_size=6), max_size=80),
    container=st.sampled_from(["zip", "legacy"]),
)
def test_random_opcode_streams_only_ever_raise_cas_errors(
    tmp_path_factory: pytest.TempPathFactory, snippets: list[bytes], container: str
) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "fuzz.pt"
    data = b"\x80\x02" + b"".join(snippets) + b"."
    if container == "zip":
        torch_zip(path, data, {"0": bytes(16)})
    else:
        path.write_bytes(data)
    with contextlib.suppress(CASError):  # anything else (TypeError, RecursionError...) fails
        inspect_file(path)
