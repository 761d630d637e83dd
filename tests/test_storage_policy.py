"""Thalia's storage precision policy and lossy delta: opt-in, recorded as lossy, never the default."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest
import torch

import cas
from cas.errors import FormatError
from cas.fs.filesystem import CASFileSystem
from tests.helpers import run_cli, small_chunk_repo


def _brain(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {"weights": torch.randn(256, 256), "membrane": torch.randn(256)}


def test_thalia_stores_weights_as_fp16_and_gets_fp32_back(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store")
    brain = _brain()
    state = {"model": brain, "step": 3}
    repo.save(state, "brain/fp32")
    repo.save(state, "brain/fp16", store_as={"model.weights": "float16"})

    loaded = repo.load("brain/fp16")["model"]
    assert loaded["weights"].dtype == torch.float32
    assert torch.equal(loaded["weights"], brain["weights"].half().float())
    assert torch.equal(loaded["membrane"], brain["membrane"])  # not matched: exact
    stored = {t.dtype for t in repo.manifest("brain/fp16").tensors}
    assert stored == {"float16", "float32"}
    assert repo.show("brain/fp16")["meta"]["lossy"] == {"store_as": {"model.weights": "float16"}}
    assert "lossy" not in repo.show("brain/fp32")["meta"]  # never the default
    assert torch.equal(repo.load("brain/fp32")["model"]["weights"], brain["weights"])
    with repo.open("brain/fp16") as ckpt:
        assert ckpt["model.weights"].dtype == torch.float32
        assert ckpt.get_slice("model.weights").get_dtype() == "float32"
        assert torch.equal(ckpt.get_slice("model.weights")[:4], loaded["weights"][:4])

    # The cas:// .pt view is of the stored bytes: the weights read as float16 there.
    fs = CASFileSystem(repo=repo, skip_instance_cache=True)
    viewed = torch.load(io.BytesIO(fs.cat_file("brain/fp16/model.pt")), weights_only=True)
    assert viewed["weights"].dtype == torch.float16

    shown = run_cli(tmp_path / "store", "show", "brain/fp16")
    assert shown.returncode == 0 and "lossy" in shown.stdout and "float16" in shown.stdout


def test_lossy_delta_keeps_the_parents_value_for_changes_below_the_threshold(
    tmp_path: Path,
) -> None:
    repo = small_chunk_repo(tmp_path / "store")
    before = _brain()
    repo.save({"model": before}, "brain/step1")
    nudged = before["weights"].clone()
    nudged[:128] += 1e-7  # below the threshold: kept from the parent
    nudged[200:] += 0.5  # above it: stored
    after = {"weights": nudged, "membrane": before["membrane"]}

    repo.save({"model": after}, "brain/step2", parent="brain/step1", lossy_delta=1e-5)

    loaded = repo.load("brain/step2")["model"]["weights"]
    assert torch.equal(loaded[:200], before["weights"][:200])
    assert torch.equal(loaded[200:], nudged[200:])
    assert repo.show("brain/step2")["meta"]["lossy"] == {"lossy_delta": {"*": 1e-5}}
    # Without the opt-in every change is kept, however small.
    repo.save({"model": after}, "brain/exact", parent="brain/step1")
    assert torch.equal(repo.load("brain/exact")["model"]["weights"], nudged)


def test_a_storage_policy_refuses_a_dtype_it_cannot_store_as(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    with pytest.raises(FormatError, match="int8"):
        repo.save({"w": torch.ones(3)}, "x", store_as={"*": "int8"})
    with pytest.raises(FormatError, match="lossy_delta"):
        repo.save({"w": torch.ones(3)}, "x", lossy_delta=-1.0)


@dataclasses.dataclass
class RegionConfig:
    """A Thalia-style config dataclass kept inside the state."""

    n_neurons: int = 128
    tau_mem: float = 20.0
    name: str = "cortex"


def test_a_config_dataclass_inside_the_state_comes_back_as_a_dict(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    repo.save({"config": RegionConfig(), "w": torch.ones(2)}, "brain/c")
    loaded = repo.load("brain/c")
    assert loaded["config"] == {"n_neurons": 128, "tau_mem": 20.0, "name": "cortex"}
    node = repo.manifest("brain/c").tree["items"][0][1]
    assert node["type"].endswith("RegionConfig")


@dataclasses.dataclass
class BadConfig:
    """A dataclass with a field cas cannot store."""

    callback: object = dataclasses.field(default_factory=object)


def test_a_dataclass_field_cas_cannot_store_is_named_in_the_error(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    with pytest.raises(FormatError, match=r"config\.callback"):
        repo.save({"config": BadConfig()}, "brain/bad")
