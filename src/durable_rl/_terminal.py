"""What reaches a terminal: text a trial or a task wrote (stderr, answers, error messages, a task
folder's name in a trial id) is shown as text, never acted on by the terminal or by rich.

Two places meet a terminal, and each strips control characters (every C0 and C1 character and
DEL, except newline and tab) from what passes, so an escape sequence a trial wrote (a window
title, OSC 52 into the clipboard, colours, cursor moves) arrives as harmless printable residue:

- `Printable`, a text stream around stdout or stderr: everything written as plain text (error
  lines, warnings, progress lines, logging) goes through it. Each process that prints installs it
  once, with `guard_standard_streams`.
- `console()`, the rich console the CLI and the progress view render with: it never parses markup
  or emoji codes in the text it is given (`[/red]` is shown, not applied), and strips control
  characters from every text segment it renders, after layout. Rich's own styles and cursor
  movements are not text segments: they are drawn from its style objects as it writes, so they
  stay, and are the only escape sequences a terminal receives.

Rich consoles write past a `Printable` to the stream it wraps (`rich_proxied_file`), which is what
lets their own styles through; so every console of this package comes from `console()` (a test
pins that).
"""

from __future__ import annotations

import functools
import io
import re
import sys
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

# C0 but tab and newline, DEL, C1 (0x80-0x9f: a terminal may read 0x9b as CSI, 0x9d as OSC)
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` without control characters (all of C0 and C1, and DEL) but newline and tab."""
    return _CONTROL.sub("", text)


class Printable(io.TextIOBase):
    """A text stream that writes to `raw` what `printable` leaves of each write.

    It has no `buffer`: a writer that looks for the binary stream under a text stream (click does)
    writes here instead of past it."""

    def __init__(self, raw: IO[str]) -> None:
        self.raw = raw

    @classmethod
    def wrap(cls, stream: IO[str]) -> IO[str]:
        """`stream` behind a Printable (itself when it is one already)."""
        return stream if isinstance(stream, Printable) else cls(stream)  # type: ignore[return-value]

    @property
    def rich_proxied_file(self) -> IO[str]:
        """Where a rich console that is handed this stream writes (see the module's docstring)."""
        return self.raw

    def write(self, text: str) -> int:
        self.raw.write(printable(text))
        return len(text)

    def flush(self) -> None:
        self.raw.flush()

    def isatty(self) -> bool:
        return self.raw.isatty()

    def fileno(self) -> int:
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.raw, "encoding", None) or "utf-8"

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return getattr(self.raw, "errors", None)

    @property
    def closed(self) -> bool:
        return self.raw.closed


def guard_standard_streams() -> None:
    """Put this process's stdout and stderr behind `Printable` (once): call it before anything
    (a logging handler, a library) keeps a reference to the bare streams."""
    if sys.stdout is not None:
        sys.stdout = Printable.wrap(sys.stdout)
    if sys.stderr is not None:
        sys.stderr = Printable.wrap(sys.stderr)


def console(file: IO[str] | None = None, **options: Any) -> Console:
    """A rich console on `file` (default: stdout as it is at each write) that shows every text as
    given: no markup, no emoji codes, no control characters."""
    return _console_class()(file=file, markup=False, emoji=False, **options)


@functools.cache
def _console_class() -> type[Console]:
    # rich is imported here, not with this module: the driver and the workers print but never
    # render tables, and a new interpreter's start is what a restarted driver waits for
    from rich.console import Console, ConsoleOptions, RenderableType
    from rich.segment import Segment

    class _Printable(Console):
        def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> Any:
            for segment in super().render(renderable, options):
                # a control segment is rich's own (a cursor move of the live view): kept
                yield segment if segment.control else Segment(printable(segment.text), segment.style)

    return _Printable
