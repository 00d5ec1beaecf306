"""What a selection hook returns, and what the host reports about the winner."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Selection:
    """A selection hook's answer: a technique name, its options, and why it was chosen."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SelectionReport:
    """The outcome of selecting one technique kind, for logs, `ember explain` and /info."""

    kind: str
    name: str
    options: Mapping[str, Any]
    reason: str
    decided_by: str  # "manifest", or "plugin 'x' (ember_select_quantization)", or "package hooks.py"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "options": dict(self.options),
                "reason": self.reason, "decided_by": self.decided_by}
