"""Dedup: identical bytes are stored once, whichever API or file format brought them in."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.helpers import chunk_files, small_chunk_repo, stored_bytes, trained_state


def test_saving_the_same_state_twice_writes_no_chunk_bytes(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store")
    state = trained_state(width=128)
    repo.save(state, "runs/r1/ckpt_a")
    before_files, before_bytes = chunk_files(repo), stored_bytes(repo)
    repo.save(state, "runs/r1/ckpt_b")
    assert repo.last_write.new_bytes == 0 and repo.last_write.new_chunks == 0
    assert chunk_files(repo) == before_files and stored_bytes(repo) == before_bytes


def test_gate_copy_writes_no_chunk(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store")
    digest = repo.save(trained_state(), "runs/r1/phase1/ckpt_phase1_step00001000")
    before = chunk_files(repo)
    assert repo.cp("runs/r1/phase1/ckpt_phase1_step00001000", "gates/bc_best") == digest
    assert chunk_files(repo) == before
    assert repo.resolve("gates/bc_best") == digest


def test_weights_only_snapshot_costs_no_chunk_bytes(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store")
    state = trained_state(width=128)
    repo.save(state, "runs/r1/ckpt")
    before = chunk_files(repo)
    repo.cp("runs/r1/ckpt", "daily/2026-11-21", only="model.*")
    assert chunk_files(repo) == before
    snapshot = repo.load("daily/2026-11-21")
    assert set(snapshot) == {"model"}
    assert all(torch.equal(snapshot["model"][k], v) for k, v in state["model"].items())


def test_checkpoints_differing_in_one_tensor_share_every_other_chunk(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store", chunk_size=16 << 10)
    torch.manual_seed(1)
    state = {f"layer{i}.weight": torch.randn(64, 256) for i in range(8)}
    repo.save(state, "a")
    changed = dict(state)
    changed["layer3.weight"] = state["layer3.weight"] + 1
    repo.save(changed, "b")
    a, b = repo.manifest("a"), repo.manifest("b")
    chunks_a = [[c.digest for c in t.chunks] for t in a.tensors]
    chunks_b = [[c.digest for c in t.chunks] for t in b.tensors]
    for i in range(8):
        if i == 3:
            assert not set(chunks_a[i]) & set(chunks_b[i])
        else:
            assert chunks_a[i] == chunks_b[i]
    assert repo.last_write.new_chunks == len(chunks_b[3])


def test_unchanged_slice_of_a_changed_tensor_still_dedups(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store", chunk_size=4096)
    weight = torch.randn(1024, 64)
    repo.save({"w": weight}, "a")
    edited = weight.clone()
    edited[0, 0] += 1
    repo.save({"w": edited}, "b")
    assert repo.last_write.new_chunks == 1
    assert repo.last_write.reused_chunks == 64 * 1024 * 4 // 4096 - 1


def test_tensor_saved_from_python_and_ingested_from_safetensors_share_chunks(
    tmp_path: Path,
) -> None:
    repo = small_chunk_repo(tmp_path / "store", chunk_size=16 << 10)
    torch.manual_seed(2)
    tensors = {
        "encoder.weight": torch.randn(128, 256),
        "decoder.weight": torch.randn(256, 64).bfloat16(),
    }
    repo.save(tensors, "api/model")
    file = tmp_path / "model.safetensors"
    save_file(tensors, file)
    before = chunk_files(repo)
    repo.put_path(file, "files/model")
    added = chunk_files(repo) - before
    api_chunks = {c.digest for t in repo.manifest("api/model").tensors for c in t.chunks}
    file_manifest = repo.manifest("files/model")
    region_chunks = {c.digest for t in file_manifest.tensors for c in t.chunks}
    assert api_chunks == region_chunks
    assert len(added) == 1  # only the safetensors JSON header is new
    assert repo.last_write.new_bytes < 4096


def test_tensors_in_a_torch_save_file_share_chunks_with_the_api(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store", chunk_size=16 << 10)
    state = {"w": torch.randn(256, 128), "v": torch.randn(512)}
    repo.save(state, "api/state")
    file = tmp_path / "state.pt"
    torch.save(state, file)
    repo.put_path(file, "files/state")
    api_chunks = {c.digest for t in repo.manifest("api/state").tensors for c in t.chunks}
    file_chunks = {c.digest for c in repo.manifest("files/state").files["state.pt"].chunks}
    assert api_chunks <= file_chunks
    new_tensor_bytes = repo.last_write.new_bytes
    assert new_tensor_bytes < 8192
