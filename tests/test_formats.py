"""Ingest-side format detection: tensor regions of safetensors/torch files, refusals, exports."""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from cas.errors import FormatError, InvalidName
from cas.formats import FileLayout, TensorRegion, inspect_file
from cas.formats.hfdir import inspect_directory
from cas.formats.writers import VALUES_METADATA_KEY, flatten_state, write_safetensors, write_torch
from tests.helpers import assert_bit_exact


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def region_bytes(path: Path, region: TensorRegion) -> bytes:
    with open(path, "rb") as f:
        f.seek(region.offset)
        return f.read(region.nbytes)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of any dtype from random bytes (bool kept to valid 0/1 values)."""
    gen = torch.Generator().manual_seed(seed)
    numel = int(np.prod(shape)) if shape else 1
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def assert_layout_invariants(layout: FileLayout) -> None:
    offsets = [(r.offset, r.nbytes) for r in layout.regions]
    assert offsets == sorted(offsets)
    for before, after in zip(layout.regions, layout.regions[1:], strict=False):
        assert before.end <= after.offset
    assert all(r.offset >= 0 and r.end <= layout.size for r in layout.regions)


ALL_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
    torch.float4_e2m1fn_x2,
]


def test_safetensors_regions_are_the_bytes_of_every_dtype(tmp_path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(ALL_DTYPES):
        name = str(dtype).removeprefix("torch.")
        tensors[f"{name}.matrix"] = random_tensor(dtype, (3, 5), seed=i)
        if dtype != torch.float4_e2m1fn_x2:  # safetensors cannot store half a byte
            tensors[f"{name}.scalar"] = random_tensor(dtype, (), seed=100 + i)
        tensors[f"{name}.empty"] = random_tensor(dtype, (0, 4), seed=0)
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt", "step": "7"})

    layout = inspect_file(path)

    assert layout.format == "safetensors"
    assert layout.size == path.stat().st_size
    assert layout.metadata == {"format": "pt", "step": "7"}
    assert_layout_invariants(layout)
    assert {r.name for r in layout.regions} == set(tensors)
    for region in layout.regions:
        t = tensors[region.name]
        assert region.dtype == str(t.dtype).removeprefix("torch."), region.name
        assert region.shape == tuple(t.shape), region.name
        assert region.nbytes == t.nbytes
        assert region_bytes(path, region) == tensor_bytes(t), region.name


def test_safetensors_is_detected_by_content_not_name(tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    safetensors.torch.save_file({"w": torch.ones(4)}, path)
    assert inspect_file(path).format == "safetensors"


def make_safetensors(header: object, data: bytes = b"", header_len: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


GOOD = {"a": entry("F32", [2], 0, 8)}
EIGHT = b"\0" * 8


@pytest.mark.parametrize(
    ("content", "message"),
    [
        pytest.param(make_safetensors(GOOD, EIGHT)[:-3], "past the end", id="data-cut"),
        pytest.param(make_safetensors(GOOD)[:20], "truncated", id="header-cut"),
        pytest.param(b"\x05\x00", "truncated", id="tiny"),
        pytest.param(make_safetensors(GOOD, header_len=1 << 40), "cap", id="absurd-length"),
        pytest.param(struct.pack("<Q", 5) + b"{oops", "not valid JSON", id="bad-json"),
        pytest.param(make_safetensors([1, 2]), "not a JSON object", id="not-object"),
        pytest.param(
            make_safetensors({"a": entry("F32", [3], 0, 8)}, EIGHT), "needs 12", id="size"
        ),
        pytest.param(make_safetensors({"a": entry("Q7", [2], 0, 8)}, EIGHT), "unknown", id="dtype"),
        pytest.param(
            make_safetensors({"a": entry("F32", [2], 8, 0)}, EIGHT), "invalid data", id="rev"
        ),
        pytest.param(
            make_safetensors({**GOOD, "b": entry("F32", [1], 4, 8)}, EIGHT), "overlap", id="lap"
        ),
        pytest.param(make_safetensors({"__metadata__": {"n": 3}}), "__metadata__", id="meta"),
    ],
)
def test_damaged_safetensors_is_refused_naming_the_file(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "broken.safetensors"
    path.write_bytes(content)
    with pytest.raises(FormatError, match=message) as info:
        inspect_file(path)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_duplicate_safetensors_keys_are_refused(tmp_path: Path) -> None:
    raw = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    path = tmp_path / "dup.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0")
    with pytest.raises(FormatError, match="repeats key"):
        inspect_file(path)


def trained_state() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3}


def named_tensors(state: object, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else []
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(named_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def test_torch_save_regions_are_named_tensors_of_a_trained_checkpoint(tmp_path: Path) -> None:
    state = trained_state()
    path = tmp_path / "checkpoint.pt"
    torch.save(state, path)

    layout = inspect_file(path)

    assert layout.format == "torch-zip"
    assert_layout_invariants(layout)
    expected = named_tensors(state)
    assert "optimizer.state.0.exp_avg" in expected and "model.2.bias" in expected
    assert {r.name for r in layout.regions} == set(expected)
    for region in layout.regions:
        t = expected[region.name]
        assert (region.dtype, region.shape) == (str(t.dtype)[6:], tuple(t.shape)), region.name
        assert region_bytes(path, region) == tensor_bytes(t), region.name
        # torch's writer aligns storages to 64 bytes; the lead relies on nothing more.
        assert region.offset % 64 == 0


def test_views_and_shared_storages_fall_back_to_storage_regions(tmp_path: Path) -> None:
    weight = torch.randn(4, 4)
    base = torch.arange(10.0)
    state = {
        "tied_a": weight,
        "tied_b": weight,
        "view": base[2:5],
        "transposed": weight.t(),
        "conj": torch.randn(3, dtype=torch.complex64).conj(),
        "empty": torch.empty(0),
    }
    path = tmp_path / "views.pt"
    torch.save(state, path)

    regions = {r.name: r for r in inspect_file(path).regions}

    assert set(regions) == {"tied_a", "empty", "storage/1", "storage/2"}
    assert region_bytes(path, regions["tied_a"]) == tensor_bytes(weight)
    assert region_bytes(path, regions["storage/1"]) == tensor_bytes(base)
    assert regions["storage/1"].dtype == "uint8" and regions["storage/1"].shape == (40,)
    assert regions["empty"].nbytes == 0


def test_compressed_members_and_big_endian_files_have_no_regions(tmp_path: Path) -> None:
    plain = tmp_path / "plain.pt"
    torch.save({"a": torch.ones(64), "b": torch.zeros(64)}, plain)
    deflated = tmp_path / "deflated.pt"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(deflated, "w") as dst:
        for info in src.infolist():
            method = (
                zipfile.ZIP_DEFLATED if info.filename.endswith("data/0") else zipfile.ZIP_STORED
            )
            dst.writestr(info.filename, src.read(info), compress_type=method)
    assert [r.name for r in inspect_file(deflated).regions] == ["b"]

    big = tmp_path / "big.pt"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(big, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/byteorder"):
                data = b"big"
            elif "/data/" in info.filename:
                data = np.frombuffer(data, "<f4").astype(">f4").tobytes()
            dst.writestr(info.filename, data)
    layout = inspect_file(big)
    assert layout.format == "torch-zip" and layout.regions == ()


class Exploit:
    """Unpickling this creates a directory: the canary for code execution."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = str(sentinel)

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (self.sentinel,)


