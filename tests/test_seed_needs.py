"""The seed projects' open needs on the training side: Hydra's per-phase latest, Cobre's free
template dimension and system hash, ANDREA's pivot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import cas
from cas.repo.config import StoreConfig
from cas.training.history import TrainingHistory
from cas.training.manager import (
    CheckpointManager,
    ConfigMismatch,
    StrictLoadError,
    SystemMismatch,
    TensorSpec,
)
from cas.training.run_names import Layout


def _repo(tmp_path: Path) -> cas.Repository:
    return cas.open(tmp_path / "store", config=StoreConfig(chunk_size=16 << 10))


def _manager(repo: cas.Repository, **kw: Any) -> CheckpointManager:
    kw.setdefault("run", "r1")
    kw.setdefault("signals", False)
    return CheckpointManager(repo, **kw)


def test_hydra_keeps_a_latest_per_phase(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    layout = Layout(latest="{run}/phase{phase}/latest")
    w = torch.randn(32, 32)
    with _manager(repo, layout=layout, phase=1) as mgr:
        mgr.save(100, {"w": w}).result()
        mgr.save(200, {"w": w + 1}).result()
        assert mgr.latest() == "runs/r1/phase1/ckpt_phase1_step00000200"
        mgr.phase = 2  # the BC -> RL transition
        mgr.save(50, {"w": w + 2}).result()
        assert mgr.latest() == "runs/r1/phase2/ckpt_phase2_step00000050"
        mgr.save(60, {"w": w + 3}).result()

    assert repo.resolve("runs/r1/phase1/latest") == repo.resolve(
        "runs/r1/phase1/ckpt_phase1_step00000200"
    )
    assert repo.resolve("runs/r1/phase2/latest") == repo.resolve(
        "runs/r1/phase2/ckpt_phase2_step00000060"
    )
    with _manager(repo, layout=layout, phase=1) as mgr:
        restored = mgr.restore("resume")
        assert restored.step == 200 and torch.equal(restored.state["w"], w + 1)
    with _manager(repo, layout=layout, phase=2) as mgr:
        assert mgr.restore("resume").step == 60


def test_cobre_strict_template_takes_any_number_of_cuts_by_twelve_stages(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    with _manager(repo) as mgr:
        mgr.save(1, {"cuts": torch.randn(37, 12, dtype=torch.float64), "iteration": 1}).result()
    template = {"cuts": TensorSpec((None, 12), "float64"), "iteration": 0}
    with _manager(repo) as mgr:
        restored = mgr.restore("warm_start", template=template)
        assert restored.state["cuts"].shape == (37, 12)
        with pytest.raises(StrictLoadError, match=r"cuts: checkpoint .*12\).*\(\*, 13\)"):
            mgr.restore("warm_start", template={"cuts": TensorSpec((None, 13)), "iteration": 0})
        with pytest.raises(StrictLoadError, match="cuts"):
            mgr.restore("warm_start", template={"cuts": TensorSpec((None, 12), "float32"),
                                                "iteration": 0})  # fmt: skip


def test_cobre_resume_without_a_system_hash_into_a_run_saved_with_one_is_refused(
    tmp_path: Path,
) -> None:
    repo = _repo(tmp_path)
    with _manager(repo, system_hash="inputs-v1") as mgr:
        mgr.save(5, {"cuts": torch.randn(4, 12)}).result()
    with _manager(repo) as mgr:  # forgot to pass the inputs' hash
        with pytest.raises(SystemMismatch, match="passes no system_hash"):
            mgr.restore("resume")
        assert mgr.restore("resume", allow_system_change=True).step == 5
    with _manager(repo, system_hash="inputs-v1") as mgr:
        assert mgr.restore("resume").step == 5


def _andrea_state(model: torch.nn.Module, opt: torch.optim.Optimizer, position: int) -> Any:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "data_position": position}


def test_andrea_polish_pivot_keeps_weights_moments_rng_and_data_position(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opening: list[torch.Tensor] = []
    with _manager(repo, config={"lr": 1e-3, "caps": [1, 2]}, seed=7) as mgr:
        mgr.restore("fresh")
        for step in range(1, 5):
            batch = torch.randn(4, 8)
            opening.append(batch)
            model(batch).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mgr.record(step, loss=1.0 / step)
        mgr.save(4, _andrea_state(model, opt, 4)).result()
        never_stopped = torch.randn(4, 8)  # what step 5 would have drawn without the pivot

    new_config = {"lr": 3e-4, "caps": [1, 3]}
    with _manager(repo, config=new_config, seed=7) as mgr:
        with pytest.raises(ConfigMismatch):
            mgr.restore("resume")
        pivot = mgr.restore("pivot")
        step5 = torch.randn(4, 8)
        assert pivot.mode == "pivot" and pivot.step == 4 and pivot.state["data_position"] == 4
        assert torch.equal(step5, never_stopped)  # the random stream goes on...
        assert not torch.equal(step5, opening[0])  # ...and does not replay the opening
        moments = pivot.state["optimizer"]["state"][0]
        assert torch.equal(moments["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
        assert torch.equal(pivot.state["model"]["weight"], model.weight.detach())
        mgr.save(5, _andrea_state(model, opt, 5)).result()
    with _manager(repo, config=new_config, seed=7) as mgr:
        assert mgr.restore("resume").step == 5  # later resumes take the new config

    records = TrainingHistory(repo, "runs/r1/history").read()
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]  # the loss log goes on
    pivots = [r for r in records if r.get("event") == "pivot"]
    assert len(pivots) == 1 and pivots[0]["step"] == 4
    assert pivots[0]["config_diff"] == {"caps": [[1, 2], [1, 3]], "lr": [1e-3, 3e-4]}
    assert pivots[0]["config_from"] != pivots[0]["config_to"]
