"""The repository layout must not shadow the standard library or pip's dependencies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_stdlib_platform_and_packaging_importable_from_repo_root() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import platform, packaging.version; print(platform.system())"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "Linux"


def test_source_roots_are_not_packages() -> None:
    for root in ("platform", "packaging", "plugins", "kernels"):
        assert not (REPO_ROOT / root / "__init__.py").exists(), f"{root}/__init__.py would shadow imports"


def test_base_package_imports_without_torch() -> None:
    # A model author's laptop: `ember` and its CLI must not pull in torch.
    code = ("import sys, ember, ember.plugins, ember.package, ember.cli.main; "
            "ember.cli.main.build_parser(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_loading_every_plugin_imports_no_torch() -> None:
    # pluggy imports every entry-point module at start: they must stay light (STYLE.md).
    code = "import sys; from ember.plugins import PluginHost; PluginHost().techniques; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
