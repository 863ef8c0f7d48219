"""The same durability on PostgreSQL: the URL is the only difference."""

from __future__ import annotations

from conftest import CLEAN_V1, FAST, FAULTS, Cli, figures


def test_crash_run_and_reuse_on_postgres(pg_cli: Cli) -> None:
    out = pg_cli.json(
        "train",
        "--run-id",
        "pg",
        *FAST,
        *FAULTS,
    )
    assert figures(out) == CLEAN_V1
    c = out["counters"]
    assert (c["generate_executed"], c["judge_task_attempts"], c["judge_calls"], c["driver_attempts"]) == (24, 24, 18, 2)
    again = pg_cli.json("train", "--run-id", "pg-again", *FAST)
    assert figures(again) == CLEAN_V1
    assert (again["counters"]["judge_calls"], again["counters"]["generate_reused"]) == (0, 18)
    assert not (pg_cli.cwd / ".durable-rl" / "state.sqlite").exists()
