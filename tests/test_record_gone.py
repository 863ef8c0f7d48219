"""A SQLite state file deleted or replaced under a running `train`: SQLite would go on writing to
the deleted file's open inode (or the run would go on beside another record), and the run would
say "succeeded" for a record no one can read. Instead the run stops with one line on stderr and
a non-zero exit, and nothing says it succeeded."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from conftest import FAST, Cli


def _step_recorded(db: Path, run_id: str) -> bool:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            return bool(conn.execute("select count(*) from drl_steps where run_id = ?", (run_id,)).fetchone()[0])
    except sqlite3.Error:
        return False  # not made yet


def _gone_mid_run(cli: Cli, run_id: str, how: str) -> tuple[subprocess.Popen[str], str, str]:
    db = cli.cwd / ".durable-rl" / "state.sqlite"
    proc = cli.popen("train", "--run-id", run_id, *FAST, "--turn-latency", "0.1", "--n-steps", "6", "--json")
    deadline = time.monotonic() + 120
    while not _step_recorded(db, run_id):  # step 0 recorded: the run is in the middle
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    before = os.stat(db)
    if how == "deleted":
        for leftover in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
            leftover.unlink(missing_ok=True)
    else:  # another file under the same name: a copy, moved into place
        copy = db.with_name("copy.sqlite")
        shutil.copyfile(db, copy)
        os.replace(copy, db)
        assert os.stat(db).st_ino != before.st_ino
    stdout, stderr = proc.communicate(timeout=180)
    return proc, stdout, stderr


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_state_file_gone_under_a_run_stops_it_in_one_line(cli: Cli, how: str) -> None:
    proc, stdout, stderr = _gone_mid_run(cli, "gone", how)
    assert proc.returncode != 0, (stdout, stderr[-3000:])
    said = [line for line in stderr.splitlines() if line.strip() and not line.startswith(("step ", "  … "))]
    assert len(said) == 1, stderr[-3000:]
    db = cli.cwd / ".durable-rl" / "state.sqlite"
    assert said[0].startswith(f"run gone stopped: its state database {db} was {how}"), said
    assert "succeeded" not in stdout + stderr and "Traceback" not in stderr
    assert stdout == ""
