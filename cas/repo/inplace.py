"""Load a checkpoint into tensors that already exist, as ``torch.distributed.checkpoint`` does.

A resume holds its model's and optimizer's tensors already; reading a checkpoint into new ones and
copying them over (``load_state_dict``) writes every byte twice and faults in a checkpoint's worth
of fresh memory. ``Repository.load_into`` reads each chunk straight into the target tensor's own
memory, verified as any read (invariant 2), after checking every path, dtype and shape first, so
a mismatch leaves the target untouched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cas.errors import FormatError, NotFound
from cas.model.state import iter_tensor_paths, target_tensors, torch_dtype_name

if TYPE_CHECKING:
    import torch

    from cas.model.manifest import Manifest


def plan_into(ref: str, manifest: Manifest, target: Any) -> dict[int, list[torch.Tensor]]:
    """The target tensors each stored tensor is read into; FormatError or NotFound naming the
    first path that cannot be filled in place, before anything is read."""
    if manifest.kind != "state":
        raise FormatError(f"{ref} holds files, not a saved state: load_into fills a state")
    stored = dict(iter_tensor_paths(manifest.tree))
    plan: dict[int, list[torch.Tensor]] = {}
    for path, tensor in target_tensors(target):
        index = stored.get(path)
        if index is None:
            raise NotFound(f"{ref} has no tensor at {path}")
        entry = manifest.tensors[index]
        have = f"{torch_dtype_name(tensor.dtype)}{list(tensor.shape)}"
        if entry.kind != "torch" or f"{entry.dtype}{list(entry.shape)}" != have:
            raise FormatError(f"{ref}: {path} is {entry.dtype}{list(entry.shape)}, target {have}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.is_conj():
            raise FormatError(
                f"{path}: load_into fills contiguous CPU tensors; load() and copy for the rest"
            )
        plan.setdefault(index, []).append(tensor)
    return plan
