"""Where `ember serve` keeps its state: API keys, pulled packages, replica logs."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_HOME = "~/.ember"


def serve_home() -> Path:
    """`$EMBER_HOME/serve`, else ~/.ember/serve (not created here)."""
    return Path(os.environ.get("EMBER_HOME") or DEFAULT_HOME).expanduser() / "serve"