def test_malicious_raw_pickle_is_refused_without_running(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    pickle.loads(pickle.dumps(Exploit(canary)))
    assert canary.exists(), "the payload must really run when unpickled"

    sentinel = tmp_path / "pwned"
    path = tmp_path / "model.bin"
    path.write_bytes(pickle.dumps({"w": Exploit(sentinel)}, protocol=2))
    with pytest.raises(FormatError, match="not a weights-only checkpoint"):
        inspect_file(path)
    assert inspect_file(path, allow_opaque_pickles=True).format == "opaque"
    assert not sentinel.exists()


def test_malicious_torch_zip_is_refused_without_running(tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    path = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(2), "x": Exploit(sentinel)}, path)
    with pytest.raises(FormatError, match=r"refusing to load .*weights\.pt.*posix\.mkdir"):
        inspect_file(path)
    # With consent the pickle stays bytes that are never run; its tensor storages are still cut.
    layout = inspect_file(path, allow_opaque_pickles=True)
    assert [r.name for r in layout.regions] == ["w"]
    assert not sentinel.exists()


def test_legacy_torch_files_are_validated_then_opaque(tmp_path: Path) -> None:
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, legacy, _use_new_zipfile_serialization=False)
    assert inspect_file(legacy).format == "opaque"
    not_torch = tmp_path / "data.pkl"
    not_torch.write_bytes(pickle.dumps({"a": 1}, protocol=4))
    with pytest.raises(FormatError):
        inspect_file(not_torch)


