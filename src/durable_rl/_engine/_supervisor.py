"""The driver's supervisor: runs the driver as a child process and restarts it when it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import IO

EXIT_RUN_FAILED = 3  # the driver's exit code for a run that failed for good (not a crash)
EXIT_ALREADY_DRIVEN = 4  # another live driver holds the run's lease
EXIT_STORAGE = 5  # the state database cannot be written (disk full, read-only): restarting would not help
LEASE_S = 15.0  # a driver's lease on its run; renewed every third of it, lapsing that long after a kill
STOP_GRACE_S = 30.0  # how long a driver asked to stop may take to cancel its trials and clean up


def _wait(proc: subprocess.Popen[bytes]) -> int:
    """The driver's exit code; on Ctrl-C, the driver is asked to stop (killed past the grace
    period or at a second Ctrl-C) and the KeyboardInterrupt goes on up."""
    try:
        return proc.wait()
    except KeyboardInterrupt:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # from a terminal it has one already: it stops once
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                proc.kill()
                proc.wait()
        raise


def _await_other_driver(run_id: str, url: str) -> bool:
    """Wait while another process holds the run's lease; True when the run ended succeeded."""
    from ._store import Store

    store = Store(url)
    while True:
        row = store.run(run_id)
        if row is None or row.status != "running":
            return row is not None and row.status == "succeeded"
        if store.lease_holder(run_id) is None:  # it died without finishing: `resume` takes it up
            return False
        time.sleep(0.5)


def supervise(run_id: str, url: str, driver_retries: int, step_lines: IO[str] | int) -> bool:
    """Run the driver until the run completes; True when it did, False when it gave up.
    `step_lines` takes the driver's step lines (subprocess.DEVNULL when the caller follows the record)."""
    env = {**os.environ, "DURABLE_RL_DB": url, "PYTHONUNBUFFERED": "1"}
    for restart in range(driver_retries + 1):
        code = _wait(
            subprocess.Popen([sys.executable, "-m", "durable_rl._engine._driver", run_id], env=env, stdout=step_lines)
        )
        if code == 0:
            return True
        if code in (EXIT_RUN_FAILED, EXIT_STORAGE):
            return False
        if code == EXIT_ALREADY_DRIVEN:  # another process drives it: follow it to its end
            return _await_other_driver(run_id, url)
        if restart < driver_retries:
            print(
                f"driver of {run_id} died (exit {code}); restarting it "
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
