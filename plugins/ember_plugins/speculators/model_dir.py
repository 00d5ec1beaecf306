"""The first step every model-backed speculator takes: find `[speculator] model` and read its config.json.

Errors name `speculator.model` and the file, and say which example script makes the directory, so a package
author who forgot the directory or shipped a broken one knows what to fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ember_platform.api import SpeculatorContext

CONFIG = "config.json"


def read_model_config(context: SpeculatorContext, method: str, what: str, script: str) -> tuple[Path, dict[str, Any]]:
    """(the config's path, its JSON object) for `method`'s `what` ("draft head", ...) in `[speculator] model`.

    `script` is the example script that makes such a directory (named in the error when none is configured)."""
    if context.model_dir is None:
        raise ValueError(f"speculator.model: {method} needs the directory of its {what} ([speculator] model = "
                         f"\"speculator/{method}\", made by {script})")
    root = context.model_dir
    if not root.is_dir():
        raise ValueError(f"speculator.model: the {what} directory {root} does not exist")
    path = root / CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"speculator.model: cannot read the {what} config {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"speculator.model: {path} is not a JSON object")
    return path, config
