"""A manager with a mirror store pushes gates and best there, so a rotted gate can be healed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cas
from cas.errors import CASError
from cas.repo.config import StoreConfig
from cas.training.manager import CheckpointManager
from tests.helpers import assert_bit_exact, local_root

LOSSES = [3.0, 1.0, 2.0]


def _weights(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4096, generator=generator)}


def _open(root: Path) -> cas.Repository:
    return cas.open(root, config=StoreConfig(chunk_size=4096))


def _rot_first_chunk(repo: cas.Repository, ref: str) -> None:
    digest = next(c.digest for t in repo.manifest(ref).tensors for c in t.chunks)
    path = local_root(repo) / f"chunks/{digest[:2]}/{digest}"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_gate_mirrored_on_promotion_is_healed_from_the_mirror_after_rot(tmp_path: Path) -> None:
    repo, archive = _open(tmp_path / "store"), _open(tmp_path / "archive")
    with CheckpointManager(
        repo, run="r1", signals=False, best=("loss", "min"), mirror=archive
    ) as mgr:
        for step, loss in enumerate(LOSSES, start=1):
            saved = mgr.save(step, _weights(step), {"loss": loss}).result()
            assert saved.mirror_error is None
        mgr.promote_gate("bc_best")
    # best moved at steps 1 and 2 and was pushed each time; the gate was pushed on promotion.
    for ref in ("runs/r1/gates/bc_best", "runs/r1/phase1/best"):
        assert (
            archive.resolve(ref)
            == repo.resolve(ref)
            == repo.resolve("runs/r1/phase1/ckpt_phase1_step00000002")
        )
    assert archive.ref_names() == ["runs/r1/gates/bc_best", "runs/r1/phase1/best"]

    _rot_first_chunk(repo, "runs/r1/gates/bc_best")
    store, archive_url = str(tmp_path / "store"), str(tmp_path / "archive")
    args = ["--store", store, "verify", "--full", "--repair-from", archive_url]
    result = subprocess.run(
        [sys.executable, "-m", "cas", *args, "runs/r1/gates/bc_best"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "repaired: 1 objects healed, 0 refs still broken" in result.stdout
    assert_bit_exact(repo.load("runs/r1/gates/bc_best")["state"], _weights(2))


def test_a_mirror_given_as_a_url_is_opened_and_a_failed_gate_push_is_an_error(
    tmp_path: Path,
) -> None:
    repo = _open(tmp_path / "store")
    mirror_url = str(tmp_path / "archive")
    with CheckpointManager(repo, run="r1", signals=False, mirror=mirror_url) as mgr:
        mgr.save(1, _weights(1)).result()
        mgr.promote_gate("g")
        assert cas.open(mirror_url, create=False).ref_names() == ["runs/r1/gates/g"]
        mgr.mirror = cas.open(mirror_url, readonly=True)  # the archive refuses writes now
        with pytest.raises(CASError, match="gate runs/r1/gates/h is promoted, but not mirrored"):
            mgr.promote_gate("h")
    assert repo.find_ref("runs/r1/gates/h") is not None
