"""What a trial writes reaches the operator's terminal as text, never as a terminal's command or
as rich markup: Harbor tasks whose scripts write escape sequences (a window title, OSC 52 into the
clipboard, colours, a screen clear, C1 controls, DCS) and markup (`[/red]`, `[link=...]`) to their
stderr, from folders whose names hold escape sequences and markup, trained and followed through
`train`, `watch`, `show` and `runs`, each the real CLI in a pseudo-terminal of its own. What the
terminal received is read from the pseudo-terminal's other end: rich's own styles and cursor
moves are the only escape sequences in it; the trial's text shows, literally.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import struct
import subprocess
import termios
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import Cli

SRC = Path(__file__).resolve().parents[1] / "src" / "durable_rl"

# printf's format: what each hostile script writes (its stderr is what error lines quote)
HOSTILE = (
    r"\033]0;pwned-title\007"  # OSC 0: the window's title
    r"\033]52;c;cHduZWQ=\007"  # OSC 52: the clipboard
    r"\033[7;38;5;201mCOLOUR\033[2J"  # CSI: colours, then a screen clear
    r"\233[31mC1"  # a lone C1 CSI byte (not UTF-8)
    r"\302\233[2JU9B"  # U+009B, C1 CSI in UTF-8
    r"\033P+qdcs\033\\"  # DCS ... ST
    r" [/red] [bold]x [link=file:///etc/passwd]y :smile:"  # rich markup and an emoji code
)
MARKUP = "[/red] [bold]x [link=file:///etc/passwd]y :smile:"
ESC_TASK = "esc\x1b]0;pwned-name\x07\x1b[7;38;5;201mname"  # a folder name is the task's text too
MARKUP_TASK = "markup-[bold]x-[red]"
BROKEN_TASK = "broken\x1b]0;pwned-broken\x07"
RUN = "pty-[bold]x-[red]"
# what the trials wrote, byte for byte: none of it may reach a terminal
THEIRS = [b"\x1b]", b"\x07", b"\x1b[7;38;5;201m", b"\x1b[2J", b"\x1bP", b"\xc2\x9b", b"\x1b\\"]
# the escape sequences rich draws itself: styles (SGR), cursor moves, erasing a line, hiding the cursor
RICH_OWN = re.compile(rb"\x1b\[[0-9;]*m|\x1b\[\d*[ABCDGK]|\x1b\[\?25[lh]")
REWARD = 'R="${LOGS_DIR:-/logs}/verifier"; mkdir -p "$R"\n'


def _task(root: Path, name: str, solve: str, test: str, toml: str = "") -> None:
    t = root / name
    for sub in ("environment", "tests", "solution"):
        (t / sub).mkdir(parents=True)
    (t / "environment" / "README").write_text("task\n")
    (t / "task.toml").write_text(
        "[agent]\ntimeout_sec = 30\n[verifier]\ntimeout_sec = 30\n[environment]\nmemory_mb = 1024\n" + toml
    )
    (t / "instruction.md").write_text("do it\n")
    (t / "solution" / "solve.sh").write_text("#!/bin/bash\n" + textwrap.dedent(solve))
    (t / "tests" / "test.sh").write_text("#!/bin/bash\n" + textwrap.dedent(test))


def _hostile_tasks(root: Path) -> None:
    say = f"printf '{HOSTILE}' >&2\n"
    # a healthcheck that fails quoting its stderr: the trial is skipped, and its error is that text
    check = (f"printf '{HOSTILE}' >&2; exit 1").replace("\\", "\\\\").replace('"', '\\"')
    _task(
        root,
        ESC_TASK,
        say + f"printf '{HOSTILE}'\n",
        REWARD + 'echo 1 > "$R/reward.txt"\n',
        toml=f'healthcheck = {{ command = "{check}", retries = 1, interval_sec = 0.1, timeout_sec = 5 }}\n',
    )
    # a trial that scores, with markup in its folder's name, its stderr and its reward's components
    _task(
        root,
        MARKUP_TASK,
        say + "sleep 2\n",
        REWARD + say + """echo '{"reward": 1, "[/red]": 1, "[link=file:///etc/passwd]y": 1}' > "$R/reward.json"\n""",
    )
    _task(root, "honest", "sleep 2; touch ok.txt\n", REWARD + 'test -f ok.txt && echo 1 > "$R/reward.txt"\n')
    broken = root / BROKEN_TASK  # one that does not load: its name is in the warning that says so
    broken.mkdir()
    (broken / "task.toml").write_text("[agent\n")


class Terminal:
    """A command in a pseudo-terminal of its own (a wide one: rich wraps nothing), and every byte
    the terminal received from it."""

    def __init__(self, argv: list[str], cli: Cli, cols: int = 600) -> None:
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, cols, 0, 0))
        env = {**cli.env(), "TERM": "xterm-256color", "COLUMNS": str(cols), "LINES": "60"}
        env.pop("NO_COLOR", None)
        self.proc = subprocess.Popen(
            argv, cwd=cli.cwd, env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True
        )
        os.close(slave)
        self.received = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            ready, _, _ = select.select([self.master], [], [], 0.5)
            if not ready:
                if self.proc.poll() is not None:
                    return
                continue
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                return
            if not data:
                return
            self.received += data

    def wait(self, timeout: float = 240) -> bytes:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
            self._reader.join(timeout=30)
            os.close(self.master)
        return bytes(self.received)


def _shown(received: bytes) -> str:
    """What a reader sees: the bytes less rich's own sequences, which must account for every ESC;
    and no trial's sequence, no BEL, no C1 control, nothing that is not UTF-8."""
    for seq in THEIRS:
        assert seq not in received, (seq, received[max(received.find(seq) - 80, 0) : received.find(seq) + 80])
    text = RICH_OWN.sub(b"", received).decode("utf-8")  # strict: no lone C1 byte (0x9b) arrived
    assert "\x1b" not in text, text[max(text.find("\x1b") - 80, 0) : text.find("\x1b") + 80]
    bad = sorted({hex(ord(c)) for c in text if (ord(c) < 0x20 and c not in "\n\t\r") or 0x7F <= ord(c) < 0xA0})
    assert not bad, bad
    return text.replace("\r", "")


