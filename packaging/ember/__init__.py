"""Ember: declarative LLM packages, technique plugins and the contracts between them.

This package is deliberately light (pydantic, pluggy, boto3, rich): a model author can
install it on a laptop without torch. The serving platform lives in `ember_platform`.

The public API for plugin authors: `hookimpl` (the marker), `Selection` (what a selection
hook may return), `OutputFilter` (what `ember_postprocess_stream` returns), and the types hooks
receive, `Manifest` and `Hardware`.
"""

from ember.errors import EmberError
from ember.hardware import Hardware
from ember.hooks import NAME, hookimpl, hookspec
from ember.manifest import Manifest
from ember.postprocess import OutputFilter
from ember.selection import Selection

__version__ = "0.1.0"

__all__ = [
    "NAME", "EmberError", "Hardware", "Manifest", "OutputFilter", "Selection", "__version__", "hookimpl", "hookspec",
]
