"""Run names: run ids and the ref name templates a training run's checkpoints are stored under.

(Not to be confused with ``cas.formats.layout``, where the tensors are inside a file.) By default a
run id ``YYYYMMDD_HHmmss_<seed_hex8>`` sorts runs by start time and names the master seed, and
every name below zero-pads steps to 8 digits, so lexicographic order is chronological order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Ref name templates; ``{run}`` is the run prefix (``runs/<id>``).

    Gates live under their run, so two runs that promote a gate of the same name keep both;
    ``Layout(gate="gates/{name}")`` shares one store-wide gate between runs on purpose.
    ``latest`` may name ``{phase}`` (``"{run}/phase{phase}/latest"``): each phase then keeps its
    own pointer, which saves of that phase move and ``restore`` of that phase reads.
    """

    checkpoint: str = "{run}/phase{phase}/ckpt_phase{phase}_step{step:08d}"
    latest: str = "{run}/latest"
    best: str = "{run}/phase{phase}/best"
    gate: str = "{run}/gates/{name}"
    history: str = "{run}/history"
    pool: str = "{run}/phase{phase}/opponent_pool"


DEFAULT_LAYOUT = Layout()


def new_run_id(seed: int, clock: Callable[[], float] = time.time) -> str:
    """``YYYYMMDD_HHmmss_<seed_hex8>`` in UTC: sortable by start time, traceable to the seed."""
    stamp = time.strftime("%Y%m%d_%H%M%S", time.gmtime(clock()))
    return f"{stamp}_{seed & 0xFFFFFFFF:08x}"


def run_prefix(run: str) -> str:
    """``runs/<run>`` for a bare run id; a name with a ``/`` is used as the prefix as it is."""
    return run if "/" in run else f"runs/{run}"
