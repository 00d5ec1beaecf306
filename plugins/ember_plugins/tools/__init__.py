"""Tool-call parsers for the common open-model families: `hermes` (Qwen2.5, NousResearch Hermes),
`llama3_json` (Llama 3.1 / 3.2 JSON calls) and `mistral` (`[TOOL_CALLS] [...]`).

Registered lazily ("module:Class"), so listing plugins imports none of them.
"""

from __future__ import annotations

from ember import hookimpl
from ember.hookspecs import Register


@hookimpl
def ember_tool_parsers(register: Register) -> None:
    register("hermes", "ember_plugins.tools.hermes:HermesToolParser",
             summary="<tool_call>{\"name\", \"arguments\"}</tool_call> (Qwen2.5, Hermes)")
    register("llama3_json", "ember_plugins.tools.llama3_json:Llama3JsonToolParser",
             summary="[<|python_tag|>]{\"name\", \"parameters\"}; ... (Llama 3.1 / 3.2)")
    register("mistral", "ember_plugins.tools.mistral:MistralToolParser",
             summary="[TOOL_CALLS] [{\"name\", \"arguments\"}, ...] (Mistral)")
