"""Numpy arrays in any byte order round-trip: a big-endian array (a file written on another
machine, ``np.dtype('>f4')``) is stored little-endian and comes back with its values, its kind
and size of element, in the host's own order, so ``torch.from_numpy`` takes it as it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import cas
from cas.model.state import buffer_over, tensor_from_bytes
from cas.repo.config import StoreConfig

BIG = [">f2", ">f4", ">f8", ">i2", ">i4", ">i8", ">u2", ">u4", ">c8", ">c16"]
OTHERS = [">M8[ns]", ">m8[s]", ">U3"]


def _values(dtype: str, n: int = 5000) -> np.ndarray[Any, Any]:
    if dtype.startswith(">U"):
        return np.array([f"{i % 997}" for i in range(n)], dtype=dtype)
    base = np.arange(n, dtype=np.int64) * 37 % 1009 - 400
    if np.dtype(dtype).kind == "u":
        base = np.abs(base)
    if np.dtype(dtype).kind == "c":
        return (base + 1j * base[::-1]).astype(dtype)
    return base.astype(dtype)


@pytest.fixture
def repo(tmp_path: Path) -> cas.Repository:
    return cas.open(tmp_path / "s", config=StoreConfig(chunk_size=4096, inline_max=64), fsync=False)


@pytest.mark.parametrize("dtype", BIG + OTHERS)
def test_a_big_endian_array_loads_with_its_values_in_the_hosts_order(
    repo: cas.Repository, dtype: str
) -> None:
    array = _values(dtype)
    state = {"whole": array, "strided": array[::3], "zero_d": array[7:8].reshape(())}
    repo.save(state, "ckpt")
    loaded = repo.load("ckpt")
    for name, original in state.items():
        got = loaded[name]
        assert got.dtype == original.dtype.newbyteorder("="), name
        assert got.dtype.isnative and got.shape == original.shape, name
        assert np.array_equal(got, original), f"{name}: values changed on the way"


@pytest.mark.parametrize("dtype", BIG)
def test_torch_takes_a_loaded_big_endian_array_as_it_is(repo: cas.Repository, dtype: str) -> None:
    array = _values(dtype)
    repo.save({"a": array}, "ckpt")
    tensor = torch.from_numpy(repo.load("ckpt")["a"])
    assert torch.equal(tensor, torch.from_numpy(array.astype(array.dtype.newbyteorder("="))))


def test_the_same_values_in_either_byte_order_share_their_chunks(repo: cas.Repository) -> None:
    little = _values("<f4", 20_000)
    repo.save({"a": little}, "little")
    repo.save({"a": little.astype(">f4")}, "big")
    chunks = [
        {c.digest for t in repo.manifest(r).tensors for c in t.chunks} for r in ("little", "big")
    ]
    assert chunks[0] == chunks[1]


@pytest.mark.parametrize("dtype", [">f4", ">i8", ">c16"])
def test_an_entry_that_records_a_big_endian_dtype_loads_swapped_into_the_hosts_order(
    dtype: str,
) -> None:
    # cas writes little-endian entries only; one another tool wrote with its bytes big-endian
    # must still come back with its values, in an order torch takes.
    array = _values(dtype, 64)
    loaded = tensor_from_bytes("numpy", dtype, array.shape, buffer_over(bytearray(array.tobytes())))
    assert loaded.dtype.isnative and np.array_equal(loaded, array)
    assert torch.from_numpy(loaded).shape == array.shape
