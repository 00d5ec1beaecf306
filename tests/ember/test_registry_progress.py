"""Transfer progress bars: shown only on a terminal, and only for transfers longer than the delay."""

from __future__ import annotations

import io
import time

from rich.console import Console

from ember.registry.progress import TransferProgress


def console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=100), out


def test_slow_transfer_on_a_terminal_shows_a_bar():
    term, out = console(terminal=True)
    with TransferProgress("pulling tiny:0.1.0", 1000, console=term, delay=0.01) as bar:
        bar.advance(400)
        deadline = time.monotonic() + 5
        while not bar.shown and time.monotonic() < deadline:
            time.sleep(0.01)
        bar.advance(600)
    assert bar.shown and bar.done_bytes == 1000
    assert "pulling tiny:0.1.0" in out.getvalue()


def test_quick_transfer_shows_nothing():
    term, out = console(terminal=True)
    with TransferProgress("pushing", 1000, console=term) as bar:  # the default one-second delay
        bar.advance(1000)
    assert not bar.shown and out.getvalue() == ""


def test_no_bar_when_not_a_terminal():
    pipe, out = console(terminal=False)
    with TransferProgress("pushing", 1000, console=pipe, delay=0) as bar:
        time.sleep(0.05)
        bar.advance(1000)
    assert not bar.shown and out.getvalue() == ""
