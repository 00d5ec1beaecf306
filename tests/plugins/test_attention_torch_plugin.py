"""The built-in "torch" attention backend is an ordinary plugin: light to import, lazy to load."""

from __future__ import annotations

import subprocess
import sys

from ember.plugins import PluginHost


def test_plugin_module_does_not_import_torch() -> None:
    code = "import sys, ember_plugins.attention; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_registers_the_torch_backend_lazily() -> None:
    import ember_plugins.attention as plugin

    host = PluginHost(entry_points=False, disabled=())
    host.register(plugin, "attention-torch")
    technique = host.techniques.get("attention", "torch")
    assert technique is not None and technique.plugin == "attention-torch"
    assert isinstance(technique.impl, str)  # a "module:attr" string until an engine asks for it

    from ember_platform.engine.attention import AttentionBackend
    from ember_plugins.attention.torch_paged import TorchPagedAttention

    backend_class = technique.load()
    assert backend_class is TorchPagedAttention
    assert isinstance(backend_class(sliding_window=None), AttentionBackend)
