"""Technique kinds and the registry that registration hooks fill."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ember.errors import PluginError


@dataclass(frozen=True, slots=True)
class TechniqueKind:
    """One kind of technique: its registration hook, its selection hook, and its manifest key."""

    kind: str
    register_hook: str
    select_hook: str | None
    manifest_key: str | None  # dotted path of the manifest field that names it
    reserved: tuple[str, ...]  # names that need no plugin ("auto", "none")


KINDS: dict[str, TechniqueKind] = {
    k.kind: k
    for k in (
        TechniqueKind("quantization", "ember_quantizers", "ember_select_quantization",
                      "quantization.method", ("auto", "none")),
        TechniqueKind("speculator", "ember_speculators", "ember_select_speculator",
                      "speculator.method", ("auto", "none")),
        TechniqueKind("attention", "ember_attention_backends", "ember_select_attention_backend",
                      "kernels.attention", ("auto",)),
        TechniqueKind("parallelism", "ember_parallel_strategies", "ember_select_parallelism",
                      "parallelism.strategy", ("auto", "none")),
        TechniqueKind("routing_scorer", "ember_routing_scorers", None, None, ()),
        TechniqueKind("launcher", "ember_launchers", None, None, ()),
        # Chosen per package, but from its chat template rather than the hardware: see PluginHost.tool_parser.
        TechniqueKind("tool_parser", "ember_tool_parsers", None, "chat.tool_parser", ("auto", "none")),
    )
}

SELECTABLE = tuple(k for k, spec in KINDS.items() if spec.select_hook)


@dataclass(frozen=True, slots=True)
class Technique:
    """A registered technique. `impl` is loaded lazily when it is a "module:attr" string."""

    kind: str
    name: str
    impl: Any
    plugin: str
    summary: str = ""
    options: tuple[str, ...] = ()  # the option keys it reads (`register(..., options=...)`); others are refused
    check: Any = None  # checks the options' values (`register(..., check=...)`): a callable or "module:attr"

    def load(self) -> Any:
        return self._resolve(self.impl)

    def load_check(self) -> Any:
        """The options' value check, `check(options, prefix)` (None when the technique registered none)."""
        return None if self.check is None else self._resolve(self.check)

    def _resolve(self, target: Any) -> Any:
        if not isinstance(target, str):
            return target
        module_name, _, attr = target.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split(".") if attr else ():
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise PluginError(f"plugin '{self.plugin}': {self.kind} '{self.name}' cannot be loaded from "
                              f"{target!r}: {e}") from e
        return obj


class TechniqueRegistry:
    """All techniques by kind and name; a name registered twice is an error naming both plugins."""

    def __init__(self) -> None:
        self._by_kind: dict[str, dict[str, Technique]] = {kind: {} for kind in KINDS}

    def add(self, technique: Technique) -> None:
        known = self._by_kind[technique.kind]
        if technique.name in KINDS[technique.kind].reserved:
            raise PluginError(f"plugin '{technique.plugin}': {technique.kind} name '{technique.name}' is "
                              "reserved")
        if technique.name in known:
            other = known[technique.name].plugin
            raise PluginError(f"{technique.kind} '{technique.name}' is registered by both plugin '{other}' "
                              f"and plugin '{technique.plugin}'; uninstall or disable one "
                              "(EMBER_DISABLE_PLUGINS)")
        known[technique.name] = technique

    def of_kind(self, kind: str) -> dict[str, Technique]:
        return dict(sorted(self._by_kind[kind].items()))

    def get(self, kind: str, name: str) -> Technique | None:
        return self._by_kind[kind].get(name)

    def by_plugin(self, plugin: str) -> list[Technique]:
        return [t for kind in self._by_kind.values() for t in kind.values() if t.plugin == plugin]