def test_corrupted_torch_zip_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "good.pt"
    torch.save({"w": torch.ones(8)}, path)
    content = path.read_bytes()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(content[: len(content) // 2])
    with pytest.raises(FormatError, match=re.escape("truncated.pt")):
        inspect_file(truncated)

    with zipfile.ZipFile(path) as z:
        pkl = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    name_len, extra_len = struct.unpack(
        "<HH", content[pkl.header_offset + 26 : pkl.header_offset + 30]
    )
    garbled = bytearray(content)
    start = pkl.header_offset + 30 + name_len + extra_len + 2  # just after the PROTO opcode
    garbled[start : start + 16] = b"\xff" * 16
    bad_pickle = tmp_path / "garbled.pt"
    bad_pickle.write_bytes(bytes(garbled))
    with pytest.raises(FormatError, match=re.escape("garbled.pt")):
        inspect_file(bad_pickle)


def test_other_files_are_opaque(tmp_path: Path) -> None:
    archive = tmp_path / "assets.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("readme.txt", "hello")
    broken_zip = tmp_path / "broken.zip"
    broken_zip.write_bytes(archive.read_bytes()[:20])
    text = tmp_path / "trainer_state.json"
    text.write_text(json.dumps({"global_step": 3}))
    noise = tmp_path / "noise.pt"
    noise.write_bytes(bytes(random.Random(1).randrange(1, 128) for _ in range(4096)))
    for path in (archive, broken_zip, text, noise):
        assert inspect_file(path) == FileLayout("opaque", path.stat().st_size), path


@dataclass
class FakeTrainingArguments:
    output_dir: str = "out"
    learning_rate: float = 1e-3
    tags: list[str] = field(default_factory=list)


def hf_checkpoint(root: Path) -> dict[str, torch.Tensor]:
    state = trained_state()
    model = state["model"]
    assert isinstance(model, dict)
    root.mkdir()
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in model.items()},
        root / "model.safetensors",
        metadata={"format": "pt"},
    )
    torch.save(state["optimizer"], root / "optimizer.pt")
    scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1)], lr=1.0), 5)
    torch.save(scheduler.state_dict(), root / "scheduler.pt")
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    torch.save(rng, root / "rng_state.pth")
    (root / "trainer_state.json").write_text('{"global_step": 3}')
    torch.save(FakeTrainingArguments(), root / "training_args.bin")
    (root / "extra" / "deeper").mkdir(parents=True)
    (root / "extra" / "notes.txt").write_text("hi")
    (root / "empty").mkdir()
    return model


def test_hf_checkpoint_directory_needs_consent_for_training_args(tmp_path: Path) -> None:
    root = tmp_path / "checkpoint-3"
    model = hf_checkpoint(root)

    with pytest.raises(FormatError, match=re.escape("training_args.bin")):
        inspect_directory(root)
    files = inspect_directory(root, allow_opaque_pickles=True)

    formats = {rel: layout.format for rel, layout in files}
    assert [rel for rel, _ in files] == sorted(formats)
    assert formats == {
        "extra/notes.txt": "opaque",
        "model.safetensors": "safetensors",
        "optimizer.pt": "torch-zip",
        "rng_state.pth": "torch-zip",
        "scheduler.pt": "torch-zip",
        "trainer_state.json": "opaque",
        "training_args.bin": "torch-zip",  # its pickle is kept as bytes, never loaded
    }
    layouts = dict(files)
    assert {r.name for r in layouts["model.safetensors"].regions} == set(model)
    assert "state.0.exp_avg_sq" in {r.name for r in layouts["optimizer.pt"].regions}
    assert [r.name for r in layouts["rng_state.pth"].regions] == ["cpu"]


