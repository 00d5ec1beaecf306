"""Ember: declarative LLM packages, technique plugins and the contracts between them.

This package is deliberately light (pydantic, pluggy, boto3, rich): a model author can
install it on a laptop without torch. The serving platform lives in `ember_platform`.
"""

from ember.errors import EmberError
from ember.hooks import NAME, hookimpl, hookspec

__version__ = "0.1.0"

__all__ = ["NAME", "EmberError", "__version__", "hookimpl", "hookspec"]
