"""Invariant 8: what comes out of the store is byte-identical to what went in."""

from __future__ import annotations

import mmap
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import cas
from cas.digest import Digest
from cas.objects.store import chunk_key
from tests.helpers import assert_bit_exact, local_root, small_chunk_repo, trained_state

ALL_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
    torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every bit pattern is possible, NaN payloads and denormals included."""
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = int(np.prod(shape)) if shape else 1
    raw = torch.randint(0, 256, (count * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    repo = small_chunk_repo(tmp_path / "store", chunk_size=4096)
    state = {
        "big": _random_bits((300, 70), dtype, 1),
        "scalar": _random_bits((), dtype, 2),
        "empty": torch.empty((0, 3), dtype=dtype),
        "row": _random_bits((7,), dtype, 3),
    }
    repo.save(state, "t/dtypes")
    assert_bit_exact(state, repo.load("t/dtypes"))


def test_special_float_values_survive(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    specials = torch.tensor(
        [float("nan"), -0.0, float("inf"), -float("inf"), 1e-45, -1e-45, 5e-324]
    )
    payload_nans = (
        torch.tensor([0x7FC00001, 0x7F800001, 0xFFC12345], dtype=torch.int64)
        .to(torch.int32)
        .view(torch.float32)
    )
    state = {
        "f64": specials.double(),
        "f32": torch.cat([specials.float(), payload_nans]),
        "bf16": specials.bfloat16(),
    }
    repo.save(state, "t/special")
    assert_bit_exact(state, repo.load("t/special"))


def test_non_contiguous_and_storage_sharing_views(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store", chunk_size=4096)
    base = torch.randn(64, 128)
    state = {
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "slice": base[10:20],
        "expanded": torch.randn(1, 16).expand(32, 16),
        "conj": torch.randn(8, dtype=torch.complex64).conj(),
        "base": base,
    }
    repo.save(state, "t/views")
    back = repo.load("t/views")
    for key, value in state.items():
        assert torch.equal(back[key], value.resolve_conj()), key
    assert back["strided"].is_contiguous()


def test_tied_weights_come_back_tied(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    embedding = torch.randn(100, 32)
    repo.save({"embed": embedding, "lm_head": embedding}, "t/tied")
    back = repo.load("t/tied")
    assert back["embed"] is back["lm_head"]
    assert len(repo.manifest("t/tied").tensors) == 1


def test_real_adamw_training_state_round_trips(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store")
    state = trained_state(steps=5, width=96)
    state["numpy_rng"] = np.random.default_rng(7).bit_generator.state
    state["legacy_numpy_rng"] = np.random.RandomState(3).get_state()
    state["python_rng"] = random.Random(5).getstate()
    state["metrics"] = {
        "loss": np.float32(0.25), "lr": np.float64(1e-3), "accuracy": 0.9, "nan": float("nan")
    }  # fmt: skip
    state["flags"] = [True, None, b"\x00\x01", 2**70, -(2**63), torch.bfloat16, torch.device("cpu")]
    repo.save(state, "runs/r1/ckpt_step00000005", metadata={"step": 5, "phase": 1})
    back = repo.load("runs/r1/ckpt_step00000005")
    assert_bit_exact(state, back)
    model = torch.nn.Sequential(torch.nn.Linear(96, 192), torch.nn.GELU(), torch.nn.Linear(192, 8))
    model.load_state_dict(back["model"], strict=True)
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(back["optimizer"])
    assert opt.state_dict()["state"][0]["exp_avg_sq"].equal(
        state["optimizer"]["state"][0]["exp_avg_sq"]
    )
    restored = random.Random()
    restored.setstate(back["python_rng"])
    reference = random.Random(5)
    assert restored.random() == reference.random()


def test_int_keys_tuples_and_order_preserved(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    state = {3: "three", "b": (1, [2, {"x": None}]), 1: 1.5, "a": []}
    repo.save(state, "t/plain")
    back = repo.load("t/plain")
    assert_bit_exact(state, back)
    assert list(back) == [3, "b", 1, "a"]


def test_keys_selection_reads_only_needed_chunks(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store", chunk_size=4096)
    state = trained_state(width=64)
    repo.save(state, "t/sel")
    manifest = repo.manifest("t/sel")
    reads: list[Digest] = []
    original = repo.objects.read_chunk_into

    def counting(digest: Digest, out: memoryview, *, encoded: bool = False) -> None:
        reads.append(digest)
        original(digest, out, encoded=encoded)

    repo.objects.read_chunk_into = counting  # type: ignore[method-assign]
    back = repo.load("t/sel", keys="model.*")
    assert set(back) == {"model"}
    assert_bit_exact(state["model"], back["model"])
    model_chunks = {c.digest for t in manifest.tensors[:4] for c in t.chunks}
    assert reads and set(reads) <= model_chunks


def test_mmap_load_of_local_raw_store(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    state = {"w": torch.randn(256, 256), "small": torch.arange(10)}
    repo.save(state, "t/mm")
    back = repo.load("t/mm", mmap=True)
    assert_bit_exact(state, back)
    back["w"].add_(1)  # copy-on-write: the stored chunk is untouched
    assert_bit_exact(state, repo.load("t/mm"))


def store_files(root: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every file and directory under ``root``: its bytes (None for a directory) and mtime."""
    return {
        str(path.relative_to(root)): (
            None if path.is_dir() else path.read_bytes(),
            path.stat().st_mtime_ns,
        )
        for path in sorted(root.rglob("*"))
    }


