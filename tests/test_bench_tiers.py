"""``scripts/bench_tiers.py`` runs end to end with small sizes against its own SeaweedFS, and
every figure it reports is measured (the remote tier drained, each peer ran)."""

from __future__ import annotations

from pathlib import Path

from tests.prerequisites import require_weed
from tests.test_bench_peers import script


def test_quick_tiers_bench_measures_every_peer_against_its_own_seaweed(tmp_path: Path) -> None:
    require_weed()
    results = script("bench_tiers").run(True, tmp_path)
    spare = results["stall_loop_one_thread_spare_core"]  # None only on a one-CPU machine
    stalls = [results["stall"], results["stall_loop_one_thread"], *([spare] if spare else [])]
    for stall in stalls:
        # Every save of both tiered managers (drain worker, drain thread) reached S3.
        assert stall["drain_left_behind"] == stall["drain_thread_left_behind"] == 0
        assert stall["step_ms"] > 0
        for saver in (
            "cas_local_only", "cas_remote_tier", "cas_remote_tier_drain_thread",
            "dcp_async_save_s3",
        ):  # fmt: skip
            assert len(stall[saver]["rounds_ms"]) == stall["rounds"]  # one figure per round
    assert results["stall_loop_one_thread"]["threads"] == 1
    assert spare is None or (spare["threads"] == 1 and spare["spare_cores"])
    sent = results["bytes"]
    # The first checkpoint sends the frozen backbone; later ones only what changed.
    assert sent["first_checkpoint_sent_bytes"] > sent["later_checkpoint_sent_bytes_median"] > 0
    assert 0 < sent["sent_over_full"] < 1
    resume = sent["resume"]
    assert resume["cas_empty_machine_s"] > 0 and resume["boto3_pt_torch_load_s"] > 0
    # The same resumes in processes of their own (resume_child.py), each to its first step.
    for kind in ("cas_empty_machine", "cas_base_cached", "boto3_pt_torch_load"):
        whole, after_model = (
            resume[f"new_process_{kind}_s"],
            resume[f"new_process_{kind}_after_model_s"],
        )
        assert 0 < after_model < whole  # the child's own clocks: its resume after its model
    assert resume["new_process_empty_after_model_over_boto3"] > 0
    assert results["throughput"]["cas_drain_MBps"] > 0
    assert set(results["targets"]) == {
        "stall_tiered_over_local_le_1_05", "stall_tiered_at_or_below_dcp",
        "one_thread_loop_stall_tiered_over_local_le_1_05",
        "spare_core_loop_stall_tiered_over_local_le_1_05",
        "bytes_sent_over_full_le_0_15", "drain_over_boto3_ge_0_9", "resume_empty_le_boto3",
        "resume_new_process_empty_le_boto3",
    }  # fmt: skip
