"""Two tiers for a run: saves land locally, drain to a remote in the background, each tier keeps
its own retention, and a run resumes from whichever tier holds the newest good checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from click.testing import CliRunner

import cas
from cas.cli import cli
from cas.repo.config import StoreConfig
from cas.retention.policy import RetentionPolicy, Rule
from cas.training.manager import CheckpointManager
from cas.training.run_names import Layout
from tests.helpers import assert_bit_exact, local_root

CKPT = "runs/r1/phase1/ckpt_phase1_step{:08d}"
EVERY_FOURTH = "runs/*/phase*/ckpt_*[048]"
"""Steps 4, 8, 10, 14...: a glob stands for "every Nth step" in the remote policy."""


def _weights(step: int, size: int = 4096) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(size, generator=generator)}


def _open(root: Path) -> cas.Repository:
    return cas.open(root, config=StoreConfig(chunk_size=4096))


def _keep_last(n: int, *protect: str) -> RetentionPolicy:
    rule = Rule("runs/*/phase*/ckpt_*", keep_last=n, protect=protect)
    return RetentionPolicy(rules=(rule,))


def test_every_save_drains_to_the_remote_with_latest_and_best_after_it(tmp_path: Path) -> None:
    local, remote = _open(tmp_path / "local"), _open(tmp_path / "remote")
    mgr = CheckpointManager(local, run="r1", signals=False, best=("loss", "min"), remote=remote)
    losses = [3.0, 1.0, 2.0, 4.0]
    for step, loss in enumerate(losses, start=1):
        saved = mgr.save(step, _weights(step), {"loss": loss}).result()
        assert saved.remote_lag is not None and saved.remote_lag.saves >= 1
    mgr.promote_gate("bc_best")
    assert mgr.tier is not None
    lag = mgr.tier.wait(30)
    assert (lag.saves, lag.bytes, lag.error) == (0, 0, None)
    assert mgr.tier.idle  # and asking started no cycle: it stays so
    assert mgr.tier.idle
    mgr.close()
    for step in range(1, 5):
        assert remote.resolve(CKPT.format(step)) == local.resolve(CKPT.format(step))
    assert remote.resolve("runs/r1/latest") == local.resolve(CKPT.format(4))
    assert remote.resolve("runs/r1/phase1/best") == local.resolve(CKPT.format(2))
    assert remote.resolve("runs/r1/gates/bc_best") == local.resolve(CKPT.format(2))
    # The remote's latest moved once per checkpoint, each naming its checkpoint ref.
    events = [e.message for e in remote.log("runs/r1/latest")]
    assert events == [CKPT.format(s) for s in (4, 3, 2, 1)]
    assert_bit_exact(remote.load("runs/r1/latest")["state"], _weights(4))


def test_a_restarted_run_finishes_the_drain_its_predecessor_left(tmp_path: Path) -> None:
    local, remote = _open(tmp_path / "local"), _open(tmp_path / "remote")
    # The first process saves with no remote tier at all (as if killed before any drain).
    with CheckpointManager(local, run="r1", signals=False) as first:
        for step in (1, 2, 3):
            first.save(step, _weights(step)).result()
    assert remote.ref_names() == []
    with CheckpointManager(local, run="r1", signals=False, remote=remote) as second:
        assert second.tier is not None
        assert second.tier.wait(30).saves == 0
        assert second.tier.drained == 3
    assert remote.ref_names("runs/r1/phase1/ckpt_*") == [CKPT.format(s) for s in (1, 2, 3)]
    assert remote.resolve("runs/r1/latest") == local.resolve(CKPT.format(3))


def test_local_retention_spares_what_the_remote_policy_keeps_until_it_is_there(
    tmp_path: Path,
) -> None:
    local, remote = _open(tmp_path / "local"), _open(tmp_path / "remote")
    mgr = CheckpointManager(
        local, run="r1", signals=False, async_save=False, policy=_keep_last(2),
        remote=remote, remote_policy=_keep_last(2, EVERY_FOURTH),
    )  # fmt: skip
    assert mgr.tier is not None
    mgr.tier.close(0)  # the remote is unreachable from now on: nothing drains
    for step in range(1, 7):
        mgr.save(step, _weights(step))
    # Local keep-last 2 would leave steps 5 and 6; step 4 waits for the remote (every 4th).
    names = local.ref_names("runs/r1/phase1/ckpt_*")
    assert names == [CKPT.format(s) for s in (4, 5, 6)]
    decision = local.plan_forget(_keep_last(2)).decision(CKPT.format(4))
    assert not decision.keep  # the plain policy drops it: the tier's guard kept it
    mgr.close()


def test_a_tier_behind_passes_over_what_the_remote_policy_would_not_keep(tmp_path: Path) -> None:
    local, remote = _open(tmp_path / "local"), _open(tmp_path / "remote")
    with CheckpointManager(local, run="r1", signals=False) as first:
        for step in range(1, 11):  # ten saves the remote never saw
            first.save(step, _weights(step)).result()
    policy = _keep_last(2, EVERY_FOURTH)
    with CheckpointManager(
        local, run="r1", signals=False, remote=remote, remote_policy=policy, remote_queue=4
    ) as second:
        assert second.tier is not None
        lag = second.tier.wait(30)
        # Steps 1-3 and 5-7 are passed over, every one (none goes up only to be removed).
        assert lag.saves == 0 and lag.skipped == 6
        assert second.tier.drained == 4
    # Kept by the remote policy: every 4th step (4, 8, 10) and the last two (9, 10).
    assert remote.ref_names("runs/r1/phase1/ckpt_*") == [CKPT.format(s) for s in (4, 8, 9, 10)]
    assert remote.resolve("runs/r1/latest") == local.resolve(CKPT.format(10))


def test_resume_on_an_empty_machine_pulls_the_newest_checkpoint_from_the_remote(
    tmp_path: Path,
) -> None:
    first_node, remote = _open(tmp_path / "node1"), _open(tmp_path / "remote")
    base = {"backbone": _weights(0, 65536)["w"]}  # frozen, and cached on the new node already
    with CheckpointManager(first_node, run="r1", signals=False, remote=remote) as mgr:
        for step in (1, 2):
            mgr.save(step, {**base, **_weights(step)}).result()
        assert mgr.tier is not None and mgr.tier.wait(30).saves == 0
    new_node = _open(tmp_path / "node2")
    new_node.save({"base": base}, "models/base")
    chunks_before = _chunk_files(new_node)
    mgr = CheckpointManager(new_node, run="r1", signals=False, remote=remote)
    restored = mgr.restore("auto")
    assert (restored.mode, restored.step, restored.ref) == ("resume", 2, CKPT.format(2))
    assert_bit_exact(restored.state, {**base, **_weights(2)})
    # Loaded straight from the remote (the base read here): nothing written locally yet.
    assert _chunk_files(new_node) == chunks_before
    mgr.close()  # the next save, or the close, keeps the checkpoint in the local tier
    assert new_node.resolve("runs/r1/latest") == remote.resolve(CKPT.format(2))
    # Only what the base does not hold travelled (the head and the RNG states).
    wanted = set(new_node.manifest(CKPT.format(2)).chunk_digests())
    travelled = _chunk_files(new_node) - chunks_before
    assert travelled == wanted - chunks_before
    assert 0 < len(travelled) < len(wanted) // 4


def test_a_corrupt_local_chunk_is_healed_from_the_remote_on_resume(tmp_path: Path) -> None:
    local, remote = _open(tmp_path / "local"), _open(tmp_path / "remote")
    with CheckpointManager(local, run="r1", signals=False, remote=remote) as mgr:
        mgr.save(1, _weights(1)).result()
        mgr.save(2, _weights(2)).result()
        assert mgr.tier is not None and mgr.tier.wait(30).saves == 0
    digest = next(c.digest for t in local.manifest(CKPT.format(2)).tensors for c in t.chunks)
    path = local_root(local) / f"chunks/{digest[:2]}/{digest}"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with CheckpointManager(local, run="r1", signals=False, remote=remote) as mgr:
        restored = mgr.restore("auto")
    # The newest checkpoint, not the one before it: the bad chunk came back from the remote.
    assert (restored.step, restored.fallbacks) == (2, [])
    assert_bit_exact(restored.state, _weights(2))
    assert_bit_exact(local.load(CKPT.format(2))["state"], _weights(2))


def _chunk_files(repo: cas.Repository) -> set[str]:
    return {p.name for p in (local_root(repo) / "chunks").glob("*/*")}


def test_cas_status_shows_the_remote_tier_and_what_it_lacks(tmp_path: Path) -> None:
    local, remote = _open(tmp_path / "local"), _open(tmp_path / "remote")
    mgr = CheckpointManager(local, run="r1", signals=False, async_save=False, remote=remote)
    assert mgr.tier is not None
    mgr.tier.close(0)  # nothing drains: both saves wait for the remote
    mgr.save(1, _weights(1))
    mgr.save(2, _weights(2))
    mgr.close()
    store = ["--store", str(tmp_path / "local"), "status"]
    shown = CliRunner().invoke(cli, store)
    assert shown.exit_code == 0, shown.output
    assert f"remote tier  {remote.url}: 2 saves (" in shown.output
    as_json = CliRunner().invoke(cli, [*store, "--json"])
    tier = json.loads(as_json.output)["remote_tier"]
    # Both saves' weights (and their RNG states) are missing there.
    assert tier["saves"] == 2 and tier["bytes"] >= 2 * 4096 * 4 and tier["error"] is None
    with CheckpointManager(local, run="r1", signals=False, remote=remote) as again:
        assert again.tier is not None and again.tier.wait(30).saves == 0
    shown = CliRunner().invoke(cli, store)
    assert f"remote tier  {remote.url}: up to date" in shown.output


def test_a_run_resumed_on_a_new_node_goes_on_with_the_history_its_predecessor_drained(
    tmp_path: Path,
) -> None:
    remote = _open(tmp_path / "remote")
    with CheckpointManager(
        _open(tmp_path / "node1"), run="r1", signals=False, remote=remote
    ) as mgr:
        mgr.record(1, loss=3.0)
        mgr.save(1, _weights(1)).result()
        mgr.record(2, loss=2.0)
        mgr.save(2, _weights(2)).result()
        assert mgr.tier is not None and mgr.tier.wait(30).saves == 0
    node2 = _open(tmp_path / "node2")
    with CheckpointManager(node2, run="r1", signals=False, remote=remote) as mgr:
        assert mgr.restore("auto").step == 2
        mgr.record(3, loss=1.0)
        mgr.save(3, _weights(3)).result()
        assert mgr.tier is not None and mgr.tier.wait(30).saves == 0
    losses = [r["loss"] for r in mgr.history.read() if "loss" in r]
    assert losses == [3.0, 2.0, 1.0]
    # The remote holds the same history: a third node would go on from all of it.
    assert remote.resolve("runs/r1/history") == node2.resolve("runs/r1/history")


def test_a_per_phase_latest_moves_on_the_remote_for_each_phase_the_run_saves_in(
    tmp_path: Path,
) -> None:
    local, remote = _open(tmp_path / "local"), _open(tmp_path / "remote")
    layout = Layout(latest="{run}/phase{phase}/latest")
    with CheckpointManager(local, run="r1", signals=False, remote=remote, layout=layout) as mgr:
        mgr.save(1, _weights(1)).result()
        mgr.phase = 2
        mgr.save(2, _weights(2)).result()
        assert mgr.tier is not None and mgr.tier.wait(30).saves == 0
    for phase in (1, 2):
        ref = f"runs/r1/phase{phase}/latest"
        assert remote.resolve(ref) == local.resolve(ref)
    # A new node resumes from the phase the run was last in.
    with CheckpointManager(
        _open(tmp_path / "node2"), run="r1", signals=False, remote=remote, layout=layout, phase=2
    ) as mgr:
        assert mgr.restore("auto").step == 2


def test_remote_retry_sets_how_soon_a_failed_drain_is_tried_again(tmp_path: Path) -> None:
    blocker = tmp_path / "not-yet"
    blocker.write_text("a file where the remote's parent directory should be")
    remote_dir = blocker / "remote"  # opening it fails until the file makes way
    with CheckpointManager(
        _open(tmp_path / "local"), run="r1", signals=False, remote=str(remote_dir),
        remote_retry=0.05,
    ) as mgr:  # fmt: skip
        assert mgr.tier is not None
        mgr.save(1, _weights(1)).result()
        deadline = time.monotonic() + 10
        while mgr.tier.lag().error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mgr.tier.lag().error is not None  # the first attempt failed
        blocker.unlink()
        blocker.mkdir()
        # Retries 0.05 s, 0.1 s, 0.2 s... apart reach it well within the default first 2 s.
        deadline = time.monotonic() + 1.5
        while mgr.tier.lag().saves and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mgr.tier.lag().saves == 0
