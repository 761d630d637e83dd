"""Repository.load_into: a resume reads a checkpoint into the tensors it already has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import cas
from cas.errors import FormatError, IntegrityError, NotFound
from tests.helpers import ref_chunk_paths


def state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(512, 1024, generator=gen), "b": torch.randn(16, generator=gen)},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(512, 1024, generator=gen)}}},
        "step": torch.tensor(7),
        "mask": torch.rand(1000, generator=gen) > 0.5,
    }


def zeros_like(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    return {k: zeros_like(v) for k, v in tree.items()}


def test_a_resume_fills_its_own_tensors_in_place(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    saved = state(1)
    repo.save(saved, "runs/a/step-7")
    target = zeros_like(saved)
    where = {id(t): t.data_ptr() for t in (target["model"]["w"], target["step"])}
    assert repo.load_into("runs/a/step-7", target) is target
    assert torch.equal(target["model"]["w"], saved["model"]["w"])
    assert torch.equal(
        target["optimizer"]["state"][0]["exp_avg"], saved["optimizer"]["state"][0]["exp_avg"]
    )
    assert torch.equal(target["mask"], saved["mask"]) and int(target["step"]) == 7
    assert {id(t): t.data_ptr() for t in (target["model"]["w"], target["step"])} == where


def test_a_target_that_does_not_match_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    repo.save(state(2), "runs/a/ckpt")
    wrong_shape = zeros_like(state(2))
    wrong_shape["model"]["b"] = torch.zeros(17)
    with pytest.raises(FormatError, match=r"model\.b is float32\[16\], target float32\[17\]"):
        repo.load_into("runs/a/ckpt", wrong_shape)
    assert not wrong_shape["model"]["w"].any()  # untouched: checked before any read
    extra = zeros_like(state(2))
    extra["model"]["new_head"] = torch.zeros(4)
    with pytest.raises(NotFound, match=r"no tensor at model\.new_head"):
        repo.load_into("runs/a/ckpt", extra)
    strided = {"model": {"w": torch.zeros(1024, 512).t()}}
    with pytest.raises(FormatError, match="contiguous CPU tensors"):
        repo.load_into("runs/a/ckpt", strided)


def test_a_subset_of_the_state_loads_alone_and_aliases_are_both_filled(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    saved = state(3)
    repo.save(saved, "runs/a/ckpt")
    w = torch.zeros(512, 1024)
    target = {"model": {"w": w}, "optimizer": {"state": {0: {"exp_avg": torch.zeros(512, 1024)}}}}
    repo.load_into("runs/a/ckpt", target)
    assert torch.equal(w, saved["model"]["w"])
    # Saved as one tensor under two paths (tied weights): both targets are filled.
    twice: dict[str, Any] = {
        "model": {"w": torch.zeros(512, 1024)},
        "copy": {"model": {"w": torch.zeros(512, 1024)}},
    }
    repo.save(
        {"model": {"w": saved["model"]["w"]}, "copy": {"model": {"w": saved["model"]["w"]}}},
        "runs/tied",
    )
    repo.load_into("runs/tied", twice)
    assert torch.equal(twice["model"]["w"], saved["model"]["w"])
    assert torch.equal(twice["copy"]["model"]["w"], saved["model"]["w"])


def test_a_damaged_chunk_is_an_integrity_error_not_bytes_in_the_model(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    repo.save(state(4), "runs/a/ckpt")
    for path in ref_chunk_paths(repo, "runs/a/ckpt"):
        if path.stat().st_size > 1 << 20:
            data = bytearray(path.read_bytes())
            data[-1] ^= 1
            path.chmod(0o644)
            path.write_bytes(bytes(data))
            break
    with pytest.raises(IntegrityError):
        repo.load_into("runs/a/ckpt", zeros_like(state(4)))
