"""The options of a speculator with a native CPU drafting kernel (eagle3, draft): `native_draft` (true, false, or
unset: where it runs) and `native_draft_weights` (how the kernel keeps its matrices), checked alike for both."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def native_draft_choice(options: Mapping[str, Any], formats: Sequence[str]) -> tuple[bool | None, str]:
    """(native_draft: True / False / None for "where it runs", the weight format), or ValueError naming the option."""
    wanted = options.get("native_draft")
    weight_format = options.get("native_draft_weights", "int8")
    if wanted is not None and not isinstance(wanted, bool):
        raise ValueError(f"speculator.options.native_draft must be true or false, got {wanted!r}")
    if weight_format not in formats:
        raise ValueError(f"speculator.options.native_draft_weights must be one of {', '.join(formats)}, got "
                         f"{weight_format!r}")
    if wanted is False and "native_draft_weights" in options:
        raise ValueError("speculator.options.native_draft_weights is for the native kernel, which "
                         "speculator.options.native_draft = false turns off")
    return wanted, weight_format
