"""The retention manager seed: eval metrics ranked by keep_best, a metric nobody records warned
about, a top-level latest in `cas status`, and daily snapshots taken by plan_forget().execute()."""

from __future__ import annotations

from pathlib import Path

import torch

import cas
from cas.retention.policy import Best, DailySnapshot, RetentionPolicy, Rule
from tests.helpers import run_cli
from tests.retention_helpers import DAY, HOUR, FakeClock, memory_repo, utc
from tests.test_integrations import Tokens, hf_args, tiny_bert


def test_hf_callback_stores_eval_loss_so_keep_best_protects_the_best_checkpoint(
    tmp_path: Path,
) -> None:
    from transformers import Trainer

    from cas.training.integrations.hf import CASCallback

    repo = cas.open(tmp_path / "store")
    args = hf_args(tmp_path / "out", max_steps=6, eval_strategy="steps", eval_steps=2)
    Trainer(model=tiny_bert(), args=args, train_dataset=Tokens(), eval_dataset=Tokens(),
            callbacks=[CASCallback(repo, "runs/bert")]).train()  # fmt: skip

    losses = {
        r.name: repo.manifest(r.name).meta["metrics"]["eval_loss"]
        for r in repo.refs("runs/bert")
        if "ckpt_" in r.name
    }
    assert len(losses) == 3
    best = min(losses, key=losses.__getitem__)
    policy = RetentionPolicy(rules=(Rule("runs/bert/ckpt_*", keep_last=1,
                                         keep_best=(Best("eval_loss"),)),))  # fmt: skip
    plan = repo.plan_forget(policy)
    assert plan.decision(best).keep
    assert any("best eval_loss" in r for r in plan.decision(best).reasons)
    assert not plan.warnings


def _saved(repo: cas.Repository, name: str, step: int, **metrics: float) -> None:
    repo.save({"model": {"w": torch.full((64,), float(step))}}, name,
              {"step": step, "metrics": metrics})  # fmt: skip


def test_a_keep_best_metric_that_no_checkpoint_records_is_warned_about_in_the_plan() -> None:
    repo = memory_repo(FakeClock(utc("2026-11-20 00:00")))
    for step in (1, 2, 3):
        _saved(repo, f"checkpoints/checkpoint-{step}", step, loss=1.0 / step)
    policy = RetentionPolicy(rules=(Rule("checkpoints/*", keep_last=1,
                                         keep_best=(Best("eval_los"),)),))  # fmt: skip
    plan = repo.plan_forget(policy)
    assert any("eval_los" in w and "protects none" in w for w in plan.warnings)
    ranked = RetentionPolicy(rules=(Rule("checkpoints/*", keep_last=1,
                                         keep_best=(Best("loss"),)),))  # fmt: skip
    assert not repo.plan_forget(ranked).warnings


def test_cas_status_shows_latest_and_best_of_a_top_level_latest(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    for step, eval_loss in ((1000, 0.7), (2000, 0.5), (3000, 0.6)):
        _saved(repo, f"checkpoints/checkpoint-{step}", step, eval_loss=eval_loss)
    repo.cp("checkpoints/checkpoint-3000", "latest")
    repo.cp("checkpoints/checkpoint-2000", "best")

    runs = repo.status().runs
    assert [(r.run, r.latest.ref) for r in runs] == [("", "checkpoints/checkpoint-3000")]
    assert [(p, c.ref) for p, c in runs[0].best] == [("best", "checkpoints/checkpoint-2000")]
    shown = run_cli(tmp_path / "store", "status")
    assert shown.returncode == 0, shown.stderr
    assert "run (top level): latest checkpoints/checkpoint-3000" in shown.stdout
    assert "best best: checkpoints/checkpoint-2000" in shown.stdout


def test_plan_forget_execute_takes_the_daily_snapshot_as_forget_does() -> None:
    start = utc("2026-11-20 00:00")
    clock = FakeClock(start + 10 * HOUR)
    repo = memory_repo(clock)
    policy = RetentionPolicy(
        rules=(Rule("checkpoints/*", keep_last=1),),
        snapshots=(DailySnapshot("checkpoints/*", keep=3),),
    )
    for step in (1, 2):
        clock.set(start + (10 + step) * HOUR)
        _saved(repo, f"checkpoints/checkpoint-{step}", step)
    clock.set(start + DAY + 3 * HOUR)

    plan = repo.plan_forget(policy)
    assert repo.ref_names("snapshots/") == []  # planning changes nothing
    plan.execute()

    assert repo.ref_names("snapshots/") == ["snapshots/2026-11-21"]
    assert repo.ref_names("checkpoints/") == ["checkpoints/checkpoint-2"]
