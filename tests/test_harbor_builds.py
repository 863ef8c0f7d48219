"""Dockerfile builds of hostile tasks, checked from the host: nothing one task's build writes is
read by another's, a build's time and size are bounded, builds of different images never wait
for each other, and the image cache keeps to its size.

Each test has an image cache of its own (its base system hard-linked from the machine's default
cache, made once by debootstrap when missing), so what it finds in the cache is its own doing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
from conftest import Cli

from durable_rl._harbor_image import _lock, _unlock, base_folder, base_rootfs, default_cache

REWARD = 'R=/logs/verifier; mkdir -p "$R"\n'

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("debootstrap") is None or not os.access("/usr/bin/bwrap", os.X_OK),
    reason="Dockerfile builds need root (overlay mounts), debootstrap and bubblewrap",
)


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """An image cache of this test's own, with the machine's base system in it (hard links)."""
    shared = default_cache()
    lock = _lock(shared)
    try:
        base_rootfs(shared)
    finally:
        _unlock(lock)
    tmp_path.chmod(0o711)
    own = tmp_path / "images"
    own.mkdir(mode=0o711)
    done = subprocess.run(["cp", "-al", str(base_folder(shared)), str(base_folder(own))], capture_output=True)
    if done.returncode != 0:  # another filesystem: copied instead
        subprocess.run(["cp", "-a", str(base_folder(shared)), str(base_folder(own))], check=True)
    return own


def _task(root: Path, name: str, dockerfile: str, test: str, solve: str = "true\n", toml: str = "") -> Path:
    t = root / name
    for sub in ("environment", "tests", "solution"):
        (t / sub).mkdir(parents=True)
    (t / "environment" / "Dockerfile").write_text(textwrap.dedent(dockerfile))
    (t / "task.toml").write_text(
        "[agent]\ntimeout_sec = 60\n[verifier]\ntimeout_sec = 60\n[environment]\nmemory_mb = 1024\n" + toml
    )
    (t / "instruction.md").write_text(f"{name}\n")
    (t / "solution" / "solve.sh").write_text("#!/bin/bash\n" + textwrap.dedent(solve))
    (t / "tests" / "test.sh").write_text("#!/bin/bash\n" + REWARD + textwrap.dedent(test))
    return t


def _train(cli: Cli, cache: Path, run_id: str, tasks: Path, *more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli.argv("train", "--run-id", run_id, "--tasks", str(tasks), "--n-steps", "1", "--n-samples", "1", *more),
        cwd=cli.cwd,
        env={**cli.env(), "DURABLE_RL_IMAGE_CACHE": str(cache)},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _trials(cli: Cli, run_id: str) -> dict[str, dict]:  # type: ignore[type-arg]
    return {t["trial_id"].split("-", 1)[1].rsplit("-", 1)[0]: t for t in cli.json("show", run_id, "--trials")}


def _images(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if len(p.name) == 64 and (p / "image.json").exists())


def _holding(cache: Path, marker: bytes) -> list[Path]:
    """Every regular file under `cache` whose bytes hold `marker`, read as root: the base aside,
    and an image's mounted root (its layer's files are found in the layer itself)."""
    found = []
    for top, dirs, files in os.walk(cache):
        dirs[:] = [d for d in dirs if not os.path.ismount(os.path.join(top, d))]
        if Path(top).is_relative_to(base_folder(cache)):
            continue
        for name in files:
            path = Path(top) / name
            if path.is_file() and not path.is_symlink() and marker in path.read_bytes():
                found.append(path)
    return found


POISON = "POISONED-by-task-a"
CACHES = ("pip", "uv", "huggingface", "ms-playwright")


def test_one_tasks_build_never_reads_what_anothers_wrote(cli: Cli, tmp_path: Path, cache: Path) -> None:
    """Task A's build plants files (a wheel among them) in every cache a build tool keeps under
    /root/.cache; task B, another image, is built after it and must find none of them."""
    tasks = tmp_path / "tasks"
    plant = " && ".join(f"mkdir -p /root/.cache/{c} && echo {POISON} > /root/.cache/{c}/planted.txt" for c in CACHES)
    _task(
        tasks / "a",
        "poisoner",
        f"""\
        FROM python:3.11-slim
        ENV WHEEL=/root/.cache/pip/mypkg-1.0-py3-none-any.whl
        RUN {plant}
        RUN mkdir -p /tmp/w/mypkg && echo 'VALUE = "{POISON}"' > /tmp/w/mypkg/__init__.py \\
         && cd /tmp/w && python3 -c "import zipfile; z = zipfile.ZipFile('$WHEEL', 'w'); z.write('mypkg/__init__.py')"
        """,
        "echo 0 > $R/reward.txt\n",
    )
    _task(
        tasks / "b",
        "honest",
        """\
        FROM python:3.11-slim
        RUN ls -A /root/.cache > /opt/seen 2>/dev/null || true
        RUN pip install --quiet --no-index --find-links /root/.cache/pip mypkg 2>/dev/null || true
        """,
        'if [ ! -s /opt/seen ] && ! python3 -c "import mypkg" 2>/dev/null; then echo 1; else echo 0; fi'
        ' > "$R/reward.txt"\n',
    )
    first = _train(cli, cache, "a", tasks / "a")
    assert first.returncode == 0, first.stderr
    assert _trials(cli, "a")["poisoner"]["reward"] == 0.0  # built and ran
    [image_a] = _images(cache)
    planted = _holding(cache, POISON.encode())
    assert len(planted) == len(CACHES) + 1, planted  # the attack ran: its files exist, in its own image only
    assert all(p.is_relative_to(image_a) for p in planted), planted
    second = _train(cli, cache, "b", tasks / "b")
    assert second.returncode == 0, second.stderr
    honest = _trials(cli, "b")["honest"]
    assert honest["reward"] == 1.0, honest["error_message"]
    [image_b] = [p for p in _images(cache) if p != image_a]
    assert _holding(cache, POISON.encode()) == planted  # nothing of A's was copied anywhere, B's image least
    assert (image_b / "layer" / "opt" / "seen").read_text() == ""  # B's build saw an empty /root/.cache
    assert not (cache / ".downloads").exists()
