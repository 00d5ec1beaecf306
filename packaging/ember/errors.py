"""Errors a user can cause. The CLI prints them as one line, never as a traceback."""

from __future__ import annotations


class EmberError(Exception):
    """A mistake in the user's input or environment, with a message that says what to do."""


class ManifestError(EmberError):
    """`ember.toml` is missing, malformed, or fails validation."""


class PackageError(EmberError):
    """A package directory or its lock is unusable (bad files, unsafe paths, digest mismatch)."""


class PluginError(EmberError):
    """A plugin is broken, conflicts with another, or a technique name is unknown."""


class OptionValueError(PluginError, ValueError):
    """A technique's option has a value it cannot take (raised by the technique's `check`, naming the key)."""


class RegistryError(EmberError):
    """A registry is unreachable, denies access, or lacks what was asked for."""