def mapped_files() -> set[str]:
    """Paths of the files this process has mapped into memory (Linux)."""
    with open("/proc/self/maps") as maps:
        return {line.split(maxsplit=5)[5].strip() for line in maps if len(line.split()) == 6}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_a_read_only_store_maps_chunks_in_place_and_never_writes(tmp_path: Path) -> None:
    writer = cas.open(tmp_path / "store")
    state = {
        "w": torch.randn(256, 256),
        "half": torch.randn(64, 64).half(),
        "small": torch.arange(10),
        "step": 7,
    }
    writer.save(state, "t/mm")
    root = local_root(writer)
    before = store_files(root)
    reader = cas.open(root, readonly=True)

    back = reader.load("t/mm", mmap=True)
    assert_bit_exact(state, back)
    # The chunk files of the stored tensors are mapped, not read into fresh buffers.
    chunked = [t for t in reader.manifest("t/mm").tensors if t.chunks]
    assert len(chunked) == 2 and all(len(t.chunks) == 1 for t in chunked)
    chunk_files = {str(root / chunk_key(t.chunks[0].digest)) for t in chunked}
    assert chunk_files <= mapped_files()

    back["w"].add_(1)  # copy-on-write: neither the file nor a second load sees it
    assert_bit_exact(state, reader.load("t/mm", mmap=True))
    with pytest.raises(cas.ReadOnlyError):
        reader.save(state, "t/other")
    assert store_files(root) == before


