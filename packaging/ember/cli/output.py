"""Terminal output shared by the commands: one rich console for results, one for errors."""

from __future__ import annotations

import sys

from rich.console import Console

# Into a pipe or a file, lines (digests, paths, tables) stay whole instead of wrapping at 80.
_PIPE_WIDTH = None if sys.stdout.isatty() else 200
console = Console(highlight=False, soft_wrap=True, width=_PIPE_WIDTH)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
