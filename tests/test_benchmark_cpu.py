"""The benchmarks' CPU reading (benchmarks/_cpu.py): each role's CPU, and each moment's."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from _cpu import watch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# A process tree laid out as `durable-rl train`'s: the started process (the CLI) forks a driver,
# which forks a helper (the same program) and runs another program. Each burns a known amount of
# CPU at a moment it writes down, idle before and after, and writes its own CPU time at its end.
TREE = """
import json, os, subprocess, sys, time
out = sys.argv[1]
OTHER = (
    "import json, sys, time\\nend = time.process_time() + 0.2\\nwhile time.process_time() < end: pass\\n"
    "json.dump({'cpu': time.process_time()}, open(sys.argv[1], 'w'))"
)

def burn(seconds):
    start = time.time()
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    return [start, time.time()]

def done(role, **moments):
    time.sleep(0.3)  # idle: the sampler's last reading of this process is its whole CPU
    with open(os.path.join(out, role), "w") as f:
        json.dump({"cpu": time.process_time(), **moments}, f)

if os.fork() == 0:  # the driver
    time.sleep(0.3)
    first = burn(0.4)
    time.sleep(0.3)
    if os.fork() == 0:  # its helper
        time.sleep(0.3)
        own = burn(0.3)
        done("helper", burn=own)
        os._exit(0)
    os.wait()
    subprocess.run([sys.executable, "-c", OTHER, os.path.join(out, "other")])
    done("driver", burn=first)
    os._exit(0)
os.wait()
done("cli")
"""


@pytest.mark.process
def test_the_cpu_reading_counts_each_role_and_each_moment_of_a_tree_laid_out_as_a_run(tmp_path: Path) -> None:
    script = tmp_path / "tree.py"
    script.write_text(textwrap.dedent(TREE))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)])
    cpu = watch(proc)
    assert proc.returncode == 0
    own = {role: json.loads((tmp_path / role).read_text()) for role in ("cli", "driver", "helper", "other")}
    whole = cpu.cpu_between(cpu.times[0], cpu.times[-1])
    # /proc counts in ticks of 10 ms: each role's total is its processes' own, to a few ticks; the
    # helper, reaped by the driver, is not counted again as what the driver reaped
    for role in ("cli", "driver", "helper", "other"):
        assert whole[role] == pytest.approx(own[role]["cpu"], abs=0.05), (role, whole)
    # each burn, in a window around it where nothing else burns: only its role's CPU
    for role, share in (("driver", 0.4), ("helper", 0.3)):
        start, end = own[role]["burn"]
        window = cpu.cpu_between(start - 0.15, end + 0.15)
        assert window[role] == pytest.approx(share, abs=0.06), (role, window)
        assert sum(window.values()) - window[role] < 0.06, (role, window)
