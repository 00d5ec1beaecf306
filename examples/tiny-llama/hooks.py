"""Hooks that belong to the tiny-llama package.

Ember imports this file when it loads the package and registers it after every plugin, so these
implementations are called first. Any hook in `ember.hookspecs` may be implemented here.
"""

from __future__ import annotations

from typing import Any

from ember import Manifest, hookimpl


@hookimpl
def ember_preprocess_request(request: dict[str, Any], manifest: Manifest) -> dict[str, Any] | None:
    """Called with each request body (OpenAI-style) before it is tokenized.

    Return a new dict to replace the request, or None to keep it. A model could add a default
    system prompt here, for instance:

        if "messages" in request and request["messages"][0]["role"] != "system":
            system = {"role": "system", "content": "You are terse."}
            return {**request, "messages": [system, *request["messages"]]}

    tiny-llama keeps every request as it is, so that tests see exactly what they sent.
    """
    return None
