"""Launchers: where replicas run. "local" runs each as a child process on this machine."""

from ember import hookimpl


@hookimpl
def ember_launchers(register) -> None:
    register("local", "ember_plugins.launchers.local:build",
             summary="each replica is a child process on this machine (`python -m ember_platform.replica`)")
