"""`servprof demo`'s live progress: one line that fits an 80-column terminal, plain lines in a
pipe (rich consoles, as the demo makes them)."""

from __future__ import annotations

import io

from rich.console import Console
from rich.segment import Segment

from servprof.demo import progress as demo_progress
from servprof.demo.progress import LiveLine, PlainLines, progress_for

# The longest descriptions the demo shows: a big request count and every session state.
NOTES = ["sample at 10 s", "ordered 64", "session starting 0/64", "session capturing 63/64",
         "session exporting 64/64", "session analysing 64/64", "session done", "session failed"]


def _rendered(line: LiveLine) -> list[str]:
    lines = line.console.render_lines(line.progress.get_renderable(), line.console.options)
    assert all(Segment.get_line_length(segments) <= line.console.width for segments in lines)
    return ["".join(segment.text for segment in segments).rstrip() for segments in lines]


def test_live_line_fits_80_columns_and_shows_the_whole_description() -> None:
    console = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
    line = progress_for(console, 30.0)
    assert isinstance(line, LiveLine)
    for phase in ("load", "analysis"):
        for note in NOTES:
            line.show(phase, 29.5, 1_234_567, note)
            (text,) = _rendered(line)
            assert "…" not in text and f"1234567 served · {note}" in text and text.startswith(phase), text


def test_live_line_cuts_only_what_does_not_fit_a_narrow_terminal() -> None:
    console = Console(file=io.StringIO(), width=60, force_terminal=True, color_system=None)
    line = progress_for(console, 30.0)
    line.show("load", 3.0, 12, "sample order refused: HTTP 409 servprof is disabled (SERVPROF_ENABLED=0)")
    (text,) = _rendered(line)
    assert text.startswith("load") and "12 served · sample order" in text and "…" in text


def test_plain_lines_in_a_pipe(monkeypatch) -> None:
    """Not a terminal: no live display (rich would leave a blank line), a plain line per change
    and one every PLAIN_EVERY_S while nothing changes."""
    out = io.StringIO()
    console = Console(file=out, width=120)
    assert not console.is_terminal
    clock = [100.0]
    monkeypatch.setattr(demo_progress.time, "monotonic", lambda: clock[0])
    with progress_for(console, 30.0) as progress:
        assert isinstance(progress, PlainLines)
        for second, note in enumerate(["sample at 10 s"] * 3 + ["session capturing 1/4"] * 8):
            clock[0] = 100.0 + second
            progress.show("load", second, 10 * second, note)
        progress.show("analysis", 30, 400, "session done")
    lines = out.getvalue().splitlines()
    assert lines == ["servprof demo: load 0 s: 0 served · sample at 10 s",
                     "servprof demo: load 3 s: 30 served · session capturing 1/4",
                     "servprof demo: load 8 s: 80 served · session capturing 1/4",
                     "servprof demo: analysis 30 s: 400 served · session done"]
