"""Where a checkpoint keeps its chat templates, read as transformers reads them (torch- and tokenizers-free, so that
`ember explain` can tell which tool-call parser a template asks for)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ChatTemplates = str | dict[str, str]
TOOL_USE = "tool_use"  # the name of the template transformers renders when a request has tools


def load_chat_templates(directory: Path, config: Mapping[str, Any]) -> ChatTemplates | None:
    """The templates of the checkpoint in `directory`, whose tokenizer_config.json holds `config`.

    The same precedence as transformers: template files beside the tokenizer override the config's entry.
    """
    templates: dict[str, str] = {}
    default_file = directory / "chat_template.jinja"
    if default_file.is_file():
        templates["default"] = default_file.read_text(encoding="utf-8")
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates

    entry = config.get("chat_template")
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        try:
            return {str(item["name"]): str(item["template"]) for item in entry}
        except (KeyError, TypeError) as e:
            raise ValueError(f"{directory / 'tokenizer_config.json'}: 'chat_template' list entries need "
                             f"'name' and 'template' keys") from e
    if isinstance(entry, dict):
        return {str(name): str(template) for name, template in entry.items()}
    raise ValueError(f"{directory / 'tokenizer_config.json'}: 'chat_template' must be a string, a list or an "
                     f"object, got {type(entry).__name__}")


def tool_template(templates: ChatTemplates | None) -> str | None:
    """The template a request with tools renders: `tool_use` if there is one, else `default`, else the only one."""
    if templates is None or isinstance(templates, str):
        return templates
    for name in (TOOL_USE, "default"):
        if name in templates:
            return templates[name]
    return next(iter(templates.values())) if len(templates) == 1 else None


def read_chat_templates(weights: Path) -> ChatTemplates | None:
    """The templates of the checkpoint directory `weights` (its tokenizer_config.json and template files)."""
    path = weights / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from e
    return load_chat_templates(weights, config if isinstance(config, dict) else {})
