"""The public pluggy markers. Plugins import `hookimpl` from `ember` (or from here)."""

from __future__ import annotations

import pluggy

NAME = "ember"

hookspec = pluggy.HookspecMarker(NAME)
hookimpl = pluggy.HookimplMarker(NAME)
