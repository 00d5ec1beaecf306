"""The native CPU kernels: built once per machine into a cache, and a clear fallback without a compiler."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import json, torch
from ember_kernels.cpu import native_library_error, paged_attention_available
from ember_kernels.cpu.build import native_library
lib = native_library()
print(json.dumps({"path": getattr(lib, "_name", None), "error": native_library_error(),
                  "available": paged_attention_available(torch.float32)}))
"""


def probe(tmp_path: Path, **env: str) -> dict:
    full_env = {**os.environ, "EMBER_KERNEL_CACHE": str(tmp_path / "cache"), **env}
    out = subprocess.run([sys.executable, "-c", PROBE], env=full_env, capture_output=True, text=True, timeout=180,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_built_once_then_reused_from_the_cache(tmp_path: Path) -> None:
    first = probe(tmp_path)
    assert first["available"] and first["error"] is None
    built = Path(first["path"])
    assert built.is_file() and str(built).startswith(str(tmp_path / "cache"))
    mtime = built.stat().st_mtime_ns
    second = probe(tmp_path)
    assert second["path"] == first["path"] and built.stat().st_mtime_ns == mtime  # not rebuilt
    assert list(built.parent.iterdir()) == [built]  # no temporary files left beside it


def test_disabled_by_environment(tmp_path: Path) -> None:
    result = probe(tmp_path, EMBER_NATIVE_KERNELS="0")
    assert not result["available"] and "EMBER_NATIVE_KERNELS" in result["error"]


def test_a_broken_compiler_falls_back_with_its_reason(tmp_path: Path) -> None:
    result = probe(tmp_path, CC="/bin/false")
    assert not result["available"] and "/bin/false failed" in result["error"]
    assert not list((tmp_path / "cache").rglob("*.so"))