@pytest.mark.skipif(os.geteuid() != 0, reason="Harbor trials run in the sandbox, which needs root")
def test_trial_text_reaches_the_terminal_as_text_only(cli: Cli, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    _hostile_tasks(tasks)
    train = Terminal(
        cli.argv("train", "--run-id", RUN, "--tasks", str(tasks), "--n-steps", "1", "--n-samples", "1"), cli
    )
    deadline = time.monotonic() + 120
    while not (cli.cwd / ".durable-rl" / "state.sqlite").exists() or RUN not in cli.run("runs", "--json").stdout:
        assert time.monotonic() < deadline and train.proc.poll() is None, bytes(train.received)
        time.sleep(0.2)
    watch = Terminal(cli.argv("watch", RUN), cli)  # from another terminal, while it runs
    trained, watched = train.wait(), watch.wait()
    assert train.proc.returncode == 0, trained
    assert watch.proc.returncode == 0, watched
    trials = {t["trial_id"]: t for t in json.loads(cli.run("show", RUN, "--trials", "--json").stdout)}
    escaped = next(t for k, t in trials.items() if k.startswith("s0-esc"))
    assert escaped["status"] == "skipped" and "\x1b]0;pwned-title\x07" in escaped["error_message"]  # as recorded
    assert trials[f"s0-{MARKUP_TASK}-n0"]["reward"] == 1.0 and trials["s0-honest-n0"]["reward"] == 1.0

    # the skipped trial's line quotes its stderr; its id, the task's folder name; the warning, the broken one's
    for received in (trained, watched):
        shown = _shown(received)
        assert "skipped s0-esc]0;pwned-name[7;38;5;201mname-n0: generate: TaskError" in shown, shown
        assert "]0;pwned-title]52;c;cHduZWQ=[7;38;5;201mCOLOUR[2J" in shown and MARKUP in shown, shown
    assert "warning: task broken]0;pwned-broken skipped" in _shown(trained)
    assert "run pty-[bold]x-[red] succeeded" in _shown(watched)

    table = Terminal(cli.argv("show", RUN, "--trials"), cli)
    shown = _shown(table.wait())
    assert table.proc.returncode == 0, shown
    assert "s0-esc]0;pwned-name[7;38;5;201mname-n0" in shown and MARKUP in shown, shown
    assert f"s0-{MARKUP_TASK}-n0" in shown and "[/red]=1.0, [link=file:///etc/passwd]y=1.0" in shown, shown
    for argv in (["show", RUN], ["runs"]):
        term = Terminal(cli.argv(*argv), cli)
        shown = _shown(term.wait())
        assert term.proc.returncode == 0 and RUN in shown, shown

    # where no terminal is (a pipe, a file a terminal shows later): no escape sequence at all
    for argv in (["show", RUN, "--trials"], ["watch", RUN]):
        piped = subprocess.run(
            cli.argv(*argv), cwd=cli.cwd, env={**cli.env(), "COLUMNS": "600"}, capture_output=True, text=True
        )
        assert piped.returncode == 0, piped.stderr
        assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", piped.stdout + piped.stderr), piped.stdout
        assert MARKUP in piped.stdout


def test_every_rich_console_of_the_package_is_the_one_that_shows_text_as_text() -> None:
    """A rich console writes past the standard streams' guard (to draw its own styles): one made
    anywhere but `_terminal.console()` would hand a trial's escape sequences and markup on."""
    made = [
        f"{path.relative_to(SRC)}:{n}"
        for path in SRC.rglob("*.py")
        if path.name != "_terminal.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bConsole\(|from rich\.console import .*\bConsole\b", line)
    ]
    assert made == []


def test_printable_keeps_newline_tab_and_every_printable_character() -> None:
    from durable_rl._terminal import printable

    controls = "".join(chr(c) for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)])
    assert printable(controls) == "\t\n"
    kept = "é ü — ┃ ━ 日本 🙂 [/red] \xa0"
    assert printable(f"a{controls}{kept}") == f"a\t\n{kept}"
