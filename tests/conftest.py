"""Fixtures shared by every test tree."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "vocab_size": 32,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


def write_tiny_package(root: Path, name: str = "tiny", version: str = "0.1.0", extra_toml: str = "",
                       seed: int = 0) -> Path:
    """A small but well-formed package: manifest, config.json and one safetensors file.

    Written with numpy so that tests of the torch-free base install need no torch.
    """
    from safetensors.numpy import save_file

    weights = root / "weights"
    weights.mkdir(parents=True, exist_ok=True)
    (weights / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
    rng = np.random.default_rng(seed)
    save_file({"model.embed_tokens.weight": rng.standard_normal((32, 16), dtype=np.float32)},
              str(weights / "model.safetensors"))
    (root / "ember.toml").write_text(f'[model]\nname = "{name}"\nversion = "{version}"\n{extra_toml}')
    return root


@pytest.fixture
def make_package(tmp_path: Path) -> Callable[..., Path]:
    """make_package(name="tiny", version="0.1.0", extra_toml="", subdir=None) -> package dir."""
    counter = iter(range(1_000_000))

    def make(name: str = "tiny", version: str = "0.1.0", extra_toml: str = "", subdir: str | None = None,
             seed: int = 0) -> Path:
        root = tmp_path / (subdir or f"pkg{next(counter)}")
        return write_tiny_package(root, name, version, extra_toml, seed)

    return make


# --- plugin distributions ------------------------------------------------------------------

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def readme_plugin_sources() -> dict[str, str]:
    """The files of the plugin in README.md's "Write a plugin" section, by their `# file:` line."""
    import re

    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Write a plugin", 1)[1].split("\n## ", 1)[0]
    files = {}
    for block in re.findall(r"```(?:toml|python)\n(.*?)```", section, flags=re.S):
        first, _, rest = block.partition("\n")
        if first.startswith("# file: "):
            files[first.removeprefix("# file: ").strip()] = rest
    return files


def pip_install_target(source: Path, target: Path) -> None:
    """Install a distribution for real (build backend, dist-info, entry points) into `target`."""
    import subprocess
    import sys

    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(source)],
        check=True, capture_output=True, text=True,
    )


@pytest.fixture(scope="session")
def plugin_dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Site directories, each holding one installed test plugin distribution.

    "redact" is built from README.md's plugin source, so the README's example is what is tested.
    """
    root = tmp_path_factory.mktemp("plugin-dists")
    readme_src = root / "src" / "ember-redact"
    readme_src.mkdir(parents=True)
    for name, text in readme_plugin_sources().items():
        (readme_src / name).write_text(text)
    sources = {"redact": readme_src, "techniques": FIXTURES / "ember-test-techniques",
               "broken": FIXTURES / "ember-broken-plugin"}
    sites = {}
    for key, source in sources.items():
        sites[key] = root / f"site-{key}"
        pip_install_target(source, sites[key])
    return sites


@pytest.fixture
def use_plugins(plugin_dists: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """use_plugins("redact", "techniques"): make those distributions importable and discoverable."""
    monkeypatch.delenv("EMBER_DISABLE_PLUGINS", raising=False)

    def use(*keys: str) -> None:
        for key in keys:
            monkeypatch.syspath_prepend(str(plugin_dists[key]))

    return use
