"""A write that landed on the real S3 server but whose reply was lost is recognised as ours.

SeaweedFS sits behind ``LossyProxy``, which lets the server carry out a request and then closes
the connection unanswered (or answers 500). cas's retrying store is the one retry layer: it
retries, finds the key already written by its own first attempt (412), checks that the blob
holds its own bytes, and carries on. The push reports the ref it moved, GC keeps the lock it
took, a save records its event once.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import cas
from cas.names import RefName
from cas.refs.keys import ref_key
from cas.refs.maintenance import MAINTENANCE_LOCK_KEY
from cas.repo.config import StoreConfig
from cas.retention.gc import GCSettings
from cas.testing.lossy_proxy import LossRule, LossyProxy, writes_key
from cas.testing.seaweed import SeaweedServer

pytestmark = pytest.mark.s3

ROOT = Path(__file__).resolve().parent.parent
CONFIG = StoreConfig(chunk_size=16 << 10, inline_max=64)
NO_GRACE = GCSettings(grace=0, reflog_window=0)


@pytest.fixture
def proxy(seaweed: SeaweedServer) -> Iterator[LossyProxy]:
    """A proxy in front of the session's SeaweedFS that loses nothing until told to."""
    with LossyProxy(seaweed.endpoint_url) as running:
        yield running


def state(seed: int) -> dict[str, Any]:
    """A small checkpoint of a few chunks."""
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 128, generator=generator), "step": seed}


def through(proxy: LossyProxy, url: str) -> cas.Repository:
    """The store at ``url``, reached through the proxy."""
    return cas.open(url, config=CONFIG, endpoint_url=proxy.url)


def lose_first(proxy: LossyProxy, key: str, mode: str) -> None:
    """Lose the reply to the next conditional write of ``key`` (the server still performs it)."""
    proxy.set_rule(LossRule(fraction=1.0, select=writes_key(key), limit=1, mode=mode))


@pytest.mark.parametrize("mode", ["close", "500"])
def test_a_push_whose_ref_write_lost_its_reply_reports_success_and_the_ref_moved(
    tmp_path: Path, s3_url: str, proxy: LossyProxy, mode: str
) -> None:
    local = cas.open(tmp_path / "local", config=CONFIG)
    target = local.save(state(1), "gates/best")
    remote = through(proxy, s3_url)
    lose_first(proxy, ref_key(RefName("gates/best")), mode)

    report = local.push(remote, ["gates/best"])

    assert len(proxy.lost) == 1  # the reply to the ref's create was lost
    assert [(r.name, r.status) for r in report.refs] == [("gates/best", "created")]
    direct = cas.open(s3_url)
    assert direct.resolve("gates/best") == target
    assert len(direct.log("gates/best")) == 1


def test_gc_whose_lock_take_lost_its_reply_recognises_its_own_lock_and_completes(
    s3_url: str, proxy: LossyProxy
) -> None:
    repo = through(proxy, s3_url)
    repo.save(state(1), "runs/r1/dropped")
    repo.rm("runs/r1/dropped")  # its chunks are garbage now
    repo.save(state(2), "runs/r1/latest")
    time.sleep(1.05)  # S3 mtimes count whole seconds: garbage of this second is not yet older
    lose_first(proxy, MAINTENANCE_LOCK_KEY, "close")

    result = repo.plan_gc(NO_GRACE).execute()

    assert len(proxy.lost) == 1
    assert result.deleted_chunks > 0
    assert repo.maintenance_lock_holder() is None  # taken, used and released: it was ours
    torch.testing.assert_close(cas.open(s3_url).load("runs/r1/latest")["w"], state(2)["w"])


@pytest.mark.parametrize("mode", ["close", "500"])
def test_a_save_whose_history_append_lost_its_reply_records_one_event(
    s3_url: str, proxy: LossyProxy, mode: str
) -> None:
    repo = through(proxy, s3_url)
    repo.save(state(1), "runs/r1/latest")
    lose_first(proxy, ref_key(RefName("runs/r1/latest")), mode)

    second = repo.save(state(2), "runs/r1/latest")

    assert len(proxy.lost) == 1
    events = cas.open(s3_url).log("runs/r1/latest")
    assert len(events) == 2
    assert events[0].target == second


def _soak() -> ModuleType:
    path = ROOT / "scripts" / "soak_lossy_s3.py"
    spec = importlib.util.spec_from_file_location("soak_lossy_s3", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_with_5_percent_of_replies_lost_gc_completes_and_nothing_is_misreported_or_lost(
    seaweed: SeaweedServer, s3_url: str, tmp_path: Path
) -> None:
    figures = _soak().run(
        rounds=2, loss=0.05, seed=7, savers=2, server=seaweed, url=s3_url, work=tmp_path
    )

    assert figures["rounds"] == 2
    assert figures["replies_lost"] > 0
    assert figures["gc_completed"] == 2
    assert figures["push_misreports"] == 0
    assert figures["saves_lost"] == 0
    assert figures["duplicate_events"] == 0
