"""The seed projects' open needs on the training side: Hydra's per-phase latest, Cobre's free
template dimension and system hash, ANDREA's pivot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import cas
from cas.repo.config import StoreConfig
from cas.training.manager import CheckpointManager
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
