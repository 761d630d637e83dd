"""RNG state capture and restore: torch CPU, CUDA (when present), numpy's global and Python's random.

``capture()`` returns a plain nesting of ints, floats, lists, numpy arrays and tensors that
``cas.model.state`` stores without pickle; ``restore()`` puts every generator back exactly where it was,
so the next random draw after a resume equals the next draw of a run that never stopped.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from cas.errors import FormatError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("cas.training.rng")

RNG_FORMAT_VERSION = 1


def capture() -> dict[str, Any]:
    """The current state of every global generator a training loop usually draws from."""
    import torch

    py_version, py_state, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "version": RNG_FORMAT_VERSION,
        # 624 Mersenne Twister words and the position: one array leaf, not 625 int nodes.
        "python": {
            "version": py_version,
            "state": np.asarray(py_state, dtype=np.uint32),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "kind": str(kind),
            "keys": np.asarray(keys, dtype=np.uint32).copy(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state().clone(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return state


def restore(state: Mapping[str, Any]) -> list[str]:
    """Put every generator back to ``state``; return warnings about what could not be restored."""
    import torch

    if state.get("version") != RNG_FORMAT_VERSION:
        raise FormatError(f"unknown RNG state version {state.get('version')!r}")
    warnings: list[str] = []
    try:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
        npy = state["numpy"]
        np.random.set_state(
            (
                str(npy["kind"]),
                np.asarray(npy["keys"], dtype=np.uint32),
                int(npy["pos"]),
                int(npy["has_gauss"]),
                float(npy["cached_gaussian"]),
            )
        )
        torch.set_rng_state(_as_byte_tensor(state["torch"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise FormatError(f"RNG state in the checkpoint is malformed: {e}") from e
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            warnings.append("the checkpoint holds CUDA RNG states but CUDA is not available here")
        elif len(cuda) != torch.cuda.device_count():
            warnings.append(
                f"the checkpoint holds {len(cuda)} CUDA RNG states but "
                f"{torch.cuda.device_count()} devices are visible; CUDA RNG not restored"
            )
        else:
            torch.cuda.set_rng_state_all([_as_byte_tensor(s) for s in cuda])
    for warning in warnings:
        log.warning(warning)
    return warnings


def seed_all(seed: int) -> None:
    """Seed Python, numpy's global and torch (all devices) from one integer."""
    import torch

    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.manual_seed(seed)


def phase_seed(seed: int, phase: int) -> int:
    """The seed of one training phase: a SeedSequence child, stable across numpy versions."""
    return int(np.random.SeedSequence(seed, spawn_key=(phase,)).generate_state(1)[0])


def _as_byte_tensor(value: Any) -> torch.Tensor:
    import torch

    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
        raise FormatError("RNG state tensor must be a uint8 tensor")
    return value.cpu().contiguous()
