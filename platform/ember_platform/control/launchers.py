"""The launcher the control plane runs replicas with: built from the plugin that registered it (`ember_launchers`)."""

from __future__ import annotations

import dataclasses

from ember.errors import EmberError, PluginError
from ember.launch import Launcher, LaunchSettings
from ember.plugins import PluginHost

DEFAULT_LAUNCHER = "local"
LAUNCHER_ENV = "EMBER_LAUNCHER"  # `ember serve --launcher`'s default when set


def installed_launchers(host: PluginHost | None = None) -> list[str]:
    return sorted((host or PluginHost()).techniques.of_kind("launcher"))


def build_launcher(name: str, settings: LaunchSettings, host: PluginHost | None = None) -> Launcher:
    """The launcher `name` from the installed plugins, built with `settings`; an unknown name is refused, naming the
    installed ones. `settings.launcher(other)` lets it build another one (a wrapper), with no options."""
    host = host or PluginHost()
    technique = host.techniques.get("launcher", name)
    if technique is None:
        installed = ", ".join(installed_launchers(host)) or "none"
        raise EmberError(f"unknown launcher {name!r} (installed: {installed}); choose one of those with --launcher, "
                         "or install the plugin that provides it")
    factory = technique.load()
    settings = dataclasses.replace(
        settings, launcher=lambda other: build_launcher(other, dataclasses.replace(settings, options={}), host))
    launcher = factory(settings)
    if not isinstance(launcher, Launcher):
        raise PluginError(f"plugin '{technique.plugin}': launcher {name!r} built a {type(launcher).__name__}, not an "
                          "ember.launch.Launcher")
    return launcher
