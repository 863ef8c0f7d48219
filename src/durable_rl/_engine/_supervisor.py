"""The driver's supervisor: runs the driver as a child process and restarts it when it dies."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import IO

EXIT_RUN_FAILED = 3  # the driver's exit code for a run that failed for good (not a crash)


def supervise(run_id: str, url: str, driver_retries: int, step_lines: IO[str]) -> bool:
    """Run the driver until the run completes; True when it did, False when it gave up."""
    env = {**os.environ, "DURABLE_RL_DB": url, "PYTHONUNBUFFERED": "1"}
    for restart in range(driver_retries + 1):
        proc = subprocess.run(
            [sys.executable, "-m", "durable_rl._engine._driver", run_id], env=env, stdout=step_lines, check=False
        )
        if proc.returncode == 0:
            return True
        if proc.returncode == EXIT_RUN_FAILED:
            return False
        if restart < driver_retries:
            print(
                f"driver of {run_id} died (exit {proc.returncode}); restarting it "
                f"({restart + 1} of {driver_retries} restarts); it resumes from the record",
                file=sys.stderr,
                flush=True,
            )
    print(
        f"driver of {run_id} died {driver_retries + 1} times; `durable-rl resume {run_id}` finishes it",
        file=sys.stderr,
        flush=True,
    )
    return False
