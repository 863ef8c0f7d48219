"""The driver process: `python -m durable_rl._engine._driver RUN_ID`, database in DURABLE_RL_DB.

Its own failure domain: the supervisor restarts it when it dies, and it resumes the run from
the record. Step lines go to stdout, everything else to stderr.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from ._store import Store
from ._supervisor import EXIT_RUN_FAILED


def main(argv: list[str]) -> int:
    run_id, url = argv[0], os.environ["DURABLE_RL_DB"]
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    store = Store(url)
    attempt = store.add_attempt(run_id)
    from ._dbos import run_driver  # after the attempt is on record, however long DBOS takes to start

    try:
        asyncio.run(run_driver(run_id, url, store, attempt, sys.stdout))
    except Exception as e:
        print(f"run {run_id} failed: {type(e).__name__}: {e}", file=sys.stderr)
        store.set_status(run_id, "failed")
        return EXIT_RUN_FAILED
    store.set_status(run_id, "succeeded")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
