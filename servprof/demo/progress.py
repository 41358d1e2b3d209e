"""The live progress line of `servprof demo`.

On a terminal: one rich progress line (phase, bar, what is happening, elapsed time) that fits
the console's width; the description is short by design and only cut, with an ellipsis, on a
terminal narrower than 80 columns. Elsewhere (a pipe, a CI log): a plain line whenever the
state changes, and every PLAIN_EVERY_S seconds while it does not, never a live display
(rich would print nothing but a blank line there).
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Protocol

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column
from rich.text import Text

PHASE_WIDTH = 8  # "load", "analysis"
BAR_WIDTH = 16
ELAPSED_WIDTH = 7  # "0:00:42"
PLAIN_EVERY_S = 5.0


class DemoProgress(Protocol):
    def __enter__(self) -> DemoProgress: ...

    def __exit__(self, *exc: object) -> None: ...

    def show(self, phase: str, elapsed_s: float, served: int | None, note: str) -> None:
        """`served`: requests the server has counted (None when it cannot say); `note`: what the
        demo is at (ordering, the session's state), a few words."""


def progress_for(console: Console, total_s: float) -> DemoProgress:
    return LiveLine(console, total_s) if console.is_terminal else PlainLines(console)


def describe(served: int | None, note: str) -> str:
    return f"{served} served · {note}" if served is not None else note


class LiveLine:
    def __init__(self, console: Console, total_s: float) -> None:
        self.console = console
        # Phase, bar and elapsed time take fixed columns; the description gets the rest.
        self.info_width = max(10, console.width - PHASE_WIDTH - BAR_WIDTH - ELAPSED_WIDTH - 3)
        self.progress = Progress(
            TextColumn("[bold]{task.description}", table_column=_fixed(PHASE_WIDTH)),
            BarColumn(bar_width=BAR_WIDTH),
            TextColumn("{task.fields[info]}", table_column=_fixed(self.info_width)),
            TimeElapsedColumn(),
            console=console, transient=True, expand=False)
        self.task = self.progress.add_task("load", total=total_s, info="")

    def __enter__(self) -> LiveLine:
        self.progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.progress.stop()

    def show(self, phase: str, elapsed_s: float, served: int | None, note: str) -> None:
        info = Text(describe(served, note))
        info.truncate(self.info_width, overflow="ellipsis")
        self.progress.update(self.task, completed=elapsed_s, description=phase, info=info.plain)


class PlainLines:
    def __init__(self, console: Console) -> None:
        self.console = console
        self._shown: tuple[str, str] | None = None
        self._shown_at = 0.0

    def __enter__(self) -> PlainLines:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def show(self, phase: str, elapsed_s: float, served: int | None, note: str) -> None:
        now = time.monotonic()
        if (phase, note) == self._shown and now - self._shown_at < PLAIN_EVERY_S:
            return
        self._shown, self._shown_at = (phase, note), now
        self.console.print(f"servprof demo: {phase} {elapsed_s:.0f} s: {describe(served, note)}",
                           soft_wrap=True, highlight=False, markup=False)


def _fixed(width: int) -> Column:
    return Column(width=width, no_wrap=True, overflow="ellipsis")