def test_directory_symlinks_stay_inside_and_special_files_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.txt").write_text("a")
    (root / "alias.txt").symlink_to("sub/a.txt")
    (root / "sub_alias").symlink_to("sub", target_is_directory=True)
    assert [rel for rel, _ in inspect_directory(root)] == [
        "alias.txt",
        "sub/a.txt",
        "sub_alias/a.txt",
    ]

    (tmp_path / "secret").write_text("s")
    (root / "leak").symlink_to(tmp_path / "secret")
    with pytest.raises(FormatError, match="outside"):
        inspect_directory(root)
    (root / "leak").unlink()

    (root / "sub" / "loop").symlink_to("..", target_is_directory=True)
    with pytest.raises(FormatError, match="cycle"):
        inspect_directory(root)
    (root / "sub" / "loop").unlink()

    os.mkfifo(root / "pipe")
    with pytest.raises(FormatError, match="special file"):
        inspect_directory(root)
    for special in (root / "pipe", root / "sub"):
        with pytest.raises(FormatError, match="not a regular file"):
            inspect_file(special)


def test_flatten_state_names_tensors_by_dotted_path() -> None:
    state = {
        "model": {"fc.weight": torch.ones(2, 2), "layers": [torch.zeros(1), np.arange(3)]},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
        "meta": {"step": np.int64(45000), "tags": [], "note": None, "ok": True},
    }
    tensors, metadata = flatten_state(state)
    assert list(tensors) == [
        "model.fc.weight",
        "model.layers.0",
        "model.layers.1",
        "optimizer.state.0.step",
    ]
    assert tensors["model.layers.1"].dtype == torch.int64
    assert metadata["format"] == "pt"
    assert json.loads(metadata[VALUES_METADATA_KEY]) == {
        "optimizer.param_groups.0.lr": 0.1,
        "meta.step": 45000,
        "meta.tags": [],
        "meta.note": None,
        "meta.ok": True,
    }
    with pytest.raises(InvalidName, match=re.escape("a.b")):
        flatten_state({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}})
    with pytest.raises(FormatError, match="object"):
        flatten_state({"x": object()})
    looped: dict[str, object] = {}
    looped["self"] = looped
    with pytest.raises(FormatError, match="deeper"):
        flatten_state(looped)


def test_exported_safetensors_round_trip_and_dedup_with_the_source(tmp_path: Path) -> None:
    weight = torch.randn(3, 4)
    state = {
        "w": weight,
        "w_tied": weight,
        "t": weight.t(),
        "bf": torch.ones(5).bfloat16(),
        "be": np.arange(4, dtype=">i4"),
        "step": 7,
    }
    tensors, metadata = flatten_state(state)
    path = tmp_path / "out.safetensors"
    path.write_bytes(b"old")
    write_safetensors(tensors, metadata, path)

    loaded = safetensors.torch.load_file(path)
    assert torch.equal(loaded["w_tied"], weight) and torch.equal(loaded["t"], weight.t())
    assert loaded["be"].tolist() == [0, 1, 2, 3]
    layout = inspect_file(path)
    assert json.loads(layout.metadata[VALUES_METADATA_KEY]) == {"step": 7}
    for region in layout.regions:
        assert region_bytes(path, region) == tensor_bytes(loaded[region.name])
    assert os.listdir(tmp_path) == ["out.safetensors"]


def test_exported_torch_file_round_trips_and_failed_writes_leave_the_old_file(
    tmp_path: Path,
) -> None:
    state = trained_state()
    path = tmp_path / "out.pt"
    write_torch(state, path)
    loaded = torch.load(path, weights_only=True)
    assert_bit_exact(loaded, state)  # every tensor's dtype, shape and bytes; every other value
    originals = named_tensors(state)
    regions = inspect_file(path).regions
    assert {r.name for r in regions} == set(originals)
    for region in regions:
        assert region_bytes(path, region) == tensor_bytes(originals[region.name]), region.name

    before = path.read_bytes()
    with pytest.raises(FormatError):
        write_safetensors({"bad": torch.ones(2).to_sparse()}, None, path)
    with pytest.raises(FormatError, match="strings"):
        write_safetensors({"w": torch.ones(1)}, {"step": 3}, path)  # type: ignore[dict-item]  # the wrong type on purpose
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["out.pt"]
