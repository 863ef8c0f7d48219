"""Without the [train] extra, a run that names the grpo trainer or the sampler agent is refused
before anything is written: one line, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# torch hidden from this interpreter, as on a machine without the extra
WITHOUT_TORCH = "import sys; sys.modules['torch'] = None; from durable_rl._cli import main; main()"


@pytest.mark.process
@pytest.mark.parametrize("flags", [["--trainer", "grpo"], ["--agent", "sampler"]])
def test_a_run_that_needs_the_train_extra_says_so_in_one_line(tmp_path: Path, flags: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, "--db", f"sqlite:///{tmp_path / 's.sqlite'}", "train", *flags],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs the [train] extra (torch missing)" in lines[0], proc.stderr
    assert not (tmp_path / "s.sqlite").exists()
