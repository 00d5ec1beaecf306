"""The plugin host: owns a pluggy PluginManager, discovers plugins, selects techniques.

Whoever needs plugins (the CLI, a replica, a test) makes a `PluginHost`; there is no
import-time global. Plugins are found through the entry-point group "ember" — Ember's own
built-ins exactly like third-party ones — then a package's `hooks.py` is registered last so
that it is called first and can override any plugin.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import importlib.util
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy

from ember import hookspecs
from ember.errors import OptionValueError, PluginError
from ember.hardware import Hardware, detect_hardware
from ember.hooks import NAME, hookimpl
from ember.kernel_ops import REGISTER_HOOK, KernelOpRegistry, collect_kernel_ops
from ember.manifest import AUTO, NONE, Manifest, load_manifest
from ember.manifest.schema import COMPOSE
from ember.manifest.unsupported import refuse_unconsumed_selection
from ember.postprocess import FilterStage, OutputHookError, OutputPipeline, WholeOutputStage
from ember.selection import Selection, SelectionReport
from ember.techniques import KINDS, SELECTABLE, Technique, TechniqueRegistry

DISABLE_ENV = "EMBER_DISABLE_PLUGINS"
# The manifest section whose `options` go to the selected technique of each kind.
_OPTION_SECTIONS = {"quantization": "quantization", "speculator": "speculator", "attention": "kernels"}
# Option keys Ember puts in a selection's options for itself (the engine reads them, not the technique).
_EMBER_OPTION_KEYS = {"speculator": frozenset({"num_speculative_tokens", "max_batch_size"})}
HOOKS_FILE = "hooks.py"
MANIFEST_PLUGIN = "ember.manifest"


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """A loaded plugin: its name, where it came from, and what it registers."""

    name: str
    source: str  # "entry point", "package hooks.py", "registered in code"
    distribution: str | None
    version: str | None
    techniques: tuple[Technique, ...]


def disabled_from_env() -> set[str]:
    return {name.strip() for name in os.environ.get(DISABLE_ENV, "").split(",") if name.strip()}


class PluginHost:
    """Discovers and holds plugins for one package (or none), and answers the hooks."""

    def __init__(self, *, entry_points: bool = True, disabled: Iterable[str] | None = None) -> None:
        self.pm = pluggy.PluginManager(NAME)
        self.pm.add_hookspecs(hookspecs)
        self.disabled = set(disabled) if disabled is not None else disabled_from_env()
        self._origins: dict[str, tuple[str, str | None, str | None]] = {}
        self._registry: TechniqueRegistry | None = None
        self._kernel_ops: KernelOpRegistry | None = None
        self._hardware: dict[str, Hardware] = {}
        self.register(_ManifestChoice(self), MANIFEST_PLUGIN, source="built into ember")
        if entry_points:
            self.load_entry_points()

    # --- discovery ------------------------------------------------------------------------

    def load_entry_points(self) -> None:
        """Import and register every plugin of the "ember" entry-point group, unless disabled."""
        seen: set[str] = set()
        for ep in sorted(importlib.metadata.entry_points(group=NAME), key=lambda e: e.name):
            if ep.name in seen or ep.name in self.disabled or self.pm.has_plugin(ep.name):
                continue  # the same distribution can be visible twice on sys.path
            seen.add(ep.name)
            dist = getattr(ep, "dist", None)
            dist_name, version = (dist.metadata["Name"], dist.version) if dist is not None else (None, None)
            try:
                plugin = ep.load()
            except Exception as e:
                raise PluginError(f"plugin '{ep.name}' (from {dist_name or 'unknown distribution'}, "
                                  f"{ep.value}) failed to import: {type(e).__name__}: {e}") from e
            self.register(plugin, ep.name, source="entry point", distribution=dist_name, version=version)
        self.check_pending()

    def load_package_hooks(self, package_dir: str | Path) -> str | None:
        """Register the package's hooks.py (if any) last, so it is called first. Returns its name."""
        path = Path(package_dir) / HOOKS_FILE
        if not path.is_file():
            return None
        name = f"package:{Path(package_dir).resolve().name}"
        module = _import_file(path, f"ember_package_hooks_{abs(hash(str(path.resolve())))}")
        self.register(module, name, source="package hooks.py")
        self.check_pending()
        return name

    def register(self, plugin: object, name: str, *, source: str = "registered in code",
                 distribution: str | None = None, version: str | None = None) -> None:
        if name in self.disabled:
            return
        try:
            self.pm.register(plugin, name=name)
        except ValueError as e:
            raise PluginError(f"plugin '{name}': {e}") from None
        except pluggy.PluginValidationError as e:
            raise PluginError(f"plugin '{name}': {e}") from None
        self._origins[name] = (source, distribution, version)
        self._registry = None
        self._kernel_ops = None

    def check_pending(self) -> None:
        """A hook implementation whose name is no hook spec is an error (a typo, most likely)."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            match = re.search(r"unknown hook '(\w+)'", str(e))
            hook = match.group(1) if match else "?"
            close = difflib.get_close_matches(hook, self.hook_names(), n=1)
            hint = f" — did you mean '{close[0]}'?" if close else f" (hooks: {', '.join(self.hook_names())})"
            name = self.pm.get_name(e.plugin) or "?"
            raise PluginError(f"{self._describe(name)}: '{hook}' is not an Ember hook{hint}") from None

    @classmethod
    def for_package(cls, package_dir: str | Path, **kwargs: Any) -> PluginHost:
        host = cls(**kwargs)
        host.load_package_hooks(package_dir)
        return host

    # --- what is installed ----------------------------------------------------------------

    @staticmethod
    def hook_names() -> list[str]:
        return sorted(n for n in dir(hookspecs) if n.startswith("ember_"))

    @property
    def techniques(self) -> TechniqueRegistry:
        """Every technique the registered plugins declare (collected once, then cached)."""
        if self._registry is None:
            registry = TechniqueRegistry()
            for spec in KINDS.values():
                for plugin_name, call in self._impls(spec.register_hook):
                    def register(name: str, impl: Any, *, summary: str = "", options: Iterable[str] = (),
                                 check: Any = None, _p: str = plugin_name, _k: str = spec.kind) -> None:
                        if isinstance(options, str):  # options="bits" would declare "b", "i", "t", "s"
                            options = (options,)
                        registry.add(Technique(_k, name, impl, _p, summary, tuple(options), check))
                    call(register=register)
            self._registry = registry
        return self._registry

    @property
    def kernel_ops(self) -> KernelOpRegistry:
        """Every kernel-op impl the registered plugins offer (`ember_kernel_ops`; collected once, then cached)."""
        if self._kernel_ops is None:
            self._kernel_ops = collect_kernel_ops(self._impls(REGISTER_HOOK))
        return self._kernel_ops

    def plugins(self) -> list[PluginInfo]:
        infos = []
        for name, _plugin in self.pm.list_name_plugin():
            source, dist, version = self._origins.get(name, ("registered in code", None, None))
            techniques = [*self.techniques.by_plugin(name), *(i.technique() for i in self.kernel_ops.by_plugin(name))]
            infos.append(PluginInfo(name, source, dist, version, tuple(techniques)))
        return sorted(infos, key=lambda p: (p.name != MANIFEST_PLUGIN, p.name))

    def hardware(self, manifest: Manifest | None = None) -> Hardware:
        accelerator = manifest.runtime.accelerator if manifest is not None else "auto"
        if accelerator not in self._hardware:
            self._hardware[accelerator] = detect_hardware(accelerator)
        return self._hardware[accelerator]

    # --- manifest checks and selection ----------------------------------------------------

    def check_manifest(self, manifest: Manifest, source: str = "ember.toml") -> None:
        """Every technique the manifest names explicitly must be provided by an installed plugin, and every option
        it gives must be one that technique reads (`register(..., options=...)`)."""
        for kind in SELECTABLE:
            spec = KINDS[kind]
            assert spec.manifest_key is not None
            value = _manifest_value(manifest, spec.manifest_key)
            missing = [part for part in _composed(kind, value) if self.techniques.get(kind, part) is None]
            if value not in spec.reserved and missing:
                raise PluginError(f"{source}: {spec.manifest_key}: {unknown_technique_message(self, kind, missing[0])}")
            given = _given_options(manifest, kind)
            if given and value in spec.reserved:
                # The manifest's options go to the technique it names: with "none" or "auto" none gets them.
                raise PluginError(f"{source}: {_option_key(kind, given[0])}: nothing reads it: {spec.manifest_key} "
                                  f"= {value!r} names no technique to pass it to")
            if given:
                self._check_options(kind, value, given, source)
                self._check_option_values(kind, value, _manifest_options(manifest, kind), source)
        parser = manifest.chat.tool_parser
        if parser not in KINDS["tool_parser"].reserved and self.techniques.get("tool_parser", parser) is None:
            raise PluginError(f"{source}: chat.tool_parser: {unknown_technique_message(self, 'tool_parser', parser)}")

    def _check_options(self, kind: str, name: str, given: Iterable[str], where: str) -> None:
        """PluginError for the first option key the technique `name` does not declare that it reads."""
        parts = _composed(kind, name)
        if len(parts) > 1:  # composed quantization methods: a table per method (the engine checks each table)
            stray = sorted(set(given) - set(parts))
            if stray:
                raise PluginError(f"{where}: {_option_key(kind, stray[0])}: with several methods ({', '.join(parts)}), "
                                  "[quantization] options are tables named after them")
            return
        technique = self.techniques.get(kind, name)
        if technique is None or kind not in _OPTION_SECTIONS:
            return
        unread = sorted(set(given) - set(technique.options) - _EMBER_OPTION_KEYS.get(kind, frozenset()))
        if not unread:
            return
        reads = f"reads only {', '.join(technique.options)}" if technique.options else "reads no options"
        close = difflib.get_close_matches(unread[0], technique.options, n=1)
        hint = f" — did you mean '{close[0]}'?" if close else ""
        raise PluginError(f"{where}: {_option_key(kind, unread[0])}: not supported by {kind} '{name}' "
                          f"({self._describe(technique.plugin)}), which {reads}{hint}")

    def _check_option_values(self, kind: str, name: str, options: Mapping[str, Any], where: str) -> None:
        """OptionValueError naming the first option whose value the technique's registered `check` refuses; each
        technique of a composition checks its own table (`quantization.options.<method>`). The same function the
        technique runs when it is built, so a manifest is refused here as an engine would refuse it."""
        if kind not in _OPTION_SECTIONS or name in KINDS[kind].reserved:
            return
        parts = _composed(kind, name)
        ours = _EMBER_OPTION_KEYS.get(kind, frozenset())
        for part in parts:
            technique = self.techniques.get(kind, part)
            check = technique.load_check() if technique is not None else None
            if check is None:
                continue
            own = options.get(part, {}) if len(parts) > 1 else options
            if not isinstance(own, Mapping):
                continue  # the engine refuses a composed method's table that is not a table, naming it
            prefix = f"{_OPTION_SECTIONS[kind]}.options" + (f".{part}" if len(parts) > 1 else "")
            try:
                check({k: v for k, v in own.items() if k not in ours}, prefix)
            except ValueError as e:
                raise OptionValueError(f"{where}: {e}") from None

    def select(self, kind: str, manifest: Manifest, hardware: Hardware | None = None) -> SelectionReport:
        """Ask the selection hook for `kind`; report the winner and who decided."""
        spec = KINDS[kind]
        if spec.select_hook is None:
            raise ValueError(f"{kind} techniques are not selected per package")
        hardware = hardware or self.hardware(manifest)
        available = frozenset(self.techniques.of_kind(kind))
        for plugin_name, call in self._impls(spec.select_hook):
            answer = call(manifest=manifest, hardware=hardware, available=available)
            if answer is None:
                continue
            selection = answer if isinstance(answer, Selection) else Selection(str(answer))
            if plugin_name != MANIFEST_PLUGIN:
                decided_by = f"{self._describe(plugin_name)} ({spec.select_hook})"
            elif _manifest_value(manifest, spec.manifest_key or "") == AUTO:
                decided_by = "ember's auto fallback"
            else:
                decided_by = "manifest"
            missing = [p for p in _composed(kind, selection.name) if self.techniques.get(kind, p) is None]
            if selection.name not in (NONE,) and missing:
                raise PluginError(f"{decided_by} chose {kind} '{selection.name}': "
                                  f"{unknown_technique_message(self, kind, missing[0])}")
            options = selection.options
            if not options and (kind == "parallelism"
                                or selection.name == _manifest_value(manifest, spec.manifest_key or "")):
                options = _manifest_options(manifest, kind)
            report = SelectionReport(kind, selection.name, dict(options), selection.reason, decided_by)
            read_by_technique = [*report.options, *(["model"] if kind == "speculator"
                                                    and manifest.speculator.model is not None else [])]
            refuse_unconsumed_selection(report, manifest)
            self._check_options(kind, report.name, read_by_technique, decided_by)
            self._check_option_values(kind, report.name, report.options, decided_by)
            return report
        article = "an" if kind[0] in "aeiou" else "a"
        raise PluginError(f"no installed plugin provides {article} {kind} technique for {hardware.describe()} "
                          f"(set {spec.manifest_key} in ember.toml, or install a plugin that provides one)")

    def select_all(self, manifest: Manifest, hardware: Hardware | None = None) -> dict[str, SelectionReport]:
        return {kind: self.select(kind, manifest, hardware) for kind in SELECTABLE}

    def select_tool_parser(self, manifest: Manifest, chat_template: str | None) -> SelectionReport:
        """The tool-call parser for this package ("none": requests with tools are refused).

        `[chat] tool_parser` names it; "auto" takes the one registered parser whose `matches_template` says the
        chat template (the one requests with tools render) writes its format, and none when zero or several do.
        """
        value = manifest.chat.tool_parser
        if value != AUTO:
            if value != NONE and self.techniques.get("tool_parser", value) is None:
                raise PluginError(f"chat.tool_parser: {unknown_technique_message(self, 'tool_parser', value)}")
            where = "in ember.toml" if "tool_parser" in manifest.chat.model_fields_set else "(the default)"
            return SelectionReport("tool_parser", value, {}, f"chat.tool_parser = {value!r} {where}", "manifest")
        decided_by = "the chat template (chat.tool_parser = 'auto')"
        if chat_template is None:
            return SelectionReport("tool_parser", NONE, {}, "auto: the model has no chat template", decided_by)
        matching = []
        for name, technique in self.techniques.of_kind("tool_parser").items():
            try:
                matches = technique.load().matches_template(chat_template)
            except Exception as e:
                raise PluginError(f"{self._describe(technique.plugin)}: tool parser '{name}' failed to read the chat "
                                  f"template: {type(e).__name__}: {e}") from e
            if matches:
                matching.append(name)
        if len(matching) == 1:
            return SelectionReport("tool_parser", matching[0], {},
                                   f"auto: the chat template writes {matching[0]!r} tool calls", decided_by)
        if matching:
            reason = (f"auto: the chat template matches several parsers ({', '.join(matching)}); set "
                      "[chat] tool_parser in ember.toml")
        else:
            reason = "auto: the chat template writes no tool-call format an installed parser knows"
        return SelectionReport("tool_parser", NONE, {}, reason, decided_by)

    # --- lifecycle ------------------------------------------------------------------------

    def model_loaded(self, manifest: Manifest, model: Any, hardware: Hardware | None = None) -> None:
        self.pm.hook.ember_model_loaded(manifest=manifest, model=model,
                                        hardware=hardware or self.hardware(manifest))

    def preprocess_request(self, request: dict[str, Any], manifest: Manifest) -> dict[str, Any]:
        """Chain every ember_preprocess_request implementation (package hooks.py first)."""
        for plugin_name, call in self._impls("ember_preprocess_request"):
            replaced = call(request=request, manifest=manifest)
            if replaced is not None and not isinstance(replaced, dict):
                raise PluginError(f"{self._describe(plugin_name)}: ember_preprocess_request returned a "
                                  f"{type(replaced).__name__}; it must return a request dict or None")
            if replaced is not None:
                request = replaced
        return request

    def postprocess_output(self, output: dict[str, Any], request: dict[str, Any],
                           manifest: Manifest) -> dict[str, Any]:
        """A whole output ({"text", "token_ids", "finish_reason"}) after every post-processing hook."""
        pipeline = self.output_pipeline(request, manifest, stream=False)
        if pipeline is None:
            return output
        text, finish_reason = pipeline.apply(output.get("text", ""), output.get("token_ids", ()),
                                             output.get("finish_reason"))
        return {**output, "text": text, "finish_reason": finish_reason}

    def output_pipeline(self, request: dict[str, Any], manifest: Manifest, *,
                        stream: bool) -> OutputPipeline | None:
        """One choice's post-processing (ember/postprocess.py), or None when no plugin post-processes outputs.

        Per plugin, in call order: for a stream its `ember_postprocess_stream` filter, else its
        `ember_postprocess_output` holding the stream back to the end; for a whole output the other way round (that
        hook sees the token ids too).
        """
        filters = dict(self._impls("ember_postprocess_stream"))
        whole = dict(self._impls("ember_postprocess_output"))
        if not filters and not whole:
            return None
        stages: list[FilterStage | WholeOutputStage] = []
        for name in self._call_order("ember_postprocess_stream", "ember_postprocess_output"):
            label = self._describe(name)
            output_filter = None
            if name in filters and (stream or name not in whole):
                try:
                    output_filter = filters[name](request=request, manifest=manifest)
                except PluginError as e:
                    raise OutputHookError(label, str(e).removeprefix(f"{label}: ")) from e
            if output_filter is not None:
                stages.append(FilterStage(label, output_filter))
            elif name in whole:
                stages.append(WholeOutputStage(label, whole[name], request, manifest))
        return OutputPipeline(stages) if stages else None

    # --- internals ------------------------------------------------------------------------

    def _impls(self, hook_name: str) -> Iterator[tuple[str, Callable[..., Any]]]:
        """Implementations of a hook in pluggy's call order (last registered, tryfirst first).

        The host calls them itself when it needs to know *which* plugin answered (selection)
        or to chain results (pre/post-processing); pluggy's public `get_hookimpls()` gives the
        order. Wrappers are not used on these hooks.
        """
        caller = getattr(self.pm.hook, hook_name)
        for impl in reversed(caller.get_hookimpls()):
            if impl.hookwrapper or getattr(impl, "wrapper", False):
                continue

            def call(_impl: Any = impl, **kwargs: Any) -> Any:
                try:
                    return _impl.function(**{arg: kwargs[arg] for arg in _impl.argnames})
                except PluginError:
                    raise
                except Exception as e:
                    raise PluginError(f"{self._describe(_impl.plugin_name)}: {hook_name} raised "
                                      f"{type(e).__name__}: {e}") from e
            yield impl.plugin_name, call

    def _call_order(self, *hook_names: str) -> list[str]:
        """The plugins implementing any of these hooks, in the order pluggy calls each of them: tryfirst ones, then
        the rest, each group last registered first (so a package's hooks.py leads)."""
        registered = [name for name, _ in self.pm.list_name_plugin()]
        rank: dict[str, int] = {}
        for hook_name in hook_names:
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.hookwrapper or getattr(impl, "wrapper", False):
                    continue
                group = 2 if impl.tryfirst else 0 if impl.trylast else 1
                rank[impl.plugin_name] = max(rank.get(impl.plugin_name, 0), group)
        return sorted(rank, key=lambda name: (-rank[name], -registered.index(name)))

    def _describe(self, plugin_name: str) -> str:
        source = self._origins.get(plugin_name, ("",))[0]
        return "package hooks.py" if source == "package hooks.py" else f"plugin '{plugin_name}'"


def unknown_technique_message(host: PluginHost, kind: str, name: str) -> str:
    available = sorted(host.techniques.of_kind(kind)) + list(KINDS[kind].reserved)
    close = difflib.get_close_matches(name, available, n=1)
    hint = f" — did you mean '{close[0]}'?" if close else ""
    return (f"no installed plugin provides {kind} '{name}' (available: {', '.join(available)}){hint}")


def _manifest_value(manifest: Manifest, dotted_key: str) -> Any:
    value: Any = manifest
    for part in dotted_key.split("."):
        value = getattr(value, part)
    return value


def _composed(kind: str, name: str) -> list[str]:
    """The techniques a selected name stands for: several for composed quantization methods ("smooth+int8")."""
    return name.split(COMPOSE) if kind == "quantization" else [name]


def _given_options(manifest: Manifest, kind: str) -> list[str]:
    """The option keys the manifest gives the technique of `kind` (a speculator's `model` counts as one)."""
    section = _OPTION_SECTIONS.get(kind)
    if section is None:
        return []
    given = sorted(getattr(manifest, section).options)
    if kind == "speculator" and manifest.speculator.model is not None:
        given.append("model")
    return given


def _option_key(kind: str, option: str) -> str:
    """The manifest key an option comes from: `quantization.options.bits`; a speculator's model: `speculator.model`."""
    return "speculator.model" if (kind, option) == ("speculator", "model") else \
        f"{_OPTION_SECTIONS[kind]}.options.{option}"


def _manifest_options(manifest: Manifest, kind: str) -> dict[str, Any]:
    section = {"quantization": manifest.quantization, "speculator": manifest.speculator,
               "attention": manifest.kernels}.get(kind)
    options = dict(getattr(section, "options", {}) or {})
    if kind == "speculator" and manifest.speculator.method != NONE:
        options.setdefault("num_speculative_tokens", manifest.speculator.num_speculative_tokens)
        if manifest.speculator.max_batch_size is not None:  # a ceiling only when set
            options.setdefault("max_batch_size", manifest.speculator.max_batch_size)
    if kind == "parallelism":
        options = {"tensor_parallel": manifest.parallelism.tensor_parallel,
                   "expert_parallel": manifest.parallelism.expert_parallel}
    return options


def _import_file(path: Path, module_name: str) -> ModuleType:
    """Import a package's hooks.py; an error in it is reported with its file and line."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path]
        where = f"{path}:{frames[-1].lineno}" if frames else str(path)
        raise PluginError(f"{where}: {type(e).__name__}: {e}") from e
    return module


class _ManifestChoice:
    """The default selection: the manifest's explicit choice, or a plain fallback for "auto".

    Registered first with trylast, so every plugin and the package's hooks.py are asked before it.
    """

    def __init__(self, host: PluginHost) -> None:
        self._host = host

    @hookimpl(trylast=True)
    def ember_select_quantization(self, manifest: Manifest) -> Selection:
        return _explicit_or(manifest.quantization, "method", "quantization.method", NONE)

    @hookimpl(trylast=True)
    def ember_select_speculator(self, manifest: Manifest) -> Selection:
        return _explicit_or(manifest.speculator, "method", "speculator.method", NONE)

    @hookimpl(trylast=True)
    def ember_select_attention_backend(self, manifest: Manifest) -> Selection | None:
        if manifest.kernels.attention != AUTO:
            return _explicit_or(manifest.kernels, "attention", "kernels.attention", "")
        # No plugin answered "auto": prefer the portable backend, else any installed one.
        installed = self._host.techniques.of_kind("attention")
        if not installed:
            return None
        name = "torch" if "torch" in installed else next(iter(installed))
        return Selection(name, reason=f"auto: no plugin chose, so the installed backend '{name}'")

    @hookimpl(trylast=True)
    def ember_select_parallelism(self, manifest: Manifest) -> Selection:
        p = manifest.parallelism
        if p.strategy != AUTO:
            return _explicit_or(p, "strategy", "parallelism.strategy", "")
        if p.tensor_parallel == 1 and p.expert_parallel == 1:
            return Selection(NONE, reason="auto: tensor_parallel = expert_parallel = 1, one device")
        name = "expert" if p.expert_parallel > 1 else "tensor"
        return Selection(name, reason=f"auto: tensor_parallel = {p.tensor_parallel}, "
                                      f"expert_parallel = {p.expert_parallel}")


def _explicit_or(section: Any, field: str, key: str, fallback: str) -> Selection:
    value = getattr(section, field)
    if value != AUTO:
        where = "in ember.toml" if field in section.model_fields_set else "(the default)"
        return Selection(value, reason=f"{key} = {value!r} {where}")
    return Selection(fallback, reason=f"auto: no plugin chose, so the default '{fallback}'")


def load_package(package_dir: str | Path, *, check_files: bool = True) -> tuple[Manifest, PluginHost]:
    """Load a package's manifest and hooks (not its weights) and check its technique names."""
    manifest = load_manifest(package_dir, check_files=check_files)
    host = PluginHost.for_package(package_dir)
    host.check_manifest(manifest, source=str(Path(package_dir) / "ember.toml"))
    return manifest, host
