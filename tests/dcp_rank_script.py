"""One rank of a 2-process gloo job that saves a sharded DTensor through cas and loads it back.

Run by tests/test_integrations.py: ``python dcp_rank_script.py STORE RANK WORLD PORT``. Each rank
writes its own shard and a rank-only tensor; the load reads the tensor back *replicated* (DCP
reshards across the shards the two ranks wrote) and prints ``ok <rank>``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import cas
from cas.training.integrations.dcp import CASStorageReader, CASStorageWriter


def main(store: str, rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    state: dict[str, Any] = {
        "weight": distribute_tensor(full, mesh, [Shard(0)]),
        f"only_rank{rank}": torch.full((1000,), float(rank)),
        "step": 7,
    }
    repo = cas.open(store)
    save(state, storage_writer=CASStorageWriter(repo), checkpoint_id="runs/dist/step7")
    dist.barrier()

    target: dict[str, Any] = {
        "weight": distribute_tensor(torch.zeros(64, 8), mesh, [Replicate()]),
        f"only_rank{rank}": torch.zeros(1000),
        "step": 0,
    }
    load(target, storage_reader=CASStorageReader(repo), checkpoint_id="runs/dist/step7")
    weight = target["weight"]
    assert isinstance(weight, DTensor) and torch.equal(weight.to_local(), full), "reshard differs"
    assert torch.equal(target[f"only_rank{rank}"], torch.full((1000,), float(rank)))
    assert target["step"] == 7
    dist.barrier()
    dist.destroy_process_group()
    print(f"ok {rank}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
