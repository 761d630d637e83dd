"""Tied weights load tied: tensors sharing storage when saved share it when loaded, as torch.load does."""

from __future__ import annotations

from pathlib import Path

import torch

import cas
from cas.training.async_save import Stager


class TinyLM(torch.nn.Module):
    """An embedding whose matrix is also the output head, as GPT-2 and T5 tie them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, 64)
        self.lm_head = torch.nn.Linear(64, 256, bias=False)
        self.lm_head.weight = self.embed.weight


def test_lm_head_tied_to_the_embedding_loads_sharing_one_storage(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    model = TinyLM()
    state = model.state_dict()
    assert state["lm_head.weight"] is not state["embed.weight"]  # two objects, one storage

    repo.save({"model": state}, "runs/r1/ckpt")

    assert len(repo.manifest("runs/r1/ckpt").tensors) == 1  # stored once
    loaded = repo.load("runs/r1/ckpt")["model"]
    embed, head = loaded["embed.weight"], loaded["lm_head.weight"]
    assert torch.equal(embed, model.embed.weight.detach())
    assert embed.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()
    fresh = TinyLM()
    fresh.load_state_dict(loaded)
    assert fresh.lm_head.weight is fresh.embed.weight


def test_views_of_one_storage_that_differ_stay_separate_tensors(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    base = torch.randn(8, 8)
    repo.save({"w": base, "t": base.t(), "row": base[2]}, "r")
    loaded = repo.load("r")
    assert len(repo.manifest("r").tensors) == 3
    assert torch.equal(loaded["t"], base.t()) and torch.equal(loaded["row"], base[2])


def test_the_background_save_copy_keeps_state_dict_ties_in_one_buffer() -> None:
    state = TinyLM().state_dict()
    stager = Stager()
    copy = stager.snapshot(state, stager.acquire())
    assert copy["lm_head.weight"] is copy["embed.weight"]
