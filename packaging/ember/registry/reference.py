"""Package references (`NAME[:VERSION]`) and the order of versions."""

from __future__ import annotations

import re
from typing import Any

from packaging.version import InvalidVersion, Version

from ember.errors import RegistryError

# A name or version becomes one path component or key segment in a registry, so it must start
# with a letter or digit (no '..', no hidden files) and hold no separator. The manifest's own
# rules are stricter; this only keeps references from reaching outside the registry layout.
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


def parse_reference(reference: str) -> tuple[str, str | None]:
    """`"tiny:0.1.0"` -> `("tiny", "0.1.0")`; `"tiny"` -> `("tiny", None)` (the latest version)."""
    name, sep, version = reference.partition(":")
    if not _PART.match(name) or (sep and not _PART.match(version)):
        raise RegistryError(f"{reference!r} is not a package reference: expected NAME or NAME:VERSION, "
                            "e.g. tiny or tiny:0.1.0")
    return name, (version if sep else None)


def version_key(version: str) -> tuple[Any, ...]:
    """Sort key: PEP 440 order for versions it can parse, after any it cannot (compared as text)."""
    try:
        return (1, Version(version), version)
    except InvalidVersion:
        return (0, version)


def sort_versions(versions: list[str]) -> list[str]:
    """Oldest first."""
    return sorted(versions, key=version_key)
