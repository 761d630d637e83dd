"""Real ``.pt`` files: a torch.save file that holds more than tensors still dedups tensor by tensor."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cas.errors import FormatError
from cas.formats import inspect_file
from tests.helpers import run_cli, small_chunk_repo


@dataclasses.dataclass
class TrainConfig:
    """A config class a training script saves next to its weights."""

    lr: float = 3e-4
    layers: int = 4


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"model.w": torch.randn(512, 256), "model.v": torch.randn(4096)}


@pytest.mark.parametrize(
    "extra",
    [
        argparse.Namespace(lr=3e-4, batch=32),
        TrainConfig(),
        np.random.default_rng(7),
        np.random.RandomState(3),
    ],
    ids=["argparse-namespace", "config-class", "numpy-generator", "numpy-randomstate"],
)
def test_pt_with_a_non_tensor_object_shares_its_tensors_with_saved_ones(
    tmp_path: Path, extra: object
) -> None:
    repo = small_chunk_repo(tmp_path / "store", chunk_size=16 << 10)
    state = _state()
    repo.save({"model": {"w": state["model.w"], "v": state["model.v"]}}, "api/state")
    file = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": state["model.w"], "v": state["model.v"]}, "args": extra}, file)

    repo.put_path(file, "files/ckpt", allow_opaque_pickles=True)

    api_chunks = {c.digest for t in repo.manifest("api/state").tensors for c in t.chunks}
    file_entry = repo.manifest("files/ckpt").files["ckpt.pt"]
    assert api_chunks <= {c.digest for c in file_entry.chunks}
    # Only the pickle record and the zip's own records are new.
    assert repo.last_write.new_bytes < 0.02 * file.stat().st_size
    names = {r.name for r in file_entry.regions}
    assert {"model.w", "model.v"} <= names
    out = tmp_path / "out.pt"
    repo.get_path("files/ckpt", out)
    assert out.read_bytes() == file.read_bytes()


def test_pt_with_a_namespace_is_refused_without_consent_and_cut_with_it(tmp_path: Path) -> None:
    file = tmp_path / "ckpt.pt"
    torch.save({"w": torch.randn(64, 64), "args": argparse.Namespace(lr=1.0)}, file)
    with pytest.raises(FormatError, match=r"argparse\.Namespace"):
        inspect_file(file)
    layout = inspect_file(file, allow_opaque_pickles=True)
    assert layout.format == "torch-zip"
    assert [(r.name, r.dtype, r.shape) for r in layout.regions] == [("w", "float32", (64, 64))]


def test_cli_put_of_a_pt_with_args_adds_under_one_percent_next_to_its_stored_tensors(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    repo = small_chunk_repo(store, chunk_size=256 << 10)
    torch.manual_seed(1)
    state = {"w": torch.randn(2048, 1024), "b": torch.randn(1024)}  # 8 MiB of tensors
    repo.save(state, "api/state")
    repo.close()
    file = tmp_path / "train.pt"
    torch.save({**state, "args": argparse.Namespace(lr=3e-4, epochs=3)}, file)

    done = run_cli(store, "put", "--allow-opaque-pickles", "--json", str(file), "files/train")

    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["new_bytes"] < 0.01 * file.stat().st_size, report
    assert report["reused_chunks"] >= 32
    out = tmp_path / "back.pt"
    assert run_cli(store, "get", "files/train", str(out)).returncode == 0
    assert out.read_bytes() == file.read_bytes()
