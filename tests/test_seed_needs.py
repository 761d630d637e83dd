"""The seed projects' open needs on the training side: Hydra's per-phase latest, Cobre's free
template dimension and system hash, ANDREA's pivot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import cas
from cas.repo.config import StoreConfig
from cas.training.manager import CheckpointManager, StrictLoadError, SystemMismatch, TensorSpec
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