def test_map_location_and_unsupported_values(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    repo.save({"w": torch.ones(3)}, "t/ml")
    assert repo.load("t/ml", map_location="cpu")["w"].device.type == "cpu"
    with pytest.raises(cas.FormatError, match="never pickles"):
        repo.save({"bad": object()}, "t/bad")
    with pytest.raises(cas.FormatError, match="objects"):
        repo.save({"bad": np.array([object()])}, "t/bad")
    with pytest.raises(cas.NotFound):
        repo.resolve("t/bad")


def test_keys_selection_drops_unselected_empty_containers(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    state = {
        "model": {"w": torch.ones(2)},
        "optimizer": {"state": {}, "param_groups": []},
        "empty": {},
    }
    repo.save(state, "t/empty")
    assert set(repo.load("t/empty", keys="model.*")) == {"model"}
    both = repo.load("t/empty", keys=["model.*", "empty"])
    assert set(both) == {"model", "empty"} and both["empty"] == {}


def test_a_read_only_local_store_loads_by_mmap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {"w": torch.randn(256, 256)}
    cas.open(tmp_path / "store").save(state, "t/mm")
    repo = cas.open(tmp_path / "store", readonly=True)
    mapped: list[int] = []
    real_mmap = mmap.mmap

    def counting_mmap(fileno: int, length: int, **kwargs: Any) -> mmap.mmap:
        mapped.append(fileno)
        return real_mmap(fileno, length, **kwargs)

    monkeypatch.setattr(mmap, "mmap", counting_mmap)
    assert_bit_exact(state, repo.load("t/mm", mmap=True))
    assert len(mapped) == 1  # the one chunk of ``w``, mapped through the read-only view


# -- sparse tensors -------------------------------------------------------------------------------


def sparse_examples() -> dict[str, torch.Tensor]:
    """COO (uncoalesced with a repeated index, coalesced, hybrid with dense values) and CSR, with
    values of every bit pattern."""
    gen = torch.Generator().manual_seed(7)
    indices = torch.tensor([[0, 3, 3, 1, 0], [2, 0, 0, 4, 2]])
    values = _random_bits((5,), torch.float32, 1)
    dense = torch.randn(6, 7, generator=gen) * (torch.rand(6, 7, generator=gen) > 0.7)
    return {
        "coo": torch.sparse_coo_tensor(indices, values, (4, 5)),
        "coo_coalesced": torch.sparse_coo_tensor(indices, values, (4, 5)).coalesce(),
        "coo_hybrid": torch.sparse_coo_tensor(
            indices, _random_bits((5, 3), torch.bfloat16, 2), (4, 5, 3)
        ),
        "csr": dense.to_sparse_csr(),
        "csr_int32": torch.sparse_csr_tensor(
            torch.tensor([0, 2, 2, 3], dtype=torch.int32),
            torch.tensor([1, 4, 0], dtype=torch.int32),
            _random_bits((3,), torch.float64, 3),
            (3, 5),
        ),
    }


def assert_same_sparse(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.layout == want.layout and got.shape == want.shape
    if want.layout == torch.sparse_coo:
        assert got.is_coalesced() == want.is_coalesced()
        pairs = [(got._indices(), want._indices()), (got._values(), want._values())]
    else:
        pairs = [(got.crow_indices(), want.crow_indices()), (got.col_indices(), want.col_indices()),
                 (got.values(), want.values())]  # fmt: skip
    for a, b in pairs:
        assert_bit_exact(a, b)


def test_sparse_coo_and_csr_tensors_round_trip_bit_exact(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    sparse, dense = sparse_examples(), torch.ones(3)
    repo.save({"embedding": sparse, "dense": dense}, "runs/thalia/ckpt")
    loaded = repo.load("runs/thalia/ckpt")
    for name, tensor in sparse.items():
        assert_same_sparse(loaded["embedding"][name], tensor)
    assert torch.equal(loaded["dense"], dense)
    # A sparse tensor is one value: selecting it (or a part of it) loads it whole.
    only = repo.load("runs/thalia/ckpt", keys=["embedding.csr", "embedding.coo.values"])
    assert sorted(only["embedding"]) == ["coo", "csr"]
    assert_same_sparse(only["embedding"]["coo"], sparse["coo"])
    repo.cp("runs/thalia/ckpt", "runs/thalia/weights", only=["embedding.coo_hybrid"])
    assert_same_sparse(
        repo.load("runs/thalia/weights")["embedding"]["coo_hybrid"], sparse["coo_hybrid"]
    )


def test_a_sparse_layout_cas_does_not_store_is_a_clear_error(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    csc = torch.eye(3).to_sparse_csc()
    with pytest.raises(cas.FormatError, match=r"sparse_csc.*COO.*CSR"):
        repo.save({"w": csc}, "runs/x/ckpt")


def test_sparse_parts_that_do_not_form_a_tensor_are_a_format_error() -> None:
    from cas.model.state import build_sparse

    # What a damaged or hostile manifest could name: an index past the size, checked on load.
    with pytest.raises(cas.FormatError, match="no sparse coo tensor"):
        build_sparse("coo", [torch.tensor([[5]]), torch.tensor([1.0])], (2,))
    with pytest.raises(cas.FormatError, match="no sparse csr tensor"):
        build_sparse("csr", [torch.tensor([0, 3]), torch.tensor([0]), torch.tensor([1.0])], (1, 2))
