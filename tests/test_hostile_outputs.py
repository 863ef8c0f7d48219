"""Hostile trials against what the driver keeps of them: a command's stdout and stderr, and the
files a trial leaves for the kept trial folder. Checked from the host: `df` of the host's /tmp
and of the state folder's file system, inode counts, and the record's bytes.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Cli
from test_hostile import REWARD, _task

from durable_rl._engine._store import Store
from durable_rl._views import recorded

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the attacks run as root, as the red team ran them")
MB = 1 << 20


class FreeSpace:
    """The least free space seen on each file system while the run went, sampled from the host."""

    def __init__(self, *paths: Path) -> None:
        self.paths = paths
        self.start = {p: self.free(p) for p in paths}
        self.least = dict(self.start)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def free(path: Path) -> int:
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize

    def _sample(self) -> None:
        while not self.stop.is_set():
            for p in self.paths:
                self.least[p] = min(self.least[p], self.free(p))
            time.sleep(0.02)

    def dropped(self) -> dict[Path, int]:
        return {p: self.start[p] - self.least[p] for p in self.paths}


@pytest.fixture
def free_space(cli: Cli) -> Iterator[FreeSpace]:
    state = cli.cwd / ".durable-rl"
    state.mkdir(exist_ok=True)
    watch = FreeSpace(Path("/tmp"), state)
    watch.thread.start()
    try:
        yield watch
    finally:
        watch.stop.set()
        watch.thread.join()


def _trials(cli: Cli, run_id: str) -> dict[str, dict[str, Any]]:
    return {t["trial_id"].split("-", 1)[1].rsplit("-", 1)[0]: t for t in cli.json("show", run_id, "--trials")}


def _trajectory(cli: Cli, trial: dict[str, Any]) -> dict[str, Any]:
    traj = recorded(Store(cli.db), trial["generate_identity"])
    assert traj is not None, trial
    return traj


FLOOD = """\
python3 -c '
import os
for fd in (1, 2):
    try:
        os.posix_fallocate(fd, 0, 2 << 30)
        said = "fallocated"
    except OSError as e:
        said = e.strerror
    open(f"/logs/agent/fallocate-{fd}", "w").write(said)
'
fallocate -l 2G /proc/self/fd/1
fallocate -l 2G /proc/self/fd/2
head -c 300000000 /dev/zero
head -c 300000000 /dev/zero >&2
sleep 2
"""

HONEST = ("touch ok.txt\n", REWARD + 'test -f ok.txt && echo 1 > "$R/reward.txt"\n')


def test_fallocate_and_a_flood_on_fd_1_and_2_take_no_host_disk_and_the_record_says_truncated(
    cli: Cli, tmp_path: Path, free_space: FreeSpace
) -> None:
    tasks = tmp_path / "tasks"
    _task(tasks, "flood", FLOOD, test=REWARD + 'echo 0 > "$R/reward.txt"\n')
    _task(tasks, "honest", *HONEST)
    proc = cli.run("train", "--run-id", "flood", "--tasks", str(tasks), "--n-steps", "1", "--n-samples", "1")
    assert proc.returncode == 0, proc.stderr
    free_space.stop.set()
    free_space.thread.join()
    # 2 GiB fallocated on each of fd 1 and 2 and 300 MB written to each: none of it on a host disk
    dropped = free_space.dropped()
    assert all(d < 64 * MB for d in dropped.values()), {str(p): d // MB for p, d in dropped.items()}
    trials = _trials(cli, "flood")
    assert trials["honest"]["reward"] == 1.0, trials["honest"]
    flood = trials["flood"]
    files = cli.cwd / ".durable-rl" / "trial-files" / "flood" / flood["trial_id"] / "attempt-0" / "agent"
    # fd 1 and 2 are pipes: nothing to allocate on
    assert (files / "fallocate-1").read_text() == (files / "fallocate-2").read_text() == "Illegal seek"
    # what is kept is the cap's worth, and the record says how much more the command wrote
    assert (files / "stdout.txt").stat().st_size <= 64 * 1024
    assert (files / "stderr.txt").stat().st_size <= 64 * 1024
    agent = _trajectory(cli, flood)["metadata"]["agent"]
    assert agent["ended_by"] == "exit"
    assert agent["output_truncated"]["stdout"] >= 300_000_000, agent
    assert agent["output_truncated"]["stderr"] >= 300_000_000, agent
