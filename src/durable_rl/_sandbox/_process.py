"""One command in a sandbox: its own process group, a deadline, resource limits, a scrubbed
environment and, where the machine allows, no network.

The command runs as `unshare --net` (a new, empty network namespace), `setpriv` (a uid of its
own, so the process limit counts only its processes and it cannot write outside its copy) and
`prlimit` (CPU seconds, address space, file size, processes), each applied only where this
machine supports it. What ended the command is recorded: exit, signal, or the limit it hit.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Literal

from pydantic import BaseModel, ConfigDict, Field

EndedBy = Literal["exit", "signal", "deadline", "cpu", "memory", "file_size", "processes"]
OUTPUT_LIMIT = 64 * 1024  # bytes of stdout and of stderr kept per command
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_UIDS = itertools.count()
UID_BASE, UID_SPAN = 610_000, 50_000  # uids that belong to no account on the machine


class Limits(BaseModel):
    """What one sandboxed command may use."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    wall_s: float = Field(60.0, gt=0, description="Wall-clock seconds before the whole process group is killed.")
    cpu_s: int = Field(60, ge=1, description="CPU seconds (RLIMIT_CPU).")
    memory_mb: int = Field(2048, ge=16, description="Address space per process in MiB (RLIMIT_AS).")
    file_size_mb: int = Field(1024, ge=1, description="Largest file a process may write, in MiB (RLIMIT_FSIZE).")
    processes: int = Field(128, ge=1, description="Processes and threads the sandbox's uid may have (RLIMIT_NPROC).")
    network: bool = Field(False, description="Allow the network; False runs in a new, empty network namespace.")


class CommandResult(BaseModel):
    """How a sandboxed command ended."""

    model_config = ConfigDict(frozen=True)

    exit_code: int | None = Field(description="Exit status, None when a signal ended it.")
    signal: str | None = Field(description="Name of the signal that ended it, if any.")
    ended_by: EndedBy = Field(description="What ended it: a normal exit, a signal, or which limit.")
    stdout: str = Field(description="Standard output (first 64 KiB).")
    stderr: str = Field(description="Standard error (first 64 KiB).")
    seconds: float = Field(description="Wall time.")
    isolation: list[str] = Field(description="The isolation layers that applied: netns, uid, rlimits.")

    @property
    def ok(self) -> bool:
        """True for a zero exit."""
        return self.exit_code == 0


@functools.cache
def capabilities() -> frozenset[str]:
    """The isolation layers this machine supports, probed once per process."""
    found = set()
    if shutil.which("prlimit"):
        found.add("rlimits")
    if os.geteuid() == 0 and shutil.which("setpriv"):
        found.add("uid")
    if shutil.which("unshare") and _succeeds(["unshare", "--net", "true"]):
        found.add("netns")
    return frozenset(found)


def _succeeds(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=10, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def sandbox_uid() -> int | None:
    """A fresh uid for one trial's commands, or None when commands cannot change uid here."""
    if "uid" not in capabilities():
        return None
    return UID_BASE + (os.getpid() * 1000 + next(_UIDS)) % UID_SPAN


def _wrap(command: str, limits: Limits, uid: int | None) -> tuple[list[str], list[str]]:
    caps = capabilities()
    argv: list[str] = []
    applied = []
    if not limits.network and "netns" in caps:
        argv += ["unshare", "--net", "--"]
        applied.append("netns")
    if uid is not None and "uid" in caps:
        argv += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        applied.append("uid")
    if "rlimits" in caps:
        mb = 1024 * 1024
        argv += [
            "prlimit",
            f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",  # SIGXCPU first, SIGKILL a second later
            f"--as={limits.memory_mb * mb}",
            f"--fsize={limits.file_size_mb * mb}",
            f"--nproc={limits.processes}",
            "--",
        ]
        applied.append("rlimits")
    return [*argv, "/bin/sh", "-c", command], applied


async def run_command(
    command: str,
    *,
    cwd: Path,
    limits: Limits,
    uid: int | None = None,
    env: dict[str, str] | None = None,
) -> CommandResult:
    """Run a shell command in the sandbox and say how it ended; never raises for the command's sake."""
    argv, applied = _wrap(command, limits, uid)
    clean_env = {"PATH": SAFE_PATH, "HOME": str(cwd), "LANG": "C.UTF-8", "TMPDIR": str(cwd), **(env or {})}
    t0 = time.monotonic()
    # Output goes to files, not pipes: a background child holding a pipe open must not keep
    # the command "running" after its shell has exited.
    with tempfile.TemporaryFile() as out_file, tempfile.TemporaryFile() as err_file:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=cwd,
            env=clean_env,
            stdin=subprocess.DEVNULL,
            stdout=out_file,
            stderr=err_file,
            start_new_session=True,  # its own process group: the deadline kills all of it
        )
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), limits.wall_s)
        except TimeoutError:
            timed_out = True
        finally:
            _kill_everything(proc.pid, uid)  # stragglers too: background children, a setsid'd escapee
            if proc.returncode is None:
                await proc.wait()
        stdout, stderr = _read_capped(out_file), _read_capped(err_file)
    code = proc.returncode
    sig = _signal_of(code)
    return CommandResult(
        exit_code=code if code is not None and code >= 0 else None,
        signal=signal.Signals(sig).name if sig is not None else None,
        ended_by=_ended_by(timed_out, sig, stderr),
        stdout=stdout,
        stderr=stderr,
        seconds=round(time.monotonic() - t0, 3),
        isolation=applied,
    )


def _read_capped(f: IO[bytes]) -> str:
    f.seek(0)
    return f.read(OUTPUT_LIMIT).decode("utf-8", errors="replace")


def _kill_everything(pgid: int, uid: int | None) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is None:
        return
    # the uid is this trial's alone: nothing of it may outlive the command. A fork bomb forks
    # between a scan and its kill, so kill until none is left (the next command of the trial, its
    # verifier, would otherwise meet the process limit the survivors hold).
    deadline = time.monotonic() + 5.0
    while True:
        subprocess.run(["pkill", "-KILL", "-U", str(uid)], capture_output=True, check=False)
        left = subprocess.run(["pgrep", "-U", str(uid)], capture_output=True, check=False).returncode == 0
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _signal_of(code: int | None) -> int | None:
    """The signal that ended the command: its own, or the one `sh` reports as 128 + n."""
    if code is None:
        return None
    if code < 0:
        return -code
    if 128 < code < 128 + signal.NSIG and code - 128 in {s.value for s in signal.Signals}:
        return code - 128
    return None


_MEMORY_WORDS = ("MemoryError", "Cannot allocate memory", "bad_alloc", "out of memory")
_PROCESS_WORDS = ("Resource temporarily unavailable", "fork: retry", "can't fork", "Cannot fork")


def _ended_by(timed_out: bool, sig: int | None, stderr: str) -> EndedBy:
    if timed_out:
        return "deadline"
    if sig == signal.SIGXCPU:
        return "cpu"
    if sig == signal.SIGXFSZ or "File too large" in stderr or "File size limit exceeded" in stderr:
        return "file_size"
    if any(w in stderr for w in _MEMORY_WORDS):
        return "memory"
    if any(w in stderr for w in _PROCESS_WORDS):
        return "processes"
    return "signal" if sig is not None else "exit"
