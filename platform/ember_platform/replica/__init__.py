"""The replica runtime: one OS process per replica, an engine behind an OpenAI-compatible HTTP server.

Run it with `python -m ember_platform.replica --package DIR`; embed it with `Replica` and `create_app`.
"""

from __future__ import annotations

from ember_platform.replica.app import create_app
from ember_platform.replica.core import DRAINING, FAILED, READY, STARTING, Replica

__all__ = ["DRAINING", "FAILED", "READY", "STARTING", "Replica", "create_app"]
