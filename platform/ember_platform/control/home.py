"""Where `ember serve` keeps its state: API keys, pulled packages, replica logs (`ember.keys.serve_home`, which
`ember keys ...` uses too, without the platform)."""

from __future__ import annotations

from ember.keys import DEFAULT_HOME, serve_home

__all__ = ["DEFAULT_HOME", "serve_home"]
